"""The sweep's and the overhead benchmark's workers run through the public API, and the sweep
builds the law's arm from a link's figures (the netbed itself needs root: not run here)."""

from __future__ import annotations

import json

import pytest

from benchmarks import auto_sweep
from benchmarks.harness import ROOT, result_lines, run, torchrun


def _worker(argv: list[str]) -> dict:
    (result,) = result_lines(run(torchrun(2, *argv), timeout_s=300, env={"OMP_NUM_THREADS": "1"}))
    return result


@pytest.mark.parametrize("arm", ["acco_fp8", "auto"])
def test_the_sweep_worker_times_every_update(arm: str) -> None:
    settings = auto_sweep.arm_settings(arm, None)
    settings["accumulation_steps"] //= 5  # 4 micro-batches per update (2 + 2 in acco)
    result = _worker(["-m", "benchmarks.auto_sweep", "--worker", "--settings", json.dumps(settings),
                      "--compute", "sleep", "--microbatch-s", "0.002", "--updates", "6",
                      "--timed", "3"])  # fmt: skip
    assert len(result["update_s"]) == 5 and all(t > 0 for t in result["update_s"])
    assert len(result["schedules"]) == 6
    if arm == "acco_fp8":
        assert result["final_schedule"] == [2, 2, "float8_e4m3fn"]
        assert 0.2 < result["estimate_fractions"]["float8_e4m3fn"] < 0.3


def test_the_law_arm_takes_the_schedule_the_law_prices_fastest() -> None:
    fractions = {"float32": 1.0, "bfloat16": 0.5, "float8_e4m3fn": 0.26}
    # c = 10 ms, C = 150 ms: the estimate round (15 micro-batches) hides C, the rest αC
    ddp = {"per_microbatch_s": 0.010, "comm_s": 0.150, "fractions": fractions}
    settings = auto_sweep.arm_settings("law", ddp)
    assert settings == dict(mode="acco", accumulation_steps=5, estimate_microbatches=15,
                            estimate_dtype="float8_e4m3fn")  # fmt: skip
    assert auto_sweep.law_speedup(ddp, [15, 5, "float8_e4m3fn"]) == pytest.approx(0.35 / 0.2)
    assert auto_sweep.arm_settings("law", {**ddp, "comm_s": 0.0}) is None  # nothing to hide


def test_the_overhead_worker_measures_rounds() -> None:
    settings = dict(mode="acco", accumulation_steps=2, fused=True, estimate_dtype="bfloat16")
    result = _worker([str(ROOT / "benchmarks" / "round_overhead.py"), "--worker", "--settings",
                      json.dumps(settings), "--compute", "sleep", "--microbatch-s", "0.002",
                      "--rounds", "6"])  # fmt: skip
    assert result["round_s"] >= result["compute_s"] > 0.0035
    assert 0 <= result["overhead_s"] < result["round_s"]
