"""The engine plumbing of the ACCO optimizer container, shared by the torchtitan adapters.

torchtitan's ``OptimizersContainer`` is built differently in 0.2.2 and 0.3.0; what the ACCO
container does with the engine is the same in both, and lives here: :class:`EngineContainer`
(mixed in before torchtitan's class) and :func:`engine_kwargs`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from acco_hooks.engine import ACCOEngine
from acco_hooks.titan.settings import ACCO, REDUCE_DTYPES

__all__ = ["OPTIMIZER_CLASSES", "TRAINER_BEING_BUILT", "EngineContainer", "WithoutReplicate",
           "building", "engine_kwargs"]

OPTIMIZER_CLASSES = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}

# The trainer whose __init__ is running. torchtitan builds the optimizer container and the LR
# schedulers from their own config sections only; the engine also needs [acco], the meshes and
# the round size, which the trainer being built holds.
TRAINER_BEING_BUILT: contextvars.ContextVar[Any] = contextvars.ContextVar("acco_trainer")


@contextlib.contextmanager
def building(trainer: Any) -> Iterator[None]:
    """While the block runs, the ACCO builders read ``trainer``'s config and round size."""
    token = TRAINER_BEING_BUILT.set(trainer)
    try:
        yield
    finally:
        TRAINER_BEING_BUILT.reset(token)


class WithoutReplicate:
    """A ``ParallelDims`` view without the ``dp_replicate`` dimension (both releases).

    A model's parallelize function handed this view applies no DDP (0.2.2) and FSDP over the
    ``fsdp`` mesh alone instead of HSDP over ``["dp_replicate", "fsdp"]``: everything but the
    cross-replica data parallelism, which is the engine's.
    """

    def __init__(self, parallel_dims: Any) -> None:
        self._parallel_dims = parallel_dims

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parallel_dims, name)

    dp_replicate_enabled = False


class EngineContainer:
    """The optimizer-container side of the engine (a mixin before ``OptimizersContainer``).

    Iterating the container yields the engine's shard optimizer, so torchtitan's LR schedulers
    are built on it; the engine steps them once per real update. Gradients are moved into the
    engine by post-accumulate-grad hooks; the training loop ends micro-batches with
    ``self.engine.microbatch_done(weight)`` instead of calling ``step()``.

    **Note**
    The state dict is this rank's engine state under a rank-unique key: DCP keeps every rank's
    entry (a plain tensor under a shared key would be deduplicated as if replicated).

    **Limitations**
    Resuming needs the same world size and parallelism (the engine refuses otherwise).
    """

    engine: ACCOEngine

    def _build_engine(
        self,
        model_parts: list[nn.Module],
        optimizer_cls: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
        engine_kwargs: dict[str, Any],
    ) -> list[nn.Parameter]:
        """Build the engine over every trainable parameter; return those parameters."""
        self.model_parts = model_parts
        named = [
            (name, p) for m in model_parts for name, p in m.named_parameters() if p.requires_grad
        ]
        self.engine = ACCOEngine(named, optimizer_cls, **engine_kwargs, **optimizer_kwargs)
        self.optimizers = [self.engine.optimizer]
        self.engine.hook_param_grads()
        self._state_key = f"acco_engine_rank{dist.get_rank() if dist.is_initialized() else 0}"
        return [p for _, p in named]

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"{type(self).__name__}.step(): the ACCO engine ends rounds itself; call "
            "engine.microbatch_done(weight) after each micro-batch (ACCOTrainer does)"
        )

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        """No-op: gradients live in the engine."""

    def state_dict(self) -> dict[str, Any]:
        # DCP loads in place into the structure this returns: the Adam state must exist before
        # the first step, or a resumed run would silently start from empty moments.
        _materialize_adam_state(self.engine.optimizer)
        return {self._state_key: self.engine.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._state_key not in state_dict:
            raise ValueError(
                f"the checkpoint has no ACCO engine state for this rank ({self._state_key}); "
                "it was saved by a run with another world size or without [acco] enable"
            )
        self.engine.load_state_dict(state_dict[self._state_key])

    def close(self, *, flush: bool = True, barrier: bool = True) -> None:
        """Apply or drop the update in flight, join the engine's thread, destroy its groups
        and remove its gradient hooks (see ``ACCOEngine.close``)."""
        self.engine.close(flush=flush, barrier=barrier)


def _materialize_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter Adam's state as it is before a first step: step 0, zero moments.

    Adam's first step from this state equals its first step from no state at all, so this
    changes nothing in training; it only gives DCP tensors to load into.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            if optimizer.state[p]:
                continue
            state = {
                "step": torch.tensor(0.0, dtype=torch.float32),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            optimizer.state[p] = state


def engine_kwargs(
    acco: ACCO,
    parallel_dims: Any,
    *,
    accumulation_steps: int,
    max_norm: float,
    fsdp_mesh_name: str,
) -> dict[str, Any]:
    """The engine's groups and round settings from ``[acco]`` and torchtitan's meshes.

    Args:
        acco: the ``[acco]`` settings.
        parallel_dims: torchtitan's ``ParallelDims``.
        accumulation_steps: micro-batches per round.
        max_norm: ``training.max_norm`` (clipping off when <= 0).
        fsdp_mesh_name: the mesh FSDP shards a replica over (``"fsdp"`` in 0.2.2 and under
            0.3.0's ``partial_dtensor`` backend).
    """
    # With TP or PP a rank holds only part of the model: the gradient norm is summed over every
    # rank (each counts its shard of its part; replicated tensors count once).
    model_parallel = parallel_dims.tp_enabled or parallel_dims.pp_enabled
    return {
        "mode": acco.mode,
        "process_group": _replica_group(parallel_dims),
        "accumulation_steps": accumulation_steps,
        "accumulate_until_ready": acco.accumulate_until_ready,
        "reduce_dtype": REDUCE_DTYPES[acco.reduce_dtype],
        "max_grad_norm": max_norm if max_norm > 0 else None,
        # FSDP: each rank's parameters are its fsdp shard, gradients FSDP-summed over the node.
        "fsdp_process_group": (
            parallel_dims.get_mesh(fsdp_mesh_name) if parallel_dims.dp_shard_enabled else None
        ),
        "norm_process_group": dist.group.WORLD if model_parallel else None,
    }


def _replica_group(parallel_dims: Any) -> Any:
    """The group ACCO runs across: the ``dp_replicate`` mesh, or this rank alone.

    With one replica (``data_parallel_replicate_degree = 1``, no FSDP) there is no data-parallel
    traffic; the rounds, the shard step and the estimate still run, which is what a comparison
    with plain torchtitan on one GPU measures.
    """
    if parallel_dims.dp_replicate_enabled:
        return parallel_dims.get_mesh("dp_replicate")
    alone, _ = dist.new_subgroups(group_size=1)  # every rank builds every 1-rank group
    return alone
