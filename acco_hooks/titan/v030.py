"""torchtitan 0.3.0: ``ACCOTrainer``, its config, and the engine as an optimizer container.

torchtitan 0.3.0 configures a run with a ``Trainer.Config`` returned by a Python function
(``-m torchtitan.train --module M --config FN``); a component is a ``Configurable`` whose
nested ``Config`` builds it. ACCO plugs in at three of them:

- :class:`ACCOTrainer` (``ACCOTrainer.Config`` = ``Trainer.Config`` plus an ``acco`` field,
  ``--acco.mode ...`` on the command line). Its ``__init__`` validates ``acco``, then swaps into
  the config what ACCO replaces before torchtitan builds anything: the model spec's
  parallelize function (the same one, with the ``dp_replicate`` dimension hidden), the optimizer
  container and the LR schedulers (the same settings, built on the engine). The round loop is
  shared with the 0.2.2 adapter (:mod:`acco_hooks.titan._round_loop`).
- :class:`ACCOOptimizersContainer`: the engine over every parameter of this rank, sharded over
  ``dp_replicate``, from the run's single Adam/AdamW parameter group.
- :class:`ACCOLRSchedulersContainer`: torchtitan's schedules, counted in real updates.

Data parallelism in 0.3.0 is FSDP2 everywhere (torchtitan's "DDP" is FSDP with a replicate
mesh dimension). ACCO keeps FSDP2 inside a replica (mixed precision; sharding with
``data_parallel_shard_degree > 1``, i.e. HSDP) and replaces the cross-replica all-reduce.
ACCO runs need ``parallelism.spmd_backend = "partial_dtensor"`` (DTensor parameters, the
``fsdp`` mesh): the engine reads DTensor placements, which the default ``spmd_types`` backend
only gives FSDP parameters.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from acco_hooks.titan import require_release

require_release("0.3.0", __name__)  # before any torchtitan import: a clear error on 0.2.2

from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from acco_hooks._frontend import label_tokens
from acco_hooks.engine import real_updates
from acco_hooks.titan._container import (
    OPTIMIZER_CLASSES,
    TRAINER_BEING_BUILT,
    EngineContainer,
    WithoutReplicate,
    building,
    engine_kwargs,
)
from acco_hooks.titan._round_loop import ACCOTrainerLoop, Batch
from acco_hooks.titan.settings import ACCO, validate_acco_settings

__all__ = ["ACCOLRSchedulersContainer", "ACCOOptimizersContainer", "ACCOTrainer",
           "parallelize_without_data_parallel", "validate_acco_config"]  # fmt: skip

ACCO_SPMD_BACKEND = "partial_dtensor"


def validate_acco_config(config: Trainer.Config, world_size: int | None = None) -> None:
    """Refuse bad ``acco`` settings or an unsupported parallelism before anything is built.

    Raises:
        ValueError: naming the setting and the fix.
    """
    acco = getattr(config, "acco", None)
    if acco is None or not acco.enable:
        return
    groups = config.optimizer.param_groups
    validate_acco_settings(
        acco, config.parallelism, [g.optimizer_name for g in groups] or ["(none)"],
        world_size=world_size,
    )  # fmt: skip
    if groups[0].pattern != ".*":
        raise ValueError(
            f"optimizer.param_groups[0].pattern = {groups[0].pattern!r}: the ACCO engine "
            "optimizes every parameter with one optimizer; use the catch-all pattern '.*'"
        )
    if config.parallelism.spmd_backend != ACCO_SPMD_BACKEND:
        raise ValueError(
            f"parallelism.spmd_backend = {config.parallelism.spmd_backend!r}: ACCO runs on "
            f"DTensor parameters; set --parallelism.spmd-backend {ACCO_SPMD_BACKEND} (the "
            "acco_hooks.titan configs do)"
        )


def parallelize_without_data_parallel(parallelize_fn):
    """Wrap a model spec's parallelize function so that it applies everything but the
    cross-replica data parallelism (HSDP's all-reduce)."""

    def parallelize(model: nn.Module, *, parallel_dims: Any, **kwargs: Any) -> nn.Module:
        return parallelize_fn(model, parallel_dims=WithoutReplicate(parallel_dims), **kwargs)

    parallelize.__name__ = f"{parallelize_fn.__name__}_without_data_parallel"
    return parallelize


class ACCOOptimizersContainer(EngineContainer, OptimizersContainer):
    """torchtitan 0.3.0's optimizer container with the ACCO engine inside (see
    :class:`acco_hooks.titan._container.EngineContainer`). Built by ``ACCOTrainer`` from the
    run's optimizer config: one Adam or AdamW parameter group matching every parameter."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        trainer = TRAINER_BEING_BUILT.get()
        titan_config = trainer.config
        (group,) = config.param_groups  # validate_acco_config refuses several
        optimizer_kwargs = {**self._build_impl_kwargs(config), **group.optimizer_kwargs}
        kwargs = engine_kwargs(
            titan_config.acco, trainer.parallel_dims,
            accumulation_steps=(titan_config.acco.accumulation_steps
                                or trainer.gradient_accumulation_steps),
            max_norm=titan_config.training.max_norm, fsdp_mesh_name="fsdp",
        )  # fmt: skip
        params = self._build_engine(
            model_parts, OPTIMIZER_CLASSES[group.optimizer_name], optimizer_kwargs, kwargs
        )
        self._post_init(params)


class ACCOLRSchedulersContainer(LRSchedulersContainer):
    """torchtitan's LR schedulers on the engine's optimizer, counted in real updates (with
    ``acco.mode = "acco"`` a run of ``training.steps`` rounds makes ``steps // 2`` updates) and
    stepped by the engine once per real update. A set ``total_steps`` counts real updates."""

    @dataclass(kw_only=True, slots=True)
    class Config(LRSchedulersContainer.Config):
        def build(self, *, optimizers: ACCOOptimizersContainer, training_steps: int) -> Any:
            mode = TRAINER_BEING_BUILT.get().config.acco.mode
            # slots dataclass: name the base explicitly (zero-argument super() fails)
            schedulers = LRSchedulersContainer.Config.build(
                self, optimizers=optimizers, training_steps=real_updates(mode, training_steps)
            )
            optimizers.engine.lr_scheduler = schedulers
            return schedulers


def _as(config_cls: type, config: Any) -> Any:
    """``config``'s settings in ``config_cls`` (a subclass of its class)."""
    return config_cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                         if f.init})  # fmt: skip


