"""torchtitan 0.2.2: ``ACCOTrainer``, its job config with the ``[acco]`` section, and the train
spec whose builders put the engine in place of data parallelism.

torchtitan 0.2.2 reads a TOML job config into ``JobConfig`` and builds a run from a model's
``TrainSpec``: ``parallelize_fn(model, parallel_dims, job_config)``,
``build_optimizers_fn(model_parts, optimizer_config, parallel_dims)``,
``build_lr_schedulers_fn(optimizers, lr_scheduler_config, training_steps)``. Each builder gets
its config section explicitly, and so do ACCO's: :class:`ACCOTrainer` replaces
``job_config.optimizer`` with an :class:`EngineOptimizerConfig` section that carries the engine's
settings next to torchtitan's optimizer fields, and runs the model under the train spec
``<model>_acco`` (:func:`acco_train_spec`), registered once per model:

- the model's own parallelize function (TP, activation checkpointing, torch.compile, FSDP)
  with the ``dp_replicate`` dimension hidden, so no DDP is applied, and FSDP2 (if
  ``data_parallel_shard_degree > 1``) shards over the ``fsdp`` mesh only: no cross-replica
  all-reduce (HSDP without its slow half);
- :func:`build_acco_optimizers` (the engine, with torchtitan's LR schedulers built on its shard
  optimizer, and with ``[fault_tolerance]`` a ``torchft.Manager``) and
  :func:`build_acco_lr_schedulers`;
- with ``[fault_tolerance] enable``, the model's data loader split over the replica groups too,
  as torchtitan's own torchft trainer splits it.

No ``from __future__ import annotations`` here: torchtitan's ConfigManager reads the field types
of the dataclasses (``dataclasses.fields(...).type``) to build nested sections from TOML.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from acco_hooks.titan import require_release

require_release("0.2.2", __name__)  # before any torchtitan import: a clear error on 0.3.0

from torchtitan.components.lr_scheduler import LRSchedulersContainer, build_lr_schedulers  # noqa: E402
from torchtitan.config import JobConfig as TitanJobConfig  # noqa: E402
from torchtitan.config import Optimizer as TitanOptimizer  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec  # noqa: E402

from acco_hooks.engine import EngineSettings, real_updates  # noqa: E402
from acco_hooks.titan.base import (  # noqa: E402
    OPTIMIZER_CLASSES,
    ACCOTrainerBase,
    EngineOptimizersContainer,
    WithoutReplicate,
)
from acco_hooks.titan.config import ACCO, validate_acco  # noqa: E402
from acco_hooks.titan.replica_groups import (  # noqa: E402
    build_torchft_manager,
    replica_group_folder,
    split_data_over_replica_groups,
)

__all__ = ["ACCO", "EngineOptimizerConfig", "ACCOTrainer", "JobConfig", "acco_train_spec",
           "build_acco_lr_schedulers", "build_acco_optimizers", "validate_acco_config"]  # fmt: skip


@dataclass
class JobConfig(TitanJobConfig):
    """torchtitan's JobConfig with the ``[acco]`` section."""

    acco: ACCO = field(default_factory=ACCO)


@dataclass
class EngineOptimizerConfig(TitanOptimizer):
    """torchtitan's ``[optimizer]`` section with the engine's settings, resolved from the job
    (``acco_hooks.titan.config.validate_acco``) by :class:`ACCOTrainer`."""

    engine: EngineSettings = field(default_factory=EngineSettings)
    """The engine's settings: [acco], the round size and training.max_norm's clipping."""

    lr_scheduler: Any = None
    """torchtitan's ``[lr_scheduler]`` section: the engine builds its schedulers on the shard
    optimizer as it is built, so that a torchft group that joins a running job takes a live
    group's schedule with the rest of its state."""

    training_steps: int = 0
    """``[training] steps``, in rounds: the schedule is counted in the real updates they make."""

    fault_tolerance: Any = None
    """torchtitan's ``[fault_tolerance]`` section when enabled (``None`` otherwise): the
    engine's process group is then one torchft replica group, and the groups in the current
    quorum sum through a ``torchft.Manager`` built from this section."""


def validate_acco_config(
    job_config: JobConfig, world_size: int | None = None
) -> EngineSettings | None:
    """Refuse a bad ``[acco]`` section or an unsupported parallelism before anything is built.

    Returns:
        The engine's settings, for :class:`ACCOTrainer`; ``None`` when ``[acco] enable`` is off.

    Raises:
        ValueError: naming the setting and the fix.
    """
    return validate_acco(
        job_config.acco, job_config.parallelism, job_config.training, [job_config.optimizer.name],
        early_step_in_backward=job_config.optimizer.early_step_in_backward,
        world_size=world_size, train_timeout_seconds=job_config.comm.train_timeout_seconds,
        fault_tolerance=job_config.fault_tolerance,
    )  # fmt: skip


