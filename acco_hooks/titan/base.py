"""What ACCO adds to torchtitan, written once for both releases: the optimizer container that
holds the engine, and the trainer whose training step is one ACCO round.

Each release's adapter (``v022``, ``v030``) subclasses these two and adds only how that
release builds them: where the ``[acco]`` section lives in its config, how the container and
the LR schedulers are built from it, and how a micro-batch comes out of its dataloader.

**The container** (:class:`EngineOptimizersContainer`) is built in two steps, as torchtitan
hands an optimizer container its inputs: the constructor takes the model parts, the optimizer
and the engine's settings (from the optimizer config); :meth:`~EngineOptimizersContainer.bind`
takes the meshes (``parallel_dims``) and builds the engine over them. 0.2.2's builder
function receives both at once and calls both; 0.3.0 builds the container from its config,
then gives the meshes to the model spec's ``post_optimizer_build_fn``, which binds it.

**The trainer** (:class:`ACCOTrainerBase`). One training step is one ACCO round: micro-batches
are run until the engine ends the round (``accumulation_steps`` of them, or more with
``accumulate_until_ready``). The round's communication (reduce-scatter -> shard step ->
all-gather over ``dp_replicate``) then runs on the engine's thread during the next step.
Everything else is torchtitan's: model building, tensor and pipeline parallelism, activation
checkpointing, torch.compile, data loading, metrics, validation and DCP checkpointing.

Loss scaling: torchtitan divides each micro-batch's token-summed loss by the global number of
valid tokens, which needs an all-reduce before the micro-batches run. The engine instead takes
token-summed gradients (``global_valid_tokens = 1``), with the valid tokens of each micro-batch
as its weight, and divides by their global sum. This is the same per-token average for DDP and
PP alike (torchtitan's PP schedule sums token losses).
"""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from acco_hooks._frontend import label_tokens
from acco_hooks.engine import ACCOEngine, EngineSettings, real_updates
from acco_hooks.fsdp import fsdp_modules, set_gradient_sync_for_next_microbatch
from acco_hooks.titan import TITAN_030, flag
from acco_hooks.titan.dataloader import ReshardableLoaderState
from acco_hooks.titan.titan_checkpoint import (
    LIVE_KEY,
    STATE_KEY,
    CheckpointRefusal,
    states_to_load,
)

# isort: split
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.tools.logging import logger

if TITAN_030:
    from torchtitan.trainer import Trainer
else:
    from torchtitan.train import Trainer

__all__ = ["ACCOTrainerBase", "Batch", "EngineOptimizersContainer", "LIVE_KEY",
           "OPTIMIZER_CLASSES", "STATE_KEY", "WHOLE_PARAMETER_CLASSES", "WithoutReplicate"]  # fmt: skip

OPTIMIZER_CLASSES = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}
# torchtitan 0.3.0's optimizers that the engine steps on whole parameters, by the torch class
# it runs: DistMuon computes torch's Muon (its momentum, Newton-Schulz iteration and learning
# rate adjustment), distributed by the engine instead of by FlexShard
WHOLE_PARAMETER_CLASSES = {"DistMuon": torch.optim.Muon, "Muon": torch.optim.Muon}

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]


class WithoutReplicate:
    """A ``ParallelDims`` view without the ``dp_replicate`` dimension (0.2.2, and 0.3.0's
    ``partial_dtensor`` backend).

    A model's parallelize function handed this view applies no DDP (0.2.2) and FSDP over the
    ``fsdp`` mesh alone instead of HSDP over ``["dp_replicate", "fsdp"]``: everything but the
    cross-replica data parallelism, which is the engine's.
    """

    def __init__(self, parallel_dims: Any) -> None:
        self._parallel_dims = parallel_dims

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parallel_dims, name)

    dp_replicate_enabled = False


class EngineOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizer container with the ACCO engine inside.

    Iterating the container yields the engine's shard optimizer, so torchtitan's LR schedulers
    are built on it; the engine steps them once per real update. Gradients are moved into the
    engine by post-accumulate-grad hooks; the training loop ends micro-batches with
    ``self.engine.microbatch_done(weight)`` instead of calling ``step()``.

    **Note**
    The state dict is this rank's engine state, whose shards DCP saves from every rank, and the
    live parameters the next round computes at (``ACCOEngine.live_state_dict``): the trainer
    saves the model inside ``real_weights()``, so a checkpoint's model is θ for whatever reads
    it, and a resume puts the live parameters back.

    **Limitations**
    Resuming needs the same world size and parallelism (the engine refuses otherwise).

    Args:
        model_parts: the model parts of this rank (several with pipeline parallelism).
        optimizer_class: ``torch.optim.Adam`` or ``AdamW``, stepped on the shard.
        optimizer_kwargs: its keyword arguments (``lr``, ``betas``, ...).
        settings: the engine's settings (what ``acco_hooks.titan.config.validate_acco`` built).
        param_groups: torchtitan 0.3.0's ``optimizer.param_groups`` as ``(pattern, class,
            keyword arguments)``: each trained parameter goes to the first pattern its name
            matches (``re.search``), as torchtitan assigns them; ``None``: one group of every
            parameter, stepped by ``optimizer_class`` with ``optimizer_kwargs``.
    """

    engine: ACCOEngine

    def __init__(
        self,
        model_parts: list[nn.Module],
        optimizer_class: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
        settings: EngineSettings,
        param_groups: list[tuple[str, type[torch.optim.Optimizer], dict[str, Any]]] | None = None,
    ) -> None:
        self.model_parts = model_parts
        self.optimizers = []  # the engine's shard optimizer, once bound
        self._engine_plan = (optimizer_class, optimizer_kwargs, settings, param_groups)
        params = [p for m in model_parts for p in m.parameters() if p.requires_grad]
        # What torchtitan's own containers do last: the torch.optim.Optimizer machinery (hooks)
        torch.optim.Optimizer.__init__(self, params, dict(optimizer_kwargs))

    def bind(
        self, parallel_dims: Any, manager: Any = None, lr_scheduler: Any = None,
        replica_groups: int | None = None,
    ) -> None:  # fmt: skip
        """Build the engine over every trainable parameter, across the ``dp_replicate`` mesh
        (with ``manager``, a ``torchft.Manager``: across torchft replica groups too, the first
        round waiting for the ``replica_groups`` the job is launched with), with
        the LR schedulers ``lr_scheduler(shard_optimizer)`` builds (or, later,
        :meth:`attach_lr_schedulers`)."""
        optimizer_class, optimizer_kwargs, settings, param_groups = self._engine_plan
        named = self.trained_parameters()
        if param_groups is not None:
            named = _assign_to_groups(named, param_groups)
        # With TP or PP a rank holds only part of the model: the gradient norm is summed over
        # every rank (each counts its shard of its part; replicated tensors count once).
        model_parallel = parallel_dims.tp_enabled or parallel_dims.pp_enabled
        self.engine = ACCOEngine(
            named, optimizer_class, settings=settings,
            process_group=_replica_group(parallel_dims),
            # FSDP: each rank's parameters are its fsdp shard, gradients FSDP-summed over it.
            fsdp_process_group=(
                _shard_group(parallel_dims) if parallel_dims.dp_shard_enabled else None
            ),
            norm_process_group=dist.group.WORLD if model_parallel else None,
            manager=manager, replica_groups=replica_groups, lr_scheduler=lr_scheduler,
            **optimizer_kwargs,
        )  # fmt: skip
        self.manager = manager
        self.optimizers = [self.engine.optimizer]
        # No placeholders in .grad: torchtitan's loop reads no gradient, and the zero-bubble
        # pipeline schedules write .grad themselves
        self.engine.hook_param_grads(placeholders=False)

    def trained_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The trainable parameters of every model part by name: what the engine trains."""
        return [(name, p) for m in self.model_parts for name, p in m.named_parameters()
                if p.requires_grad]  # fmt: skip

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"{type(self).__name__}.step(): the ACCO engine ends rounds itself; call "
            "engine.microbatch_done(weight) after each micro-batch (ACCOTrainer does)"
        )

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        """No-op: gradients live in the engine."""

    def state_dict(self) -> dict[str, Any]:
        # One key for every rank: the engine's shards are DTensors over the replicas, which
        # DCP saves rank by rank and reshards at a load (ACCOEngine.state_dict).
        return {STATE_KEY: self.engine.state_dict(), LIVE_KEY: self.engine.live_state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if STATE_KEY not in state_dict:
            raise ValueError(
                f"the checkpoint has no ACCO engine state ({STATE_KEY}); it was saved by a run "
                "without [acco] enable, or by an acco_hooks before state version 3"
            )
        self.engine.load_state_dict(state_dict[STATE_KEY])
        # The live parameters replace θ in the model once the model's entry is loaded, which
        # torchtitan 0.3.0 does after this call (0.2.2 before it): the trainer's load wrapper
        # calls restore_live_parameters() when the whole checkpoint is in.
        self._live_to_restore = state_dict[LIVE_KEY]

    def restore_live_parameters(self) -> None:
        """Put the loaded checkpoint's live parameters into the model (after its θ); a no-op
        when nothing was loaded since the last call."""
        live, self._live_to_restore = getattr(self, "_live_to_restore", None), None
        if live is not None:
            self.engine.load_live_state_dict(live)

    def take_assigned_grads(self) -> None:
        """Hand the engine every gradient that reached ``.grad`` without its hook.

        The zero-bubble pipeline schedules (``ZBVZeroBubble``, ``InterleavedZeroBubble``) split
        a backward into an input pass and a later weight pass, and the weight pass
        (``torch.distributed.pipelining``'s ``stage_backward_weight``) assigns ``weight.grad``
        by hand, so the post-accumulate-grad hooks that move gradients into the engine never
        fire for it. The trainer calls this after each pipeline schedule step; under any other
        schedule (and under FSDP, which runs the hooks itself) nothing is left in ``.grad``.
        """
        engine = self.engine
        for param in engine.params:
            if param.grad is not None:
                engine.accumulate_grad(param, param.grad)
                param.grad = None

    def close(self, *, flush: bool = True, barrier: bool = True) -> None:
        """Apply or drop the update in flight, join the engine's thread, destroy its groups
        and remove its gradient hooks (see ``ACCOEngine.close``)."""
        self.engine.close(flush=flush, barrier=barrier)
        if getattr(self, "manager", None) is not None:  # built by this container's builder
            self.manager.shutdown(wait=False)
            self.manager = None

    def attach_lr_schedulers(self, schedulers: Any) -> Any:
        """Let the engine step ``schedulers`` after each real update; return them."""
        self.engine.lr_scheduler = schedulers
        return schedulers


def _replica_group(parallel_dims: Any) -> Any:
    """The group ACCO runs across: the ``dp_replicate`` mesh, or this rank alone.

    With one replica (``data_parallel_replicate_degree = 1``, no FSDP) there is no data-parallel
    traffic; the rounds, the shard step and the estimate still run, which is what a comparison
    with plain torchtitan on one GPU measures.
    """
    if parallel_dims.dp_replicate_enabled:
        return parallel_dims.get_mesh("dp_replicate")
    alone, _ = dist.new_subgroups(group_size=1)  # every rank builds every 1-rank group
    return alone


def _shard_group(parallel_dims: Any) -> Any:
    """The mesh FSDP shards over inside a replica: ``fsdp`` (0.2.2; 0.3.0's ``partial_dtensor``
    backend) or ``dp_shard`` (0.3.0's ``spmd_types``, which has no ``fsdp`` mesh)."""
    if getattr(parallel_dims, "spmd_backend", "partial_dtensor") == "spmd_types":
        return parallel_dims.get_mesh("dp_shard")
    return parallel_dims.get_mesh("fsdp")


# DCP's planner, before it reads anything: a key of this run that the checkpoint lacks, or holds
# in another size. With the engine's key, it means another tensor or pipeline parallel layout:
# the engine's keys name the mesh coordinates of every dimension but the data-parallel ones.
_DCP_KEY_MISMATCH = re.compile(
    rf"(?:Missing key in checkpoint state_dict: |Size mismatch between saved .*? for )"
    rf"(\S*{STATE_KEY}\S*?)\.?$", re.MULTILINE,
)


def refuse_other_model_layout(error: BaseException, parallel_dims: Any) -> None:
    """Raise ACCO's own error, naming the fix, for a checkpoint load that failed because the
    engine state was saved with another tensor or pipeline parallel degree; else return.

    DCP refuses such a load while it plans it, before any tensor is read, with a raw
    ``Missing key`` or ``Size mismatch`` for one of the engine's keys. The engine state
    reshards across data-parallel replicas and FSDP degrees, not across these.
    """
    found = _DCP_KEY_MISMATCH.search(str(error))
    if found is None and f"Missing key in checkpoint state_dict: optimizer.{LIVE_KEY}" in str(error):
        raise CheckpointRefusal(
            "ACCO: this checkpoint was saved by an acco_hooks that kept the live parameters "
            "(θ̃) in its model entry instead of beside it (engine state version 4): resume it "
            f"with that acco_hooks, or start from its weights alone "
            f"({flag('checkpoint.initial_load_path')} with "
            f"{flag('checkpoint.initial_load_model_only')})"
        ) from None
    if found is None:
        return
    raise CheckpointRefusal(
        f"ACCO: this checkpoint was saved with another tensor or pipeline parallel layout than "
        f"this run's (tensor_parallel_degree = {parallel_dims.tp}, pipeline_parallel_degree = "
        f"{parallel_dims.pp}), or by another model: its ACCO engine state has no "
        f"{found.group(1)} of the size this run needs. The engine state reshards across "
        "data-parallel replicas and FSDP degrees only: resume with the tensor_parallel_degree "
        "and pipeline_parallel_degree it was saved with"
    ) from None


class ACCOTrainerBase(Trainer):
    """torchtitan's ``Trainer`` whose training step is one ACCO round.

    A release's adapter subclasses it with its config surgery before ``super().__init__`` and
    provides :attr:`titan_config`; 0.3.0's also :meth:`_next_microbatch` under pipeline
    parallelism.
    """

    optimizers: EngineOptimizersContainer

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        acco = self.titan_config.acco
        engine = self.optimizers.engine
        # The engine's round size was resolved from the config before torchtitan built
        # anything (titan.config.validate_acco); torchtitan's own count must agree. Across
        # torchft replica groups (0.2.2's [fault_tolerance]) the global batch spans the groups,
        # which torchtitan's Trainer does not count.
        ft = getattr(self.titan_config, "fault_tolerance", None)
        groups = ft.group_size if ft is not None and ft.enable else 1
        expected = acco.accumulation_steps or self.gradient_accumulation_steps // groups
        if engine.settings.accumulation_steps != expected:
            raise RuntimeError(
                f"ACCO: the engine runs {engine.settings.accumulation_steps} micro-batches per "
                f"round where torchtitan counts {expected}; set [acco] accumulation_steps "
                "explicitly"
            )
        self.logged_losses: dict[int, float] = {}  # step -> global average loss, for the summary
        # A torchft replica group that joined a running job holds a live group's state, at its
        # round (0 otherwise: a checkpoint, if any, loads later): the trainer counts its steps
        # from there (rounds; in auto updates), and the data loader reads on to the live
        # groups' position first.
        self.step = engine.updates_launched if acco.mode == "auto" else engine.round_index
        self._microbatches_to_read_on = engine.microbatches_scheduled
        # HSDP: FSDP2 shards each replica; its gradient reduce-scatter is switched per micro-batch
        self._fsdp_modules = fsdp_modules(self.model_parts)
        # A step's metrics are all-reduced without waiting and logged at the start of the next
        # step: a blocking all-reduce per step would make a fast rank wait for the slowest one
        # every round, which is what accumulate_until_ready exists to avoid.
        self._pending_metrics: tuple | None = None
        load = self.checkpointer.load

        def load_then_sync_master(*args: Any, **kwargs: Any) -> Any:
            if engine.joined_round is not None:
                # A torchft replica group that joined a running job holds a live group's state:
                # its own checkpoint, from before it was lost, would overwrite it
                if self.checkpointer.enable:
                    logger.warning(
                        "ACCO: this replica group joined a running job at round %d with a live "
                        "group's state; its own checkpoint is not loaded", engine.joined_round,
                    )  # fmt: skip
                return False
            # torchtitan's lr_scheduler entry is the engine's scheduler, whose state the
            # engine's own entry (under optimizer) carries too: a schedule torchtitan was told
            # to restart (exclude_from_loading lr_scheduler) must stay as built.
            schedule = engine.lr_scheduler
            excluded = getattr(self.checkpointer, "exclude_from_loading", ())  # off: unset
            restart = "lr_scheduler" in excluded and schedule is not None
            as_built = copy.deepcopy(schedule.state_dict()) if restart else None
            try:
                loaded = load(*args, **kwargs)
            except BaseException as error:  # DCP's CheckpointException is a BaseException
                refuse_other_model_layout(error, self.parallel_dims)
                raise
            if as_built is not None:
                schedule.load_state_dict(as_built)
            if engine.round_index == 0:
                # Model weights loaded without engine state (seed or pretrained checkpoint):
                # the master shard was copied from the freshly initialised model.
                engine.reset_master_from_params()
            self.optimizers.restore_live_parameters()
            return loaded

        self.checkpointer.load = load_then_sync_master
        save = self.checkpointer.save

        def save_real_parameters(curr_step: int, last_step: bool = False) -> Any:
            # torchtitan calls save() after every step; it writes at checkpoint steps only.
            # θ is the update in flight: waiting for it at every step would serialise the
            # update round's communication with the next round's compute (acco's update
            # rounds then overlapped nothing: 0.77 s against 0.27 s for an estimate round on
            # a 650 Mbit/s link). 0.3.0's torch_checkpointing backend writes nothing yet.
            should_save = getattr(self.checkpointer, "_should_save", None)
            writes = getattr(self.checkpointer, "enable", False) and (
                should_save is None or should_save(curr_step, last_step)
            )
            if not writes:
                return save(curr_step, last_step=last_step)
            # θ in the checkpoint's model, for whatever reads it (an initial_load_path, an
            # export, an evaluation); the optimizer entry holds the live parameters beside it
            with engine.real_weights():
                saved = save(curr_step, last_step=last_step)
                # async_with_pinned_mem stages after save() returns: the block may end (and
                # the live parameters come back) only once the staging copy holds θ
                self.checkpointer.maybe_wait_for_staging()
                return saved

        self.checkpointer.save = save_real_parameters
        # (0.3.0's torch_checkpointing backend has none: a checkpoint of its own format)
        dcp_load = getattr(self.checkpointer, "dcp_load", None)
        if dcp_load is not None:

            def load_torchtitans_own_too(states: dict, checkpoint_id: Any, *args, **kwargs):
                # A checkpoint of torchtitan's own trainer keeps the optimizer's state by
                # parameter and each data-parallel rank's position apart: read as ACCO's own
                states = states_to_load(states, checkpoint_id, engine,
                                        self.optimizers.trained_parameters(), acco.mode)  # fmt: skip
                return dcp_load(states, checkpoint_id, *args, **kwargs)

            self.checkpointer.dcp_load = load_torchtitans_own_too
        # The data loader's state must load on another number of replicas too (elastic
        # restarts): torchtitan's refuses to.
        states = getattr(self.checkpointer, "states", None)  # absent when checkpoints are off
        if states is not None and hasattr(states.get("dataloader"), "dp_world_size"):
            states["dataloader"] = ReshardableLoaderState(states["dataloader"])
        if getattr(self, "validator", None) is not None:  # built when validation is enabled
            validate = self.validator.validate

            def validate_real_parameters(*args: Any, **kwargs: Any) -> Any:
                # θ, not the estimate θ̃, without applying the update in flight early
                with engine.real_weights():
                    result = validate(*args, **kwargs)
                    # FSDP2 keeps a module unsharded after a forward it does not reshard after
                    # (the root's, by default) until a backward: without this the next training
                    # forward would reuse θ's unsharded copy instead of gathering θ̃.
                    for module in self._fsdp_modules:
                        module.reshard()
                    return result

            self.validator.validate = validate_real_parameters
        steps = self.titan_config.training.steps
        logger.info(
            f"ACCO: mode={acco.mode} rounds={steps} "
            f"real updates={real_updates(acco.mode, steps)} "
            f"micro-batches per round={engine.settings.accumulation_steps} "
            f"replicas (ACCO degree)={self.parallel_dims.dp_replicate} "
            f"{f'in each of {groups} torchft replica groups ' if groups > 1 else ''}"
            f"FSDP shards per replica={self.parallel_dims.dp_shard}"
        )

    @property
    def titan_config(self) -> Any:
        """The run's torchtitan config (0.2.2's ``JobConfig``, 0.3.0's ``Trainer.Config``);
        both have ``acco``, ``training`` and ``parallelism``."""
        raise NotImplementedError

    def _next_microbatch(self, data_iterator: Iterator[Batch]) -> tuple[Any, Any, torch.Tensor]:
        """One ACCO micro-batch on the device: ``(input_dict, labels, valid_tokens)``, in the
        form ``forward_backward_step`` takes: one batch of ``local_batch_size`` (under 0.2.2's
        pipeline parallelism its schedule splits it into micro-batches)."""
        input_dict, labels = self._move_to_device(next(data_iterator))
        return input_dict, labels, label_tokens(labels, IGNORE_INDEX)

    def _move_to_device(self, batch: Batch) -> Batch:
        input_dict, labels = batch
        for key, value in input_dict.items():
            if isinstance(value, torch.Tensor):
                input_dict[key] = value.to(self.device)
        return input_dict, labels.to(self.device)

    def train_step(self, data_iterator: Iterator[Batch]) -> None:
        self._log_pending_metrics()
        # The round end writes the parameters and the engine's shards: an asynchronous
        # checkpoint's staging copy of them must be done (torchtitan waits before its step)
        self.checkpointer.maybe_wait_for_staging()
        config = self.titan_config
        engine = self.optimizers.engine
        for _ in range(self._microbatches_to_read_on):  # a group that joined a running job
            next(data_iterator)
        self._microbatches_to_read_on = 0
        lr = engine.optimizer.param_groups[0]["lr"]
        one = torch.ones((), device=self.device)
        loss_sum = torch.zeros((), device=self.device)
        tokens = torch.zeros((), dtype=torch.int64)
        step_ended = False  # a step is one round; in mode "auto" one update (one or two rounds)
        while not step_ended:
            if self._fsdp_modules:
                set_gradient_sync_for_next_microbatch(
                    engine, self._fsdp_modules, config.acco.fsdp_sync_every_microbatch
                )
            # the advisor's K starts here: the data and the compute, not the step end's
            # metrics, which wait behind the round on a slow link
            engine.start_microbatch()
            input_dict, labels, valid = self._next_microbatch(data_iterator)
            # global_valid_tokens = 1: backward of the token-summed loss (see module docstring).
            loss = self.forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=one
            )
            if self.parallel_dims.pp_enabled:  # a zero-bubble schedule's weight pass
                self.optimizers.take_assigned_grads()
            if isinstance(loss, DTensor):  # loss parallel under TP
                loss = loss.full_tensor()
            loss_sum += loss.detach().reshape(())
            tokens += valid
            if valid > 0:
                engine.microbatch_done(weight=valid)
            else:  # nothing to learn from; keep the round count in step with the other ranks
                engine.skip_microbatch()
            step_ended = engine.step_boundary
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
                f"summary: mode={engine.settings.mode} "
                f"data_parallel={self.parallel_dims.dp_replicate} rounds={engine.round_index} "
                f"updates={engine.num_updates} tokens_per_rank={self.ntokens_seen} "
                f"first_loss={losses[0]:.4f} last_loss={losses[-1]:.4f} "
                f"mean_loss_last_{tail}_steps={sum(losses[-tail:]) / tail:.4f} "
                f"time={time.perf_counter() - start:.1f}s fsdp_shards={self.parallel_dims.dp_shard}"
            )
        # What this rank's engine holds, by the categories of docs/torchtitan.md's memory table
        # (benchmarks/fake_rank.py holds it against benchmarks/memory_8b.py's prediction)
        logger.info("ACCO engine memory per rank (MiB): " + " ".join(
            f"{name}={size / 2**20:.2f}" for name, size in engine.memory_bytes().items()))  # fmt: skip

    def close(self, *, barrier: bool = True) -> None:
        """torchtitan's ``close()``, after closing the engine (see ``ACCOEngine.close``)."""
        optimizers = getattr(self, "optimizers", None)
        if isinstance(optimizers, EngineOptimizersContainer) and hasattr(optimizers, "engine"):
            optimizers.close(flush=barrier, barrier=barrier)
        super().close()


def _assign_to_groups(
    named: list[tuple[str, nn.Parameter]],
    param_groups: list[tuple[str, type[torch.optim.Optimizer], dict[str, Any]]],
) -> list[dict[str, Any]]:
    """The engine's parameter groups: each parameter in the first group whose pattern its name
    matches, as torchtitan 0.3.0 assigns them; a group names its class."""
    groups, claimed = [], set()
    for pattern, optimizer_class, kwargs in param_groups:
        matcher = re.compile(pattern)
        members = [(n, p) for n, p in named if n not in claimed and matcher.search(n)]
        if not members:
            raise ValueError(f"optimizer.param_groups: the pattern {pattern!r} matched no "
                             "trained parameter of this rank's model")  # fmt: skip
        claimed.update(n for n, _ in members)
        groups.append({"params": members, "optimizer_class": optimizer_class, **kwargs})
    missing = [n for n, _ in named if n not in claimed]
    if missing:
        raise ValueError(
            f"optimizer.param_groups: {', '.join(missing[:3])}"
            + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            + " match(es) no pattern: end the groups with the catch-all pattern '.*'"
        )
    return groups
