"""Clipping written in the training loop is refused by name, on every front-end and for every way
torch offers to clip, at the call itself; the run loses nothing and goes on exactly.

Between ``backward()`` and the ``step()`` that counts the micro-batch, the gradient lives in the
engine (averaged over every rank only at the round end), so ``.grad`` holds a placeholder that
refuses every operation (``acco_hooks/engine/ownership.py``): a clip there would otherwise clip
nothing (plain DDP's norm 2.07, the loop's 0.0) and train on wrong. Each front-end's run tries
every clip once, on micro-batches of its own, and must end where the same run without the
attempts ends. What the refusal points at, ``max_grad_norm``, equals plain DDP with the loop's
``clip_grad_norm_``: ``tests/ddp_hooks/test_against_plain_ddp.py``'s ``clip_grad_norm`` case.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_, clip_grad_value_  # the usual import: by name

from tests.scenario import relative_error

REFUSAL = "max_grad_norm="

CLIPS = {
    "clip_grad_norm_ imported by name": lambda ps: clip_grad_norm_(ps, 0.05),
    "torch.nn.utils.clip_grad_norm_": lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.05),
    "clip_grad.clip_grad_norm_": lambda ps: torch.nn.utils.clip_grad.clip_grad_norm_(ps, 0.05),
    "clip_grad_norm_ foreach": lambda ps: clip_grad_norm_(ps, 0.05, foreach=True),
    "clip_grad_norm_ per tensor": lambda ps: clip_grad_norm_(ps, 0.05, foreach=False),
    "clip_grad_norm_ inf norm": lambda ps: clip_grad_norm_(ps, 0.05, norm_type=math.inf),
    "get_total_norm then clip_grads_with_norm_": lambda ps: torch.nn.utils.clip_grads_with_norm_(
        ps, 0.05, torch.nn.utils.get_total_norm([p.grad for p in ps])
    ),
    "clip_grads_with_norm_, a norm of its own": lambda ps: torch.nn.utils.clip_grads_with_norm_(
        ps, 0.05, torch.tensor(2.0)
    ),
    "clip_grad_value_": lambda ps: clip_grad_value_(ps, 0.01),
    "clip_grad_value_ foreach": lambda ps: clip_grad_value_(ps, 0.01, foreach=True),
    "a gradient norm for the log": lambda ps: torch.stack([p.grad.norm() for p in ps]).norm(),
    "in place, by hand": lambda ps: [p.grad.mul_(0.5) for p in ps],
}  # fmt: skip


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def _try_every_clip(params: list[torch.Tensor], backward) -> Iterator[list[str]]:
    """Per clip: a backward and the clip, which must be refused; then it yields to the caller,
    which steps. Yields what was not refused as it should so far, by name."""
    wrong = []
    for name, clip in CLIPS.items():
        backward()
        try:
            clip(params)
        except RuntimeError as refusal:
            if REFUSAL not in str(refusal) or ".grad of" not in str(refusal):
                wrong.append(f"{name}: {refusal}")
        else:
            wrong.append(f"{name}: not refused")
        yield wrong


def _train(params: list[torch.Tensor], backward, step, clipping: bool) -> list[str]:
    """As many micro-batches as there are clips, each ``backward()`` then ``step()``; with
    ``clipping``, each clip tried in between. What was not refused as it should."""
    wrong: list[str] = []
    if clipping:
        for wrong in _try_every_clip(params, backward):  # noqa: B007 - the list it fills
            step()
    else:
        for _ in CLIPS:
            backward()
            step()
    return wrong


def test_every_clip_in_a_plain_loop_is_refused_and_the_run_goes_on_exactly() -> None:
    from acco_hooks import ACCOOptimizer

    def run(clipping: bool) -> tuple[dict[str, torch.Tensor], list[str]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
        opt = ACCOOptimizer(model.named_parameters(), torch.optim.AdamW, mode="ddp", lr=1e-2)
        step = iter(range(len(CLIPS)))
        params = list(model.parameters())

        def backward() -> None:
            model(_batch(next(step), 0)).square().mean().backward()

        wrong = _train(params, backward, opt.step, clipping)
        assert all(p.grad is None for p in params)  # as before the engine: empty after step()
        opt.close()
        return {n: p.detach().clone() for n, p in model.named_parameters()}, wrong

    clipped, wrong = run(clipping=True)
    assert not wrong, wrong
    assert relative_error(clipped, run(clipping=False)[0]) == 0.0


def ddp_worker(rank: int, world_size: int, clipping: bool, no_sync: bool, view: bool) -> dict:
    """ACCOState under DDP: every clip once, after a synchronized backward or, with
    ``no_sync``, after a backward under ``no_sync()`` (the micro-batch's first of two)."""
    import contextlib

    from torch.nn.parallel import DistributedDataParallel as DDP

    from acco_hooks import ACCOState, acco_hook

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    ddp = DDP(model, gradient_as_bucket_view=view, bucket_cap_mb=1e-4)
    state = ACCOState(ddp, torch.optim.AdamW, mode="ddp", accumulation_steps=2 if no_sync else 1,
                      lr=1e-2)  # fmt: skip
    ddp.register_comm_hook(state, acco_hook)
    step = iter(range(2 * len(CLIPS)))
    params = list(model.parameters())

    def backward() -> None:
        with ddp.no_sync() if no_sync else contextlib.nullcontext():
            ddp(_batch(next(step), rank)).square().mean().backward()

    def finish_step() -> None:
        state.step()
        if no_sync:  # the micro-batch's synchronized backward
            ddp(_batch(next(step), rank)).square().mean().backward()
            state.step()

    wrong = _train(params, backward, finish_step, clipping)
    state.close()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "wrong": wrong}  # fmt: skip


