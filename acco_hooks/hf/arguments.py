"""``ACCOArguments``: the ACCO settings of a Hugging Face ``Trainer`` run, next to its
``TrainingArguments``.

Everything the ``TrainingArguments`` already say keeps its meaning there (micro-batches per
round = ``gradient_accumulation_steps``, learning rate and schedule, ``max_grad_norm``,
``ddp_timeout``, ...); ``ACCOArguments`` holds only what a plain ``Trainer`` has no word for:
the engine's :class:`~acco_hooks.engine.ACCOSettings`, taken as they are. It is a dataclass, so
``transformers.HfArgumentParser((ACCOArguments, TrainingArguments))`` turns it into command-line
flags (``--mode acco``); the docstring under each field is its ``--help`` text.
"""

from dataclasses import dataclass

from acco_hooks.engine import ACCOSettings
from acco_hooks.engine.settings import with_own_fields

__all__ = ["ACCOArguments"]


@dataclass
@with_own_fields  # HfArgumentParser rewrites the fields it reads: not the engine's own
class ACCOArguments(ACCOSettings):
    """How the ACCO engine replaces DDP and the optimizer in ``ACCOTrainer``.

    The fields, their defaults and their allowed values are the engine's
    (:class:`~acco_hooks.engine.ACCOSettings`, which also says how to tune them). Two of them
    meet the Trainer:

    * ``accumulate_until_ready=True`` is refused by ``ACCOTrainer``: the Trainer runs a fixed
      number of micro-batches per step and epoch on every rank. Use ``ACCOOptimizer`` in a
      custom loop or the torchtitan trainer for heterogeneous hardware.
    * ``timeout=None`` takes ``TrainingArguments.ddp_timeout``, the timeout of the Trainer's own
      process group.

    Raises:
        SettingError: a ``ValueError`` at construction, for a value outside the allowed set,
            naming the field (``ACCOArguments.mode='x' is not one of ...``).
    """

    def __post_init__(self) -> None:
        self.check(spell=lambda name, value: f"ACCOArguments.{name}={value!r}")
