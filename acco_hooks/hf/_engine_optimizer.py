"""What the Trainer holds as its optimizer and scheduler, and the optimizer its settings name."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn
from transformers.optimization import get_scheduler

from acco_hooks._frontend import EngineFrontEnd
from acco_hooks.engine import ACCOEngine, real_updates
from acco_hooks.engine.shard_optimizer import check_optimizer

__all__ = ["STEP_COUNTED_SCHEDULER_KWARGS", "EngineOptimizer", "EngineSchedule", "build_engine",
           "optimizer_cls_and_kwargs", "schedule_over_real_updates"]  # fmt: skip

_NO_CLIPPING = 1e30
# transformers' scheduler arguments counted in Trainer steps (warmup_stable_decay's phases,
# inverse_sqrt's time scale): converted to real updates as warmup_steps is
STEP_COUNTED_SCHEDULER_KWARGS = frozenset({"num_stable_steps", "num_decay_steps", "timescale"})


def build_engine(
    trainer: Any, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer],
    optimizer_kwargs: dict[str, Any], rounds: int,
) -> ACCOEngine:  # fmt: skip
    """The engine over the Trainer's two parameter groups (weight decay / none), with the
    Trainer's clipping, timeout and LR schedule and the ``ACCOArguments`` settings."""
    decay = set(trainer.get_decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [(n, p) for n, p in named if n in decay],
         "weight_decay": trainer.args.weight_decay},
        {"params": [(n, p) for n, p in named if n not in decay], "weight_decay": 0.0},
    ]  # fmt: skip
    # Without clipping, a bound no norm reaches: the engine still measures the gradient
    # norm, which the Trainer logs as ``grad_norm`` in any case (a scalar all-reduce).
    max_grad_norm = trainer.args.max_grad_norm
    if not (max_grad_norm and max_grad_norm > 0):
        max_grad_norm = _NO_CLIPPING
    acco = trainer.acco_args
    timeout = acco.timeout
    if timeout is None and trainer.args.ddp_timeout:
        timeout = float(trainer.args.ddp_timeout)  # as the Trainer's own process group
    settings = acco.to_engine_settings(
        accumulation_steps=trainer.args.gradient_accumulation_steps,
        max_grad_norm=max_grad_norm, timeout=timeout,
    )
    return ACCOEngine(
        groups,  # both, as the Trainer's own optimizer has them (one may be empty)
        optimizer_cls,
        settings=settings,
        lr_scheduler=functools.partial(schedule_over_real_updates, trainer.args, acco.mode, rounds),
        weights_are_shares=True,  # training_step weighs shares of each Trainer step (_loss_weights)
        **optimizer_kwargs,
    )


class EngineOptimizer(EngineFrontEnd):
    """What the Trainer holds as ``trainer.optimizer``: the engine, fed by ``training_step``.

    ``step()`` and ``zero_grad()`` are no-ops: rounds end in ``training_step`` and gradients
    never stay in ``.grad``. ``param_groups`` are the shard optimizer's (current ``lr`` there).
    """

    def __init__(self, engine: ACCOEngine) -> None:
        super().__init__(engine)
        engine.hook_param_grads()

    def step(self, closure: Any = None) -> None:
        """No-op: the Trainer step's last micro-batch already ended the engine's round."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op: gradients live in the engine."""


class EngineSchedule:
    """What the Trainer holds as ``trainer.lr_scheduler``; the real one is the engine's.

    The engine steps its scheduler after each real update (every other round in ``acco``), so
    the Trainer's per-step ``lr_scheduler.step()`` must not: it is a no-op here. The state is
    saved with the engine's.
    """

    def __init__(self, optimizer: EngineOptimizer) -> None:
        self.optimizer = optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        """No-op: the engine steps the real scheduler after each real update."""

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {}  # in the engine's state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to load: the engine's state holds the schedule."""


