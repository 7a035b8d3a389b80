"""Generated torchft jobs, each against its oracle.

Run: ``pytest -m soak tests/engine/test_torchft_soak.py``.

Three generators, each case drawn from its seed (2 or 3 replica groups of 1 or 2 ranks, ``acco``,
``dpu`` or ``ddp``, with or without clipping and an LR scheduler):

* **a job and one event**: none; the last group SIGKILLed at a random round and point
  (mid-round, inside a round's sum, or in ``acco`` right after an estimate was summed); the same
  followed by its restart; the last group started 10 rounds late (the live groups wait after
  round 10 until a joiner's first quorum request is at the lighthouse); the last group's vote on
  a random round failing once, on its own link (its retry meets the others a round further,
  behind by a committed round, and heals); or, with 3 groups, a joiner healed in a sum that then
  fails (group 1 dies in it) and retried without it. The oracle is ``examples/torchft_train.py``
  as one group of every rank without torchft, whose ranks of a group that was away skip their
  micro-batches from the round its contributions stopped in until the round after the one it
  (re)joined in (``tests/engine/test_torchft.py`` says why those rounds). Every survivor and
  every healed rank must match it to 1e-5, and be bit-identical to the group that never left.
* **a checkpoint**: saved by all groups at a random round (in ``acco`` also between an estimate
  and its update), resumed on other groups and sizes, or on one world without torchft; its
  oracle is the same job's checkpoint saved by one world of every rank, resumed on as many
  ranks as the resumed job has in all (``ACCOEngine.state_dict`` reshards it).
* **groups that differ** in one setting (the learning rate, ``accumulation_steps``, the mode,
  clipping, the LR scheduler or its arguments, the initial parameters, a learning rate set by
  hand at some round, the number of ranks): every group must stop with the refusal naming it,
  and none may finish training; or the group that differs starts late, joining a running job:
  it must stop with the refusal, alone, and the live groups finish as the reference in which
  it never contributed.

Not in the default suite (each case is a torchft job and its reference: 10-40 s); the default
suite runs fixed cases of each kind in ``test_torchft.py``. ``ACCO_TORCHFT_SOAK_CASES`` sets
how many cases each generator draws (default 12), ``ACCO_TORCHFT_SOAK_SEED`` the first seed.
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
SEEDS = range(FIRST_SEED, FIRST_SEED + CASES)
ROUNDS = 24
# A group that joins: the live ones wait after this round until its first quorum request is at
# the lighthouse; that first step meets them in this round's sum, the one it heals in the next
HOLD_ROUND = 10
EVENTS = ["none", "kill", "restart", "late", "flaky", "join_in_failed_round"]


class Case(NamedTuple):
    groups: int
    group_size: int
    mode: str
    clip: bool
    lr_step_size: int  # 0: no LR scheduler
    event: str
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
        groups, size = rng.choice([2, 3]), rng.choice([1, 2])
        clip, step_size = rng.random() < 0.5, rng.choice([0, 0, 3])
        event = rng.choice(EVENTS)
        if event == "join_in_failed_round":
            groups = 3  # a live group, one that dies, the joiner
        return cls(groups, size, mode, clip, step_size, event, kill_at, kill_round)

    @property
    def args(self) -> list[str]:
        return ["--mode", self.mode, "--rounds", str(ROUNDS), "--timeout", "10",
                "--lr-step-size", str(self.lr_step_size),
                *(["--max-grad-norm", "0.5"] if self.clip else [])]  # fmt: skip

    @property
    def stop(self) -> int:
        """The round the lost group's contributions stop in (an estimate is summed with the
        update that follows it)."""
        return self.kill_round + (self.kill_at == "after_estimate")


def _params(out: Path, tag: str) -> dict:
    return torch.load(out / f"params_{tag}.pt")


def _assert_every_rank_equals(out: Path, case: object, groups: list[int], size: int,
                              expected: dict) -> None:  # fmt: skip
    first = _params(out, f"g{groups[0]}_r0")
    for g in groups:
        for r in range(size):
            run = _params(out, f"g{g}_r{r}")
            assert run["updates"] == expected["updates"], case
            for name, value in expected["params"].items():
                torch.testing.assert_close(run["params"][name], value, rtol=0, atol=1e-5,
                                           msg=lambda m, c=case: f"{c}: {m}")  # fmt: skip
                assert torch.equal(run["params"][name], first["params"][name]), (case, g, r)


@pytest.mark.soak
@pytest.mark.parametrize("seed", SEEDS)
def test_generated_torchft_job_equals_its_oracle(tmp_path: Path, seed: int) -> None:
    case = Case.draw(seed)
    lost = case.groups - 1
    kill = ["--kill-group", str(lost), "--kill-at", case.kill_at,
            "--kill-round", str(case.kill_round)]  # fmt: skip
    hold = {g: ["--hold-round", str(HOLD_ROUND), "--hold-for", "joining"] for g in range(lost)}
    joiner = ["--wait-for", f"round_{HOLD_ROUND}", "--announce", "joining"]
    replica_args = {
        "none": {}, "kill": {lost: kill}, "restart": {**hold, lost: kill},
        "late": {**hold, 0: [*hold[0], "--mark-round", str(HOLD_ROUND)], lost: joiner},
        "flaky": {lost: ["--flaky-group", str(lost), "--flaky-round", str(case.kill_round)]},
    }.get(case.event)  # fmt: skip
    if case.event == "join_in_failed_round":  # group 1 dies in the sum that heals group 2
        replica_args = {0: [*hold[0], "--mark-round", str(HOLD_ROUND)],
                        1: [*hold[1], "--kill-group", "1", "--kill-at", "in_reduction",
                            "--kill-round", str(HOLD_ROUND + 1)],
                        2: joiner}  # fmt: skip
    status = run_groups(
        case.groups, case.group_size, case.args, tmp_path, replica_args=replica_args,
        restart={lost: ["--announce", "joining"]} if case.event == "restart" else None,
        # the groups that do not start late start together
        start_together=list(range(lost)) if case.event in ("late", "join_in_failed_round")
        else True, timeout_s=360,
    )  # fmt: skip
    dead = {"kill": [lost], "join_in_failed_round": [1]}.get(case.event, [])
    alive = [g for g in range(case.groups) if g not in dead]
    assert [status[g] for g in alive] == [0] * len(alive), (case, status)
    away: list[str] = []
    if case.event in ("kill", "restart", "late"):
        start, resume = (0 if case.event == "late" else case.stop), ROUNDS
        if case.event != "kill":
            resume = _params(tmp_path, f"g{lost}_r0")["first_round"]
            # a restarted group may come back while the survivors still retry the sum it
            # died in (3 groups: the ring waits for the dead member's collective timeout)
            assert resume > (HOLD_ROUND if case.event == "late" else start), case
        away = ["--stop-group", str(lost), "--stop-round", str(start),
                "--resume-round", str(resume)]  # fmt: skip
    elif case.event == "flaky":  # the round it sat out, behind by the one the others committed
        sat_out = _params(tmp_path, f"g{lost}_r0")["last_joined"]
        assert sat_out is not None and sat_out > case.kill_round, case
        away = ["--stop-group", str(lost), "--stop-round", str(sat_out),
                "--resume-round", str(sat_out + 1)]  # fmt: skip
    elif case.event == "join_in_failed_round":
        first = _params(tmp_path, "g2_r0")["first_round"]
        assert first == HOLD_ROUND + 2, case
        away = ["--stop-group", "1", "--stop-round", str(HOLD_ROUND + 1),
                "--also-stop", "2", "0", str(first)]  # fmt: skip
    assert run_reference(case.groups, case.group_size, [*case.args, *away], tmp_path) == 0
    _assert_every_rank_equals(tmp_path, case, alive, case.group_size,
                              _params(tmp_path, "ref_r0"))  # fmt: skip


class ResumeCase(NamedTuple):
    groups: int
    group_size: int
    mode: str
    clip: bool
    lr_step_size: int
    save_round: int  # rounds ended when the checkpoint is taken
    resume_groups: int  # 0: one world without torchft
    resume_size: int

    @classmethod
    def draw(cls, seed: int) -> ResumeCase:
        rng = random.Random(1_000_003 * seed + 7)
        groups, size = rng.choice([1, 2, 3]), rng.choice([1, 2])
        resume_groups, resume_size = rng.choice([0, 1, 2, 3]), rng.choice([1, 2, 3])
        if resume_groups:
            resume_size = min(resume_size, 2)
        return cls(groups, size, rng.choice(["acco", "dpu", "ddp"]), rng.random() < 0.5,
                   rng.choice([0, 3]), rng.randrange(3, 9), resume_groups, resume_size)  # fmt: skip

    def args(self, rounds: int) -> list[str]:
        return ["--mode", self.mode, "--rounds", str(rounds), "--timeout", "10",
                "--lr-step-size", str(self.lr_step_size),
                *(["--max-grad-norm", "0.5"] if self.clip else [])]  # fmt: skip


@pytest.mark.soak
@pytest.mark.parametrize("seed", SEEDS)
def test_generated_torchft_checkpoint_resumes_as_the_one_world_one(
    tmp_path: Path, seed: int
) -> None:  # fmt: skip
    case = ResumeCase.draw(seed)
    save = [*case.args(case.save_round), "--save", "ck"]
    assert run_groups(case.groups, case.group_size, save, tmp_path) == [0] * case.groups, case
    assert run_reference(case.groups, case.group_size, save, tmp_path) == 0
    resume = case.args(case.save_round + 6)
    ranks = max(case.resume_groups, 1) * case.resume_size
    oracle = tmp_path / "oracle"
    assert run_reference(1, ranks, [*resume, "--resume", str(tmp_path / "ck_ref")], oracle) == 0
    expected = _params(oracle, "ref_r0")
    assert expected["first_round"] == case.save_round, case
    resumed = tmp_path / "resumed"
    from_torchft = [*resume, "--resume", str(tmp_path / "ck_g0")]
    if case.resume_groups == 0:
        assert run_reference(1, case.resume_size, from_torchft, resumed) == 0
        tags = [f"ref_r{r}" for r in range(case.resume_size)]
    else:
        status = run_groups(case.resume_groups, case.resume_size, from_torchft, resumed)
        assert status == [0] * case.resume_groups, case
        tags = [f"g{g}_r{r}" for g in range(case.resume_groups) for r in range(case.resume_size)]
    for tag in tags:
        run = _params(resumed, tag)
        assert run["first_round"] == case.save_round and run["updates"] == expected["updates"]
        for name, value in expected["params"].items():
            torch.testing.assert_close(run["params"][name], value, rtol=0, atol=1e-5,
                                       msg=lambda m, c=case, t=tag: f"{c} {t}: {m}")  # fmt: skip


# (what one group is given beside the others', what the refusal names)
MISMATCHES = {
    "lr": (["--lr", "0.02"], "settings"),
    "accumulation_steps": (["--accumulation-steps", "3"], "settings"),
    "mode": (None, "settings"),  # another mode than the case's
    "max_grad_norm": (["--max-grad-norm", "0.25"], "settings"),
    "lr_scheduler": (["--lr-step-size", "2"], "settings"),  # the others have none
    "lr_scheduler_arguments": (["--lr-step-size", "5"], "settings"),  # the others' is 3
    "seed": (["--seed", "1"], "initial parameters"),
    "lr_by_hand": (["--lr-at", "6", "0.002"], "optimizer hyperparameters"),
    "group_size": (None, "number of ranks"),
}


# What a joiner that differs is refused for in its first step (it takes the live groups' state,
# so its own initial parameters and learning rate by hand do not apply)
JOINER_MISMATCHES = ["lr", "accumulation_steps", "mode", "max_grad_norm", "lr_scheduler",
                     "lr_scheduler_arguments", "group_size"]  # fmt: skip


@pytest.mark.soak
@pytest.mark.parametrize("seed", SEEDS)
def test_generated_groups_that_differ_are_all_refused_by_name(tmp_path: Path, seed: int) -> None:
    rng = random.Random(2_000_029 * seed + 11)
    kind = rng.choice(sorted(MISMATCHES))
    differs, named = MISMATCHES[kind]
    groups, size = rng.choice([2, 3]), rng.choice([1, 2])
    odd = rng.randrange(groups)  # the group that differs
    mode = rng.choice(["acco", "dpu", "ddp"])
    late = kind in JOINER_MISMATCHES and rng.random() < 0.4  # it joins a running job
    args = ["--mode", mode, "--rounds", "16" if late else "12", "--timeout", "10"]
    if kind == "lr_scheduler_arguments":
        args += ["--lr-step-size", "3"]
    sizes = [size] * groups
    if kind == "mode":
        differs = ["--mode", rng.choice([m for m in ("acco", "dpu", "ddp") if m != mode])]
    if kind == "group_size":
        sizes[odd], differs = 3 - size, []
    replica_args, live = {odd: differs}, list(range(groups))
    if late:
        live = [g for g in range(groups) if g != odd]
        hold = ["--hold-round", "6", "--hold-for", "joining"]
        replica_args = {**{g: hold for g in live}, live[0]: [*hold, "--mark-round", "6"],
                        odd: [*differs, "--wait-for", "round_6", "--announce", "joining"]}  # fmt: skip
    status = run_groups(groups, sizes, args, tmp_path, replica_args=replica_args,
                        start_together=live if late else True, timeout_s=360)  # fmt: skip
    case = (kind, groups, sizes, odd, mode, late)
    refused = [odd] if late else list(range(groups))
    for g in range(groups):
        log = (tmp_path / f"g{g}.log").read_text()
        if g in refused:
            assert status[g] != 0, (case, status)
            assert f"the replica groups differ in their {named}" in log, (case, g, log[-3000:])
        else:
            assert status[g] == 0, (case, status, log[-3000:])
    if not late:
        assert not list(tmp_path.glob("params_*")), (case, "a group finished training")
        return
    assert not list(tmp_path.glob(f"params_g{odd}_*")), (case, "the joiner trained")
    never = ["--stop-group", str(odd), "--stop-round", "0"]
    assert run_reference(groups, size, [*args, *never], tmp_path) == 0
    _assert_every_rank_equals(tmp_path, case, live, size, _params(tmp_path, "ref_r0"))
