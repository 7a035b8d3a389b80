"""torchtitan 0.3.0: ``ACCOTrainer``, its config, and the engine as an optimizer container.

torchtitan 0.3.0 configures a run with a ``Trainer.Config`` returned by a Python function
(``-m torchtitan.train --module M --config FN``); a component is a ``Configurable`` whose
nested ``Config`` builds it, with the runtime objects it needs passed to ``build``. ACCO plugs
in at three of them:

- :class:`ACCOTrainer` (``ACCOTrainer.Config`` = ``Trainer.Config`` plus an ``acco`` field,
  ``--acco.mode ...`` on the command line). Its ``__init__`` validates ``acco``, then swaps into
  the config what ACCO replaces before torchtitan builds anything: the model spec's
  parallelize function (the same one, with the ``dp_replicate`` dimension hidden) and its
  ``post_optimizer_build_fn`` (which hands the meshes to the engine), the optimizer container
  (whose config carries the engine's settings) and the LR schedulers.
- :class:`ACCOOptimizersContainer`: the engine over every parameter of this rank, sharded over
  ``dp_replicate``, from the run's single Adam/AdamW parameter group.
- :class:`ACCOLRSchedulersContainer`: torchtitan's schedules, counted in real updates.

With ``fault_tolerance.enable`` (the section of torchtitan's ``experiments.torchft`` trainer, in
ACCO's config) the job is one torchft replica group: the engine is built with a
``torchft.Manager``, the data loader's config reads the group's part of the data, and each group
checkpoints into a folder of its own, as on 0.2.2.

The training step (one ACCO round) is shared with the 0.2.2 adapter: :mod:`acco_hooks.titan.base`.

Data parallelism in 0.3.0 is FSDP2 everywhere (torchtitan's "DDP" is FSDP with a replicate
mesh dimension). ACCO keeps FSDP2 inside a replica (mixed precision; sharding with
``data_parallel_shard_degree > 1``, i.e. HSDP) and replaces the cross-replica all-reduce.
ACCO runs on torchtitan's default ``parallelism.spmd_backend = "spmd_types"`` and on
``partial_dtensor``. Under ``spmd_types`` a parameter's type spans the whole data-parallel axis
(replicas x shards), so FSDP is applied as torchtitan's HSDP and then stops after its
intra-replica reduce-scatter (:func:`acco_hooks.fsdp.turn_off_replica_all_reduce`); under
``partial_dtensor`` the model is parallelized as one replica. Either way the engine is the only
thing that reduces gradients across replicas. ``full_dtensor`` is refused (not tested).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from acco_hooks.titan import require_release

require_release("0.3.0", __name__)  # before any torchtitan import: a clear error on 0.2.2

from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer  # noqa: E402
from torchtitan.experiments.torchft.config import FaultTolerance  # noqa: E402
from torchtitan.tools.logging import logger  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from acco_hooks._frontend import label_tokens  # noqa: E402
from acco_hooks.engine import EngineSettings, real_updates  # noqa: E402
from acco_hooks.fsdp import fsdp_modules, turn_off_replica_all_reduce  # noqa: E402
from acco_hooks.titan.base import (  # noqa: E402
    OPTIMIZER_CLASSES,
    WHOLE_PARAMETER_CLASSES,
    ACCOTrainerBase,
    Batch,
    EngineOptimizersContainer,
    WithoutReplicate,
)
from acco_hooks.titan.config import ACCO, spelling, validate_acco  # noqa: E402
from acco_hooks.titan.replica_groups import (  # noqa: E402
    build_torchft_manager,
    replica_group_folder,
    split_data_over_replica_groups,
)

__all__ = ["ACCOLRSchedulersContainer", "ACCOOptimizersContainer", "ACCOTrainer",
           "validate_acco_config", "with_acco"]  # fmt: skip

ACCO_SPMD_BACKENDS = ("spmd_types", "partial_dtensor")
"""The ``parallelism.spmd_backend`` values ACCO is tested on; the first is torchtitan's default."""


