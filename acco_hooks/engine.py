"""The ACCO engine: the round schedule of a sharded (ZeRO-1) optimizer that overlaps communication.

This module is the one place where the algorithm's schedule lives; the front-ends
(``ACCOOptimizer``, the DDP hook, the torchtitan and Hugging Face trainers) only feed it
gradients and call :meth:`ACCOEngine.microbatch_done`. The contract is
``shared/spec/acco-algorithm.md``. What it stands on, each in a module of its own:
``_buffers`` (the flat buffer layout), ``_groups`` (the process groups of its thread),
``_comm_job`` (what the thread computes), ``_engine_state`` (the checkpoint format).

The round timeline (``acco`` mode; G̃ is computed at the estimate θ̃, G at the real θ)::

    round   compute side (main thread)          communication side (worker thread)    live after
    -----   --------------------------------    ----------------------------------   ----------
      0     acc  = G̃_0 at θ_0                   (nothing in flight)                   θ_0
      1     acc += G_0 at θ_0   (carry G̃_0)     θ̃_1 = Peek(θ_0, ΣG̃_0 / Σc̃_0)          θ̃_1
      2     acc  = G̃_1 at θ̃_1                   θ_1 = Opt(θ_0, Σ(G̃_0+G_0) / Σ(c̃_0+c_0)) θ_1
      3     acc += G_1 at θ_1   (carry G̃_1)     θ̃_2 = Peek(θ_1, ΣG̃_1 / Σc̃_1)          θ̃_2
      …

Follow one gradient. ``backward()`` produces it; a post-accumulate-grad hook adds it to the
fp32 accumulator (:meth:`ACCOEngine.accumulate_grad`) and drops ``.grad``. The front-end then
calls :meth:`~ACCOEngine.microbatch_done`, which counts the micro-batch; the round ends after
``accumulation_steps`` of them (or later, with ``accumulate_until_ready``, while the previous
round still communicates). At the round end (:meth:`~ACCOEngine._end_round`) the main thread

1. waits for the communication launched at the end of the previous round and copies its
   all-gathered result into the model: it becomes the live parameters of the next round;
2. copies the accumulator into the communication buffer (``acco`` keeps the accumulator after
   an estimate round: G̃ is carried into the update);
3. hands that payload to the worker thread: reduce-scatter -> divide by the global weight ->
   clip -> step (or Peek) this rank's 1/N fp32 master shard -> all-gather (``_comm_job``);
4. returns at once: the next round's micro-batches run while the network works.

``dpu`` does the same with a real step every round and no carry; ``ddp`` waits for its own
payload at once (synchronous ZeRO-1).

Memory per rank for Φ parameters (model in dtype d, AdamW): the model (Φ·d), the fp32
accumulator (4Φ), one communication buffer shared by the reduce-scatter input and the
all-gather output (Φ·max(reduce dtype, d)), and the 1/N shard: fp32 master + optimizer state +
reduce/gather staging (≈ 20Φ/N). The estimate step adds no memory for AdamW, Adam and SGD.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from acco_hooks._buffers import GroupBuffers, local_tensor, memory_bytes
from acco_hooks._comm_job import Job, RoundResult, communicate
from acco_hooks._config import (
    MODES,
    NONFINITE_POLICIES,
    REDUCE_DTYPES,
    normalize_param_groups,
    validate_config,
)
from acco_hooks._engine_state import EngineStateMixin
from acco_hooks._groups import (
    barrier_each,
    broadcast_from_first_rank,
    build_engine_groups,
    release_communication,
)
from acco_hooks.peek import has_functional_peek
from acco_hooks._worker import CommWorker

__all__ = ["ACCOCommunicationError", "ACCOEngine", "MODES", "NONFINITE_POLICIES",
           "REDUCE_DTYPES", "real_updates"]  # fmt: skip

logger = logging.getLogger(__name__)


def real_updates(mode: str, rounds: int) -> int:
    """Real optimizer updates in ``rounds`` rounds: every other round in ``acco``, every round
    in ``dpu`` and ``ddp``. Schedules counted in updates use it."""
    return rounds // 2 if mode == "acco" else rounds


class ACCOCommunicationError(RuntimeError):
    """A round's communication failed (a peer died or hung, a collective or the shard step
    raised). Every rank of the group fails its round the same way: a collective cannot complete
    without all its ranks. The engine cannot continue: restart from the last complete checkpoint.
    """


class ACCOEngine(EngineStateMixin):
    r"""Sharded optimizer with ACCO, DPU or synchronous ZeRO-1 rounds over one process group.

    A front-end feeds it each micro-batch's parameter gradients (:meth:`accumulate_grad`, or
    the hooks of :meth:`hook_param_grads`) and then calls :meth:`microbatch_done`; the engine
    decides when a round ends and runs the communication of each round on a background thread.
    See the module docstring for the timeline and ``ACCOOptimizer`` for the user-facing
    documentation of every argument.

    Args:
        params, optimizer_class, mode, process_group, accumulation_steps,
        accumulate_until_ready, reduce_dtype, max_grad_norm, lr_scheduler, nonfinite, timeout,
        \*\*optimizer_kwargs: as for :class:`acco_hooks.ACCOOptimizer`, which documents them.
        norm_process_group: the ranks whose shards make up the whole model, for the global
            gradient norm: the data-parallel group times the tensor/pipeline-parallel ranks
            (with TP, replicated parameters count once). Default: the data-parallel group (times
            ``fsdp_process_group``).
        fsdp_process_group: HSDP: the ranks over which FSDP2 shards each model replica (a
            ``ProcessGroup`` or 1-D ``DeviceMesh``). ``params`` are then FSDP's sharded
            parameters, whose gradients arrive reduce-scattered and *summed* over this group;
            the engine shards each local FSDP shard again over ``process_group`` and sums the
            micro-batch weights and the skip decision over both groups. Default: no FSDP.
    """

    __slots__ = (
        # Configuration
        "mode", "accumulation_steps", "accumulate_until_ready", "reduce_dtype", "max_grad_norm",
        "nonfinite", "timeout", "device",
        # The process groups of the worker thread, and this rank's place in them
        "_groups", "world_size", "rank", "fsdp_world_size",
        # Buffers (one per parameter group) and the shard optimizer
        "_buffers", "_slot_of", "optimizer", "lr_scheduler",
        # The worker thread, the gradient hooks, and what close() (or a finalizer) releases
        "_worker", "_hook_handles", "_release", "__weakref__",
        # The round in flight (launched, not yet applied), and the failure that stopped the engine
        "_in_flight", "_in_flight_job", "_in_flight_round", "_in_flight_seen", "_failure",
        # Round bookkeeping (saved in checkpoints)
        "round_index", "num_updates", "skipped_rounds", "_round_microbatches", "_local_count",
        "_grad_arrived",
        # Statistics of the last round, for logging
        "last_wait_s", "last_round_microbatches", "last_global_count", "last_grad_norm",
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
        param_groups = normalize_param_groups(params)
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
            self._build_shard(param_groups, optimizer_class, optimizer_kwargs, lr_scheduler)
        except BaseException:
            self._release()  # e.g. a bad optimizer argument: the groups go now, not at exit
            self._groups = None  # type: ignore[assignment]
            raise
        self._in_flight: Future | None = None
        self._in_flight_job: Job | None = None
        self._in_flight_round = -1
        self._in_flight_seen = False  # its result was read (state_dict() waits early)
        self._failure: ACCOCommunicationError | None = None
        self.round_index = self.num_updates = self.skipped_rounds = 0
        self._round_microbatches, self._local_count = 0, 0.0
        self._grad_arrived = [[False] * len(g.params) for g in self._buffers]
        self.last_wait_s, self.last_round_microbatches = 0.0, 0
        self.last_global_count, self.last_grad_norm = 0.0, None
        logger.info(
            "acco_hooks: mode=%s world_size=%d fsdp_world_size=%d accumulation_steps=%d "
            "accumulate_until_ready=%s reduce_dtype=%s max_grad_norm=%s optimizer=%s (estimate: "
            "%s), %d params in %d groups",
            mode, self.world_size, self.fsdp_world_size, accumulation_steps,
            accumulate_until_ready, self.reduce_dtype, max_grad_norm, optimizer_class.__name__,
            "functional" if has_functional_peek(self.optimizer) else "snapshot-and-restore",
            len(self._slot_of), len(self._buffers),
        )  # fmt: skip

    def _build_shard(
        self, param_groups: list[dict[str, Any]], optimizer_class: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any], lr_scheduler: Callable[..., Any] | None,
    ) -> None:  # fmt: skip
        """Every replica starts from the first rank's parameters; lay out the buffers; build the
        shard optimizer over this rank's fp32 master shard."""
        if self._groups.data is not None:
            broadcast_from_first_rank(
                [local_tensor(p) for g in param_groups for p in g["params"]], self._groups.data
            )
        self._buffers = [
            GroupBuffers(g["params"], g["names"], self.world_size, self.rank, self.reduce_dtype,
                         self._groups.data_parallel_ranks)  # fmt: skip
            for g in param_groups
        ]
        self._slot_of = {
            p: (gi, pi) for gi, g in enumerate(self._buffers) for pi, p in enumerate(g.params)
        }
        shard_groups = [
            {**{k: v for k, v in g.items() if k not in ("params", "names")}, "params": [b.master]}
            for g, b in zip(param_groups, self._buffers)
        ]
        self.optimizer = optimizer_class(shard_groups, **optimizer_kwargs)
        self.lr_scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None else None

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
        if isinstance(grad, DTensor):
            if grad.placements != param.placements:  # e.g. Partial sums over tensor-parallel ranks
                grad = grad.redistribute(grad.device_mesh, param.placements)
            grad = grad.to_local()
        self._buffers[gi].accumulator_views[pi].add_(grad)
        self._grad_arrived[gi][pi] = True

    def hook_param_grads(self, on_grad: Callable[[Tensor], None] | None = None) -> None:
        """Register a post-accumulate-grad hook on every parameter; :meth:`close` removes them.

        Args:
            on_grad: what the hook does with the parameter. Default: hand ``.grad`` to
                :meth:`accumulate_grad` and drop it, so ``.grad`` is ``None`` after backward.
                The DDP hook passes its own (DDP's buckets deliver the gradients there).
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

        self._hook_handles += [p.register_post_accumulate_grad_hook(on_grad) for p in self.params]

    # ------------------------------------------------------------ the round schedule

    @property
    def microbatches_in_round(self) -> int:
        """Micro-batches counted so far in the round being accumulated."""
        return self._round_microbatches

    @property
    def communication_in_flight(self) -> bool:
        """Whether a round's communication was launched and has not finished yet."""
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
        self._check_round_inputs()
        start = time.perf_counter()
        self._finish_in_flight(apply=True)  # 1. the previous round's result becomes live
        self.last_wait_s = time.perf_counter() - start

        # 2. the payload: acco carries G̃ into the update round; everything else restarts
        estimate = self.mode == "acco" and self.round_index % 2 == 0
        for g in self._buffers:
            g.comm_input.copy_(g.accumulator)
            if not estimate:
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
        if not result.nonfinite:
            return
        what = "update" if self._in_flight_job is Job.UPDATE else "estimate"
        if self.nonfinite == "raise":
            self._failure = ACCOCommunicationError(
                f"acco_hooks: non-finite gradient (NaN/Inf) in round {self._in_flight_round}; "
                "nonfinite='raise'"
            )
            raise FloatingPointError(
                f"acco_hooks: the averaged gradient of round {self._in_flight_round} has NaN/Inf "
                f"values (nonfinite='raise'); the {what} was not applied and the optimizer state "
                "is unchanged"
            )
        self.skipped_rounds += 1
        warnings.warn(
            f"acco_hooks: non-finite gradient (NaN/Inf) in round {self._in_flight_round}: every "
            f"rank skipped this {what}; the optimizer state and learning rate are unchanged "
            f"({self.skipped_rounds} rounds skipped so far)",
            RuntimeWarning,
            stacklevel=4,
        )

    def _check_round_inputs(self) -> None:
        """Every parameter got a gradient, and none was moved since the engine was built."""
        moved = [name for g in self._buffers for name in g.moved_params()]
        if moved:
            raise RuntimeError(
                f"acco_hooks: {_some(moved)} moved or changed dtype after the optimizer was "
                "built (model.to(), a dtype cast, param.data = ...): the engine holds views of "
                "the old memory and would train parameters the model no longer uses. Move or "
                "cast the model first, then build the optimizer"
            )
        missing = [
            g.names[pi]
            for g, arrived in zip(self._buffers, self._grad_arrived)
            for pi, ok in enumerate(arrived)
            if not ok
        ]
        if missing and len(missing) == len(self._slot_of):
            raise RuntimeError(
                f"acco_hooks: no gradient reached any parameter during round {self.round_index}: "
                "call loss.backward() before each step()"
            )
        if missing:
            raise RuntimeError(
                f"acco_hooks: no gradient reached {_some(missing)} during round "
                f"{self.round_index}. Every trained parameter must get a gradient in every "
                "round: run backward() before step(), and set requires_grad=False on parameters "
                "that are not trained (or leave them out of the optimizer's params)"
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
        if self._in_flight is not None and self._in_flight.done() and self._in_flight.exception():
            self._finish_in_flight(apply=False)

    # ------------------------------------------------------------ real weights, draining, closing

    def flush(self) -> None:
        """Wait for in-flight communication and leave the latest real parameters θ in the model.

        An estimate in flight is kept and applied at the next round end as usual (the model
        already holds the real θ it was computed from), so training may go on exactly. A real
        update in flight is applied now; training may go on from it (the next round then
        computes at θ_{t+1} where it would have used θ̃_{t+1}: the estimate is exact). Use
        :meth:`real_weights` to look at θ without changing the trajectory.
        """
        if self._in_flight is not None:
            self._finish_in_flight(apply=self._in_flight_job is Job.UPDATE)

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
        if self._in_flight is None or self._in_flight_job is not Job.UPDATE:
            yield None
            return
        self._finish_in_flight(apply=False)
        live = {n: t.clone() for g in self._buffers for n, t in zip(g.names, g.locals)}
        with torch.no_grad():
            for g in self._buffers:
                g.copy_gathered_into_params()
        try:
            yield live
        finally:
            with torch.no_grad():
                for g in self._buffers:
                    torch._foreach_copy_(g.locals, [live[n] for n in g.names])

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
        try:
            if self._in_flight is not None and self._failure is None:
                self._finish_in_flight(apply=flush and self._in_flight_job is Job.UPDATE)
        except (ACCOCommunicationError, FloatingPointError):
            pass  # already reported to the training loop by the call that failed
        finally:
            for handle in self._hook_handles:
                handle.remove()
            self._hook_handles = []
            if barrier and self._failure is None and self.process_groups:
                backstop = None if self.timeout is None else self.timeout + 60.0
                try:
                    self._worker.wait(self._worker.submit(barrier_each, self.process_groups),
                                      timeout_s=backstop)  # fmt: skip
                except Exception:  # noqa: BLE001 - a peer died meanwhile: tear down anyway
                    logger.warning("acco_hooks: close(): a peer never reached the barrier",
                                   exc_info=True)  # fmt: skip
            self._release()
            # Drop the last references too: the groups' C++ objects go now, not at exit. A
            # result not applied above is dropped for good (a later flush() applies nothing).
            self._groups = None  # type: ignore[assignment]
            self._in_flight = self._in_flight_job = None

    def __enter__(self) -> ACCOEngine:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.close(flush=exc_type is None, barrier=exc_type is None)

    # ------------------------------------------------------------ inspection

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds, by the categories of the spec's memory table."""
        return memory_bytes(self._buffers, self.optimizer, self.reduce_dtype)

    def _param_shapes(self) -> list[list[tuple[int, ...]]]:
        return [[tuple(p.shape) for p in g.params] for g in self._buffers]


def _some(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
