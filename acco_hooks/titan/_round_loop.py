"""The ACCO trainer's round loop, shared by the torchtitan 0.2.2 and 0.3.0 adapters.

One training step is one ACCO round: micro-batches are run until the engine ends the round
(``accumulation_steps`` of them, or more with ``accumulate_until_ready``). The round's
communication (reduce-scatter -> shard step -> all-gather over ``dp_replicate``) then runs on
the engine's thread during the next step. Everything else is torchtitan's: model building,
tensor and pipeline parallelism, activation checkpointing, torch.compile, data loading,
metrics, validation and DCP checkpointing.

Loss scaling: torchtitan divides each micro-batch's token-summed loss by the global number of
valid tokens, which needs an all-reduce before the micro-batches run. The engine instead takes
token-summed gradients (``global_valid_tokens = 1``), with the valid tokens of each micro-batch
as its weight, and divides by their global sum. This is the same per-token average for DDP and
PP alike (torchtitan's PP schedule sums token losses).

A release's adapter mixes :class:`ACCOTrainerLoop` in before its ``Trainer`` and provides
:attr:`~ACCOTrainerLoop.titan_config` and :meth:`~ACCOTrainerLoop._next_microbatch`.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.tools.logging import logger

from acco_hooks.engine import real_updates
from acco_hooks.fsdp import fsdp_modules, set_gradient_sync_for_next_microbatch
from acco_hooks.titan._container import EngineContainer

__all__ = ["ACCOTrainerLoop"]

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]


class ACCOTrainerLoop:
    """The round loop, metrics and shutdown of ``ACCOTrainer`` (a mixin before ``Trainer``)."""

    optimizers: EngineContainer

    @property
    def titan_config(self) -> Any:
        """The run's torchtitan config (0.2.2's ``JobConfig``, 0.3.0's ``Trainer.Config``);
        both have ``acco``, ``training`` and ``parallelism``."""
        raise NotImplementedError

    def _next_microbatch(self, data_iterator: Iterator[Batch]) -> tuple[Any, Any, torch.Tensor]:
        """One ACCO micro-batch on the device: ``(input_dict, labels, valid_tokens)``, in the
        form ``forward_backward_step`` takes."""
        raise NotImplementedError

    def _validation_enabled(self) -> bool:
        raise NotImplementedError

    def _move_to_device(self, batch: Batch) -> Batch:
        input_dict, labels = batch
        for key, value in input_dict.items():
            if isinstance(value, torch.Tensor):
                input_dict[key] = value.to(self.device)
        return input_dict, labels.to(self.device)

    def _setup_acco(self) -> None:
        """After ``Trainer.__init__``: wrap checkpoint loading and validation, log the plan."""
        config = self.titan_config
        self.logged_losses: dict[int, float] = {}  # step -> global average loss, for the summary
        # HSDP: FSDP2 shards each replica; its gradient reduce-scatter is switched per micro-batch
        self._fsdp_modules = fsdp_modules(self.model_parts)
        # A step's metrics are all-reduced without waiting and logged at the start of the next
        # step: a blocking all-reduce per step would make a fast rank wait for the slowest one
        # every round, which is what accumulate_until_ready exists to avoid.
        self._pending_metrics: tuple | None = None
        load = self.checkpointer.load

        def load_then_sync_master(*args: Any, **kwargs: Any) -> Any:
            loaded = load(*args, **kwargs)
            if self.optimizers.engine.round_index == 0:
                # Model weights loaded without engine state (seed or pretrained checkpoint):
                # the master shard was copied from the freshly initialised model.
                self.optimizers.engine.reset_master_from_params()
            return loaded

        self.checkpointer.load = load_then_sync_master
        if self._validation_enabled():
            validate = self.validator.validate

            def validate_real_parameters(*args: Any, **kwargs: Any) -> Any:
                # θ, not the estimate θ̃, without applying the update in flight early
                with self.optimizers.engine.real_weights():
                    result = validate(*args, **kwargs)
                    # FSDP2 keeps a module unsharded after a forward it does not reshard after
                    # (the root's, by default) until a backward: without this the next training
                    # forward would reuse θ's unsharded copy instead of gathering θ̃.
                    for module in self._fsdp_modules:
                        module.reshard()
                    return result

            self.validator.validate = validate_real_parameters
        logger.info(
            f"ACCO: mode={config.acco.mode} rounds={config.training.steps} "
            f"real updates={real_updates(config.acco.mode, config.training.steps)} "
            f"micro-batches per round={self.optimizers.engine.accumulation_steps} "
            f"replicas (ACCO degree)={self.parallel_dims.dp_replicate} "
            f"FSDP shards per replica={self.parallel_dims.dp_shard}"
        )

    def train_step(self, data_iterator: Iterator[Batch]) -> None:
        self._log_pending_metrics()
        config = self.titan_config
        engine = self.optimizers.engine
        lr = engine.optimizer.param_groups[0]["lr"]
        one = torch.ones((), device=self.device)
        loss_sum = torch.zeros((), device=self.device)
        tokens = torch.zeros((), dtype=torch.int64)
        round_ended = False
        while not round_ended:
            if self._fsdp_modules:
                set_gradient_sync_for_next_microbatch(
                    engine, self._fsdp_modules, config.acco.fsdp_sync_every_microbatch
                )
            input_dict, labels, valid = self._next_microbatch(data_iterator)
            # global_valid_tokens = 1: backward of the token-summed loss (see module docstring).
            loss = self.forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=one
            )
            if isinstance(loss, DTensor):  # loss parallel under TP
                loss = loss.full_tensor()
            loss_sum += loss.detach().reshape(())
            tokens += valid
            if valid > 0:
                round_ended = engine.microbatch_done(weight=valid)
            else:  # nothing to learn from; keep the round count in step with the other ranks
                round_ended = engine.skip_microbatch()
        if self.step == config.training.steps:
            engine.flush()  # the final model (and a model-only last checkpoint) holds θ
        if self.metrics_processor.should_log(self.step):
            self._start_metrics(lr, loss_sum, tokens)
        if self.step == config.training.steps:
            # Now, not after torchtitan's shutdown (which sleeps): the last step's tps is right.
            self._log_pending_metrics()

    def _start_metrics(self, lr: float, loss_sum: torch.Tensor, tokens: torch.Tensor) -> None:
        """Launch this step's metric all-reduces over the loss mesh; log them next step."""
        parallel_dims = self.parallel_dims
        sums = torch.stack([loss_sum.double().cpu(), tokens.double(),
                            torch.tensor(float(self.ntokens_seen), dtype=torch.float64)])  # fmt: skip
        local_avg = (sums[0] / sums[1].clamp(min=1)).reshape(1)
        works = []
        if parallel_dims.dp_cp_enabled:
            group = parallel_dims.get_optional_mesh("loss").get_group()
            sums, local_avg = sums.to(self.device), local_avg.to(self.device)
            works = [dist.all_reduce(sums, group=group, async_op=True),
                     dist.all_reduce(local_avg, op=dist.ReduceOp.MAX, group=group, async_op=True)]  # fmt: skip
        engine = self.optimizers.engine
        self._pending_metrics = (
            self.step, lr, works, sums, local_avg,
            engine.last_grad_norm if engine.last_grad_norm is not None else -1.0,
            {"acco/round": engine.round_index, "acco/real_updates": engine.num_updates,
             "acco/microbatches": engine.last_round_microbatches,
             "acco/comm_wait_s": engine.last_wait_s,
             **{f"acco/{name}": value for name, value in engine.advisor.figures.items()}},
        )  # fmt: skip

    def _log_pending_metrics(self) -> None:
        if self._pending_metrics is None:
            return
        step, lr, works, sums, local_max, grad_norm, extra = self._pending_metrics
        self._pending_metrics = None
        for work in works:
            work.wait()
        has_loss = not self.parallel_dims.pp_enabled or self.pp_has_last_stage
        global_avg = float(sums[0] / sums[1].clamp(min=1)) if has_loss else -1.0
        global_max = float(local_max) if has_loss else -1.0
        self.logged_losses[step] = global_avg
        self.metrics_processor.log(step, global_avg, global_max, grad_norm,
                                   extra_metrics={"n_tokens_seen": int(sums[2]), "lr": lr, **extra})  # fmt: skip

    def train(self) -> None:
        start = time.perf_counter()
        super().train()
        self._log_pending_metrics()
        engine, losses = self.optimizers.engine, list(self.logged_losses.values())
        if losses and losses[0] >= 0:
            tail = max(1, len(losses) // 10)
            logger.info(
                f"summary: mode={self.titan_config.acco.mode} "
                f"data_parallel={self.parallel_dims.dp_replicate} rounds={engine.round_index} "
                f"updates={engine.num_updates} tokens_per_rank={self.ntokens_seen} "
                f"first_loss={losses[0]:.4f} last_loss={losses[-1]:.4f} "
                f"mean_loss_last_{tail}_steps={sum(losses[-tail:]) / tail:.4f} "
                f"time={time.perf_counter() - start:.1f}s fsdp_shards={self.parallel_dims.dp_shard}"
            )

    def close(self, *, barrier: bool = True) -> None:
        """torchtitan's ``close()``, after closing the engine (see ``ACCOEngine.close``)."""
        if hasattr(self, "optimizers") and isinstance(self.optimizers, EngineContainer):
            self.optimizers.close(flush=barrier, barrier=barrier)
        super().close()
