"""The communication side of the engine: its thread, the thread's process groups, and the job
the thread runs for each round.

**The thread.** One background thread (:class:`CommWorker`) runs each round's job while the
training loop goes on. Why not async collectives from the training loop: gloo's ``Work``
objects cannot be polled (``is_completed()`` stays False until ``wait()``) and have no futures,
so the chain reduce-scatter -> shard step -> all-gather cannot be driven from the main thread
without blocking it. A thread that runs the chain with blocking collectives overlaps 0.91-0.97
of the communication on a bandwidth-capped link; torch ops and gloo collectives release the
GIL, so the training loop keeps running. On CUDA the thread runs its work on a side stream of
its own. Two events order it with the training loop: a job starts (on that stream) after the
work the caller had queued when it submitted the job, and the job's future completes only once
its device work has finished, not once its kernels and collectives are queued. NCCL
collectives return to the host as soon as they are enqueued, so a future set at that point
would say "done" while the all-gather still runs: ``accumulate_until_ready`` would end rounds
early and the advisor would time the enqueueing.

**Its process groups.** Two threads issuing collectives on one group deadlock, and
``init_device_mesh`` hands out the WORLD group for a dimension that spans every rank: the
thread therefore never shares a group with the training loop. The engine builds up to four
groups for it, and one for the training loop (once, in the same order on every rank), and
destroys them when it closes:

- ``data``: the data-parallel ranks: reduce-scatter and all-gather;
- ``count``: the ranks whose gradients make up one averaged gradient (with HSDP every FSDP
  shard of every replica): the micro-batch weights and the "non-finite" flags are summed there;
- ``norm``: the ranks whose shards make up the whole model (times tensor/pipeline parallel
  ranks): the squared gradient norm is summed there, and a round with a non-finite gradient in
  any part of the model is skipped by every part;
- ``pieces`` (only where a replica splits parameters that an optimizer steps whole: FSDP, tensor
  parallelism): the ranks of this replica that hold their pieces, over which each such
  matrix's pieces are brought to its owner and sent back (``whole_pieces``);
- ``replica`` (the training loop's; only under ``accumulate_until_ready``): the ranks of one
  model replica where it spans several (FSDP shards, tensor-parallel ranks, pipeline stages):
  they agree there after each micro-batch whether to run another, so that they run the same
  ones.

Every rank's rank sets are gathered first, except in a fake world (torch's ``fake`` backend,
torchtitan's ``--comm.mode fake_backend``: one rank of a job measured at its real shape), whose
other ranks do not exist: its groups are those of this rank alone, and an HSDP grid is
assumed to be a ``DeviceMesh``'s.

**One round's job** (:func:`communicate`), as the round's :class:`RoundPlan` says::

    reduce-scatter Σ gradients ─► ÷ global weight ─► clip ─► UPDATE: step the shard optimizer
                                                             ESTIMATE: Peek (no state changes)
                               ─► all-gather the new shard (θ_{t+1} or θ̃_{t+1})

Split inside a replica (FSDP, tensor parallelism), matrices stepped whole are brought to their
owners after the clip and sent back before the all-gather (``whole_pieces``).

An estimate sent narrower than the update (``estimate_dtype``) travels as encoded bytes both
ways and gathers θ̃ − θ instead of θ̃ (``wire``). Under a torchft manager the reduce-scattered
shard and the round's weights are then summed over the replica groups (``replicas``).

Only this thread touches the shard side of the buffers (``shard_sum``, ``master``,
``gather_input``), the shard optimizer and the engine's process groups while a job runs; the
training loop reads ``gathered`` once the job's future is done.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import logging
import math
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.profiler import record_function

from acco_hooks.engine.buffers import GroupBuffers
from acco_hooks.engine.collectives import all_gather, reduce_scatter_sum
from acco_hooks.engine.peek import peek
from acco_hooks.engine.replicas import ReplicaGroups
from acco_hooks.engine.whole_pieces import piece_ranks
from acco_hooks.engine.wire import (
    WireFormat,
    all_gather_difference,
    reduce_scatter_encoded,
)

__all__ = ["ACCOCommunicationError", "CommWorker", "EngineGroups", "Job", "RoundPlan",
           "RoundResult", "all_gather_into", "all_gather_shards", "barrier_each",
           "broadcast_from_first_rank",
           "build_engine_groups", "communicate", "reduce_scatter_accumulators",
           "release_communication"]  # fmt: skip

logger = logging.getLogger(__name__)


class ACCOCommunicationError(RuntimeError):
    """A round's communication failed (a peer died or hung, a collective or the shard step
    raised). Every rank of the group fails its round the same way: a collective cannot complete
    without all its ranks. The engine cannot continue: restart from the last complete checkpoint.
    """


# --------------------------------------------------------------------------------- the thread

# How often a waiting training loop re-checks that the worker thread is still alive.
_LIVENESS_POLL_S = 1.0


class CommWorker:
    """A FIFO of jobs executed in order on one daemon thread.

    Every job's outcome (its return value or any exception, ``BaseException`` included) is
    delivered through the ``Future`` returned by :meth:`submit`, so a failure on the
    communication side always reaches the training loop instead of killing the thread silently.

    A failed job's exception is handed to ``on_failure`` first. When it says the failure is
    fatal, the groups it used are gone (see :meth:`EngineGroups.release`) and every later job
    fails at once with the first failure named. The locals of the failed job's frames are
    dropped too (the traceback keeps its lines): they hold the groups and a ring step's pending
    receive, and a gloo group closes its sockets only when nothing holds it any more.

    Args:
        device: the device the jobs compute on. For CUDA the jobs run on a dedicated stream,
            and the thread makes ``device`` its current device (the CUDA current device is
            per thread: a new thread would otherwise allocate on device 0).
        name: the thread's name (shows up in ``py-spy`` dumps and tracebacks).
        on_failure: called on the thread with a failed job's exception; returns whether the
            failure is fatal (``None``: every failure is, and nothing is released).
    """

    __slots__ = ("_jobs", "_thread", "_stream", "_closed", "_on_failure", "_fatal")

    def __init__(
        self, device: torch.device, name: str = "acco-comm",
        on_failure: Callable[[BaseException], bool] | None = None,
    ) -> None:  # fmt: skip
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stream = None
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            self._stream = torch.cuda.Stream(torch.device("cuda", index))
        self._closed = False
        self._on_failure = on_failure
        self._fatal: str | None = None  # the first fatal failure, as the later jobs' error names it
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)``; return the future of its result.

        On CUDA the job waits (on the worker's stream) for all work already queued on the
        caller's current stream, so buffers the caller just wrote are complete when it reads
        them. The future completes once the job's device work has finished (the thread waits
        for an event recorded after it), so ``future.done()`` means the result is in memory;
        :meth:`wait` also orders the caller's stream after the worker's.
        """
        if self._closed:
            raise RuntimeError("acco_hooks: the communication worker is closed")
        future: Future = Future()
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._stream.device))
        self._jobs.put((future, fn, args, ready))
        return future

    def wait(self, future: Future, timeout_s: float | None = None) -> Any:
        """Block until ``future`` is done and return its result (re-raising its exception).

        Re-checks every second that the worker thread is alive, so a dead worker can never
        leave the training loop waiting forever. ``timeout_s`` bounds the whole wait.
        """
        waited = 0.0
        while True:
            try:
                result = future.result(timeout=_LIVENESS_POLL_S)
                break
            except FutureTimeoutError:  # the builtin TimeoutError only from Python 3.11
                waited += _LIVENESS_POLL_S
                if not self._thread.is_alive():
                    raise RuntimeError(
                        "acco_hooks: the communication worker thread died without reporting "
                        "an error; the in-flight round is lost"
                    ) from None
                if timeout_s is not None and waited >= timeout_s:
                    raise TimeoutError(
                        f"acco_hooks: communication did not finish within {timeout_s:.0f} s; "
                        "a peer rank is probably dead or stuck"
                    ) from None
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        return result

    def close(self, timeout_s: float = 60.0) -> None:
        """Let the thread finish the queued jobs, exit, and join it. Idempotent.

        Joining matters: a process that tears down its process groups while this thread is
        still alive can abort in gloo's destructors.
        """
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        if self._stream is not None:
            torch.cuda.set_device(self._stream.device)
        while True:
            item = self._jobs.get()
            if item is None:
                return
            future, fn, args, ready = item
            if not future.set_running_or_notify_cancel():
                continue
            if self._fatal is not None:
                future.set_exception(ACCOCommunicationError(
                    f"acco_hooks: an earlier communication job failed ({self._fatal}); the "
                    "engine's process groups are destroyed and it runs nothing more"
                ))  # fmt: skip
                continue
            try:
                if self._stream is not None:
                    result = self._run_on_stream(fn, args, ready)
                else:
                    result = fn(*args)
            except BaseException as exc:  # every failure must reach the loop
                logger.debug("acco_hooks: communication job failed", exc_info=True)
                self._fail(future, exc)
            else:
                future.set_result(result)

    def _fail(self, future: Future, exc: BaseException) -> None:
        try:
            fatal = self._on_failure is None or self._on_failure(exc)
        except BaseException:  # the job's own error must still reach the loop
            logger.warning("acco_hooks: releasing after a failed job failed too", exc_info=True)
            fatal = True
        if fatal:
            self._fatal = f"{type(exc).__name__}: {exc}".splitlines()[0]
            _drop_frame_locals(exc)
        future.set_exception(exc)

    def _run_on_stream(self, fn: Callable[..., Any], args: tuple, ready: Any) -> Any:
        """Run ``fn(*args)`` on the stream after ``ready``; return when its device work is done."""
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            result = fn(*args)
        # blocking: the thread sleeps until the device gets there instead of spinning on a core
        # the training loop needs.
        finished = torch.cuda.Event(blocking=True)
        finished.record(self._stream)
        finished.synchronize()
        return result


