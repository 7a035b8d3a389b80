"""The engine's checkpoint format: what a saved state must match before it is loaded.

A state is this rank's alone (its master shard, optimizer state and accumulator), so it can
only resume the same rank of a run with the same shape; anything else is refused by name.
"""

from __future__ import annotations

from typing import Any

__all__ = ["STATE_VERSION", "check_compatible"]

STATE_VERSION = 1


def check_compatible(
    state: dict[str, Any], *, mode: str, world_size: int, fsdp_world_size: int,
    param_shapes: list[list[tuple[int, ...]]], has_lr_scheduler: bool,
) -> None:  # fmt: skip
    """Raise ``ValueError`` naming the first difference between ``state`` and this engine."""
    if state.get("version") != STATE_VERSION:
        raise ValueError(
            f"acco_hooks: load_state_dict: unknown state version {state.get('version')!r} "
            f"(this acco_hooks writes version {STATE_VERSION})"
        )
    if state["world_size"] != world_size:
        raise ValueError(
            f"acco_hooks: load_state_dict: the checkpoint was saved with a data-parallel world "
            f"size of {state['world_size']}, this run has {world_size}. Resharding the "
            f"optimizer state is not supported yet: resume with {state['world_size']} "
            "data-parallel ranks"
        )
    saved_fsdp = state.get("fsdp_world_size", 1)
    if saved_fsdp != fsdp_world_size:
        raise ValueError(
            f"acco_hooks: load_state_dict: the checkpoint was saved with the model sharded "
            f"{saved_fsdp} ways by FSDP inside each replica, this run shards it "
            f"{fsdp_world_size} ways. Resharding the optimizer state is not supported "
            f"yet: resume with an FSDP (data_parallel_shard) degree of {saved_fsdp}"
        )
    if state["mode"] != mode:
        raise ValueError(
            f"acco_hooks: load_state_dict: the checkpoint was saved in mode={state['mode']!r}, "
            f"this engine has mode={mode!r}; build the optimizer with "
            f"mode={state['mode']!r} to resume"
        )
    if [[tuple(s) for s in g] for g in state["param_shapes"]] != param_shapes:
        raise ValueError(
            "acco_hooks: load_state_dict: the checkpoint's parameter groups and shapes differ "
            "from this optimizer's; build it over the same parameters in the same order"
        )
    if has_lr_scheduler != (state["lr_scheduler"] is not None):
        raise ValueError(
            "acco_hooks: load_state_dict: the checkpoint "
            + ("has no" if state["lr_scheduler"] is None else "has an")
            + " LR scheduler state but this optimizer "
            + ("has one" if has_lr_scheduler else "has none")
            + "; pass the same lr_scheduler argument as the saved run"
        )
