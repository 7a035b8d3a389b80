"""Slow one rank of a torchtitan run down, and log every micro-batch of every rank.

What it does: monkeypatches torchtitan's ``Trainer.forward_backward_step`` (which
``ACCOTrainer`` inherits and calls once per micro-batch) so that

* on the slow global rank (``ACCO_BENCH_SLOW_RANK``, default 1) each micro-batch first sleeps
  ``ACCO_BENCH_SLOW_S`` seconds (default 0: nobody is slowed): a simulated slower device;
* on every rank, when ``ACCO_BENCH_STATS_DIR`` is set, each micro-batch appends one JSON line
  to ``<dir>/microbatches_rank<R>.jsonl``::

      {"step": S, "tokens": T, "valid": V, "loss_sum": L, "t": UNIX_TIME}

  ``T`` = ``labels.numel()`` (as torchtitan counts ``ntokens_seen``), ``V`` the tokens that
  count in the loss, ``L`` the micro-batch's token-summed loss (the returned loss times the
  ``global_valid_tokens`` it was divided by; ``null`` where there is no loss, e.g. a PP stage
  without the last layer or a TP DTensor loss), ``t`` when its backward ended. Summing ``L`` and
  ``V`` over the ranks of a step gives the step's global average loss without any collective,
  so a run can log rarely (``--metrics.log_freq``): torchtitan's per-step logging all-reduces
  the loss, which puts every rank back in step at every logged step. The file is line
  buffered: a killed run keeps what it did.

Reproduce (what ``python -m benchmarks.convergence.run --heterogeneous`` launches)::

    ACCO_BENCH_SLOW_S=0.3 ACCO_BENCH_STATS_DIR=/tmp/stats OMP_NUM_THREADS=1 \\
    torchrun --standalone --nproc_per_node 2 train_titan.py \\
        --job.config_file torchtitan_configs/debug_cpu_acco.toml --acco.accumulate_until_ready \\
        --metrics.log_freq 600 --training.steps 600 \\
        --experimental.custom_import benchmarks.convergence.slow_rank

Assumptions: torchtitan imports ``--experimental.custom_import`` inside ``Trainer.__init__`` of
every rank (torchtitan 0.2.2), before the first training step; the training loop calls
``self.forward_backward_step(input_dict=..., labels=..., global_valid_tokens=...)`` once per
micro-batch and ``self.step`` is the current step (one ACCO round for ``ACCOTrainer``). The
global rank is read from the ``RANK`` variable torchrun sets.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import time
from typing import Any, Callable, TextIO

import torch
from torch.distributed.tensor import DTensor
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.train import Trainer

__all__ = ["SLOW_S_ENV", "SLOW_RANK_ENV", "STATS_DIR_ENV", "install", "stats_path"]

SLOW_S_ENV = "ACCO_BENCH_SLOW_S"
SLOW_RANK_ENV = "ACCO_BENCH_SLOW_RANK"
STATS_DIR_ENV = "ACCO_BENCH_STATS_DIR"
_PATCHED = "_acco_bench_slow_rank_patched"


def stats_path(stats_dir: str | os.PathLike, rank: int) -> pathlib.Path:
    """The micro-batch log of ``rank`` under ``stats_dir``."""
    return pathlib.Path(stats_dir) / f"microbatches_rank{rank}.jsonl"


def _open_stats(rank: int) -> TextIO | None:
    stats_dir = os.environ.get(STATS_DIR_ENV)
    if not stats_dir:
        return None
    os.makedirs(stats_dir, exist_ok=True)
    return open(stats_path(stats_dir, rank), "a", buffering=1, encoding="utf-8")


def _loss_sum(loss: Any, scale: Any) -> float | None:
    """The token-summed loss of a micro-batch, or None where this rank has none."""
    if not isinstance(loss, torch.Tensor) or isinstance(loss, DTensor):
        return None  # a DTensor loss would need a collective to read
    value = float(loss.detach().float().sum())
    if value < 0:  # torchtitan's -1 on pipeline stages without the loss
        return None
    return value * (float(scale) if scale is not None else 1.0)


def _row(trainer: Trainer, loss: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """One micro-batch: its step, tokens, valid tokens and token-summed loss, and the time."""
    labels = kwargs["labels"]
    return {
        "step": int(trainer.step),
        "tokens": int(labels.numel()),
        "valid": int((labels != IGNORE_INDEX).sum()),
        "loss_sum": _loss_sum(loss, kwargs.get("global_valid_tokens")),
        "t": time.time(),
    }


def _wrap(original: Callable[..., Any], sleep_s: float, stats: TextIO | None) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward_backward_step(self: Trainer, **kwargs: Any) -> Any:
        if sleep_s > 0:
            time.sleep(sleep_s)
        loss = original(self, **kwargs)
        if stats is not None:
            stats.write(json.dumps(_row(self, loss, kwargs)) + "\n")
        return loss

    setattr(forward_backward_step, _PATCHED, True)
    return forward_backward_step


def install() -> None:
    """Patch ``Trainer.forward_backward_step`` (and an ACCOTrainer override) once per process."""
    rank = int(os.environ.get("RANK", "0"))
    slow_rank = int(os.environ.get(SLOW_RANK_ENV, "1"))
    sleep_s = float(os.environ.get(SLOW_S_ENV, "0") or 0) if rank == slow_rank else 0.0
    stats = _open_stats(rank)
    classes: list[type] = [Trainer]
    try:
        from acco_hooks.titan.trainer import ACCOTrainer

        if "forward_backward_step" in vars(ACCOTrainer):  # only if it overrides the method
            classes.append(ACCOTrainer)
    except ImportError:  # pragma: no cover - plain torchtitan
        pass
    for cls in classes:
        method = vars(cls)["forward_backward_step"]
        if not getattr(method, _PATCHED, False):
            cls.forward_backward_step = _wrap(method, sleep_s, stats)


install()