def build_acco_optimizers(
    model_parts: list[nn.Module],
    optimizer_config: EngineOptimizerConfig,
    parallel_dims: ParallelDims,
) -> EngineOptimizersContainer:
    """The engine from torchtitan's ``[optimizer]`` fields and the settings it carries."""
    optimizer_kwargs = {
        "lr": optimizer_config.lr,
        "betas": (optimizer_config.beta1, optimizer_config.beta2),
        "eps": optimizer_config.eps,
        "weight_decay": optimizer_config.weight_decay,
        # torchtitan's [optimizer] implementation, applied to the flat fp32 shard.
        "foreach": optimizer_config.implementation == "foreach",
        "fused": optimizer_config.implementation == "fused",
    }
    optimizers = EngineOptimizersContainer(
        model_parts, OPTIMIZER_CLASSES[optimizer_config.name], optimizer_kwargs,
        optimizer_config.engine,
    )  # fmt: skip
    ft = optimizer_config.fault_tolerance
    manager = None if ft is None else build_torchft_manager(ft, optimizer_config.engine.timeout)
    # [lr_scheduler] warmup and decay are in real updates: with mode = "acco" a run of
    # training.steps rounds makes training.steps // 2 updates
    updates = real_updates(optimizer_config.engine.mode, optimizer_config.training_steps)
    lr_config = optimizer_config.lr_scheduler
    optimizers.bind(
        parallel_dims, manager=manager, replica_groups=None if ft is None else ft.group_size,
        lr_scheduler=lambda shard: build_lr_schedulers([shard], lr_config, updates),
    )  # fmt: skip
    return optimizers


def build_acco_lr_schedulers(
    optimizers: EngineOptimizersContainer, lr_scheduler_config: Any, training_steps: int
) -> LRSchedulersContainer:
    """torchtitan's schedulers, counted in real updates and stepped by the engine: the ones
    :func:`build_acco_optimizers` built with it (from the same ``[lr_scheduler]`` section)."""
    del lr_scheduler_config, training_steps  # the engine's own copy of the section
    return optimizers.engine.lr_scheduler


def acco_train_spec(base: TrainSpec) -> TrainSpec:
    """``base`` with the ACCO engine in place of its data parallelism and optimizer.

    Use it to give your own model ACCO: ``register_train_spec("mymodel_acco",
    acco_train_spec(get_train_spec("mymodel")))``; ``ACCOTrainer`` does this on the fly.
    """
    parallelize_fn = base.parallelize_fn

    def parallelize(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig):
        return parallelize_fn(model, WithoutReplicate(parallel_dims), job_config)

    parallelize.__name__ = f"{parallelize_fn.__name__}_without_data_parallel"
    build_dataloader_fn = base.build_dataloader_fn

    def build_dataloader(*, dp_world_size: int, dp_rank: int, job_config: JobConfig, **kwargs):
        dp_world_size, dp_rank = split_data_over_replica_groups(
            job_config.fault_tolerance, dp_world_size, dp_rank
        )
        return build_dataloader_fn(dp_world_size=dp_world_size, dp_rank=dp_rank,
                                   job_config=job_config, **kwargs)  # fmt: skip

    return dataclasses.replace(
        base,
        parallelize_fn=parallelize,
        build_dataloader_fn=build_dataloader if build_dataloader_fn is not None else None,
        build_optimizers_fn=build_acco_optimizers,
        build_lr_schedulers_fn=build_acco_lr_schedulers,
    )


def _ensure_acco_train_spec(model_name: str) -> str:
    """Register ``<model_name>_acco`` once (from the ``<model_name>`` spec); return its name."""
    base_name = model_name.removesuffix("_acco")
    name = f"{base_name}_acco"
    try:
        get_train_spec(name)
    except ValueError:
        register_train_spec(name, acco_train_spec(get_train_spec(base_name)))
    return name


class ACCOTrainer(ACCOTrainerBase):
    """torchtitan ``Trainer`` whose data parallelism and optimizer are the ACCO engine.

    Needs ``[acco] enable = true``. The model's train spec is replaced by ``<name>_acco``
    (registered on the fly): the same model and parallelize function, without DDP.

    Args:
        job_config: the run's configuration.
        settings: what :func:`validate_acco_config` returned for it, when the caller validated
            it first (``train_titan.py`` does, to refuse a bad section on every rank before
            anything is built); ``None`` validates it here.
    """

    def __init__(self, job_config: JobConfig, settings: EngineSettings | None = None) -> None:
        settings = settings or validate_acco_config(job_config)
        if settings is None:
            raise ValueError("ACCOTrainer needs [acco] enable = true")
        job_config.model.name = _ensure_acco_train_spec(job_config.model.name)
        job_config.checkpoint.folder = replica_group_folder(
            job_config.fault_tolerance, job_config.checkpoint
        )
        optimizer = job_config.optimizer
        job_config.optimizer = EngineOptimizerConfig(
            **{f.name: getattr(optimizer, f.name) for f in dataclasses.fields(TitanOptimizer)},
            engine=settings, lr_scheduler=job_config.lr_scheduler,
            training_steps=job_config.training.steps,
            fault_tolerance=job_config.fault_tolerance if job_config.fault_tolerance.enable
            else None,
        )  # fmt: skip
        super().__init__(job_config)

    @property
    def titan_config(self) -> JobConfig:
        return self.job_config
