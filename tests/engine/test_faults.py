"""Faults lose nothing and hang nobody: worker errors, dead or hung ranks, non-finite gradients.

First the single faults, each with what must hold: a shard step that raises on one rank, a
killed rank, a NaN round (skipped by every rank, or raised with ``nonfinite="raise"``).

Then faults injected by (rank, round), the way torchft tests them. One training (``acco``, 2
gloo ranks, ``ROUNDS`` rounds of ``MICRO`` micro-batches, a checkpoint every
``CHECKPOINT_EVERY`` rounds) runs once unfaulted: its per-round losses are the golden ones.
Each fault then hits one rank in one round, through public API only:

* ``delay``: that rank's shard step, on the communication thread, sleeps (a slow link);
* ``raise``: that rank's shard step raises (a failing collective or optimizer);
* ``nan``: that rank's loss becomes NaN for one micro-batch;
* ``kill``: that rank SIGKILLs itself at the start of the round.

After each: a delay changes nothing, bit for bit; a NaN round is skipped by every rank and the
replicas still agree bit for bit; a raise or a kill ends the job on every surviving rank with
``ACCOCommunicationError`` (no hang: the harness's deadline would fail the test), and a run
resumed in fresh processes from the last complete checkpoint reproduces the golden losses of
every later round and the golden final weights, bit for bit.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import signal
import time
import warnings

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.scenario import (
    Config,
    expected_updates,
    make_model,
    make_scheduler,
    microbatch_loss,
    param_groups,
    reference_run,
    relative_error,
)

# ---------------------------------------------------------------------- single faults


def failing_step_run(rank: int, world_size: int) -> str:
    """Rank 1's shard step raises in round 3; every rank must see a clear error, soon."""
    from acco_hooks import ACCOCommunicationError, ACCOOptimizer

    model = make_model()
    # Rank 0 learns of the failure when its collective times out: a short timeout, a short test.
    opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="dpu", lr=1e-2, timeout=10)
    if rank == 1:
        real_step = opt.optimizer.step

        def step(*args, **kwargs):
            if opt.engine.num_updates == 2:
                raise ValueError("injected optimizer failure")
            return real_step(*args, **kwargs)

        opt.optimizer.step = step
    try:
        for r in range(20):
            microbatch_loss(model, rank, r, 0).backward()
            opt.step()
        opt.flush()
    except ACCOCommunicationError as exc:
        message = str(exc)
    else:
        message = "no error"
    with pytest.raises(ACCOCommunicationError):  # the engine stays failed
        opt.flush()
    return message


def test_worker_exception_reaches_every_rank() -> None:
    messages = run_distributed("tests.engine.test_faults:failing_step_run", 2, fresh_processes=True)
    assert "failed on rank 1" in messages[1] and "injected optimizer failure" in messages[1]
    # Rank 0's collective lost its peer: it fails too instead of waiting forever.
    assert messages[0].startswith("acco_hooks: the communication of round")
    assert "restart from the last complete checkpoint" in messages[0]


def test_killed_rank_makes_the_survivor_fail_clearly(tmp_path) -> None:
    # benchmarks/peer_death.py's scenario: rank 1 SIGKILLs itself with round 4's communication
    # in flight (the benchmark times the same run).
    survivor, dead = run_distributed("benchmarks.peer_death:killed_peer_run", 2, str(tmp_path),
                                     may_die=(1,), fresh_processes=True)  # fmt: skip
    assert dead is None
    assert survivor["message"].startswith("acco_hooks: the communication of round")
    assert "restart from the last complete checkpoint" in survivor["message"]


def test_survivors_kept_alive_after_their_error_all_fail_within_seconds_of_a_kill() -> None:
    """4 gloo ranks, one SIGKILLed at a random moment, the survivors alive and their engines not
    closed after their error (benchmarks/peer_death.py's kill loop). A survivor whose ring
    receive waits on a live neighbour that has itself failed is freed only by that neighbour's
    engine letting its groups go at once: before it did, one survivor of every kill waited for a
    fellow survivor's exit (the hold, 20 s here) or the groups' timeout (60 s)."""
    from benchmarks.peer_death import kill_loop

    for run in kill_loop(kills=2, hold_s=20.0, seed=3):
        assert len(run["survivors"]) == 3
        for survivor in run["survivors"]:
            assert survivor.get("error") == "ACCOCommunicationError", survivor
            assert survivor["detection_s"] < 10.0, run
            assert survivor["groups_left"] == 0, survivor  # released with the failure


