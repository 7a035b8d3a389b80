"""Which engine trains a parameter, and what its ``.grad`` says while the engine holds its gradient.

An engine takes each gradient out of ``.grad`` during backward (or zeroes DDP's bucket), so two
engines on one parameter would each see half the story: :func:`claim` refuses the second one by
name.

Between ``backward()`` and the ``step()`` that counts the micro-batch, the gradient lives in the
engine's accumulator: summed over the round, averaged over every rank only at the round end, on
the communication thread. Whatever reads ``.grad`` there (``clip_grad_norm_``, imported by name
or by attribute, ``get_total_norm`` and ``clip_grads_with_norm_``, ``clip_grad_value_``, their
foreach variants, a gradient-norm log line) would see nothing or zeros and go on silently. So
``.grad`` holds a :class:`GradientInEngine` then: a tensor with the parameter's shape, no
storage, that refuses every operation on it with a message naming ``max_grad_norm=``. Nothing
of torch is replaced; ``p.grad is None`` checks, ``model.zero_grad()`` and the next backward
(which finds ``.grad`` empty again) work as usual.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from acco_hooks.engine.buffers import is_dtensor

__all__ = ["GradientInEngine", "claim", "clear_before_accumulating", "clear_placeholders",
           "leave_placeholder", "owner_of", "release"]  # fmt: skip

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


def release(engine: Any) -> None:
    """Forget ``engine``'s parameters (it closed), and entries whose engine or parameter died."""
    for key, (param_ref, engine_ref) in list(_OWNER.items()):
        if engine_ref() in (engine, None) or param_ref() is None:
            del _OWNER[key]


# ---------------------------------------------------------------- what .grad holds meanwhile


class GradientInEngine(Tensor):
    """What a trained parameter's ``.grad`` holds from its backward to the ``step()`` that
    counts the micro-batch: the parameter's shape, dtype and device, no storage, and a refusal
    for every operation (module docstring). The averaged gradient exists only at the round end;
    ``max_grad_norm=`` clips it (to its global norm, as ``clip_grad_norm_`` after DDP's
    all-reduce), ``engine.last_grad_norm`` reports its norm."""

    param_name: str

    @staticmethod
    def __new__(cls, like: Tensor, name: str) -> GradientInEngine:
        placeholder = Tensor._make_wrapper_subclass(
            cls, like.shape, strides=like.stride(), dtype=like.dtype, device=like.device,
            requires_grad=False,
        )  # fmt: skip
        placeholder.param_name = name
        return placeholder

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"GradientInEngine({self.param_name}: the gradient is in the ACCO engine)"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _ALIASES and _same_shape_alias(func, args):
            # an alias reads nothing: DTensor.from_local wraps a local placeholder through one
            return GradientInEngine(args[0], args[0].param_name)
        names = sorted({a.param_name for a in _tensors(args, kwargs) if isinstance(a, GradientInEngine)})
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise RuntimeError(
            f"acco_hooks: {func} on the .grad of {shown or 'a trained parameter'}, which an ACCO "
            "optimizer trains: between backward() and step() its gradient lives in the engine "
            "(summed over the round, averaged over every rank at the round end), and .grad "
            "holds nothing to read or change. A torch optimizer of your own would step nothing: "
            "the ACCO optimizer's step() (ACCOState.step() under DDP) replaces it. Clipping here "
            "(clip_grad_norm_, clip_grad_value_, get_total_norm and clip_grads_with_norm_) would "
            "clip nothing: pass max_grad_norm=... to the ACCO optimizer instead, which clips the "
            "averaged gradient to that global norm, as clip_grad_norm_ does after DDP's "
            "all-reduce (engine.last_grad_norm is its norm)"
        )


_ALIASES = (torch.ops.aten.view.default, torch.ops.aten.alias.default,
            torch.ops.aten.detach.default)  # fmt: skip


def _same_shape_alias(func: Any, args: tuple) -> bool:
    return func is not torch.ops.aten.view.default or list(args[1]) == list(args[0].shape)


def leave_placeholder(param: Tensor, name: str) -> None:
    """Put a :class:`GradientInEngine` in ``param.grad`` (its gradient went to the engine)."""
    if is_dtensor(param):
        local = param.to_local()
        param.grad = type(param).from_local(
            GradientInEngine(local, name), param.device_mesh, param.placements,
            run_check=False, shape=param.shape, stride=param.stride(),
        )  # fmt: skip
    else:
        param.grad = GradientInEngine(param, name)


def holds_placeholder(param: Tensor) -> bool:
    grad = param.grad
    if is_dtensor(grad):
        grad = grad._local_tensor  # the public to_local() is an operation on it
    return isinstance(grad, GradientInEngine)


def clear_placeholders(params: Iterable[Tensor]) -> None:
    """``.grad = None`` where a placeholder is (the micro-batch was counted, or another backward
    is about to accumulate into it)."""
    for param in params:
        if param.grad is not None and holds_placeholder(param):
            param.grad = None


def clear_before_accumulating(param: Tensor) -> Callable[[Tensor], None]:
    """A tensor hook that empties ``param.grad`` of its placeholder before autograd accumulates
    the next gradient into it (another backward before the micro-batch is counted)."""
    param_ref = weakref.ref(param)  # the hook is kept by the parameter: no cycle through it

    def clear(grad: Tensor) -> None:
        param = param_ref()
        if param is not None:
            clear_placeholders([param])

    return clear


def _tensors(args: Any, kwargs: Any) -> list[Any]:
    flat = list(torch.utils._pytree.tree_leaves((args, kwargs or {})))
    return [a for a in flat if isinstance(a, Tensor)]