def _drop_frame_locals(exc: BaseException) -> None:
    """Clear the locals of every finished frame in ``exc``'s traceback and its causes' (what a
    traceback prints stays: files, lines, the message)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


# ------------------------------------------------------------------------- its process groups

@dataclasses.dataclass
class EngineGroups:
    """The engine's groups (``None``: a single local worker) and its place in them.

    The one holder of the engine's process groups (nothing else keeps them), so that
    :meth:`release` can let them go while the engine object lives on.
    """

    data: dist.ProcessGroup | None
    count: dist.ProcessGroup | None
    norm: dist.ProcessGroup | None
    data_parallel_ranks: tuple[int, ...]
    world_size: int
    rank: int
    fsdp_world_size: int
    fsdp_ranks: tuple[int, ...] = ()  # HSDP: the global ranks FSDP shards this replica over
    # Parameters stepped whole that a replica splits (FSDP, tensor parallelism): the global
    # ranks that hold their pieces (``whole_pieces.piece_ranks``), the worker's group over them,
    # and this rank's index in it
    piece_ranks: tuple[int, ...] = ()
    pieces: dist.ProcessGroup | None = None
    piece_rank: int = 0
    # torchft: this group is one replica group of several, summed over through their manager
    replicas: ReplicaGroups | None = None
    # The ranks of this model replica (its FSDP shards, tensor-parallel ranks and pipeline
    # stages), where it spans several: under accumulate_until_ready they agree after each
    # micro-batch whether to run another. Used by the training thread between micro-batches,
    # never by the worker.
    replica: dist.ProcessGroup | None = None
    released: bool = False

    @property
    def owned(self) -> tuple[dist.ProcessGroup, ...]:
        """Each group once, in creation order: what :meth:`release` destroys."""
        return tuple(dict.fromkeys(g for g in (self.data, self.count, self.norm, self.pieces,
                                               self.replica) if g is not None))  # fmt: skip

    def replica_waits(self, in_flight: bool, device: torch.device) -> bool:
        """Whether this model replica's communication is still in flight on any of its ranks:
        every rank of the replica gets the same answer, and runs another micro-batch or ends
        the round with the others (one all-reduce of one value over the replica's own ranks,
        the fast link inside a node)."""
        if self.replica is None:
            return in_flight
        on = device if dist.get_backend(self.replica) != dist.Backend.GLOO else torch.device("cpu")
        flag = torch.tensor([1.0 if in_flight else 0.0], device=on)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.replica)
        return bool(flag.item())

    def release(self) -> None:
        """Destroy the groups and drop them. Idempotent.

        Destroying alone leaves a gloo group's sockets open while anything holds it: a peer
        blocked in a ring receive from this rank would then wait out its timeout after this
        rank's round failed. Once the last reference goes, the peer's receive fails at once
        ("Connection closed by peer"), and the failure travels round the ring in milliseconds.
        """
        owned, self.released = self.owned, True
        self.data = self.count = self.norm = self.pieces = self.replica = None
        if not dist.is_available() or not dist.is_initialized():
            return  # the user already destroyed every group, ours included
        for group in owned:
            try:
                dist.destroy_process_group(group)
            except ValueError:
                pass  # destroyed already


def build_engine_groups(
    process_group: Any, fsdp_process_group: Any, norm_process_group: Any, timeout: float | None,
    replicas: ReplicaGroups | None = None, until_ready: bool = False,
    whole_parameters: Sequence[Tensor] = (),
) -> EngineGroups:  # fmt: skip
    """Dedicated copies of the data-parallel, count and norm groups (see the module docstring),
    over the ranks that hold pieces of the ``whole_parameters`` (the parameters stepped whole)
    a group of those ranks, and with ``until_ready`` (``accumulate_until_ready``) the
    replica's own group."""
    fsdp_ranks: tuple[int, ...] = ()
    if fsdp_process_group is not None:
        fsdp_ranks = _ranks_of(fsdp_process_group)
        if fsdp_ranks is None:
            raise ValueError("acco_hooks: fsdp_process_group needs torch.distributed to be initialized")
    # refused before any group exists: parameters split over several sets of ranks
    split_over = piece_ranks(whole_parameters, fsdp_ranks)
    data_parallel_ranks = _ranks_of(process_group)
    data = _dedicated_group(data_parallel_ranks, timeout)
    count, count_ranks, fsdp_world_size = data, data_parallel_ranks, 1
    if fsdp_process_group is not None:
        fsdp_world_size = len(fsdp_ranks)
        count_ranks = _product_ranks(data_parallel_ranks, fsdp_ranks)
        count = _dedicated_group(count_ranks, timeout)
    pieces = None
    if data_parallel_ranks is not None:  # on every rank: a pipeline stage may step none whole
        pieces = _dedicated_group(split_over, timeout, shared_only=True)
    norm_ranks = None if norm_process_group is None else _ranks_of(norm_process_group)
    norm = count if norm_ranks is None else _dedicated_group(norm_ranks, timeout)
    replica = None
    if until_ready and (norm_ranks is not None or fsdp_world_size > 1):  # several ranks a replica
        model_ranks = count_ranks if norm_ranks is None else norm_ranks
        replica = _dedicated_group(_replica_ranks(data_parallel_ranks, model_ranks), timeout)
    return EngineGroups(
        data=data, count=count, norm=norm, data_parallel_ranks=data_parallel_ranks or (0,),
        world_size=1 if data is None else dist.get_world_size(data),
        rank=0 if data is None else dist.get_rank(data), fsdp_world_size=fsdp_world_size,
        fsdp_ranks=fsdp_ranks, piece_ranks=split_over if pieces is not None else (),
        pieces=pieces, piece_rank=0 if pieces is None else dist.get_rank(pieces),
        replicas=replicas, replica=replica,
    )  # fmt: skip


