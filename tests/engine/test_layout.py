"""Shard layouts: where a parameter group's tensors lie in the padded vector (``engine.layout``)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from acco_hooks.engine.layout import balanced_owners, flat_layout, whole_parameter_layout

sizes = st.lists(st.integers(min_value=1, max_value=300), min_size=1, max_size=12)
ranks = st.integers(min_value=1, max_value=5)


def _covered(layout) -> list[int]:
    """How many tensors cover each element of the padded vector."""
    cover = [0] * layout.padded_numel
    for at, n in zip(layout.offsets, layout.numels):
        for i in range(at, at + n):
            cover[i] += 1
    return cover


@settings(max_examples=200, deadline=None)
@given(numels=sizes, world_size=ranks)
def test_the_flat_layout_lays_tensors_end_to_end_and_pads_under_n(numels, world_size):
    layout = flat_layout(numels, world_size)
    assert not layout.whole
    assert list(layout.offsets) == [sum(numels[:i]) for i in range(len(numels))]
    assert 0 <= layout.padding < world_size
    assert _covered(layout) == [1] * sum(numels) + [0] * layout.padding


@settings(max_examples=200, deadline=None)
@given(numels=sizes, world_size=ranks)
def test_the_whole_parameter_layout_keeps_each_tensor_in_one_shard(numels, world_size):
    layout = whole_parameter_layout(numels, world_size)
    assert layout.whole
    assert max(_covered(layout)) == 1  # no element holds two tensors
    owners = {}
    for rank in range(world_size):
        for piece in layout.pieces(rank):
            assert piece.at_tensor == 0 and piece.numel == numels[piece.index]
            owners.setdefault(piece.index, []).append(rank)
        assert layout.owned(rank) == [p.index for p in layout.pieces(rank)]
        # inside a shard the tensors keep the group's order
        assert layout.owned(rank) == sorted(layout.owned(rank))
    assert sorted(owners) == list(range(len(numels)))
    assert all(len(r) == 1 for r in owners.values())
    # largest first onto the least loaded rank: no shard exceeds the mean by more than the
    # largest tensor, and the padding reported is what no tensor covers
    assert layout.shard_numel <= sum(numels) / world_size + max(numels)
    assert layout.padding == _covered(layout).count(0)


def test_views_place_each_tensor_and_pieces_cut_at_shard_boundaries():
    shapes = [(2, 3), (4,), (3, 3)]
    numels = [6, 4, 9]
    vector = torch.arange(24.0)
    flat = flat_layout(numels, 2)  # 19 elements, shards of 10
    assert [tuple(v.shape) for v in flat.views(vector, shapes)] == shapes
    assert flat.views(vector, shapes)[2].flatten().tolist() == list(range(10, 19))
    # the 4-vector straddles: 6..9 is rank 0's; 10..18 (the matrix) rank 1's
    assert [tuple(p) for p in flat.pieces(1)] == [(2, 0, 0, 9)]
    assert [tuple(p) for p in flat.pieces(0)] == [(0, 0, 0, 6), (1, 0, 6, 4)]
    assert flat.owned(0) == [0, 1]
    whole = whole_parameter_layout(numels, 2)  # 9 to rank 0, then 6 to rank 1, 4 to rank 1
    assert whole.shard_numel == 10 and whole.padding == 1
    assert whole.owned(0) == [2] and whole.owned(1) == [0, 1]
    assert whole.views(vector, shapes)[0].flatten().tolist() == list(range(10, 16))


@settings(max_examples=100, deadline=None)
@given(numels=sizes, replicas=ranks, shards=st.integers(min_value=1, max_value=4))
def test_owners_on_a_grid_keep_each_fsdp_piece_in_its_owners_replica(numels, replicas, shards):
    """Under FSDP each matrix gets an owner among replicas × FSDP ranks; every FSDP rank lays its
    piece of the matrix in the shard of the owner's replica (``whole_pieces``)."""
    slots = balanced_owners(numels, replicas * shards)
    assert all(0 <= slot < replicas * shards for slot in slots)
    # no slot holds more than the mean plus the largest matrix
    load = [sum(n for n, s in zip(numels, slots) if s == slot) for slot in range(replicas * shards)]
    assert max(load) <= sum(numels) / (replicas * shards) + max(numels)
    layout = whole_parameter_layout(numels, replicas, owners=[s // shards for s in slots])
    for index, slot in enumerate(slots):
        assert index in layout.owned(slot // shards)
    # one slot a replica: the owners of the layout that balances by itself
    if shards == 1:
        alone = whole_parameter_layout(numels, replicas)
        assert layout.offsets == alone.offsets and layout.shard_numel == alone.shard_numel