def optimizer_cls_and_kwargs(trainer: Any, model: nn.Module) -> tuple[type, dict[str, Any]]:
    """The torch optimizer class and keyword arguments the Trainer's settings name."""
    if trainer.optimizer_cls_and_kwargs is not None:
        optimizer_cls, kwargs = trainer.optimizer_cls_and_kwargs
        source = "optimizer_cls_and_kwargs"
    else:
        optim = str(getattr(trainer.args.optim, "value", trainer.args.optim))
        if optim.startswith("schedule_free"):
            raise ValueError(
                f"ACCOTrainer: TrainingArguments.optim={optim!r}: schedule-free optimizers "
                "evaluate at other weights than they train (optimizer.eval()/train()), which "
                "the ACCO engine's shard optimizer does not follow. Use optim='adamw_torch' "
                "with an LR schedule"
            )
        optimizer_cls, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, model)
        source = f"TrainingArguments.optim={optim!r}"
    kwargs = dict(kwargs)
    special = sorted({"params", "model", "optimizer_dict"} & kwargs.keys())
    is_torch_optimizer = isinstance(optimizer_cls, type) and issubclass(
        optimizer_cls, torch.optim.Optimizer
    )
    if not is_torch_optimizer or special:
        raise ValueError(
            f"ACCOTrainer: {source} gives {getattr(optimizer_cls, '__name__', optimizer_cls)}"
            + (f" built over its own {', '.join(special)}" if special else "")
            + ", which the ACCO engine cannot run on a flat shard of the parameters. Use a "
            "torch.optim optimizer such as optim='adamw_torch_fused' (the default), "
            "'adamw_torch' or 'sgd', or "
            "optimizer_cls_and_kwargs=(torch.optim.AdamW, {...})"
        )
    device = next(model.parameters()).device
    decay = set(trainer.get_decay_parameter_names(model))
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # the Trainer's two groups (weight decay / none), the empty one left out
    groups = [({"weight_decay": weight_decay},
               [tuple(p.shape) for n, p in trained if (n in decay) == decaying])
              for decaying, weight_decay in ((True, trainer.args.weight_decay), (False, 0.0))]
    groups = [(options, shapes) for options, shapes in groups if shapes]  # fmt: skip
    # the engine's own decision at the Trainer's groups' options and shapes: per element (a
    # flat shard), whole parameters (each stepped on the rank that owns it: torch's
    # Adafactor), or refused (torch's Muon, which steps 2-D matrices only, over the biases too)
    try:
        check_optimizer(optimizer_cls, [o for o, _ in groups], kwargs, device,
                        [s for _, s in groups])  # fmt: skip
    except TypeError as refusal:
        raise ValueError(
            f"ACCOTrainer: {source} gives {optimizer_cls.__name__}, which the ACCO engine "
            f"cannot run ({refusal}). Use optim='adamw_torch_fused' (the default), "
            "'adamw_torch' or 'sgd', or torch.optim.Adafactor; a class for some parameters "
            "only (torch.optim.Muon on the matrices) beside AdamW on the rest needs parameter "
            "groups, which ACCOOptimizer and torchtitan's optimizer.param_groups take and "
            "ACCOTrainer does not yet"
        ) from refusal
    return optimizer_cls, kwargs


def schedule_over_real_updates(
    args: Any, mode: str, rounds: int, shard_optimizer: torch.optim.Optimizer
) -> Any:
    """The ``lr_scheduler_type`` schedule over the real updates, on the shard optimizer.

    Every length the Trainer counts in its steps (rounds), ``warmup_steps`` and the step counts
    in ``lr_scheduler_kwargs`` (:data:`STEP_COUNTED_SCHEDULER_KWARGS`), becomes as many rounds
    in real updates, so that each phase lasts the same Trainer steps as without ACCO.
    """
    updates = max(1, real_updates(mode, rounds))

    def in_updates(steps: int) -> int:
        return math.ceil(int(steps) * updates / max(1, rounds))

    warmup = args.get_warmup_steps(updates) if args.warmup_steps < 1 else in_updates(
        args.warmup_steps
    )  # a ratio of the schedule, or counted in Trainer steps  # fmt: skip
    kwargs = dict(args.lr_scheduler_kwargs or {})
    for key in STEP_COUNTED_SCHEDULER_KWARGS.intersection(kwargs):
        if kwargs[key] is not None:
            kwargs[key] = in_updates(kwargs[key])
    return get_scheduler(
        args.lr_scheduler_type,
        optimizer=shard_optimizer,
        num_warmup_steps=warmup,
        num_training_steps=updates,
        scheduler_specific_kwargs=kwargs,
    )
