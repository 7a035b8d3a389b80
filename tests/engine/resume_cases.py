"""Training runs that save and resume the engine through DCP on any number of ranks, described
by one value (:class:`ResumeCase`), for the resume tests, hand-written and generated.

The oracle of a resumed run is the uninterrupted one: every micro-batch is one global batch
split evenly over the ranks (12, 24 or 36 samples: 1, 2, 3 and 4 ranks split them alike), so a run
on N ranks and one on N' ranks train on the same data. A resumed run must end at the
uninterrupted run's parameters (to the order of float sums on another world), or its load must
be refused by name.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import torch
from torch import nn

from acco_hooks import declare_per_element_optimizer


@declare_per_element_optimizer
class RequiredArgsSGD(torch.optim.SGD):
    """A user's SGD whose constructor requires its arguments (declared per element): a copy of
    it can be built only with the run's own keyword arguments (a save before the first step)."""

    def __init__(self, params: Any, lr: float, momentum: float) -> None:
        super().__init__(params, lr=lr, momentum=momentum)


OPTIMIZERS: dict[str, tuple[type, dict[str, Any]]] = {
    "AdamW": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "SGD": (torch.optim.SGD, dict(lr=5e-2, momentum=0.9)),
    "Adagrad": (torch.optim.Adagrad, dict(lr=0.1)),  # a snapshot estimate (no functional Peek)
    "RequiredArgsSGD": (RequiredArgsSGD, dict(lr=5e-2, momentum=0.9)),
    # whole parameters: Adafactor on every group; Muon on each group of matrices only, AdamW on
    # the others (a grouped shard optimizer)
    "Adafactor": (torch.optim.Adafactor, dict(lr=1e-2)),
    "Muon+AdamW": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
}


@dataclasses.dataclass(frozen=True)
class ResumeCase:
    """A model, its parameter groups, the engine's settings and the data's weighting."""

    shapes: tuple[tuple[int, ...], ...] = ((3, 4), (4,), (1,))
    # each parameter's group, and each group's options (sorted (key, value) pairs)
    group_of: tuple[int, ...] = (0, 0, 1)
    group_options: tuple[tuple[tuple[str, float], ...], ...] = ((), (("lr", 5e-3),))
    optimizer: str = "AdamW"
    mode: str = "acco"
    accumulation_steps: int = 2
    estimate_microbatches: int | None = None
    estimate_dtype: str | None = None
    # "mean": each rank's loss is the mean over its share, weight 1; "tokens": summed over its
    # share, weighed by its size, and the global batch cycles through 12, 24 and 36 samples
    weights: str = "mean"
    named: bool = True  # the optimizer gets (name, parameter) pairs; else bare parameters
    # parameters with requires_grad=False (a group of frozen ones only stays, at its index)
    frozen: tuple[bool, ...] = ()

    @property
    def exact_on_the_same_ranks(self) -> bool:
        """A resume on the saving ranks is bit for bit the uninterrupted run, except where a
        narrow estimate's gradients wait in the accumulators: the checkpoint sums them first."""
        return self.estimate_dtype is None


class Generic(nn.Module):
    """One parameter per shape; each one's elements act through a fixed random projection."""

    def __init__(self, shapes: tuple[tuple[int, ...], ...]) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(99)
        self.weights = nn.ParameterList(
            [nn.Parameter(torch.randn(shape, generator=gen) * 0.5) for shape in shapes]
        )
        self.projections = [torch.randn(5, math.prod(shape), generator=gen) for shape in shapes]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[0])
        for p, projection in zip(self.weights, self.projections):
            out = out + torch.tanh((x @ projection) * p.reshape(-1)).sum(-1)
        return out


