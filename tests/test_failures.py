"""Faults lose nothing and hang nobody: worker errors, dead ranks, non-finite gradients."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.scenario import Config, expected_updates, reference_run, relative_error


def failing_step_run(rank: int, world_size: int) -> str:
    """Rank 1's shard step raises in round 3; every rank must see a clear error, soon."""
    from acco_hooks import ACCOCommunicationError, ACCOOptimizer
    from tests.scenario import make_model, microbatch_loss

    model = make_model()
    opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="dpu", lr=1e-2, timeout=30)
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
    messages = run_distributed("tests.test_failures:failing_step_run", 2)
    assert "failed on rank 1" in messages[1] and "injected optimizer failure" in messages[1]
    # Rank 0's collective lost its peer: it fails too instead of waiting forever.
    assert messages[0].startswith("acco_hooks: the communication of round")
    assert "restart from the last complete checkpoint" in messages[0]


def test_killed_rank_makes_the_survivor_fail_clearly(tmp_path) -> None:
    # benchmarks/peer_death.py's scenario: rank 1 SIGKILLs itself with round 4's communication
    # in flight (the benchmark times the same run).
    survivor, dead = run_distributed("benchmarks.peer_death:killed_peer_run", 2, str(tmp_path),
                                     may_die=(1,))  # fmt: skip
    assert dead is None
    assert survivor["message"].startswith("acco_hooks: the communication of round")
    assert "restart from the last complete checkpoint" in survivor["message"]


@pytest.mark.parametrize("mode, nan_round, skipped", [("ddp", 4, 1), ("acco", 6, 2), ("acco", 7, 1)])
def test_nonfinite_round_is_skipped_on_every_rank(mode: str, nan_round: int, skipped: int) -> None:
    """A NaN on one rank: every rank skips; in acco an estimate's NaN also spoils its update."""
    cfg = Config(mode=mode, rounds=14, nan_rounds=frozenset({nan_round}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_distributed("tests.scenario:engine_run", 2, cfg)
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
    from tests.scenario import make_model, microbatch_loss

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
    for message in run_distributed("tests.test_failures:nonfinite_warning_run", 2, "skip"):
        assert "non-finite gradient (NaN/Inf) in round 2: every rank skipped this update" in message


def test_nonfinite_raise_policy_raises_on_every_rank() -> None:
    for message in run_distributed("tests.test_failures:nonfinite_warning_run", 2, "raise"):
        assert message.startswith("FloatingPointError: acco_hooks: the averaged gradient of round 2")


def test_saving_while_a_nonfinite_round_is_in_flight_counts_it_once() -> None:
    """state_dict() waits for the in-flight round early; the round end must not count it again."""
    from acco_hooks import ACCOOptimizer
    from tests.scenario import make_model, microbatch_loss

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
