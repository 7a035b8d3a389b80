"""Where each element of the engine's shards sits in the model: what lets DCP save every rank's
shard and load it into a run of another shape.

The engine keeps its per-element state (the fp32 master, the optimizer's moments, acco's carried
half-batch, the pending result) in shards: a parameter group's local parameter tensors lie in a
padded vector of N shards, and rank r of the N data-parallel ranks owns shard r (``buffers``);
where each tensor lies is the group's ``layout``: end to end (flat), or each whole in one
rank's shard.

Checkpoint coordinates are those of the *part vector*: the group's parameters laid end to end as
one model part holds them, before FSDP shards them, i.e. restricted to this rank's coordinates on
the mesh dimensions other than the data-parallel and FSDP ones (a tensor-parallel rank, a
pipeline stage's parameters). Each part's vector has a key of its own: the group's first
parameter name and those coordinates. Resharding therefore changes the data-parallel degree N
and the FSDP degree S; another tensor- or pipeline-parallel degree changes what the parts are.

* **Without FSDP** (S = 1), in the flat layout, the local vector is the part vector, and rank
  r's range is exactly how ``torch.chunk`` splits it, so how a ``DTensor`` of global shape ``(Φ,)`` with placement
  ``Shard(0)`` over the data-parallel group places it. Handed to DCP as such a DTensor, each
  shard is saved under the key with its offset (no rank's is dropped as a duplicate, as plain
  tensors under one key are), and ``dcp.load`` into the DTensor of a run with another N reads,
  for each rank's new range, whatever saved ranges overlap it.
* **With FSDP** (HSDP, S > 1) the local vector is the concatenation of this rank's FSDP pieces:
  FSDP2 splits each parameter's dim 0 as ``torch.chunk`` does, so each piece is a contiguous
  range of the parameter's elements. A rank's range of its local vector is then a few
  contiguous ranges of the part vector, one per parameter it touches: the state is a
  ``ShardedTensor`` with one local shard per range, each a view of the flat shard, and the
  layout of every rank gathered once when the engine is built. DCP reads and writes those
  ranges the same way, so a run with another N or S loads the ranges it holds. The coordinates
  are those of the DTensor case, and each format loads the other.
* **Whole parameters** (no FSDP): a rank's shard holds the parameters it owns, each a
  contiguous range of the part vector: a ``ShardedTensor`` as with FSDP, every rank's ranges
  known from the layout. The coordinates are the part vector's in both layouts, so each loads
  the other's state, on any N.

A layout FSDP2 did not make this way (a parameter sharded on another dimension, or replicated
over the FSDP ranks) keeps one vector per FSDP rank: its key carries the FSDP coordinate, and
only the data-parallel degree reshards.

Without ``torch.distributed`` (one local worker) each vector is a plain tensor.
"""

from __future__ import annotations

import itertools
import math
import warnings
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as LocalShard
from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from acco_hooks.engine.buffers import GroupBuffers, is_dtensor
from acco_hooks.engine.whole_pieces import Split, chunk_rows, split_of

__all__ = ["LocalChunk", "ShardPlacement", "to_local_chunks"]

Pieces = tuple[tuple[int, int], ...]  # (offset in the part vector, length) per range


class LocalChunk(NamedTuple):
    """A rank's range of one vector without the ``DTensor`` or ``ShardedTensor`` around it:
    what a per-rank file holds, loadable without a process group (:func:`to_local_chunks`)."""

    numel: int  # Φ, the vector's length
    offset: int  # where this rank's range starts (the first piece's, with ``pieces``)
    data: Tensor
    pieces: Pieces = ()  # with FSDP: the part-vector ranges ``data`` holds, laid end to end


def to_local_chunks(state: Any) -> Any:
    """``state`` with every ``DTensor`` and ``ShardedTensor`` replaced by this rank's
    :class:`LocalChunk`."""
    if is_dtensor(state):
        (chunk,) = state.__create_chunk_list__()  # DCP's own view of the local range
        offset = chunk.offsets[0] if len(chunk.offsets) else 0
        return LocalChunk(state.shape[0], offset, state.to_local())
    if isinstance(state, ShardedTensor):
        # a rank that holds no range (whole parameters it does not own) keeps one empty piece:
        # no pieces at all means a DTensor's one range
        pieces = _pieces_of(state) or ((0, 0),)
        shards = [s.tensor for s in state.local_shards()]
        data = torch.cat(shards) if shards else torch.empty(0, dtype=state.dtype)
        return LocalChunk(state.size(0), pieces[0][0] if pieces else 0, data, pieces)
    if isinstance(state, dict):
        return {k: to_local_chunks(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)) and not hasattr(state, "_fields"):
        return type(state)(to_local_chunks(v) for v in state)
    return state


