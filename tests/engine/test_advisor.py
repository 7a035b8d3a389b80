"""The per-token speedup law, and the advisor that measures it on the engine's own rounds."""

from __future__ import annotations

import json
import logging
import pathlib
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from acco_hooks import ACCOOptimizer
from acco_hooks.engine.advisor import UNEQUAL_SPEED, Advisor, predicted_speedup
from tests.dist_utils import run_distributed

ROOT = pathlib.Path(__file__).parents[2]


@pytest.mark.parametrize("compute, comm, expected", [
    (1.0, 0.0, 1.0),     # nothing to hide
    (1.0, 0.5, 1.25),
    (1.0, 1.0, 1.5),     # the ceiling: one round's compute hides one round's communication
    (1.0, 2.0, 1.0),     # two communications per update cost what one synchronous one saves
    (1.0, 4.0, 0.75),
])  # fmt: skip
def test_the_law_at_its_landmarks(compute: float, comm: float, expected: float) -> None:
    # Synchronous ZeRO-1 over 2k micro-batches: 2K + C; ACCO over the same tokens: 2 max(K, C).
    assert predicted_speedup(compute, comm) == pytest.approx(expected)
    assert predicted_speedup(compute, comm) == pytest.approx(
        (2 * compute + comm) / (2 * max(compute, comm))
    )


def _feed(advisor: Advisor, rounds: int, quiet_s: float, overlapped_s: float, comm_s: float,
          round_s: float) -> None:
    """``rounds`` rounds of 4 micro-batches: the first undisturbed, the rest overlapping."""
    for _ in range(rounds):
        advisor.record_microbatch(quiet_s, communicating=False)
        for _ in range(3):
            advisor.record_microbatch(overlapped_s, communicating=True)
        advisor.record_comm(comm_s)
        advisor.record_round(round_s, microbatches=4)


def test_the_advisor_warns_with_the_fix_when_communication_dominates() -> None:
    advisor = Advisor(accumulation_steps=4)
    _feed(advisor, 2, quiet_s=9.0, overlapped_s=9.0, comm_s=9.0, round_s=9.0)  # warm-up: ignored
    _feed(advisor, 4, quiet_s=0.25, overlapped_s=0.5, comm_s=3.0, round_s=3.1)
    # K from undisturbed micro-batches only: 4 x 0.25 (the 9 s warm-up ones are outvoted)
    assert advisor.figures["compute_per_round_s"] == pytest.approx(1.0)
    assert advisor.figures["comm_per_round_s"] == 3.0 and advisor.figures["round_s"] == 3.1
    assert advisor.figures["ideal_speedup"] == pytest.approx(5 / 6)  # (2 + 3) / (2 x 3)
    assert advisor.figures["predicted_speedup"] == pytest.approx(5 / 6.2)  # (2K + C) / 2T
    advice = advisor.advice()
    assert advice.startswith("acco advisor: compute_per_round=1.0000s comm_per_round=3.0000s "
                             "predicted_speedup=0.81 round=3.1000s ideal_speedup=0.83")  # fmt: skip
    assert len(advice) < 140, advice  # one short line; the figures are in the metrics
    finding = advisor.finding()
    assert "ACCO is slower here (0.81x" in finding
    assert "accumulation_steps to about 12" in finding and "mode='ddp'" in finding  # C/c = 3/0.25


def test_the_advisor_prices_imperfect_overlap() -> None:
    # C = K: the law allows 1.5, but the rounds take 1.6 K because communication slows compute.
    advisor = Advisor(accumulation_steps=4)
    _feed(advisor, 6, quiet_s=0.25, overlapped_s=0.4, comm_s=1.0, round_s=1.6)
    assert advisor.figures["ideal_speedup"] == pytest.approx(1.5)
    assert advisor.figures["predicted_speedup"] == pytest.approx(3.0 / 3.2)
    assert "although the law allows 1.50" in advisor.finding()


def test_without_undisturbed_microbatches_compute_is_an_upper_bound() -> None:
    advisor = Advisor(accumulation_steps=2)
    for _ in range(6):
        advisor.record_microbatch(0.5, communicating=True)
        advisor.record_comm(2.0)
        advisor.record_round(2.0, microbatches=2)
    assert advisor.figures["compute_per_round_s"] == pytest.approx(1.0)


def test_in_ddp_mode_the_prediction_is_the_law() -> None:
    advisor = Advisor(accumulation_steps=4, overlapping=False)
    _feed(advisor, 6, quiet_s=0.25, overlapped_s=0.25, comm_s=1.0, round_s=2.0)
    assert advisor.figures["predicted_speedup"] == advisor.figures["ideal_speedup"] == 1.5


