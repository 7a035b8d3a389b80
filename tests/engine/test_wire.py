"""The estimate round's narrow formats: their rounding error, and the byte collectives on gloo.

The bounds come from the formats themselves, not from the code: bfloat16 keeps 8 significant
bits (relative error ≤ 2⁻⁸ after rounding to nearest); float8 e4m3 keeps 4 (≤ 2⁻⁴) over the
normal range of a block scaled so that its largest magnitude is 448, and below 2⁻⁶ of the scale
its steps are 2⁻⁹ of the scale (absolute error ≤ 2⁻¹⁰ of it).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from acco_hooks.engine.wire import BLOCK, WireFormat
from tests.dist_utils import run_distributed


def _values(numel: int, seed: int) -> torch.Tensor:
    """Magnitudes over 10 decades, signs mixed, zeros and an all-zero block."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=g) * torch.logspace(-6, 4, numel)[torch.randperm(numel, generator=g)]
    values[::17] = 0.0
    values[BLOCK : 2 * BLOCK] = 0.0
    return values


def _round_trip(dtype: torch.dtype, values: torch.Tensor) -> torch.Tensor:
    wire = WireFormat(dtype)
    data = torch.full((wire.nbytes(values.numel()),), 0xAB, dtype=torch.uint8)
    wire.encode(values, data)
    decoded = torch.full_like(values, float("nan"))
    wire.decode(data, values.numel(), decoded)
    return decoded


@pytest.mark.parametrize("numel", [1, 127, BLOCK, 3 * BLOCK + 5, 600_001])
def test_float8_with_block_scales_rounds_within_e4m3s_precision(numel: int) -> None:
    values = _values(numel, seed=numel)
    decoded = _round_trip(torch.float8_e4m3fn, values)
    padded = torch.nn.functional.pad(values, (0, -numel % BLOCK)).view(-1, BLOCK)
    scale = (padded.abs().amax(dim=1) / 448.0).repeat_interleave(BLOCK)[:numel]
    error = (decoded - values).abs()
    bound = torch.maximum(values.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)
    assert bool((error <= bound).all()), float((error / bound).max())
    assert bool((decoded[values == 0] == 0).all())
    assert values.numel() < 2 or not torch.equal(decoded, values)  # it does round


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_narrower_float_rounds_as_a_cast(dtype: torch.dtype) -> None:
    values = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(_round_trip(dtype, values), values.to(dtype).float())


def test_encoding_leaves_its_input_alone() -> None:
    values = _values(3 * BLOCK + 5, seed=1)
    kept = values.clone()
    WireFormat(torch.float8_e4m3fn).encode(values, torch.empty(1024, dtype=torch.uint8))
    assert torch.equal(values, kept)


def test_a_float8_run_takes_a_quarter_of_float32_and_a_scale_per_block() -> None:
    wire = WireFormat(torch.float8_e4m3fn)
    assert wire.nbytes(1024 * BLOCK) == 1024 * BLOCK + 4 * 1024
    assert wire.nbytes(1) == 8  # runs start 8-byte aligned
    assert WireFormat(torch.bfloat16).nbytes(1000) == 2000


def encoded_collectives(rank: int, world_size: int, dtype: torch.dtype) -> dict:
    from acco_hooks.engine.wire import all_gather_difference, reduce_scatter_encoded

    group = dist.new_group(list(range(world_size)))
    wire, shard = WireFormat(dtype), 3 * BLOCK + 7
    payload = _values(world_size * shard, seed=100 + rank)
    buffer = lambda: torch.empty(world_size * wire.nbytes(shard), dtype=torch.uint8)  # noqa: E731
    summed = torch.empty(shard)
    reduce_scatter_encoded(summed, payload, wire, buffer(), buffer(), group)
    difference = _values(shard, seed=200 + rank)
    gathered = torch.empty(world_size * shard)
    encoded_shard = torch.empty(wire.nbytes(shard), dtype=torch.uint8)
    all_gather_difference(gathered, difference, wire, encoded_shard, buffer(), group)
    return {"summed": summed, "gathered": gathered}


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_encoded_collectives_sum_and_gather_every_ranks_rounded_values(
    dtype: torch.dtype, world_size: int
) -> None:
    """Reduce-scatter: each rank's chunk rounded alone, then summed in float32 in rank order;
    all-gather: each rank's shard rounded alone. Reference: the round trip of one rank."""
    shard = 3 * BLOCK + 7
    results = run_distributed(f"{__name__}:encoded_collectives", world_size, dtype)
    for rank, result in enumerate(results):
        expected = torch.zeros(shard)
        for source in range(world_size):
            chunk = _values(world_size * shard, seed=100 + source)[rank * shard : (rank + 1) * shard]
            expected += _round_trip(dtype, chunk)
        torch.testing.assert_close(result["summed"], expected, rtol=1e-6, atol=0.0)
        gathered = torch.cat([_round_trip(dtype, _values(shard, seed=200 + r)) for r in range(world_size)])
        assert torch.equal(result["gathered"], gathered)


@pytest.mark.parametrize("dtype, per_value", [(None, 0.0), ("bfloat16", 2.0),
                                              ("float8_e4m3fn", 1 + 4 / BLOCK)])  # fmt: skip
def test_a_narrow_estimate_costs_one_encoded_model_and_two_shards(dtype, per_value) -> None:
    from acco_hooks import ACCOOptimizer

    model = torch.nn.Linear(1000, 1000)  # 1,001,000 parameters, one process: the shard is all
    opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, estimate_dtype=dtype)
    memory = opt.engine.memory_bytes()
    opt.close()
    numel = 1_001_000
    expected = 0 if dtype is None else 2 * per_value * numel + 4 * numel  # wire, shard; θ̃ − θ
    assert memory["estimate_wire"] == pytest.approx(expected, abs=64)
    assert memory["comm_buffer"] == 4 * numel
