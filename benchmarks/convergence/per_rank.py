"""``train_titan.py`` with extra command-line arguments for this rank only.

torchrun gives every rank the same arguments; the heterogeneous control arm ``ddp_matched``
(``docs/results.md`` section 5) runs ``ddp`` with each rank's own ``accumulation_steps`` (8 on
the fast rank, 2 on the slow one), which the engine accepts: the averaged gradient weighs every
micro-batch by its tokens. ``run.py`` launches this file in place of ``train_titan.py`` with
``ACCO_BENCH_RANK_ARGS='{"0": ["--acco.accumulation_steps", "8"], "1": [...]}'`` (argument lists
by global rank); it appends this rank's to the arguments and runs ``train_titan.py`` as
``__main__``.
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