@pytest.mark.parametrize("no_sync, view", [(False, False), (False, True), (True, False)],
                         ids=["synchronized", "gradient_as_bucket_view", "no_sync"])  # fmt: skip
def test_every_clip_under_the_ddp_hook_is_refused_and_the_run_goes_on_exactly(
    no_sync: bool, view: bool, rank_pool
) -> None:
    clipped = rank_pool.run(f"{__name__}:ddp_worker", 2, True, no_sync, view)
    plain = rank_pool.run(f"{__name__}:ddp_worker", 2, False, no_sync, view)
    for rank, (c, p) in enumerate(zip(clipped, plain)):
        assert not c["wrong"], (rank, c["wrong"])
        assert relative_error(c["params"], p["params"]) == 0.0, rank


def hsdp_worker(rank: int, world_size: int, clipping: bool) -> dict:
    """ACCOHSDPOptimizer (FSDP2 inside 2 replicas of 2 ranks): every clip once, on the DTensor
    gradients FSDP2 reduce-scattered (the round's last micro-batch)."""
    from acco_hooks import ACCOHSDPOptimizer
    from tests.engine.hsdp_workers import sharded_tiny_net
    from tests.scenario import microbatch_loss

    model, _ = sharded_tiny_net(2, 2)
    opt = ACCOHSDPOptimizer(model, torch.optim.AdamW, mode="ddp", lr=1e-2)
    step = iter(range(len(CLIPS)))
    params = list(model.parameters())

    def backward() -> None:
        microbatch_loss(model, rank, next(step), 0).backward()

    wrong = _train(params, backward, opt.step, clipping)
    opt.flush()
    result = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    opt.close()
    return {"params": result, "wrong": wrong}


def test_every_clip_under_hsdp_is_refused_and_the_run_goes_on_exactly(rank_pool) -> None:
    clipped = rank_pool.run(f"{__name__}:hsdp_worker", 4, True)
    plain = rank_pool.run(f"{__name__}:hsdp_worker", 4, False)
    for rank, (c, p) in enumerate(zip(clipped, plain)):
        assert not c["wrong"], (rank, c["wrong"])
        assert relative_error(c["params"], p["params"]) == 0.0, rank
