"""How much of the engine's weighting unit each of the Trainer's micro-batches is.

The engine averages Σ gradients / Σ weights over all ranks; the Trainer has already scaled each
micro-batch's loss by its own rule, which these functions read back: a micro-batch weighs
``items · f / num_items_in_batch`` when the loss is normalised by the number of label tokens
(``f`` = the number of processes when ``average_tokens_across_devices`` scales the loss by it),
``1 / gradient_accumulation_steps`` when the Trainer divides a per-micro-batch mean by it.
"""

from __future__ import annotations

from typing import Any

import torch

from acco_hooks._frontend import label_tokens as count_label_tokens

__all__ = ["label_tokens", "microbatch_weight"]


def label_tokens(trainer: Any, inputs: dict[str, Any]) -> int | None:
    """The label tokens of one micro-batch, counted as the Trainer counts num_items_in_batch."""
    if "shift_labels" in inputs:
        labels = inputs["shift_labels"]
    elif "labels" in inputs and isinstance(inputs["labels"], torch.Tensor):
        labels = inputs["labels"][..., 1:] if trainer._loss_shifts_labels else inputs["labels"]
    else:
        return None
    return count_label_tokens(labels)


def microbatch_weight(trainer: Any, items: int | None, num_items_in_batch: Any) -> float:
    """How much of the engine's weighting unit the back-propagated loss sums over."""
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:  # the Trainer's own rule (Trainer.training_step)
        scaled = (
            trainer.model_accepts_loss_kwargs and num_items_in_batch is not None
        ) or trainer.compute_loss_func is not None
    if not scaled or num_items_in_batch is None or items is None:
        # A per-micro-batch mean that the Trainer divided by the step's micro-batches (or a
        # loss the user normalised over the step): every micro-batch is an equal share.
        return 1.0 / trainer.current_gradient_accumulation_steps
    factor = 1
    if trainer.args.average_tokens_across_devices and (
        trainer.model_accepts_loss_kwargs or trainer.compute_loss_func
    ):  # compute_loss multiplied the loss by the number of processes
        factor = trainer.accelerator.num_processes // trainer.get_tp_size()
    return items * factor / float(num_items_in_batch)
