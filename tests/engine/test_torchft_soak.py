"""Generated torchft jobs, each against its oracle.

Run: ``pytest -m soak tests/engine/test_torchft_soak.py``.

Each case is drawn from its seed: 2 or 3 replica groups of 1 or 2 ranks, ``acco``, ``dpu`` or
``ddp``, with or without clipping, and one event: none, the last group SIGKILLed at a random
round and point (mid-round, inside a round's sum, or in ``acco`` right after an estimate was
summed), the same followed by its restart, or the last group started 10 rounds late (the live
groups wait after round 10 until a joiner's manager is up). The oracle is
``examples/torchft_train.py`` as one group of every rank without torchft, whose ranks of the
lost group skip their micro-batches from the round their contributions stopped in until the
round after the one it joined in (``tests/engine/test_torchft.py`` says why those rounds).
Every survivor and every healed rank must match it to 1e-5, and the ranks of a group that
joined must be bit-identical to those of the group that never left.

Not in the default suite (each case is a torchft job and its reference: 10-30 s); the default
suite runs fixed cases of each kind in ``test_torchft.py``. ``ACCO_TORCHFT_SOAK_CASES`` sets
how many cases (default 12), ``ACCO_TORCHFT_SOAK_SEED`` the first seed.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from scaffolding.torchft_job import run_groups, run_reference

pytest.importorskip("torchft", reason="the ft extra: pip install -e '.[ft]'")

CASES = int(os.environ.get("ACCO_TORCHFT_SOAK_CASES", "12"))
FIRST_SEED = int(os.environ.get("ACCO_TORCHFT_SOAK_SEED", "0"))
ROUNDS = 24
# A group that joins: the live ones wait after this round until its manager is up
HOLD_ROUND = 10


class Case(NamedTuple):
    groups: int
    group_size: int
    mode: str
    clip: bool
    event: str  # "none", "kill", "restart", "late"
    kill_at: str
    kill_round: int

    @classmethod
    def draw(cls, seed: int) -> Case:
        rng = random.Random(seed)
        mode = rng.choice(["acco", "dpu", "ddp"])
        points = ["mid_round", "in_reduction"] + (["after_estimate"] if mode == "acco" else [])
        kill_at = rng.choice(points)
        kill_round = rng.randrange(1, 8)
        if kill_at == "after_estimate":
            kill_round -= kill_round % 2  # acco's estimate rounds are the even ones
        return cls(rng.choice([2, 3]), rng.choice([1, 2]), mode, rng.random() < 0.5,
                   rng.choice(["none", "kill", "restart", "late"]), kill_at, kill_round)  # fmt: skip

    @property
    def stop(self) -> int:
        """The round the lost group's contributions stop in (an estimate is summed with the
        update that follows it)."""
        return self.kill_round + (self.kill_at == "after_estimate")


@pytest.mark.soak
@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + CASES))
def test_generated_torchft_job_equals_its_oracle(tmp_path: Path, seed: int) -> None:
    case = Case.draw(seed)
    lost = case.groups - 1
    args = ["--mode", case.mode, "--rounds", str(ROUNDS), "--timeout", "10",
            *(["--max-grad-norm", "0.5"] if case.clip else [])]  # fmt: skip
    kill = ["--kill-group", str(lost), "--kill-at", case.kill_at,
            "--kill-round", str(case.kill_round)]  # fmt: skip
    hold = {g: ["--hold-round", str(HOLD_ROUND), "--hold-for", "joining"] for g in range(lost)}
    replica_args = {
        "none": {}, "kill": {lost: kill}, "restart": {**hold, lost: kill},
        "late": {**hold, 0: [*hold[0], "--mark-round", str(HOLD_ROUND)],
                 lost: ["--wait-for", f"round_{HOLD_ROUND}", "--announce", "joining"]},
    }  # fmt: skip
    status = run_groups(
        case.groups, case.group_size, args, tmp_path, replica_args=replica_args[case.event],
        restart={lost: ["--announce", "joining"]} if case.event == "restart" else None,
        start_together=case.event != "late", timeout_s=360,
    )  # fmt: skip
    alive = list(range(case.groups)) if case.event != "kill" else list(range(lost))
    assert [status[g] for g in alive] == [0] * len(alive), (case, status)
    away: list[str] = []
    if case.event != "none":
        start = 0 if case.event == "late" else case.stop
        resume = ROUNDS
        if case.event in ("restart", "late"):
            first = torch.load(tmp_path / f"params_g{lost}_r0.pt")["first_round"]
            # a restarted group may come back while the survivors still retry the sum it
            # died in (3 groups: the ring waits for the dead member's collective timeout)
            assert first > (HOLD_ROUND if case.event == "late" else start), case
            resume = first
        away = ["--stop-group", str(lost), "--stop-round", str(start),
                "--resume-round", str(resume)]  # fmt: skip
    assert run_reference(case.groups, case.group_size, [*args, *away], tmp_path) == 0
    reference = torch.load(tmp_path / "params_ref_r0.pt")
    first = torch.load(tmp_path / "params_g0_r0.pt")
    for g in alive:
        for r in range(case.group_size):
            run = torch.load(tmp_path / f"params_g{g}_r{r}.pt")
            assert run["updates"] == reference["updates"], case
            for name, expected in reference["params"].items():
                torch.testing.assert_close(run["params"][name], expected, rtol=0, atol=1e-5,
                                           msg=lambda m, c=case: f"{c}: {m}")  # fmt: skip
                assert torch.equal(run["params"][name], first["params"][name]), (case, g, r)
