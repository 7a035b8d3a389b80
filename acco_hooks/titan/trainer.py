"""torchtitan 0.2.2: ``ACCOTrainer``, torchtitan's Trainer with ACCO on the data-parallel dimension.

The round loop is shared with the 0.3.0 adapter (:mod:`acco_hooks.titan._round_loop`); this
module puts the engine into 0.2.2's train spec and feeds the loop 0.2.2's batches.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from acco_hooks.titan import require_release

require_release("0.2.2", __name__)  # before any torchtitan import: a clear error on 0.3.0

from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.train import Trainer

from acco_hooks._frontend import label_tokens
from acco_hooks.titan._round_loop import ACCOTrainerLoop, Batch
from acco_hooks.titan.components import ACCOOptimizersContainer
from acco_hooks.titan.config import JobConfig, validate_acco_config
from acco_hooks.titan.train_spec import acco_train_spec, building, ensure_acco_train_spec

__all__ = ["ACCOTrainer", "acco_train_spec", "ensure_acco_train_spec"]


class ACCOTrainer(ACCOTrainerLoop, Trainer):
    """torchtitan ``Trainer`` whose data parallelism and optimizer are the ACCO engine.

    Needs ``[acco] enable = true``. The model's train spec is replaced by ``<name>_acco``
    (registered on the fly): the same model and parallelize function, without DDP.
    """

    optimizers: ACCOOptimizersContainer

    def __init__(self, job_config: JobConfig) -> None:
        validate_acco_config(job_config)
        if not job_config.acco.enable:
            raise ValueError("ACCOTrainer needs [acco] enable = true")
        job_config.model.name = ensure_acco_train_spec(job_config.model.name)
        with building(self):
            super().__init__(job_config)
        self._setup_acco()

    @property
    def titan_config(self) -> JobConfig:
        return self.job_config

    def _validation_enabled(self) -> bool:
        return self.job_config.validation.enable

    def _next_microbatch(self, data_iterator: Iterator[Batch]) -> tuple[Any, Any, torch.Tensor]:
        # 0.2.2: one batch of local_batch_size; under PP its schedule splits it into micro-batches
        input_dict, labels = self._move_to_device(next(data_iterator))
        return input_dict, labels, label_tokens(labels, IGNORE_INDEX)
