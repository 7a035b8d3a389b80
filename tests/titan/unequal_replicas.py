"""Imported into a torchtitan run by a test (``--experimental.custom_import``): replicas of
unequal speed, however each replica is split over ranks.

* Every rank of the second model replica (``dp_replicate`` coordinate 1) sleeps ``SLOW_S``
  after each micro-batch's forward and backward: the replica computes slower, whatever FSDP,
  tensor or pipeline parallelism split it into.
* Each rank records how many micro-batches each step (one ACCO round) ran, and prints them when
  the run closes: ``unequal replicas: rank R replica I counts [...]``.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from acco_hooks.titan.base import ACCOTrainerBase

SLOW_S = 0.25

_forward_backward_step = ACCOTrainerBase.forward_backward_step
_train_step = ACCOTrainerBase.train_step
_close = ACCOTrainerBase.close
_counts: list[int] = []


def _replica(trainer: ACCOTrainerBase) -> int:
    return trainer.parallel_dims.get_mesh("dp_replicate").get_local_rank()


def _slower_on_the_second_replica(trainer: ACCOTrainerBase, *args: Any, **kwargs: Any) -> Any:
    loss = _forward_backward_step(trainer, *args, **kwargs)
    if _replica(trainer) == 1:
        time.sleep(SLOW_S)
    return loss


def _counted_step(trainer: ACCOTrainerBase, *args: Any, **kwargs: Any) -> None:
    _train_step(trainer, *args, **kwargs)
    _counts.append(trainer.optimizers.engine.last_round_microbatches)


def _report_then_close(trainer: ACCOTrainerBase, **kwargs: Any) -> None:
    print(f"unequal replicas: rank {dist.get_rank()} replica {_replica(trainer)} counts "
          f"{_counts}", flush=True)  # fmt: skip
    _close(trainer, **kwargs)


ACCOTrainerBase.forward_backward_step = _slower_on_the_second_replica
ACCOTrainerBase.train_step = _counted_step
ACCOTrainerBase.close = _report_then_close
