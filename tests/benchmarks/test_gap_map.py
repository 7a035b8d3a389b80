"""benchmarks/convergence/gap_map.py: each point's settings (one rank, 4 micro-batches an update
in every arm, the same held-out sequences, a validation at the last update), ddp's best learning
rate, and the map's plan from it."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.convergence import gap_map, run


def value(overrides, name):
    return run.override_value(overrides, name)


@pytest.mark.parametrize("batch", sorted(gap_map.UPDATES))
def test_every_arm_of_a_point_runs_its_batch_in_four_micro_batches_on_one_rank(batch) -> None:
    point = gap_map.Point(batch, 1.6e-3)
    updates, every = gap_map.UPDATES[batch]
    assert updates % every == 0  # the last validation scores the run
    for arm, per_step in (("ddp", batch), ("acco", batch // 2), ("acco_split_fp8", batch // 2)):
        spec = gap_map.spec_for(point, arm, seed=1)
        o = spec.overrides
        assert value(o, "--training.global_batch_size") == str(per_step)
        assert int(value(o, "--training.local_batch_size")) == batch // 4
        assert value(o, "--parallelism.data_parallel_replicate_degree") == "1"
        assert value(o, "--optimizer.lr") == "0.0016"
        # the same 512 held-out sequences for every run
        assert int(value(o, "--validation.steps")) * int(value(o, "--validation.local_batch_size")) == 512
        assert spec.key == f"gap/b{batch}-lr0.0016/stdlib-sequences/{arm}/seed1"
        assert spec.steps == (2 * updates if arm != "ddp" else updates)
    split = gap_map.spec_for(point, "acco_split_fp8", 0).overrides
    assert value(split, "--acco.estimate_microbatches") == "3"
    assert value(split, "--acco.estimate_dtype") == "float8_e4m3fn"


def record(batch: float, lr: float, arm: str, loss: float, complete: bool = True) -> dict:
    return {"experiment": f"gap/b{batch}-lr{lr:g}", "arm": arm, "seed": 0, "complete": complete,
            "overrides": ["--optimizer.lr", f"{lr:g}"], "data_order": "sequences",
            "heldout_loss": [9.0, loss], "summary": {"heldout_loss_final": loss}}  # fmt: skip


def test_the_best_learning_rate_is_ddps_lowest_held_out_loss_that_finished() -> None:
    results = {"runs": {str(i): r for i, r in enumerate([
        record(32, 8e-4, "ddp", 4.7), record(32, 1.6e-3, "ddp", 4.4),
        record(32, 3.2e-3, "ddp", float("nan")),  # diverged
        record(32, 6.4e-3, "ddp", 4.1, complete=False),  # cut short
        record(32, 3.2e-3, "acco", 4.0),  # another arm
        record(8, 3.2e-3, "ddp", 4.0),  # another batch
        {**record(32, 8e-4, "ddp", 3.9), "data_order": "parts2x4"},  # non-i.i.d.
        {**record(32, 8e-4, "ddp", 3.8), "experiment": "gap/b32-lr0.0008-w768"},  # wider
    ])}}  # fmt: skip
    assert gap_map.best_lr(results, 32) == 1.6e-3
    assert gap_map.best_lr(results, 128) is None
    assert gap_map.best_lr(results, 32, width=768) == 8e-4
    args = argparse.Namespace(phase="map", batches=[32], seeds=[0], lr_factors=[1, 2],
                              arms=["ddp", "acco"], out="x", data="iid", width=256,
                              warmup=2)  # fmt: skip
    planned = {spec.key for spec in gap_map.plan(args, results)}
    assert planned == {f"gap/b32-lr{lr:g}/stdlib-sequences/{arm}/seed0"
                       for lr in (1.6e-3, 3.2e-3) for arm in ("ddp", "acco")}  # fmt: skip
    args.batches = [128]
    with pytest.raises(SystemExit, match="no complete ddp sweep at batch 128"):
        gap_map.plan(args, results)


def test_replicas_on_their_own_parts_read_whole_documents_in_turns_of_a_block() -> None:
    from benchmarks.convergence import data

    documents = [[f"d{d}s{s}" for s in range(n)] for d, n in enumerate([5, 1, 4, 6, 2, 3])]
    stream = data.replica_stream(documents, seed=3, replicas=2, block=2)
    first = {s for doc in documents[:3] for s in doc}  # 10 sequences before the 4th document
    second = {s for doc in documents[3:] for s in doc}  # 11
    assert len(stream) == 20 and len(set(stream)) == 20  # 5 blocks of 2 from each part
    for k in range(0, 20, 2):
        assert set(stream[k : k + 2]) <= (first if k % 4 == 0 else second)
    assert stream[::4] != sorted(stream[::4])  # shuffled within the part
    assert stream == data.replica_stream(documents, seed=3, replicas=2, block=2)
    assert stream != data.replica_stream(documents, seed=4, replicas=2, block=2)


def test_the_non_iid_wide_and_warm_up_points_change_the_data_model_or_schedule_only() -> None:
    point = gap_map.Point(32, 6.4e-3)
    iid = gap_map.spec_for(point, "acco", 1)
    parts = gap_map.spec_for(point, "acco", 1, "parts")
    wide = gap_map.spec_for(gap_map.Point(32, 6.4e-3, 768), "acco", 1)
    warm = gap_map.spec_for(gap_map.Point(32, 6.4e-3, warmup=20), "acco", 1)
    # each replica's micro-batch is half the rank's: 4 of its 8 sequences
    assert parts.key == "gap/b32-lr0.0064/stdlib-parts2x4/acco/seed1"
    assert value(parts.overrides, "--training.dataset_path").endswith("parts2x4-seed1-len64")
    assert wide.key == "gap/b32-lr0.0064-w768/stdlib-sequences/acco/seed1"
    assert value(wide.overrides, "--model.flavor") == "debugmodel_w768"
    assert warm.key == "gap/b32-lr0.0064-wu20/stdlib-sequences/acco/seed1"
    assert value(warm.overrides, "--lr_scheduler.warmup_steps") == "20"
    for spec in (parts, wide, warm):
        changed = {o for o in spec.overrides if o.startswith("--")} ^ {
            o for o in iid.overrides if o.startswith("--")}
        assert changed <= {"--model.flavor", "--lr_scheduler.warmup_steps"}
    assert gap_map.point_of({"experiment": wide.experiment}) == gap_map.Point(32, 6.4e-3, 768)
    assert gap_map.point_of({"experiment": warm.experiment}) == gap_map.Point(32, 6.4e-3,
                                                                              warmup=20)
    assert gap_map.point_of({"experiment": parts.experiment}) == point
    with pytest.raises(ValueError, match="width 300"):
        gap_map.spec_for(gap_map.Point(32, 6.4e-3, 300), "acco", 0)


def test_the_wide_flavors_are_the_debug_model_at_another_width() -> None:
    from torchtitan.models import llama3

    import benchmarks.convergence.slow_rank  # noqa: F401  (registers them, as custom_import does)

    debug = llama3.llama3_args["debugmodel"]
    for dim in (512, 768, 1024):
        wide = llama3.llama3_args[f"debugmodel_w{dim}"]
        assert wide.dim == dim and (wide.n_layers, wide.n_heads, wide.vocab_size) == (
            debug.n_layers, debug.n_heads, debug.vocab_size)


def test_the_report_pairs_gaps_by_seed_and_asks_for_a_third_seed_where_the_gap_is_in_the_noise(
        tmp_path) -> None:  # fmt: skip
    def run_of(lr, arm, seed, loss):
        return {**record(32, lr, arm, loss), "seed": seed}

    runs = [run_of(1.6e-3, "ddp", 0, 4.0),  # the sweep: ddp's best (seed 0)
            run_of(8e-4, "ddp", 0, 4.2), run_of(8e-4, "ddp", 1, 4.4),
            run_of(8e-4, "acco", 0, 4.0), run_of(8e-4, "acco", 1, 4.3),
            run_of(1.6e-3, "ddp", 1, 4.4),
            run_of(1.6e-3, "acco", 0, 4.04), run_of(1.6e-3, "acco", 1, 4.444),  # +1 %, +1 %
            run_of(1.6e-3, "acco_split_fp8", 0, 4.0), run_of(1.6e-3, "acco_split_fp8", 1, 4.4),
            run_of(1.6e-3, "acco_split_fp8", 2, 9.9)]  # a third seed without ddp's: unpaired
    runs[6]["heldout_loss"] = [9.0, 3.96, 4.04]  # acco seed 0 rose late: its lowest is 1 % below
    results = {"runs": {str(i): r for i, r in enumerate(runs)}}
    summary = gap_map.summarize(results)
    rows = {(r["lr"], r["arm"]): r for r in summary["points"]}
    acco = rows[(1.6e-3, "acco")]
    assert acco["lr_factor"] == 1
    assert acco["gap_pct"] == pytest.approx({"0": 1.0, "1": 1.0})
    assert acco["gap_pct_mean"] == pytest.approx(1.0) and acco["seeds_wanted"] == 2
    assert acco["lowest"] == {"0": 3.96, "1": 4.444}
    assert acco["lowest_gap"]["gap_pct"] == pytest.approx({"0": -1.0, "1": 1.0})
    split = rows[(1.6e-3, "acco_split_fp8")]
    assert set(split["gap_pct"]) == {"0", "1"} and split["seeds_wanted"] == 3  # 0 ± 0: in noise
    low = rows[(8e-4, "acco")]  # -4.76 %, -2.27 %: mean -3.5, std 1.8: within 3x its spread
    assert low["lr_factor"] == 0.5 and low["seeds_wanted"] == 3
    best = {r["arm"]: r for r in summary["own_best"]}
    # ddp: 1.6e-3 (mean 4.2 over seeds 0 1) beats 8e-4 (4.3); acco: 8e-4 (4.15) beats 4.242
    assert best["ddp"]["lr"] == 1.6e-3 and best["acco"]["lr"] == 8e-4
    assert best["acco"]["gap_pct"] == pytest.approx({"0": 0.0, "1": 100 * (4.3 - 4.4) / 4.4})
    # the split arm's best compares seeds 0 and 1 only (the one rate it ran on 2+ seeds)
    assert best["acco_split_fp8"]["lr"] == 1.6e-3
    results["runs"]["x"] = run_of(8e-4, "acco_split_fp8", 0, 3.0)  # one seed: not a candidate
    assert {r["arm"]: r["lr"] for r in gap_map.summarize(results)["own_best"]}["acco_split_fp8"] == 1.6e-3
    gap_map.plot(results, tmp_path / "map.png")
    assert (tmp_path / "map.png").stat().st_size > 0


def test_runs_added_by_two_processes_to_one_file_are_all_kept(tmp_path) -> None:
    out = tmp_path / "map.json"
    gap_map.add_run(out, "a", {"x": 1})
    # another process adds its run: this one, which read the file before, must not drop it
    other = json.loads(out.read_text())
    other["runs"]["b"] = {"x": 2}
    out.write_text(json.dumps(other))
    assert set(gap_map.add_run(out, "c", {"x": 3})["runs"]) == {"a", "b", "c"}
    assert set(json.loads(out.read_text())["runs"]) == {"a", "b", "c"}
