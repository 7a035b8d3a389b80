"""The per-token speedup law, and the advisor that measures it on the engine's own rounds."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from acco_hooks import ACCOOptimizer
from acco_hooks.advisor import Advisor, predicted_speedup


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


def test_the_advisor_warns_with_the_fix_when_acco_is_slower() -> None:
    advisor = Advisor(accumulation_steps=4)
    for compute, comm in [(9.0, 9.0), (9.0, 9.0)] + [(1.0, 3.0), (1.2, 3.2), (0.8, 2.8), (1.0, 3.0)]:
        advisor.record(compute, None)
        advisor.record(None, comm)
    assert advisor.figures == {"compute_per_round_s": 1.0, "comm_per_round_s": 3.0,
                               "predicted_speedup": pytest.approx(5 / 6)}  # fmt: skip
    advice = advisor.advice()
    assert advice.startswith("acco advisor: compute_per_round=1.0000s comm_per_round=3.0000s "
                             "predicted_speedup=0.83")  # fmt: skip
    assert "WARNING" in advice and "accumulation_steps to about 12" in advice  # C/c = 3/0.25
    assert "mode='ddp'" in advice


def test_the_engine_logs_one_advisor_line_with_its_figures(caplog) -> None:
    model = nn.Linear(64, 64)
    opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="acco", accumulation_steps=2,
                        lr=1e-3)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="acco_hooks"):
        for _ in range(20):
            model(torch.randn(8, 64)).square().mean().backward()
            opt.step()
    opt.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("acco advisor:")]
    assert len(lines) == 1, lines
    figures = opt.engine.advisor.figures
    assert set(figures) == {"compute_per_round_s", "comm_per_round_s", "predicted_speedup"}
    assert figures["compute_per_round_s"] > 0 and figures["comm_per_round_s"] > 0
    assert f"predicted_speedup={figures['predicted_speedup']:.2f}" in lines[0]
