"""Peek: the estimate step of ACCO, ``θ̃ = Peek(θ, g)``.

Peek computes the parameters one step of the wrapped optimizer *would* produce from the master
shard ``θ`` and gradient ``g``, and leaves the optimizer state (step counts, moments, momentum
buffers) and the learning rate exactly as they were.

For ``torch.optim.AdamW``, ``Adam`` and ``SGD`` the step is recomputed functionally, chunk by
chunk, straight into the all-gather input: no copy of the optimizer state is made (the paper's
code clones the fp32 shard and both Adam moments every other round). The arithmetic follows
torch's single-tensor implementations operation for operation. Any other optimizer class falls
back to snapshot -> ``step()`` -> restore (``shard_optimizer.step_and_restore``), which costs a
copy of its state.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from acco_hooks.engine.shard_optimizer import GroupedOptimizer, step_and_restore

__all__ = ["CHUNK_NUMEL", "peek", "has_functional_peek"]

# Elements per chunk of the functional estimate: bounds its temporaries to a few MiB whatever
# the shard size, so the estimate adds no memory proportional to the model.
CHUNK_NUMEL = 1 << 20


def has_functional_peek(optimizer: torch.optim.Optimizer) -> bool:
    """Whether :func:`peek` recomputes ``optimizer``'s step without copying its state."""
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
        return False  # a subclass may change step(); only the exact classes are mirrored
    return not any(
        group.get("differentiable") or group.get("capturable") for group in optimizer.param_groups
    )


@torch.no_grad()
def peek(
    optimizer: torch.optim.Optimizer, outputs: list[Tensor], *, chunk_numel: int = CHUNK_NUMEL
) -> None:
    """Write ``Opt(θ, g)`` of every parameter of ``optimizer`` into ``outputs`` without stepping.

    Args:
        optimizer: the shard optimizer. Its params hold ``θ`` and their ``.grad`` holds ``g``.
        outputs: one tensor per parameter of ``optimizer`` (in ``param_groups`` order), same
            shape, any floating dtype: receives the would-be parameters.
        chunk_numel: elements recomputed at a time by the functional estimate (bounds its
            temporaries); the result does not depend on it.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(params) != len(outputs):
        raise ValueError(f"peek: {len(outputs)} outputs for {len(params)} parameters")
    if isinstance(optimizer, GroupedOptimizer):  # each class estimates its own parameters
        out_of = dict(zip(map(id, params), outputs))
        for part in optimizer.optimizers:
            peek(part, [out_of[id(p)] for group in part.param_groups for p in group["params"]],
                 chunk_numel=chunk_numel)  # fmt: skip
        return
    if not has_functional_peek(optimizer):
        step_and_restore(optimizer, outputs)
        return
    out_iter = iter(outputs)
    for group in optimizer.param_groups:
        for p in group["params"]:
            out = next(out_iter)
            if p.grad is None:  # the optimizer would skip it: the parameter stays
                out.copy_(p)
                continue
            state = optimizer.state.get(p, {})
            if isinstance(optimizer, torch.optim.SGD):
                chunk = functools.partial(_sgd_chunk, group, state)
            else:  # read on the host once per parameter, not once per chunk
                step = float(state["step"]) + 1 if "step" in state else 1.0
                # AdamW decays decoupled whatever its param-group keys say (not every torch
                # version has ``decoupled_weight_decay``); Adam as the key says.
                decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(
                    group.get("decoupled_weight_decay", False)
                )
                chunk = functools.partial(_adam_chunk, group, state, step, decoupled)
            for start in range(0, p.numel(), chunk_numel):
                end = min(start + chunk_numel, p.numel())
                view = lambda t: t.view(-1)[start:end]  # noqa: E731, B023 - used in this iteration only
                view(out).copy_(chunk(view, view(p), view(p.grad)))


def _adam_chunk(
    group: dict, state: dict, step: float, decoupled: bool, view, param: Tensor, grad: Tensor
) -> Tensor:
    lr = float(group["lr"])
    beta1, beta2 = (float(b) for b in group["betas"])
    eps, weight_decay = float(group["eps"]), float(group["weight_decay"])
    if group["maximize"]:
        grad = -grad
    param = param.clone()  # chunk-sized temporary: θ itself must not move
    if weight_decay != 0:
        if decoupled:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    if state:
        exp_avg = view(state["exp_avg"]).lerp(grad, 1 - beta1)
        exp_avg_sq = view(state["exp_avg_sq"]).mul(beta2).addcmul_(grad, grad, value=1 - beta2)
    else:  # first step: the moments start at zero
        exp_avg = torch.zeros_like(grad).lerp_(grad, 1 - beta1)
        exp_avg_sq = torch.zeros_like(grad).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    if group["amsgrad"]:
        if state:
            exp_avg_sq = torch.maximum(view(state["max_exp_avg_sq"]), exp_avg_sq)
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    return param.addcdiv_(exp_avg, denom, value=-step_size)


def _sgd_chunk(group: dict, state: dict, view, param: Tensor, grad: Tensor) -> Tensor:
    lr, momentum = float(group["lr"]), float(group["momentum"])
    dampening, weight_decay = float(group["dampening"]), float(group["weight_decay"])
    if group["maximize"]:
        grad = -grad
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    if momentum != 0:
        buf = state.get("momentum_buffer")
        if buf is None:  # first step: the buffer starts as the gradient itself
            buf = grad
        else:
            buf = view(buf).mul(momentum).add_(grad, alpha=1 - dampening)
        grad = grad.add(buf, alpha=momentum) if group["nesterov"] else buf
    return param.add(grad, alpha=-lr)
