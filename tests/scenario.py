"""A small model, deterministic data and an independent reference of the spec's recursions.

The reference is written from the algorithm as ``docs/algorithm.md`` states it, alone: one
process, the full (unsharded) model, a plain torch optimizer, the N workers simulated one after
the other. It shares no code with ``acco_hooks``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


class TinyNet(nn.Module):
    """Two linear layers and a scalar gain: 56 weights + 11 other parameters (odd counts)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 7)
        self.fc2 = nn.Linear(7, 3)
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) * self.gain


class DeepNet(nn.Module):
    """Four linear layers of different shapes and a scalar gain: matrices of 35 to 42 weights,
    enough of them that 4 ranks each own one whole (Muon's parameters).

    ``on_grid``: its gradients lie on a grid (:class:`GridGradient`), whose float32 sums are
    exact in any order, so that the engine's reduce-scatter and a reference's loop over the same
    micro-batches hand the optimizer the same bits. Muon orthogonalizes in bfloat16, where a
    one-ulp difference of the averaged gradient now and then rounds an element the other way
    and moves the step by about 1e-3 (measured off the grid: 1.2e-3 on ``layers.0.weight``
    after 12 rounds of ``ddp`` on 4 ranks). Not where a batch is split otherwise (another
    number of ranks): its pieces' gradients then differ by up to a grid step, not an ulp.
    """

    def __init__(self, on_grid: bool = False) -> None:
        super().__init__()
        self.on_grid = on_grid
        self.layers = nn.ModuleList(
            nn.Linear(a, b) for a, b in ((5, 7), (7, 6), (6, 7), (7, 3))
        )
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = GridGradient.apply if self.on_grid else (lambda tensor: tensor)
        for i, layer in enumerate(self.layers):
            x = nn.functional.linear(x, grid(layer.weight), grid(layer.bias))
            x = torch.tanh(x) if i < len(self.layers) - 1 else x
        return x * grid(self.gain)


class GridGradient(torch.autograd.Function):
    """The identity, whose gradient is rounded to multiples of 2^-18 within ±4: a float32 sum of
    up to 16 of them (4 ranks × 2 micro-batches × acco's two rounds) is exact in any order, an
    integer below 2^24 in units of 2^-18."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.round(grad.clamp(-4.0, 4.0) * 2.0**18) / 2.0**18


class GridLinear(nn.Linear):
    """``nn.Linear`` whose weight and bias gradients lie on :class:`GridGradient`'s grid: a
    module call, so that a tensor-parallel plan (``ColwiseParallel``, ``RowwiseParallel``)
    splits it as it splits ``nn.Linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, GridGradient.apply(self.weight),
                                    GridGradient.apply(self.bias))  # fmt: skip


class SplitNet(nn.Module):
    """Four linear layers for a tensor-parallel plan, column- then row-wise twice as torchtitan
    splits a feed-forward (``layers.0`` and ``layers.2`` by rows of the weight, ``layers.1`` and
    ``layers.3`` by columns; 7 rows and 7 columns split unevenly over 2 ranks, 4 + 3), and a
    scalar gain; gradients on the grid (:class:`GridLinear`)."""

    SHAPES = ((5, 8), (8, 6), (6, 7), (7, 3))

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(GridLinear(a, b) for a, b in self.SHAPES)
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            x = torch.tanh(x) if i < len(self.layers) - 1 else x
        # under tensor parallelism a DTensor replicated over the TP ranks (its gradient the same
        # on each, counted once in the gradient norm), read as the local tensor it is
        gain = self.gain.to_local() if hasattr(self.gain, "to_local") else self.gain
        return x * GridGradient.apply(gain)


def make_model(dtype: torch.dtype = torch.float32, model: str = "tiny") -> nn.Module:
    torch.manual_seed(1234)
    if model == "split":
        return SplitNet().to(dtype)
    if model.startswith("deep"):  # "deep_on_grid": DeepNet(on_grid=True)
        return DeepNet(on_grid=model == "deep_on_grid").to(dtype)
    return TinyNet().to(dtype)


