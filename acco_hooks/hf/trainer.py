"""``ACCOTrainer``: the Hugging Face ``Trainer`` with the ACCO engine for DDP and the optimizer.

What changes from a plain ``Trainer`` (everything else is the Trainer's own: data loading and
per-rank sharding, the loss and its normalisation, mixed precision, evaluation, logging,
callbacks, checkpoint folders, ``resume_from_checkpoint``):

* **No DDP wrapper.** The model is prepared by ``accelerate`` for autocast/compile only; the
  engine broadcasts rank 0's weights when it is built and does the gradient reduction.
* **The optimizer is the engine.** ``create_optimizer`` builds an :class:`ACCOEngine` over the
  Trainer's two parameter groups (weight decay / none) with the optimizer class and keyword
  arguments of ``TrainingArguments.optim`` (or ``optimizer_cls_and_kwargs``). A
  post-accumulate-grad hook moves each gradient into the engine during backward, so ``.grad``
  holds nothing to clip (a placeholder that refuses to be read) and the Trainer's own clipping
  is the engine's: ``max_grad_norm`` goes to the engine, which clips the averaged gradient
  (global norm, on its shard).
* **Buffers** are rank 0's before each step's first forward, as DDP's ``broadcast_buffers``
  makes them (``_broadcast_buffers``).
* **One Trainer step is one round** of ``gradient_accumulation_steps`` micro-batches per rank.
  ``training_step`` counts each micro-batch with the engine; the round ends (and its
  communication starts on the engine's thread) with the step's last micro-batch.
* **Real updates and the LR schedule.** ``ddp`` and ``dpu`` update once per round; ``acco``
  once every other round. The scheduler named by ``lr_scheduler_type`` is built on the
  engine's shard optimizer for the number of *real updates* (``max_steps // 2`` in ``acco``),
  warm-up scaled alike, and the engine steps it after each real update.

Loss scaling: each micro-batch weighs the share of a unit that the Trainer's loss already
divides by (``_loss_weights``), so ``ddp`` mode takes exactly the update of a plain ``Trainer``
with DDP. Checkpoints: the engine state is a distributed checkpoint next to the model files,
which hold the real θ, and loads on another number of processes; the live parameters go along
when they differ (``_checkpoints``). ``docs/hf.md`` has the details and the measurements.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer, TrainerState
from transformers.trainer import TRAINER_STATE_NAME

from acco_hooks.engine import ACCOEngine, Mode, real_updates
from acco_hooks.hf._checkpoints import (
    ENGINE_DIR,
    ENGINE_FILE,
    LIVE_PARAMS_FILE,
    load_engine,
    save_engine,
    saved_layout,
)
from acco_hooks.hf._engine_optimizer import (
    EngineOptimizer,
    EngineSchedule,
    build_engine,
    optimizer_cls_and_kwargs,
)
from acco_hooks.hf._loss_weights import label_tokens, microbatch_weight
from acco_hooks.hf._refusals import (
    EvaluationBarrier,
    check_trainer_internals,
    refuse_after_init,
    refuse_before_init,
)
from acco_hooks.hf.arguments import ACCOArguments

__all__ = ["ACCOTrainer", "ENGINE_DIR", "ENGINE_FILE", "LIVE_PARAMS_FILE", "real_updates"]

logger = logging.getLogger(__name__)

check_trainer_internals()  # fail at import, not silently at train()


class ACCOTrainer(Trainer):
    r"""``transformers.Trainer`` whose data parallelism and optimizer are the ACCO engine.

    Launch it as any Trainer script (``torchrun --nproc_per_node N train.py``, CPU/gloo or
    CUDA/nccl); each process runs a full model replica on its shard of the data. The
    ``TrainingArguments`` keep their meaning: ``gradient_accumulation_steps`` micro-batches per
    round and Trainer step, ``max_steps``/``num_train_epochs`` count rounds, the learning rate and
    ``lr_scheduler_type`` advance once per real update (every other round in ``acco``),
    ``max_grad_norm`` clips the averaged gradient, logging, evaluation and checkpoint
    strategies, ``bf16``, seeds.

    Tuning: see :class:`ACCOArguments`. A real update in ``acco`` uses two rounds of
    gradients: at equal ``TrainingArguments``, ``acco`` makes half the updates of ``ddp``, each
    on twice the tokens. Compare them per token (the same data), or give ``ddp`` twice the
    ``gradient_accumulation_steps`` and half the ``max_steps`` for the same updates.

    .. warning::
        In ``acco`` mode the model holds the estimate θ̃ after every other step. Evaluation,
        checkpoints' model files and the model after ``train()`` are the real θ (the trainer
        swaps θ in and out); anything else that reads the model during training (a callback,
        ``trainer.model`` in ``on_step_end``) may see θ̃. Call ``trainer.optimizer.flush()`` to
        put θ in the model for good (the next round then computes at θ instead of θ̃).

    Args:
        *args, **kwargs: those of ``transformers.Trainer``. ``optimizers=(optimizer, scheduler)``
            is refused (the engine builds its own over a shard); pass
            ``optimizer_cls_and_kwargs=(torch.optim.AdamW, {...})`` to choose the optimizer.
        acco_args: the ACCO settings; default ``ACCOArguments()`` (``mode="acco"``).

    Raises:
        ValueError: at construction, for a combination the engine cannot serve (DeepSpeed,
            FSDP, fp16 loss scaling, DataParallel, ...), naming the setting and the fix.

    Example::

        >>> trainer = ACCOTrainer(model=model, args=TrainingArguments(output_dir="out",
        ...                       gradient_accumulation_steps=4, max_steps=1000, bf16=True),
        ...                       train_dataset=train, eval_dataset=val,
        ...                       acco_args=ACCOArguments(mode="acco"))
        >>> trainer.train()                 # torchrun --nproc_per_node 8 train.py
        >>> trainer.save_model("final")     # the real parameters θ
    """

    def __init__(self, *args: Any, acco_args: ACCOArguments | None = None, **kwargs: Any) -> None:
        acco_args = ACCOArguments() if acco_args is None else acco_args
        if not isinstance(acco_args, ACCOArguments):
            raise TypeError(
                f"ACCOTrainer: acco_args must be an acco_hooks.hf.ACCOArguments, got "
                f"{type(acco_args).__name__}"
            )
        bound = inspect.signature(Trainer.__init__).bind(None, *args, **kwargs).arguments
        refuse_before_init(bound.get("args"), acco_args, bound.get("optimizers"))
        self.acco_args = acco_args
        self._acco_max_steps: int | None = None
        self._acco_lr: float | None = None  # LR the latest round's gradients are applied with
        # The live parameters while a checkpoint is written, when they are not θ
        self._acco_live_params: dict[str, torch.Tensor] | None = None
        self._acco_rounds_since_log = 0
        self._acco_wait_since_log = 0.0
        self._acco_evaluation_barrier = EvaluationBarrier()
        # Whether the next forward takes rank 0's buffers first (BatchNorm's statistics), as
        # DDP's broadcast_buffers does without the DDP wrapper: the first forward of train()
        self._acco_broadcast_buffers_next = False
        super().__init__(*args, **kwargs)
        refuse_after_init(self)

    # --------------------------------------------------------------------------- the engine

    @property
    def engine(self) -> ACCOEngine | None:
        """The ACCO engine of the current ``train()`` call (``None`` outside of training)."""
        optimizer = getattr(self, "optimizer", None)
        return optimizer.engine if isinstance(optimizer, EngineOptimizer) else None

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any
    ) -> Any:
        self._acco_max_steps = max_steps
        if self.acco_args.mode == Mode.ACCO and max_steps % 2:
            logger.warning(
                "ACCOTrainer: max_steps=%d rounds is odd: in acco mode the last round computes "
                "at an estimate whose update never comes, its gradients are unused. Use an even "
                "number of steps.", max_steps,
            )  # fmt: skip
        return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        self._acco_max_steps = num_training_steps
        super().create_optimizer_and_scheduler(num_training_steps)

    def create_optimizer(self, model: nn.Module | None = None) -> EngineOptimizer:
        """Build the ACCO engine over the Trainer's parameter groups (the Trainer's optimizer)."""
        if self.optimizer is not None:
            return self.optimizer
        opt_model = self.model if model is None else model
        optimizer_cls, optimizer_kwargs = optimizer_cls_and_kwargs(self, opt_model)
        engine = build_engine(self, opt_model, optimizer_cls, optimizer_kwargs, self._max_rounds())
        self.optimizer = EngineOptimizer(engine)
        updates = real_updates(self.acco_args.mode, self._max_rounds())
        logger.info(
            "ACCOTrainer: mode=%s, the whole run: %d rounds of %d micro-batches per rank, %d "
            "real updates, on %s, optimizer %s", self.acco_args.mode, self._max_rounds(),
            self.args.gradient_accumulation_steps, updates, _ranks(engine.world_size),
            optimizer_cls.__name__,
        )  # fmt: skip
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> EngineSchedule:
        """The Trainer's view of the engine's scheduler (built with the engine)."""
        if self.lr_scheduler is None:
            self.lr_scheduler = EngineSchedule(self.optimizer)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def _max_rounds(self) -> int:
        if self._acco_max_steps is not None:
            return self._acco_max_steps
        if self.args.max_steps > 0:
            return self.args.max_steps
        raise RuntimeError(
            "ACCOTrainer: the number of training steps is not known yet; build the optimizer "
            "through train() or create_optimizer_and_scheduler(num_training_steps)"
        )

    def _wrap_model(
        self, model: nn.Module, training: bool = True, dataloader: Any = None
    ) -> nn.Module:
        if not training:
            return super()._wrap_model(model, training=training, dataloader=dataloader)
        if self.accelerator.unwrap_model(model, keep_torch_compile=False) is not model:
            return model  # already prepared by an earlier train() call
        # Autocast and torch.compile as configured, without accelerate's DDP wrapper: the
        # engine reduces the gradients. ``prepare_model`` marks the model prepared, so the
        # Trainer's later ``accelerator.prepare(model, optimizer)`` leaves it as it is. No device
        # placement: the Trainer placed the model before the engine took views of its
        # parameters, and ``model.to()`` may re-allocate them (it does under torch.distributed).
        return self.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)

    def _clip_grad_norm(self, model: nn.Module) -> float | None:
        """The engine clips; this is the norm of the latest averaged gradient it saw."""
        engine = self.engine
        return None if engine is None else engine.last_grad_norm

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        # ``.grad`` is empty: the engine measured the norm (also without clipping)
        return self._clip_grad_norm(model) if grad_norm is None else grad_norm

    def _get_learning_rate(self) -> float:
        if self._acco_lr is not None:
            return self._acco_lr
        return super()._get_learning_rate()

    # ------------------------------------------------------------------------ micro-batches

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """The Trainer's forward and backward; then the micro-batch is counted by the engine.

        The gradient went to the engine's accumulator during backward. The micro-batch's weight
        makes the engine's ``Σ gradients / Σ weights`` the average the Trainer's loss scaling
        means (see the module docstring). The step's last micro-batch ends the round: a short
        step (the last of an epoch) is padded with empty micro-batches, which weigh nothing.
        """
        engine = self.engine
        if engine is None:
            raise RuntimeError("ACCOTrainer.training_step runs inside train() only")
        items = label_tokens(self, inputs)  # before compute_loss consumes the inputs
        last = self.accelerator.sync_gradients
        if self._acco_broadcast_buffers_next:
            _broadcast_buffers(self.model)
        # DDP broadcasts before a forward that follows a synchronizing one: each step's first
        self._acco_broadcast_buffers_next = last and self.args.ddp_broadcast_buffers is not False
        engine.start_microbatch()  # the advisor's K: this forward and backward, not the loop's logging
        loss = super().training_step(model, inputs, num_items_in_batch)
        weight = microbatch_weight(self, items, num_items_in_batch)
        ended = engine.microbatch_done(weight) if weight > 0 else engine.skip_microbatch()
        while last and not engine.step_boundary:  # one round; in mode "auto" one update
            ended = engine.skip_microbatch()
        if ended:
            self._acco_rounds_since_log += 1
            self._acco_wait_since_log += engine.last_wait_s
            self._acco_lr = engine.last_round_lr  # the rate this round's gradients get
        return loss

    # --------------------------------------------------------------- logs and evaluation at θ

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        engine = self.engine
        if engine is not None and "loss" in logs:
            logs["acco/round"] = engine.round_index
            # Updates started (deterministic): the latest may still be communicating.
            logs["acco/real_updates"] = engine.updates_launched
            rounds = max(1, self._acco_rounds_since_log)
            logs["acco/comm_wait_s"] = self._acco_wait_since_log / rounds
            if engine.skipped_rounds:
                logs["acco/skipped_rounds"] = engine.skipped_rounds
            logs.update({f"acco/{name}": v for name, v in engine.advisor.figures.items()})
            self._acco_rounds_since_log, self._acco_wait_since_log = 0, 0.0
        super().log(logs, start_time)

    @contextlib.contextmanager
    def _real_parameters(self) -> Iterator[dict[str, torch.Tensor] | None]:
        """Within the block the model holds the real θ; after it, training goes on unchanged.

        Yields the live parameters the block replaced (``None`` when the model held θ
        already), for a checkpoint to save.
        """
        engine = self.engine
        if engine is None:
            yield None
            return
        with engine.real_weights() as live:
            yield live

    def _trainable_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """``Trainer.evaluate`` at the real parameters θ (the training trajectory is unchanged).
        During training a call that not every rank makes raises instead of hanging."""
        self._acco_evaluation_barrier.check("evaluate", self.args.ddp_timeout)
        with self._real_parameters():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.predict`` at the real parameters θ, on every rank (see :meth:`evaluate`)."""
        self._acco_evaluation_barrier.check("predict", self.args.ddp_timeout)
        with self._real_parameters():
            return super().predict(*args, **kwargs)

    # ------------------------------------------------------------------------- checkpoints

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        if self.engine is None:
            return super()._save_checkpoint(model, trial)
        with self._real_parameters() as live:  # the folder's model files hold θ
            self._acco_live_params = live
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self._acco_live_params = None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Every rank saves its part of the engine state; rank 0 the live parameters if they
        are not θ."""
        engine = self.engine
        if engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        save_engine(output_dir, engine, self._acco_live_params, self.args.should_save)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Restore the engine state (resharded onto another number of processes if need be)
        and, if saved, the live parameters."""
        if self.engine is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self._check_global_batch(checkpoint)
            load_engine(checkpoint, self.engine, self._trainable_named_parameters())
            updates = real_updates(self.acco_args.mode, self._max_rounds())
            logger.info(
                "ACCOTrainer: resumed from %s after %d of the run's %d real updates, on %s "
                "(saved by %s)", checkpoint, self.engine.num_updates, updates,
                _ranks(self.engine.world_size), _ranks((saved_layout(checkpoint) or (0,))[0]),
            )  # fmt: skip

    def _check_global_batch(self, checkpoint: str) -> None:
        """A resumed run on another number of processes must take the saved run's global batch
        (processes × gradient_accumulation_steps × per-device batch), or the data it skips and
        the updates it takes are another run's."""
        layout = saved_layout(checkpoint)
        state_file = os.path.join(checkpoint, TRAINER_STATE_NAME)
        if layout is None or not os.path.isfile(state_file):
            return  # load_engine names what is missing
        per_device = TrainerState.load_from_json(state_file).train_batch_size
        world, steps = layout
        if not per_device or not steps:
            return
        saved, this_world = world * steps * per_device, self.args.world_size
        local = self._train_batch_size * self.args.gradient_accumulation_steps
        if saved == this_world * local:
            return
        fits = saved // (this_world * self._train_batch_size)
        fix = (f"gradient_accumulation_steps={fits}"
               if fits * this_world * self._train_batch_size == saved
               else f"a number of processes that divides {saved}")  # fmt: skip
        raise ValueError(
            f"ACCOTrainer: {checkpoint} was saved by {world} processes × "
            f"gradient_accumulation_steps={steps} × per-device batch {per_device} = {saved} "
            f"samples per step; this run takes {this_world} × "
            f"{self.args.gradient_accumulation_steps} × {self._train_batch_size} = "
            f"{this_world * local}. Resume with the same global batch: {fix}"
        )

    # ---------------------------------------------------------------------- end of training

    def _finalize_training(self, trial: Any, num_train_samples: int, start_time: float) -> Any:
        self._close_engine(flush=True)  # the model holds θ before the best model may be loaded
        return super()._finalize_training(trial, num_train_samples, start_time)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; the engine is built for this call and closed at its end.

        A later ``train()`` builds a new engine from the model's weights: resume through
        ``resume_from_checkpoint`` to keep the optimizer state.
        """
        self._acco_evaluation_barrier.open()
        self._acco_broadcast_buffers_next = self.args.ddp_broadcast_buffers is not False
        try:
            return super().train(*args, **kwargs)
        finally:
            self._acco_evaluation_barrier.close()
            # After an exception (on this rank alone, maybe): quietly, and without waiting for
            # peers at a barrier; after success, _finalize_training closed it already.
            self._close_engine(flush=False)
            self.optimizer = None
            self.lr_scheduler = None
            self._acco_lr = None

    def _close_engine(self, flush: bool) -> None:
        optimizer = self.optimizer
        if not isinstance(optimizer, EngineOptimizer):
            return
        optimizer.close(flush=flush, barrier=flush)


def _broadcast_buffers(model: nn.Module) -> None:
    """Every rank's buffers become rank 0's, as DDP's ``broadcast_buffers`` makes them before a
    forward (the engine's groups belong to its thread: the default group, on this one)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    for buffer in model.buffers():
        dist.broadcast(buffer.detach(), src=0)


def _ranks(count: int) -> str:
    return f"{count} rank" if count == 1 else f"{count} ranks"
