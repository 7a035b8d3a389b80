"""Whole parameters split inside a replica: each matrix's pieces brought together on the rank
that steps it, and its new values sent back, over the replica's own ranks.

With FSDP inside a replica (HSDP: R replicas of S FSDP ranks) or tensor parallelism (R replicas
of S TP ranks) no rank holds a whole matrix: FSDP2 splits each one's dim 0 over the S ranks of a
replica, a TP plan splits a matrix's rows (``ColwiseParallel``) or columns (``RowwiseParallel``),
each as ``torch.chunk`` cuts it. These S ranks are the replica's *piece ranks*
(:func:`piece_ranks`). An optimizer that looks at each matrix whole (Muon's Newton–Schulz, a
factored second moment) needs the matrix on one rank: Newton–Schulz of a piece is not
Newton–Schulz of the matrix. The engine gives each such matrix one owner on the R × S grid
(``layout.balanced_owners`` over the matrices' sizes before they are split; the same on every
rank), and every piece rank lays its piece of the matrix in the shard of the owner's replica
index (``layout.whole_parameter_layout`` with those owners). So after a round's reduce-scatter
over the replicas, rank ``(r, s)`` holds, in its shard, its piece of every matrix owned by
``(r, s')`` for any ``s'``, summed over the replicas; the matrices owned in replica index r are
all there, spread over the S ranks that share it. One round then runs, on the communication
thread::

    reduce-scatter over replicas ─► ÷ weight, clip (on the pieces) ─► gather: all-to-all over
    the piece ranks, each piece to its matrix's owner ─► the owner steps the whole matrix ─►
    scatter: all-to-all back, each rank's piece of the new values into its shard ─► all-gather
    over replicas, as for any shard

The piece ranks are the replica's own, the fast link inside a node (torchtitan's FlexShard and
Moonlight's Distributed Muon bring a matrix together there too, by all-gather or all-to-all);
the replicas' slow link carries what it carries without whole parameters. Each all-to-all moves
what this rank's shard holds of the whole-stepped matrices in fp32, (S - 1)/S of it to other
ranks: about 4·Φ_w/(R·S) bytes a rank each way, Φ_w the whole-stepped elements. The owner keeps
each matrix's fp32 master and gradient whole (the optimizer steps those); the shard's master
keeps the pieces too, written back after each step, which is what the all-gather sends and a
checkpoint saves (``placement``), laid out as any piece of that layout.

A matrix the piece ranks do not split (a TP plan that leaves it replicated) is whole on each of
them: each steps its own copy in the replica that owns it, as every TP rank steps a replicated
parameter's copy, and nothing of it travels. A matrix split over two dimensions of ranks at once
(FSDP over a TP-split matrix) is refused by name: its FSDP piece is a piece of a piece.

An estimate step (``acco``'s θ̃) writes the whole matrices' would-be values into temporaries on
the owner and scatters them into the shard that is gathered, as the update does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from acco_hooks.engine.layout import ShardLayout

__all__ = ["PieceExchange", "Split", "chunk_rows", "piece_ranks", "split_of"]


def chunk_rows(rows: int, size: int, index: int) -> tuple[int, int]:
    """``(first row, rows)`` of piece ``index`` when ``torch.chunk`` splits ``rows`` rows into
    ``size`` pieces (FSDP2's split of dim 0, a TP plan's ``Shard``): pieces of
    ``ceil(rows / size)`` rows, the last ones shorter or empty."""
    per_rank = math.ceil(rows / size)
    first = min(index * per_rank, rows)
    return first, max(0, min(per_rank, rows - first))


class Split(NamedTuple):
    """How the piece ranks of a replica hold one tensor."""

    shape: tuple[int, ...]  # the tensor unsplit over the piece ranks: what its owner steps
    dim: int | None  # the dimension they split, as torch.chunk cuts it; None: each holds it whole
    index: int  # this rank's piece
    size: int  # the piece ranks, S

    def piece(self, whole: Tensor, index: int) -> Tensor:
        """Piece ``index`` of ``whole`` (a view; ``whole`` itself when unsplit)."""
        if self.dim is None:
            return whole
        first, n = chunk_rows(self.shape[self.dim], self.size, index)
        return whole.narrow(self.dim, first, n)

    def piece_numel(self, index: int) -> int:
        if self.dim is None:
            return math.prod(self.shape)
        _, n = chunk_rows(self.shape[self.dim], self.size, index)
        return n * math.prod(self.shape) // max(1, self.shape[self.dim])


def _ranks(mesh: Any, dim: int) -> tuple[int, ...]:
    return tuple(sorted(dist.get_process_group_ranks(mesh.get_group(dim))))


def _splits(mesh: Any, dim: int, placement: Any) -> bool:
    """Whether ``placement`` on mesh dimension ``dim`` splits the tensor (one rank: not)."""
    return placement.is_shard() and mesh.size(dim) > 1


def piece_ranks(params: Sequence[Tensor], fsdp_ranks: tuple[int, ...]) -> tuple[int, ...]:
    """The global ranks over which a replica splits the whole-stepped ``params`` (module
    docstring): FSDP's (``fsdp_ranks``, more than one), else the one set of ranks whose mesh
    dimension shards some of them (tensor parallelism); ``()`` where none is split (data
    parallelism alone, pipeline stages: each holds its matrices whole)."""
    from acco_hooks.engine.buffers import is_dtensor

    if len(fsdp_ranks) > 1:
        return fsdp_ranks
    found = {_ranks(p.device_mesh, d) for p in params if is_dtensor(p)
             for d, placement in enumerate(p.placements)
             if _splits(p.device_mesh, d, placement)}  # fmt: skip
    if len(found) > 1:
        raise ValueError(
            "acco_hooks: the parameters stepped whole are split over several sets of ranks "
            f"({sorted(found)}): the engine brings a matrix together over one (FSDP's, or the "
            "tensor-parallel ranks'). Step the others with a per-element optimizer "
            "(torch.optim.AdamW)"
        )
    return found.pop() if found else ()


def split_of(
    param: Tensor, local: Tensor, ranks: tuple[int, ...], alone: bool = True
) -> Split | str:  # fmt: skip
    """How ``ranks`` (a replica's piece ranks) hold ``param``, whose local tensor is ``local``;
    or why the engine cannot bring it together (a phrase that follows the parameter's name).

    The whole it steps is ``param`` unsplit over ``ranks`` only: its global shape where nothing
    else splits it. ``alone``: a ``DTensor`` that another mesh dimension shards too (FSDP over
    a TP-split matrix) is refused: its piece is a piece of a piece, not a slice of the matrix
    (without ``alone``, the piece of that part, as FSDP2 lays it out: what a checkpoint saves)."""
    from acco_hooks.engine.buffers import is_dtensor

    size = max(1, len(ranks))
    if not is_dtensor(param) or param.dim() == 0:
        return Split(tuple(local.shape), None, 0, size)
    import torch.distributed.tensor as dtensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = param.device_mesh, list(param.placements)
    ours = [d for d in range(mesh.ndim) if _ranks(mesh, d) == ranks]
    others = [d for d in range(mesh.ndim) if d not in ours and _splits(mesh, d, placements[d])]
    if others and alone:
        return (f"{placements[others[0]]} splits it over ranks {_ranks(mesh, others[0])} besides "
                f"{'the ranks ' + str(ranks) if ranks else 'no piece ranks'}")  # fmt: skip
    if not ours or not _splits(mesh, ours[0], placements[ours[0]]):
        return Split(tuple(local.shape), None, 0, size)
    (dim,) = ours
    placement = placements[dim]
    if alone and type(placement) is not dtensor.Shard:  # _StridedShard: beside another split
        return f"{placement} splits it in interleaved pieces, not as torch.chunk cuts it"
    unsplit = list(placements)
    unsplit[dim] = dtensor.Replicate()
    shape, _ = compute_local_shape_and_global_offset(param.shape, mesh, unsplit)
    split = Split(tuple(shape), placement.dim, mesh.get_local_rank(dim), size)
    expected = split.piece(torch.empty(shape, device="meta"), split.index).shape
    if tuple(local.shape) != tuple(expected):
        return f"its local tensor {tuple(local.shape)} is not torch.chunk's piece of {tuple(shape)}"
    return split


class PieceExchange:
    """How one parameter group's whole-stepped tensors travel between their pieces (in this
    rank's shards) and their owners (module docstring).

    Args:
        layout: the group's layout over the R replicas (each piece in its owner's replica's
            shard).
        rank: this rank's replica index r.
        owners: per tensor of the group, its owner ``(replica index, piece index)``; a tensor
            the piece ranks do not split is owned by each of them in one replica (its
            ``piece index`` is then this rank's own).
        piece_rank: this rank's index s among the piece ranks; ``piece_size``: S.
        splits: per tensor, how the piece ranks hold it (:func:`split_of`).
    """

    __slots__ = ("owned", "splits", "piece_rank", "piece_size", "_sends", "_receives",
                 "_send_splits", "_receive_splits")  # fmt: skip

    def __init__(
        self, layout: ShardLayout, rank: int, owners: Sequence[tuple[int, int]], piece_rank: int,
        piece_size: int, splits: Sequence[Split],
    ) -> None:  # fmt: skip
        self.piece_rank, self.piece_size = piece_rank, piece_size
        self.splits = list(splits)
        # the tensors this rank steps whole, in the group's order
        self.owned = [i for i, owner in enumerate(owners) if owner == (rank, piece_rank)]

        def holds(i: int, s: int) -> bool:  # whether piece rank s sends tensor i to its owner
            return self.splits[i].dim is not None or s == piece_rank

        # gather, send side: per piece rank s', the (shard offset, elements) of this rank's
        # pieces of the tensors s' owns, in the group's order
        self._sends = [[(p.at_shard, p.numel) for p in sorted(layout.pieces(rank),
                                                              key=lambda p: p.index)
                        if owners[p.index] == (rank, s) and holds(p.index, s)]
                       for s in range(piece_size)]  # fmt: skip
        # gather, receive side: per piece rank s', (owned tensor's place in ``owned``, the
        # piece s' holds) of each tensor this rank owns that s' sends
        self._receives = [[(k, s) for k, i in enumerate(self.owned) if holds(i, s)]
                          for s in range(piece_size)]  # fmt: skip
        self._send_splits = [sum(n for _, n in sends) for sends in self._sends]
        self._receive_splits = [sum(self.splits[self.owned[k]].piece_numel(s) for k, s in got)
                                for got in self._receives]  # fmt: skip

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """Per tensor of the group, the shape its owner steps."""
        return [split.shape for split in self.splits]

    def gather(self, shard: Tensor, wholes: list[Tensor], group: dist.ProcessGroup) -> None:
        """``wholes[k]`` (one per tensor of :attr:`owned`) = the tensor's pieces in the shards
        of its owner's piece peers (``shard``: this rank's, e.g. the averaged gradient)."""
        send = self._collect([shard[at : at + n] for sends in self._sends for at, n in sends],
                             wholes[0].dtype if wholes else torch.float32, shard.device)  # fmt: skip
        received = send.new_empty(sum(self._receive_splits))
        self._all_to_all(received, send, self._receive_splits, self._send_splits, group)
        at = 0
        for got in self._receives:
            for k, s in got:
                piece = self.splits[self.owned[k]].piece(wholes[k], s)
                piece.copy_(received[at : at + piece.numel()].view(piece.shape))
                at += piece.numel()

    def scatter(self, wholes: list[Tensor], shard: Tensor, group: dist.ProcessGroup) -> None:
        """The reverse of :meth:`gather`: each piece rank's piece of ``wholes`` (this rank's
        owned tensors, e.g. their new values) into that rank's ``shard``."""
        send = self._collect(
            [self.splits[self.owned[k]].piece(wholes[k], s).reshape(-1)
             for got in self._receives for k, s in got],
            wholes[0].dtype if wholes else torch.float32, shard.device,
        )  # fmt: skip
        received = send.new_empty(sum(self._send_splits))
        self._all_to_all(received, send, self._send_splits, self._receive_splits, group)
        at = 0
        for sends in self._sends:
            for offset, n in sends:
                shard[offset : offset + n].copy_(received[at : at + n])
                at += n

    def bytes_per_exchange(self, element_size: int = 4) -> int:
        """Bytes this rank sends to other piece ranks in one :meth:`gather` (as many come back
        in a :meth:`scatter`)."""
        return element_size * sum(n for s, n in enumerate(self._send_splits) if s != self.piece_rank)

    @staticmethod
    def _collect(parts: list[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
        if not parts:
            return torch.empty(0, dtype=dtype, device=device)
        return torch.cat([p.to(dtype) for p in parts])

    @staticmethod
    def _all_to_all(output: Tensor, input: Tensor, output_splits: list[int],
                    input_splits: list[int], group: dist.ProcessGroup) -> None:  # fmt: skip
        dist.all_to_all_single(output, input, output_splits, input_splits, group=group)
