"""Bad input is refused with a message that names the setting and the fix."""

from __future__ import annotations

import pytest
import torch

from acco_hooks import ACCOOptimizer
from tests.scenario import make_model, microbatch_loss


def build(model=None, **kwargs):
    model = model or make_model()
    kwargs = {"lr": 1e-2, **kwargs}
    return model, ACCOOptimizer(model.named_parameters(), torch.optim.AdamW, **kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"mode": "sync"}, ValueError, r"mode='sync' is not one of 'acco', 'dpu', 'ddp'"),
        ({"accumulation_steps": 0}, ValueError, r"accumulation_steps=0 must be an integer >= 1"),
        ({"accumulation_steps": 2.5}, ValueError, r"accumulation_steps=2.5 must be an integer"),
        ({"accumulation_steps": True}, ValueError, r"accumulation_steps=True"),
        ({"accumulate_until_ready": "yes"}, TypeError, r"accumulate_until_ready='yes'"),
        ({"reduce_dtype": torch.int32}, ValueError, r"reduce_dtype=torch.int32 must be one of torch.float32"),
        ({"max_grad_norm": -1.0}, ValueError, r"max_grad_norm=-1.0 must be a finite number > 0"),
        ({"max_grad_norm": float("nan")}, ValueError, r"max_grad_norm=nan"),
        ({"lr_scheduler": 5}, TypeError, r"lr_scheduler must be a callable"),
    ],
)
def test_bad_setting_is_refused(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        build(**kwargs)


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


def test_step_before_any_backward_is_refused() -> None:
    _, opt = build()
    with pytest.raises(RuntimeError, match=r"no gradient reached the optimizer since the last step\(\): call loss.backward\(\) before each step\(\)"):
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