class ShardPlacement:
    """Each parameter group's vector: its checkpoint key, length, and this rank's part of it.

    Args:
        buffers: the engine's parameter groups.
        rank: this rank's index in the data-parallel group.
        data_group: the data-parallel group (``None``: one local worker); only whether there
            is one counts: the DTensors' mesh holds no group.
        data_parallel_ranks: its global ranks (a mesh dimension over them is not a model part).
        fsdp_ranks: HSDP: the global ranks FSDP shards this replica over (empty: no FSDP).
        count_group: HSDP: the data-parallel × FSDP ranks of this model part, over which the
            ranges of every rank are gathered once.
    """

    __slots__ = ("keys", "param_names", "global_shapes", "numels", "ranges", "mesh_ranks",
                 "part_numels", "pieces", "layouts", "reshards_fsdp")  # fmt: skip

    def __init__(
        self, buffers: list[GroupBuffers], rank: int, data_group: dist.ProcessGroup | None,
        data_parallel_ranks: tuple[int, ...], fsdp_ranks: tuple[int, ...] = (),
        count_group: dist.ProcessGroup | None = None,
    ) -> None:  # fmt: skip
        # The DTensors' mesh: the data-parallel ranks, as a mesh that holds no process group
        # (the engine's own are destroyed at close(), and a state dict may outlive it)
        self.mesh_ranks = None if data_group is None else data_parallel_ranks
        self.param_names = [list(g.names) for g in buffers]
        self.global_shapes = [[tuple(p.shape) for p in g.params] for g in buffers]
        self.numels = [sum(t.numel() for t in g.locals) for g in buffers]
        self.ranges = [
            (min(rank * g.shard_numel, numel), min((rank + 1) * g.shard_numel, numel))
            for g, numel in zip(buffers, self.numels)
        ]  # fmt: skip
        # With FSDP: this rank's ranges of each part vector, and every rank's (None: one vector
        # per FSDP rank, or no FSDP)
        self.part_numels: list[int] = list(self.numels)
        self.pieces: list[list[tuple[int, int, int]]] | None = None
        self.layouts: list[list[tuple[int, Pieces]]] | None = None
        split = [_fsdp_split(g, fsdp_ranks) for g in buffers] if len(fsdp_ranks) > 1 else None
        if split is not None:
            split = _agreed(split, count_group)
        if split is not None:
            self.part_numels = [sum(n for n, _ in parts) for parts in split]
            self.pieces = [_ranges_in_part(g, parts, rank) for g, parts in zip(buffers, split)]
            mine = [tuple((off, n) for off, _, n in ps) for ps in self.pieces]
            every = [None] * dist.get_world_size(count_group)
            dist.all_gather_object(every, (dist.get_rank(), mine), group=count_group)
            self.layouts = [[(r, pieces[gi]) for r, pieces in every] for gi in range(len(buffers))]
        elif data_group is not None and any(g.layout.whole for g in buffers):
            # Whole parameters: a rank's shard holds a few ranges of the part vector, one per
            # parameter it owns; every rank's are the layout's, known here without a gather.
            parts = [[(t.numel(), 0) for t in g.locals] for g in buffers]
            self.pieces = [_ranges_in_part(g, p, rank) for g, p in zip(buffers, parts)]
            self.layouts = [
                [(peer, tuple((off, n) for off, _, n in _ranges_in_part(g, p, r)))
                 for r, peer in enumerate(data_parallel_ranks)]
                for g, p in zip(buffers, parts)
            ]  # fmt: skip
        # Whether a run of another FSDP degree can load this state: the vectors are the part
        # vectors (one FSDP rank holds the whole part)
        self.reshards_fsdp = split is not None or len(fsdp_ranks) <= 1
        unsharded = fsdp_ranks if self.reshards_fsdp else ()
        self.keys = [g.names[0] + _part(g.params[0], data_parallel_ranks, unsharded)
                     for g in buffers]  # fmt: skip

    def chunks(self, flats: list[Tensor | None]) -> dict[str, Tensor]:
        """One tensor per group, keyed by the group's key: a ``DTensor`` over the
        data-parallel group (or, with FSDP, a ``ShardedTensor``) whose local data is (views
        of) this rank's part of ``flats``; for one local worker, the vector itself. A group
        whose flat is ``None`` (optimizer state only some groups keep) has no key."""
        if self.pieces is not None:
            return {key: self._sharded(flat.detach(), gi)
                    for gi, (key, flat) in enumerate(zip(self.keys, flats))
                    if flat is not None}  # fmt: skip
        mesh = None
        if self.mesh_ranks is not None:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.tensor import DTensor, Shard

            device = next(flat.device for flat in flats if flat is not None)
            mesh = DeviceMesh(device.type, torch.tensor(self.mesh_ranks),
                              _init_backend=False)  # fmt: skip
        out = {}
        for key, flat, numel, (start, end) in zip(self.keys, flats, self.numels, self.ranges):
            if flat is None:
                continue
            local = flat[: end - start]
            out[key] = local if mesh is None else DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=torch.Size([numel]), stride=(1,)
            )  # fmt: skip
        return out

    def _sharded(self, flat: Tensor, gi: int) -> ShardedTensor:
        device, me = flat.device, dist.get_rank()
        # A rank that holds nothing (whole parameters it does not own) holds an empty range at
        # the end: DCP drops a ShardedTensor without local shards from a rank's plan, and a key
        # missing on one rank makes its load take the checkpoint for the pre-2.4 format
        end = self.part_numels[gi]
        local = [
            LocalShard(flat[start : start + n], ShardMetadata([off], [n], f"rank:{me}/{device}"))
            for off, start, n in self.pieces[gi] or [(end, 0, 0)]
        ]  # fmt: skip
        metadata = ShardedTensorMetadata(
            [ShardMetadata([off], [n], f"rank:{r}/{device}")
             for r, pieces in self.layouts[gi] for off, n in pieces or [(end, 0)]],
            torch.Size([self.part_numels[gi]]),
            TensorProperties(dtype=flat.dtype, layout=flat.layout, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False),
        )  # fmt: skip
        with warnings.catch_warnings():  # DTensor cannot hold several ranges on one rank
            warnings.filterwarnings("ignore", message="Please use DTensor instead")
            return ShardedTensor._init_from_local_shards_and_global_metadata(local, metadata)

    def matches(self, chunks: dict[str, Any]) -> bool:
        """Whether ``chunks`` hold exactly this rank's ranges (a state of this shape)."""
        return all(_signature(chunks.get(key)) == self._signature(gi)
                   for gi, key in enumerate(self.keys))  # fmt: skip

    def _signature(self, gi: int) -> tuple:
        if self.pieces is not None:
            return ("pieces", self.part_numels[gi], tuple((o, n) for o, _, n in self.pieces[gi]))
        return (self.numels[gi], *self.ranges[gi])

    @torch.no_grad()
    def fill(self, flats: list[Tensor | None], chunks: dict[str, Any]) -> None:
        """Copy ``chunks`` (laid out as :meth:`chunks` lays them) into ``flats``; the padding
        becomes zero. A ``None`` flat is skipped (its group has no key in ``chunks``)."""
        for gi, (key, flat, (start, end)) in enumerate(zip(self.keys, flats, self.ranges)):
            if flat is None:
                continue
            source = chunks[key]
            if isinstance(source, ShardedTensor):
                for shard in source.local_shards():
                    if not shard.tensor.numel():  # the empty range of a rank that holds none
                        continue
                    at = _find(self.pieces[gi], shard.metadata.shard_offsets[0])
                    if shard.tensor.data_ptr() != flat[at:].data_ptr():  # else loaded in place
                        flat[at : at + shard.tensor.numel()].copy_(shard.tensor)
                _zero_outside(flat, self.pieces[gi])
            elif isinstance(source, LocalChunk) and source.pieces:  # a per-rank file's
                at = 0
                for offset, n in source.pieces:
                    if not n:
                        continue
                    start = _find(self.pieces[gi], offset)
                    flat[start : start + n].copy_(source.data[at : at + n])
                    at += n
                _zero_outside(flat, self.pieces[gi])
            else:
                data = _local(source)
                if data.data_ptr() != flat.data_ptr():  # else DCP loaded in place
                    flat[: end - start].copy_(data)
                flat[end - start :].zero_()


