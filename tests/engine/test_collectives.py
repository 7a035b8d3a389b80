"""The gloo ring collectives equal torch's native ones."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed


def ring_vs_native(rank: int, world_size: int, dtype: torch.dtype) -> dict:
    import os

    from acco_hooks.engine import collectives

    group = dist.new_group(list(range(world_size)))
    shard = 13
    g = torch.Generator().manual_seed(rank)
    inputs = torch.randn(world_size * shard, generator=g).to(dtype)
    out = {}
    for ring in ("1", "0"):
        os.environ["ACCO_HOOKS_GLOO_RING"] = ring
        rs = torch.empty(shard, dtype=dtype)
        collectives.reduce_scatter_sum(rs, inputs, group)
        ag = torch.empty(world_size * shard, dtype=dtype)
        collectives.all_gather(ag, inputs[:shard] * (rank + 1), group)
        out[ring] = (rs, ag)
    expected = torch.zeros(world_size * shard, dtype=torch.float64)
    for r in range(world_size):
        expected += torch.randn(world_size * shard, generator=torch.Generator().manual_seed(r)).to(dtype)
    out["expected_rs"] = expected.view(world_size, shard)[rank]
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_reduce_scatter_and_all_gather_equal_native(world_size: int) -> None:
    # fresh processes: each rank sets ACCO_HOOKS_GLOO_RING for itself
    outs = run_distributed("tests.engine.test_collectives:ring_vs_native", world_size,
                           torch.float32, fresh_processes=True)  # fmt: skip
    for out in outs:
        (ring_rs, ring_ag), (native_rs, native_ag) = out["1"], out["0"]
        torch.testing.assert_close(ring_rs.double(), out["expected_rs"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ring_rs, native_rs, rtol=1e-6, atol=1e-6)
        assert torch.equal(ring_ag, native_ag)
        if world_size == 2:  # a + b == b + a: two ranks are bit-identical whatever the order
            assert torch.equal(ring_rs, native_rs)
