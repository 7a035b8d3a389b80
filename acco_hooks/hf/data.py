"""Causal-LM data from a raw text column: tokenise, then cut into fixed-length blocks.

What the paper's ``DecoupledTrainer`` does to its datasets (``const_len_batch``), in the manner
of ``transformers``' ``run_clm.py``: every text is tokenised, followed by the end-of-text token,
the token streams are concatenated and cut into blocks of ``block_size`` tokens (the tail of
each map batch that does not fill a block is dropped); each block is its own label sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import DataCollatorForLanguageModeling, default_data_collator

__all__ = ["tokenize_and_group"]


def tokenize_and_group(
    dataset: Any,
    tokenizer: Any,
    text_column_name: str = "text",
    block_size: int = 1024,
    group_texts: bool = True,
    preprocess_fn: Callable[[dict[str, list]], dict[str, list]] | None = None,
    num_proc: int | None = None,
) -> tuple[Any, Callable]:
    """Tokenise ``dataset[text_column_name]`` for causal language modelling.

    Args:
        dataset: a ``datasets.Dataset`` with a text column (or already an ``input_ids`` one,
            which is kept as it is).
        tokenizer: a ``transformers`` tokenizer. Without a padding token, the end-of-text token
            pads (only needed with ``group_texts=False``).
        text_column_name: the column holding the raw text.
        block_size: tokens per training sequence.
        group_texts: ``True``: concatenate and cut into full blocks (no padding, every token is
            a target). ``False``: one truncated sequence per text, padded per batch, padding
            masked out of the loss.
        preprocess_fn: a batched ``dataset.map`` function applied first (the paper's
            ``preprocess_dataset_fn``).
        num_proc: processes for ``dataset.map``.

    Returns:
        ``(dataset, data_collator)``: the tokenised dataset (only model columns left) and the
        collator that batches it.
    """
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 2:
        raise ValueError(f"tokenize_and_group: block_size={block_size!r} must be an integer >= 2")
    if preprocess_fn is not None:
        dataset = dataset.map(preprocess_fn, batched=True, num_proc=num_proc)
    if "input_ids" in dataset.column_names:
        if "labels" in dataset.column_names:
            return dataset, default_data_collator
        return dataset, _padding_lm_collator(tokenizer)
    if text_column_name not in dataset.column_names:
        raise ValueError(
            f"tokenize_and_group: the dataset has no column {text_column_name!r} (it has "
            f"{', '.join(dataset.column_names)}); pass text_column_name="
        )
    columns = dataset.column_names
    if not group_texts:

        def tokenize_truncated(batch: dict[str, list]) -> dict[str, list]:
            return tokenizer(batch[text_column_name], truncation=True, max_length=block_size)

        tokenized = dataset.map(tokenize_truncated, batched=True, remove_columns=columns,
                                num_proc=num_proc, desc="tokenize")  # fmt: skip
        return tokenized, _padding_lm_collator(tokenizer)

    eos = tokenizer.eos_token_id

    def tokenize_and_cut(batch: dict[str, list]) -> dict[str, list]:
        stream: list[int] = []
        for ids in tokenizer(batch[text_column_name])["input_ids"]:
            stream.extend(ids)
            if eos is not None and (not ids or ids[-1] != eos):
                stream.append(eos)
        usable = len(stream) - len(stream) % block_size
        blocks = [stream[i : i + block_size] for i in range(0, usable, block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    grouped = dataset.map(tokenize_and_cut, batched=True, remove_columns=columns,
                          num_proc=num_proc, desc="tokenize and group")  # fmt: skip
    return grouped, default_data_collator


def _padding_lm_collator(tokenizer: Any) -> Callable:
    """Pads each batch; padding positions are left out of the loss (label -100)."""
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token  # as the paper's code does
    return DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm=False)
