"""Fine-tune a causal language model with ACCO through the Hugging Face Trainer.

Runs offline as it is (a tiny Llama built from a config, the Python standard library's source as
data, the project's byte-level BPE tokenizer trained from it)::

    python3 -m torch.distributed.run --standalone --nproc_per_node 2 \\
        -m examples.hf_finetune --mode acco

Adapt it by changing the model and the data; every ``TrainingArguments`` flag works::

    torchrun --nproc_per_node 8 -m examples.hf_finetune \\
        --model_name_or_path EleutherAI/gpt-neo-125m \\
        --train_file train.jsonl --validation_file val.jsonl --block_size 1024 --bf16 \\
        --per_device_train_batch_size 8 --gradient_accumulation_steps 4 --max_steps 2000 \\
        --learning_rate 6e-4 --weight_decay 0.1 --adam_beta2 0.95 --lr_scheduler_type cosine \\
        --save_strategy steps --save_steps 500 --mode acco

It saves no checkpoint unless asked (``save_strategy="no"`` among its defaults): add
``--save_strategy steps --save_steps N``, and resume with ``--resume_from_checkpoint
outputs/hf_finetune/checkpoint-N``, on any number of processes that keeps the global batch
(docs/hf.md, "Checkpoints and resuming").

The only lines that differ from a plain ``Trainer`` script are the ``ACCOArguments`` in the
parser and ``ACCOTrainer(..., acco_args=acco_args)``. Compare with ``--mode ddp`` (synchronous
ZeRO-1, the same updates as the plain Trainer with DDP) and ``--mode dpu``.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    TrainingArguments,
)

from acco_hooks.hf import ACCOArguments, ACCOTrainer, real_updates, tokenize_and_group
from scaffolding.process_exit import finish

logger = logging.getLogger("hf_finetune")


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": (
        "A model id or folder for AutoModelForCausalLM.from_pretrained. Default: a tiny Llama "
        "(2 layers, hidden 64) built from a config and trained from scratch.")})
    tokenizer_name: str | None = field(default=None, metadata={"help": (
        "Tokenizer id or folder. Default: the model's; for the tiny Llama the stdlib BPE "
        "tokenizer (outputs/stdlib/tokenizer, built on first use).")})
    train_file: str | None = field(default=None, metadata={"help": (
        "A .jsonl/.json/.csv/.txt file with a text column. Default: the Python standard "
        "library's source files (outputs/stdlib/dataset/train.jsonl, built on first use).")})
    validation_file: str | None = field(default=None, metadata={"help": (
        "Like train_file, for evaluation. Default: the stdlib validation split.")})
    text_column_name: str = field(default="text", metadata={"help": "The raw text column."})
    block_size: int = field(default=128, metadata={"help": (
        "Tokens per training sequence (texts are concatenated and cut into blocks).")})
    max_train_samples: int | None = field(default=None, metadata={"help": (
        "Keep only the first N training texts (quick runs).")})
    max_eval_samples: int | None = field(default=100, metadata={"help": (
        "Keep only the first N evaluation texts.")})


def load_text_dataset(path: str, limit: int | None):
    from datasets import load_dataset

    extension = os.path.splitext(path)[1]
    kind = {".jsonl": "json", ".json": "json", ".csv": "csv", ".txt": "text"}[extension]
    dataset = load_dataset(kind, data_files=path, split="train")
    return dataset.select(range(min(limit, len(dataset)))) if limit else dataset


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, ACCOArguments, TrainingArguments))
    parser.set_defaults(
        output_dir="outputs/hf_finetune", max_steps=40, per_device_train_batch_size=8,
        per_device_eval_batch_size=8, gradient_accumulation_steps=2, learning_rate=1e-3,
        weight_decay=0.1, lr_scheduler_type="cosine", warmup_steps=0.1, logging_steps=5,
        eval_strategy="steps", eval_steps=20, save_strategy="no", report_to="none",
        use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
    )  # fmt: skip
    script_args, acco_args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(level=logging.INFO if training_args.process_index == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)  # fmt: skip

    # Data and tokenizer: the embedded defaults need no download.
    train_file, validation_file = script_args.train_file, script_args.validation_file
    tokenizer_name = script_args.tokenizer_name or script_args.model_name_or_path
    if train_file is None or tokenizer_name is None:
        from scaffolding.stdlib_data import (
            DEFAULT_DATASET_DIR,
            DEFAULT_TOKENIZER_DIR,
            ensure_stdlib_assets,
        )

        with training_args.main_process_first(desc="stdlib assets"):
            ensure_stdlib_assets()
        train_file = train_file or os.path.join(DEFAULT_DATASET_DIR, "train.jsonl")
        if validation_file is None and script_args.train_file is None:
            validation_file = os.path.join(DEFAULT_DATASET_DIR, "validation.jsonl")
        tokenizer_name = tokenizer_name or DEFAULT_TOKENIZER_DIR
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name)

    with training_args.main_process_first(desc="tokenize"):
        train, collator = tokenize_and_group(
            load_text_dataset(train_file, script_args.max_train_samples), tokenizer,
            script_args.text_column_name, script_args.block_size,
        )  # fmt: skip
        evaluation = None
        if validation_file:
            evaluation, _ = tokenize_and_group(
                load_text_dataset(validation_file, script_args.max_eval_samples), tokenizer,
                script_args.text_column_name, script_args.block_size,
            )  # fmt: skip
    if evaluation is None:
        training_args.eval_strategy = "no"

    # Model: change --model_name_or_path to fine-tune a pretrained one.
    if script_args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(script_args.model_name_or_path)
    else:
        torch.manual_seed(training_args.seed)
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=script_args.block_size,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        ))  # fmt: skip

    trainer = ACCOTrainer(model=model, args=training_args, train_dataset=train,
                          eval_dataset=evaluation, data_collator=collator,
                          processing_class=tokenizer, acco_args=acco_args)  # fmt: skip
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    metrics = trainer.evaluate() if evaluation is not None else {}
    trainer.save_model()  # the real parameters θ
    if trainer.is_world_process_zero():
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        print(
            f"summary: mode={acco_args.mode} steps={result.global_step} "
            f"real_updates={real_updates(acco_args.mode, result.global_step)} "
            f"first_loss={losses[0] if losses else float('nan'):.4f} "
            f"last_loss={losses[-1] if losses else float('nan'):.4f} "
            f"eval_loss={metrics.get('eval_loss', float('nan')):.4f}",
            flush=True,
        )
    trainer.accelerator.end_training()  # the trackers finish
    # The trainer (its DDP model) holds the process group: let it go, then destroy the group
    # and leave without an abort at exit (scaffolding/process_exit.py).
    del trainer, model
    finish()


if __name__ == "__main__":
    main()
