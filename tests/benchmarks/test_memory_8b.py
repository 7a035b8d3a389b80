"""The 8B memory calculator: its arithmetic, and every shipped 8B config fits an H100."""

from __future__ import annotations

import pathlib

import pytest

from benchmarks.memory_8b import GIB, NODES, model_facts, per_gpu_bytes

ROOT = pathlib.Path(__file__).parents[2]
CONFIGS = sorted((ROOT / "torchtitan_configs").glob("llama3_8b_*.toml"))


@pytest.fixture(scope="module")
def facts() -> dict[str, int]:
    return model_facts()


def test_the_arithmetic_of_one_row(facts) -> None:
    row = per_gpu_bytes(ROOT / "torchtitan_configs" / "llama3_8b_acco.toml", 4, facts)
    local = facts["params"] / 8  # TP 8, no PP, no FSDP
    assert facts["params"] == 8_030_261_248
    assert row["replicas"] == 4
    assert row["params"] == round(local * 2 / GIB, 2)  # bf16
    assert row["grads"] == round(local * 4 / GIB, 2)  # fp32 accumulator
    # fp32 master + AdamW m, v + bf16 reduce and gather staging + the master's fp32 gradient
    # (the reduced sum is bf16) + acco's carried sum, over 4
    assert row["optimizer"] == round(local * (4 + 8 + 2 + 2 + 4 + 4) / 4 / GIB, 2)
    # under torchft a node is a replica group of one data-parallel rank (TP 8): it holds the
    # whole optimizer state, whatever the number of nodes
    assert row["optimizer_torchft"] == round(local * (4 + 8 + 2 + 2 + 4 + 4) / GIB, 2)
    assert row["total_torchft"] == pytest.approx(
        row["total"] - row["optimizer"] + row["optimizer_torchft"], abs=0.02
    )


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_8b_config_fits_an_h100_wherever_it_runs(path: pathlib.Path, facts) -> None:
    rows = {nodes: per_gpu_bytes(path, nodes, facts) for nodes in NODES}
    assert rows[4]["runs"] and rows[16]["runs"]
    for nodes, row in rows.items():
        assert not row["runs"] or row["fits_h100_80gb"], (nodes, row)
