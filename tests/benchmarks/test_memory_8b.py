"""The 8B memory calculator: its arithmetic, every shipped 8B config fits an H100, and torchft's
DiLoCo in the same layouts, whose arithmetic a small run of DiLoCo itself measures."""

from __future__ import annotations

import pathlib

import pytest

from benchmarks.memory_8b import (
    GIB,
    NODES,
    check_diloco,
    diloco_per_gpu_bytes,
    model_facts,
    per_gpu_bytes,
)

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
    for fragments, delay in ((1, 0), (2, 1)):  # DiLoCo and streaming DiLoCo, in the same layout
        row = diloco_per_gpu_bytes(path, facts, fragments, delay)
        assert row["fits_h100_80gb"], (fragments, row)


def test_the_arithmetic_of_one_diloco_row(facts) -> None:
    """TP 8 fills a node: a replica group of one model replica, no FSDP inside it; every
    buffer fp32, parameter-sized, on the GPU but the backup."""
    config = ROOT / "torchtitan_configs" / "llama3_8b_acco.toml"
    row = diloco_per_gpu_bytes(config, facts, fragments=1, sync_delay=0, ndigits=None)
    local = facts["params"] / 8
    assert row["fsdp_in_group"] == 1
    assert row["params"] * GIB == row["grads"] * GIB == row["outer_momentum"] * GIB == 4 * local
    assert row["optimizer"] * GIB == 8 * local  # AdamW's m and v
    assert row["pseudo_gradient_held"] == 0
    # the pseudo-gradient and a copy of the local parameters, and one tensor of the backup
    # copied to the GPU: the embedding, TP-sharded
    assert row["sync_extra"] * GIB == 8 * local + 4 * facts["largest"] / 8
    assert row["total_at_sync"] == pytest.approx(20 * local / GIB + row["sync_extra"])
    assert row["total"] == max(row["total_training"], row["total_at_sync"])
    assert row["host_backup"] * GIB == 4 * local
    # TP without FSDP: torchtitan 0.2.2 computes fp32 parameters in fp32, twice the estimate's
    engine = per_gpu_bytes(config, 4, facts, ndigits=None)
    assert row["activations_estimate"] == 2 * engine["activations_estimate"]
    hsdp = ROOT / "torchtitan_configs" / "llama3_8b_hsdp_acco.toml"  # FSDP's bf16 compute
    assert diloco_per_gpu_bytes(hsdp, facts, ndigits=None)["activations_estimate"] == (
        per_gpu_bytes(hsdp, 4, facts, ndigits=None)["activations_estimate"])
    streaming = diloco_per_gpu_bytes(config, facts, fragments=2, sync_delay=1, ndigits=None)
    assert streaming["pseudo_gradient_held"] * GIB == 4 * local / 2  # one fragment's, held
    assert streaming["total_training"] == pytest.approx(row["total_training"] + 2 * local / GIB)
    # nothing is sharded across groups: ZeRO-1's ACCO holds less per GPU from 4 nodes on
    assert per_gpu_bytes(config, 4, facts)["total"] < round(row["total"], 2)


@pytest.mark.parametrize(("fragments", "sync_delay"), [(1, 0), (2, 1)],
                         ids=["diloco", "streaming"])  # fmt: skip
def test_diloco_allocates_what_the_calculator_counts(fragments: int, sync_delay: int) -> None:
    """torchft's DiLoCo itself on the debug model, on this CPU: its outer momentum and backup
    are the arithmetic's, and each sync allocates, byte for byte, what the arithmetic says for
    a backup on the parameters' device. Not checked here: the GPU's copy of one backup tensor,
    pinned memory, what a real Manager's all-reduce allocates."""
    check = check_diloco(fragments, sync_delay, periods=2)
    assert check["outer_momentum"] == check["predicted"]["outer_momentum"] == 4 * check["params"]
    assert check["host_backup"] == check["predicted"]["host_backup"]
    assert len(check["syncs"]) == fragments
    assert {sync["fragment"] for sync in check["syncs"]} == set(range(fragments))
    for sync in check["syncs"]:
        assert sync["sync_extra"] == sync["predicted"]["sync_extra"] == 8 * sync["fragment_numel"]
        assert sync["pseudo_gradient_held"] == sync["predicted"]["pseudo_gradient_held"]
