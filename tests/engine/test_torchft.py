"""ACCO across torchft replica groups: exact with every group alive, exact when one is lost.

Each job is ``examples/torchft_train.py``: a torchft lighthouse and one ``torchrun`` per replica
group, each group in a session of its own (``scaffolding.torchft_job``). Its oracle is the same
script as ONE group of every rank without torchft (the plain engine, whose own numerics the
engine tests hold against the spec's reference): with every group alive the two must agree; when
a group is SIGKILLed, the survivors must agree with a reference run in which that group's ranks
contribute nothing (``skip_microbatch``) from the round its contributions stopped in; a group
that joins a running job (started late, or restarted after it was killed) takes a live group's
state, sits out the round it joined in, and then holds parameters bit-identical to every other
group's, equal to a reference whose ranks of that group skip the rounds it was away (a group
whose sum failed alone, where the others committed it, is one that was away for the round it
then sat out). A checkpoint saved under torchft must resume, with or without torchft, on any
number of groups and ranks, as the same checkpoint saved by the one-world job does; groups that
differ (settings, LR scheduler, number of ranks) are refused by name, every one of them, before
the first round.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from scaffolding import forked_ranks
from scaffolding.torchft_job import LIGHTHOUSE, ROOT, free_port, run_groups, run_reference

pytest.importorskip("torchft", reason="the ft extra: pip install -e '.[ft]'")

ROUNDS = 12


def _params(out: Path, tag: str) -> dict:
    return torch.load(out / f"params_{tag}.pt")


def _assert_equal_to_reference(out: Path, groups: list[int], group_size: int) -> None:
    reference = _params(out, "ref_r0")
    for g in groups:
        for r in range(group_size):
            run = _params(out, f"g{g}_r{r}")
            assert run["updates"] == reference["updates"]
            for name, expected in reference["params"].items():
                torch.testing.assert_close(run["params"][name], expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("groups", "group_size", "mode", "extra"),
    # 2 groups of 1 rank: test_with_torchfts_init_sync_..._state[1], against the same oracle
    [(2, 2, "acco", ["--max-grad-norm", "0.5"]), (3, 1, "acco", []),
     (3, 2, "acco", []), (2, 2, "ddp", []),  # dpu: test_a_lost_group_..., until its kill
     # HSDP inside each group: 2 replicas x 2 FSDP shards, against HSDP over 4 x 2
     (2, 4, "acco", ["--fsdp", "2", "--max-grad-norm", "0.5"]),
     # Muon on whole matrices: each group's 2 ranks own one each, the reference's 4 ranks 2
     (2, 2, "acco", ["--muon"]),
     # both: each matrix brought together from its FSDP pieces on its owner in each group
     (2, 4, "acco", ["--fsdp", "2", "--muon"])],
)  # fmt: skip
def test_every_group_alive_equals_one_run_over_every_rank(
    tmp_path: Path, groups: int, group_size: int, mode: str, extra: list[str]
) -> None:
    args = ["--mode", mode, "--rounds", str(ROUNDS), *extra]
    assert run_groups(groups, group_size, args, tmp_path) == [0] * groups
    assert run_reference(groups, group_size, args, tmp_path) == 0
    _assert_equal_to_reference(tmp_path, list(range(groups)), group_size)
    first = _params(tmp_path, "g0_r0")
    torch.manual_seed(0)  # the example's model: training moved it
    initial = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    assert not torch.equal(first["params"]["0.weight"], initial[0].weight.detach())


# accumulate_until_ready: group 1 computes 60 ms per micro-batch, group 0 nothing; 2 micro-batches
# a round, at most 4 (the cap: each round takes 4 data positions in every group)
UNTIL_READY = ["--accumulation-steps", "2", "--until-ready", "--max-microbatches-per-round", "4"]
SLOW_GROUP = {1: ["--microbatch-seconds", "0.06"]}


def _ran(out: Path, tag: str) -> list[int]:
    """The micro-batches a rank ran in each round (the example's round ends)."""
    return [end[6] for end in _params(out, tag)["round_ends"]]


def _replay_reference(out: Path, groups: int, group_size: int, args: list[str]) -> int:
    """The job as one world without torchft, each rank running what its rank ran in the job
    (tests/engine/torchft_replay.py)."""
    counts = [_ran(out, f"g{g}_r{r}") for g in range(groups) for r in range(group_size)]
    (out / "replay.json").write_text(json.dumps(counts))
    log = out / "reference.log"
    return forked_ranks.run(groups * group_size,
                            ["-m", "tests.engine.torchft_replay", "--replay-counts",
                             str(out / "replay.json"), "--groups", str(groups), "--out", str(out),
                             *args], log, preload=("examples.torchft_train",), timeout_s=120.0)  # fmt: skip


@pytest.mark.parametrize("mode", ["acco"])  # dpu and ddp: the engine's replay in test_hsdp.py
def test_groups_of_unequal_speed_accumulate_until_ready_exactly(tmp_path: Path, mode: str) -> None:
    """2 groups of 2 ranks, the second slower, accumulate_until_ready with a cap of 4: the fast
    group runs more micro-batches while the sum over the groups waits for the slow one, and
    every round takes 4 data positions on every rank (the data position after round r is
    4 (r + 1)), so that the micro-batches of two rounds never meet. The job equals one world
    of the 4 ranks without torchft, each running what its rank ran."""
    args = ["--mode", mode, "--rounds", str(ROUNDS), *UNTIL_READY]
    assert run_groups(2, 2, args, tmp_path, replica_args=SLOW_GROUP) == [0, 0]
    ran = {(g, r): _ran(tmp_path, f"g{g}_r{r}") for g in range(2) for r in range(2)}
    assert all(len(c) == ROUNDS and all(2 <= n <= 4 for n in c) for c in ran.values()), ran
    assert sum(ran[0, 0]) > 2 * ROUNDS, ran  # the fast group filled its waits
    for g in range(2):
        ends = _params(tmp_path, f"g{g}_r0")["round_ends"]
        assert [end[5] for end in ends] == [4 * (end[0]) for end in ends], ends
    assert _replay_reference(tmp_path, 2, 2, args) == 0, (tmp_path / "reference.log").read_text()[-3000:]
    _assert_equal_to_reference(tmp_path, [0, 1], 2)


# mode="auto": 4 micro-batches of c = 60 ms per update, and a link between the groups that adds
# 30 ms to each round's sum (C: 50-120 ms here with torchft's quorum and commit): the law
# prices the synchronous update at 4c + C ≈ 0.3 s and the even overlapped split at
# 2·max(2c, C) ≈ 0.24 s, so auto times the synchronous schedule, tries the split (it does
# while 0.2c < C < 3.6c) and keeps it (timed 1.2-1.3x faster here, kept above 1.02x).
# Only the first group computes that slowly: the others wait for it in every sum, so their own
# timings price the overlapped schedule slower than the synchronous one, and they run it only
# because the first group decides for all. Its oracle: the same job as one replica group of
# every rank under the same manager and link (the plain engine's world, with the timings that
# auto's choice needs).
AUTO_ARGS = ["--mode", "auto", "--accumulation-steps", "4", "--rounds", "26",
             "--microbatch-seconds", "0.06", "--link-seconds", "0.03", "--timeout", "10"]  # fmt: skip


def _schedules(out: Path, tag: str) -> list[tuple[int, ...]]:
    return [end[4] for end in _params(out, tag)["round_ends"]]


def _assert_auto_ran_one_schedule_everywhere(
    out: Path, tags: list[str], reference: list[tuple[int, ...]]
) -> None:  # fmt: skip
    """Every rank of every group ran ``reference``'s schedule in every round: synchronous
    first, then the overlapped one the deciding group's auto chose."""
    synchronous = (0, 4, "")
    assert reference[0] == synchronous and reference[-1] != synchronous, reference
    for tag in tags:
        assert _schedules(out, tag) == reference, tag


@pytest.mark.parametrize(("groups", "group_size"), [(2, 2)])
def test_auto_switches_every_group_at_the_same_update_and_equals_one_group(
    tmp_path: Path, groups: int, group_size: int
) -> None:  # fmt: skip
    faster = {g: ["--microbatch-seconds", "0"] for g in range(1, groups)}
    assert run_groups(groups, group_size, AUTO_ARGS, tmp_path, replica_args=faster) == [0] * groups
    one = tmp_path / "one_group"
    assert run_groups(1, groups * group_size, AUTO_ARGS, one) == [0]
    reference = _schedules(one, "g0_r0")
    tags = [f"g{g}_r{r}" for g in range(groups) for r in range(group_size)]
    _assert_auto_ran_one_schedule_everywhere(tmp_path, tags, reference)
    expected = _params(one, "g0_r0")
    for tag in tags:
        run = _params(tmp_path, tag)
        assert run["updates"] == expected["updates"]
        for name, value in expected["params"].items():
            torch.testing.assert_close(run["params"][name], value, rtol=0, atol=1e-5)


def test_auto_goes_on_with_the_next_deciding_group_when_the_first_is_lost(tmp_path: Path) -> None:
    """3 groups of 1 rank; only group 0, the deciding one, computes slowly enough for the
    overlapped schedule to pay. It is SIGKILLed inside round 20's sum, after the job switched
    to that schedule. The survivors keep their processes, group 1 decides from then on by its
    own timings (its rounds waited for group 0's: it chose the synchronous schedule), and both
    survivors go back to it at the same round, holding the same parameters."""
    replica_args = {0: ["--kill-group", "0", "--kill-at", "in_reduction", "--kill-round", "20"],
                    1: ["--microbatch-seconds", "0"], 2: ["--microbatch-seconds", "0"]}  # fmt: skip
    status = run_groups(3, 1, [*AUTO_ARGS, "--rounds", "30"], tmp_path, replica_args=replica_args)
    assert status[1:] == [0, 0] and status[0] != 0, "the survivors finish, no restart"
    ran = _schedules(tmp_path, "g1_r0")
    assert _schedules(tmp_path, "g2_r0") == ran
    synchronous = (0, 4, "")
    switched = next(i for i, schedule in enumerate(ran) if schedule != synchronous)
    back = next(i for i in range(switched, len(ran)) if ran[i] == synchronous)
    assert 0 < switched < 20 < back, ran  # overlapped while group 0 decided, not after
    assert ran[back:] == [synchronous] * (len(ran) - back), ran
    _assert_bit_identical(tmp_path, ["g1_r0", "g2_r0"])


def test_auto_a_group_that_joins_reads_on_from_the_live_groups_data_position(
    tmp_path: Path,
) -> None:  # fmt: skip
    """mode="auto" changes the size of its rounds: a joiner's data position is not a round
    count times a round size but ``engine.microbatches_scheduled``, handed over with the state.
    Group 0 (deciding, slow) switches to an overlapped schedule and, at the first estimate
    round's end from round 14 on, holds until group 1 (started late) has asked for a quorum:
    the joiner's first step (comparing settings) meets it in the update round's sum, and its
    join in the next one, an estimate round, which the joiner sits out. From then on both run
    the same schedule, the joiner reads on from where group 0 stood after that round, and they
    end bit-identical."""
    hold = ["--hold-round", "14", "--hold-for", "joining", "--mark-round", "14",
            "--hold-mid-update"]  # fmt: skip
    late = {1: ["--wait-for", "round_14", "--announce", "joining", "--microbatch-seconds", "0"],
            0: hold}  # fmt: skip
    status = run_groups(2, 1, AUTO_ARGS, tmp_path, replica_args=late, start_together=False)
    assert status == [0, 0]
    live, joiner = _params(tmp_path, "g0_r0"), _params(tmp_path, "g1_r0")
    joined = joiner["first_round"] - 1
    assert joined >= 14
    assert f"joined the job at round {joined}" in (tmp_path / "g1.log").read_text()
    synchronous = (0, 4, "")
    ran = _schedules(tmp_path, "g0_r0")
    assert ran[joined] != synchronous, f"auto had not switched before the join: {ran}"
    assert joiner["joined_mid_update"], "it joined in an update round"
    # from the joiner's first round on: the live group's schedules, and its data position then
    # (the micro-batches it read through the round the joiner sat out)
    after = [end for end in live["round_ends"] if end[0] > joined + 1]
    assert [end[4] for end in joiner["round_ends"]] == [end[4] for end in after]
    at_join = next(end for end in live["round_ends"] if end[0] == joined + 1)
    assert joiner["first_index"] == at_join[5], (joiner["first_index"], at_join, ran)
    _assert_bit_identical(tmp_path, ["g0_r0", "g1_r0"])


# (kill_at, groups, group_size, mode, kill_round, the round the lost group's contributions
# stop in): mid-round and in the sum, the round it died in; after an estimate, the update
# that follows (the estimate was summed with it)
KILLS = [
    ("mid_round", 2, 1, "acco", 5, 5),
    ("after_estimate", 2, 2, "acco", 4, 5),
    # in_reduction, 2 groups of 2 ranks: test_a_lost_group_restarted_..._parameters
    ("in_reduction", 3, 1, "acco", 5, 5),
    ("in_reduction", 2, 2, "dpu", 3, 3),
]


@pytest.mark.parametrize(("kill_at", "groups", "group_size", "mode", "kill_round", "stop"), KILLS)
def test_a_lost_group_leaves_the_survivors_stepping_exactly(
    tmp_path: Path, kill_at: str, groups: int, group_size: int, mode: str, kill_round: int,
    stop: int,
) -> None:  # fmt: skip
    lost = groups - 1
    args = ["--mode", mode, "--rounds", str(ROUNDS), "--timeout", "10"]
    kill = ["--kill-group", str(lost), "--kill-at", kill_at, "--kill-round", str(kill_round)]
    status = run_groups(groups, group_size, args, tmp_path, replica_args={lost: kill})
    assert status[:lost] == [0] * lost, "every survivor finishes, no restart"
    assert status[lost] != 0
    assert (tmp_path / "killed_at").exists()
    assert not list(tmp_path.glob(f"params_g{lost}_*"))
    if kill_at == "in_reduction":  # the failed sum was taken again, not lost
        log = (tmp_path / "g0.log").read_text()
        assert f"round {kill_round} committed at attempt 2" in log, log[-3000:]
    stop_args = ["--stop-group", str(lost), "--stop-round", str(stop)]
    assert run_reference(groups, group_size, [*args, *stop_args], tmp_path) == 0
    _assert_equal_to_reference(tmp_path, list(range(lost)), group_size)


@pytest.mark.parametrize("group_size", [1, 2])
def test_with_torchfts_init_sync_every_group_takes_one_state(
    tmp_path: Path, group_size: int
) -> None:  # fmt: skip
    """init_sync=True: at the start torchft hands each rank r the state of the group its rank
    picks (rank r of group r mod G), so groups built from different seeds hold one model; with
    one rank per group, group 0's: the run is the reference's from group 0's seed."""
    args = ["--rounds", "12", "--timeout", "10"]
    assert run_groups(2, group_size, [*args, "--init-sync"], tmp_path,
                      replica_args={1: ["--seed", "1"]}) == [0, 0]  # fmt: skip
    tags = [f"g{g}_r{r}" for g in range(2) for r in range(group_size)]
    _assert_bit_identical(tmp_path, tags)
    if group_size == 1:
        assert run_reference(2, 1, args, tmp_path) == 0
        _assert_equal_to_reference(tmp_path, [0, 1], 1)


def _assert_bit_identical(out: Path, tags: list[str]) -> None:
    first = _params(out, tags[0])
    for tag in tags[1:]:
        run = _params(out, tag)
        assert run["updates"] == first["updates"]
        for name, value in run["params"].items():
            assert torch.equal(value, first["params"][name]), (tag, name)


# Healing: the live group waits after round 10 until the joiner's manager is up, so that the
# joiner meets it in round 10's or 11's sum however long its start takes
HEAL_ARGS = ["--rounds", "24", "--timeout", "10"]
HOLD = ["--hold-round", "10", "--hold-for", "joining"]


@pytest.mark.parametrize("extra", [[], ["--muon"]], ids=["adamw", "muon"])
def test_a_group_that_joins_a_running_job_heals_and_trains_exactly(
    tmp_path: Path, extra: list[str]
) -> None:
    """With Muon the joiner takes each matrix's momentum (by name) with the master shard."""
    late = {1: ["--wait-for", "round_10", "--announce", "joining"],
            0: ["--mark-round", "10", *HOLD]}  # fmt: skip
    args = [*HEAL_ARGS, *extra]
    assert run_groups(2, 1, args, tmp_path, replica_args=late, start_together=False) == [0, 0]
    joined = _params(tmp_path, "g1_r0")["first_round"] - 1
    assert joined >= 10
    assert f"joined the job at round {joined}" in (tmp_path / "g1.log").read_text()
    _assert_bit_identical(tmp_path, ["g0_r0", "g1_r0"])
    away = ["--stop-group", "1", "--stop-round", "0", "--resume-round", str(joined + 1)]
    assert run_reference(2, 1, [*args, *away], tmp_path) == 0
    _assert_equal_to_reference(tmp_path, [0, 1], 1)


@pytest.mark.parametrize(
    ("kill_at", "group_size", "mode", "stop", "extra"),
    [("in_reduction", 2, "acco", 4, []), ("mid_round", 1, "dpu", 4, []),
     ("in_reduction", 2, "acco", 4, ["--fsdp", "2"]),  # HSDP: each rank heals its FSDP shard
     # and with Muon: the owner's whole matrix brought together again from the healed pieces
     ("in_reduction", 2, "acco", 4, ["--fsdp", "2", "--muon"])],
    ids=["in_reduction-acco", "mid_round-dpu", "in_reduction-acco-hsdp",
         "in_reduction-acco-hsdp-muon"],
)
def test_a_lost_group_restarted_heals_and_holds_the_same_parameters(
    tmp_path: Path, kill_at: str, group_size: int, mode: str, stop: int, extra: list[str]
) -> None:  # fmt: skip
    args = [*HEAL_ARGS, "--mode", mode, *extra]
    # the restart waits for the survivor's round 10: a forked group is back within the
    # survivor's retry of the failed sum (2-3 s), where it would join that retry's quorum
    # (test_a_group_joining_in_a_round_whose_sum_fails_...), not a running job
    kill = {1: ["--kill-group", "1", "--kill-at", kill_at, "--kill-round", "4"],
            0: ["--mark-round", "10", *HOLD]}  # fmt: skip
    status = run_groups(2, group_size, args, tmp_path, replica_args=kill,
                        restart={1: ["--wait-for", "round_10", "--announce", "joining"]})  # fmt: skip
    assert status == [0, 0], "the survivor never restarted; the restarted group finished"
    assert (tmp_path / "killed_at").exists()
    joined = _params(tmp_path, "g1_r0")["first_round"] - 1
    assert joined >= 10
    assert f"joined the job at round {joined}" in (tmp_path / "g1_restart.log").read_text()
    _assert_bit_identical(tmp_path, [f"g{g}_r{r}" for g in range(2) for r in range(group_size)])
    away = ["--stop-group", "1", "--stop-round", str(stop), "--resume-round", str(joined + 1)]
    assert run_reference(2, group_size, [*args, *away], tmp_path) == 0
    _assert_equal_to_reference(tmp_path, [0, 1], group_size)


def test_a_lost_group_restarted_under_accumulate_until_ready_reads_nothing_twice(
    tmp_path: Path,
) -> None:  # fmt: skip
    """accumulate_until_ready, cap 4: the fast group (1) is SIGKILLed in round 4, having read up
    to 4 micro-batches a round; restarted, it joins the slow group's running job and reads on
    from the data position its first round takes, round x 4, past anything its lost
    predecessor can have read (below 5 x 4); from then on both groups hold bit-identical
    parameters and every round end leaves every rank at round x 4."""
    args = [*HEAL_ARGS, *UNTIL_READY]
    kill = {1: ["--kill-group", "1", "--kill-at", "mid_round", "--kill-round", "4"],
            0: ["--mark-round", "10", *HOLD, "--microbatch-seconds", "0.06"]}  # fmt: skip
    status = run_groups(2, 1, args, tmp_path, replica_args=kill,
                        restart={1: ["--wait-for", "round_10", "--announce", "joining"]})  # fmt: skip
    assert status == [0, 0]
    assert (tmp_path / "killed_at").exists()
    joiner, live = _params(tmp_path, "g1_r0"), _params(tmp_path, "g0_r0")
    assert joiner["first_round"] - 1 >= 10
    assert joiner["first_index"] == 4 * joiner["first_round"] >= 4 * (4 + 1)
    for run in (joiner, live):
        assert [end[5] for end in run["round_ends"]] == [4 * end[0] for end in run["round_ends"]]
    assert any(n > 2 for n in _ran(tmp_path, "g1_r0")), "the restarted fast group ran no extra"
    _assert_bit_identical(tmp_path, ["g0_r0", "g1_r0"])


@pytest.mark.parametrize(
    ("differs", "named"),
    [(["--lr", "0.02"], "settings"), (["--seed", "1"], "initial parameters"),
     (["--lr-step-size", "2"], "settings")],  # an LR scheduler in one group alone
    ids=["lr", "seed", "lr_scheduler"],
)
def test_groups_that_differ_are_refused_by_name(
    tmp_path: Path, differs: list[str], named: str
) -> None:
    status = run_groups(2, 1, ["--rounds", "4", "--timeout", "10"], tmp_path,
                        replica_args={1: differs})  # fmt: skip
    assert status == [1, 1]
    for g in (0, 1):
        log = (tmp_path / f"g{g}.log").read_text()
        assert f"the replica groups differ in their {named}" in log, log[-3000:]


@pytest.mark.parametrize("sizes", [(1, 2), (2, 1)], ids=["1-2", "2-1"])
def test_groups_of_another_number_of_ranks_are_refused_by_name_before_the_first_round(
    tmp_path: Path, sizes: tuple[int, int]
) -> None:  # fmt: skip
    """Rank r of one group has no rank r to sum with in the other: the groups' first ranks
    compare their sizes in the step each group takes first, and every group stops there."""
    status = run_groups(2, list(sizes), ["--rounds", "4", "--timeout", "10"], tmp_path)
    assert status == [1, 1]
    for g in (0, 1):
        log = (tmp_path / f"g{g}.log").read_text()
        refusal = (f"the replica groups differ in their number of ranks: this group has "
                   f"{sizes[g]}, the 2 groups in this sum have 3 in all")  # fmt: skip
        assert refusal in log, log[-3000:]
        assert "committed at attempt" not in log
    assert not list(tmp_path.glob("params_*")), "no group trained on"


@pytest.mark.parametrize("mode", ["acco", "ddp"])  # ddp: the group waits for its own round
def test_a_group_whose_sum_failed_alone_heals_and_trains_exactly(tmp_path: Path, mode: str) -> None:
    """torchft's commit is each group's: group 1's vote on round 5 fails (an error on its own
    link, after the sum went through), group 0 commits the round and goes on. Group 1's retry
    meets group 0 a round later, behind by a committed round: it takes group 0's state, sits
    that round out, and both end bit-identical, equal to a reference whose group 1 skipped that
    one round."""
    args = ["--mode", mode, "--rounds", "14", "--timeout", "10"]
    flaky = {1: ["--flaky-group", "1", "--flaky-round", "5"]}
    assert run_groups(2, 1, args, tmp_path, replica_args=flaky) == [0, 0]
    assert _params(tmp_path, "g0_r0")["last_joined"] is None
    sat_out = _params(tmp_path, "g1_r0")["last_joined"]
    assert sat_out is not None and sat_out > 5
    log = (tmp_path / "g1.log").read_text()
    assert f"took a live group's state in round {sat_out}, sits that round out" in log, log[-3000:]
    _assert_bit_identical(tmp_path, ["g0_r0", "g1_r0"])
    away = ["--stop-group", "1", "--stop-round", str(sat_out), "--resume-round", str(sat_out + 1)]
    assert run_reference(2, 1, [*args, *away], tmp_path) == 0
    _assert_equal_to_reference(tmp_path, [0, 1], 1)


def test_a_group_joining_in_a_round_whose_sum_fails_takes_the_state_on_the_retry(
    tmp_path: Path,
) -> None:  # fmt: skip
    """3 groups of 1 rank; group 2 starts late, groups 0 and 1 hold after round 10 until its
    quorum request is at the lighthouse. Group 2's first step meets them in round 10's sum
    (comparing settings), its next in round 11's, where torchft heals it, and group 1 dies
    inside that sum: the attempt fails, and the retry, without group 1, does not heal group 2
    again. Group 2 keeps the state handed over, sits round 11 out and ends bit-identical to
    group 0, equal to a reference whose group 1 stopped in round 11 and group 2 joined after
    it."""
    ra = {0: [*HOLD, "--mark-round", "10"],
          1: [*HOLD, "--kill-group", "1", "--kill-at", "in_reduction", "--kill-round", "11"],
          2: ["--wait-for", "round_10", "--announce", "joining"]}  # fmt: skip
    status = run_groups(3, 1, HEAL_ARGS, tmp_path, replica_args=ra, start_together=[0, 1])
    assert status[0] == 0 and status[2] == 0 and status[1] != 0, status
    assert _params(tmp_path, "g2_r0")["first_round"] == 12
    assert "joined the job at round 11" in (tmp_path / "g2.log").read_text()
    assert "round 11 committed at attempt 2" in (tmp_path / "g0.log").read_text()
    _assert_bit_identical(tmp_path, ["g0_r0", "g2_r0"])
    away = ["--stop-group", "1", "--stop-round", "11", "--also-stop", "2", "0", "12"]
    assert run_reference(3, 1, [*HEAL_ARGS, *away], tmp_path) == 0
    _assert_equal_to_reference(tmp_path, [0, 2], 1)


def _resume(tmp_path: Path, name: str, checkpoint: Path, args: list[str], groups: int) -> dict:
    """Train on from ``checkpoint``: on one world of ``-groups`` ranks without torchft
    (``groups`` < 0), or as ``groups`` replica groups of 1 rank; rank 0's parameters."""
    out = tmp_path / name
    resume = [*args, "--resume", str(checkpoint)]
    if groups > 0:
        assert run_groups(groups, 1, resume, out) == [0] * groups
        return _params(out, "g0_r0")
    assert run_reference(-groups, 1, resume, out) == 0
    return _params(out, "ref_r0")


def test_a_checkpoint_saved_under_torchft_resumes_as_the_one_world_checkpoint_does(
    tmp_path: Path,
) -> None:  # fmt: skip
    """2 groups of 1 rank save in acco between round 4's estimate and its update (the carried
    half-batch of 2 ranks, pending), as does the same job on one world of 2 ranks; each
    checkpoint resumes on 1 rank without torchft, and the torchft one as 1 replica group: all
    three equal the one-world checkpoint's resume on 1 rank (the carried half counts half of
    the update, as its micro-batches do)."""
    save = ["--rounds", "5", "--timeout", "10", "--save", "ck"]
    assert run_groups(2, 1, save, tmp_path) == [0, 0]
    assert run_reference(2, 1, save, tmp_path) == 0
    args = ["--rounds", "10", "--timeout", "10"]
    expected = _resume(tmp_path, "from_one_world", tmp_path / "ck_ref", args, groups=-1)
    assert expected["first_round"] == 5 and expected["updates"] == 5
    for name, groups in (("one_rank", -1), ("one_group", 1)):
        run = _resume(tmp_path, name, tmp_path / "ck_g0", args, groups=groups)
        assert run["first_round"] == 5 and run["updates"] == expected["updates"], name
        for param, value in expected["params"].items():
            torch.testing.assert_close(run["params"][param], value, rtol=0, atol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip


def test_a_quorum_that_cannot_commit_is_tried_less_often_and_given_up(tmp_path: Path) -> None:
    """One group, a manager that commits over 2 only (min_replica_size=2), timeout=None: the
    search for a quorum ends after twice the manager's timeout (2 s), and the attempts wait
    longer each (at most 8 fit in 4 s however fast each one fails)."""
    args = ["--rounds", "4", "--timeout", "2", "--min-replica-size", "2", "--engine-timeout",
            "none"]  # fmt: skip
    assert run_groups(1, 1, args, tmp_path) == [1]
    log = (tmp_path / "g0.log").read_text()
    found = re.search(r"joining the job: no quorum of replica groups committed within 4 s "
                      r"\((\d+) attempts; twice the manager's timeout", log)  # fmt: skip
    assert found, log[-3000:]
    assert 2 <= int(found[1]) <= 8
    assert "min_replica_size" in log[found.end():][:400]
    # one line for the event (the sum failed), not one per attempt
    assert log.count("the sum over the replica groups failed") == 1, log[-3000:]


def test_a_second_start_of_a_live_group_is_refused_by_name_and_the_job_goes_on(
    tmp_path: Path,
) -> None:  # fmt: skip
    """What a torchrun killed with SIGKILL leaves (its workers train on as group 1), then the
    same group started again: the second start of ``acco_1`` is refused by name on the
    newcomer, once it took part in a live round's sum with nothing, and the live groups go on
    as the job they were, equal to one run of their ranks."""
    ra = {0: [*HOLD, "--mark-round", "10"], 1: HOLD,
          2: ["--replica-id", "1", "--wait-for", "round_10", "--announce", "joining"]}  # fmt: skip
    status = run_groups(3, 1, HEAL_ARGS, tmp_path, replica_args=ra, start_together=[0, 1])
    assert status[:2] == [0, 0] and status[2] != 0, status
    newcomer = (tmp_path / "g2.log").read_text()
    assert re.search(r"a replica group named 'acco_1' is in the job already \(acco_1:[0-9a-f-]+; "
                     r"this start is acco_1:[0-9a-f-]+\)", newcomer), newcomer[-3000:]
    assert "pgrep -af" in newcomer
    survivor = (tmp_path / "g0.log").read_text()
    assert "Traceback" not in survivor, survivor[-3000:]
    _assert_bit_identical(tmp_path, ["g0_r0", "g1_r0"])
    assert run_reference(2, 1, HEAL_ARGS, tmp_path) == 0
    _assert_equal_to_reference(tmp_path, [0, 1], 1)


def test_a_lost_lighthouse_is_named_within_twice_the_timeout(tmp_path: Path) -> None:
    """The lighthouse SIGKILLed while 2 groups train (timeout=5): the next round's quorum is
    given what is left of its patience (10 s), and every group fails with the lighthouse
    named, instead of waiting for torchft's own quorum timeout (60 s) and a backstop that
    blames a peer."""
    args = ["--rounds", "2000", "--microbatch-seconds", "0.01", "--timeout", "5"]
    job = concurrent.futures.ThreadPoolExecutor(1).submit(
        run_groups, 2, 1, args, tmp_path, replica_args={0: ["--mark-round", "5"]})
    deadline = time.monotonic() + 120
    while not (tmp_path / "round_5").exists() and not job.done():
        assert time.monotonic() < deadline, "the job did not reach round 5"
        time.sleep(0.05)
    lost = time.monotonic()
    # this job's lighthouse alone (a child of this process): not another job's on the machine
    subprocess.run(["pkill", "-9", "-P", str(os.getpid()), "-f", str(LIGHTHOUSE)], check=False)
    assert job.result(timeout=120) == [1, 1]
    took = time.monotonic() - lost
    assert took < 2 * 5 + 15, f"{took:.0f} s from the lighthouse's loss to the groups' exit"
    for g in (0, 1):
        log = (tmp_path / f"g{g}.log").read_text()
        assert re.search(r"round \d+: no quorum of replica groups formed within 10 s \(attempt "
                         r"\d+; twice timeout=5\): the lighthouse at http://localhost:\d+ does "
                         r"not answer", log), log[-3000:]
        assert "a peer rank is probably dead" not in log, log[-3000:]


def test_a_lighthouse_address_without_a_host_is_refused_by_name(monkeypatch) -> None:
    from acco_hooks.engine.replicas import check_lighthouse_address

    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://:29510")  # http://$HEAD:29510, HEAD unset
    with pytest.raises(ValueError, match=r"'http://:29510' \(TORCHFT_LIGHTHOUSE\) names no host"):
        check_lighthouse_address()
    with pytest.raises(ValueError, match="names no port"):
        check_lighthouse_address("http://node0")
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE")
    with pytest.raises(ValueError, match="set TORCHFT_LIGHTHOUSE"):
        check_lighthouse_address()
    assert check_lighthouse_address("http://node0:29510") == "http://node0:29510"


def test_no_lighthouse_is_a_clear_error(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
         "--master_port", str(free_port()), "-m", "examples.torchft_train", "--replica-id", "0",
         "--groups", "1", "--out", str(tmp_path), "--timeout", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "TORCHFT_LIGHTHOUSE": "http://localhost:1"},
    )  # fmt: skip
    assert run.returncode != 0
    assert "failed to connect to http://localhost:1" in run.stdout + run.stderr


def _engine_errors(*codes: str, prelude: str = "") -> list[str]:
    """What building an engine with each of ``codes``' arguments raises (one line each), in
    one fresh process, after ``prelude``."""
    script = prelude + "import torch\nfrom acco_hooks import ACCOOptimizer\n"
    script += "model = torch.nn.Linear(4, 2)\n"
    for code in codes:
        script += (f"try:\n    {code}\nexcept Exception as e:\n"
                   "    print(type(e).__name__, str(e).replace(chr(10), ' '))\n")  # fmt: skip
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)  # fmt: skip
    return run.stdout.splitlines()


