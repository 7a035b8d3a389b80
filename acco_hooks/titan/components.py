"""torchtitan components backed by the ACCO engine: the optimizer container and its schedulers.

:class:`ACCOOptimizersContainer` holds one engine over every model part of this rank, sharded
over the ``dp_replicate`` mesh (on top of FSDP's sharding), and looks like torchtitan's
``OptimizersContainer`` to the LR schedulers, metrics and checkpointing. ``train_spec`` puts it
(and a parallelize function without data parallelism) into a model's train spec.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchtitan.components.lr_scheduler import LRSchedulersContainer, build_lr_schedulers
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import LRScheduler as LRSchedulerConfig
from torchtitan.distributed import ParallelDims

from acco_hooks.engine import ACCOEngine, real_updates
from acco_hooks.titan.config import REDUCE_DTYPES, JobConfig

__all__ = ["ACCOOptimizersContainer", "build_acco_lr_schedulers", "build_acco_optimizers",
           "real_updates"]  # fmt: skip

_OPTIMIZER_CLASSES = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}


class ACCOOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizer container with the ACCO engine inside.

    Iterating it yields the engine's shard optimizer, so torchtitan's LR schedulers are built
    on it; the engine steps them once per real update. Gradients are moved into the engine by
    post-accumulate-grad hooks; the training loop ends micro-batches with
    ``self.engine.microbatch_done(weight)`` instead of calling ``step()``.

    **Note**
    The state dict is this rank's engine state under a rank-unique key: DCP keeps every rank's
    entry (a plain tensor under a shared key would be deduplicated as if replicated).

    **Limitations**
    Resuming needs the same world size and parallelism (the engine refuses otherwise).
    """

    def __init__(
        self,
        model_parts: list[nn.Module],
        optimizer_cls: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
        engine_kwargs: dict[str, Any],
    ) -> None:
        self.model_parts = model_parts
        named = [
            (name, p) for m in model_parts for name, p in m.named_parameters() if p.requires_grad
        ]
        self.engine = ACCOEngine(named, optimizer_cls, **engine_kwargs, **optimizer_kwargs)
        self.optimizers = [self.engine.optimizer]
        self.engine.hook_param_grads()
        self._state_key = f"acco_engine_rank{dist.get_rank() if dist.is_initialized() else 0}"
        self._post_init([p for _, p in named], optimizer_kwargs)

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "ACCOOptimizersContainer.step(): the ACCO engine ends rounds itself; call "
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


def build_acco_optimizers(
    model_parts: list[nn.Module],
    optimizer_config: Any,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    accumulation_steps: int,
) -> ACCOOptimizersContainer:
    """Build the engine from torchtitan's ``[optimizer]`` and ``[acco]`` sections."""
    acco = job_config.acco
    optimizer_kwargs = {
        "lr": optimizer_config.lr,
        "betas": (optimizer_config.beta1, optimizer_config.beta2),
        "eps": optimizer_config.eps,
        "weight_decay": optimizer_config.weight_decay,
        # torchtitan's [optimizer] implementation, applied to the flat fp32 shard.
        "foreach": optimizer_config.implementation == "foreach",
        "fused": optimizer_config.implementation == "fused",
    }
    # With TP or PP a rank holds only part of the model: the gradient norm is summed over every
    # rank (each counts its shard of its part; replicated tensors count once).
    model_parallel = parallel_dims.tp_enabled or parallel_dims.pp_enabled
    engine_kwargs = {
        "mode": acco.mode,
        "process_group": parallel_dims.get_mesh("dp_replicate"),
        "accumulation_steps": accumulation_steps,
        "accumulate_until_ready": acco.accumulate_until_ready,
        "reduce_dtype": REDUCE_DTYPES[acco.reduce_dtype],
        "max_grad_norm": job_config.training.max_norm if job_config.training.max_norm > 0 else None,
        # FSDP: each rank's parameters are its fsdp shard, gradients FSDP-summed over the node.
        "fsdp_process_group": (
            parallel_dims.get_mesh("fsdp") if parallel_dims.dp_shard_enabled else None
        ),
        "norm_process_group": dist.group.WORLD if model_parallel else None,
    }
    return ACCOOptimizersContainer(
        model_parts, _OPTIMIZER_CLASSES[optimizer_config.name], optimizer_kwargs, engine_kwargs
    )


def build_acco_lr_schedulers(
    optimizers: ACCOOptimizersContainer,
    lr_scheduler_config: LRSchedulerConfig,
    training_steps: int,
    mode: str,
) -> LRSchedulersContainer:
    """torchtitan's schedulers, counted in real updates and stepped by the engine.

    ``[lr_scheduler]`` warmup and decay are in real updates: with ``mode = "acco"`` a run of
    ``training.steps`` rounds makes ``training.steps // 2`` updates.
    """
    schedulers = build_lr_schedulers(
        optimizers, lr_scheduler_config, real_updates(mode, training_steps)
    )
    optimizers.engine.lr_scheduler = schedulers
    return schedulers
