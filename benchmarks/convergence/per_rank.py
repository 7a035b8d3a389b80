"""``train_titan.py`` with extra command-line arguments for this rank only.

torchrun gives every rank the same arguments. The heterogeneous control arm runs ``ddp`` with a
different number of micro-batches per rank and round (e.g. 8 on the fast rank, 2 on the slow
one: the mix ``accumulate_until_ready`` produced), which the engine accepts: each rank ends its
round after its own ``accumulation_steps`` and the averaged gradient weighs every micro-batch
by its tokens. This launcher appends ``ACCO_BENCH_RANK_ARGS[RANK]`` (a JSON object of argument
lists keyed by global rank) to the arguments and runs ``train_titan.py`` as ``__main__``::

    ACCO_BENCH_RANK_ARGS='{"0": ["--acco.accumulation_steps", "8"],
                           "1": ["--acco.accumulation_steps", "2"]}' \\
    torchrun --standalone --nproc_per_node 2 benchmarks/convergence/per_rank.py \\
        --job.config_file torchtitan_configs/debug_cpu_ddp.toml
"""

from __future__ import annotations

import json
import os
import pathlib
import runpy
import sys

RANK_ARGS_ENV = "ACCO_BENCH_RANK_ARGS"
TRAIN_TITAN = pathlib.Path(__file__).resolve().parents[2] / "train_titan.py"


def main() -> None:
    extra = json.loads(os.environ.get(RANK_ARGS_ENV) or "{}").get(os.environ.get("RANK", "0"), [])
    sys.argv = [str(TRAIN_TITAN), *sys.argv[1:], *extra]
    sys.path.insert(0, str(TRAIN_TITAN.parent))
    runpy.run_path(str(TRAIN_TITAN), run_name="__main__")


if __name__ == "__main__":
    main()
