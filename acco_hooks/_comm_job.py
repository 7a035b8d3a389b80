"""The communication job of one round, run on the engine's thread.

    reduce-scatter Σ gradients ─► ÷ global weight ─► clip ─► UPDATE: step the shard optimizer
                                                             ESTIMATE: Peek (no state changes)
                               ─► all-gather the new shard (θ_{t+1} or θ̃_{t+1})

Only this thread touches the shard side of the buffers (``shard_sum``, ``master``,
``gather_input``), the shard optimizer and the engine's process groups while a job runs; the
training loop reads ``gathered`` once the job's future is done.
"""

from __future__ import annotations

import enum
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from acco_hooks._buffers import GroupBuffers
from acco_hooks.collectives import all_gather, reduce_scatter_sum
from acco_hooks._groups import EngineGroups
from acco_hooks.peek import peek

__all__ = ["ACCOCommunicationError", "Job", "RoundResult", "all_gather_shards", "communicate"]


class ACCOCommunicationError(RuntimeError):
    """A round's communication failed (a peer died or hung, a collective or the shard step
    raised). Every rank of the group fails its round the same way: a collective cannot complete
    without all its ranks. The engine cannot continue: restart from the last complete checkpoint.
    """


class Job(enum.Enum):
    """What one round's communication computes from its averaged gradient."""

    UPDATE = "update"  # θ_{t+1} = Opt(θ_t, g): the optimizer state and LR schedule advance
    ESTIMATE = "estimate"  # θ̃_{t+1} = Peek(θ_t, g): nothing advances


class RoundResult(NamedTuple):
    """What a finished job reports to the training loop."""

    global_count: float  # Σ micro-batch weights over every rank of the averaged gradient
    grad_norm: float | None  # before clipping; None without max_grad_norm
    nonfinite: bool  # NaN/Inf in the averaged gradient: nothing was stepped, θ was re-gathered
    updated: bool  # the shard optimizer stepped (a real update θ_t -> θ_{t+1})
    comm_s: float  # how long the job took on the communication thread


def communicate(
    job: Job, local_count: float, buffers: list[GroupBuffers], groups: EngineGroups,
    optimizer: torch.optim.Optimizer, lr_scheduler: Any, max_grad_norm: float | None,
) -> RoundResult:  # fmt: skip
    """reduce-scatter -> average -> clip -> step or estimate -> all-gather."""
    start = time.perf_counter()
    if groups.data is None:
        for g in buffers:
            g.shard_sum.copy_(g.comm_input)
    else:
        for g in buffers:
            reduce_scatter_sum(g.shard_sum, g.comm_input, groups.data)
    # acco: the estimate round's sum ΣG̃ stays here for the update round, which adds it: the
    # update averages both rounds, and no rank keeps a model-sized carry between rounds.
    carried = [g.carried for g in buffers if g.carried is not None]
    if carried and job is Job.ESTIMATE:
        torch._foreach_copy_(carried, [g.shard_sum for g in buffers])
    add_carried = bool(carried) and job is Job.UPDATE
    # The count and a "my shard has NaN/Inf" flag travel together: every rank then agrees on
    # whether to skip, although each has seen only its own shard. A NaN estimate round also
    # skips the update that carries it.
    sums = [g.shard_sum for g in buffers] + (carried if add_carried else [])
    finite = all(bool(torch.isfinite(t).all()) for t in sums)
    counts = torch.tensor([local_count, 0.0 if finite else 1.0], dtype=torch.float64,
                          device=buffers[0].master.device)  # fmt: skip
    if groups.count is not None:
        dist.all_reduce(counts, group=groups.count)
    global_count, nonfinite = counts[0].item(), counts[1].item() > 0
    if nonfinite:  # every rank: no step, no estimate; the live parameters become θ
        for g in buffers:
            g.gather_input.copy_(g.master)
        all_gather_shards(buffers, groups)
        return RoundResult(global_count, None, True, False, time.perf_counter() - start)
    if global_count <= 0:
        raise RuntimeError(
            "acco_hooks: no rank contributed a micro-batch to this round (the global count "
            "is 0); at least one rank must run a real micro-batch in every round"
        )

    grads = []
    for g in buffers:
        if g.shard_sum.dtype == torch.float32:  # average in place: no shard-sized copy
            total = g.shard_sum
        else:
            if g.master.grad is None or g.master.grad is g.shard_sum:
                g.master.grad = torch.empty_like(g.master)
            total = g.master.grad.copy_(g.shard_sum)
        if add_carried:
            total.add_(g.carried)
        g.master.grad = total.div_(global_count)
        grads.append(g.master.grad)
    grad_norm = None
    if max_grad_norm is not None:
        grad_norm = _clip_(grads, buffers, max_grad_norm, groups.norm)

    if job is Job.UPDATE:
        optimizer.step()
        if lr_scheduler is not None:
            lr_scheduler.step()
        for g in buffers:
            g.gather_input.copy_(g.master)
    else:
        peek(optimizer, [g.gather_input for g in buffers])
    all_gather_shards(buffers, groups)
    return RoundResult(
        global_count, grad_norm, False, job is Job.UPDATE, time.perf_counter() - start
    )


def _clip_(
    grads: list[Tensor], buffers: list[GroupBuffers], max_norm: float,
    norm_group: dist.ProcessGroup | None,
) -> float:  # fmt: skip
    """Clip the averaged gradient to ``max_norm`` (global L2 norm, as torch does)."""
    terms = []
    for g, grad in zip(buffers, grads):
        terms.append(grad.double().pow(2).sum())
        for start, end, discount in g.norm_discounts:  # replicated: count each value once
            terms.append(-discount * grad[start:end].double().pow(2).sum())
    sq = torch.stack(terms).sum().reshape(1)
    if norm_group is not None:
        dist.all_reduce(sq, group=norm_group)
    norm = sq.sqrt().float().squeeze(0)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(grads, coef)
    return norm.item()


def all_gather_shards(buffers: list[GroupBuffers], groups: EngineGroups) -> None:
    """``gathered`` = every rank's ``gather_input``, end to end."""
    if groups.data is None:
        for g in buffers:
            g.gathered.copy_(g.gather_input)
        return
    for g in buffers:
        all_gather(g.gathered, g.gather_input, groups.data)
