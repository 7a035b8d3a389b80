"""The ACCO engine: the round schedule of a sharded (ZeRO-1) optimizer that overlaps communication.

This module is the one place where the algorithm's schedule lives; the front-ends
(``ACCOOptimizer``, the DDP hook, the torchtitan and Hugging Face trainers) only feed it
gradients and call :meth:`ACCOEngine.microbatch_done`. The contract is
``shared/spec/acco-algorithm.md``. What it stands on, each in a module of its own:
``_buffers`` (the flat buffer layout and its memory), ``_groups`` (the process groups of its
thread), ``_comm_job`` (what the thread computes), ``_round_checks`` (what a round end refuses),
``_engine_state`` (the checkpoint format), ``_lifecycle`` (``real_weights()`` and ``close()``).

The round timeline (``acco`` mode; G̃ is computed at the estimate θ̃, G at the real θ)::

    round   compute side (main thread)   communication side (worker thread)         live after
    -----   -------------------------    -----------------------------------------  ----------
      0     acc = G̃_0 at θ_0             (nothing in flight)                        θ_0
      1     acc = G_0 at θ_0             θ̃_1 = Peek(θ_0, ΣG̃_0 / Σc̃_0); keep ΣG̃_0     θ̃_1
      2     acc = G̃_1 at θ̃_1             θ_1 = Opt(θ_0, (ΣG̃_0 + ΣG_0) / Σ(c̃_0+c_0))  θ_1
      3     acc = G_1 at θ_1             θ̃_2 = Peek(θ_1, ΣG̃_1 / Σc̃_1); keep ΣG̃_1     θ̃_2
      …

Follow one gradient. ``backward()`` produces it; a post-accumulate-grad hook adds it to the
fp32 accumulator (:meth:`ACCOEngine.accumulate_grad`) and drops ``.grad``. The front-end then
calls :meth:`~ACCOEngine.microbatch_done`, which counts the micro-batch; the round ends after
``accumulation_steps`` of them (or later, with ``accumulate_until_ready``, while the previous
round still communicates). At the round end (:meth:`~ACCOEngine._end_round`) the main thread

1. waits for the communication launched at the end of the previous round and copies its
   all-gathered result into the model: it becomes the live parameters of the next round;
2. copies the accumulator into the communication buffer and zeroes it (in ``acco`` the
   estimate round's job keeps its reduce-scattered sum ΣG̃ on the shard side, and the update
   round's job adds it: every update averages two rounds of gradients);
3. hands that payload to the worker thread: reduce-scatter -> divide by the global weight ->
   clip -> step (or Peek) this rank's 1/N fp32 master shard -> all-gather (``_comm_job``);
4. returns at once: the next round's micro-batches run while the network works.

``dpu`` does the same with a real step every round and no carry; ``ddp`` waits for its own
payload at once (synchronous ZeRO-1).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from acco_hooks._buffers import build_shard, local_tensor
from acco_hooks._comm_job import ACCOCommunicationError, Job, RoundResult, communicate
from acco_hooks._config import (
    MODES,
    NONFINITE_POLICIES,
    REDUCE_DTYPES,
    normalize_param_groups,
    real_updates,
    validate_config,
)
from acco_hooks._engine_state import EngineStateMixin
from acco_hooks._groups import (
    broadcast_from_first_rank,
    build_engine_groups,
    release_communication,
)
from acco_hooks._lifecycle import EngineLifecycleMixin
from acco_hooks._round_checks import (
    check_round_inputs,
    nonfinite_error,
    sparse_gradient_error,
    warn_skipped_round,
)
from acco_hooks._worker import CommWorker
from acco_hooks.advisor import Advisor
from acco_hooks.peek import has_functional_peek

__all__ = ["ACCOCommunicationError", "ACCOEngine", "MODES", "NONFINITE_POLICIES",
           "REDUCE_DTYPES", "real_updates"]  # fmt: skip

logger = logging.getLogger(__name__)


class ACCOEngine(EngineStateMixin, EngineLifecycleMixin):
    """Sharded optimizer with ACCO, DPU or synchronous ZeRO-1 rounds over one process group.

    A front-end feeds it each micro-batch's gradients (:meth:`accumulate_grad`, or the hooks of
    :meth:`hook_param_grads`), then calls :meth:`microbatch_done`; the engine decides when a
    round ends and runs each round's communication on a background thread. Its arguments are
    :class:`acco_hooks.ACCOOptimizer`'s, which documents them, and two for 3-D and HSDP runs:
    ``norm_process_group`` (every rank whose shards make up the model, for the global gradient
    norm: data-parallel × tensor/pipeline-parallel ranks) and ``fsdp_process_group`` (the ranks
    over which FSDP2 shards each replica: gradients then arrive summed over it, and the engine
    shards each local FSDP shard again over ``process_group``).
    """

    __slots__ = (
        "mode", "accumulation_steps", "accumulate_until_ready", "reduce_dtype", "max_grad_norm",
        "nonfinite", "timeout", "device",
        # The worker thread's process groups, and this rank's place in them
        "_groups", "world_size", "rank", "fsdp_world_size",
        # Buffers (one per parameter group) and the shard optimizer
        "_buffers", "_slot_of", "_frozen", "optimizer", "lr_scheduler",
        # The worker thread, the gradient hooks, and what close() (or a finalizer) releases
        "_worker", "_hook_handles", "_release", "__weakref__",
        # The round in flight (launched, not yet applied), and the failure that stopped the engine
        "_in_flight", "_in_flight_job", "_in_flight_round", "_in_flight_seen", "_failure",
        # Round bookkeeping (saved in checkpoints), and statistics of the last round for logging
        "round_index", "num_updates", "skipped_rounds", "_round_microbatches", "_local_count",
        "_grad_arrived", "grads_received", "last_wait_s", "last_round_microbatches",
        "last_global_count", "last_grad_norm",
        # The advisor's clocks: when this round and this micro-batch started, and whether a
        # communication was in flight when the micro-batch started
        "advisor", "_round_started", "_microbatch_started", "_microbatch_overlapped",
    )  # fmt: skip

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer],
        *,
        mode: str = "acco",
        process_group: Any = None,
        accumulation_steps: int = 1,
        accumulate_until_ready: bool = False,
        reduce_dtype: torch.dtype | None = None,
        max_grad_norm: float | None = None,
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        norm_process_group: Any = None,
        fsdp_process_group: Any = None,
        nonfinite: str = "skip",
        timeout: float | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        validate_config(
            optimizer_class, mode, accumulation_steps, accumulate_until_ready, reduce_dtype,
            max_grad_norm, lr_scheduler, nonfinite, timeout, fsdp_process_group,
        )  # fmt: skip
        self.mode, self.nonfinite, self.timeout = mode, nonfinite, timeout
        self.accumulation_steps = accumulation_steps
        self.accumulate_until_ready = accumulate_until_ready
        self.reduce_dtype = reduce_dtype or torch.float32
        self.max_grad_norm = max_grad_norm
        param_groups, self._frozen = normalize_param_groups(params)
        self.device = param_groups[0]["params"][0].device

        # No local name holds the groups: a traceback through here must not keep them alive.
        self._groups = build_engine_groups(
            process_group, fsdp_process_group, norm_process_group, timeout
        )
        self.world_size, self.rank = self._groups.world_size, self._groups.rank
        self.fsdp_world_size = self._groups.fsdp_world_size
        self._worker = CommWorker(self.device)
        self._hook_handles: list[Any] = []
        # Every group built above is this engine's alone; close() destroys them. An engine its
        # owner never closes is released when it is garbage-collected or at interpreter exit:
        # a gloo group destructed during interpreter finalization can abort the process.
        self._release = weakref.finalize(
            self, release_communication, self._worker, self._groups.owned
        )
        try:
            if self._groups.data is not None:  # every replica starts from the first rank's
                broadcast_from_first_rank(
                    [local_tensor(p) for g in param_groups for p in g["params"]], self._groups.data
                )
            self._buffers, self.optimizer, self.lr_scheduler = build_shard(
                param_groups, self.world_size, self.rank, self._groups.data_parallel_ranks,
                self.reduce_dtype, mode == "acco", optimizer_class, optimizer_kwargs, lr_scheduler,
            )  # fmt: skip
        except BaseException:
            self._release()  # e.g. a bad optimizer argument: the groups go now, not at exit
            self._groups = None
            raise
        self._slot_of = {
            p: (gi, pi) for gi, g in enumerate(self._buffers) for pi, p in enumerate(g.params)
        }
        self._in_flight: Future | None = None
        self._in_flight_job: Job | None = None
        self._in_flight_round, self._in_flight_seen = -1, False  # seen: state_dict() read it
        self._failure: ACCOCommunicationError | None = None
        self.round_index = self.num_updates = self.skipped_rounds = 0
        self._round_microbatches, self._local_count = 0, 0.0
        self._grad_arrived = [[False] * len(g.params) for g in self._buffers]
        self.grads_received = 0  # parameter gradients taken in so far, for front-ends' checks
        # measures K, C and the round time; predicts ACCO's per-token speedup
        self.advisor = Advisor(accumulation_steps, overlapping=mode != "ddp")
        self._round_started: float | None = None
        self._microbatch_started: float | None = None
        self._microbatch_overlapped = False
        self.last_wait_s, self.last_round_microbatches = 0.0, 0
        self.last_global_count, self.last_grad_norm = 0.0, None
        logger.info(
            "acco_hooks: mode=%s world_size=%d fsdp_world_size=%d accumulation_steps=%d "
            "until_ready=%s reduce_dtype=%s max_grad_norm=%s %s (%s estimate), %d params",
            mode, self.world_size, self.fsdp_world_size, accumulation_steps,
            accumulate_until_ready, self.reduce_dtype, max_grad_norm, optimizer_class.__name__,
            "functional" if has_functional_peek(self.optimizer) else "snapshot", len(self._slot_of),
        )  # fmt: skip

    # ------------------------------------------------------------ gradients in (main thread)

    @property
    def params(self) -> list[Tensor]:
        """The model parameters the engine trains, in layout order."""
        return [p for g in self._buffers for p in g.params]

    def accumulate_grad(self, param: Tensor, grad: Tensor) -> None:
        """Add one micro-batch gradient of ``param`` to the fp32 accumulator."""
        try:
            gi, pi = self._slot_of[param]
        except KeyError:
            raise KeyError(
                "acco_hooks: accumulate_grad: this tensor is not one of the engine's parameters"
            ) from None
        if grad.layout != torch.strided:  # nn.Embedding(sparse=True), a sparse matmul, ...
            raise sparse_gradient_error(self._buffers[gi].names[pi], grad.layout)
        if isinstance(grad, DTensor):
            if grad.placements != param.placements:  # e.g. Partial sums over tensor-parallel ranks
                grad = grad.redistribute(grad.device_mesh, param.placements)
            grad = grad.to_local()
        self._buffers[gi].accumulator_views[pi].add_(grad)
        self._grad_arrived[gi][pi] = True
        self.grads_received += 1

    # ------------------------------------------------------------ the round schedule

    @property
    def microbatches_in_round(self) -> int:
        """Micro-batches counted so far in the round being accumulated."""
        return self._round_microbatches

    @property
    def communication_in_flight(self) -> bool:
        """Whether a round's communication was launched and has not finished yet.

        On CUDA "finished" means its device work is done, not only enqueued: the worker's
        future completes after an event recorded behind the all-gather (``_worker``).
        """
        return self._in_flight is not None and not self._in_flight.done()

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

    def skip_microbatch(self) -> bool:
        """Count a micro-batch that contributes nothing, e.g. on a rank that ran out of data.

        Keeps this rank's rounds (and so its collectives) in step with the other ranks; the
        averaged gradient is taken over the ranks that did contribute.
        """
        for arrived in self._grad_arrived:
            arrived[:] = [True] * len(arrived)
        return self._count_microbatch(0.0)

    def _count_microbatch(self, weight: float) -> bool:
        self._raise_if_failed()
        if self._microbatch_started is not None:  # the advisor's K: this micro-batch's compute
            elapsed = time.perf_counter() - self._microbatch_started
            self.advisor.record_microbatch(elapsed, communicating=self._microbatch_overlapped)
        try:
            return self._count_or_end_round(weight)
        finally:  # the next micro-batch's compute starts now
            self._microbatch_started = time.perf_counter()
            self._microbatch_overlapped = self.communication_in_flight

    def _count_or_end_round(self, weight: float) -> bool:
        if self.mode == "ddp" and self._in_flight is not None:
            # A step() interrupted while it waited for its own round: this call completes it.
            self._finish_in_flight(apply=True)
            return True
        counted = (self._round_microbatches, self._local_count)
        self._round_microbatches += 1
        self._local_count += weight
        if self._round_microbatches < self.accumulation_steps:
            return False
        if self.accumulate_until_ready and self.communication_in_flight:
            return False  # the caller runs another micro-batch while the network works
        round_index = self.round_index
        try:
            self._end_round()
        except BaseException:
            if self.round_index == round_index and self._failure is None:
                # Interrupted before the round was launched (while waiting for the previous
                # one): nothing was lost, the call can be repeated.
                self._round_microbatches, self._local_count = counted
            raise
        return True

    def _end_round(self) -> None:
        check_round_inputs(self._buffers, self._grad_arrived, self.round_index, self._frozen)
        start = time.perf_counter()
        self._finish_in_flight(apply=True)  # 1. the previous round's result becomes live
        self.last_wait_s = time.perf_counter() - start

        # 2. the payload; the accumulator restarts. acco's update round averages both halves:
        #    its job adds the estimate round's reduce-scattered ΣG̃, kept on the shard side, and
        #    its count c̃ stays in the local count.
        estimate = self.mode == "acco" and self.round_index % 2 == 0
        for g in self._buffers:
            g.comm_input.copy_(g.accumulator)
            g.accumulator.zero_()
        count = self._local_count
        if not estimate:
            self._local_count = 0.0
        # 3. launch: reduce-scatter -> step or Peek -> all-gather, on the worker thread
        job = Job.ESTIMATE if estimate else Job.UPDATE
        self._in_flight = self._worker.submit(
            communicate, job, count, self._buffers, self._groups, self.optimizer,
            self.lr_scheduler, self.max_grad_norm,
        )  # fmt: skip
        self._in_flight_job, self._in_flight_seen = job, False
        self._in_flight_round = self.round_index

        self.last_round_microbatches = self._round_microbatches
        self._round_microbatches = 0
        self.round_index += 1
        for arrived in self._grad_arrived:
            arrived[:] = [False] * len(arrived)
        if self.mode == "ddp":  # synchronous: its own result is the next round's parameters
            self._finish_in_flight(apply=True)
        # 4. return: the next round computes while the network works
        now = time.perf_counter()
        if self._round_started is not None:  # round end to round end, for the advisor
            self.advisor.record_round(now - self._round_started, self.last_round_microbatches)
        self._round_started = now

    def _finish_in_flight(self, apply: bool) -> None:
        """Wait for the in-flight communication; with ``apply``, its result becomes live."""
        if self._in_flight is None:
            return
        if self._failure is not None:
            raise self._failure
        # Backstop only: a dead peer fails the collective within the group's timeout.
        backstop = None if self.timeout is None else self.timeout + 60.0
        try:
            result = self._worker.wait(self._in_flight, timeout_s=backstop)
        except Exception as exc:  # not KeyboardInterrupt: the communication itself goes on
            self._failure = ACCOCommunicationError(
                f"acco_hooks: the communication of round {self._in_flight_round} failed on rank "
                f"{self.rank} of the data-parallel group: {type(exc).__name__}: {exc}. The other "
                "ranks fail their round too; restart from the last complete checkpoint"
            )
            raise self._failure from exc
        if result is not None and not self._in_flight_seen:  # None: a re-gather after a load
            self._in_flight_seen = True
            self._take_result(result)
        if apply:
            with torch.no_grad():
                for g in self._buffers:
                    g.copy_gathered_into_params()
            self._in_flight = self._in_flight_job = None

    def _take_result(self, result: RoundResult) -> None:
        self.last_global_count, self.last_grad_norm = result.global_count, result.grad_norm
        self.num_updates += result.updated
        self.advisor.record_comm(result.comm_s)
        if not result.nonfinite:
            return
        what = "update" if self._in_flight_job is Job.UPDATE else "estimate"
        if self.nonfinite == "raise":
            self._failure = ACCOCommunicationError(
                f"acco_hooks: non-finite gradient (NaN/Inf) in round {self._in_flight_round}; "
                "nonfinite='raise'"
            )
            raise nonfinite_error(self._in_flight_round, what)
        self.skipped_rounds += 1
        warn_skipped_round(self._in_flight_round, what, self.skipped_rounds)

    def _raise_if_failed(self) -> None:
        """Raise at once if a round's communication failed, even before the round end."""
        if self.closed:
            raise RuntimeError(
                "acco_hooks: the engine is closed (close() ran, or its with-block ended); "
                "build a new optimizer to train on"
            )
        if self._failure is not None:
            raise self._failure
        if self._in_flight is not None and self._in_flight.done() and self._in_flight.exception():
            self._finish_in_flight(apply=False)
