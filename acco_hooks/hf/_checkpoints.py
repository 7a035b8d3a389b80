"""What ``ACCOTrainer`` adds to a checkpoint folder: each rank's engine shard, and the live
parameters when they are not the real θ the folder's model files hold."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from acco_hooks import checkpoint as acco_checkpoint
from acco_hooks.engine import ACCOEngine

__all__ = ["ENGINE_FILE", "LIVE_PARAMS_FILE", "load_engine", "save_engine"]

ENGINE_FILE = "acco_engine_rank{rank}.pt"
LIVE_PARAMS_FILE = "acco_live_params.pt"
_FORMAT = 1


def save_engine(
    output_dir: str, engine: ACCOEngine, engine_state: dict[str, Any],
    live_params: dict[str, torch.Tensor] | None, should_save: bool,
) -> None:  # fmt: skip
    """This rank's engine shard; with ``should_save`` (one rank) the live parameters too."""
    acco_checkpoint.save(
        {"format": _FORMAT, "engine": engine_state},
        os.path.join(output_dir, ENGINE_FILE.format(rank=engine.rank)),
    )
    if live_params is not None and should_save:
        acco_checkpoint.save(live_params, os.path.join(output_dir, LIVE_PARAMS_FILE))


def load_engine(
    checkpoint: str, engine: ACCOEngine, named_parameters: list[tuple[str, nn.Parameter]]
) -> None:
    """Restore this rank's engine shard and, if saved, the live parameters."""
    path = os.path.join(checkpoint, ENGINE_FILE.format(rank=engine.rank))
    if not os.path.isfile(path):
        saved = sorted(f for f in os.listdir(checkpoint) if f.startswith("acco_engine_rank"))
        raise ValueError(
            f"ACCOTrainer: {checkpoint} has no {os.path.basename(path)} "
            + (
                f"(it has {len(saved)} engine shards: resume with that many processes)"
                if saved
                else "(it was not written by ACCOTrainer, or with save_only_model=True)"
            )
            + ". Resume from a checkpoint of an ACCOTrainer run with the same number of "
            "processes, or start a new run from its model weights"
        )  # fmt: skip
    state = acco_checkpoint.load(path, map_location=engine.device)
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise ValueError(
            f"ACCOTrainer: {path} is not an ACCOTrainer engine checkpoint of format "
            f"{_FORMAT} (this acco_hooks reads that format only)"
        )
    engine.load_state_dict(state["engine"])
    live_path = os.path.join(checkpoint, LIVE_PARAMS_FILE)
    if os.path.isfile(live_path):
        live = acco_checkpoint.load(live_path, map_location=engine.device)
        with torch.no_grad():
            for n, p in named_parameters:
                p.copy_(live[n])
