"""torchtitan 0.2.2 components backed by the ACCO engine: the optimizer container and its schedulers.

:class:`ACCOOptimizersContainer` holds one engine over every model part of this rank, sharded
over the ``dp_replicate`` mesh (on top of FSDP's sharding), and looks like torchtitan's
``OptimizersContainer`` to the LR schedulers, metrics and checkpointing. ``train_spec`` puts it
(and a parallelize function without data parallelism) into a model's train spec.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from acco_hooks.titan import require_release

require_release("0.2.2", __name__)  # before any torchtitan import: a clear error on 0.3.0

from torchtitan.components.lr_scheduler import LRSchedulersContainer, build_lr_schedulers
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import LRScheduler as LRSchedulerConfig
from torchtitan.distributed import ParallelDims

from acco_hooks.engine import real_updates
from acco_hooks.titan._container import OPTIMIZER_CLASSES, EngineContainer, engine_kwargs
from acco_hooks.titan.config import JobConfig

__all__ = ["ACCOOptimizersContainer", "build_acco_lr_schedulers", "build_acco_optimizers",
           "real_updates"]  # fmt: skip


class ACCOOptimizersContainer(EngineContainer, OptimizersContainer):
    """torchtitan 0.2.2's optimizer container with the ACCO engine inside (see
    :class:`acco_hooks.titan._container.EngineContainer`)."""

    def __init__(
        self,
        model_parts: list[nn.Module],
        optimizer_cls: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
        engine_kwargs: dict[str, Any],
    ) -> None:
        params = self._build_engine(model_parts, optimizer_cls, optimizer_kwargs, engine_kwargs)
        self._post_init(params, optimizer_kwargs)


def build_acco_optimizers(
    model_parts: list[nn.Module],
    optimizer_config: Any,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    accumulation_steps: int,
) -> ACCOOptimizersContainer:
    """Build the engine from torchtitan's ``[optimizer]`` and ``[acco]`` sections."""
    optimizer_kwargs = {
        "lr": optimizer_config.lr,
        "betas": (optimizer_config.beta1, optimizer_config.beta2),
        "eps": optimizer_config.eps,
        "weight_decay": optimizer_config.weight_decay,
        # torchtitan's [optimizer] implementation, applied to the flat fp32 shard.
        "foreach": optimizer_config.implementation == "foreach",
        "fused": optimizer_config.implementation == "fused",
    }
    kwargs = engine_kwargs(
        job_config.acco, parallel_dims, accumulation_steps=accumulation_steps,
        max_norm=job_config.training.max_norm, fsdp_mesh_name="fsdp",
    )  # fmt: skip
    return ACCOOptimizersContainer(
        model_parts, OPTIMIZER_CLASSES[optimizer_config.name], optimizer_kwargs, kwargs
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
