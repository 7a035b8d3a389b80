"""Benchmark hooks for torchtitan runs: a slow rank, per-micro-batch logs, a fixed held-out set,
wider debug models.

``benchmarks/convergence/run.py`` makes every rank import it (``--experimental.custom_import``);
``docs/results.md`` section 5 uses the first three, ``gap_map.py``'s width point the last:

* Slow rank: on global rank ``ACCO_BENCH_SLOW_RANK`` (default 1) each micro-batch of
  ``Trainer.forward_backward_step`` (which ``ACCOTrainer`` inherits) takes
  ``ACCO_BENCH_SLOW_FACTOR`` times its compute (default 1: nobody is slowed): the rank sleeps
  ``factor - 1`` times its fastest forward+backward so far. The fastest, not the current one:
  on a CPU testbed a micro-batch that shares the cores with the communication thread (and the
  other rank) is slower, and multiplying that contention made the slow rank ~9x, not 4x, slower
  in acco rounds (0.17 s vs 0.08 s of compute at seq_len 64). Validation is never slowed.
  ``ACCO_BENCH_SLOW_STEPS=first:end`` slows only the torchtitan steps ``first`` to ``end - 1``
  (a straggler that recovers); unset, every step.
* Micro-batch log: with ``ACCO_BENCH_STATS_DIR`` set, each micro-batch of every rank appends
  ``{"step", "tokens", "valid", "loss_sum", "compute_s", "sleep_s", "t"}`` to
  ``<dir>/microbatches_rank<R>.jsonl`` (line buffered: a killed run keeps what it did).
  ``tokens`` = ``labels.numel()`` (torchtitan's ``ntokens_seen``), ``valid`` the tokens in the
  loss, ``loss_sum`` the token-summed loss (``null`` without a plain loss: a PP stage without
  the last layer, a TP DTensor), ``t`` the end time, after the sleep. Summing ``loss_sum`` and
  ``valid`` over the ranks gives each step's global loss without a collective, so a run can
  log rarely: torchtitan's logged steps all-reduce the loss, which puts the ranks back in step.
* Fixed held-out set: torchtitan's ``Validator.validate`` reads on from where the previous
  validation stopped, which would mix model progress with text difficulty. Here every
  validation rewinds the validation dataset to its state at the first one: every validation
  of a run (and of every run with the same data, batch, seq_len and ranks) scores the same
  batches. ``ACCO_BENCH_HELDOUT_RANKS=n``: every run scores the held-out batches of n
  data-parallel ranks, whatever its own number: torchtitan gives each rank a contiguous block
  of the set, so 4 ranks would score other batches than 2. Rank r of W reads block
  ``r * n // W`` of n: with 4 ranks (two replicas of two FSDP ranks) ranks 0 and 1 score the
  batches of the first of 2 and ranks 2 and 3 those of the second; the mean is the 2-rank
  run's.
* Wider models: the llama3 flavors ``debugmodel_w<dim>`` (:data:`WIDE_FLAVORS`) are the debug
  model (6 layers, 16 heads, vocabulary 2048) at another width; ``--model.flavor`` names them.

Assumptions (torchtitan 0.2.2): ``Trainer.__init__`` imports the module on every rank before it
builds the validator; the loop calls ``self.forward_backward_step(input_dict=..., labels=...,
global_valid_tokens=...)`` once per micro-batch, with ``self.step`` the current step (an ACCO
round); the validation dataset has ``state_dict()``/``load_state_dict()``; the train spec looks its
flavor up in ``torchtitan.models.llama3.llama3_args`` after the import. The global rank is
torchrun's ``RANK``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import os
import pathlib
import time
from collections.abc import Callable
from typing import Any, TextIO

import torch
from torch.distributed.tensor import DTensor
from torchtitan.components import validate as validate_module
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.validate import Validator
from torchtitan.train import Trainer

__all__ = ["HELDOUT_RANKS_ENV", "SLOW_FACTOR_ENV", "SLOW_RANK_ENV", "SLOW_STEPS_ENV",
           "STATS_DIR_ENV", "install"]

SLOW_FACTOR_ENV = "ACCO_BENCH_SLOW_FACTOR"
SLOW_RANK_ENV = "ACCO_BENCH_SLOW_RANK"
SLOW_STEPS_ENV = "ACCO_BENCH_SLOW_STEPS"
HELDOUT_RANKS_ENV = "ACCO_BENCH_HELDOUT_RANKS"
STATS_DIR_ENV = "ACCO_BENCH_STATS_DIR"
# the debug model at these widths (non-embedding parameters: 5.6M at its own 256; 21.5M, 44M,
# 79M at these)
WIDE_FLAVORS = {f"debugmodel_w{dim}": dim for dim in (512, 768, 1024)}
_PATCHED = "_acco_bench_slow_rank_patched"
_HELDOUT_START = "_acco_bench_heldout_start"


def _open_stats(rank: int) -> TextIO | None:
    """This rank's micro-batch log (run.py reads it), or None without ``ACCO_BENCH_STATS_DIR``."""
    stats_dir = os.environ.get(STATS_DIR_ENV)
    if not stats_dir:
        return None
    os.makedirs(stats_dir, exist_ok=True)
    path = pathlib.Path(stats_dir) / f"microbatches_rank{rank}.jsonl"
    return open(path, "a", buffering=1, encoding="utf-8")


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


