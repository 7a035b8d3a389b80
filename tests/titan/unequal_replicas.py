"""Imported into a torchtitan run by a test (``--experimental.custom_import``): replicas of
unequal speed, however each replica is split over ranks, and the replay of such a run.

* Every rank of the job's second model replica sleeps ``SLOW_S`` (``ACCO_TEST_SLOW_S``) after
  each micro-batch's forward and backward: the replica computes slower, whatever FSDP, tensor
  or pipeline parallelism split it into. The job's replicas: the ``dp_replicate`` coordinates, of each
  torchft replica group in turn under ``[fault_tolerance]`` (whose tests' hooks,
  ``tests/titan/torchft_hooks.py``, are then imported too).
* Each rank records how many micro-batches each step (one ACCO round) ran, and prints them when
  the run closes: ``unequal replicas: rank R replica I counts [...]``.
* Replay (``ACCO_TEST_REPLAY`` = ``{"counts": [[...] per step] per replica, "ranks_per_replica":
  k}``): nobody sleeps, and replica r of the replaying run runs, in each round, the
  micro-batches that replica ``r // k`` of the recorded run ran: the engine's "is the round's
  communication still in flight on this replica" is answered from the record instead of from
  the network. The same micro-batches then meet the same updates: in plain data parallelism
  (one rank per data-parallel rank, k = the ranks FSDP split a recorded replica into), or in
  the recorded layout (k = 1) resumed from one of its checkpoints.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from acco_hooks.engine.communication import EngineGroups
from acco_hooks.titan.base import ACCOTrainerBase
from tests.titan import small_model  # noqa: F401  (the tests' model: a job has one custom_import)

SLOW_S = float(os.environ.get("ACCO_TEST_SLOW_S", "0.25"))
REPLAY_ENV = "ACCO_TEST_REPLAY"

_forward_backward_step = ACCOTrainerBase.forward_backward_step
_train_step = ACCOTrainerBase.train_step
_close = ACCOTrainerBase.close
_counts: list[int] = []
_engine: list[Any] = []  # the run's engine and this rank's replica, once its first step starts
_replay = json.loads(os.environ[REPLAY_ENV]) if os.environ.get(REPLAY_ENV) else None


def _replica(trainer: ACCOTrainerBase) -> int:
    """This rank's replica of the job: of its torchft replica group's, the group's first."""
    dims = trainer.parallel_dims
    ft = getattr(trainer.titan_config, "fault_tolerance", None)
    first = ft.replica_id * dims.dp_replicate if ft is not None and ft.enable else 0
    if not dims.dp_replicate_enabled:
        return first
    return first + dims.get_mesh("dp_replicate").get_local_rank()


def _slower_on_the_second_replica(trainer: ACCOTrainerBase, *args: Any, **kwargs: Any) -> Any:
    loss = _forward_backward_step(trainer, *args, **kwargs)
    if _replay is None and _replica(trainer) == 1:
        time.sleep(SLOW_S)
    return loss


def _counted_step(trainer: ACCOTrainerBase, *args: Any, **kwargs: Any) -> None:
    _engine[:] = [trainer.optimizers.engine, _replica(trainer)]
    _train_step(trainer, *args, **kwargs)
    _counts.append(trainer.optimizers.engine.last_round_microbatches)


def _report_then_close(trainer: ACCOTrainerBase, **kwargs: Any) -> None:
    print(f"unequal replicas: rank {dist.get_rank()} replica {_replica(trainer)} counts "
          f"{_counts}", flush=True)  # fmt: skip
    _close(trainer, **kwargs)


def _as_recorded(groups: EngineGroups, in_flight: bool, device: torch.device) -> bool:
    engine, replica = _engine
    recorded = _replay["counts"][replica // _replay["ranks_per_replica"]]
    return engine.microbatches_in_round < recorded[engine.round_index]


ACCOTrainerBase.forward_backward_step = _slower_on_the_second_replica
ACCOTrainerBase.train_step = _counted_step
ACCOTrainerBase.close = _report_then_close
if _replay is not None:
    EngineGroups.replica_waits = _as_recorded
if os.environ.get("ACCO_TEST_FT_OUT"):  # a job of torchft replica groups, or its reference
    import tests.titan.torchft_hooks  # noqa: F401
