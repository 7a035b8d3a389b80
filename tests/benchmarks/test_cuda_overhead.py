"""The GPU overhead benchmark's harness, on the CPU: its arms run through train_titan.py, every
run's figures and log are kept, and arms without the baseline are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _benchmark(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.cuda_overhead", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def test_the_smoke_run_times_each_arm_and_keeps_its_log() -> None:
    done = _benchmark("--smoke", "--arms", "titan,acco")
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((ROOT / "outputs" / "cuda_overhead_smoke.json").read_text())
    assert results["complete"] and results["arms"] == ["titan", "acco"]
    assert set(results["summary"]) == {"titan", "acco"}
    assert results["summary"]["titan"]["overhead_vs_titan"] == 0
    for arm in ("titan", "acco"):
        (run,) = results["runs"][arm]
        assert run["update_s"] > 0 and run["peak_memory_gib"] > 0
        assert len(run["step_s_all"]) >= 2  # steps >= 3 of 4 (acco: 8 rounds)
        log = ROOT / "outputs" / "cuda_overhead" / f"{arm}_0.log"
        assert "step:  4" in log.read_text()


def test_arms_without_the_baseline_are_refused() -> None:
    done = _benchmark("--smoke", "--arms", "acco,ddp")
    assert done.returncode == 2
    assert "titan among them" in done.stderr, done.stderr[-2000:]
