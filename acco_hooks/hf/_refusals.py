"""What ``ACCOTrainer`` refuses, and why: settings the ACCO engine cannot serve, each named
with its fix, before any training step."""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist
from transformers import Trainer, TrainingArguments

from acco_hooks.hf._engine_optimizer import optimizer_cls_and_kwargs
from acco_hooks.hf.arguments import ACCOArguments

__all__ = ["EvaluationBarrier", "check_trainer_internals", "refuse_after_init",
           "refuse_before_init"]  # fmt: skip

# Trainer internals ACCOTrainer overrides: a transformers release that renames one would leave
# the override silently unused, so the import fails instead.
_OVERRIDDEN = (
    "_prepare_for_training", "_wrap_model", "_clip_grad_norm", "_get_grad_norm",
    "_get_learning_rate", "_save_checkpoint", "_save_optimizer_and_scheduler",
    "_load_optimizer_and_scheduler", "_finalize_training",
)  # fmt: skip
# LR schedules that need the training loop's metrics (the engine steps schedules by itself).
_METRIC_SCHEDULES = ("reduce_lr_on_plateau", "greedy")


def check_trainer_internals() -> None:
    """Refuse a transformers whose ``Trainer`` lacks a method ``ACCOTrainer`` overrides."""
    missing = [name for name in _OVERRIDDEN if not hasattr(Trainer, name)]
    if missing:
        import transformers

        raise ImportError(
            f"acco_hooks.hf: transformers {transformers.__version__} has no Trainer."
            f"{', Trainer.'.join(missing)}; ACCOTrainer is written for transformers 5.x"
        )


def refuse_before_init(args: Any, acco_args: ACCOArguments, optimizers: Any) -> None:
    """Settings of the arguments alone: refused before the Trainer builds anything."""
    if optimizers is not None and any(o is not None for o in optimizers):
        raise ValueError(
            "ACCOTrainer: optimizers=(optimizer, lr_scheduler) is not supported: the ACCO engine "
            "builds the optimizer over its 1/N shard and steps the schedule once per real update. "
            "Choose the optimizer with TrainingArguments.optim or "
            "optimizer_cls_and_kwargs=(torch.optim.AdamW, {'lr': ...}), the schedule with "
            "TrainingArguments.lr_scheduler_type"
        )
    if acco_args.accumulate_until_ready:
        raise ValueError(
            "ACCOTrainer: ACCOArguments.accumulate_until_ready=True is not supported: the Trainer "
            "runs gradient_accumulation_steps micro-batches per step and a fixed number of steps "
            "per epoch on every rank, and logs, evaluates and saves at step boundaries "
            "collectively. Set it to False, or use ACCOOptimizer in your own loop or the "
            "torchtitan trainer for heterogeneous hardware"
        )
    if args is None:
        return
    if not isinstance(args, TrainingArguments):
        raise TypeError(f"ACCOTrainer: args must be TrainingArguments, got {type(args).__name__}")
    if args.deepspeed:
        raise ValueError(
            "ACCOTrainer: TrainingArguments.deepspeed is set: DeepSpeed's ZeRO replaces the "
            "optimizer and gradient reduction that the ACCO engine does (ACCO already shards the "
            "optimizer state like ZeRO-1). Remove deepspeed, or use the plain Trainer"
        )
    if args.fsdp:
        raise ValueError(
            f"ACCOTrainer: TrainingArguments.fsdp={args.fsdp!r}: ACCOTrainer replicates the "
            "model and shards the optimizer state like ZeRO-1. Remove fsdp; for FSDP2 inside a "
            "node with ACCO across nodes use the torchtitan trainer or "
            "acco_hooks.ACCOHSDPOptimizer (docs/hsdp.md)"
        )
    if args.fp16:
        raise ValueError(
            "ACCOTrainer: TrainingArguments.fp16=True scales the loss with a GradScaler whose "
            "scale the ACCO engine would average into the update. Use bf16=True (no loss "
            "scaling) or full precision"
        )
    if args.parallelism_config is not None:
        raise ValueError(
            "ACCOTrainer: TrainingArguments.parallelism_config (tensor, context or sequence "
            "parallelism) is set; ACCO supports pure data parallelism here. Remove it"
        )
    if args.auto_find_batch_size:
        raise ValueError(
            "ACCOTrainer: TrainingArguments.auto_find_batch_size=True restarts the training loop "
            "after an out-of-memory error with a new batch size, which the ACCO engine's "
            "in-flight rounds cannot follow. Set per_device_train_batch_size yourself"
        )
    schedule = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    if schedule in _METRIC_SCHEDULES:
        raise ValueError(
            f"ACCOTrainer: TrainingArguments.lr_scheduler_type={schedule!r} steps on evaluation "
            "metrics, but the ACCO engine steps the schedule after each real update on its "
            "communication thread. Use a step-based schedule ('linear', 'cosine', "
            "'constant_with_warmup', ...)"
        )


