"""Which engine trains a parameter: one at a time, and never behind torch's back.

An engine takes each gradient out of ``.grad`` during backward (or zeroes DDP's bucket), so two
engines on one parameter would each see half the story, and torch's own ``clip_grad_norm_`` on
it would measure nothing and clip nothing. Both are refused here, by name, at the first call
that would go wrong.

The ``clip_grad_norm_`` refusal wraps torch's function only while some engine owns parameters:
:func:`claim` puts the guard in place, the :func:`release` that leaves no owned parameter puts
torch's function back. Importing ``acco_hooks`` changes nothing in torch.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import Tensor

__all__ = ["claim", "owner_of", "release"]

# id(parameter) -> weak references to the parameter and to the engine that hooked it: keyed by
# identity (a tensor's == is elementwise), keeping neither alive.
_OWNER: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def owner_of(param: Tensor) -> Any:
    """The live, open engine whose hooks take ``param``'s gradients, or ``None``."""
    param_ref, engine_ref = _OWNER.get(id(param), (None, None))
    if param_ref is None or param_ref() is not param:
        return None
    engine = engine_ref()
    return None if engine is None or engine.closed else engine


def claim(engine: Any, params: list[Tensor], names: list[str]) -> None:
    """Record ``engine`` as the one engine training ``params``; refuse a parameter another
    open engine already trains."""
    taken = [name for p, name in zip(params, names) if owner_of(p) not in (None, engine)]
    if taken:
        raise RuntimeError(
            f"acco_hooks: {', '.join(taken[:5])}{' and more' if len(taken) > 5 else ''} "
            "already train(s) under another ACCO optimizer that is still open: each gradient "
            "would reach only one of them. close() the first one before building another over "
            "the same model"
        )
    engine_ref = weakref.ref(engine)
    for p in params:
        _OWNER[id(p)] = (weakref.ref(p), engine_ref)
    _guard_clip_grad_norm()


def release(engine: Any) -> None:
    """Forget ``engine``'s parameters (it closed), and entries whose engine or parameter died;
    with no parameter owned any more, torch's ``clip_grad_norm_`` is torch's own again."""
    for key, (param_ref, engine_ref) in list(_OWNER.items()):
        if engine_ref() in (engine, None) or param_ref() is None:
            del _OWNER[key]
    if not _OWNER:
        _unguard_clip_grad_norm()


def _guard_clip_grad_norm() -> None:
    """Make ``torch.nn.utils.clip_grad_norm_`` refuse parameters whose gradients an engine holds.

    Parameters no engine trains go straight to torch's function. A name imported before
    (``from torch.nn.utils import clip_grad_norm_`` ahead of building the optimizer) keeps
    torch's unguarded function.
    """
    original = torch.nn.utils.clip_grad_norm_
    if getattr(original, "_acco_guarded", False):
        return

    @functools.wraps(original)
    def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Tensor:
        params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
        if any(owner_of(p) is not None for p in params):
            raise RuntimeError(
                "acco_hooks: torch.nn.utils.clip_grad_norm_ on parameters an ACCO optimizer "
                "trains would clip nothing: their gradients live in the engine (summed over the "
                "round, averaged over every rank at the round end), not in .grad. Pass "
                f"max_grad_norm={max_norm} to the optimizer instead: it clips the averaged "
                "gradient to that global norm"
            )
        return original(params, max_norm, *args, **kwargs)

    clip_grad_norm_._acco_guarded = True  # type: ignore[attr-defined]
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_


def _unguard_clip_grad_norm() -> None:
    """Put torch's own ``clip_grad_norm_`` back, unless someone wrapped ours meanwhile."""
    guard = torch.nn.utils.clip_grad_norm_
    if not getattr(guard, "_acco_guarded", False):
        return
    torch.nn.utils.clip_grad_norm_ = guard.__wrapped__
    if torch.nn.utils.clip_grad.clip_grad_norm_ is guard:
        torch.nn.utils.clip_grad.clip_grad_norm_ = guard.__wrapped__
