"""Crash-safe checkpoint files for plain training loops (``ACCOOptimizer``, DDP hooks).

``torch.save(state, path)`` writes in place: a crash or SIGKILL in the middle leaves a truncated
file, and the previous checkpoint at that path is already gone. :func:`save` writes a temporary
file beside ``path``, flushes it to disk and renames it over ``path``; a rename within a
directory is atomic, so ``path`` always holds a complete checkpoint, the old or the new one.

Each rank saves its own file, which a run on the same ranks loads (to resume on another number
of ranks, save with ``torch.distributed.checkpoint``: ``ACCOEngine.state_dict``)::

    acco_hooks.checkpoint.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                "step": step}, f"ckpt/rank{rank}.pt")
    state = acco_hooks.checkpoint.load(f"ckpt/rank{rank}.pt")

(The torchtitan trainer uses torchtitan's DCP checkpoints, which are safe the same way: DCP
writes a step's ``.metadata`` last and torchtitan only resumes from steps that have it.)
"""

from __future__ import annotations

import os
import pathlib
import tempfile
from typing import Any

import torch

from acco_hooks.engine.placement import to_local_chunks

__all__ = ["save", "load"]


def save(state: Any, path: str | os.PathLike) -> None:
    """Write ``state`` to ``path`` atomically (``torch.save`` format).

    The optimizer state's ``ShardedTensor`` chunks are written as this rank's plain tensors
    (``LocalChunks``), so that the file loads without a process group.
    """
    state = to_local_chunks(state)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself reaches the disk
    finally:
        os.close(directory)


def load(path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """Read a checkpoint written by :func:`save` (or ``torch.save``)."""
    return torch.load(path, map_location=map_location, weights_only=False)