def test_the_engine_measures_compute_apart_from_a_slow_communication(caplog) -> None:
    # dpu steps the shard optimizer every round; a step pre-hook (on the communication
    # thread) makes each round's communication take >= 0.2 s while compute takes ~0.01 s.
    model = nn.Linear(16, 16)
    opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="dpu", accumulation_steps=2,
                        lr=1e-3)  # fmt: skip
    opt.optimizer.register_step_pre_hook(lambda *_: time.sleep(0.2))
    with caplog.at_level(logging.INFO, logger="acco_hooks"):
        for _ in range(16):
            time.sleep(0.005)
            model(torch.randn(4, 16)).square().mean().backward()
            opt.step()
    opt.close()
    figures = opt.engine.advisor.figures
    assert figures["comm_per_round_s"] >= 0.2 and figures["round_s"] >= 0.2
    assert 0.01 <= figures["compute_per_round_s"] < 0.1, figures  # not the waits, not the comm
    assert figures["ideal_speedup"] < 1 and figures["predicted_speedup"] < 1
    records = [r for r in caplog.records if r.getMessage().startswith("acco advisor:")]
    assert [r.levelno for r in records] == [logging.INFO, logging.WARNING], records
    assert "ACCO is slower here" in records[1].getMessage()


def test_the_engine_logs_one_advisor_line_with_its_figures(caplog) -> None:
    model = nn.Linear(64, 64)
    opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="acco", accumulation_steps=2,
                        lr=1e-3)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="acco_hooks"):
        for _ in range(20):
            model(torch.randn(8, 64)).square().mean().backward()
            opt.step()
    opt.close()
    lines = [r.getMessage() for r in caplog.records
             if r.levelno == logging.INFO and r.getMessage().startswith("acco advisor:")]
    assert len(lines) == 1, lines
    figures = opt.engine.advisor.figures
    assert set(figures) == {"compute_per_round_s", "comm_per_round_s", "round_s",
                            "predicted_speedup", "ideal_speedup"}  # fmt: skip
    assert figures["compute_per_round_s"] > 0 and figures["comm_per_round_s"] > 0
    assert f"predicted_speedup={figures['predicted_speedup']:.2f}" in lines[0]


SLOW_COMMUNICATION_LOOP = """
import time, torch
from torch import nn
from acco_hooks import ACCOOptimizer
model = nn.Linear(16, 16)
opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="dpu", accumulation_steps=2,
                    lr=1e-3)
opt.optimizer.register_step_pre_hook(lambda *_: time.sleep(0.1))
for _ in range(16):
    time.sleep(0.005)
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
opt.close()
"""


def test_a_user_without_logging_configured_sees_that_acco_is_slower() -> None:
    """The finding that should change what the user does is printed with Python's defaults
    (no logging.basicConfig): once, and without the INFO figures line."""
    done = subprocess.run([sys.executable, "-c", SLOW_COMMUNICATION_LOOP], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    shown = [line for line in done.stderr.splitlines() if line.startswith("acco advisor:")]
    assert len(shown) == 1 and "ACCO is slower here" in shown[0], done.stderr[-3000:]
    assert "mode='ddp'" in shown[0]


def test_a_front_end_that_marks_its_micro_batches_times_those_alone() -> None:
    """The loop marks each real micro-batch's start (``start_microbatch``) and pads every round
    with empty ones, as the HF Trainer pads a short step: K is the marked micro-batches'
    compute (each >= 20 ms here), not pulled toward zero by the three in four that ran none."""
    model = nn.Linear(16, 16)
    opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="ddp", accumulation_steps=4,
                        lr=1e-3)  # fmt: skip
    for _ in range(8):  # rounds: the advisor concludes after its 2 + 4
        opt.engine.start_microbatch()
        time.sleep(0.02)
        model(torch.randn(4, 16)).square().mean().backward()
        opt.step()
        for _ in range(3):
            opt.engine.skip_microbatch()
    opt.close()
    per_microbatch = opt.engine.advisor.figures["compute_per_round_s"] / 4
    assert per_microbatch >= 0.02, opt.engine.advisor.figures


def _feed_ranks(advisor: Advisor, slowest_s: float, fastest_s: float, comm_s: float) -> None:
    """6 rounds of 4 micro-batches of ``fastest_s`` on this rank, each round's slowest and
    fastest rank as the engine's collective reports them."""
    for _ in range(6):
        for _ in range(4):
            advisor.record_microbatch(fastest_s, communicating=True)
        advisor.take_round_compute()
        advisor.record_comm(comm_s, (slowest_s, fastest_s))
        advisor.record_round(max(comm_s, 4 * slowest_s), microbatches=4)


def test_ranks_of_unequal_speed_are_told_to_accumulate_until_ready() -> None:
    """A fast rank's C holds its wait for the slowest rank: with ranks 2x apart the advice is
    accumulate_until_ready, not the slow link's (more accumulation, DiLoCo), although this
    rank's C is 3x its K; under accumulate_until_ready, or with ranks of one speed, it is not."""
    advisor = Advisor(accumulation_steps=4)
    _feed_ranks(advisor, slowest_s=0.5, fastest_s=0.25, comm_s=3.0)
    assert advisor.figures["slowest_over_fastest"] == pytest.approx(2.0)
    assert advisor.advice().endswith(" slowest_over_fastest=2.00")
    finding = advisor.finding()
    assert "unequal speed" in finding and "2.0x the fastest's" in finding
    assert "accumulate_until_ready=True" in finding and "DiLoCo" not in finding
    assert "max_microbatches_per_round=8" in finding  # 4 a round, the fastest 2x the slowest
    until_ready = Advisor(accumulation_steps=4, until_ready=True)
    _feed_ranks(until_ready, slowest_s=0.5, fastest_s=0.25, comm_s=3.0)
    assert "accumulate_until_ready" not in (until_ready.finding() or "")
    assert "DiLoCo" in until_ready.finding()  # its slow-link advice stands
    equal = Advisor(accumulation_steps=4)
    _feed_ranks(equal, slowest_s=0.25 * (UNEQUAL_SPEED - 0.05), fastest_s=0.25, comm_s=0.5)
    assert equal.finding() is None


