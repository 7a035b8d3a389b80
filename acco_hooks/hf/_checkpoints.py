"""What ``ACCOTrainer`` adds to a checkpoint folder: the engine state, and the live parameters
when they are not the real θ the folder's model files hold.

The engine state is a distributed checkpoint (``acco_engine/``, ``torch.distributed.checkpoint``):
every rank writes its shard, and a run on another number of processes loads it resharded, as
``ACCOEngine.state_dict`` describes. (A Trainer step ends a round, so no rank's own gradients
are in it.) Earlier versions wrote per-rank files (``acco_engine_rank{r}.pt``); they still load
on the same number of processes.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from acco_hooks import checkpoint as acco_checkpoint
from acco_hooks.engine import ACCOEngine

__all__ = ["ENGINE_DIR", "ENGINE_FILE", "LIVE_PARAMS_FILE", "load_engine", "save_engine"]

ENGINE_DIR = "acco_engine"
ENGINE_FILE = "acco_engine_rank{rank}.pt"
LIVE_PARAMS_FILE = "acco_live_params.pt"
_FORMAT = 1


def save_engine(
    output_dir: str, engine: ACCOEngine, live_params: dict[str, torch.Tensor] | None,
    should_save: bool,
) -> None:  # fmt: skip
    """The engine state (collective: every rank calls it); with ``should_save`` (one rank)
    the live parameters too."""
    with _without_single_process_warning():
        dcp.save({"engine": engine.state_dict()}, no_dist=_alone(),
                 checkpoint_id=os.path.join(output_dir, ENGINE_DIR))  # fmt: skip
    if live_params is not None and should_save:
        acco_checkpoint.save(live_params, os.path.join(output_dir, LIVE_PARAMS_FILE))


def _alone() -> bool:
    """No process group (one process, no launcher): DCP's ``no_dist``."""
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _without_single_process_warning() -> Iterator[None]:
    """DCP warns that it "assumes the intent is to save/load in a single process" whenever
    ``no_dist`` is in effect (torch 2.13 even when told so): here that is always the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def saved_layout(checkpoint: str) -> tuple[int, int] | None:
    """(data-parallel ranks, micro-batches per round) of the run that saved ``checkpoint``'s
    engine state, read without loading it; ``None`` if it has none."""
    metadata = os.path.join(checkpoint, ENGINE_DIR, ".metadata")
    if os.path.isfile(metadata):
        state = {"engine": {"world_size": 0, "accumulation_steps": 0}}
        with _without_single_process_warning():  # two numbers, read by this rank alone
            dcp.load(state, checkpoint_id=os.path.join(checkpoint, ENGINE_DIR), no_dist=True)
        return state["engine"]["world_size"], state["engine"]["accumulation_steps"]
    files = _rank_files(checkpoint)
    if not files:
        return None
    state = acco_checkpoint.load(os.path.join(checkpoint, files[0]))
    engine = state.get("engine", {}) if isinstance(state, dict) else {}
    return engine.get("world_size", len(files)), engine.get("accumulation_steps", 0)


def load_engine(
    checkpoint: str, engine: ACCOEngine, named_parameters: list[tuple[str, nn.Parameter]]
) -> None:
    """Restore the engine state (resharded if it was saved by another number of processes)
    and, if saved, the live parameters."""
    directory = os.path.join(checkpoint, ENGINE_DIR)
    if os.path.isfile(os.path.join(directory, ".metadata")):
        state = {"engine": engine.state_dict()}  # what this engine holds: DCP fills it
        with _without_single_process_warning():
            dcp.load(state, checkpoint_id=directory, no_dist=_alone())
        engine.load_state_dict(state["engine"])
    else:
        engine.load_state_dict(_load_rank_file(checkpoint, engine))
    live_path = os.path.join(checkpoint, LIVE_PARAMS_FILE)
    if os.path.isfile(live_path):
        live = acco_checkpoint.load(live_path, map_location=engine.device)
        with torch.no_grad():
            for n, p in named_parameters:
                p.copy_(live[n])


def _load_rank_file(checkpoint: str, engine: ACCOEngine) -> dict[str, Any]:
    path = os.path.join(checkpoint, ENGINE_FILE.format(rank=engine.rank))
    if not os.path.isfile(path):
        saved = _rank_files(checkpoint)
        raise ValueError(
            f"ACCOTrainer: {checkpoint} has neither {ENGINE_DIR}/ nor "
            f"{os.path.basename(path)} "
            + (
                f"(it has {len(saved)} per-rank engine files of an earlier version: resume with "
                "that many processes)"
                if saved
                else "(it was not written by ACCOTrainer, or with save_only_model=True)"
            )
            + ". Resume from a checkpoint of an ACCOTrainer run, or start a new run from its "
            "model weights"
        )  # fmt: skip
    state = acco_checkpoint.load(path, map_location=engine.device)
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise ValueError(
            f"ACCOTrainer: {path} is not an ACCOTrainer engine checkpoint of format "
            f"{_FORMAT} (this acco_hooks reads that format only)"
        )
    return state["engine"]


def _rank_files(checkpoint: str) -> list[str]:
    return sorted(f for f in os.listdir(checkpoint) if f.startswith("acco_engine_rank"))
