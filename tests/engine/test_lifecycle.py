"""The engine's lifecycle: what close() releases and does with the update in flight, the real
weights seen without changing training, interrupts, and a model moved under the engine.

Through public ways to ask only: ``engine.process_groups`` / ``engine.closed``,
``torch.distributed.get_process_group_ranks`` (which no longer knows a destroyed group) and
``threading.enumerate()`` (the communication thread is named ``acco-comm``).
"""

from __future__ import annotations

import contextlib
import gc
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from acco_hooks import ACCOEngine, ACCOOptimizer, declare_per_element_optimizer
from scaffolding.process_exit import group_worker_threads
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
    return run_distributed("tests.engine.test_lifecycle:close_and_context_manager", 2)


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
    for message in run_distributed("tests.engine.test_lifecycle:engine_usable_after_close_raises", 2):
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


def bad_optimizer_argument(rank: int, world_size: int) -> dict:
    """The engine's groups exist when the shard optimizer refuses its arguments."""
    # The pool's default group for this call starts its gloo threads at its first collective:
    # counted before that, they would be taken for the engine's
    dist.barrier()
    threads_before = group_worker_threads()
    with pytest.raises(ValueError, match="Invalid beta parameter") as refused:
        ACCOOptimizer(_model().parameters(), torch.optim.AdamW, lr=1e-2, betas=(2.0, 0.9))
    # Measured while the traceback (which holds the half-built engine) is alive, as it is for
    # an error that ends the program: its groups must not wait for interpreter exit. A
    # destroyed group's gloo threads end on their own schedule (later on a loaded machine):
    # the count is given a few seconds to come back, which a group left alive never does.
    deadline = time.monotonic() + 10.0
    while group_worker_threads() > threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    seen = {"gloo_threads_left": group_worker_threads() - threads_before,
            "comm_threads": _comm_threads()}  # fmt: skip
    del refused
    return seen


def test_a_constructor_that_fails_releases_the_groups_it_built() -> None:
    for rank in run_distributed("tests.engine.test_lifecycle:bad_optimizer_argument", 2):
        assert rank["gloo_threads_left"] == 0  # not left to interpreter exit
        assert rank["comm_threads"] == []


# ------------------------------------------------ the update in flight: applied, dropped, seen


@declare_per_element_optimizer
class _SlowAdamW(torch.optim.AdamW):
    """AdamW whose real step takes ``delay_s`` (on the communication thread): rounds stay in
    flight while it is 1 s; the same numbers at 0 (the default: the engine's build probes the
    class with a few steps)."""

    delay_s = 0.0

    def step(self, closure=None):
        time.sleep(self.delay_s)
        return super().step(closure)


def _opt(model: torch.nn.Module, mode: str, optimizer_class=torch.optim.AdamW) -> ACCOOptimizer:
    return ACCOOptimizer(model.parameters(), optimizer_class, mode=mode, lr=1e-2)


def _batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 8, generator=generator) for _ in range(n)]


def _run(opt: ACCOOptimizer, model: torch.nn.Module, batches: list[torch.Tensor]) -> None:
    for x in batches:
        model(x).square().mean().backward()
        opt.step()


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["acco", "dpu"])
def test_close_applies_the_update_in_flight_as_flush_does(mode: str) -> None:
    flushed_model, closed_model = _model(), _model()
    flushed, closed = _opt(flushed_model, mode), _opt(closed_model, mode)
    _run(flushed, flushed_model, _batches(4))  # acco: an update in flight after round 3
    _run(closed, closed_model, _batches(4))
    live = _params(closed_model)
    flushed.flush()
    closed.close()
    assert closed.closed
    assert not all(torch.equal(a, b) for a, b in zip(live, _params(closed_model)))
    for a, b in zip(_params(flushed_model), _params(closed_model)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    flushed.close()


def test_close_with_flush_false_drops_the_update_in_flight() -> None:
    model = _model()
    opt = _opt(model, "acco")
    _run(opt, model, _batches(4))
    live = _params(model)
    opt.close(flush=False)
    for a, b in zip(live, _params(model)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # still the estimate θ̃
    opt.flush()  # dropped means dropped: nothing is left to apply
    for a, b in zip(live, _params(model)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["acco", "dpu"])
def test_real_weights_shows_theta_without_changing_the_trajectory(mode: str) -> None:
    batches = _batches(8)
    looked, plain = _model(), _model()
    looked_opt, plain_opt = _opt(looked, mode), _opt(plain, mode)
    seen = []
    for x in batches:
        _run(looked_opt, looked, [x])
        before = _params(looked)
        with looked_opt.real_weights():
            seen.append(_params(looked))
        for a, b in zip(before, _params(looked)):  # the live parameters are back
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        _run(plain_opt, plain, [x])
    for a, b in zip(_params(looked), _params(plain)):  # the same training trajectory
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # What the block showed after the last round is what flush() gives.
    plain_opt.flush()
    for a, b in zip(seen[-1], _params(plain)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    looked_opt.close()
    plain_opt.close()


# --------------------------------------------------------- interrupts never poison the engine


@contextlib.contextmanager
def _sigint_raises_keyboard_interrupt() -> Iterator[None]:
    """Python's own SIGINT handler for the block (a library imported earlier may replace it)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("mode", ["dpu", "ddp"])
def test_ctrl_c_inside_step_leaves_the_engine_usable(mode: str) -> None:
    batches = _batches(6)
    reference_model, model = _model(), _model()
    with _opt(reference_model, mode, _SlowAdamW) as reference, \
            _opt(model, mode, _SlowAdamW) as opt, _sigint_raises_keyboard_interrupt():  # fmt: skip
        _run(reference, reference_model, batches)
        reference.flush()
        try:  # only the interrupted wait needs a slow update
            _SlowAdamW.delay_s = 1.0
            _run(opt, model, batches[:2])  # dpu: round 1's update is on the worker, ddp: none
            model(batches[2]).square().mean().backward()
            # While step() waits for an update (which takes 1 s on the worker thread):
            timer = threading.Timer(0.2, signal.pthread_kill,
                                    (threading.main_thread().ident, signal.SIGINT))  # fmt: skip
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                opt.step()
            timer.join()
            assert opt.step()  # the interrupted call, repeated, ends the round
        finally:
            _SlowAdamW.delay_s = 0.0
        _run(opt, model, batches[3:])
        opt.flush()
        for a, b in zip(_params(reference_model), _params(model)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_exception_between_micro_batches_closes_the_with_block_cleanly() -> None:
    model = _model()
    with pytest.raises(KeyboardInterrupt):
        with _opt(model, "acco") as opt:
            _run(opt, model, _batches(3))
            live = _params(model)
            raise KeyboardInterrupt
    assert opt.closed
    for a, b in zip(live, _params(model)):  # no flush after an exception: the live θ̃ stays
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ------------------------------------------------------------------ a model moved after build


@pytest.mark.parametrize("move", ["double", "param_data"])
def test_a_model_moved_after_the_optimizer_was_built_is_refused(move: str) -> None:
    model = _model()
    opt = _opt(model, "acco")
    _run(opt, model, _batches(2))
    if move == "double":
        model.double()
    else:
        model[0].weight.data = model[0].weight.data.clone()
    x = _batches(1)[0].to(model[0].weight.dtype)
    model(x).square().mean().backward()
    with pytest.raises(RuntimeError, match=r"moved or changed dtype after the optimizer was built"):
        opt.step()
    opt.close(flush=False)
