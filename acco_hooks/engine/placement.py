"""The engine's shards as ``DTensor``: what lets DCP save every rank's and reshard them.

The engine keeps its per-element state (the fp32 master, the optimizer's moments, acco's carried
half-batch, the pending result) in flat shards: a parameter group's local parameter tensors
laid end to end make a vector of Φ elements, and rank r of the N data-parallel ranks owns
elements ``[r*s, (r+1)*s)`` of it, s = ⌈Φ/N⌉ (``buffers``). That is exactly how ``torch.chunk``
splits the vector, and so how a ``DTensor`` of global shape ``(Φ,)`` with placement
``Shard(0)`` over the data-parallel group places it. Handed to DCP as such a DTensor, each
shard is saved under the group's name with its offset (no rank's is dropped as a duplicate, as
plain tensors under one key are), and ``dcp.load`` into the DTensor of a run with another N
reads, for each rank's new range, whatever saved ranges overlap it. The resharding is DCP's.

The vector is the same on every data-parallel rank of one *model part*: the ranks that hold the
same local tensors, i.e. the same coordinates on every other mesh dimension (a tensor-parallel
rank, an FSDP shard inside an HSDP replica, a pipeline stage's parameters). Each part's vector
gets a key of its own: the group's first parameter name (pipeline stages differ there) and the
coordinates of that parameter's DTensor on its other mesh dimensions. Resharding therefore
changes the data-parallel degree N only: another tensor-parallel or FSDP degree changes what
the parts are.

Without ``torch.distributed`` (one local worker) each vector is a plain tensor.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from acco_hooks.engine.buffers import GroupBuffers

__all__ = ["LocalChunk", "ShardPlacement", "to_local_chunks"]


class LocalChunk(NamedTuple):
    """A rank's range of one vector without the ``DTensor`` around it: what a per-rank file
    holds, loadable without a process group (:func:`to_local_chunks`)."""

    numel: int  # Φ, the vector's length
    offset: int  # where this rank's range starts
    data: Tensor


def to_local_chunks(state: Any) -> Any:
    """``state`` with every ``DTensor`` replaced by this rank's :class:`LocalChunk`."""
    if isinstance(state, DTensor):
        (chunk,) = state.__create_chunk_list__()  # DCP's own view of the local range
        offset = chunk.offsets[0] if len(chunk.offsets) else 0
        return LocalChunk(state.shape[0], offset, state.to_local())
    if isinstance(state, dict):
        return {k: to_local_chunks(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)) and not hasattr(state, "_fields"):
        return type(state)(to_local_chunks(v) for v in state)
    return state


class ShardPlacement:
    """Each parameter group's vector: its checkpoint key, length Φ, and this rank's range.

    Args:
        buffers: the engine's parameter groups.
        rank: this rank's index in the data-parallel group.
        data_group: the data-parallel group (``None``: one local worker); only whether there
            is one counts: the DTensors' mesh holds no group.
        data_parallel_ranks: its global ranks (a mesh dimension over them is not a model part).
    """

    __slots__ = ("keys", "param_names", "global_shapes", "numels", "ranges", "mesh_ranks")

    def __init__(
        self, buffers: list[GroupBuffers], rank: int, data_group: dist.ProcessGroup | None,
        data_parallel_ranks: tuple[int, ...],
    ) -> None:  # fmt: skip
        # The DTensors' mesh: the data-parallel ranks, as a mesh that holds no process group
        # (the engine's own are destroyed at close(), and a state dict may outlive it)
        self.mesh_ranks = None if data_group is None else data_parallel_ranks
        self.keys = [g.names[0] + _part(g.params[0], data_parallel_ranks) for g in buffers]
        self.param_names = [list(g.names) for g in buffers]
        self.global_shapes = [[tuple(p.shape) for p in g.params] for g in buffers]
        self.numels = [sum(t.numel() for t in g.locals) for g in buffers]
        self.ranges = [
            (min(rank * g.shard_numel, numel), min((rank + 1) * g.shard_numel, numel))
            for g, numel in zip(buffers, self.numels)
        ]  # fmt: skip

    def chunks(self, flats: list[Tensor]) -> dict[str, Tensor]:
        """One tensor per group, keyed by the group's key: a ``DTensor`` over the
        data-parallel group whose local data is (a view of) this rank's part of ``flats``;
        for one local worker, the vector itself."""
        mesh = None
        if self.mesh_ranks is not None:
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh(flats[0].device.type, torch.tensor(self.mesh_ranks),
                              _init_backend=False)  # fmt: skip
        out = {}
        for key, flat, numel, (start, end) in zip(self.keys, flats, self.numels, self.ranges):
            local = flat[: end - start]
            out[key] = local if mesh is None else DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=torch.Size([numel]), stride=(1,)
            )  # fmt: skip
        return out

    def matches(self, chunks: dict[str, Any]) -> bool:
        """Whether ``chunks`` hold exactly this rank's ranges (a state of this shape)."""
        return all(_range_of(chunks.get(key)) == (numel, start, end)
                   for key, numel, (start, end) in zip(self.keys, self.numels, self.ranges))

    @torch.no_grad()
    def fill(self, flats: list[Tensor], chunks: dict[str, Any]) -> None:
        """Copy ``chunks`` (laid out as :meth:`chunks` lays them) into ``flats``; the padding
        becomes zero."""
        for key, flat, (start, end) in zip(self.keys, flats, self.ranges):
            source = _local(chunks[key])
            if source.data_ptr() != flat.data_ptr():  # else DCP loaded in place
                flat[: end - start].copy_(source)
            flat[end - start :].zero_()


def _part(param: Tensor, data_parallel_ranks: tuple[int, ...]) -> str:
    """``@name=coordinate...`` of the mesh dimensions of ``param`` other than the
    data-parallel one; empty for a plain tensor."""
    if not isinstance(param, DTensor):
        return ""
    mesh, coordinate = param.device_mesh, param.device_mesh.get_coordinate() or ()
    names = mesh.mesh_dim_names or tuple(str(dim) for dim in range(mesh.ndim))
    others = [
        f"{names[dim]}={coordinate[dim]}" for dim in range(mesh.ndim)
        if tuple(sorted(dist.get_process_group_ranks(mesh.get_group(dim)))) != data_parallel_ranks
    ]  # fmt: skip
    return "@" + ",".join(others) if others else ""


def _local(chunk: Any) -> Tensor:
    if isinstance(chunk, DTensor):
        return chunk.to_local()
    return chunk.data if isinstance(chunk, LocalChunk) else chunk


def _range_of(chunk: Any) -> tuple[int, int, int] | None:
    """(Φ, start, end) of the range a chunk holds on this rank."""
    if isinstance(chunk, DTensor):
        chunk = to_local_chunks(chunk)
    if isinstance(chunk, LocalChunk):
        return chunk.numel, chunk.offset, chunk.offset + chunk.data.numel()
    if isinstance(chunk, Tensor):
        return chunk.numel(), 0, chunk.numel()
    return None
