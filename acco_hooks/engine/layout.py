"""Where a parameter group's tensors sit in the engine's padded vector, and so what each rank steps.

Each parameter group travels as one padded vector of ``N * shard_numel`` elements: the
reduce-scatter hands rank r elements ``[r * shard_numel, (r + 1) * shard_numel)`` of its sum,
rank r steps that shard, and the all-gather lays every rank's shard back end to end. A
:class:`ShardLayout` says where each of the group's local tensors sits in that vector; the
round's schedule, the wire formats, ``auto`` and torchft's sums move the vector and never look
inside it. Two layouts:

* **flat** (:func:`flat_layout`): the tensors end to end, padded at the end to a multiple of N.
  A shard cuts through parameters wherever its boundary falls; the padding is under N
  elements, and every rank steps the same number of elements. Only an optimizer whose step is
  per element computes on such a piece what it computes on the whole parameter
  (``shard_optimizer``).
* **whole parameters** (:func:`whole_parameter_layout`): each tensor lies inside one rank's
  shard, the rank that owns it: the optimizer steps it in its real shape, so a step that looks
  at the whole matrix (Muon's Newton–Schulz, a trust ratio, a factored second moment) sees it.
  The owners are balanced by a cost per tensor (its elements unless told otherwise), greedily,
  largest first, as Megatron's layer-wise optimizer and torch's ``ZeroRedundancyOptimizer``
  place whole parameters; every shard is padded to the largest one, so the collectives stay
  the equal-sized reduce-scatter and all-gather (:attr:`ShardLayout.padding` says how much).

**With FSDP inside a replica** (HSDP: R replicas of S FSDP ranks) a rank holds FSDP's pieces of
each parameter, not the parameter. Each whole-stepped matrix then gets one owner on the R × S
grid (:func:`balanced_owners` over the matrices' global sizes, the same on every rank), and
every FSDP rank lays its piece of the matrix in the shard of the owner's replicate index: after
the reduce-scatter, the owner's S FSDP peers hold the matrix's summed gradient, piece by piece,
and bring it together on the owner over the replica's own group
(:mod:`acco_hooks.engine.whole_pieces`).

A layout is a pure function of the tensors' sizes and N (and the owners given): every rank
computes the same one.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

from torch import Tensor

__all__ = ["Piece", "ShardLayout", "balanced_owners", "flat_layout", "whole_parameter_layout"]


class Piece(NamedTuple):
    """A part of one tensor that lies in one rank's shard."""

    index: int  # the tensor's index in the group
    at_tensor: int  # where the part starts among the tensor's elements (flattened)
    at_shard: int  # where it starts in the shard
    numel: int


class ShardLayout:
    """Where each of a parameter group's local tensors sits in its padded vector.

    Args:
        numels: each tensor's number of elements, in the group's order.
        offsets: where each tensor's elements start in the padded vector.
        shard_numel: the elements of one rank's shard (the vector holds ``world_size`` of them).
        world_size: N, the data-parallel ranks.
        whole: each tensor lies inside one shard (its owner's).
    """

    __slots__ = ("numels", "offsets", "shard_numel", "world_size", "whole")

    def __init__(
        self, numels: Sequence[int], offsets: Sequence[int], shard_numel: int, world_size: int,
        whole: bool,
    ) -> None:  # fmt: skip
        self.numels, self.offsets = tuple(numels), tuple(offsets)
        self.shard_numel, self.world_size, self.whole = shard_numel, world_size, whole

    @property
    def kind(self) -> str:
        """``"flat"`` or ``"whole"`` (parameters), as settings and logs name it."""
        return "whole" if self.whole else "flat"

    @property
    def padded_numel(self) -> int:
        """The vector's elements: N shards."""
        return self.shard_numel * self.world_size

    @property
    def padding(self) -> int:
        """Elements of the vector that hold no parameter (zeros on the wire)."""
        return self.padded_numel - sum(self.numels)

    def views(self, vector: Tensor, shapes: Sequence[Sequence[int]]) -> list[Tensor]:
        """Each tensor's place in ``vector`` (a padded vector), as a view of ``shapes[i]``."""
        return [vector[at : at + n].view(shape)
                for at, n, shape in zip(self.offsets, self.numels, shapes)]  # fmt: skip

    def pieces(self, rank: int) -> list[Piece]:
        """The parts of the tensors that lie in ``rank``'s shard, in the shard's order."""
        start, end = rank * self.shard_numel, (rank + 1) * self.shard_numel
        out = []
        for index, (at, n) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(start, at), min(end, at + n)
            if lo < hi:
                out.append(Piece(index, lo - at, lo - start, hi - lo))
        return sorted(out, key=lambda piece: piece.at_shard)

    def owned(self, rank: int) -> list[int]:
        """The tensors that lie whole in ``rank``'s shard: what it steps in their real shapes."""
        return [p.index for p in self.pieces(rank) if p.numel == self.numels[p.index]]


def flat_layout(numels: Sequence[int], world_size: int) -> ShardLayout:
    """The tensors end to end, padded to a multiple of ``world_size`` (module docstring)."""
    offsets = [0, *itertools.accumulate(numels)][: len(numels)]
    shard_numel = max(1, math.ceil(sum(numels) / world_size))
    return ShardLayout(numels, offsets, shard_numel, world_size, whole=False)


def balanced_owners(
    numels: Sequence[int], slots: int, costs: Sequence[float] | None = None
) -> list[int]:
    """An owner among ``slots`` for each tensor, balanced by ``costs`` (default: the elements):
    largest first onto the least loaded slot (fewest elements, then the lowest, on a tie)."""
    costs = list(numels) if costs is None else list(costs)
    load, elements = [0.0] * slots, [0] * slots
    owner = [0] * len(numels)
    for index in sorted(range(len(numels)), key=lambda i: (-costs[i], -numels[i], i)):
        slot = min(range(slots), key=lambda r: (load[r], elements[r], r))
        owner[index] = slot
        load[slot] += costs[index]
        elements[slot] += numels[index]
    return owner


def whole_parameter_layout(
    numels: Sequence[int], world_size: int, costs: Sequence[float] | None = None,
    owners: Sequence[int] | None = None,
) -> ShardLayout:  # fmt: skip
    """Each tensor whole in one rank's shard: ``owners[i]``'s, or balanced by ``costs``
    (:func:`balanced_owners`); inside a shard the tensors keep the group's order. Every shard
    is as long as the longest (module docstring)."""
    owner = list(balanced_owners(numels, world_size, costs) if owners is None else owners)
    elements = [0] * world_size
    for index, rank in enumerate(owner):
        elements[rank] += numels[index]
    shard_numel = max(1, *elements)
    offsets, filled = [0] * len(numels), [0] * world_size
    for index, n in enumerate(numels):
        rank = owner[index]
        offsets[index] = rank * shard_numel + filled[rank]
        filled[rank] += n
    return ShardLayout(numels, offsets, shard_numel, world_size, whole=True)