# ------------------------------------------------------------------ the FSDP pieces


def _fsdp_split(g: GroupBuffers, fsdp_ranks: tuple[int, ...]) -> list[tuple[int, int]] | None:
    """Per parameter of ``g``: (elements of its part, offset of this rank's FSDP piece in
    them); ``None`` if FSDP did not split some parameter's dim 0 as ``torch.chunk`` does."""
    out = []
    for param, local in zip(g.params, g.locals):
        piece = split_of(param, local, fsdp_ranks, alone=False)
        if not isinstance(piece, Split) or piece.dim != 0:
            return None
        shape = piece.shape
        rest = math.prod(shape[1:])
        first, _ = chunk_rows(shape[0], len(fsdp_ranks), piece.index)
        out.append((shape[0] * rest, first * rest))
    return out


def _agreed(split: list[Any], group: dist.ProcessGroup | None) -> list[Any] | None:
    """``split`` if every rank of ``group`` found its FSDP pieces, else ``None`` everywhere."""
    flag = torch.tensor([0 if any(s is None for s in split) else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return split if flag.item() else None


def _ranges_in_part(
    g: GroupBuffers, split: list[tuple[int, int]], rank: int
) -> list[tuple[int, int, int]]:
    """(offset in the part vector, offset in the shard, length) of each piece of the
    parameters in ``rank``'s shard; ``split``: per parameter, the elements of its part and
    where this rank's local tensor starts among them."""
    part_at = [0, *itertools.accumulate(n for n, _ in split)]
    return [(part_at[p.index] + split[p.index][1] + p.at_tensor, p.at_shard, p.numel)
            for p in g.layout.pieces(rank)]  # fmt: skip


def _zero_outside(flat: Tensor, pieces: list[tuple[int, int, int]]) -> None:
    """Zero the elements of ``flat`` that no piece holds: the padding."""
    at = 0
    for _, start, n in sorted(pieces, key=lambda piece: piece[1]):
        flat[at:start].zero_()
        at = start + n
    flat[at:].zero_()


def _pieces_of(tensor: ShardedTensor) -> Pieces:
    return tuple((s.metadata.shard_offsets[0], s.metadata.shard_sizes[0])
                 for s in tensor.local_shards() if s.metadata.shard_sizes[0])  # fmt: skip


def _find(pieces: list[tuple[int, int, int]], offset: int) -> int:
    return next(start for off, start, _ in pieces if off == offset)


# ------------------------------------------------------------------ keys and local views


def _ranks(mesh: Any, dim: int) -> tuple[int, ...]:
    return tuple(sorted(dist.get_process_group_ranks(mesh.get_group(dim))))


def _part(
    param: Tensor, data_parallel_ranks: tuple[int, ...], fsdp_ranks: tuple[int, ...] = ()
) -> str:
    """``@name=coordinate...`` of the mesh dimensions of ``param`` other than the
    data-parallel one (and FSDP's, when the vectors are the part vectors); empty for a plain
    tensor. A dimension of size 1 splits nothing: a layout with it and one without it (FSDP
    degree 1, or none) hold the same parts."""
    if not is_dtensor(param):
        return ""
    mesh, coordinate = param.device_mesh, param.device_mesh.get_coordinate() or ()
    names = mesh.mesh_dim_names or tuple(str(dim) for dim in range(mesh.ndim))
    others = [f"{names[dim]}={coordinate[dim]}" for dim in range(mesh.ndim)
              if mesh.size(dim) > 1
              and _ranks(mesh, dim) not in (data_parallel_ranks, fsdp_ranks)]  # fmt: skip
    return "@" + ",".join(others) if others else ""


def _local(chunk: Any) -> Tensor:
    if is_dtensor(chunk):
        return chunk.to_local()
    return chunk.data if isinstance(chunk, LocalChunk) else chunk


def _signature(chunk: Any) -> tuple | None:
    """What identifies the ranges a chunk holds on this rank."""
    if isinstance(chunk, ShardedTensor):
        return ("pieces", chunk.size(0), _pieces_of(chunk))
    if is_dtensor(chunk):
        chunk = to_local_chunks(chunk)
    if isinstance(chunk, LocalChunk):
        if chunk.pieces:
            return ("pieces", chunk.numel, tuple(p for p in chunk.pieces if p[1]))
        return chunk.numel, chunk.offset, chunk.offset + chunk.data.numel()
    if isinstance(chunk, Tensor):
        return chunk.numel(), 0, chunk.numel()
    return None