def build(case: ResumeCase) -> tuple[Generic, Any]:
    from acco_hooks import ACCOOptimizer

    model = Generic(case.shapes)
    for p, frozen in zip(model.parameters(), case.frozen):
        p.requires_grad_(not frozen)
    named = list(model.named_parameters())
    groups = [
        {"params": [item if case.named else item[1]
                    for item, g in zip(named, case.group_of) if g == gi], **dict(options)}
        for gi, options in enumerate(case.group_options)
    ]  # fmt: skip
    if case.optimizer == "Muon+AdamW":
        for group in groups:
            tensors = [item if isinstance(item, torch.Tensor) else item[1] for item in group["params"]]
            if all(t.ndim == 2 for t in tensors):
                group["optimizer_class"] = torch.optim.Muon
    cls, kwargs = OPTIMIZERS[case.optimizer]
    opt = ACCOOptimizer(
        groups, cls, mode=case.mode, accumulation_steps=case.accumulation_steps,
        estimate_microbatches=case.estimate_microbatches, estimate_dtype=case.estimate_dtype,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda t: 1 / (1 + 0.3 * t)),
        **kwargs,
    )  # fmt: skip
    return model, opt


def train(model: Generic, opt: Any, case: ResumeCase, rank: int, world_size: int,
          first: int, last: int) -> None:  # fmt: skip
    """Micro-batches ``first`` .. ``last - 1``: this rank's share of each global batch."""
    for i in range(first, last):
        size = 12 * (1 + i % 3) if case.weights == "tokens" else 12
        g = torch.Generator().manual_seed(7919 * i)
        x, y = torch.randn(size, 5, generator=g), torch.randn(size, generator=g)
        share = size // world_size
        mine = slice(rank * share, (rank + 1) * share)
        if case.weights == "tokens":
            nn.functional.mse_loss(model(x[mine]), y[mine], reduction="sum").backward()
            opt.step(share)
        else:
            nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            opt.step()


def run(rank: int, world_size: int, case: ResumeCase, first: int, last: int,
        load_from: str | None = None, saves: tuple[tuple[int, str], ...] = (),
        theta_in_model: bool = False) -> dict | str:  # fmt: skip
    """Build, load ``load_from`` (a DCP checkpoint) if given, train micro-batches ``first`` ..
    ``last - 1``, saving with DCP after each ``(micro-batches done, path)`` of ``saves``. With
    ``theta_in_model`` the model is saved inside ``real_weights()`` (θ) and the engine's live
    parameters beside it, and loaded back from there.

    Returns the real parameters θ at the end (and the warnings of the load), or the message
    that refused the load.
    """
    import torch.distributed.checkpoint as dcp

    model, opt = build(case)

    def state() -> dict:
        own = {"model": model.state_dict(), "optim": opt.state_dict()}
        return {**own, "live": opt.engine.live_state_dict()} if theta_in_model else own

    def save(path: str) -> None:
        if not theta_in_model:
            dcp.save(state(), checkpoint_id=path)
            return
        with opt.real_weights():
            dcp.save(state(), checkpoint_id=path)

    caught: list[str] = []
    if load_from is not None:
        loaded = state()
        dcp.load(loaded, checkpoint_id=load_from)
        model.load_state_dict(loaded["model"])
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            try:
                opt.load_state_dict(loaded["optim"])
            except ValueError as refusal:
                opt.close()
                return str(refusal)
        if theta_in_model:
            opt.engine.load_live_state_dict(loaded["live"])
        caught = [str(r.message) for r in records]
    saves = dict(saves)
    if first in saves:  # right after the load, before any step
        save(saves[first])
    for done in range(first, last):
        train(model, opt, case, rank, world_size, done, done + 1)
        if done + 1 in saves:
            save(saves[done + 1])
    opt.flush()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.close()
    return {"params": params, "warnings": caught}


def relative_error(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    diff = sum(float((actual[n].double() - expected[n].double()).pow(2).sum()) for n in expected)
    norm = sum(float(expected[n].double().pow(2).sum()) for n in expected)
    return (diff / norm) ** 0.5


def saved_model(rank: int, world_size: int, case: ResumeCase, path: str) -> dict:
    """The model a DCP checkpoint holds, read into a fresh model alone."""
    import torch.distributed.checkpoint as dcp

    model = Generic(case.shapes)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)
    return {n: t.clone() for n, t in state["model"].items()}