def validate_acco_config(
    config: Trainer.Config, world_size: int | None = None
) -> EngineSettings | None:
    """Refuse bad ``acco`` settings or an unsupported parallelism before anything is built.

    Returns:
        The engine's settings, for :class:`ACCOTrainer`; ``None`` without ``acco`` or when
        ``acco.enable`` is off.

    Raises:
        ValueError: naming the setting and the fix.
    """
    acco = getattr(config, "acco", None)
    if acco is None or not acco.enable:
        return None
    groups = config.optimizer.param_groups
    settings = validate_acco(
        acco, config.parallelism, config.training,
        [g.optimizer_name for g in groups] or ["(none)"],
        world_size=world_size, train_timeout_seconds=config.comm.train_timeout_seconds,
        fault_tolerance=getattr(config, "fault_tolerance", None),
        whole_parameter_optimizers=tuple(WHOLE_PARAMETER_CLASSES),
    )  # fmt: skip
    if groups[-1].pattern != ".*":
        raise ValueError(
            f"optimizer.param_groups[{len(groups) - 1}].pattern = {groups[-1].pattern!r}: the "
            "ACCO engine optimizes every parameter; end the groups with the catch-all pattern "
            "'.*'"
        )
    if config.parallelism.spmd_backend not in ACCO_SPMD_BACKENDS:
        raise ValueError(
            f"parallelism.spmd_backend = {config.parallelism.spmd_backend!r}: ACCO runs on "
            f"{' or '.join(ACCO_SPMD_BACKENDS)}; set --parallelism.spmd-backend spmd_types "
            "(torchtitan's default)"
        )
    return settings


class ACCOOptimizersContainer(EngineOptimizersContainer):
    """torchtitan 0.3.0's optimizer container with the ACCO engine inside (see
    :class:`acco_hooks.titan.base.EngineOptimizersContainer`). Built from the run's optimizer
    config (one Adam or AdamW parameter group matching every parameter, or several groups, each
    its class: AdamW, Adam, or Muon on whole parameters by the name ``DistMuon`` or ``Muon``)
    and the engine's settings; bound to the meshes by the model spec's
    ``post_optimizer_build_fn``."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        engine: EngineSettings = field(default_factory=EngineSettings)
        """The engine's settings: acco, the round size and training.max_norm's clipping."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        impl = self._build_impl_kwargs(config)  # fused / foreach: Adam's and AdamW's options
        if len(config.param_groups) == 1:  # every parameter, one class
            (group,) = config.param_groups
            super().__init__(
                model_parts, OPTIMIZER_CLASSES[group.optimizer_name],
                {**impl, **group.optimizer_kwargs}, config.engine,
            )  # fmt: skip
            return
        # Several groups, each its class (Muon on the matrices): the engine distributes them,
        # so DistMuon's FlexShard plumbing (optimizer_factory_kwargs_by_name) is not used
        groups = [
            (group.pattern, WHOLE_PARAMETER_CLASSES[group.optimizer_name], dict(group.optimizer_kwargs))
            if group.optimizer_name in WHOLE_PARAMETER_CLASSES else
            (group.pattern, OPTIMIZER_CLASSES[group.optimizer_name],
             {**impl, **group.optimizer_kwargs})
            for group in config.param_groups
        ]  # fmt: skip
        super().__init__(model_parts, groups[0][1], {}, config.engine, param_groups=groups)


def _bind_engine_after(
    post_optimizer_build_fn: Any, settings: EngineSettings,
    lr_scheduler: LRSchedulersContainer.Config, training_steps: int,
    fault_tolerance: FaultTolerance | None,
) -> Any:  # fmt: skip
    """A model spec's ``post_optimizer_build_fn`` that first builds the engine over the meshes
    torchtitan hands it, then runs the model's own (if any). The engine builds the LR
    schedulers (``lr_scheduler``, counted in the real updates of ``training_steps`` rounds) on
    its shard optimizer as it is built, and with ``fault_tolerance`` enabled joins the torchft
    replica groups: a group that joins a running job takes a live group's schedule with the
    rest of its state."""

    def bind_engine(optimizers: ACCOOptimizersContainer, model_parts: Any, parallel_dims: Any):
        updates = real_updates(settings.mode, training_steps)
        manager = None
        if fault_tolerance is not None and fault_tolerance.enable:
            manager = build_torchft_manager(fault_tolerance, settings.timeout)
        # slots dataclass: name the base explicitly (zero-argument super() fails)
        optimizers.bind(parallel_dims, manager=manager, lr_scheduler=lambda shard: (
            LRSchedulersContainer.Config.build(lr_scheduler, optimizers=[shard],
                                               training_steps=updates)
        ), replica_groups=None if manager is None else fault_tolerance.group_size)  # fmt: skip
        if post_optimizer_build_fn is not None:
            post_optimizer_build_fn(optimizers, model_parts, parallel_dims)

    return bind_engine


