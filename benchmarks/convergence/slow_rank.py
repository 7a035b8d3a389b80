"""Slow one rank of a torchtitan run down, and count the micro-batches every rank runs.

What it does: monkeypatches torchtitan's ``Trainer.forward_backward_step`` (which
``ACCOTrainer`` inherits and calls once per micro-batch) so that

* on the slow global rank (``ACCO_BENCH_SLOW_RANK``, default 1) each micro-batch first sleeps
  ``ACCO_BENCH_SLOW_S`` seconds (default 0: nobody is slowed): a simulated slower device;
* on every rank, when ``ACCO_BENCH_STATS_DIR`` is set, each micro-batch appends one JSON line
  ``{"step": S, "tokens": T, "t": UNIX_TIME}`` to ``<dir>/microbatches_rank<R>.jsonl``
  (``T`` = ``labels.numel()``, as torchtitan counts ``ntokens_seen``). The file is line
  buffered, so a killed run keeps what it did.

Reproduce (what ``benchmarks/convergence/run.py --heterogeneous`` launches)::

    ACCO_BENCH_SLOW_S=0.2 ACCO_BENCH_STATS_DIR=/tmp/stats OMP_NUM_THREADS=1 \\
    torchrun --standalone --nproc_per_node 2 train_titan.py \\
        --job.config_file torchtitan_configs/debug_cpu_acco.toml --acco.accumulate_until_ready true \\
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


def _wrap(original: Callable[..., Any], sleep_s: float, stats: TextIO | None) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward_backward_step(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        if sleep_s > 0:
            time.sleep(sleep_s)
        loss = original(self, *args, **kwargs)
        if stats is not None:
            labels = kwargs.get("labels", args[1] if len(args) > 1 else None)
            tokens = int(labels.numel()) if labels is not None else 0
            stats.write(json.dumps({"step": int(self.step), "tokens": tokens, "t": time.time()}))
            stats.write("\n")
        return loss

    setattr(forward_backward_step, _PATCHED, True)
    return forward_backward_step


def install() -> None:
    """Patch ``Trainer.forward_backward_step`` (and any subclass override) once per process."""
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
