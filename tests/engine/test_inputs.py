"""Inputs: what plain PyTorch accepts trains the same model under the engine, and what it
cannot serve is refused by name, at the first call that would go wrong.

The reference is the same model trained with the same ``torch.optim`` class and no engine:
``mode="ddp"`` on one process is then a plain optimizer step on the average of the round's
micro-batch gradients. The settings themselves are checked in ``tests/test_settings.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from acco_hooks import ACCOOptimizer
from tests.scenario import make_model, microbatch_loss

ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


class Awkward(nn.Module):
    """Tied weights, a channels-last conv, a non-contiguous parameter, a branch that only some
    micro-batches use, and a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.conv = nn.Conv2d(6, 6, 3, padding=1).to(memory_format=torch.channels_last)
        self.transposed = nn.Parameter(torch.randn(6, 4).t())  # a (4, 6) view, not contiguous
        self.sometimes = nn.Linear(6, 6)
        self.frozen = nn.Parameter(torch.randn(6), requires_grad=False)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor, use_branch: bool) -> torch.Tensor:
        x = self.embed(tokens)  # (B, T, 6)
        image = x.transpose(1, 2).unsqueeze(-1).expand(-1, -1, -1, 3).contiguous()
        x = x + self.conv(image.to(memory_format=torch.channels_last)).mean(-1).transpose(1, 2)
        x = x + (x @ self.transposed.t() @ self.transposed) * 0.1 + self.frozen
        if use_branch:
            x = x + self.sometimes(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), tokens.flatten())


def _batches(rounds: int, steps: int) -> list[list[tuple[torch.Tensor, bool]]]:
    gen = torch.Generator().manual_seed(1)
    return [[(torch.randint(0, 11, (2, 5), generator=gen), micro == 0) for micro in range(steps)]
            for _ in range(rounds)]  # fmt: skip


def test_awkward_parameters_train_as_with_plain_adamw() -> None:
    assert not Awkward().transposed.is_contiguous()
    torch.manual_seed(0)
    model = Awkward()
    reference = copy.deepcopy(model)
    steps, rounds = 3, 4
    opt = ACCOOptimizer(model.named_parameters(), torch.optim.AdamW, mode="ddp",
                        accumulation_steps=steps, **ADAMW)  # fmt: skip
    # Added after the optimizer was built: as with a torch optimizer, it is not trained and its
    # gradient accumulates in .grad.
    model.late = nn.Parameter(torch.ones(6))
    reference.late = nn.Parameter(torch.ones(6))
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p is not reference.late],
                                **ADAMW)  # fmt: skip
    for round_batches in _batches(rounds, steps):
        for tokens, use_branch in round_batches:
            (model(tokens, use_branch) + model.late.sum()).backward()
            opt.step()
            ((reference(tokens, use_branch) + reference.late.sum()) / steps).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    opt.close()
    trained = dict(model.named_parameters())
    for name, expected in reference.named_parameters():
        torch.testing.assert_close(trained[name], expected, rtol=1e-5, atol=1e-6, msg=name)
    assert model.head.weight is model.embed.weight  # still tied
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(model.late.grad, torch.full((6,), float(rounds * steps)))
    torch.testing.assert_close(model.late, torch.ones(6))


def test_sparse_gradient_is_refused_by_name() -> None:
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    opt = ACCOOptimizer(model.named_parameters(), torch.optim.SGD, mode="ddp", lr=0.1)
    with pytest.raises(RuntimeError, match=r"0.weight got a torch.sparse_coo gradient.*sparse=False"):
        model(torch.tensor([[1, 2]])).sum().backward()
    opt.close()