# Muon's options for the matrices (torch.optim.Muon): the rest take the AdamW of "adamw"
MUON = dict(lr=5e-2, momentum=0.9, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")


class WarmupTrustRatioSGD(torch.optim.SGD):
    """A LARS-style class as many ports write it: each matrix's step scaled by its trust ratio
    ‖θ‖ / ‖g‖, the learning rate warmed up over the first ``warmup`` steps, which it counts on
    the instance (``self.calls``, not in ``state``), and an ``lr`` it requires."""

    def __init__(self, params: Any, lr: float, warmup: int = 8) -> None:
        super().__init__(params, lr=lr)
        self.warmup, self.calls = warmup, 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self.calls += 1
        warm = min(1.0, self.calls / self.warmup)
        for group in self.param_groups:
            for p in group["params"]:
                ratio = p.norm() / p.grad.norm().clamp(min=1e-12)
                p.add_(p.grad, alpha=-group["lr"] * warm * float(ratio))


# The matrices' own class (their group names it), by recipe, and its group's options
MATRICES: dict[str, tuple[type, dict[str, Any]]] = {
    "muon": (torch.optim.Muon, MUON),
    "warmup": (WarmupTrustRatioSGD, dict(lr=2e-2)),
}


def param_groups(model: nn.Module, two_groups: bool, recipe: str = "adamw") -> list[dict[str, Any]]:
    """Weight decay on matrices only (the usual LLM recipe) or one group; with a recipe of
    :data:`MATRICES` ("muon"), the matrices stepped by its class (their group names it, as
    acco_hooks takes it) and the rest by the run's optimizer."""
    named = list(model.named_parameters())
    if not two_groups:
        return [{"params": named}]
    matrices = {}
    if recipe in MATRICES:
        cls, options = MATRICES[recipe]
        matrices = {"optimizer_class": cls, **options}
    return [
        {"params": [(n, p) for n, p in named if p.ndim == 2], **matrices},
        {"params": [(n, p) for n, p in named if p.ndim != 2], "weight_decay": 0.0},
    ]


class MatricesAndAdamW:
    """The reference's optimizer for a recipe of :data:`MATRICES`: the class the matrices'
    group names over the matrices (built with the group's learning rate, which a class may
    require) and AdamW over the rest, two plain torch optimizers stepped one after the other."""

    def __init__(self, groups: list[dict[str, Any]], **adamw: Any) -> None:
        (matrices, rest) = groups
        matrices = dict(matrices)
        cls = matrices.pop("optimizer_class")
        self.parts = [cls([matrices], lr=matrices["lr"]), torch.optim.AdamW([rest], **adamw)]
        self.param_groups = [g for part in self.parts for g in part.param_groups]

    def step(self) -> None:
        for part in self.parts:
            part.step()


def microbatch_loss(model: nn.Module, rank: int, round_index: int, micro: int) -> torch.Tensor:
    """Loss of a deterministic micro-batch that depends on (rank, round, micro)."""
    g = torch.Generator().manual_seed(10_007 * rank + 101 * round_index + micro)
    x = torch.randn(4, 5, generator=g)
    y = torch.randn(4, 3, generator=g)
    param = next(model.parameters())
    prediction = model(x.to(device=param.device, dtype=param.dtype))
    return torch.nn.functional.mse_loss(prediction.float(), y.to(param.device))


@dataclass
class Config:
    mode: str = "acco"
    world_size: int = 2
    rounds: int = 12
    micro: list[int] = field(default_factory=lambda: [2, 2])  # micro-batches per round per rank
    optimizer: str = "adamw"
    two_groups: bool = True
    max_grad_norm: float | None = None
    scheduler: bool = False
    dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype | None = None
    # Per-rank micro-batch weight (e.g. tokens): the loss is multiplied by it (a sum over that
    # many units) and passed to step(weight=...). None: every micro-batch weighs 1.
    weights: list[float] | None = None
    # Per-rank number of micro-batches actually run (uneven inputs): later ones contribute
    # nothing, neither gradient nor count. None: every rank runs every micro-batch.
    limit: list[int] | None = None
    # Per round, per rank: the micro-batches it ran (accumulate_until_ready, recorded from a
    # run and replayed here; a round's list is as long as its world). None: micro[rank] in
    # every round.
    counts: list[list[int]] | None = None
    # Rounds whose micro-batches give rank 1 a NaN loss; the engine skips their update, and the
    # reference (ddp mode only) leaves the parameters unchanged in those rounds.
    nan_rounds: frozenset[int] = frozenset()
    # Where the engine run trains (the reference always runs on the CPU), and extra keyword
    # arguments of its optimizer (e.g. fused=True); the reference uses the plain optimizer.
    device: str = "cpu"
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
    # The engine run's estimate round on the wire (acco_hooks' estimate_dtype); None: exact.
    estimate_dtype: str | None = None
    # or "deep" (DeepNet), "deep_on_grid" (its gradients on a grid), "split" (SplitNet)
    model: str = "tiny"


OPTIMIZERS: dict[str, tuple[type, dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, dict(lr=3e-2, betas=(0.9, 0.95), weight_decay=0.1)),
    "sgd": (torch.optim.SGD, dict(lr=5e-2, momentum=0.9, nesterov=True, weight_decay=0.01)),
    # Muon on the matrices (MUON), this AdamW on the rest
    "muon": (torch.optim.AdamW, dict(lr=3e-2, betas=(0.9, 0.95), weight_decay=0.1)),
    # WarmupTrustRatioSGD on the matrices, this AdamW on the rest
    "warmup": (torch.optim.AdamW, dict(lr=3e-2, betas=(0.9, 0.95), weight_decay=0.1)),
}


def make_scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1.0 + 0.5 * t))