def _ranks_of(process_group: Any) -> tuple[int, ...] | None:
    """The sorted global ranks of a ``ProcessGroup`` or 1-D ``DeviceMesh``.

    ``None`` (and no ``torch.distributed``): a single local worker, returned as ``None``.
    """
    if process_group is not None and hasattr(process_group, "get_group"):  # a DeviceMesh
        if process_group.ndim != 1:
            raise ValueError(
                f"acco_hooks: got a {process_group.ndim}-D DeviceMesh; pass one dimension of it, "
                "e.g. mesh['dp_replicate']"
            )
        process_group = process_group.get_group()
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        process_group = dist.group.WORLD
    return tuple(sorted(dist.get_process_group_ranks(process_group)))


def _product_ranks(
    data_parallel_ranks: tuple[int, ...] | None, fsdp_ranks: tuple[int, ...]
) -> tuple[int, ...]:
    """The ranks of the data-parallel × FSDP grid through this rank.

    Every rank gathers every rank's two groups; the grid is the union of the FSDP groups of
    this rank's data-parallel peers (the same set on every rank of the grid).
    """
    data_parallel_ranks = data_parallel_ranks or (dist.get_rank(),)
    if fake_world():
        # no peer to ask: in a DeviceMesh a peer's FSDP group is this rank's, shifted by the
        # distance between the two ranks
        offsets = [r - dist.get_rank() for r in fsdp_ranks]
        return tuple(sorted({peer + o for peer in data_parallel_ranks for o in offsets}))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (dist.get_rank(), fsdp_ranks))
    fsdp_of = dict(every)
    return tuple(sorted({r for peer in data_parallel_ranks for r in fsdp_of[peer]}))