def _wrap(original: Callable[..., Any], slow_factor: float, slow_steps: range | None,
          stats: TextIO | None) -> Callable[..., Any]:  # fmt: skip
    fastest_s = math.inf  # this rank's fastest forward+backward so far: its unloaded compute

    @functools.wraps(original)
    def forward_backward_step(self: Trainer, **kwargs: Any) -> Any:
        nonlocal fastest_s
        start = time.perf_counter()
        loss = original(self, **kwargs)
        compute_s = time.perf_counter() - start
        fastest_s = min(fastest_s, compute_s)
        slowed = slow_factor > 1 and (slow_steps is None or int(self.step) in slow_steps)
        sleep_s = (slow_factor - 1) * fastest_s if slowed else 0.0
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


def _as_if_on(ranks: int, build: Callable[..., Any]) -> Callable[..., Any]:
    """``build_text_validation_dataloader`` that reads the block of the set that rank
    ``dp_rank * ranks // dp_world_size`` of ``ranks`` would (see the module docstring)."""

    @functools.wraps(build)
    def build_as_if_on(*args: Any, dp_world_size: int, dp_rank: int, **kwargs: Any) -> Any:
        if dp_world_size % ranks:
            raise ValueError(f"{HELDOUT_RANKS_ENV}={ranks} must divide the {dp_world_size} "
                             "data-parallel ranks")  # fmt: skip
        return build(*args, dp_world_size=ranks, dp_rank=dp_rank * ranks // dp_world_size,
                     **kwargs)  # fmt: skip

    setattr(build_as_if_on, _PATCHED, True)
    return build_as_if_on


def _register_wide_flavors() -> None:
    try:
        from torchtitan.models import llama3
    except ImportError:  # pragma: no cover - a torchtitan without the llama3 package
        return
    flavors = getattr(llama3, "llama3_args", None)  # 0.2.2's registry; 0.3.0 builds models apart
    if flavors is None:
        return
    for name, dim in WIDE_FLAVORS.items():
        flavors.setdefault(name, dataclasses.replace(flavors["debugmodel"], dim=dim))


def install() -> None:
    """Patch ``forward_backward_step`` (and an ACCOTrainer override) and ``Validator.validate``;
    register :data:`WIDE_FLAVORS`."""
    _register_wide_flavors()
    rank = int(os.environ.get("RANK", "0"))
    slow_rank = int(os.environ.get(SLOW_RANK_ENV, "1"))
    slow_factor = float(os.environ.get(SLOW_FACTOR_ENV, "1") or 1) if rank == slow_rank else 1.0
    if slow_factor < 1:
        raise ValueError(f"{SLOW_FACTOR_ENV}={slow_factor} must be >= 1")
    slow_steps = None
    if window := os.environ.get(SLOW_STEPS_ENV):
        first, _, end = window.partition(":")
        slow_steps = range(int(first), int(end))
    if not getattr(Validator.validate, _PATCHED, False):
        Validator.validate = _rewind_before_each(Validator.validate)
    if ranks := os.environ.get(HELDOUT_RANKS_ENV):
        # looked up only when asked for: importing this module's names (benchmarks/diloco.py
        # does) must not need torchtitan 0.2.2's validation builder
        build = getattr(validate_module, "build_text_validation_dataloader", None)
        if build is None:
            raise RuntimeError(f"{HELDOUT_RANKS_ENV} needs torchtitan 0.2.2's "
                               "build_text_validation_dataloader; install torchtitan==0.2.2 "
                               "(bash scripts/setup.sh) or unset it")  # fmt: skip
        if not getattr(build, _PATCHED, False):
            validate_module.build_text_validation_dataloader = _as_if_on(int(ranks), build)
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
            cls.forward_backward_step = _wrap(method, slow_factor, slow_steps, stats)


install()
