"""What an engine owns is released: its process groups and its communication thread.

Through public ways to ask only: ``engine.process_groups`` / ``engine.closed``,
``torch.distributed.get_process_group_ranks`` (which no longer knows a destroyed group) and
``threading.enumerate()`` (the communication thread is named ``acco-comm``).
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch
import torch.distributed as dist

from acco_hooks import ACCOEngine, ACCOOptimizer
from tests.dist_utils import run_distributed


def _comm_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("acco-comm")]


def _destroyed(group: dist.ProcessGroup) -> bool:
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError):
        return True
    return False


def _train(opt: ACCOOptimizer, model: torch.nn.Module, rounds: int) -> None:
    for _ in range(rounds):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


# ------------------------------------------------------------------- workers (gloo processes)


def close_and_context_manager(rank: int, world_size: int) -> dict:
    seen = {}
    model = _model()
    opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    groups = opt.engine.process_groups
    seen["groups_while_open"] = len(groups)
    seen["alive_while_open"] = [not _destroyed(g) for g in groups]
    seen["threads_while_open"] = len(_comm_threads())
    _train(opt, model, 3)
    opt.close()
    seen["closed"] = opt.closed
    seen["groups_after_close"] = len(opt.engine.process_groups)
    seen["destroyed_after_close"] = [_destroyed(g) for g in groups]
    seen["threads_after_close"] = _comm_threads()
    opt.close()  # idempotent

    with ACCOOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2) as opt:
        groups = opt.engine.process_groups
        _train(opt, model, 3)
    seen["with_closed"] = opt.closed
    seen["with_destroyed"] = [_destroyed(g) for g in groups]
    seen["with_threads"] = _comm_threads()

    # Many engines, one after the other, in one process: nothing piles up.
    every_group = []
    for _ in range(5):
        with ACCOEngine(model.parameters(), torch.optim.SGD, lr=0.1) as engine:
            every_group += engine.process_groups
    seen["many_destroyed"] = [_destroyed(g) for g in every_group]
    seen["many_threads"] = _comm_threads()

    # An engine its owner forgets is released when it is collected.
    forgotten = ACCOOptimizer(_model().parameters(), torch.optim.AdamW, lr=1e-2)
    groups = forgotten.engine.process_groups
    del forgotten
    gc.collect()
    seen["forgotten_destroyed"] = [_destroyed(g) for g in groups]
    seen["forgotten_threads"] = _comm_threads()
    return seen


def engine_usable_after_close_raises(rank: int, world_size: int) -> str:
    model = _model()
    opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    opt.close()
    with pytest.raises(RuntimeError, match="closed") as error:
        _train(opt, model, 1)
    return str(error.value)


# ------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def closing() -> list[dict]:
    return run_distributed("tests.test_lifecycle:close_and_context_manager", 2)


def test_close_destroys_the_engine_groups_and_joins_its_thread(closing) -> None:
    for seen in closing:
        assert seen["groups_while_open"] >= 1 and all(seen["alive_while_open"])
        assert seen["threads_while_open"] == 1
        assert seen["closed"] is True
        assert seen["groups_after_close"] == 0
        assert all(seen["destroyed_after_close"])
        assert seen["threads_after_close"] == []


def test_a_with_block_closes_the_engine(closing) -> None:
    for seen in closing:
        assert seen["with_closed"] is True
        assert seen["with_destroyed"] and all(seen["with_destroyed"])
        assert seen["with_threads"] == []
        assert len(seen["many_destroyed"]) == 5 and all(seen["many_destroyed"])
        assert seen["many_threads"] == []


def test_an_engine_nobody_closed_is_released_when_collected(closing) -> None:
    for seen in closing:
        assert seen["forgotten_destroyed"] and all(seen["forgotten_destroyed"])
        assert seen["forgotten_threads"] == []


def test_a_closed_engine_refuses_to_run_a_round() -> None:
    for message in run_distributed("tests.test_lifecycle:engine_usable_after_close_raises", 2):
        assert "closed" in message


def test_a_local_engine_closes_without_torch_distributed() -> None:
    assert not dist.is_initialized()
    model = _model()
    with ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="ddp", lr=1e-2) as opt:
        assert opt.engine.process_groups == ()
        _train(opt, model, 2)
        assert len(_comm_threads()) == 1
    assert opt.closed
    assert _comm_threads() == []