def _replica_ranks(
    data_parallel_ranks: tuple[int, ...] | None, model_ranks: tuple[int, ...]
) -> tuple[int, ...]:
    """The ranks of this rank's model replica: those of ``model_ranks`` (the ranks that hold
    the model, every replica's) that sit where this rank sits in their data-parallel group.

    A data-parallel group holds one rank of each replica, in the replicas' order (a
    ``DeviceMesh``'s ``dp_replicate`` dimension: its ranks sorted are its coordinates), so a
    rank's place in its group is the index of its replica, whatever other dimensions (FSDP,
    tensor, pipeline) split a replica.
    """
    me = dist.get_rank()
    place = (data_parallel_ranks or (me,)).index(me)
    if fake_world():
        return (me,)  # no peer to ask, and no peer to agree with
    places: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(places, place)
    return tuple(r for r in model_ranks if places[r] == place)


def fake_world() -> bool:
    """Whether this process is one rank of a world whose other ranks do not exist: torch's
    ``fake`` backend, whose collectives return at once and move nothing."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "fake"


def _dedicated_group(
    my_ranks: tuple[int, ...] | None, timeout: float | None = None, shared_only: bool = False
) -> dist.ProcessGroup | None:
    """A new process group over ``my_ranks``, for the worker thread alone.

    ``new_group`` must be called by every rank for every group in the same order: the rank sets
    of every rank are gathered first. ``shared_only``: no group of fewer than two ranks (this
    rank then gets ``None``).
    """
    if my_ranks is None:
        return None  # a single local worker
    every_ranks: list[Any] = [my_ranks]  # in a fake world, every rank there is
    if not fake_world():
        every_ranks = [None] * dist.get_world_size()
        dist.all_gather_object(every_ranks, my_ranks)
    mine = None
    for ranks in sorted(set(map(tuple, every_ranks))):
        if shared_only and len(ranks) < 2:
            continue
        group = dist.new_group(
            list(ranks), timeout=None if timeout is None else datetime.timedelta(seconds=timeout)
        )
        if ranks == my_ranks:
            mine = group
    return mine


def barrier_each(groups: tuple[dist.ProcessGroup, ...]) -> None:
    for group in groups:  # the same order on every rank: the order they were created in
        dist.barrier(group=group)


def release_communication(worker: CommWorker, groups: EngineGroups) -> None:
    """Join the worker thread, then destroy the groups it was the only user of."""
    worker.close()
    groups.release()


@torch.no_grad()
def broadcast_from_first_rank(params: list[Tensor], group: dist.ProcessGroup) -> None:
    """Start every replica from the first rank's parameters, as DDP does."""
    src = dist.get_global_rank(group, 0)
    for p in params:
        dist.broadcast(p.detach(), src=src, group=group)


