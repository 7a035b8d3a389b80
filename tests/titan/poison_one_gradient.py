"""Imported into a torchtitan run by a test (``--experimental.custom_import``): on global rank 0
every gradient of round 2 becomes +inf, and each rank prints, when it closes, how many updates
its engine applied and how many rounds it skipped."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from acco_hooks.engine import ACCOEngine
from acco_hooks.titan.base import ACCOTrainerBase
from tests.titan import small_model  # noqa: F401  (the tests' model: a job has one custom_import)

POISONED_ROUND = 2

_accumulate_grad = ACCOEngine.accumulate_grad
_close = ACCOTrainerBase.close


def _poisoned(engine: ACCOEngine, param: Any, grad: Any) -> None:
    if dist.get_rank() == 0 and engine.round_index == POISONED_ROUND:
        grad = grad.clone().fill_(float("inf"))
    _accumulate_grad(engine, param, grad)


def _report_then_close(trainer: ACCOTrainerBase, **kwargs: Any) -> None:
    engine = trainer.optimizers.engine
    if not engine.closed:
        engine.flush()
        print(f"poisoned run: rank {dist.get_rank()} updates {engine.num_updates} "
              f"skipped {engine.skipped_rounds}", flush=True)  # fmt: skip
    _close(trainer, **kwargs)


ACCOEngine.accumulate_grad = _poisoned
ACCOTrainerBase.close = _report_then_close
