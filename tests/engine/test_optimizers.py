"""Every ``torch.optim`` class either steps the engine's flat shard exactly as torch steps the
parameters themselves, on 1 and 2 ranks, and resumes through DCP on the same and on another
number of ranks; or steps whole parameters (Adafactor, Muon: ``test_whole_parameters.py``);
or it is refused when the optimizer is built, by name and with the reason.

Any other class (a user's, transformers', a subclass of torch's) is refused by name unless
its author declares it per element, and a declared one is refused where the probe, at the run's
parameter shapes with one instance per piece, finds it is not
(``acco_hooks/engine/shard_optimizer.py``).

The parameter groups differ in their options, and one holds a single element with its own
learning rate: its shard has one element on rank 0 and none on the others, and its optimizer
state is per element all the same (the case that was saved as shared and reset on resume).
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn

from acco_hooks import declare_per_element_optimizer
from tests.scenario import make_model, relative_error

# Every class torch.optim exports, with options that make it keep all the state it can.
RUNS: dict[str, tuple[type, dict]] = {
    "ASGD": (torch.optim.ASGD, dict(lr=1e-2, t0=3, weight_decay=1e-2)),  # averaging from step 3
    "Adadelta": (torch.optim.Adadelta, dict(lr=1.0, weight_decay=1e-2)),
    "Adagrad": (torch.optim.Adagrad, dict(lr=0.1, lr_decay=1e-2, initial_accumulator_value=0.1)),
    "Adam": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=1e-2)),
    "AdamW": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "Adamax": (torch.optim.Adamax, dict(lr=1e-2, weight_decay=1e-2)),
    "NAdam": (torch.optim.NAdam, dict(lr=1e-2, decoupled_weight_decay=True, weight_decay=1e-2)),
    "RAdam": (torch.optim.RAdam, dict(lr=1e-2)),  # rectified from its 6th step
    "RMSprop": (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5, centered=True)),
    "Rprop": (torch.optim.Rprop, dict(lr=1e-2)),
    "SGD": (torch.optim.SGD, dict(lr=5e-2, weight_decay=1e-2)),
}
REFUSED = {
    "LBFGS": r"torch\.optim\.LBFGS cannot step the engine's shard: it needs a closure",
    "SparseAdam": r"torch\.optim\.SparseAdam cannot step the engine's shard: it steps sparse",
}
# Each parameter whole on the rank that owns it (tests/engine/test_whole_parameters.py)
WHOLE_PARAMETERS = {"Adafactor", "Muon"}
STEPS = 8
GLOBAL_BATCH = 12  # samples per micro-batch: splits evenly over 1, 2, 3 and 4 ranks


def test_every_torch_optimizer_is_decided() -> None:
    exported = {name for name, value in vars(torch.optim).items()
                if inspect.isclass(value) and issubclass(value, torch.optim.Optimizer)
                and value is not torch.optim.Optimizer}  # fmt: skip
    assert exported == set(RUNS) | set(REFUSED) | WHOLE_PARAMETERS


def groups(model: nn.Module, name: str) -> list[dict]:
    """Matrices; biases without weight decay; the one-element gain at half the learning rate
    (and, for SGD, the only group with momentum)."""
    named = dict(model.named_parameters())
    _, kwargs = RUNS[name]
    biases = {"weight_decay": 0.0} if "weight_decay" in kwargs else {}
    gain = {"lr": kwargs["lr"] / 2, **({"momentum": 0.9} if name == "SGD" else {})}
    return [
        {"params": [(n, named[n]) for n in ("fc1.weight", "fc2.weight")]},
        {"params": [(n, named[n]) for n in ("fc1.bias", "fc2.bias")], **biases},
        {"params": [("gain", named["gain"])], **gain},
    ]


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of micro-batch ``step``'s global batch."""
    g = torch.Generator().manual_seed(7919 * step)
    x, y = torch.randn(GLOBAL_BATCH, 5, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
    share = GLOBAL_BATCH // world_size
    return x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]


def torch_run(name: str, world_size: int) -> dict[str, torch.Tensor]:
    """The oracle: torch's own optimizer on the whole parameters, each step on the average of
    the ranks' gradients (each of its share's mean loss)."""
    cls, kwargs = RUNS[name]
    model = make_model()
    opt = cls([{**g, "params": [p for _, p in g["params"]]} for g in groups(model, name)], **kwargs)
    return torch_training(model, [opt], world_size)