# ---------------------------------------------------------------------------- one round's job

class Job(enum.Enum):
    """What one round's communication computes from its averaged gradient."""

    UPDATE = "update"  # θ_{t+1} = Opt(θ_t, g): the optimizer state and LR schedule advance
    ESTIMATE = "estimate"  # θ̃_{t+1} = Peek(θ_t, g): nothing advances


class RoundPlan(NamedTuple):
    """What one round's communication does, decided once at the round end by the training loop
    and taken whole by :func:`communicate`."""

    job: Job
    local_count: float  # this rank's Σ micro-batch weights in the payload
    round_index: int = 0  # the round whose gradients it carries
    unit_weights: bool = True  # every micro-batch in this rank's payload weighed exactly 1
    # An estimate sent narrower than the update (``estimate_dtype``): its gradients are
    # reduce-scattered in this format and θ̃ − θ is all-gathered in it. None: the reduce dtype,
    # and the job gathers the new parameters themselves.
    wire: WireFormat | None = None
    # acco with the estimate in the reduce dtype: the estimate job keeps its reduce-scattered
    # ΣG̃ on the shard side, and the update job adds it (``adds_carried``).
    carry: bool = False
    # The training loop's side: the accumulators keep this round's gradients (and the local
    # count its weight) for the update round to send, as after a narrow estimate.
    keeps_accumulator: bool = False
    carried_count: float = 0.0  # c̃, the carried ΣG̃'s weight over every rank (an update)
    # Resumed on another world: the weight an update round had on the saved one; ΣG̃ and c̃
    # are multiplied by this round's own weight over it. None: kept as they are.
    reweigh_carried: float | None = None
    # mode="auto": the schedule this rank wants next; the first rank of the norm group's
    # proposal comes back to every rank as ``RoundResult.schedule_choice``.
    proposal: int | None = None
    # A gradient may be missing on some ranks (DDP's find_unused_parameters): per parameter in
    # layout order, 1.0 if one reached this rank in the round. Summed over the ranks, a 0
    # names a parameter no rank trained, and nothing is stepped. None: every rank checked its
    # own at the round end.
    arrived: tuple[float, ...] | None = None

    @property
    def adds_carried(self) -> bool:
        """An update that averages the carried ΣG̃ in."""
        return self.carry and self.job is Job.UPDATE