@pytest.mark.parametrize("mode, nan_round, skipped", [("ddp", 4, 1), ("acco", 6, 2), ("acco", 7, 1)])
def test_nonfinite_round_is_skipped_on_every_rank(mode: str, nan_round: int, skipped: int) -> None:
    """A NaN on one rank: every rank skips; in acco an estimate's NaN also spoils its update."""
    cfg = Config(mode=mode, rounds=14, nan_rounds=frozenset({nan_round}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_distributed("tests.scenario:engine_run", 2, cfg, fresh_processes=True)
    for result in results:
        assert result["skipped_rounds"] == skipped
        assert all(torch.isfinite(p).all() for p in result["params"].values())
        # The optimizer never stepped on the bad rounds: its step count is the updates applied.
        assert result["optimizer_steps"] == [result["num_updates"]] * 2
        assert result["num_updates"] == expected_updates(cfg) - (1 if mode == "ddp" else 1)
    assert results[0]["params"].keys() == results[1]["params"].keys()
    for name in results[0]["params"]:
        assert torch.equal(results[0]["params"][name], results[1]["params"][name])
    if mode == "ddp":  # exactly the training without that round's update
        reference = reference_run(cfg)["params"]
        assert relative_error(results[0]["params"], reference) <= 1e-6


def nonfinite_warning_run(rank: int, world_size: int, policy: str) -> str:
    from acco_hooks import ACCOOptimizer

    model = make_model()
    opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="ddp", lr=1e-2, nonfinite=policy)
    caught = "nothing"
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        try:
            for r in range(4):
                scale = float("inf") if (rank == 0 and r == 2) else 1.0
                (scale * microbatch_loss(model, rank, r, 0)).backward()
                opt.step()
        except FloatingPointError as exc:
            caught = f"FloatingPointError: {exc}"
    opt.close()
    return caught if policy == "raise" else "; ".join(str(w.message) for w in records)


def test_nonfinite_round_warns_with_its_number_on_every_rank() -> None:
    for message in run_distributed("tests.engine.test_faults:nonfinite_warning_run", 2, "skip", fresh_processes=True):
        assert "non-finite gradient (NaN/Inf) in round 2: every rank skipped this update" in message


def test_nonfinite_raise_policy_raises_on_every_rank() -> None:
    for message in run_distributed("tests.engine.test_faults:nonfinite_warning_run", 2, "raise", fresh_processes=True):
        assert message.startswith("FloatingPointError: acco_hooks: the averaged gradient of round 2")


def test_saving_while_a_nonfinite_round_is_in_flight_counts_it_once() -> None:
    """state_dict() waits for the in-flight round early; the round end must not count it again."""
    from acco_hooks import ACCOOptimizer

    model = make_model()
    opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="dpu", lr=1e-2)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        for r in range(4):
            scale = float("nan") if r == 1 else 1.0
            (scale * microbatch_loss(model, 0, r, 0)).backward()
            opt.step()
            if r == 1:
                opt.state_dict()  # round 1 (NaN) is in flight: its statistics are taken here
        opt.flush()
    opt.close()
    assert opt.engine.skipped_rounds == 1
    assert sum("non-finite" in str(w.message) for w in records) == 1

# -------------------------------------------------------- faults injected by (rank, round)


ROUNDS = 12
MICRO = 2
CHECKPOINT_EVERY = 4
RUN = "tests.engine.test_faults:faulted_run"


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str  # "delay", "raise", "nan", "kill" or "none"
    rank: int = 1
    round: int = 0  # delay/raise: an update round (odd in acco), whose job fails or waits


NONE = Fault("none")


def _install(fault: Fault, rank: int, opt) -> None:
    """``delay``/``raise``: a step pre-hook on the shard optimizer, which steps on the
    communication thread once per real update (the job of round 2k+1 in acco is update k)."""
    if fault.rank != rank or fault.kind not in ("delay", "raise"):
        return
    updates = iter(range(ROUNDS))

    def on_step(optimizer, args, kwargs) -> None:
        if 2 * next(updates) + 1 != fault.round:
            return
        if fault.kind == "delay":
            time.sleep(0.5)
        else:
            raise OSError(f"injected fault in round {fault.round}")

    opt.optimizer.register_step_pre_hook(on_step)


def _complete_checkpoint(ckpt_dir: str, world_size: int) -> int:
    """The latest round every rank saved (0: none)."""
    rounds = {}
    for path in glob.glob(os.path.join(ckpt_dir, "round*_rank*.pt")):
        r = int(os.path.basename(path)[5:].split("_")[0])
        rounds[r] = rounds.get(r, 0) + 1
    return max([r for r, n in rounds.items() if n == world_size], default=0)