class ACCOLRSchedulersContainer(LRSchedulersContainer):
    """torchtitan's LR schedulers on the engine's optimizer, counted in real updates (with
    ``acco.mode = "acco"`` a run of ``training.steps`` rounds makes ``steps // 2`` updates) and
    stepped by the engine once per real update. A set ``total_steps`` counts real updates.
    The engine built them as it was built (``_bind_engine_after``): building them returns
    those."""

    @dataclass(kw_only=True, slots=True)
    class Config(LRSchedulersContainer.Config):
        def build(self, *, optimizers: ACCOOptimizersContainer, training_steps: int) -> Any:
            del training_steps  # the engine's were built from the same config and count
            return optimizers.engine.lr_scheduler


def _as(config_cls: type, config: Any, **more: Any) -> Any:
    """``config``'s settings in ``config_cls`` (a subclass of its class), plus ``more``."""
    return config_cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                         if f.init}, **more)  # fmt: skip


class ACCOTrainer(ACCOTrainerBase):
    """torchtitan 0.3.0 ``Trainer`` whose data parallelism and optimizer are the ACCO engine.

    Needs ``acco.enable = True``. Build it from its config (``config.build()``), as
    ``torchtitan.train`` does.

    Args:
        config: the run's configuration.
        settings: what :func:`validate_acco_config` returned for it, when the caller validated
            it first (``train_titan.py``: ``config.build(settings=...)``); ``None`` validates
            it here.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        acco: ACCO = field(default_factory=lambda: ACCO(enable=True))
        """ACCO over the data_parallel_replicate dimension (see acco_hooks.titan.config)."""

        fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
        """torchft (torchtitan's ``experiments.torchft`` section, its fields): with
        ``enable``, this job is replica group ``replica_id`` of ``group_size``, one torchrun
        each under a torchft lighthouse, and the engine sums the groups in the current quorum
        through a ``torchft.Manager`` (docs/multinode.md). ``semi_sync_method`` (torchtitan's
        DiLoCo, local SGD) is another training method and is refused with ACCO."""

    optimizers: ACCOOptimizersContainer
    config: Config

    def __init__(self, config: Config, settings: EngineSettings | None = None) -> None:
        settings = settings or validate_acco_config(config)
        if settings is None:
            raise ValueError("ACCOTrainer needs acco.enable = true")
        spec = config.model_spec
        parallelize_fn = spec.parallelize_fn
        # Which mesh dimensions a parameter's layout names depends on the backend. Under
        # partial_dtensor FSDP never sees dp_replicate: the model is parallelized as one
        # replica. Under spmd_types a parameter is typed over the whole data-parallel axis
        # (replicas x shards), which FSDP must know as HSDP's: it is applied as HSDP, then
        # stops after its intra-replica reduce-scatter.
        spmd_types = config.parallelism.spmd_backend == "spmd_types"

        def parallelize(model: nn.Module, *, parallel_dims: Any, **kwargs: Any) -> nn.Module:
            if not spmd_types:
                return parallelize_fn(model, parallel_dims=WithoutReplicate(parallel_dims),
                                      **kwargs)  # fmt: skip
            model = parallelize_fn(model, parallel_dims=parallel_dims, **kwargs)
            if parallel_dims.dp_replicate_enabled:
                turn_off_replica_all_reduce(fsdp_modules([model]))
                logger.info("ACCO: FSDP's cross-replica all-reduce is off (spmd_types "
                            "backend); the engine reduces gradients across replicas")  # fmt: skip
            return model

        parallelize.__name__ = f"{parallelize_fn.__name__}_without_data_parallel"
        ft = config.fault_tolerance
        config.model_spec = dataclasses.replace(
            spec, parallelize_fn=parallelize,
            post_optimizer_build_fn=_bind_engine_after(
                spec.post_optimizer_build_fn, settings, config.lr_scheduler,
                config.training.steps,
                ft if ft.enable else None,
            ),
        )  # fmt: skip
        config.optimizer = _as(ACCOOptimizersContainer.Config, config.optimizer,
                               engine=settings)  # fmt: skip
        config.lr_scheduler = _as(ACCOLRSchedulersContainer.Config, config.lr_scheduler)
        if ft.enable:  # the replica groups split the data; each checkpoints into its own folder
            config.dataloader = _split_over_replica_groups(config.dataloader, ft)
            config.checkpoint.folder = replica_group_folder(ft, config.checkpoint)
        # A CUDA-graph replay would skip the engine's gradient hooks (Python).
        config.training.disable_cuda_graphs = True
        if isinstance(config.loss, ChunkedLossWrapper.Config) and (
            config.parallelism.data_parallel_shard_degree != 1
        ):
            logger.info(
                "ACCO: the chunked loss turns FSDP gradient sync back on for the lm_head unit "
                "every micro-batch (one extra intra-replica reduce-scatter of it per "
                "micro-batch; same result). CrossEntropyLoss avoids it."
            )
        super().__init__(config)

    @property
    def titan_config(self) -> Config:
        return self.config

    def _next_microbatch(self, data_iterator: Iterator[Batch]) -> tuple[Any, Any, torch.Tensor]:
        if not self.parallel_dims.pp_enabled:
            return super()._next_microbatch(data_iterator)
        # PP: the dataloader yields pipeline micro-batches; one ACCO micro-batch is a
        # schedule's worth of them, passed as lists (as torchtitan's own train_step does).
        batches = [self._move_to_device(next(data_iterator))
                   for _ in range(self.num_pipeline_parallel_microbatches)]  # fmt: skip
        valid = sum(label_tokens(labels, IGNORE_INDEX) for _, labels in batches)
        return [b[0] for b in batches], [b[1] for b in batches], valid


def _split_over_replica_groups(dataloader: Any, fault_tolerance: FaultTolerance) -> Any:
    """``dataloader`` (a data loader's config) whose loader reads this torchft replica group's
    part of the data: torchtitan's ``Trainer`` builds it with the data-parallel degree and rank
    inside the group (``acco_hooks.titan.replica_groups``)."""
    own = type(dataloader)

    class OverReplicaGroups(own):
        def build(self, *, dp_world_size: int, dp_rank: int, **kwargs: Any) -> Any:
            dp_world_size, dp_rank = split_data_over_replica_groups(
                fault_tolerance, dp_world_size, dp_rank
            )
            return own.build(self, dp_world_size=dp_world_size, dp_rank=dp_rank, **kwargs)

    return _as(OverReplicaGroups, dataloader)


def with_acco(config: Trainer.Config, **acco: Any) -> ACCOTrainer.Config:
    """``config`` trained with ACCO over its ``data_parallel_replicate`` dimension.

    For a recipe module of your own, the way torchtitan 0.3.0 composes configs: a function
    that returns a ``Trainer.Config`` built from another one, run with ``-m torchtitan.train
    --module my_recipes --config NAME``, every setting in Python, none on the command line.

    Args:
        config: any torchtitan ``Trainer.Config`` (a model's config function, one of
            :mod:`acco_hooks.titan.config_registry`'s, ...); it is not changed.
        **acco: the ``acco`` section's settings (:class:`acco_hooks.titan.config.ACCO`:
            ``mode``, ``accumulation_steps``, ...); ``enable`` is implied.

    Returns:
        An ``ACCOTrainer.Config`` with every other setting of ``config``.

    Raises:
        ValueError: naming a setting that does not exist or has a bad value. How they compose
            with the run's parallelism is checked when the trainer is built, before any step.

    Example::

        # my_recipes.py
        from torchtitan.models.llama3.config_registry import llama3_8b
        from acco_hooks.titan.v030 import with_acco

        def llama3_8b_acco():
            config = with_acco(llama3_8b(), mode="acco")
            config.parallelism.data_parallel_replicate_degree = 2
            return config
    """
    unknown = sorted(set(acco) - {f.name for f in dataclasses.fields(ACCO)})
    if unknown:
        raise ValueError(
            f"with_acco: {', '.join(unknown)} is not an acco setting; the settings are "
            f"{', '.join(f.name for f in dataclasses.fields(ACCO))}"
        )
    base = config.acco if isinstance(config, ACCOTrainer.Config) else ACCO()
    settings = dataclasses.replace(base, **{**acco, "enable": True})
    settings.check(spelling)
    others = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.init and f.name != "acco"}  # fmt: skip
    return ACCOTrainer.Config(**copy.deepcopy(others), acco=settings)
