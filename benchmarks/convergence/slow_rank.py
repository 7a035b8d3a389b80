"""Benchmark hooks for torchtitan runs: a slow rank, per-micro-batch logs, a fixed held-out set.

What it does, once per process, when torchtitan imports it (``--experimental.custom_import``):

* Slow rank: torchtitan's ``Trainer.forward_backward_step`` (which ``ACCOTrainer`` inherits and
  calls once per micro-batch) is wrapped so that on the slow global rank
  (``ACCO_BENCH_SLOW_RANK``, default 1) each micro-batch takes ``ACCO_BENCH_SLOW_FACTOR`` times
  its own compute (default 1: nobody is slowed), a simulated device ``factor`` times slower:
  the rank times each forward+backward and then sleeps ``(factor - 1)`` x its fastest one so
  far. The fastest, not the current one: on a CPU testbed the compute of a micro-batch that
  runs while the rank's own communication thread (and the other rank) use the cores is
  slower, and multiplying that contention by ``factor - 1`` made the slow rank ~9x, not 4x,
  slower than the fast one in acco rounds (measured: 0.17 s vs 0.08 s of compute at
  seq_len 64). Validation runs the model directly, not ``forward_backward_step``, so it is
  never slowed.
* Micro-batch log: on every rank, when ``ACCO_BENCH_STATS_DIR`` is set, each micro-batch
  appends one JSON line to ``<dir>/microbatches_rank<R>.jsonl``::

      {"step": S, "tokens": T, "valid": V, "loss_sum": L, "compute_s": C, "sleep_s": Z,
       "t": UNIX_TIME}

  ``T`` = ``labels.numel()`` (as torchtitan counts ``ntokens_seen``), ``V`` the tokens that
  count in the loss, ``L`` the micro-batch's token-summed loss (the returned loss times the
  ``global_valid_tokens`` it was divided by; ``null`` where there is no loss, e.g. a PP stage
  without the last layer or a TP DTensor loss), ``C`` the measured forward+backward seconds,
  ``Z`` the slow-down slept after it, ``t`` when the micro-batch ended (after the sleep). Summing
  ``L`` and ``V`` over the ranks of a step gives the step's global average loss without any
  collective, so a run can log rarely (``--metrics.log_freq``): torchtitan's per-step logging
  all-reduces the loss, which puts every rank back in step at every logged step. The file is
  line buffered: a killed run keeps what it did.
* Fixed held-out set: torchtitan's ``Validator.validate`` reads its data loader on from where
  the previous validation stopped, so each validation would score different text and the
  held-out curve would mix model progress with text difficulty. Here every validation rewinds
  the validation dataset to the state it had at the first one: all validations of a run (and
  of every run with the same data, batch, seq_len and ranks) score the same
  ``validation.steps`` batches, and a held-out curve can be compared point by point and
  interpolated.

Reproduce (what ``python -m benchmarks.convergence.run --heterogeneous`` launches, abridged)::

    ACCO_BENCH_SLOW_FACTOR=4 ACCO_BENCH_STATS_DIR=/tmp/stats OMP_NUM_THREADS=1 \\
    torchrun --standalone --nproc_per_node 2 train_titan.py \\
        --job.config_file torchtitan_configs/debug_cpu_acco.toml --acco.accumulate_until_ready \\
        --metrics.log_freq 600 --training.steps 600 \\
        --validation.enable --validation.dataset stdlib_validation --validation.freq 50 \\
        --validation.steps 8 --validation.local_batch_size 4 --validation.seq_len 128 \\
        --experimental.custom_import benchmarks.convergence.slow_rank

Assumptions: torchtitan imports ``--experimental.custom_import`` inside ``Trainer.__init__`` of
every rank (torchtitan 0.2.2), before it builds the validator and before the first training
step; the training loop calls ``self.forward_backward_step(input_dict=..., labels=...,
global_valid_tokens=...)`` once per micro-batch and ``self.step`` is the current step (one
ACCO round for ``ACCOTrainer``); the validator's ``validation_dataloader.dataset`` has
``state_dict()``/``load_state_dict()`` (torchtitan's ``HuggingFaceTextDataset``). The global
rank is read from the ``RANK`` variable torchrun sets.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import pathlib
import time
from typing import Any, Callable, TextIO

import torch
from torch.distributed.tensor import DTensor
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.validate import Validator
from torchtitan.train import Trainer

__all__ = ["SLOW_FACTOR_ENV", "SLOW_RANK_ENV", "STATS_DIR_ENV", "install", "stats_path"]

SLOW_FACTOR_ENV = "ACCO_BENCH_SLOW_FACTOR"
SLOW_RANK_ENV = "ACCO_BENCH_SLOW_RANK"
STATS_DIR_ENV = "ACCO_BENCH_STATS_DIR"
_PATCHED = "_acco_bench_slow_rank_patched"
_HELDOUT_START = "_acco_bench_heldout_start"


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


def _row(trainer: Trainer, loss: Any, kwargs: dict[str, Any], compute_s: float,
         sleep_s: float) -> dict[str, Any]:  # fmt: skip
    """One micro-batch: step, tokens, valid tokens, token-summed loss, compute, sleep, end time."""
    labels = kwargs["labels"]
    return {
        "step": int(trainer.step),
        "tokens": int(labels.numel()),
        "valid": int((labels != IGNORE_INDEX).sum()),
        "loss_sum": _loss_sum(loss, kwargs.get("global_valid_tokens")),
        "compute_s": round(compute_s, 6),
        "sleep_s": round(sleep_s, 6),
        "t": time.time(),
    }


def _wrap(original: Callable[..., Any], slow_factor: float, stats: TextIO | None
          ) -> Callable[..., Any]:  # fmt: skip
    fastest_s = math.inf  # this rank's fastest forward+backward so far: its unloaded compute

    @functools.wraps(original)
    def forward_backward_step(self: Trainer, **kwargs: Any) -> Any:
        nonlocal fastest_s
        start = time.perf_counter()
        loss = original(self, **kwargs)
        compute_s = time.perf_counter() - start
        fastest_s = min(fastest_s, compute_s)
        sleep_s = (slow_factor - 1) * fastest_s if slow_factor > 1 else 0.0
        if sleep_s > 0:
            time.sleep(sleep_s)
        if stats is not None:
            stats.write(json.dumps(_row(self, loss, kwargs, compute_s, sleep_s)) + "\n")
        return loss

    setattr(forward_backward_step, _PATCHED, True)
    return forward_backward_step


def _rewind_before_each(validate: Callable[..., Any]) -> Callable[..., Any]:
    """``validate`` on the same held-out batches every time (see the module docstring)."""

    @functools.wraps(validate)
    def validate_on_fixed_batches(self: Validator, *args: Any, **kwargs: Any) -> Any:
        dataset = self.validation_dataloader.dataset
        start = getattr(self, _HELDOUT_START, None)
        if start is None:  # deep copies: the dataset extends its token buffer in place
            setattr(self, _HELDOUT_START, copy.deepcopy(dataset.state_dict()))
        else:
            dataset.load_state_dict(copy.deepcopy(start))
        return validate(self, *args, **kwargs)

    setattr(validate_on_fixed_batches, _PATCHED, True)
    return validate_on_fixed_batches


def install() -> None:
    """Patch ``forward_backward_step`` (and an ACCOTrainer override) and ``Validator.validate``."""
    rank = int(os.environ.get("RANK", "0"))
    slow_rank = int(os.environ.get(SLOW_RANK_ENV, "1"))
    slow_factor = float(os.environ.get(SLOW_FACTOR_ENV, "1") or 1) if rank == slow_rank else 1.0
    if slow_factor < 1:
        raise ValueError(f"{SLOW_FACTOR_ENV}={slow_factor} must be >= 1")
    if not getattr(Validator.validate, _PATCHED, False):
        Validator.validate = _rewind_before_each(Validator.validate)
    stats = _open_stats(rank)
    if slow_factor == 1 and stats is None:
        return  # nothing to time or log: the training step stays torchtitan's own
    classes: list[type] = [Trainer]
    try:
        from acco_hooks.titan.base import ACCOTrainerBase as ACCOTrainer

        if "forward_backward_step" in vars(ACCOTrainer):  # only if it overrides the method
            classes.append(ACCOTrainer)
    except ImportError:  # pragma: no cover - plain torchtitan
        pass
    for cls in classes:
        method = vars(cls)["forward_backward_step"]
        if not getattr(method, _PATCHED, False):
            cls.forward_backward_step = _wrap(method, slow_factor, stats)


install()
