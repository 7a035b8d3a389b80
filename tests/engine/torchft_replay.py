"""The reference of a torchft job with ``--until-ready``: ``examples.torchft_train`` as one
world of every rank, without torchft, each rank running in each round the micro-batches that
its rank ran in the recorded job.

    python -m tests.engine.torchft_replay --replay-counts FILE <the example's arguments>

FILE holds, per data-parallel rank of the job (group i's rank r is ``i * group_size + r``), the
micro-batches it ran in each round (the example's ``round_ends``). The engine's "is the round's
communication still in flight?" is answered from it instead of from the network.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist

from acco_hooks.engine import ACCOEngine
from acco_hooks.engine.communication import EngineGroups
from examples import torchft_train

_engines: list[ACCOEngine] = []
_build_engine = ACCOEngine.__init__


def _build_and_keep(engine: ACCOEngine, *args: Any, **kwargs: Any) -> None:
    _build_engine(engine, *args, **kwargs)
    _engines.append(engine)


def main() -> None:
    at = sys.argv.index("--replay-counts")
    with open(sys.argv[at + 1]) as file:
        counts = json.load(file)
    del sys.argv[at:at + 2]

    def as_recorded(groups: EngineGroups, in_flight: bool, device: torch.device) -> bool:
        (engine,) = _engines
        return engine.microbatches_in_round < counts[dist.get_rank()][engine.round_index]

    ACCOEngine.__init__ = _build_and_keep
    EngineGroups.replica_waits = as_recorded
    torchft_train.main()


if __name__ == "__main__":
    main()
