"""benchmarks/convergence/gap_map.py: each point's settings (one rank, 4 micro-batches an update
in every arm, the same held-out sequences, a validation at the last update), ddp's best learning
rate, and the map's plan from it."""

from __future__ import annotations

import argparse

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
            "overrides": ["--optimizer.lr", f"{lr:g}"],
            "summary": {"heldout_loss_final": loss}}  # fmt: skip


def test_the_best_learning_rate_is_ddps_lowest_held_out_loss_that_finished() -> None:
    results = {"runs": {str(i): r for i, r in enumerate([
        record(32, 8e-4, "ddp", 4.7), record(32, 1.6e-3, "ddp", 4.4),
        record(32, 3.2e-3, "ddp", float("nan")),  # diverged
        record(32, 6.4e-3, "ddp", 4.1, complete=False),  # cut short
        record(32, 3.2e-3, "acco", 4.0),  # another arm
        record(8, 3.2e-3, "ddp", 4.0),  # another batch
    ])}}  # fmt: skip
    assert gap_map.best_lr(results, 32) == 1.6e-3
    assert gap_map.best_lr(results, 128) is None
    args = argparse.Namespace(phase="map", batches=[32], seeds=[0], lr_factors=[1, 2],
                              arms=["ddp", "acco"], out="x")  # fmt: skip
    planned = {spec.key for spec in gap_map.plan(args, results)}
    assert planned == {f"gap/b32-lr{lr:g}/stdlib-sequences/{arm}/seed0"
                       for lr in (1.6e-3, 3.2e-3) for arm in ("ddp", "acco")}  # fmt: skip
    args.batches = [128]
    with pytest.raises(SystemExit, match="no complete ddp sweep at batch 128"):
        gap_map.plan(args, results)
