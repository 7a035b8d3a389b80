"""Hugging Face ``Trainer`` front-end of the ACCO engine.

``ACCOTrainer`` is a drop-in ``transformers.Trainer`` whose data parallelism and optimizer are the
ACCO engine; ``ACCOArguments`` holds the ACCO settings next to the ``TrainingArguments``;
``DecoupledTrainer`` takes the keyword arguments of the paper's code (a raw text column, a
tokenizer) and tokenises the data before behaving as ``ACCOTrainer``. See ``docs/hf.md``.
"""

from acco_hooks.hf.arguments import ACCOArguments
from acco_hooks.hf.data import tokenize_and_group
from acco_hooks.hf.decoupled import DecoupledTrainer, training_arguments_from_paper_config
from acco_hooks.hf.trainer import ACCOTrainer, real_updates

__all__ = [
    "ACCOArguments",
    "ACCOTrainer",
    "DecoupledTrainer",
    "real_updates",
    "tokenize_and_group",
    "training_arguments_from_paper_config",
]