def torch_training(model: nn.Module, optimizers: list, world_size: int) -> dict[str, torch.Tensor]:
    """``optimizers`` (torch's own, over ``model``'s parameters) stepped on the average of every
    rank's gradient of each micro-batch; the parameters at the end."""
    for step in range(STEPS):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for rank in range(world_size):
            model.zero_grad()
            x, y = batch(step, rank, world_size)
            nn.functional.mse_loss(model(x), y).backward()
            torch._foreach_add_(total, [p.grad for p in model.parameters()])
        for p, t in zip(model.parameters(), total):
            p.grad = t / world_size
        for optimizer in optimizers:
            optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def engine_run(rank: int, world_size: int, name: str, mode: str = "ddp", first: int = 0,
               last: int = STEPS, save_to: str | None = None, save_at: int = -1,
               load_from: str | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """The engine over the same groups, one micro-batch per round: micro-batches ``first`` ..
    ``last - 1``, saving with DCP after ``save_at`` of them, after loading ``load_from``."""
    from acco_hooks import ACCOOptimizer

    cls, kwargs = RUNS[name]
    model = make_model()
    opt = ACCOOptimizer(groups(model, name), cls, mode=mode, accumulation_steps=1, **kwargs)
    return train_and_checkpoint(model, opt, rank, world_size, first, last, save_at,
                                *through_dcp(save_to, load_from))  # fmt: skip


def through_dcp(save_to: str | None, load_from: str | None) -> tuple:
    """The ``save`` and ``load`` of :func:`train_and_checkpoint` through DCP."""
    import torch.distributed.checkpoint as dcp

    def load(state: dict) -> dict:
        dcp.load(state, checkpoint_id=load_from)
        return state

    return (lambda state: dcp.save(state, checkpoint_id=save_to),
            None if load_from is None else load)


def train_and_checkpoint(model: nn.Module, opt, rank: int, world_size: int, first: int,
                         last: int, save_at: int = -1, save=None, load=None) -> dict:  # fmt: skip
    """Load (``load(state)`` returns the model's and optimizer's state filled), train this
    rank's share of micro-batches ``first`` .. ``last - 1`` one per round, ``save(state)`` after
    ``save_at`` of them; the real parameters at the end."""
    if load is not None:
        state = load({"model": model.state_dict(), "optim": opt.state_dict()})
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
    for step in range(first, last):
        x, y = batch(step, rank, world_size)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if step + 1 == save_at:
            save({"model": model.state_dict(), "optim": opt.state_dict()})
    opt.flush()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.close()
    return params


@pytest.mark.parametrize("name", sorted(RUNS))
def test_each_per_element_optimizer_steps_as_torch_on_one_process(name: str) -> None:
    assert relative_error(engine_run(0, 1, name), torch_run(name, 1)) <= 1e-6


@pytest.mark.parametrize("name", sorted(RUNS))
def test_each_per_element_optimizer_steps_as_torch_on_two_ranks_and_resumes_anywhere(
    name: str, rank_pool, tmp_path
) -> None:
    """ddp: torch's optimizer on the averaged gradient. acco, saved between an estimate and its
    update (state, ΣG̃ and a one-element shard in flight), resumed through DCP on 2, 1 and 3
    ranks: the uninterrupted run's parameters."""
    ranks = rank_pool.run(f"{__name__}:engine_run", 2, name)
    assert relative_error(ranks[0], torch_run(name, 2)) <= 1e-6
    assert relative_error(ranks[1], ranks[0]) == 0.0
    ckpt = str(tmp_path / "between")
    straight = rank_pool.run(f"{__name__}:engine_run", 2, name, "acco", 0, 12, ckpt, 5)[0]
    for world_size in (2, 1, 3):
        resumed = rank_pool.run(f"{__name__}:engine_run", world_size, name, "acco", 5, 12, None,
                                -1, ckpt)[0]  # fmt: skip
        error = relative_error(resumed, straight)
        assert error == 0.0 if world_size == 2 else error <= 1e-5, (world_size, error)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_each_optimizer_the_flat_shard_cannot_run_is_refused_by_name(name: str) -> None:
    from acco_hooks import ACCOOptimizer

    with pytest.raises(TypeError, match=REFUSED[name]):
        ACCOOptimizer(nn.Linear(4, 2).named_parameters(), getattr(torch.optim, name), lr=0.1)


class TrustRatioSGD(torch.optim.SGD):
    """A LAMB-style step: SGD scaled by ‖θ‖ / ‖update‖, norms over the whole parameter."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                ratio = p.norm() / p.grad.norm().clamp(min=1e-12)
                self.state[p]["trust_ratio"] = ratio
                p.add_(p.grad, alpha=-group["lr"] * float(ratio))


class LARS(torch.optim.SGD):
    """LARS with the usual 1-D filters: biases and norms take neither decay nor trust ratio."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                update = p.grad.clone()
                if p.ndim > 1:
                    update.add_(p, alpha=1e-2)
                    update.mul_(p.norm() / update.norm().clamp(min=1e-12))
                p.add_(update, alpha=-group["lr"])


class MuPSGD(torch.optim.SGD):
    """muP-style: a matrix's step divided by its fan-in."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                fan_in = p.shape[1] if p.ndim > 1 else 1
                p.add_(p.grad, alpha=-group["lr"] / fan_in)


class MatrixDecayAdamW(torch.optim.AdamW):
    """AdamW that decays only p.ndim >= 2 (an option a user sets in step())."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim >= 2:
                    p.mul_(1 - group["lr"] * 0.1)
        return super().step(closure)


class GlobalClippingSGD(torch.optim.SGD):
    """Clipping by the norm over all of the optimizer's parameters inside step(), as timm's
    Lamb, apex's FusedLAMB and Adan do."""

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"]]
        torch.nn.utils.clip_grads_with_norm_(
            [p for g in self.param_groups for p in g["params"]], 0.5,
            torch.nn.utils.get_total_norm(grads),
        )
        return super().step(closure)


class LateTrustRatioSGD(TrustRatioSGD):
    """Plain SGD for 3 steps, a trust ratio from the 4th (as preconditioners start late)."""

    @torch.no_grad()
    def step(self, closure=None):
        self.steps = getattr(self, "steps", 0) + 1
        return super().step(closure) if self.steps > 3 else torch.optim.SGD.step(self, closure)


NOT_PER_ELEMENT = {"TrustRatioSGD": TrustRatioSGD, "LARS": LARS, "MuPSGD": MuPSGD,
                   "MatrixDecayAdamW": MatrixDecayAdamW, "GlobalClippingSGD": GlobalClippingSGD,
                   "LateTrustRatioSGD": LateTrustRatioSGD}  # fmt: skip


@pytest.mark.parametrize("name", sorted(NOT_PER_ELEMENT) + ["transformers.Adafactor"])
def test_a_class_not_known_to_be_per_element_is_refused_by_name(name: str) -> None:
    from acco_hooks import ACCOOptimizer

    if name == "transformers.Adafactor":  # as the Trainer's optim="adafactor"
        from transformers.optimization import Adafactor as cls
    else:
        cls = NOT_PER_ELEMENT[name]
    with pytest.raises(TypeError, match=rf"{cls.__qualname__} is not known to step each "
                                        r"parameter element on its own.*declare_per_element_"
                                        rf"optimizer\({cls.__qualname__}\)"):  # fmt: skip
        ACCOOptimizer(nn.Linear(4, 2).named_parameters(), cls, lr=0.1)


class DeclaredLARS(LARS):
    pass


class DeclaredMuPSGD(MuPSGD):
    pass


class DeclaredMatrixDecayAdamW(MatrixDecayAdamW):
    pass


class DeclaredGlobalClippingSGD(GlobalClippingSGD):
    pass


class DeclaredLateTrustRatioSGD(LateTrustRatioSGD):
    pass


@pytest.mark.parametrize("cls, differs", [
    (DeclaredLARS, "update"), (DeclaredMatrixDecayAdamW, "update"),
    (DeclaredGlobalClippingSGD, "update"),
    (DeclaredLateTrustRatioSGD, "update"),  # from step 4: the probe's last (one from step 10 runs)
    (DeclaredMuPSGD, "update"),  # a flat piece has no fan-in
])  # fmt: skip
def test_a_declared_class_the_probe_finds_not_per_element_is_refused(cls: type, differs) -> None:
    """The probe steps the run's own parameter shapes whole, and flat pieces in instances of
    their own (as ranks' shards)."""
    from acco_hooks import ACCOOptimizer, declare_per_element_optimizer

    declare_per_element_optimizer(cls)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    expected = (rf"{cls.__qualname__} was declared per element .*gave a different its {differs}"
                if differs else rf"{cls.__qualname__} failed to step a flat 1-D piece")
    with pytest.raises(TypeError, match=expected):
        ACCOOptimizer(model.named_parameters(), cls, lr=0.1)


def test_torchs_own_classes_cannot_be_declared_when_the_flat_shard_cannot_run_them() -> None:
    from acco_hooks import declare_per_element_optimizer

    with pytest.raises(TypeError, match=r"torch\.optim\.Adafactor is not per element"):
        declare_per_element_optimizer(torch.optim.Adafactor)


@declare_per_element_optimizer
class ClippedSGD(torch.optim.SGD):
    """A user's per-element variant: each gradient element clipped to [-1, 1] first."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.grad.clamp_(-1.0, 1.0)
        return super().step(closure)


def test_a_declared_per_element_optimizer_runs_exactly() -> None:
    from acco_hooks import ACCOOptimizer

    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    reference = copy.deepcopy(model)
    opt = ACCOOptimizer(model.named_parameters(), ClippedSGD, mode="ddp", lr=0.5, momentum=0.9)
    torch_opt = ClippedSGD(reference.parameters(), lr=0.5, momentum=0.9)
    for step in range(4):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step)) * 10
        for m in (model, reference):
            m(x).pow(2).sum().backward()
        opt.step()
        torch_opt.step()
        torch_opt.zero_grad()
    opt.close()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