def reference_run(cfg: Config) -> dict[str, Any]:
    """The spec's recursion for ``cfg.mode``; returns the final real parameters θ by name."""
    model = make_model(torch.float32, cfg.model)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    opt_class, kwargs = OPTIMIZERS[cfg.optimizer]
    groups = [{**g, "params": [p for _, p in g["params"]]}
              for g in param_groups(model, cfg.two_groups, cfg.optimizer)]  # fmt: skip
    opt = (MatricesAndAdamW(groups, **kwargs) if cfg.optimizer in MATRICES
           else opt_class(groups, **kwargs))  # fmt: skip
    sched = make_scheduler(opt) if cfg.scheduler else None

    def set_params(values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, v in zip(params, values):
                p.copy_(v)

    def gradient_sum(at: list[torch.Tensor], round_index: int) -> tuple[list[torch.Tensor], float]:
        """Σ over workers and their micro-batches of the gradient at ``at``; and the count."""
        set_params(at)
        total = [torch.zeros_like(p) for p in params]
        count = 0.0
        # replayed counts: the workers of that round (a resharded run changes their number)
        workers = len(cfg.counts[round_index]) if cfg.counts else cfg.world_size
        for rank in range(workers):
            run = cfg.counts[round_index][rank] if cfg.counts else cfg.micro[rank]
            for micro in range(run):
                if cfg.limit and round_index * cfg.micro[rank] + micro >= cfg.limit[rank]:
                    continue
                model.zero_grad()
                weight = cfg.weights[rank] if cfg.weights else 1.0
                (weight * microbatch_loss(model, rank, round_index, micro)).backward()
                for t, p in zip(total, params):
                    t.add_(p.grad)
                count += weight
        return total, count

    def opt_step(theta, grad_sum, count, estimate: bool):
        set_params(theta)
        for p, g in zip(params, grad_sum):
            p.grad = g / count
        if cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        if estimate:  # Peek: a copy of the optimizer steps; the optimizer itself stays as it was
            parts = opt.parts if isinstance(opt, MatricesAndAdamW) else [opt]
            memo: dict[int, Any] = {}  # one copy of each parameter, in the groups and the state
            for part in parts:
                copied = object.__new__(type(part))  # every attribute, not torch's __getstate__'s
                copied.__dict__.update(copy.deepcopy(vars(part), memo))
                for p in (p for g in part.param_groups for p in g["params"]):
                    memo[id(p)].grad = p.grad.clone()
                type(copied).step(copied)  # not an LR scheduler's wrapper of the original's
            return [memo[id(p)].detach().clone() for p in params]
        opt.step()
        if sched is not None:
            sched.step()
        return [p.detach().clone() for p in params]

    theta = [p.detach().clone() for p in params]
    live, in_flight = theta, None
    carry_sum, carry_count = [torch.zeros_like(p) for p in params], 0.0
    for r in range(cfg.rounds):
        grad_sum, count = gradient_sum(live, r)
        if cfg.mode == "ddp":
            if r not in cfg.nan_rounds:
                theta = live = opt_step(theta, grad_sum, count, estimate=False)
            continue
        if cfg.mode == "acco":  # odd rounds add on top of the previous round's G̃
            grad_sum = [g + c for g, c in zip(grad_sum, carry_sum)]
            count += carry_count
        if in_flight is not None:  # the previous round's communication becomes live
            live = in_flight
        if cfg.mode == "acco" and r % 2 == 0:
            in_flight = opt_step(theta, grad_sum, count, estimate=True)
            carry_sum, carry_count = grad_sum, count
        else:
            theta = in_flight = opt_step(theta, grad_sum, count, estimate=False)
            carry_sum, carry_count = [torch.zeros_like(p) for p in params], 0.0
    return {
        "params": dict(zip(names, theta)),
        "lr": [g["lr"] for g in opt.param_groups],
    }


def engine_run(rank: int, world_size: int, cfg: Config) -> dict[str, Any]:
    """One rank of the same training with ``ACCOOptimizer`` (run under ``run_distributed``)."""
    from acco_hooks import ACCOOptimizer, declare_per_parameter_optimizer

    declare_per_parameter_optimizer(WarmupTrustRatioSGD)  # its author's declaration
    model = make_model(cfg.dtype, cfg.model).to(cfg.device)
    opt_class, kwargs = OPTIMIZERS[cfg.optimizer]
    opt = ACCOOptimizer(
        param_groups(model, cfg.two_groups, cfg.optimizer),
        opt_class,
        mode=cfg.mode,
        accumulation_steps=cfg.micro[rank],
        max_grad_norm=cfg.max_grad_norm,
        reduce_dtype=cfg.reduce_dtype,
        estimate_dtype=cfg.estimate_dtype,
        lr_scheduler=make_scheduler if cfg.scheduler else None,
        **kwargs,
        **cfg.optimizer_kwargs,
    )
    weight = cfg.weights[rank] if cfg.weights else 1.0
    for r in range(cfg.rounds):
        for micro in range(cfg.micro[rank]):
            poison = float("nan") if rank == 1 and r in cfg.nan_rounds else 1.0
            (poison * weight * microbatch_loss(model, rank, r, micro)).backward()
            ended = opt.step(weight)
            assert ended == (micro == cfg.micro[rank] - 1), (r, micro, ended)
    opt.flush()
    result = {
        "params": {n: p.detach().float().to("cpu", copy=True) for n, p in model.named_parameters()},
        "lr": [g["lr"] for g in opt.param_groups],
        "num_updates": opt.num_updates,
        "scheduler_epoch": None if opt.lr_scheduler is None else opt.lr_scheduler.last_epoch,
        "master_dtypes": [p.dtype for g in opt.optimizer.param_groups for p in g["params"]],
        "skipped_rounds": opt.engine.skipped_rounds,
        "optimizer_steps": [int(s["step"]) for s in opt.optimizer.state.values() if "step" in s],
    }
    opt.close()
    return result


def fewer_ranks_run(rank: int, world_size: int, cfg: Config, per_rank: int) -> dict[str, Any]:
    """``cfg``'s workers (``cfg.micro`` micro-batches a round each) on ``world_size`` ranks of
    ``ACCOOptimizer``, each running the micro-batches of ``per_rank`` consecutive workers in a
    round: the same micro-batches in the same rounds on fewer ranks (``cfg``'s model,
    optimizer, mode and estimate format)."""
    from acco_hooks import ACCOOptimizer

    model = make_model(cfg.dtype, cfg.model)
    opt_class, kwargs = OPTIMIZERS[cfg.optimizer]
    workers = range(rank * per_rank, (rank + 1) * per_rank)
    opt = ACCOOptimizer(param_groups(model, cfg.two_groups, cfg.optimizer), opt_class,
                        mode=cfg.mode, accumulation_steps=sum(cfg.micro[w] for w in workers),
                        estimate_dtype=cfg.estimate_dtype, **kwargs)  # fmt: skip
    for r in range(cfg.rounds):
        for worker in workers:
            for micro in range(cfg.micro[worker]):
                microbatch_loss(model, worker, r, micro).backward()
                opt.step()
    opt.flush()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.close()
    return {"params": params}


def relative_error(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """‖actual − expected‖ / ‖expected‖ over all parameters together."""
    diff = sum(float((actual[n].double() - expected[n].double()).pow(2).sum()) for n in expected)
    norm = sum(float(expected[n].double().pow(2).sum()) for n in expected)
    return (diff / norm) ** 0.5


def expected_updates(cfg: Config) -> int:
    if cfg.mode == "acco":
        return cfg.rounds // 2
    return cfg.rounds


Worker = Callable[..., Any]