class RoundResult(NamedTuple):
    """What a finished job reports to the training loop."""

    global_count: float  # Σ micro-batch weights over every rank of the averaged gradient
    grad_norm: float | None  # before clipping; None without max_grad_norm
    nonfinite: bool  # NaN/Inf in the averaged gradient: nothing was stepped, θ was re-gathered
    updated: bool  # the shard optimizer stepped (a real update θ_t -> θ_{t+1})
    comm_s: float  # how long the job took on the communication thread
    difference: bool = False  # ``gathered`` holds θ̃ − θ (a narrow estimate), to add to θ
    schedule_choice: int | None = None  # mode="auto": the schedule every rank runs next
    unit_weights: bool = True  # every micro-batch of every rank's payload weighed exactly 1
    # parameters no rank got a gradient for (``RoundPlan.arrived``): nothing was stepped
    untrained: tuple[str, ...] = ()
    # the advisor's first rounds: the slowest and the fastest rank's compute per micro-batch
    # over the count group (``microbatch_speed_range``); None in the other rounds
    microbatch_s_range: tuple[float, float] | None = None


def round_weights(
    local_count: float, unit_weights: bool, arrived: tuple[float, ...] | None,
    device: torch.device,
) -> Tensor:  # fmt: skip
    """What a rank's payload carries beside its gradient sums, summed with them: its weight
    (``RoundPlan.local_count``), a "not every weight was 1" flag and ``RoundPlan.arrived``.
    A torchft group that joins inside a round sends this shape, all zeros (nothing)."""
    flag = 0.0 if unit_weights else 1.0
    return torch.tensor([local_count, flag, *(arrived or ())], dtype=torch.float64, device=device)


def microbatch_speed_range(
    seconds: float, group: dist.ProcessGroup, device: torch.device,
) -> tuple[float, float] | None:  # fmt: skip
    """The slowest and the fastest compute per micro-batch over ``group`` (one MAX all-reduce).

    Args:
        seconds: this rank's mean compute per micro-batch in the round; NaN if it timed none.
        group: the ranks that hold the same part of the model (the count group): their
            micro-batches are the same work, so their times differ only by their speed.
        device: where the collective's tensor lives.

    Returns:
        ``(slowest, fastest)`` seconds, or None if no rank timed a micro-batch.
    """
    timed = not math.isnan(seconds)
    both = torch.tensor([seconds if timed else -math.inf, -seconds if timed else -math.inf],
                        dtype=torch.float64, device=device)  # fmt: skip
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    slowest, fastest = both[0].item(), -both[1].item()
    return None if slowest == -math.inf else (slowest, fastest)


