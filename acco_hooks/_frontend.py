"""What every front-end of the engine exposes: draining, checkpoints and the figures to log."""

from __future__ import annotations

from typing import Any

import torch

from acco_hooks.engine import ACCOEngine

__all__ = ["EngineFrontEnd"]


class EngineFrontEnd:
    """Delegates to ``self.engine``; subclasses feed it gradients and count micro-batches.

    Subclasses keep the handles of the gradient hooks they register in ``_hook_handles``:
    :meth:`close` removes them.
    """

    engine: ACCOEngine
    _hook_handles: list[Any]

    def flush(self) -> None:
        """Wait for in-flight communication; the model then holds the real parameters θ."""
        self.engine.flush()

    def close(self, *, barrier: bool = True) -> None:
        """Drain the communication, join its thread and destroy its process groups.

        Every rank calls it at the end of training (see :meth:`ACCOEngine.close` for
        ``barrier``). A ``with`` block closes on exit, without the barrier after an exception.
        """
        try:
            self.engine.close(barrier=barrier)
        finally:
            for handle in self._hook_handles:
                handle.remove()
            self._hook_handles = []

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self.engine.closed

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.close(barrier=exc_type is None)

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
