"""The ACCO engine: the round schedule of a sharded (ZeRO-1) optimizer that overlaps communication.

This module is the one place where the algorithm's schedule lives; the front-ends
(``ACCOOptimizer``, the DDP hook, the torchtitan and Hugging Face trainers) only build its
settings, feed it gradients and call :meth:`ACCOEngine.microbatch_done`. The contract is
``docs/algorithm.md``. Beside it in this folder: ``settings`` (every setting, its
allowed values and its check), ``buffers`` (each group's padded vector and its memory), ``layout``
(where a group's parameters lie in that vector: flat, or each whole on one rank),
``communication`` (the thread, its process groups and the job it runs each round),
``collectives``, ``peek`` (the estimate step), ``shard_optimizer`` (which optimizers can step
the shards), ``ownership`` (one engine per parameter), ``rounds`` (which schedule the rounds
follow, where they are and what the update under way weighs: :attr:`ACCOEngine.rounds`),
``state`` (what a rank's state is, how it is saved, checked and loaded), ``placement`` (where
its shards sit in the model) and ``replicas`` (the sum over torchft replica groups).

The round timeline (``acco`` mode; G̃ is computed at the estimate θ̃, G at the real θ)::

    round   compute side (main thread)   communication side (worker thread)         live after
    -----   -------------------------    -----------------------------------------  ----------
      0     acc = G̃_0 at θ_0             (nothing in flight)                        θ_0
      1     acc = G_0 at θ_0             θ̃_1 = Peek(θ_0, ΣG̃_0 / Σc̃_0); keep ΣG̃_0     θ̃_1
      2     acc = G̃_1 at θ̃_1             θ_1 = Opt(θ_0, (ΣG̃_0 + ΣG_0) / Σ(c̃_0+c_0))  θ_1
      3     acc = G_1 at θ_1             θ̃_2 = Peek(θ_1, ΣG̃_1 / Σc̃_1); keep ΣG̃_1     θ̃_2
      …

Follow one gradient. ``backward()`` produces it; a post-accumulate-grad hook adds it to the
fp32 accumulator (:meth:`ACCOEngine.accumulate_grad`) and leaves in ``.grad`` a placeholder
that refuses to be read (``ownership``: the loop must not clip what it cannot see). The
front-end then calls :meth:`~ACCOEngine.microbatch_done`, which counts the micro-batch; the
round ends after ``accumulation_steps`` of them (or later, with ``accumulate_until_ready``,
while the previous round still communicates, up to ``max_microbatches_per_round``). At the round end
(:meth:`~ACCOEngine._end_round`) the main thread

1. waits for the communication launched at the end of the previous round and copies its
   all-gathered result into the model: it becomes the live parameters of the next round;
2. copies the accumulator into the communication buffer and zeroes it (in ``acco`` the
   estimate round's job keeps its reduce-scattered sum ΣG̃ on the shard side, and the update
   round's job adds it: every update averages two rounds of gradients);
3. hands that payload to the worker thread: reduce-scatter -> divide by the global weight ->
   clip -> step (or Peek) this rank's 1/N fp32 master shard -> all-gather
   (``communication.communicate``);
4. returns at once: the next round's micro-batches run while the network works.

``dpu`` does the same with a real step every round and no carry; ``ddp`` waits for its own
payload at once (synchronous ZeRO-1).

Around the schedule, in the order of the class: the real weights θ (``flush()``,
``real_weights()``), checkpoints (``state_dict()``: DTensor shards that DCP reshards onto another
number of data-parallel ranks; the format and its checks are ``state``'s) and closing
(``close()``, which joins the thread and destroys its groups).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.profiler import record_function

from acco_hooks.engine import ownership
from acco_hooks.engine.advisor import Advisor, MicrobatchClock
from acco_hooks.engine.buffers import (
    build_shard,
    is_dtensor,
    local_tensor,
    memory_bytes,
    normalize_param_groups,
)
from acco_hooks.engine.communication import (
    ACCOCommunicationError,
    CommWorker,
    EngineGroups,
    Job,
    RoundPlan,
    RoundResult,
    all_gather_shards,
    barrier_each,
    broadcast_from_first_rank,
    build_engine_groups,
    communicate,
    gather_whole_masters,
    release_communication,
    round_weights,
)
from acco_hooks.engine.layout import ShardLayout
from acco_hooks.engine.peek import has_functional_peek
from acco_hooks.engine.placement import ShardPlacement
from acco_hooks.engine.replicas import GroupFellBehind, ReplicaGroups, describe_replica_group
from acco_hooks.engine.rounds import RoundState, estimate_formats, name_some, wire_fraction
from acco_hooks.engine.schedule import Schedule
from acco_hooks.engine.settings import EngineSettings, Mode
from acco_hooks.engine.shard_optimizer import (
    ShardStateLayout,
    check_optimizers,
    constructor_kwargs,
)
from acco_hooks.engine.state import (
    StateParts,
    handover_state,
    load_handover,
    load_live_parameters,
    load_optimizer_state_by_name,
    load_state,
    save_live_parameters,
    save_state,
)
from acco_hooks.engine.wire import WIRE_FORMATS

__all__ = ["ACCOEngine"]

logger = logging.getLogger(__name__)


class RoundInFlight:
    """A round whose communication was launched and whose result is not applied yet."""

    __slots__ = ("future", "plan", "round_index", "seen")

    def __init__(self, future: Future, plan: RoundPlan, round_index: int) -> None:
        self.future = future  # of the job's RoundResult (None for a re-gather after a load)
        # what the job does: its result is a real update θ or an estimate θ̃ (plan.job); with a
        # narrow estimate's format (plan.wire) it is θ̃ − θ, added to θ
        self.plan = plan
        self.round_index = round_index  # the round whose gradients it communicates
        self.seen = False  # its RoundResult was read (counted) already, e.g. by state_dict()


class ACCOEngine:
    """Sharded optimizer with ACCO, DPU or synchronous ZeRO-1 rounds over one process group.

    A front-end feeds it each micro-batch's gradients (:meth:`accumulate_grad`, or the hooks of
    :meth:`hook_param_grads`), then calls :meth:`microbatch_done`; the engine decides when a
    round ends and runs each round's communication on a background thread.

    Args:
        params: parameters, ``(name, parameter)`` pairs or parameter-group dicts, as for any
            torch optimizer.
        optimizer_class: the torch optimizer class stepped on this rank's fp32 master shard;
            one whose step is not per element is refused (``shard_optimizer``).
        settings: the :class:`~acco_hooks.engine.EngineSettings`; or give them as keyword
            arguments (``mode="acco"``, ``accumulation_steps=4``, ...), which
            :class:`acco_hooks.ACCOOptimizer` documents.
        process_group: the data-parallel ``ProcessGroup`` or 1-D ``DeviceMesh``; default: the
            whole world (one local worker without ``torch.distributed``).
        lr_scheduler: ``callable(shard_optimizer) -> LRScheduler``, stepped after each real
            update.
        norm_process_group: 3-D runs: every rank whose shards make up the model
            (data-parallel × tensor/pipeline-parallel ranks), for the global gradient norm.
            Under ``accumulate_until_ready`` the ranks of this rank's replica (those of this
            group at this rank's place in ``process_group``) agree on each round's end.
        fsdp_process_group: HSDP: the ranks over which FSDP2 shards each replica. Gradients
            then arrive summed over it, and the engine shards each local FSDP shard again over
            ``process_group``.
        weights_are_shares: the weights given to :meth:`microbatch_done` are each rank's
            shares of an update, adding up to a total that does not depend on the data (the
            Hugging Face Trainer's), not what :meth:`microbatch_done` documents (the units a
            micro-batch's loss sums over). Read by a resharded resume alone.
        gradients_may_skip_ranks: a parameter's gradient may be missing on some ranks in a
            round (DDP's ``find_unused_parameters``): every parameter must get one on at
            least one rank, which the round's communication checks over every rank, instead of
            each rank at its round end.
        manager: a ``torchft.Manager``: ``process_group`` is then one replica group of a
            torchft job, and each round's shard is summed over the groups of the current
            quorum through it; a group lost mid-run drops out and the others train on
            (``replicas``, docs/multinode.md). A group that joins a running job (restarted, or
            started late) takes a live group's state in this constructor, which then blocks
            until the other groups reach their next sum; :attr:`round_index` is then the first
            round it trains (the data position). A group whose sum fails where the others
            committed it takes their state the same way, a round later, and sits the round
            under way out (:attr:`joined_round`; read the data position from
            :attr:`microbatches_scheduled` at round ends). Every group must build the same
            settings, LR scheduler and number of ranks (refused by name before the first
            round). Inside a group: data parallelism, HSDP (``fsdp_process_group``), tensor
            and pipeline parallelism (``norm_process_group``).
        replica_groups: with ``manager``: the number of replica groups the job is launched
            with. At the job's start the first round then waits for that many to be up (for
            at most the round's patience, twice ``timeout``), so that groups started at
            slightly different moments train together from the first round; a group that
            comes later joins the running job. ``None``: each group trains with the groups
            up when its first quorum forms.
        **kwargs: the settings (unless ``settings`` is given), then the keyword arguments of
            ``optimizer_class`` (``lr``, ``betas``, ...).
    """

    __slots__ = (
        # Configuration
        "settings", "device",
        # The worker thread's process groups, and this rank's place in them
        "_groups", "world_size", "rank", "fsdp_world_size",
        # Buffers (one per parameter group), the shard optimizer and how its state is saved
        "_buffers", "_slot_of", "_frozen", "optimizer", "lr_scheduler", "_state_layouts",
        # Where each element of the shards lives in the model, for checkpoints
        "_placement",
        # The worker thread, the gradient hooks, and what close() (or a finalizer) releases
        "_worker", "_hook_handles", "_placeholders", "_release", "__weakref__",
        # The round in flight (launched, not yet applied), the failure that stopped the engine,
        # and inside real_weights() the live parameters its block replaced
        "_in_flight", "_failure", "_live_outside",
        # torchft: the training loop's counters at the last round end, for a joining group,
        # and the round this group joined a running job in
        "_handover_counters", "joined_round",
        # The rounds: their schedule, counters and weights (saved in checkpoints, ``rounds``),
        # when the current update started (mode="auto" times it), whether a gradient may miss
        # a rank, the gradients taken in, and statistics of the last round for logging
        "rounds", "_update_started", "_gradients_may_skip_ranks",
        "grads_received", "_grads_counted",
        "last_wait_s", "last_round_microbatches", "last_global_count", "last_grad_norm",
        "last_round_lr", "step_boundary",
        # The advisor, the clock that times each micro-batch and round for it and for auto,
        # and the rounds this process launched (the advisor's first ones measure every rank)
        "advisor", "_clock", "_rounds_launched_here",
    )  # fmt: skip

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer],
        *,
        settings: EngineSettings | None = None,
        process_group: Any = None,
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        norm_process_group: Any = None,
        fsdp_process_group: Any = None,
        weights_are_shares: bool = False,
        gradients_may_skip_ranks: bool = False,
        manager: Any = None,
        replica_groups: int | None = None,
        **kwargs: Any,
    ) -> None:
        settings, optimizer_kwargs = EngineSettings.from_keywords(settings, kwargs)
        if lr_scheduler is not None and not callable(lr_scheduler):
            raise TypeError(
                "acco_hooks: lr_scheduler must be a callable that builds the scheduler from the "
                "optimizer, e.g. lr_scheduler=lambda opt: CosineAnnealingLR(opt, T_max=1000)"
            )
        self.settings = settings
        param_groups, self._frozen = normalize_param_groups(params)
        # a group may name its own class ("optimizer_class": Muon for the matrices)
        classes = [g.pop("optimizer_class", optimizer_class) for g in param_groups]
        trained = [gi for gi, g in enumerate(param_groups) if g["params"]]  # others: all frozen
        self.device = param_groups[trained[0]]["params"][0].device
        options = [{k: v for k, v in g.items() if k not in ("params", "names")}
                   for g in param_groups]  # fmt: skip
        # torch's rule: the keyword arguments are optimizer_class's defaults
        class_kwargs = constructor_kwargs(
            optimizer_class, optimizer_kwargs, classes, options,
            [g["names"][0] if g["names"] else f"group {gi}" for gi, g in enumerate(param_groups)],
        )  # fmt: skip
        # Refused here, before any process group exists, unless its step is per element (a
        # flat shard) or per parameter (whole parameters, each on one rank)
        layouts = check_optimizers(
            [classes[gi] for gi in trained], [options[gi] for gi in trained], class_kwargs,
            self.device,
            [[tuple(local_tensor(p).shape) for p in param_groups[gi]["params"]] for gi in trained],
            settings.mode if settings.has_estimate_round else None,
        )  # fmt: skip
        # per group that has parameters (as ``_buffers``): its layout and how its state is saved
        self._state_layouts: list[ShardStateLayout] = layouts
        whole = [False] * len(param_groups)
        for gi, layout in zip(trained, layouts):
            whole[gi] = layout.layout == "whole"
        whole_params = [p for gi in trained if whole[gi] for p in param_groups[gi]["params"]]

        replicas = None
        if replica_groups is not None and manager is None:
            raise ValueError("acco_hooks: replica_groups is the number of torchft replica "
                             "groups a job starts with: give the group's manager= too, or "
                             "leave replica_groups unset")  # fmt: skip
        if manager is not None:  # refused here too, before any process group exists
            replicas = ReplicaGroups(
                manager, describe_replica_group(settings, classes, optimizer_kwargs,
                                                param_groups, process_group, fsdp_process_group,
                                                norm_process_group),
                group_size=dist.get_world_size() if dist.is_initialized() else 1,
                narrow_estimate=settings.estimate_format != settings.reduce_format,
                until_ready_uncapped=(settings.accumulate_until_ready
                                      and settings.max_microbatches_per_round is None),
                timeout=settings.timeout,
                start_groups=replica_groups,
                logs=not dist.is_initialized() or dist.get_rank() == 0,
            )  # fmt: skip
        # No local name holds the groups: a traceback through here must not keep them alive.
        self._groups = build_engine_groups(
            process_group, fsdp_process_group, norm_process_group, settings.timeout, replicas,
            until_ready=settings.accumulate_until_ready, whole_parameters=whole_params,
        )
        self.world_size, self.rank = self._groups.world_size, self._groups.rank
        self.fsdp_world_size = self._groups.fsdp_world_size
        # a failed job releases the groups at once, on the thread (the peers then fail too)
        self._worker = CommWorker(
            self.device, on_failure=functools.partial(_release_if_fatal, self._groups)
        )
        self._hook_handles: list[Any] = []
        self._placeholders = False  # .grad holds a GradientInEngine meanwhile (hook_param_grads)
        # Every group built above is this engine's alone; close() destroys them. An engine its
        # owner never closes is released when it is garbage-collected or at interpreter exit:
        # a gloo group destructed during interpreter finalization can abort the process.
        self._release = weakref.finalize(self, _release, self._worker, self._groups)
        try:
            if self._groups.data is not None:  # every replica starts from the first rank's
                broadcast_from_first_rank(
                    [local_tensor(p) for g in param_groups for p in g["params"]], self._groups.data
                )
            # The estimate formats it may send: the reduce dtype's carries ΣG̃ on the shard
            # side; a narrower one needs the wire buffers.
            formats = estimate_formats(settings, self._groups.data,
                                       replicas=self._groups.replicas is not None)
            narrow = [WIRE_FORMATS[f] for f in formats if f != settings.reduce_format]
            self._buffers, self.optimizer, self.lr_scheduler = build_shard(
                param_groups, self.world_size, self.rank, self._groups.data_parallel_ranks,
                reduce_dtype=settings.reduce_torch_dtype,
                carry=settings.reduce_format in formats,
                wire_bytes=(lambda n: max(w.nbytes(n) for w in narrow)) if narrow else None,
                classes=classes, class_kwargs=class_kwargs, lr_scheduler=lr_scheduler,
                whole=whole, piece_ranks=self._groups.piece_ranks,
                piece_rank=self._groups.piece_rank,
            )  # fmt: skip
            groups = self._groups
            self._gather_whole_masters()
            self._placement = ShardPlacement(
                self._buffers, self.rank, groups.data, groups.data_parallel_ranks,
                groups.fsdp_ranks, groups.count,
            )  # fmt: skip
        except BaseException:
            self._release()  # e.g. a bad optimizer argument: the groups go now, not at exit
            self._groups = None
            raise
        self._slot_of = {
            p: (gi, pi) for gi, g in enumerate(self._buffers) for pi, p in enumerate(g.params)
        }
        self._in_flight: RoundInFlight | None = None
        self._failure: ACCOCommunicationError | None = None
        self._live_outside: dict[str, Tensor] | None = None
        fractions = {f: wire_fraction(self._buffers, settings, f) for f in formats}
        self.rounds = RoundState(
            settings, formats, fractions, [len(g.params) for g in self._buffers],
            weights_are_shares, report=self._groups.norm is None or dist.get_rank() == 0,
        )  # fmt: skip
        self._update_started: float | None = None  # mode="auto" times each update
        self._gradients_may_skip_ranks = gradients_may_skip_ranks
        self.step_boundary = False
        self.grads_received = 0  # parameter gradients taken in so far, for front-ends' checks
        self._grads_counted = 0  # grads_received when the last micro-batch was counted
        # measures K, C and the round time; predicts ACCO's per-token speedup
        self.advisor = Advisor(
            settings.accumulation_steps, overlapping=settings.overlaps_every_update,
            microbatches_per_update=settings.accumulation_steps
            * (2 if settings.mode is Mode.ACCO else 1),
            estimate_fractions=fractions or None,
            until_ready=settings.accumulate_until_ready,
        )  # fmt: skip
        self._clock = MicrobatchClock()
        # Rounds this process launched: the advisor's first ones carry each rank's compute per
        # micro-batch to a collective, and every rank of the count group counts them alike.
        self._rounds_launched_here = 0
        self.last_wait_s, self.last_round_microbatches = 0.0, 0
        self.last_global_count, self.last_grad_norm = 0.0, None
        # The learning rate (first parameter group) of the update the last round's gradients
        # join. Read at the round end, after the previous job finished and before the next one
        # starts: the scheduler steps on the communication thread, and any other moment races it.
        self.last_round_lr: float | None = None
        if self.advisor.report:  # one line per job; every setting at DEBUG
            whole = [g.layout for g in self._buffers if g.layout.whole]
            logger.info(
                "acco_hooks: mode=%s accumulation_steps=%d world_size=%d fsdp_world_size=%d "
                "%s (%s estimate), %d params%s", settings.mode, settings.accumulation_steps,
                self.world_size, self.fsdp_world_size,
                "+".join(dict.fromkeys(c.__name__ for c in classes)),
                "functional" if has_functional_peek(self.optimizer) else "snapshot",
                len(self._slot_of),
                "" if not whole else f"; whole parameters in {len(whole)} group(s), padding "
                f"{100 * sum(w.padding for w in whole) / sum(w.padded_numel for w in whole):.1f}"
                " % of their vectors",
            )  # fmt: skip
        logger.debug("acco_hooks: %s", settings)
        self._handover_counters: dict[str, Any] | None = None
        # The last round this torchft replica group sat out to take a live group's state: as
        # it joined a running job, or after its sum failed where the others committed it; None
        # while it has trained every round since it started with the job
        self.joined_round: int | None = None
        if replicas is not None:
            try:
                self._join_replica_groups(replicas)
            except BaseException:
                self._release()  # no quorum, a state refused: the groups go now, not at exit
                self._groups = None
                raise

    def _join_replica_groups(self, replicas: ReplicaGroups) -> None:
        """torchft: take the job's current step with the other replica groups before the first
        round, and a live group's state if they are training already (``replicas``)."""
        self._handover_counters = self.rounds.state_dict()
        engine = weakref.ref(self)  # torchft's manager keeps the callbacks: not the engine
        replicas.attach(
            lambda: engine()._handover(),
            lambda: repr([{k: v for k, v in group.items() if k != "params"}
                          for group in engine().optimizer.param_groups]),
            self.lr_scheduler,
        )  # fmt: skip
        arrived = (0.0,) * len(self._slot_of) if self._gradients_may_skip_ranks else None
        skipped = [torch.zeros_like(g.shard_sum) for g in self._buffers]
        skipped.append(round_weights(0.0, True, arrived, self.device))

        def agree(value: float) -> float:  # summed over the group's ranks: every part of it
            total = torch.tensor([value], dtype=torch.float64, device=self.device)
            if self._groups.norm is not None:
                self._run_on_thread(dist.all_reduce, total, dist.ReduceOp.SUM, self._groups.norm)
            return total.item()

        handover, joined_round = replicas.join(skipped, agree)
        # torchft heals rank by rank: with init_sync, rank r takes the state of the group its
        # rank picks, and may be the one to give it. The group loads together, every part of
        # its model (FSDP shards, tensor and pipeline parallel parts: the norm group spans
        # them), and a rank handed nothing takes its own state.
        if agree(float(handover is not None)) > 0 and handover is None:
            handover = self._handover()
        if handover is None:
            return
        load_handover(self._state_parts(), handover)
        self._gather_whole_masters()  # the group loads together: its piece ranks too
        self._handover_counters = self.rounds.state_dict()
        if joined_round is None:  # init_sync at the start: one group's state, the same in all
            return
        self.joined_round = joined_round
        if replicas.logs:
            logger.warning(
                "acco_hooks: this replica group joined the job at round %d with a live group's "
                "state; it sits that round out and trains from round %d on", joined_round,
                joined_round + 1,
            )  # fmt: skip
        for _ in range(self.round_size):  # ends the round: its job takes the sum joined
            self.skip_microbatch()

    def _handover(self) -> dict[str, Any]:
        """torchft: what a group joining in the round under way takes (``state``)."""
        return handover_state(self._state_parts(), self._handover_counters, self._live_outside)

    def _rejoin(self, behind: GroupFellBehind) -> None:
        """torchft: this group's sum of a round failed where the other groups committed it, and
        its retry took a later round's sum with a live group's state (``replicas``). The round
        in flight is dropped, the state taken, and the round the training loop is in becomes
        the one sat out: its gradients go nowhere (its job takes the sum the others made), and
        it ends as rounds do, or now if the loop is at its end. The loop reads on from
        :attr:`microbatches_scheduled` then."""
        handover, joined_round = self._groups.replicas.take_rejoin()
        counted = self.rounds.microbatches
        self._in_flight = None
        load_handover(self._state_parts(), handover)
        self._gather_whole_masters()  # the whole group rejoins: its piece ranks too
        self._handover_counters = self.rounds.state_dict()
        self.joined_round = joined_round
        self.rounds.microbatches = counted
        self.rounds.all_arrived()
        if self._groups.replicas.logs:
            logger.warning(
                "acco_hooks: round %d: this replica group's sum failed where the other groups "
                "committed it; it took a live group's state in round %d, sits that round out "
                "and trains from round %d on", behind.round_index, joined_round, joined_round + 1,
            )  # fmt: skip

    # ------------------------------------------------------------ gradients in (main thread)

    @property
    def params(self) -> list[Tensor]:
        """The model parameters the engine trains, in layout order."""
        return [p for g in self._buffers for p in g.params]

    @property
    def layouts(self) -> list[ShardLayout]:
        """Per parameter group that has parameters (in order, as :attr:`params`): where its
        parameters lie in its padded vector (``layout``): ``kind`` ("flat" or "whole"), which
        parameters each rank ``owned()``, and the ``padding`` the vector sends."""
        return [g.layout for g in self._buffers]

    @property
    def owned_whole(self) -> list[str]:
        """The names of the parameters this rank steps whole (groups on the whole-parameter
        layout): those whole in its shard, or under FSDP those it owns on the replicas × FSDP
        grid, which it brings together from their pieces each round (``whole_pieces``)."""
        return [g.names[i] for g in self._buffers for i in g.owned]

    def hook_param_grads(
        self, on_grad: Callable[[Tensor], None] | None = None, *, placeholders: bool = True
    ) -> None:
        """Register a post-accumulate-grad hook on every parameter; :meth:`close` removes them.

        Args:
            on_grad: what the hook does with the parameter. Default: hand ``.grad`` to
                :meth:`accumulate_grad` and, with ``placeholders``, leave a placeholder in it
                (else ``None``). The DDP hook passes its own (DDP's buckets deliver the
                gradients there) and leaves the placeholders itself once DDP is done
                (:meth:`leave_placeholders`).
            placeholders: from a parameter's backward to the micro-batch's count, ``.grad``
                holds a ``GradientInEngine`` (``ownership``), which refuses by name whatever
                reads or clips it in the training loop: the gradient is in the engine, and only
                ``max_grad_norm`` can clip the averaged one. ``False``: ``.grad`` is ``None``
                then (the torchtitan trainer, whose loop reads no gradient and whose pipeline
                schedules write ``.grad`` themselves).
        """
        if on_grad is None:
            # A weak reference: the parameters must not keep an engine its owner dropped alive
            # (it is then released); their gradients then stay in ``.grad`` as usual.
            engine_ref = weakref.ref(self)

            def on_grad(param: Tensor) -> None:
                engine = engine_ref()
                if engine is not None:
                    engine.accumulate_grad(param, param.grad)
                    param.grad = None
                    if placeholders:
                        engine.leave_placeholders([param])

        params = self.params
        try:
            ownership.claim(self, params, [name for g in self._buffers for name in g.names])
        except RuntimeError:
            self.close(flush=False, barrier=False)  # its groups go now, not with the traceback
            raise
        self._hook_handles += [p.register_post_accumulate_grad_hook(on_grad) for p in params]
        self._placeholders = placeholders
        if placeholders:  # a second backward before the count accumulates into an empty .grad
            self._hook_handles += [p.register_hook(ownership.clear_before_accumulating(p)) for p in params]

    def leave_placeholders(self, params: Iterable[Tensor] | None = None) -> None:
        """Put a ``GradientInEngine`` in the ``.grad`` of ``params`` (default: every parameter
        the engine trains), until the micro-batch is counted: their gradients are in the
        engine (see :meth:`hook_param_grads`)."""
        if not self._placeholders:
            return
        for param in self.params if params is None else params:
            gi, pi = self._slot_of[param]
            ownership.leave_placeholder(param, self._buffers[gi].names[pi])

    def clear_placeholders(self) -> None:
        """``.grad = None`` where :meth:`leave_placeholders` left one: counting a micro-batch
        does it; a front-end whose gradients arrive outside autograd (FSDP2's reduce-scatter
        accumulates into a ``.grad`` it finds) calls it before each forward."""
        if self._placeholders:
            ownership.clear_placeholders(self.params)

    def accumulate_grad(self, param: Tensor, grad: Tensor) -> None:
        """Add one micro-batch gradient of ``param`` to the fp32 accumulator."""
        try:
            gi, pi = self._slot_of[param]
        except KeyError:
            raise KeyError(
                "acco_hooks: accumulate_grad: this tensor is not one of the engine's parameters"
            ) from None
        if grad.layout != torch.strided:  # nn.Embedding(sparse=True), a sparse matmul, ...
            raise RuntimeError(
                f"acco_hooks: {self._buffers[gi].names[pi]} got a {grad.layout} gradient; the "
                "engine sums and shards dense gradients only, and a dense step is not the step "
                "torch's optimizers take on a sparse gradient. Use nn.Embedding(..., "
                "sparse=False) (the default)"
            )
        if is_dtensor(grad):
            if grad.placements != param.placements:  # e.g. Partial sums over tensor-parallel ranks
                grad = grad.redistribute(grad.device_mesh, param.placements)
            grad = grad.to_local()
        self._buffers[gi].accumulator_views[pi].add_(grad)
        self.rounds.grad_arrived[gi][pi] = True
        self.grads_received += 1

    # ------------------------------------------------------------ the round schedule

    @property
    def round_index(self) -> int:
        """Rounds ended so far: the index of the round being accumulated."""
        return self.rounds.round_index

    @property
    def num_updates(self) -> int:
        """Real updates applied to the master shard so far (skipped rounds not counted)."""
        return self.rounds.num_updates

    @property
    def updates_launched(self) -> int:
        """Updates whose micro-batches are all in: a trainer's steps so far."""
        return self.rounds.updates_launched

    @property
    def skipped_rounds(self) -> int:
        """Rounds whose averaged gradient was not finite (``nonfinite="skip"``)."""
        return self.rounds.skipped_rounds

    @property
    def schedule(self) -> Schedule:
        """How the update under way runs: one synchronous round, or an estimate and an update
        round (in ``auto``, the schedule every rank agreed on last)."""
        return self.rounds.schedule

    @property
    def microbatches_in_round(self) -> int:
        """Micro-batches counted so far in the round being accumulated."""
        return self.rounds.microbatches

    @property
    def round_size(self) -> int:
        """Micro-batches the round being accumulated runs (at least, with
        ``accumulate_until_ready``): ``accumulation_steps``; in ``acco`` an estimate round's
        ``estimate_microbatches``; in ``auto`` its schedule's share of the update."""
        return self.rounds.round_size

    @property
    def microbatches_scheduled(self) -> int:
        """Micro-batches the schedule has taken since training started: the ended rounds',
        skipped ones included, and those counted in the round under way. Where a data loader
        stands: a torchft replica group that joined a running job (:attr:`joined_round`) reads
        on from here, which in ``auto`` is not a round count times a round size. With
        ``accumulate_until_ready`` and ``max_microbatches_per_round`` every ended round takes
        the cap's positions, whatever each rank ran in it: no rank read at or past this, so a
        group that joins reads nothing another group (or its own lost predecessor) read."""
        return self.rounds.microbatches_scheduled

    @property
    def candidate_schedules(self) -> list[Schedule]:
        """The schedules this engine may run: ``auto``'s candidates (the synchronous one first,
        then each split and estimate format it may try); otherwise its one schedule."""
        return self.rounds.candidates

    @property
    def communication_in_flight(self) -> bool:
        """Whether a round's communication was launched and has not finished yet.

        On CUDA "finished" means its device work is done, not only enqueued: the worker's
        future completes after an event recorded behind the all-gather (``communication``).
        """
        return self._in_flight is not None and not self._in_flight.future.done()

    def start_microbatch(self) -> None:
        """Mark where this rank's next micro-batch's compute starts: just before its forward.

        The advisor's compute per round K (and ``auto``'s) is compute only: each micro-batch is
        timed from this mark to :meth:`microbatch_done`. Unmarked, a micro-batch is timed from
        the previous one's end, so it also holds what the loop does between them; at a step's
        end that can be a wait for the network (a metrics all-reduce queued behind the round's
        traffic on a slow link), and with one micro-batch per round every interval holds one.
        The torchtitan and Hugging Face trainers mark each micro-batch; a plain loop that does
        more than forward and backward between micro-batches should too. Where a front-end marks
        them, an unmarked one (an empty micro-batch that pads a short step) is not timed. On a
        GPU, while micro-batches are timed (the advisor's first rounds, ``auto``'s samples), the
        compute stream is waited for at the mark and at the count: the time is then the
        device's, not that of queuing its kernels.
        """
        self._clock.mark(self.communication_in_flight, self._wait_for_compute)

    def _wait_for_compute(self) -> None:
        """On a GPU, while micro-batches are timed: wait for the work queued on the compute
        stream (the communication stream's is not waited for)."""
        auto = self.rounds.auto
        timing = not self.advisor.figures or (auto is not None and auto.takes_microbatch_times)
        if timing and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def microbatch_done(self, weight: float = 1.0) -> bool:
        """Count one micro-batch; end the round when it may. Returns whether a round ended.

        An exception raised in this thread while the call waits for the network (Ctrl-C's
        ``KeyboardInterrupt``) leaves the engine as if the call had not happened: call it
        again to count the micro-batch.

        Args:
            weight: how many units the micro-batch's loss sums over (1 for a per-micro-batch
                mean loss; the number of tokens for a token-summed loss). The averaged gradient
                is Σ gradients / Σ weights over all ranks.
        """
        if not weight > 0:
            raise ValueError(f"acco_hooks: micro-batch weight must be > 0, got {weight}")
        return self._count_microbatch(float(weight))

    def skip_microbatch(self, weight: float = 0.0) -> bool:
        """Count a micro-batch that contributes no gradient, e.g. on a rank that ran out of data.

        Keeps this rank's rounds (and so its collectives) in step with the other ranks.

        Args:
            weight: what it counts in the average's denominator. 0 (default): nothing, the
                average is over the micro-batches that ran. What a real micro-batch weighs: a
                zero gradient in the average, as plain DDP under ``Join`` counts a joined rank
                (``divide_by_initial_world_size=True``).
        """
        if not weight >= 0:
            raise ValueError(f"acco_hooks: an empty micro-batch's weight must be >= 0, got {weight}")
        self.rounds.all_arrived()
        return self._count_microbatch(float(weight))

    def _count_microbatch(self, weight: float) -> bool:
        self._raise_if_failed()
        self.clear_placeholders()
        self._grads_counted = self.grads_received
        timed = self._clock.stop(self._wait_for_compute)
        if timed is not None:  # the advisor's K: this micro-batch's compute (start_microbatch)
            self.advisor.record_microbatch(*timed)
            if self.rounds.auto is not None:
                self.rounds.auto.record_microbatch(*timed)
        self.step_boundary = False
        try:
            return self._count_or_end_round(weight)
        finally:
            self._clock.restart(self.communication_in_flight)

    def _count_or_end_round(self, weight: float) -> bool:
        rounds = self.rounds
        if self._waits_for_own_round and self._in_flight is not None:
            # A step() interrupted while it waited for its own round: this call completes it.
            if self._finish_in_flight(apply=True):
                self._at_update_end(rounds.schedule)
            self.step_boundary = True
            return True
        counted = rounds.count(weight)
        if rounds.microbatches < rounds.round_size:
            return False
        cap = self.settings.max_microbatches_per_round
        if (self.settings.accumulate_until_ready and (cap is None or rounds.microbatches < cap)
                and self._groups.replica_waits(self.communication_in_flight, self.device)):
            return False  # the caller runs another micro-batch while the network works
        round_index = rounds.round_index
        try:
            with record_function("acco::round_end"):
                self._end_round()
        except BaseException:
            if rounds.round_index == round_index and self._failure is None:
                # Interrupted before the round was launched (while waiting for the previous
                # one): nothing was lost, the call can be repeated.
                rounds.uncount(counted)
            raise
        return True

    def _end_round(self) -> None:
        rounds = self.rounds
        rounds.check_inputs([g.names for g in self._buffers],
                            [name for g in self._buffers for name in g.moved_params()],
                            self._frozen, each_rank=not self._gradients_may_skip_ranks)  # fmt: skip
        start = time.perf_counter()
        self._finish_in_flight(apply=True)  # 1. the previous round's result becomes live
        self.last_wait_s = time.perf_counter() - start
        self.last_round_lr = float(self.optimizer.param_groups[0]["lr"])
        if self._handover_counters is not None:  # what a group joining in this round's sum gets
            self._handover_counters = rounds.state_dict()

        # 2. the payload (what it sends and adds: ``RoundState.plan_round``); the accumulators
        #    restart, unless they keep a narrow estimate's gradients for the update round
        schedule = rounds.schedule
        plan = rounds.plan_round(arrivals=self._gradients_may_skip_ranks)
        for g in self._buffers:
            g.comm_input.copy_(g.accumulator)
            if not plan.keeps_accumulator:
                g.accumulator.zero_()
        # 3. launch: reduce-scatter -> step or Peek -> all-gather, on the worker thread
        microbatch_s = None
        if self._rounds_launched_here < self.advisor.rounds_measured:
            microbatch_s = self.advisor.take_round_compute()  # slowest and fastest rank's
        future = self._worker.submit(
            communicate, plan, self._buffers, self._groups, self.optimizer, self.lr_scheduler,
            self.settings.max_grad_norm, microbatch_s,
        )  # fmt: skip
        self._rounds_launched_here += 1
        self._in_flight = RoundInFlight(future, plan, plan.round_index)
        self.last_round_microbatches = rounds.round_launched(plan)
        # its own result is the next parameters; a torchft group that took a live group's
        # state instead holds that update's counters already (``_rejoin``)
        taken = not self._waits_for_own_round or self._finish_in_flight(apply=True)
        update = plan.job is Job.UPDATE
        if update and taken:
            self._at_update_end(schedule)
        self.step_boundary = self.settings.mode is not Mode.AUTO or update
        # 4. return: the next round computes while the network works
        seconds = self._clock.round_ended()
        if seconds is not None:  # round end to round end, for the advisor
            self.advisor.record_round(seconds, self.last_round_microbatches)

    @property
    def _waits_for_own_round(self) -> bool:
        """Whether each round waits for its own communication (``ddp``; ``auto`` between its
        overlapped schedules)."""
        return self.rounds.schedule.synchronous and self.settings.mode is not Mode.DPU

    def _at_update_end(self, ran: Schedule) -> None:
        """An update's micro-batches are all in (its update launched, or applied when
        synchronous): a trainer's step ends here, and ``auto`` may change the schedule."""
        rounds = self.rounds
        rounds.updates_launched += 1
        if rounds.auto is None:
            return
        now = time.perf_counter()
        if self._update_started is not None:
            rounds.auto.record_update(ran, now - self._update_started)
        agreed = rounds.agreed
        if agreed is not None and agreed != rounds.schedule:
            # the update in flight is applied: the next round computes at θ (unless a torchft
            # group took a live group's state instead, which holds the schedule already)
            if agreed.synchronous and not self._finish_in_flight(apply=True):
                return
            rounds.schedule, rounds.estimate_next = agreed, True
        self._update_started = time.perf_counter()

    def _finish_in_flight(self, apply: bool) -> bool:
        """Wait for the round in flight; with ``apply``, its result becomes the live parameters.

        The one place that waits for the communication thread and applies its result. Returns
        ``False`` when the round was dropped instead: under torchft, this group took a live
        group's state (:meth:`_rejoin`), whose counters are past that round's bookkeeping.
        """
        flight = self._in_flight
        if flight is None:
            return True
        if self._failure is not None:
            raise self._failure
        try:
            with record_function("acco::wait"):
                result = self._wait(flight.future)
        except GroupFellBehind as behind:  # torchft: the job stopped to take the others' state
            self._rejoin(behind)
            return False
        except Exception as exc:  # not KeyboardInterrupt: the communication itself goes on
            self._failure = ACCOCommunicationError(
                f"acco_hooks: the communication of round {flight.round_index} failed on rank "
                f"{self.rank} of the data-parallel group: {type(exc).__name__}: {exc}. The other "
                "ranks fail their round too; restart from the last complete checkpoint"
            )
            raise self._failure from exc
        if result is not None and not flight.seen:  # None: a re-gather after a load
            flight.seen = True
            self._take_result(result, flight)
        if apply:
            with torch.no_grad(), record_function("acco::apply"):
                for g in self._buffers:
                    g.copy_gathered_into_params(difference=flight.plan.wire is not None)
            self._in_flight = None
        return True

    def _wait(self, job: Future) -> Any:
        """Wait for a job of the communication thread. The timeout is a backstop only: a dead
        peer fails the collective within the groups' own ``timeout`` first (with torchft, the
        round's search for a quorum that commits ends within its patience, plus one attempt)."""
        timeout = self.settings.timeout
        replicas = None if self._groups is None else self._groups.replicas
        if timeout is None:
            return self._worker.wait(job)
        patience = 0.0 if replicas is None else replicas.patience_s + timeout
        return self._worker.wait(job, timeout_s=timeout + patience + 60.0)

    def _run_on_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the communication thread, which owns the engine's process
        groups (a collective outside a round: a load's gather, the barrier at close), and wait."""
        return self._wait(self._worker.submit(fn, *args))

    def _take_result(self, result: RoundResult, flight: RoundInFlight) -> None:
        self.last_global_count, self.last_grad_norm = result.global_count, result.grad_norm
        self.rounds.take_result(result, flight.plan)
        self.advisor.record_comm(result.comm_s, result.microbatch_s_range)
        if result.untrained:
            message = (
                f"acco_hooks: no rank computed a gradient for {name_some(list(result.untrained))} "
                f"in round {flight.round_index} (DDP's find_unused_parameters): plain DDP skips "
                "such a parameter in that step, and the engine cannot leave part of its flat "
                "shard out of a step. Nothing was stepped. Freeze parameters that are not "
                "trained (requires_grad=False), or let every parameter take part in each round "
                "on at least one rank (an unused branch: add 0 * its output to the loss)"
            )
            self._failure = ACCOCommunicationError(message)
            raise RuntimeError(message)
        if not result.nonfinite:
            return
        what = flight.plan.job.value
        if self.settings.nonfinite == "raise":
            self._failure = ACCOCommunicationError(
                f"acco_hooks: non-finite gradient (NaN/Inf) in round {flight.round_index}; "
                "nonfinite='raise'"
            )
            raise FloatingPointError(
                f"acco_hooks: the averaged gradient of round {flight.round_index} has NaN/Inf "
                f"values (nonfinite='raise'); the {what} was not applied and the optimizer "
                "state is unchanged"
            )
        self.rounds.skipped_rounds += 1
        warnings.warn(
            f"acco_hooks: non-finite gradient (NaN/Inf) in round {flight.round_index}: every "
            f"rank skipped this {what}; the optimizer state and learning rate are unchanged "
            f"({self.skipped_rounds} rounds skipped so far)",
            RuntimeWarning,
            stacklevel=4,
        )

    def _raise_if_failed(self) -> None:
        """Raise at once if a round's communication failed, even before the round end."""
        if self.closed:
            raise RuntimeError(
                "acco_hooks: the engine is closed (close() ran, or its with-block ended); "
                "build a new optimizer to train on"
            )
        if self._failure is not None:
            raise self._failure
        flight = self._in_flight
        if flight is not None and flight.future.done() and flight.future.exception():
            self._finish_in_flight(apply=False)

    # ------------------------------------------------------------ the real weights θ

    def flush(self) -> None:
        """Wait for in-flight communication and leave the latest real parameters θ in the model.

        An estimate in flight is kept and applied at the next round end as usual (the model
        already holds the real θ it was computed from), so training may go on exactly. A real
        update in flight is applied now; training may go on from it (the next round then
        computes at θ_{t+1} where it would have used θ̃_{t+1}: the estimate is exact). Use
        :meth:`real_weights` to look at θ without changing the trajectory.
        """
        if self._in_flight is not None:
            self._finish_in_flight(apply=self._in_flight.plan.job is Job.UPDATE)

    @contextlib.contextmanager
    def real_weights(self) -> Iterator[dict[str, Tensor] | None]:
        """Within the block the model holds the real parameters θ; after it, what it held before.

        The real θ is what :meth:`flush` would leave in the model. When a real update is in
        flight (``acco`` after an estimate was applied, ``dpu``), the block waits for it, as
        the next round end would, but does not apply it: its result stays pending and is
        applied at the round end as usual, so evaluating inside the block never changes the
        training trajectory. Costs one copy of the live parameters while the block runs.

        Yields:
            The live parameters the block replaced (by name), or ``None`` when the model
            already held θ.

        Example::

            >>> with opt.real_weights():
            ...     val_loss = evaluate(model)
        """
        self._raise_if_failed()
        if self._in_flight is None or self._in_flight.plan.job is not Job.UPDATE:
            yield None
            return
        if not self._finish_in_flight(apply=False):  # torchft: a live group's state, taken now
            yield None
            return
        live = {n: t.clone() for g in self._buffers for n, t in zip(g.names, g.locals)}
        with torch.no_grad():
            for g in self._buffers:
                g.copy_gathered_into_params()
        self._live_outside = live
        try:
            yield live
        finally:
            self._live_outside = None
            with torch.no_grad():
                for g in self._buffers:
                    torch._foreach_copy_(g.locals, [live[n] for n in g.names])

    # ------------------------------------------------------------ checkpoints

    def live_state_dict(self) -> dict[str, Tensor]:
        """This rank's range of the *live* parameters, the ones the next round computes at (in
        ``acco`` θ̃ where an update is in flight, in ``dpu`` the weights one update behind),
        laid out as the master shard: ``DTensor`` chunks that DCP saves from every rank and
        loads on any number of them, 1/N of the model in its dtype.

        Saved beside a model ``state_dict()`` taken inside :meth:`real_weights` (which holds θ,
        what anything reading the model from the checkpoint wants), they let
        :meth:`load_live_state_dict` put the live parameters back, so the resumed run computes
        where the saved one would have. Inside :meth:`real_weights` they are still the live
        parameters the block replaced.
        """
        return save_live_parameters(self._state_parts(), self._live_outside)

    def load_live_state_dict(self, state: dict[str, Any]) -> None:
        """Put the live parameters of :meth:`live_state_dict` (filled by DCP, on any number of
        ranks) into the model: after the model's own ``load_state_dict`` and the engine's."""
        load_live_parameters(self._state_parts(), state)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: bit-exactly on the same ranks, resharded on others.

        Every tensor that is 1/N of the model (the fp32 master shard, the optimizer's
        per-element state, the pending result's shard and, in ``acco``, the carried half-batch
        shard) is a ``DTensor`` of its parameter group's whole vector, sharded over the
        data-parallel ranks (``placement``), so the standard distributed checkpoint saves every
        rank's part and loads into a run with another number of ranks::

            dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=d)
            # ... any number of ranks later, after building model and optimizer:
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            dcp.load(state, checkpoint_id=d)
            model.load_state_dict(state["model"]); opt.load_state_dict(state["optim"])

        Saved in the middle of a round, this rank's accumulated gradients are in it too, under
        a key of this rank's own: such a state resumes from per-rank files
        (``acco_hooks.checkpoint``) on the same ranks. Between an estimate sent in a narrower
        dtype and its update, the estimate's gradients that each accumulator keeps are
        reduce-scattered into the carried half-batch they would have been in the reduce dtype
        (a collective: every rank calls ``state_dict()``, as DCP does); such a state resumes
        anywhere, to the order of float sums. In-flight communication is waited for first; its
        result is kept, not applied, so saving never changes the training trajectory. Save the
        model's ``state_dict()`` too: it holds the live parameters (in ``acco`` possibly θ̃).

        Like ``torch.optim.Optimizer.state_dict``, tensors are references: save the dict before
        the next ``step()``.

        Raises:
            RuntimeError: called between a ``backward()`` and the ``step()`` that counts it:
                its gradient is in the accumulators without its weight, and the resumed run
                would count it again when it replays that micro-batch.
        """
        uncounted = self.grads_received - self._grads_counted
        if uncounted and not self.closed:
            raise RuntimeError(
                f"acco_hooks: state_dict() between backward() and step(): {uncounted} parameter "
                "gradients are accumulated but their micro-batch is not counted yet, so a "
                "resumed run that replays it would count it twice. Save after step() (or "
                "before backward())"
            )
        self._finish_in_flight(apply=False)
        return save_state(self._state_parts(), None if self._in_flight is None
                          else self._in_flight.plan)  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output: of the same rank of a run of the same shape, or,
        once DCP loaded it into this engine's :meth:`state_dict`, of a run of any shape.

        Loading gathers the pending result's shards again, rebuilding it bit for bit. Under a
        torchft ``manager``, torchft's step follows the loaded round (``replicas``): every
        replica group must load the same checkpoint.
        """
        self._finish_in_flight(apply=False)  # its result is kept, as state_dict() keeps it
        with warnings.catch_warnings():  # torch deprecates ShardedTensor's torch functions
            warnings.filterwarnings("ignore", message="Please use DTensor instead")
            pending = load_state(self._state_parts(), state)  # a state refused changes nothing
        self._in_flight = None
        self._gather_whole_masters()  # the owners' whole masters, from the loaded pieces
        if self._groups.replicas is not None:
            self._groups.replicas.resume_at(self.round_index)
        if pending is not None:
            # The saved run had a finished, not yet applied result: every rank kept its shard of
            # it (θ, or a narrow estimate's decoded θ̃ − θ); gathering the shards again rebuilds
            # the full result bit for bit.
            future = self._worker.submit(all_gather_shards, self._buffers, self._groups)
            self._in_flight = RoundInFlight(future, pending, self.round_index - 1)

    def reset_master_from_params(self) -> None:
        """Take the fp32 master shard from the model's current parameters.

        The master shard is copied from the model when the engine is built. Call this after
        loading model weights that come without engine state (a pretrained or seed checkpoint),
        before the first round.
        """
        if self.round_index != 0 or self._in_flight is not None:
            raise RuntimeError(
                "acco_hooks: reset_master_from_params() after training started would drop the "
                "optimizer's progress; call it right after loading weights, before the first step"
            )
        for g in self._buffers:
            g.reset_master(self.rank)
        self._gather_whole_masters()

    def _gather_whole_masters(self) -> None:
        """Where a replica splits them (FSDP, tensor parallelism), the whole fp32 masters of
        the parameters this rank steps whole, from its piece peers' master pieces
        (``whole_pieces``): after those were set (built, reset, loaded, handed over)."""
        if any(g.exchange is not None for g in self._buffers):
            self._run_on_thread(gather_whole_masters, self._buffers, self._groups)

    def load_optimizer_state_by_name(self, state: dict[str, dict[str, Any]]) -> None:
        """Take the shard optimizer's state from per-parameter state keyed by parameter name.

        ``state[name]`` is what a torch optimizer of the engine's class over the model's own
        parameters keeps for that parameter (AdamW: ``exp_avg`` and ``exp_avg_sq`` shaped as
        the parameter, a ``DTensor`` parameter's as its local shard, and ``step``), e.g. what
        torchtitan's own trainer checkpoints. The per-element entries are laid out as the
        master shard is; a per-parameter entry (a step count) is the group's first
        parameter's. Call it before the first round, beside :meth:`reset_master_from_params`
        for the weights; the param groups' hyperparameters stay as they are.

        Raises:
            KeyError: naming a parameter or entry that ``state`` lacks.
        """
        if self.round_index != 0 or self._in_flight is not None:
            raise RuntimeError(
                "acco_hooks: load_optimizer_state_by_name() after training started would drop "
                "the optimizer's progress; call it before the first step"
            )
        load_optimizer_state_by_name(self._state_parts(), state)

    def _state_parts(self) -> StateParts:
        """What this rank's state is made of, for ``state`` to save and load."""
        return StateParts(
            self.settings, self.rounds, self._buffers, self._placement, self.optimizer,
            self.lr_scheduler, self._state_layouts, self._groups, self.device, self._run_on_thread,
        )  # fmt: skip

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds, by the categories of the spec's memory table."""
        return memory_bytes(self._buffers, self.optimizer, self.settings.reduce_torch_dtype)

    # ------------------------------------------------------------ closing

    @property
    def process_groups(self) -> tuple[Any, ...]:
        """The process groups this engine built for its thread (empty once closed)."""
        return () if self._groups is None else self._groups.owned

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran: the thread is joined and the process groups destroyed."""
        return not self._release.alive

    def close(self, *, flush: bool = True, barrier: bool = True) -> None:
        """Finish or drop the round in flight, stop the thread, destroy the engine's groups.

        Args:
            flush: ``True``: a real update in flight is applied, and the model ends at the real
                parameters θ, as after :meth:`flush`. ``False``: it is dropped, and the model
                keeps the live parameters (in ``acco`` possibly the estimate θ̃). Skipped after
                a communication failure.
            barrier: meet the other ranks at a barrier on each of the engine's groups first,
                so that no rank tears a group down while a peer still finishes its last
                collective on it. Every rank must then call ``close()`` (as each one does when
                it ends training). Pass ``False`` when closing after an error on this rank
                alone: the peers then fail their next collective with a clear error instead
                of waiting. Skipped anyway after a communication failure.

        Removes the gradient hooks. Idempotent; the engine runs no round afterwards.
        """
        if self.closed:
            return
        uncounted = self.grads_received - self._grads_counted
        if flush and uncounted and self._failure is None:
            # The trap of a loop that never calls step(): rounds never end, nothing is applied.
            logger.warning(
                "acco_hooks: close(): %d parameter gradients from backward() passes that no "
                "step() counted were never applied (%d updates in all): call step() after every "
                "backward()", uncounted, self.num_updates,
            )  # fmt: skip
        try:
            if self._in_flight is not None and self._failure is None:
                self._finish_in_flight(apply=flush and self._in_flight.plan.job is Job.UPDATE)
        except (ACCOCommunicationError, FloatingPointError):
            pass  # already reported to the training loop by the call that failed
        finally:
            for handle in self._hook_handles:
                handle.remove()
            self._hook_handles = []
            self.clear_placeholders()
            ownership.release(self)
            if barrier and self._failure is None and self.process_groups:
                self._meet_peers()
            self._release()
            # Drop the last references too: the groups' C++ objects go now, not at exit. A
            # result not applied above is dropped for good (a later flush() applies nothing).
            self._groups = None
            self._in_flight = None

    def _meet_peers(self) -> None:
        try:
            self._run_on_thread(barrier_each, self.process_groups)
        except Exception:  # a peer died meanwhile: tear down anyway
            logger.warning("acco_hooks: close(): a peer never reached the barrier", exc_info=True)

    def __enter__(self) -> ACCOEngine:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.close(flush=exc_type is None, barrier=exc_type is None)


# ---------------------------------------------------------------- releasing


def _release(worker: CommWorker, groups: EngineGroups) -> None:
    """What an engine holds outside itself: the thread, its groups, its parameters' claim."""
    release_communication(worker, groups)
    ownership.release(None)  # the claims of engines that are gone


def _release_if_fatal(groups: EngineGroups, exc: BaseException) -> bool:
    """The worker thread's ``on_failure``: a failed job ends the engine (the training loop
    raises ``ACCOCommunicationError``), and its groups go at once, on the thread, so that the
    peers blocked on this rank fail now rather than when this process exits. Not torchft's
    :class:`GroupFellBehind`: that group takes a live group's state and trains on."""
    if isinstance(exc, GroupFellBehind):
        return False
    groups.release()
    return True
