"""Peek (the estimate step) computes Opt(θ, g) and leaves the optimizer exactly as it was."""

from __future__ import annotations

import copy

import pytest
import torch

from acco_hooks.engine.peek import has_functional_peek, peek

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)),
    "adamw_amsgrad": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    "adam_coupled_wd": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05)),
    "adam_maximize": (torch.optim.Adam, dict(lr=1e-2, maximize=True)),
    "sgd": (torch.optim.SGD, dict(lr=0.1)),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "sgd_dampening": (torch.optim.SGD, dict(lr=0.1, momentum=0.8, dampening=0.3)),
    # torch's foreach and fused kernels: the estimate mirrors the single-tensor arithmetic
    "adamw_foreach": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, foreach=True)),
    "adamw_fused": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, fused=True)),
    "adam_fused_coupled_wd": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05, fused=True)),
    "sgd_foreach_nesterov": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True,
                                                   foreach=True)),
    "sgd_fused_momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, fused=True)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5)),  # snapshot fallback
    "adagrad": (torch.optim.Adagrad, dict(lr=1e-1)),  # snapshot fallback
}
FUNCTIONAL = {"adamw", "adamw_amsgrad", "adam_coupled_wd", "adam_maximize", "sgd",
              "sgd_nesterov", "sgd_dampening", "adamw_foreach", "adamw_fused",
              "adam_fused_coupled_wd", "sgd_foreach_nesterov", "sgd_fused_momentum"}  # fmt: skip


def make_optimizer(name: str, prior_steps: int):
    """An optimizer over two flat shards (two groups) after ``prior_steps`` real steps."""
    torch.manual_seed(0)
    shards = [torch.randn(37, requires_grad=True), torch.randn(11, requires_grad=True)]
    cls, kwargs = OPTIMIZERS[name]
    opt = cls([{"params": [shards[0]]}, {"params": [shards[1]], "lr": 3e-3}], **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    for _ in range(prior_steps):
        for p in shards:
            p.grad = torch.randn_like(p)
        opt.step()
        sched.step()
    for p in shards:
        p.grad = torch.randn_like(p)
    return opt, shards


def snapshot(opt: torch.optim.Optimizer, shards: list[torch.Tensor]):
    return copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in shards]


def assert_bit_identical(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_bit_identical(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_bit_identical(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("prior_steps", [0, 3])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_peek_leaves_optimizer_state_and_lr_bit_identical(name: str, prior_steps: int) -> None:
    opt, shards = make_optimizer(name, prior_steps)
    state_before, params_before = snapshot(opt, shards)
    peek(opt, [torch.empty_like(p) for p in shards])
    state_after, params_after = snapshot(opt, shards)
    # Moments, step counts, lr, betas, and which parameters have state at all (none is created).
    assert_bit_identical(state_after, state_before)
    assert_bit_identical(params_after, params_before)


@pytest.mark.parametrize("prior_steps", [0, 3])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_peek_equals_the_real_step(name: str, prior_steps: int) -> None:
    opt, shards = make_optimizer(name, prior_steps)
    estimate = [torch.empty_like(p) for p in shards]
    peek(opt, estimate)
    opt.step()
    for p, e in zip(shards, estimate):
        torch.testing.assert_close(e, p.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", sorted(FUNCTIONAL))
def test_peek_is_functional_for_adamw_adam_and_sgd(name: str) -> None:
    """The optimizer never steps during Peek: no snapshot-step-restore of its state."""
    opt, shards = make_optimizer(name, prior_steps=2)
    assert has_functional_peek(opt)
    steps = []
    handle = opt.register_step_pre_hook(lambda *args: steps.append(args))
    estimate = [torch.empty_like(p) for p in shards]
    # Tiny chunks: the element-wise recomputation must be right across chunk boundaries.
    peek(opt, estimate, chunk_numel=5)
    assert steps == []
    handle.remove()
    opt.step()
    for p, e in zip(shards, estimate):
        torch.testing.assert_close(e, p.detach(), rtol=1e-6, atol=1e-7)


def test_other_optimizers_fall_back_to_snapshot_and_restore() -> None:
    opt, shards = make_optimizer("rmsprop", prior_steps=1)
    assert not has_functional_peek(opt)
    before = copy.deepcopy(opt.state_dict())
    steps = []
    opt.register_step_pre_hook(lambda *args: steps.append(args))
    peek(opt, [torch.empty_like(p) for p in shards])
    assert len(steps) == 1  # stepped for real on a snapshot ...
    after = opt.state_dict()  # ... and put every state tensor back
    for key, state in before["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(after["state"][key][name], value, rtol=0, atol=0)


def test_peek_writes_into_a_bf16_gather_buffer() -> None:
    opt, shards = make_optimizer("adamw", prior_steps=2)
    estimate = [torch.empty(p.shape, dtype=torch.bfloat16) for p in shards]
    peek(opt, estimate)
    opt.step()
    for p, e in zip(shards, estimate):
        torch.testing.assert_close(e, p.detach().to(torch.bfloat16), rtol=0, atol=0)


def test_adamw_decays_decoupled_without_the_param_group_key() -> None:
    """Some torch versions' AdamW has no ``decoupled_weight_decay`` key: the estimate must not
    read AdamW's rule from it (a coupled decay would be a different step)."""
    opt, shards = make_optimizer("adamw", prior_steps=2)
    saved = [group.pop("decoupled_weight_decay") for group in opt.param_groups]
    estimate = [torch.empty_like(p) for p in shards]
    peek(opt, estimate)
    for group, value in zip(opt.param_groups, saved):
        group["decoupled_weight_decay"] = value
    opt.step()
    for p, e in zip(shards, estimate):
        torch.testing.assert_close(e, p.detach(), rtol=1e-6, atol=1e-7)