def unequal_ranks(rank: int, world_size: int, until_ready: bool) -> tuple[dict, list[str]]:
    """Rank 1 computes 6x as long as rank 0 (a sleep inside its marked micro-batch): this rank's
    advisor figures and the advisor lines it logged at WARNING."""
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="acco", accumulation_steps=2,
                        accumulate_until_ready=until_ready,
                        max_microbatches_per_round=4 if until_ready else None,
                        lr=1e-3)  # fmt: skip
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("acco_hooks").addHandler(handler)
    try:
        while opt.engine.rounds.round_index < 10:
            opt.engine.start_microbatch()
            time.sleep(0.02 if rank == 0 else 0.12)
            model(torch.randn(4, 16)).square().mean().backward()
            opt.step()
        opt.close()
    finally:
        logging.getLogger("acco_hooks").removeHandler(handler)
    return dict(opt.engine.advisor.figures), [m for m in lines if m.startswith("acco advisor:")]


@pytest.mark.parametrize("until_ready", [False, True])
def test_the_engine_finds_a_slower_rank_and_names_accumulate_until_ready(until_ready) -> None:
    """Two gloo ranks, rank 1 6x slower per micro-batch: both ranks' advisors read the slowest
    and the fastest rank's compute from the engine's collective, and rank 0 (which reports)
    warns with accumulate_until_ready unless the engine runs with it."""
    (figures0, lines0), (figures1, lines1) = run_distributed(
        "tests.engine.test_advisor:unequal_ranks", 2, until_ready)
    for figures in (figures0, figures1):
        assert figures["slowest_over_fastest"] >= 2.0, figures  # 0.12 s against 0.02 s
    assert lines1 == []  # rank 0 reports for the job
    named = [line for line in lines0 if "accumulate_until_ready=True" in line]
    assert len(named) == (0 if until_ready else 1), lines0


def _firsts(rows: dict) -> set[str]:
    """The arm that reached the synchronous arm's final held-out loss first, on each seed."""
    seeds = {seed for row in rows.values() for seed in row["time_to_target_s"]}
    return {min((t, name) for name, row in rows.items()
                if (t := row["time_to_target_s"].get(seed)) is not None)[1] for seed in seeds}


def _advisor(compute: float, comm: float, round_s: float) -> Advisor:
    advisor = Advisor(accumulation_steps=4)
    _feed(advisor, 6, quiet_s=compute / 4, overlapped_s=compute / 4, comm_s=comm, round_s=round_s)
    return advisor


@pytest.mark.parametrize("result", ["diloco_vs_acco", "diloco_window"])
def test_the_advice_on_a_slow_link_is_the_measured_regime_map(result: str) -> None:
    """Fed each benchmarked link's K and C (measured by the ddp arm's advisor), the advisor names
    torchft's DiLoCo, with the config lines to try it, exactly where DiLoCo reached the
    synchronous arm's held-out loss first on a seed (docs/results/<result>.json: the regime map
    of docs/when_acco_helps.md), and not where synchronous training or ACCO did; fed ACCO's
    own round time too, it says to use mode='ddp' wherever acco's update was slower than
    ddp's (inside ACCO's window on this CPU: synchronous training reached the loss first)."""
    results = json.loads((ROOT / "docs" / "results" / f"{result}.json").read_text())
    sides = set()
    for rate, rows in results["summary"].items():
        diloco_first = any("diloco" in name for name in _firsts(rows))
        sides.add(diloco_first)
        # ddp's rounds: a whole update's compute, never overlapped; one ACCO round is half of it
        figures = results["timing"][rate]["ddp"]["advisor"]
        compute, comm = figures["compute_per_round_s"] / 2, figures["comm_per_round_s"]
        finding = _advisor(compute, comm, round_s=max(compute, comm)).finding() or ""
        assert ("DiLoCo" in finding) == diloco_first, (rate, rows, comm / compute, finding)
        if diloco_first:
            assert "[fault_tolerance] enable = true" in finding
            assert 'semi_sync_method = "diloco"' in finding
        acco_s, ddp_s = rows["acco"]["update_s"], rows["ddp"]["update_s"]
        if acco_s > ddp_s and not diloco_first:
            finding = _advisor(compute, comm, round_s=acco_s / 2).finding() or ""
            assert "mode='ddp'" in finding, (rate, acco_s, ddp_s, finding)
    assert sides == {True, False}  # a link on each side of the map
