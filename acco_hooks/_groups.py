"""The engine's process groups: built for its communication thread alone, destroyed at close.

Two threads issuing collectives on one group deadlock, and ``init_device_mesh`` hands out the
WORLD group for a dimension that spans every rank: the thread therefore never shares a group
with the training loop. The engine uses up to three groups (built once, in the same order on
every rank):

- ``data``: the data-parallel ranks: reduce-scatter and all-gather;
- ``count``: the ranks whose gradients make up one averaged gradient (with HSDP every FSDP
  shard of every replica): the micro-batch weights and the "non-finite" flags are summed there;
- ``norm``: the ranks whose shards make up the whole model (times tensor/pipeline parallel
  ranks): the squared gradient norm is summed there.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from acco_hooks._worker import CommWorker

__all__ = ["EngineGroups", "broadcast_from_first_rank", "build_engine_groups",
           "barrier_each", "release_communication"]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class EngineGroups:
    """The engine's groups (``None``: a single local worker) and its place in them."""

    data: dist.ProcessGroup | None
    count: dist.ProcessGroup | None
    norm: dist.ProcessGroup | None
    data_parallel_ranks: tuple[int, ...]
    world_size: int
    rank: int
    fsdp_world_size: int

    @property
    def owned(self) -> tuple[dist.ProcessGroup, ...]:
        """Each group once, in creation order: what close() destroys."""
        return tuple(dict.fromkeys(g for g in (self.data, self.count, self.norm) if g is not None))


def build_engine_groups(
    process_group: Any, fsdp_process_group: Any, norm_process_group: Any, timeout: float | None
) -> EngineGroups:
    """Dedicated copies of the data-parallel, count and norm groups (see the module docstring)."""
    data_parallel_ranks = _ranks_of(process_group)
    data = _dedicated_group(data_parallel_ranks, timeout)
    count, fsdp_world_size = data, 1
    if fsdp_process_group is not None:
        fsdp_ranks = _ranks_of(fsdp_process_group)
        if fsdp_ranks is None:
            raise ValueError("acco_hooks: fsdp_process_group needs torch.distributed to be initialized")
        fsdp_world_size = len(fsdp_ranks)
        count = _dedicated_group(_product_ranks(data_parallel_ranks, fsdp_ranks), timeout)
    norm = count if norm_process_group is None else _dedicated_group(_ranks_of(norm_process_group), timeout)
    return EngineGroups(
        data=data, count=count, norm=norm, data_parallel_ranks=data_parallel_ranks or (0,),
        world_size=1 if data is None else dist.get_world_size(data),
        rank=0 if data is None else dist.get_rank(data), fsdp_world_size=fsdp_world_size,
    )  # fmt: skip


def _ranks_of(process_group: Any) -> tuple[int, ...] | None:
    """The sorted global ranks of a ``ProcessGroup`` or 1-D ``DeviceMesh``.

    ``None`` (and no ``torch.distributed``): a single local worker, returned as ``None``.
    """
    if process_group is not None and hasattr(process_group, "get_group"):  # a DeviceMesh
        if process_group.ndim != 1:
            raise ValueError(
                f"acco_hooks: got a {process_group.ndim}-D DeviceMesh; pass one dimension of it, "
                "e.g. mesh['dp_replicate']"
            )
        process_group = process_group.get_group()
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        process_group = dist.group.WORLD
    return tuple(sorted(dist.get_process_group_ranks(process_group)))


def _product_ranks(
    data_parallel_ranks: tuple[int, ...] | None, fsdp_ranks: tuple[int, ...]
) -> tuple[int, ...]:
    """The ranks of the data-parallel × FSDP grid through this rank.

    Every rank gathers every rank's two groups; the grid is the union of the FSDP groups of
    this rank's data-parallel peers (the same set on every rank of the grid).
    """
    data_parallel_ranks = data_parallel_ranks or (dist.get_rank(),)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (dist.get_rank(), fsdp_ranks))
    fsdp_of = dict(every)
    return tuple(sorted({r for peer in data_parallel_ranks for r in fsdp_of[peer]}))


def _dedicated_group(
    my_ranks: tuple[int, ...] | None, timeout: float | None = None
) -> dist.ProcessGroup | None:
    """A new process group over ``my_ranks``, for the worker thread alone.

    ``new_group`` must be called by every rank for every group in the same order: the rank sets
    of every rank are gathered first.
    """
    if my_ranks is None:
        return None  # a single local worker
    every_ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every_ranks, my_ranks)
    mine = None
    for ranks in sorted(set(map(tuple, every_ranks))):
        group = dist.new_group(
            list(ranks), timeout=None if timeout is None else datetime.timedelta(seconds=timeout)
        )
        if ranks == my_ranks:
            mine = group
    return mine


def barrier_each(groups: tuple[dist.ProcessGroup, ...]) -> None:
    for group in groups:  # the same order on every rank: the order they were created in
        dist.barrier(group=group)


def release_communication(worker: CommWorker, groups: tuple[dist.ProcessGroup, ...]) -> None:
    """Join the worker thread, then destroy the groups it was the only user of."""
    worker.close()
    if not dist.is_available() or not dist.is_initialized():
        return  # the user already destroyed every group, ours included
    for group in groups:
        try:
            dist.destroy_process_group(group)
        except ValueError:
            pass  # destroyed already


@torch.no_grad()
def broadcast_from_first_rank(params: list[Tensor], group: dist.ProcessGroup) -> None:
    """Start every replica from the first rank's parameters, as DDP does."""
    src = dist.get_global_rank(group, 0)
    for p in params:
        dist.broadcast(p.detach(), src=src, group=group)