def test_complex_parameters_are_refused_at_construction() -> None:
    weight = nn.Parameter(torch.randn(3, dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"dtype torch.complex64; only floating"):
        ACCOOptimizer([("weight", weight)], torch.optim.AdamW, lr=1e-2)


def test_a_scheduler_that_steps_on_a_metric_is_refused_when_the_optimizer_is_built() -> None:
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    with pytest.raises(TypeError, match=r"lr_scheduler= built a ReduceLROnPlateau, whose step\(\) "
                                        r"needs metrics.*CosineAnnealingLR"):  # fmt: skip
        ACCOOptimizer(nn.Linear(4, 2).parameters(), torch.optim.SGD, lr=0.1,
                      lr_scheduler=lambda o: plateau(o))  # fmt: skip


def test_a_frozen_group_keeps_its_index_as_in_a_torch_optimizer() -> None:
    """A warm-up that addresses groups by index reaches the group it means."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.5}]
    opt = ACCOOptimizer(groups, torch.optim.SGD, mode="ddp", lr=0.1)
    assert [len(g["params"]) for g in opt.param_groups] == [0, 1]
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5]
    opt.param_groups[1]["lr"] = 0.0  # the head's warm-up starts at 0: nothing moves
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.flush()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    opt.close()


def test_grad_scaler_is_refused() -> None:
    model = nn.Linear(4, 1)
    opt = ACCOOptimizer(model.parameters(), torch.optim.SGD, mode="ddp", lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    with pytest.raises(RuntimeError, match=r"GradScaler is not supported.*bfloat16"):
        scaler.step(opt)
    for p, b in zip(model.parameters(), before):
        torch.testing.assert_close(p, b, rtol=0, atol=0)  # nothing was applied
    opt.close()


def test_step_without_backward_is_refused_at_that_step() -> None:
    model = nn.Linear(4, 1)
    opt = ACCOOptimizer(model.parameters(), torch.optim.SGD, mode="ddp", accumulation_steps=4,
                        lr=0.1)  # fmt: skip
    model(torch.randn(2, 4)).sum().backward()
    assert not opt.step()
    with pytest.raises(RuntimeError, match=r"no gradient reached the optimizer since the last "
                       r"step\(\): call loss.backward\(\) before each step\(\)"):  # fmt: skip
        opt.step()
    model(torch.randn(2, 4)).sum().backward()  # the loop can go on
    assert not opt.step()
    assert opt.engine.microbatches_in_round == 2
    opt.close()


def test_closure_is_refused() -> None:
    model = nn.Linear(4, 1)
    opt = ACCOOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match=r"step\(closure\) is not supported"):
        opt.step(lambda: model(torch.randn(2, 4)).sum())
    opt.close()


def test_two_open_optimizers_on_one_model_are_refused() -> None:
    model = nn.Linear(4, 1)
    first = ACCOOptimizer(model.named_parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match=r"weight, bias already train\(s\) under another ACCO"):
        ACCOOptimizer(model.named_parameters(), torch.optim.SGD, lr=0.1)
    first.close()
    second = ACCOOptimizer(model.named_parameters(), torch.optim.SGD, lr=0.1)  # now it may
    model(torch.randn(2, 4)).sum().backward()
    assert second.step()
    second.close()


def test_zero_grad_between_backward_and_step_is_refused() -> None:
    model = nn.Linear(4, 1)
    opt = ACCOOptimizer(model.parameters(), torch.optim.SGD, mode="ddp", accumulation_steps=2,
                        lr=0.1)  # fmt: skip
    opt.zero_grad()  # before backward, or after step(): the usual places
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) between backward\(\) and step\(\)"):
        opt.zero_grad()  # a loop that means to drop this gradient would silently keep it
    assert not opt.step()
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    assert opt.step()
    opt.zero_grad()
    opt.close()


def test_unfreezing_a_parameter_after_building_is_refused_at_the_round_end() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model[0].requires_grad_(False)
    opt = ACCOOptimizer(model.named_parameters(), torch.optim.SGD, mode="ddp", lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    assert opt.step()  # frozen: left alone, as by a torch optimizer
    model[0].requires_grad_(True)  # gradual unfreezing
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"0.weight, 0.bias had requires_grad=False when the "
                       r"optimizer was built.*Build the optimizer after unfreezing"):
        opt.step()
    opt.close()


# --------------------------------------------------------------- refused at the first call


def build(model=None, **kwargs):
    model = model or make_model()
    kwargs = {"lr": 1e-2, **kwargs}
    return model, ACCOOptimizer(model.named_parameters(), torch.optim.AdamW, **kwargs)


def test_optimizer_instance_instead_of_class_is_refused() -> None:
    model = make_model()
    with pytest.raises(TypeError, match=r"optimizer_class must be a torch.optim.Optimizer subclass"):
        ACCOOptimizer(model.parameters(), torch.optim.AdamW(model.parameters()))


def test_empty_and_duplicate_params_are_refused() -> None:
    with pytest.raises(ValueError, match="empty parameter list"):
        ACCOOptimizer([], torch.optim.AdamW)
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="appears more than once"):
        ACCOOptimizer([p, p], torch.optim.AdamW)


def test_parameter_without_grad_at_round_end_is_named() -> None:
    model = make_model()
    model.unused = torch.nn.Linear(2, 2)
    _, opt = build(model, accumulation_steps=2)
    microbatch_loss(model, 0, 0, 0).backward()
    opt.step()
    microbatch_loss(model, 0, 0, 1).backward()
    with pytest.raises(RuntimeError, match=r"no gradient reached unused.weight, unused.bias during round 0.*requires_grad=False"):
        opt.step()
    opt.close()


def test_frozen_parameters_are_left_alone() -> None:
    model = make_model()
    model.gain.requires_grad_(False)
    _, opt = build(model)
    microbatch_loss(model, 0, 0, 0).backward()
    assert opt.step()
    opt.close()
    assert model.gain.item() == 1.0


def test_parameters_on_mixed_devices_are_refused() -> None:
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3, device="meta"))]
    with pytest.raises(ValueError, match=r"several devices \['cpu', 'meta'\].*move the whole model"):
        ACCOOptimizer(params, torch.optim.AdamW)


def test_non_positive_microbatch_weight_is_refused() -> None:
    model, opt = build()
    microbatch_loss(model, 0, 0, 0).backward()
    with pytest.raises(ValueError, match="weight must be > 0"):
        opt.step(0)
    opt.close()


def test_lr_scheduler_cannot_be_attached_to_the_acco_optimizer() -> None:
    """Schedulers go through lr_scheduler=, which steps them once per real update."""
    _, opt = build()
    with pytest.raises(TypeError, match="ACCOOptimizer is not an Optimizer"):
        torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    opt.close()
