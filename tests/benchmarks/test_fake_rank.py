"""One rank at its real shape (``benchmarks/fake_rank.py``) on the CPU: ACCO's engine and
trainer run as rank 0 of a world of 8 on torch's fake backend (torchtitan's ``--comm.mode
fake_backend``, the engine's own process groups included) in the 8B configs' layouts, and what
the engine holds is what the memory calculator predicts for that rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from acco_hooks.titan import TITAN_030
from benchmarks.fake_rank import SMOKE_CASES, SMOKE_RESULTS

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(TITAN_030, reason="--comm.mode fake_backend is torchtitan 0.2.2's")
# the ACCO degree (replicas) and FSDP shards of each smoke case's world of 8
LAYOUTS = {"acco_tp": (4, 1), "hsdp_acco": (4, 2), "zero1_tp": (4, 1)}


def test_each_8b_layout_runs_as_one_rank_of_8_and_holds_the_predicted_shards() -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.fake_rank", "--smoke", "--steps", "4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    results = json.loads(SMOKE_RESULTS.read_text())
    assert results["complete"] and set(results["cases"]) == set(SMOKE_CASES) == set(LAYOUTS)
    for name, case in results["cases"].items():
        replicas, shards = LAYOUTS[name]
        log = (ROOT / "outputs" / "fake_rank" / f"{name}.log").read_text()
        assert f"replicas (ACCO degree)={replicas} FSDP shards per replica={shards}" in log, name
        assert "step:  4" in log, name
        assert case["world_size"] == 8
        # the engine's categories at this rank's real shape: the calculator's arithmetic
        assert set(case["engine_over_predicted"]) == {"params", "grads", "comm_buffer", "optimizer"}
        for category, ratio in case["engine_over_predicted"].items():
            assert ratio == pytest.approx(1.0, abs=0.01), (name, category, case["engine_mib"])
        carried = case["engine_mib"]["carried_shard"]
        assert (carried > 0) == (name != "zero1_tp"), name  # acco's carried half-batch only
        assert case["microbatch_s"] > 0 and len(case["step_s_all"]) == 2  # steps 3 and 4


def test_a_case_it_does_not_have_and_too_few_steps_are_refused() -> None:
    for argv, message in ((("--cases", "acco_3d"), "--cases: unknown ['acco_3d']"),
                          (("--steps", "3"), "--steps 3: K is the median over steps >= 3")):  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "benchmarks.fake_rank", "--smoke", *argv],
                              cwd=ROOT, capture_output=True, text=True, timeout=120,
                              check=False)  # fmt: skip
        assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]
