"""What the engine accepts: its settings and its parameter groups, checked before anything runs."""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["MODES", "NONFINITE_POLICIES", "REDUCE_DTYPES", "normalize_param_groups",
           "real_updates", "validate_config"]  # fmt: skip

MODES = ("acco", "dpu", "ddp")
NONFINITE_POLICIES = ("skip", "raise")
# Dtypes the collectives can sum on every backend (float8 has no add on CPU, integers no mean).
REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def real_updates(mode: str, rounds: int) -> int:
    """Real optimizer updates in ``rounds`` rounds: every other round in ``acco``, every round
    in ``dpu`` and ``ddp``. Schedules counted in updates use it."""
    return rounds // 2 if mode == "acco" else rounds


def validate_config(
    optimizer_class, mode, accumulation_steps, accumulate_until_ready, reduce_dtype,
    max_grad_norm, lr_scheduler, nonfinite, timeout, fsdp_process_group,
) -> None:  # fmt: skip
    """Refuse a setting the engine cannot honour, naming it and the fix."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(
            f"acco_hooks: optimizer_class must be a torch.optim.Optimizer subclass such as "
            f"torch.optim.AdamW (the class, not an instance), got {optimizer_class!r}"
        )
    closure = inspect.signature(optimizer_class.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise TypeError(
            f"acco_hooks: {optimizer_class.__name__}.step() needs a closure that re-evaluates "
            "the loss, which a sharded step on the communication thread cannot run; use a "
            "first-order optimizer such as torch.optim.AdamW or SGD"
        )
    if issubclass(optimizer_class, torch.optim.SparseAdam):
        raise TypeError(
            "acco_hooks: torch.optim.SparseAdam steps sparse gradients, and the engine sums "
            "and shards dense ones; use torch.optim.Adam or AdamW with dense gradients"
        )
    if mode not in MODES:
        raise ValueError(f"acco_hooks: mode={mode!r} is not one of {', '.join(map(repr, MODES))}")
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise ValueError(
            f"acco_hooks: accumulation_steps={accumulation_steps!r} must be an integer >= 1 "
            "(the number of micro-batches per round)"
        )
    if not isinstance(accumulate_until_ready, bool):
        raise TypeError(
            f"acco_hooks: accumulate_until_ready={accumulate_until_ready!r} must be True or False"
        )
    if reduce_dtype is not None and reduce_dtype not in REDUCE_DTYPES:
        raise ValueError(
            f"acco_hooks: reduce_dtype={reduce_dtype!r} must be one of torch.float32, "
            "torch.bfloat16, torch.float16, torch.float64 (the dtypes collectives can sum), or "
            "None for float32"
        )
    if max_grad_norm is not None and not _positive_number(max_grad_norm):
        raise ValueError(
            f"acco_hooks: max_grad_norm={max_grad_norm!r} must be a finite number > 0, or None "
            "for no clipping"
        )
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(
            f"acco_hooks: nonfinite={nonfinite!r} is not one of 'skip' (skip the round's update "
            "on every rank) or 'raise'"
        )
    if timeout is not None and not _positive_number(timeout, low=1e-3, high=1e12):
        raise ValueError(
            f"acco_hooks: timeout={timeout!r} must be a number of seconds between 0.001 and "
            "1e12, or None for the default process group's timeout"
        )
    if fsdp_process_group is not None and accumulate_until_ready:
        raise ValueError(
            "acco_hooks: accumulate_until_ready=True cannot be combined with "
            "fsdp_process_group: the FSDP ranks of a replica reduce-scatter together, so they "
            "must run the same micro-batches; set accumulate_until_ready=False"
        )
    if lr_scheduler is not None and not callable(lr_scheduler):
        raise TypeError(
            "acco_hooks: lr_scheduler must be a callable that builds the scheduler from the "
            "optimizer, e.g. lr_scheduler=lambda opt: CosineAnnealingLR(opt, T_max=1000)"
        )


def _positive_number(value: Any, low: float = 0.0, high: float = math.inf) -> bool:
    """A real number (not a bool), finite as a float, > 0 and within [low, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        as_float = float(value)
    except OverflowError:  # an int beyond the float range
        return False
    return math.isfinite(as_float) and as_float > 0 and low <= as_float <= high


def normalize_param_groups(
    params: Iterable[Any],
) -> tuple[list[dict[str, Any]], list[tuple[str, Tensor]]]:
    """Parameter groups as dicts with ``params`` and ``names``, and the frozen parameters
    (``requires_grad=False``) left out of them, by name.

    All on one device, each tensor once, floating point.
    """
    if isinstance(params, Tensor):
        raise TypeError("acco_hooks: params must be an iterable of tensors or dicts, got a Tensor")
    items = list(params)
    if not items:
        raise ValueError("acco_hooks: got an empty parameter list")
    groups = items if isinstance(items[0], dict) else [{"params": items}]
    normalized, seen, frozen = [], set(), []
    for gi, group in enumerate(groups):
        if not isinstance(group, dict):
            raise TypeError("acco_hooks: mix of parameter-group dicts and tensors in params")
        members = group["params"]
        members = [members] if isinstance(members, Tensor) else list(members)
        tensors, names = [], []
        for pi, item in enumerate(members):
            name, p = item if isinstance(item, tuple) else (f"params[{gi}][{pi}]", item)
            if not isinstance(p, Tensor):
                raise TypeError(f"acco_hooks: {name} is a {type(p).__name__}, not a tensor")
            if p in seen:
                raise ValueError(f"acco_hooks: {name} appears more than once in params")
            seen.add(p)
            if not p.requires_grad:
                frozen.append((name, p))
                continue
            if not p.is_floating_point():
                raise TypeError(f"acco_hooks: {name} has dtype {p.dtype}; only floating parameters train")
            tensors.append(p)
            names.append(name)
        if tensors:
            normalized.append({**group, "params": tensors, "names": names})
    if not normalized:
        raise ValueError("acco_hooks: none of the given parameters requires grad")
    devices = {p.device for g in normalized for p in g["params"]}
    if len(devices) != 1:
        raise ValueError(
            f"acco_hooks: parameters are on several devices {sorted(map(str, devices))}; "
            "move the whole model to one device before building the optimizer"
        )
    return normalized, frozen