class ACCOTrainer(ACCOTrainerLoop, Trainer):
    """torchtitan 0.3.0 ``Trainer`` whose data parallelism and optimizer are the ACCO engine.

    Needs ``acco.enable = True``. Build it from its config (``config.build()``), as
    ``torchtitan.train`` does.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        acco: ACCO = field(default_factory=lambda: ACCO(enable=True))
        """ACCO over the data_parallel_replicate dimension (see acco_hooks.titan.settings)."""

    optimizers: ACCOOptimizersContainer
    config: Config

    def __init__(self, config: Config) -> None:
        validate_acco_config(config)
        if not config.acco.enable:
            raise ValueError("ACCOTrainer needs acco.enable = true")
        spec = config.model_spec
        config.model_spec = dataclasses.replace(
            spec, parallelize_fn=parallelize_without_data_parallel(spec.parallelize_fn)
        )
        config.optimizer = _as(ACCOOptimizersContainer.Config, config.optimizer)
        config.lr_scheduler = _as(ACCOLRSchedulersContainer.Config, config.lr_scheduler)
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
        with building(self):
            super().__init__(config)
        self._setup_acco()

    @property
    def titan_config(self) -> Config:
        return self.config

    def _validation_enabled(self) -> bool:
        return self.config.validator.enable

    def _next_microbatch(self, data_iterator: Iterator[Batch]) -> tuple[Any, Any, torch.Tensor]:
        if not self.parallel_dims.pp_enabled:
            input_dict, labels = self._move_to_device(next(data_iterator))
            return input_dict, labels, label_tokens(labels, IGNORE_INDEX)
        # PP: the dataloader yields pipeline micro-batches; one ACCO micro-batch is a
        # schedule's worth of them, passed as lists (as torchtitan's own train_step does).
        batches = [self._move_to_device(next(data_iterator))
                   for _ in range(self.num_pipeline_parallel_microbatches)]  # fmt: skip
        valid = sum(label_tokens(labels, IGNORE_INDEX) for _, labels in batches)
        return [b[0] for b in batches], [b[1] for b in batches], valid