def communicate(
    plan: RoundPlan, buffers: list[GroupBuffers], groups: EngineGroups,
    optimizer: torch.optim.Optimizer, lr_scheduler: Any, max_grad_norm: float | None,
    microbatch_s: float | None = None,
) -> RoundResult:  # fmt: skip
    """reduce-scatter -> average -> clip -> step or estimate -> all-gather, as ``plan`` says.

    Without ``plan.carry``, an acco update round's payload holds both rounds' sum already (the
    accumulators were not zeroed after a narrow estimate). ``microbatch_s``: in the advisor's
    first rounds (every rank of the count group passes one in the same rounds), this rank's
    compute per micro-batch, from which the slowest and the fastest rank's are found.
    """
    job, wire = plan.job, plan.wire
    start = time.perf_counter()
    with record_function("acco::reduce_scatter"):
        for g in buffers:
            if wire is not None:
                reduce_scatter_encoded(g.shard_sum, g.comm_input, wire, g.wire_tail,
                                       g.wire_front, groups.data)  # fmt: skip
            elif groups.data is None:
                g.shard_sum.copy_(g.comm_input)
            else:
                reduce_scatter_sum(g.shard_sum, g.comm_input, groups.data)
    device = buffers[0].master.device
    weights = round_weights(plan.local_count, plan.unit_weights, plan.arrived, device)
    proposal = plan.proposal
    if groups.replicas is not None:  # torchft: rank r's shard and weights, over the groups
        with record_function("acco::sum_over_replicas"):
            _, decided = groups.replicas.sum(
                [g.shard_sum for g in buffers] + [weights], plan.round_index,
                [g.master for g in buffers], proposal,
            )  # fmt: skip
        # auto: the deciding group's proposal; none (it joins in this round): keep the schedule
        proposal = None if proposal is None else decided
    # acco: the estimate round's sum ΣG̃ stays here for the update round, which adds it: the
    # update averages both rounds, and no rank keeps a model-sized carry between rounds.
    carried = [g.carried for g in buffers] if plan.carry else []
    if carried and job is Job.ESTIMATE:
        torch._foreach_copy_(carried, [g.shard_sum for g in buffers])
    add_carried = bool(carried) and job is Job.UPDATE
    # The count, a "my shard has NaN/Inf" flag and a "not every weight was 1" flag travel
    # together: every rank then agrees on whether to skip, although each has seen only its own
    # shard (a NaN estimate round also skips the update that carries it), and knows whether
    # the weights are means of micro-batches (what a resharded resume reweighs).
    sums = [g.shard_sum for g in buffers] + (carried if add_carried else [])
    finite = all(bool(torch.isfinite(t).all()) for t in sums)
    counts = torch.cat([weights[:1], weights.new_tensor([0.0 if finite else 1.0]), weights[1:]])
    if groups.count is not None:
        dist.all_reduce(counts, group=groups.count)
    speeds = None
    if microbatch_s is not None and groups.count is not None:
        speeds = microbatch_speed_range(microbatch_s, groups.count, device)
    round_count, nonfinite = counts[0].item(), counts[1].item() > 0
    unit_weights = counts[2].item() == 0
    names = [name for g in buffers for name in g.names]
    untrained = tuple(name for name, n in zip(names, counts[3:].tolist()) if n == 0)
    if groups.norm is not groups.count:
        # Tensor or pipeline parallelism: the count group holds one part of the model, and
        # every part must skip a non-finite round together, or the parts step apart.
        flag = torch.tensor([1.0 if nonfinite else 0.0], dtype=torch.float64, device=device)
        dist.all_reduce(flag, group=groups.norm)
        nonfinite = flag.item() > 0
    global_count = round_count
    if add_carried:
        reweigh = plan.reweigh_carried
        scale = 1.0 if reweigh is None else round_count / reweigh
        if scale != 1.0:
            torch._foreach_mul_(carried, scale)
        global_count += plan.carried_count * scale
    choice = None if proposal is None else _agree(proposal, groups.norm, device)
    if nonfinite or untrained:  # every rank: no step, no estimate; the live parameters become θ
        if wire is not None:  # they hold θ already: add a zero difference, send nothing
            for g in buffers:
                g.gathered.zero_()
        else:
            for g in buffers:
                g.gather_input.copy_(g.master)
            with record_function("acco::all_gather"):
                all_gather_shards(buffers, groups)
        return RoundResult(global_count, None, nonfinite, False, time.perf_counter() - start,
                           wire is not None, choice, unit_weights, untrained, speeds)  # fmt: skip
    if global_count <= 0:
        raise RuntimeError(
            "acco_hooks: no rank contributed a micro-batch to this round (the global count "
            "is 0); at least one rank must run a real micro-batch in every round"
        )

    grads = []
    for g in buffers:
        if g.shard_sum.dtype == torch.float32:  # average in place: no shard-sized copy
            total = g.shard_sum
        else:
            if g.master.grad is None or g.master.grad is g.shard_sum:
                g.master.grad = torch.empty_like(g.master)
            total = g.master.grad.copy_(g.shard_sum)
        if add_carried:
            total.add_(g.carried)
        g.master.grad = total.div_(global_count)
        grads.append(g.master.grad)
        if g.layout.whole and g.exchange is None:  # each parameter it owns, in its shape
            for param, grad in zip(g.stepped, g.shard_views(total)):
                param.grad = grad
    grad_norm = None
    if max_grad_norm is not None:
        grad_norm = _clip_(grads, buffers, max_grad_norm, groups.norm)
    for g in buffers:  # split in a replica: each matrix stepped whole onto its owner
        if g.exchange is not None:
            with record_function("acco::gather_whole"):
                g.exchange.gather(g.master.grad, [p.grad for p in g.stepped], groups.pieces)

    if job is Job.UPDATE:
        with record_function("acco::shard_step"):
            optimizer.step()
            if lr_scheduler is not None:
                lr_scheduler.step()
        for g in buffers:  # split in a replica: the new values' pieces back
            if g.exchange is not None:
                with record_function("acco::scatter_whole"):
                    g.exchange.scatter(g.stepped, g.master, groups.pieces)
        for g in buffers:
            g.gather_input.copy_(g.master)
    elif wire is not None:  # θ̃ − θ, narrow: θ stays exact on every rank
        with record_function("acco::estimate_step"):
            _estimate(optimizer, buffers, "difference", groups)
        with record_function("acco::all_gather"):
            for g in buffers:
                all_gather_difference(g.gathered, g.difference.sub_(g.master), wire,
                                      g.encoded_shard, g.wire_tail, groups.data)  # fmt: skip
        return RoundResult(global_count, grad_norm, False, False, time.perf_counter() - start,
                           True, choice, unit_weights, (), speeds)  # fmt: skip
    else:
        with record_function("acco::estimate_step"):
            _estimate(optimizer, buffers, "gather_input", groups)
    with record_function("acco::all_gather"):
        all_gather_shards(buffers, groups)
    return RoundResult(global_count, grad_norm, False, job is Job.UPDATE,
                       time.perf_counter() - start, False, choice, unit_weights, (),
                       speeds)  # fmt: skip


