"""What every front-end of the engine exposes: real weights, closing, checkpoints, figures to log,
and the one rule for a micro-batch's weight under a token-summed loss."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from typing import Any

import torch

from acco_hooks.engine import ACCOEngine

__all__ = ["EngineFrontEnd", "label_tokens", "launcher_world_size"]

IGNORE_INDEX = -100  # torch's cross_entropy default, torchtitan's and transformers' label padding


def launcher_world_size() -> int:
    """The processes the launcher started (torchrun's ``WORLD_SIZE``; 1 without a launcher):
    what a front-end sizes its run by before the process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def label_tokens(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> int:
    """The tokens a token-summed cross-entropy over ``labels`` sums over.

    It is a micro-batch's weight for :meth:`ACCOEngine.microbatch_done` when the loss is summed
    over tokens: the engine then divides Σ gradients by Σ tokens over every micro-batch of
    every rank, the per-token average of one large batch. The torchtitan and Hugging Face
    trainers weigh their micro-batches with it.
    """
    return int(labels.ne(ignore_index).sum())


class EngineFrontEnd:
    """What a front-end built around an engine exposes; subclasses feed the engine gradients
    and count micro-batches.

    The engine owns the gradient hooks (``engine.hook_param_grads``) and removes them when it
    closes.

    Args:
        engine: the engine this front-end drives.
    """

    def __init__(self, engine: ACCOEngine) -> None:
        self.engine = engine

    def flush(self) -> None:
        """Wait for in-flight communication; the model then holds the real parameters θ."""
        self.engine.flush()

    def real_weights(self) -> AbstractContextManager[dict[str, Any] | None]:
        """A block in which the model holds the real parameters θ, for evaluation or export.

        The training trajectory is unchanged: see :meth:`ACCOEngine.real_weights`.
        """
        return self.engine.real_weights()

    def close(self, *, flush: bool = True, barrier: bool = True) -> None:
        """Apply (``flush=True``) or drop the update in flight, join the communication thread,
        destroy the engine's process groups and remove its gradient hooks.

        Every rank calls it at the end of training (see :meth:`ACCOEngine.close`). A ``with``
        block closes on exit; after an exception without the flush and the barrier.
        """
        self.engine.close(flush=flush, barrier=barrier)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self.engine.closed

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.close(flush=exc_type is None, barrier=exc_type is None)

    def state_dict(self) -> dict[str, Any]:
        """The engine state (``ACCOEngine.state_dict``): save it with ``model.state_dict()``,
        with ``torch.distributed.checkpoint`` (reshards onto other ranks) or per rank."""
        return self.engine.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`: one ``dcp.load`` filled (any number of ranks), or
        one this rank saved (``ACCOEngine.load_state_dict``)."""
        self.engine.load_state_dict(state_dict)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer over this rank's fp32 master shard (stepped by the engine)."""
        return self.engine.optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The shard optimizer's parameter groups (read the current ``lr`` here)."""
        return self.engine.optimizer.param_groups

    @property
    def lr_scheduler(self) -> Any:
        """The scheduler built from ``lr_scheduler=``, or ``None``."""
        return self.engine.lr_scheduler

    @property
    def round_index(self) -> int:
        """Rounds completed so far."""
        return self.engine.round_index

    @property
    def num_updates(self) -> int:
        """Real updates θ_t → θ_{t+1} completed so far (after the communication finished)."""
        return self.engine.num_updates
