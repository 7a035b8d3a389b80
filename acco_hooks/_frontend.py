"""What every front-end of the engine exposes: draining, checkpoints and the figures to log."""

from __future__ import annotations

from typing import Any

import torch

from acco_hooks.engine import ACCOEngine

__all__ = ["EngineFrontEnd"]


class EngineFrontEnd:
    """Delegates to ``self.engine``; subclasses feed it gradients and count micro-batches."""

    engine: ACCOEngine

    def flush(self) -> None:
        """Wait for in-flight communication; the model then holds the real parameters θ."""
        self.engine.flush()

    def close(self) -> None:
        """Drain the communication and stop its thread."""
        self.engine.close()

    def state_dict(self) -> dict[str, Any]:
        """This rank's engine state; save it with ``model.state_dict()`` to resume exactly."""
        return self.engine.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` saved by the same rank of a same-sized run."""
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
