"""The Muon cost benchmark's worker: one short arm on two loopback ranks, its figures checked
against what the recipe and the layout say they must be (the timing itself runs on the
netbed: ``python -m benchmarks.muon_cost``). The arms run one Newton–Schulz iteration (the
worker's ``ns_steps``): what they check does not depend on it, and torch's 5, in bfloat16,
were most of their time on a CPU without AVX-512."""

from __future__ import annotations

from benchmarks.harness import run_ranks


def test_one_arm_reports_the_layouts_the_bytes_and_each_classs_steps() -> None:
    ranks = run_ranks("benchmarks.muon_cost:worker", 2, "muon", "acco", 1, 1, "rank", 1)
    result = ranks[0]
    # Muon's hidden matrices on whole parameters, the rest flat
    assert [layout["kind"] for layout in result["layouts"]] == ["whole", "flat"]
    # 42 matrices of 256x256 and 768x256 split evenly over 2 ranks; the flat vector pads < 2
    assert result["layouts"][0]["padding"] == 0
    assert 0 <= result["layouts"][1]["padding"] < 2
    padded = sum(layout["padded_numel"] for layout in result["layouts"])
    assert padded >= 6_163_712
    assert result["bytes_per_round"] == 2 * 4 * padded
    assert len(result["update_s_all"]) == 1
    # one timed update of acco: Muon steps its update and (a snapshot for) its estimate, AdamW
    # its update alone (its estimate is recomputed without a step)
    assert len(result["shard_step_s_all"]["Muon"]) == 2
    assert len(result["shard_step_s_all"]["AdamW"]) == 1
    memory = result["memory_bytes"]
    assert memory["master_shard"] == 4 * padded // 2
    assert ranks[1]["layouts"] == result["layouts"]


def test_under_hsdp_each_matrix_travels_to_its_owner_and_back_once_a_round() -> None:
    """2 replicas of 2 FSDP ranks: every Muon matrix's FSDP half that its owner does not hold
    is sent to it and back each round (the 42 matrices have even rows: halves), in fp32."""
    ranks = run_ranks("benchmarks.muon_cost:worker", 4, "muon", "ddp", 1, 1, "hsdp", 1)
    matrices = 5_111_808  # the debug model's 42 hidden matrices (benchmarks.muon_step)
    sent = sum(rank["whole_exchange_bytes_per_round"] for rank in ranks)
    assert sent == 2 * 4 * matrices // 2  # gather and scatter, half of each matrix, 4 bytes
    assert all(rank["whole_exchange_s_per_round"] > 0 for rank in ranks)
    owned = [rank["memory_bytes"]["whole_on_owner"] for rank in ranks]
    assert sum(owned) == 2 * 4 * matrices  # each matrix's master and gradient on one rank


def test_the_padding_table_is_the_layouts() -> None:
    """Llama 3 8B's 224 hidden matrices balance without padding up to 32 ranks; with more
    ranks than matrices of a size, shards pad to the largest (w1, w2, w3: 58.7M each)."""
    from benchmarks.muon_cost import padding_by_world_size

    table = padding_by_world_size()
    assert all(table["llama3_8b"][n] == 0.0 for n in (2, 4, 8, 16, 32))
    # at 64 ranks a shard averages 109M elements and the longest holds two 58.7M matrices
    assert table["llama3_8b"][64] == 1 / 14
    assert table["debugmodel"][2] == 0.0 and table["debugmodel"][128] > 0.5  # 42 matrices


def test_the_step_benchmark_times_each_step_and_leaves_the_matrices_muon_steps() -> None:
    """benchmarks.muon_step times torch's Muon itself: one time per step, and the matrices it
    steps are the debug model's 42 hidden ones."""
    from benchmarks.muon_step import DEBUG_MATRICES, step_seconds

    assert len(DEBUG_MATRICES) == 42 and sum(a * b for a, b in DEBUG_MATRICES) == 5_111_808
    times = step_seconds([(8, 8), (6, 4)], repeats=3)
    assert len(times) == 3 and all(t > 0 for t in times)