def test_a_manager_that_is_not_torchfts_and_unsupported_settings_are_refused() -> None:
    build = "ACCOOptimizer(model.named_parameters(), torch.optim.AdamW, manager=object(), {})"
    wrong, auto, narrow, until_ready, groups_alone = _engine_errors(
        build.format("mode='acco'"), build.format("mode='auto', accumulation_steps=2"),
        build.format("mode='acco', estimate_dtype=torch.bfloat16"),
        # a joiner reads on from the positions the rounds took: without a cap they have none
        build.format("mode='acco', accumulate_until_ready=True"),
        "ACCOOptimizer(model.named_parameters(), torch.optim.AdamW, replica_groups=2)",
    )  # fmt: skip
    assert "ValueError acco_hooks: replica_groups is the number of torchft" in groups_alone
    assert "give the group's manager= too" in groups_alone
    assert "TypeError acco_hooks: manager must be a torchft.Manager" in wrong
    assert "TypeError acco_hooks: manager must be a torchft.Manager" in auto
    assert "estimate_dtype narrower" in narrow
    assert ("ValueError acco_hooks: accumulate_until_ready=True with a torchft manager needs "
            "max_microbatches_per_round") in until_ready  # fmt: skip
    assert "Set max_microbatches_per_round" in until_ready


def test_without_torchft_the_error_names_the_extra() -> None:
    build = "ACCOOptimizer(model.named_parameters(), torch.optim.AdamW, manager=object())"
    (error,) = _engine_errors(build, prelude="import sys; sys.modules['torchft'] = None\n")
    assert "pip install 'acco_hooks[ft]'" in error
