"""Whole parameters under FSDP: each matrix's pieces brought together on the rank that steps it,
and its new values sent back, over the replica's own FSDP group.

With HSDP (R replicas of S FSDP ranks) no rank holds a whole parameter: FSDP2 splits each one's
dim 0 over the S ranks of a replica, as ``torch.chunk`` does. An optimizer that looks at each
matrix whole (Muon's Newton–Schulz, a factored second moment) needs the matrix on one rank. The
engine gives each such matrix one owner on the R × S grid (``layout.balanced_owners`` over the
matrices' sizes before FSDP splits them; the same on every rank), and every FSDP rank lays its
piece of the matrix in the shard of the owner's replica index (``layout.whole_parameter_layout``
with those owners). So after a round's reduce-scatter over the replicas, rank ``(r, s)`` holds,
in its shard, its piece of every matrix owned by ``(r, s')`` for any ``s'``, summed over the
replicas; the matrices owned in replica index r are all there, spread over the S ranks that
share it. One round then runs, on the communication thread::

    reduce-scatter over replicas ─► ÷ weight, clip (on the pieces) ─► gather: all-to-all over
    the FSDP group, each piece to its matrix's owner ─► the owner steps the whole matrix ─►
    scatter: all-to-all back, each rank's piece of the new values into its shard ─► all-gather
    over replicas, as for any shard

The FSDP group is the replica's own, the fast link inside a node (torchtitan's FlexShard and
Moonlight's Distributed Muon bring a matrix together there too, by all-gather or all-to-all);
the replicas' slow link carries what it carries without whole parameters. Each all-to-all moves
what this rank's shard holds of the whole-stepped matrices in fp32, (S - 1)/S of it to other
ranks: about 4·Φ_w/(R·S) bytes a rank each way, Φ_w the whole-stepped elements. The owner keeps
each matrix's fp32 master and gradient whole (the optimizer steps those); the shard's master
keeps the pieces too, written back after each step, which is what the all-gather sends and a
checkpoint saves (``placement``), laid out as any FSDP piece.

An estimate step (``acco``'s θ̃) writes the whole matrices' would-be values into temporaries on
the owner and scatters them into the shard that is gathered, as the update does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from acco_hooks.engine.layout import ShardLayout

__all__ = ["PieceExchange", "chunk_rows", "dim0_piece"]


def chunk_rows(rows: int, size: int, index: int) -> tuple[int, int]:
    """``(first row, rows)`` of piece ``index`` when ``torch.chunk`` splits ``rows`` rows into
    ``size`` pieces (FSDP2's split of dim 0): pieces of ``ceil(rows / size)`` rows, the last
    ones shorter or empty."""
    per_rank = math.ceil(rows / size)
    first = min(index * per_rank, rows)
    return first, max(0, min(per_rank, rows - first))


def dim0_piece(
    param: Tensor, local: Tensor, fsdp_ranks: tuple[int, ...]
) -> tuple[tuple[int, ...], int] | None:  # fmt: skip
    """``(shape of the part, index on the FSDP dimension)`` if ``local`` is FSDP2's piece of
    ``param``'s dim 0 over ``fsdp_ranks`` as ``torch.chunk`` cuts it, else ``None``.

    The part is ``param`` unsplit over the FSDP ranks only (its global shape under HSDP alone;
    a tensor-parallel rank's shape with tensor parallelism beside it)."""
    from acco_hooks.engine.buffers import is_dtensor

    if not is_dtensor(param) or param.dim() == 0:
        return None
    import torch.distributed.tensor as dtensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = param.device_mesh
    dims = [d for d in range(mesh.ndim)
            if tuple(sorted(dist.get_process_group_ranks(mesh.get_group(d)))) == fsdp_ranks]
    if len(dims) != 1 or not param.placements[dims[0]].is_shard(0):
        return None
    (dim,) = dims
    unsplit = list(param.placements)
    unsplit[dim] = dtensor.Replicate()
    shape, _ = compute_local_shape_and_global_offset(param.shape, mesh, unsplit)
    index = mesh.get_local_rank(dim)
    _, rows = chunk_rows(shape[0], mesh.size(dim), index)
    if tuple(local.shape) != (rows, *shape[1:]):
        return None
    return tuple(shape), index


class PieceExchange:
    """How one parameter group's whole-stepped tensors travel between their FSDP pieces (in
    this rank's shards) and their owners (module docstring).

    Args:
        layout: the group's layout over the R replicas (each piece in its owner's replica's
            shard).
        rank: this rank's replica index r.
        owners: per tensor of the group, its owner ``(replica index, FSDP index)``.
        fsdp_rank: this rank's FSDP index s; ``fsdp_size``: S.
        shapes: per tensor, its shape before FSDP splits it (what its owner steps).
    """

    __slots__ = ("owned", "shapes", "fsdp_rank", "fsdp_size", "_sends", "_receives", "_send_splits",
                 "_receive_splits")  # fmt: skip

    def __init__(
        self, layout: ShardLayout, rank: int, owners: Sequence[tuple[int, int]], fsdp_rank: int,
        fsdp_size: int, shapes: Sequence[tuple[int, ...]],
    ) -> None:  # fmt: skip
        self.fsdp_rank, self.fsdp_size = fsdp_rank, fsdp_size
        self.shapes = [tuple(s) for s in shapes]
        # the tensors this rank steps whole, in the group's order
        self.owned = [i for i, owner in enumerate(owners) if owner == (rank, fsdp_rank)]
        # each FSDP rank's piece of each tensor: (offset among the tensor's elements, elements)
        pieces = []
        for shape in self.shapes:
            per_row = math.prod(shape[1:])
            pieces.append([(first * per_row, rows * per_row) for first, rows in
                           (chunk_rows(shape[0], fsdp_size, s) for s in range(fsdp_size))])
        # gather, send side: per FSDP rank s', the (shard offset, elements) of this rank's
        # pieces of the tensors s' owns, in the group's order
        self._sends = [[(p.at_shard, p.numel) for p in sorted(layout.pieces(rank),
                                                              key=lambda p: p.index)
                        if owners[p.index] == (rank, s)] for s in range(fsdp_size)]  # fmt: skip
        # gather, receive side: per FSDP rank s', (owned tensor's place in ``owned``, offset in
        # the tensor, elements) of s''s piece of each tensor this rank owns
        self._receives = [[(k, *pieces[i][s]) for k, i in enumerate(self.owned)]
                          for s in range(fsdp_size)]  # fmt: skip
        self._send_splits = [sum(n for _, n in sends) for sends in self._sends]
        self._receive_splits = [sum(n for _, _, n in got) for got in self._receives]

    def gather(self, shard: Tensor, wholes: list[Tensor], group: dist.ProcessGroup) -> None:
        """``wholes[k]`` (one per tensor of :attr:`owned`) = the tensor's pieces in the shards
        of its owner's FSDP peers (``shard``: this rank's, e.g. the averaged gradient)."""
        send = self._collect([shard[at : at + n] for sends in self._sends for at, n in sends],
                             wholes[0].dtype if wholes else torch.float32, shard.device)  # fmt: skip
        received = send.new_empty(sum(self._receive_splits))
        self._all_to_all(received, send, self._receive_splits, self._send_splits, group)
        at = 0
        for got in self._receives:
            for k, offset, n in got:
                wholes[k].view(-1)[offset : offset + n].copy_(received[at : at + n])
                at += n

    def scatter(self, wholes: list[Tensor], shard: Tensor, group: dist.ProcessGroup) -> None:
        """The reverse of :meth:`gather`: each FSDP rank's piece of ``wholes`` (this rank's
        owned tensors, e.g. their new values) into that rank's ``shard``."""
        send = self._collect(
            [wholes[k].reshape(-1)[offset : offset + n] for got in self._receives
             for k, offset, n in got],
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
        """Bytes this rank sends to other FSDP ranks in one :meth:`gather` (as many come back
        in a :meth:`scatter`)."""
        return element_size * sum(n for s, n in enumerate(self._send_splits) if s != self.fsdp_rank)

    @staticmethod
    def _collect(parts: list[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
        if not parts:
            return torch.empty(0, dtype=dtype, device=device)
        return torch.cat([p.to(dtype) for p in parts])

    @staticmethod
    def _all_to_all(output: Tensor, input: Tensor, output_splits: list[int],
                    input_splits: list[int], group: dist.ProcessGroup) -> None:  # fmt: skip
        dist.all_to_all_single(output, input, output_splits, input_splits, group=group)