def refuse_after_init(trainer: Any) -> None:
    """Settings only known once the Trainer (and its accelerator) exist."""
    if trainer.is_deepspeed_enabled:
        raise ValueError(
            "ACCOTrainer: DeepSpeed is enabled (accelerate config or "
            "ACCELERATE_USE_DEEPSPEED): ZeRO replaces the optimizer and gradient reduction "
            "that the ACCO engine does (it already shards the optimizer state like ZeRO-1). "
            "Launch without DeepSpeed"
        )
    if trainer.is_fsdp_enabled:
        raise ValueError(
            "ACCOTrainer: accelerate's FSDP plugin is enabled (accelerate config or "
            "ACCELERATE_USE_FSDP): ACCOTrainer replicates the model and shards the optimizer "
            "state like ZeRO-1. Launch without FSDP; for FSDP2 inside a node with ACCO across "
            "nodes use the torchtitan trainer or acco_hooks.ACCOHSDPOptimizer (docs/hsdp.md)"
        )
    if trainer.args.n_gpu > 1:
        raise ValueError(
            f"ACCOTrainer: this process sees {trainer.args.n_gpu} GPUs and the Trainer would use "
            "torch.nn.DataParallel. Launch one process per GPU: torchrun --nproc_per_node "
            f"{trainer.args.n_gpu} your_script.py"
        )
    if trainer.is_model_parallel or getattr(trainer, "is_distributed_loading_by_transformers", False):
        raise ValueError(
            "ACCOTrainer: the model is spread over several devices (device_map or "
            "from_pretrained(distributed_config=...)); ACCO needs one full replica per "
            "process. Load the model on one device (device_map=None) per process"
        )
    if getattr(trainer.accelerator, "parallelism_config", None) is not None:
        raise ValueError(
            "ACCOTrainer: accelerate's parallelism_config (tensor, context or sequence "
            "parallelism) is set; ACCO supports pure data parallelism here. Remove it"
        )
    optimizer_cls_and_kwargs(trainer, trainer.model)  # a bad TrainingArguments.optim fails now


class EvaluationBarrier:
    """Refuses, instead of hanging, an evaluation that only some ranks run during training.

    ``evaluate()`` gathers metrics from every rank, so a rank that calls it alone (a callback
    guarded by ``is_world_process_zero``) waits forever in the gather. Before evaluating, every
    rank meets the others at a gloo ``monitored_barrier`` on a group of its own, which gives up
    after ``timeout_s`` and names the ranks that never came. The group lives for one ``train()``
    call (``open`` / ``close``); outside it, evaluation is the plain Trainer's.
    """

    def __init__(self) -> None:
        self._group: Any = None

    def open(self) -> None:
        """Build the group; every rank calls it (at the start of ``train()``)."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")

    def check(self, what: str, timeout_s: float) -> None:
        """Meet every rank before ``what``; raise ``RuntimeError`` if one never comes."""
        if self._group is None:
            return
        try:
            dist.monitored_barrier(
                self._group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True
            )
        except RuntimeError as exc:
            raise RuntimeError(
                f"ACCOTrainer.{what}() during training must run on every rank (it gathers "
                f"metrics from all of them), but not every rank reached it within "
                f"{timeout_s:.0f} s (TrainingArguments.ddp_timeout): {exc}. Call it on every "
                "rank, not only where is_world_process_zero"
            ) from exc

    def close(self) -> None:
        """Destroy the group (every rank, at the end of ``train()``)."""
        group, self._group = self._group, None
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)