def _estimate(
    optimizer: torch.optim.Optimizer, buffers: list[GroupBuffers], name: str, groups: EngineGroups
) -> None:  # fmt: skip
    """θ̃ into each group's shard buffer ``name``: the estimate step writes it there (flat), or
    into its view per parameter this rank owns (whole parameters; the rest of the buffer, the
    padding, becomes the master's), or split inside a replica into whole temporaries on the owners, whose
    pieces are then sent back into every rank's buffer (``whole_pieces``)."""
    outputs, wholes = [], []
    for g in buffers:
        shard = getattr(g, name)
        if g.layout.whole:
            shard.copy_(g.master)
        if g.exchange is None:
            outputs += g.shard_views(shard)
        else:
            wholes.append((g, shard, [torch.empty_like(p) for p in g.stepped]))
            outputs += wholes[-1][2]
    peek(optimizer, outputs)
    for g, shard, estimates in wholes:
        g.exchange.scatter(estimates, shard, groups.pieces)


def gather_whole_masters(buffers: list[GroupBuffers], groups: EngineGroups) -> None:
    """Split inside a replica, each whole-stepped parameter's fp32 master on its owner = the
    pieces of the masters of its piece peers (after they were set: built, reset, loaded)."""
    for g in buffers:
        if g.exchange is not None:
            g.exchange.gather(g.master, g.stepped, groups.pieces)


def _agree(proposal: int, group: dist.ProcessGroup | None, device: torch.device) -> int:
    """The proposal of ``group``'s first rank, on every rank of it."""
    if group is None:
        return proposal
    mine = float(proposal) if dist.get_rank(group) == 0 else 0.0
    choice = torch.tensor([mine], dtype=torch.float64, device=device)
    dist.all_reduce(choice, group=group)
    return int(choice.item())


def _clip_(
    grads: list[Tensor], buffers: list[GroupBuffers], max_norm: float,
    norm_group: dist.ProcessGroup | None,
) -> float:  # fmt: skip
    """Clip the averaged gradient to ``max_norm`` (global L2 norm, as torch does)."""
    terms = []
    for g, grad in zip(buffers, grads):
        terms.append(grad.double().pow(2).sum())
        for start, end, discount in g.norm_discounts:  # replicated: count each value once
            terms.append(-discount * grad[start:end].double().pow(2).sum())
    sq = torch.stack(terms).sum().reshape(1)
    if norm_group is not None:
        dist.all_reduce(sq, group=norm_group)
    norm = sq.sqrt().float().squeeze(0)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(grads, coef)
    return norm.item()


def reduce_scatter_accumulators(
    outputs: list[Tensor], buffers: list[GroupBuffers], groups: EngineGroups
) -> None:
    """``outputs`` (fp32 shards) = this rank's shard of every rank's accumulator, summed: the
    ΣG̃ an estimate round sent narrower left in the accumulators, as the carried half-batch
    an estimate in the reduce dtype would have been (a checkpoint's, ``ACCOEngine.state_dict``)."""
    for out, g in zip(outputs, buffers):
        if groups.data is None:
            out.copy_(g.accumulator[: g.shard_numel])
        else:
            reduce_scatter_sum(out, g.accumulator, groups.data)


def all_gather_into(outputs: list[Tensor], shards: list[Tensor], groups: EngineGroups) -> None:
    """``outputs[i]`` = every rank's ``shards[i]``, end to end (one per parameter group)."""
    for out, shard in zip(outputs, shards):
        if groups.data is None:
            out.copy_(shard)
        else:
            all_gather(out, shard, groups.data)


def all_gather_shards(buffers: list[GroupBuffers], groups: EngineGroups) -> None:
    """``gathered`` = every rank's ``gather_input``, end to end."""
    if groups.data is None:
        for g in buffers:
            g.gathered.copy_(g.gather_input)
        return
    for g in buffers:
        all_gather(g.gathered, g.gather_input, groups.data)
