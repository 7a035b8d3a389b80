"""``DecoupledTrainer``: the paper code's trainer signature on top of ``ACCOTrainer``.

The authors' code (``trainer_decoupled.DecoupledTrainer``) is built as::

    trainer = DecoupledTrainer(model=model, tokenizer=tokenizer, train_dataset=ds["train"],
                               eval_dataset=ds["test"], text_column_name="text", args=cfg.train,
                               log=logger, preprocess_dataset_fn=None, run_name=cfg.run_name)
    trainer.train()

The same call works here. The raw text column is tokenised and cut into fixed-length blocks
(:func:`~acco_hooks.hf.data.tokenize_and_group`), then the trainer is an :class:`ACCOTrainer`.
``args`` is either ``TrainingArguments`` or the paper's ``train`` config section (a dict, an
OmegaConf ``DictConfig`` or any object with attributes), translated by
:func:`training_arguments_from_paper_config`. It launches with ``torchrun`` (the paper's code
reads SLURM variables only).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainingArguments

from acco_hooks._frontend import launcher_world_size
from acco_hooks.engine import Mode
from acco_hooks.hf.arguments import ACCOArguments
from acco_hooks.hf.data import tokenize_and_group
from acco_hooks.hf.trainer import ACCOTrainer

__all__ = ["DecoupledTrainer", "training_arguments_from_paper_config"]

logger = logging.getLogger(__name__)

# The paper's ``train`` config keys that mean the same as a TrainingArguments field.
_SAME_MEANING = {
    "batch_size": ("per_device_train_batch_size", "per_device_eval_batch_size"),
    "n_grad_accumulation": ("gradient_accumulation_steps",),
    "learning_rate": ("learning_rate",),
    "weight_decay": ("weight_decay",),
    "adam_beta1": ("adam_beta1",),
    "adam_beta2": ("adam_beta2",),
    "label_smoothing_factor": ("label_smoothing_factor",),
    "scheduler_name": ("lr_scheduler_type",),
    "use_mixed_precision": ("bf16",),
    "dataloader_num_workers": ("dataloader_num_workers",),
    "dataloader_pin_memory": ("dataloader_pin_memory",),
    "dataloader_persistent_workers": ("dataloader_persistent_workers",),
    "seed": ("seed",),
}
# Keys translated below, and keys that describe the authors' launcher, not the training.
_TRANSLATED = {"method_name", "run_baseline_ddp", "nb_steps_tot", "warmup", "eval", "eval_step",
               "max_length", "const_len_batch", "n_warmup_steps"}  # fmt: skip


def training_arguments_from_paper_config(
    config: Any, output_dir: str | None = None, world_size: int | None = None
) -> tuple[TrainingArguments, ACCOArguments, dict[str, Any]]:
    """Translate the paper code's ``train`` config into ``TrainingArguments`` and ACCO settings.

    The paper counts in micro-batch gradients summed over all workers (``nb_steps_tot``,
    ``eval_step``); a Trainer step here is one round of ``n_grad_accumulation`` micro-batches on
    each of the ``world_size`` workers, so those counts are divided by
    ``world_size × n_grad_accumulation``. Its scheduler advances once per optimizer update and
    ``warmup`` counts updates; here warm-up is given in rounds, so in ``acco`` (two rounds per
    update) it is doubled. ``n_warmup_steps`` (synchronous rounds before ACCO starts) has no
    counterpart and must be 0. Keys not listed are ignored (logged).

    Returns:
        ``(training_args, acco_args, data_kwargs)``; ``data_kwargs`` holds ``block_size``
        (``max_length``) and ``group_texts`` (``const_len_batch``) when the config has them.
    """
    values = dict(config.items()) if hasattr(config, "items") else dict(vars(config))
    world_size = world_size or (
        dist.get_world_size() if dist.is_available() and dist.is_initialized()
        else launcher_world_size()
    )  # fmt: skip
    mode = "ddp" if values.get("run_baseline_ddp") else values.get("method_name", "acco")
    acco_args = ACCOArguments(mode=mode)
    if values.get("n_warmup_steps", 0):
        raise ValueError(
            f"DecoupledTrainer: n_warmup_steps={values['n_warmup_steps']!r}: synchronous warm-up "
            "rounds before ACCO are not supported; set it to 0 (or train a few steps with "
            "mode='ddp', save, and resume the weights with mode='acco')"
        )
    kwargs: dict[str, Any] = {}
    for key, targets in _SAME_MEANING.items():
        if key in values and values[key] is not None:
            for target in targets:
                kwargs[target] = values[key]
    micro = int(values.get("n_grad_accumulation", 1)) * world_size
    if "nb_steps_tot" in values:
        kwargs["max_steps"] = max(1, math.ceil(int(values["nb_steps_tot"]) / micro))
    if "warmup" in values:
        kwargs["warmup_steps"] = int(values["warmup"]) * (2 if mode == Mode.ACCO else 1)
    if values.get("eval") and "eval_step" in values:
        kwargs["eval_strategy"] = "steps"
        kwargs["eval_steps"] = max(1, math.ceil(int(values["eval_step"]) / micro))
    kwargs.setdefault("use_cpu", not torch.cuda.is_available())
    ignored = sorted(set(values) - set(_SAME_MEANING) - _TRANSLATED)
    if ignored:
        logger.info("DecoupledTrainer: config keys without a Trainer counterpart, ignored: %s",
                    ", ".join(ignored))  # fmt: skip
    output_dir = output_dir or os.path.join("outputs", "decoupled")
    args = TrainingArguments(output_dir=output_dir, **kwargs)
    data_kwargs = {}
    if values.get("max_length"):
        data_kwargs["block_size"] = int(values["max_length"])
    if "const_len_batch" in values:
        data_kwargs["group_texts"] = bool(values["const_len_batch"])
    return args, acco_args, data_kwargs


class DecoupledTrainer(ACCOTrainer):
    """``ACCOTrainer`` with the constructor of the paper's ``DecoupledTrainer``.

    Args:
        model: the model (a causal LM such as ``GPTNeoForCausalLM``), on any device: the
            Trainer places it.
        tokenizer: tokenises the text column; saved with the checkpoints.
        train_dataset, eval_dataset: ``datasets.Dataset`` with a raw text column (or already
            tokenised ``input_ids``).
        args: ``TrainingArguments``, or the paper's ``train`` config (see
            :func:`training_arguments_from_paper_config`; its ``method_name`` then gives the
            mode unless ``acco_args`` is passed).
        log: a ``logging.Logger`` for the set-up message (the Trainer logs as usual).
        text_column_name: the raw text column.
        preprocess_dataset_fn: a batched ``dataset.map`` function applied before tokenising.
        run_name: ``TrainingArguments.run_name`` (and the output folder with a paper config).
        acco_args: the ACCO settings; default ``ACCOArguments()`` (``mode="acco"``).
        block_size: tokens per sequence; default: the paper config's ``max_length``, else the
            smaller of 1024 and the model's ``max_position_embeddings``.
        group_texts: concatenate texts and cut full blocks (default) or truncate and pad each.
        **kwargs: further ``ACCOTrainer``/``Trainer`` keyword arguments.

    Example::

        >>> trainer = DecoupledTrainer(model=model, tokenizer=tokenizer, train_dataset=ds["train"],
        ...                            eval_dataset=ds["test"], text_column_name="text",
        ...                            args=TrainingArguments(output_dir="out", max_steps=1000))
        >>> trainer.train()
    """

    def __init__(
        self,
        model: Any = None,
        tokenizer: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        args: Any = None,
        log: logging.Logger | None = None,
        text_column_name: str = "text",
        preprocess_dataset_fn: Any = None,
        run_name: str = "",
        *,
        acco_args: ACCOArguments | None = None,
        block_size: int | None = None,
        group_texts: bool = True,
        **kwargs: Any,
    ) -> None:
        if model is None or tokenizer is None or args is None:
            raise ValueError("DecoupledTrainer needs model=, tokenizer= and args=")
        data_kwargs: dict[str, Any] = {}
        if not isinstance(args, TrainingArguments):
            output_dir = os.path.join("outputs", run_name) if run_name else None
            args, paper_acco_args, data_kwargs = training_arguments_from_paper_config(
                args, output_dir
            )
            acco_args = acco_args or paper_acco_args
        if run_name:
            args.run_name = run_name
        block_size = block_size or data_kwargs.get("block_size") or _default_block_size(model)
        group_texts = data_kwargs.get("group_texts", group_texts)
        with args.main_process_first(desc="tokenize"):
            train_dataset, collator = tokenize_and_group(
                train_dataset, tokenizer, text_column_name, block_size, group_texts,
                preprocess_dataset_fn,
            )  # fmt: skip
            if eval_dataset is not None:
                eval_dataset, _ = tokenize_and_group(
                    eval_dataset, tokenizer, text_column_name, block_size, group_texts,
                    preprocess_dataset_fn,
                )  # fmt: skip
        (log or logger).info(
            "DecoupledTrainer: %d training sequences of %d tokens (%s), mode=%s",
            len(train_dataset), block_size, "grouped" if group_texts else "truncated",
            (acco_args or ACCOArguments()).mode,
        )  # fmt: skip
        kwargs.setdefault("data_collator", collator)
        super().__init__(model=model, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=tokenizer,
                         acco_args=acco_args, **kwargs)  # fmt: skip


def _default_block_size(model: Any) -> int:
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return min(1024, positions) if isinstance(positions, int) and positions > 1 else 1024
