"""torchtitan 0.2.2: the ACCO train spec: a model's own spec with the engine in place of data parallelism.

Two things of a torchtitan train spec change:

- the data-parallel wrapping: :func:`parallelize_without_data_parallel` runs the model's own
  parallelize function (TP, activation checkpointing, torch.compile, FSDP) with the
  ``dp_replicate`` dimension hidden, so no DDP is applied, and FSDP2 (if
  ``data_parallel_shard_degree > 1``) shards over the ``fsdp`` mesh only: no cross-replica
  all-reduce (HSDP without its slow half);
- the optimizer and LR schedulers: ``components.build_acco_optimizers`` and
  ``build_acco_lr_schedulers``.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from acco_hooks.titan import require_release

require_release("0.2.2", __name__)  # before any torchtitan import: a clear error on 0.3.0

from torchtitan.distributed import ParallelDims
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec

from acco_hooks.titan._container import TRAINER_BEING_BUILT, WithoutReplicate, building
from acco_hooks.titan.components import (
    ACCOOptimizersContainer,
    build_acco_lr_schedulers,
    build_acco_optimizers,
)
from acco_hooks.titan.config import JobConfig

__all__ = ["acco_train_spec", "building", "ensure_acco_train_spec",
           "parallelize_without_data_parallel"]  # fmt: skip


def _build_optimizers(model_parts, optimizer_config, parallel_dims) -> ACCOOptimizersContainer:
    trainer = TRAINER_BEING_BUILT.get()
    steps = trainer.job_config.acco.accumulation_steps or trainer.gradient_accumulation_steps
    return build_acco_optimizers(model_parts, optimizer_config, parallel_dims,
                                 trainer.job_config, steps)  # fmt: skip


def _build_lr_schedulers(optimizers, lr_scheduler_config, training_steps):
    mode = TRAINER_BEING_BUILT.get().job_config.acco.mode
    return build_acco_lr_schedulers(optimizers, lr_scheduler_config, training_steps, mode)


def acco_train_spec(base: TrainSpec) -> TrainSpec:
    """``base`` with the ACCO engine in place of its data parallelism and optimizer.

    Use it to give your own model ACCO: ``register_train_spec("mymodel_acco",
    acco_train_spec(get_train_spec("mymodel")))``; ``ACCOTrainer`` does this on the fly.
    """
    return dataclasses.replace(
        base,
        parallelize_fn=parallelize_without_data_parallel(base.parallelize_fn),
        build_optimizers_fn=_build_optimizers,
        build_lr_schedulers_fn=_build_lr_schedulers,
    )


def ensure_acco_train_spec(model_name: str) -> str:
    """Register ``<model_name>_acco`` once (from the ``<model_name>`` spec); return its name."""
    base_name = model_name.removesuffix("_acco")
    name = f"{base_name}_acco"
    try:
        get_train_spec(name)
    except ValueError:
        register_train_spec(name, acco_train_spec(get_train_spec(base_name)))
    return name


def parallelize_without_data_parallel(parallelize_fn):
    """Wrap a train spec's parallelize function so that it applies everything but the
    cross-replica data parallelism (DDP, or HSDP's all-reduce)."""

    def parallelize(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig):
        return parallelize_fn(model, WithoutReplicate(parallel_dims), job_config)

    parallelize.__name__ = f"{parallelize_fn.__name__}_without_data_parallel"
    return parallelize