def faulted_run(rank: int, world_size: int, fault: Fault, ckpt_dir: str, resume: bool) -> dict:
    from acco_hooks import ACCOCommunicationError, ACCOOptimizer, checkpoint

    model = make_model()
    opt = ACCOOptimizer(param_groups(model, True), torch.optim.AdamW, mode="acco",
                        accumulation_steps=MICRO, lr_scheduler=make_scheduler, lr=3e-2,
                        weight_decay=0.1, timeout=20)  # fmt: skip
    start = _complete_checkpoint(ckpt_dir, world_size) if resume else 0
    if start:
        saved = checkpoint.load(os.path.join(ckpt_dir, f"round{start}_rank{rank}.pt"))
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
    _install(fault, rank, opt)
    losses: dict[int, float] = {}
    try:
        for r in range(start, ROUNDS):
            if fault.kind == "kill" and fault.rank == rank and fault.round == r:
                os.kill(os.getpid(), signal.SIGKILL)
            total = 0.0
            for micro in range(MICRO):
                loss = microbatch_loss(model, rank, r, micro)
                if fault.kind == "nan" and (fault.rank, fault.round, micro) == (rank, r, 0):
                    loss = loss * float("nan")
                loss.backward()
                total += loss.item()
                opt.step()
            losses[r] = total
            if (r + 1) % CHECKPOINT_EVERY == 0 and not resume:
                checkpoint.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                                os.path.join(ckpt_dir, f"round{r + 1}_rank{rank}.pt"))  # fmt: skip
        opt.flush()
    except ACCOCommunicationError as exc:
        opt.close(flush=False, barrier=False)
        return {"error": str(exc), "losses": losses}
    result = {
        "error": None,
        "losses": losses,
        "start": start,
        "skipped_rounds": opt.engine.skipped_rounds,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }
    opt.close()
    return result


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> list[dict]:
    ckpt_dir = str(tmp_path_factory.mktemp("golden"))
    return run_distributed(RUN, 2, NONE, ckpt_dir, False, fresh_processes=True)


def _assert_replicas_agree(results: list[dict]) -> None:
    for name, value in results[0]["params"].items():
        assert torch.equal(value, results[1]["params"][name]), name


def test_a_delayed_communication_changes_nothing(golden, tmp_path) -> None:
    results = run_distributed(RUN, 2, Fault("delay", rank=1, round=5), str(tmp_path), False, fresh_processes=True)
    _assert_replicas_agree(results)
    for result, expected in zip(results, golden):
        assert result["losses"] == expected["losses"]
        for name, value in expected["params"].items():
            assert torch.equal(result["params"][name], value), name


def test_a_nan_on_one_rank_is_skipped_by_every_rank(golden, tmp_path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_distributed(RUN, 2, Fault("nan", rank=0, round=7), str(tmp_path), False, fresh_processes=True)
    _assert_replicas_agree(results)
    for result, expected in zip(results, golden):
        assert result["skipped_rounds"] == 1  # round 7's update (its estimate was clean)
        assert all(torch.isfinite(p).all() for p in result["params"].values())
        # Before the fault, nothing differs; at round 7 one rank's loss is NaN.
        assert [result["losses"][r] for r in range(7)] == [expected["losses"][r] for r in range(7)]


@pytest.mark.parametrize("fault", [Fault("raise", rank=1, round=7), Fault("kill", rank=1, round=6)],
                         ids=["raise", "kill"])  # fmt: skip
def test_a_failed_rank_ends_the_job_and_a_resume_reproduces_the_golden_run(
    fault: Fault, golden, tmp_path
) -> None:
    faulted = run_distributed(RUN, 2, fault, str(tmp_path), False, may_die=(1,), fresh_processes=True)
    survivor = faulted[0]
    assert survivor["error"] is not None
    assert "restart from the last complete checkpoint" in survivor["error"]
    if fault.kind == "raise":
        assert "injected fault in round 7" in faulted[1]["error"]
    else:
        assert faulted[1] is None  # killed
    assert _complete_checkpoint(str(tmp_path), 2) == 4  # round 8's never completed

    resumed = run_distributed(RUN, 2, NONE, str(tmp_path), True, fresh_processes=True)
    _assert_replicas_agree(resumed)
    for result, expected in zip(resumed, golden):
        assert result["start"] == 4
        assert result["losses"] == {r: expected["losses"][r] for r in range(4, ROUNDS)}
        for name, value in expected["params"].items():
            assert torch.equal(result["params"][name], value), name
