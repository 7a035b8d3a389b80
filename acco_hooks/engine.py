"""The ACCO engine: a sharded (ZeRO-1) optimizer whose communication overlaps the next rounds.

This module is the one place where the algorithm lives; the front-ends (``ACCOOptimizer`` for a
plain loop, the DDP hook, the torchtitan trainer) only feed it gradients and call
:meth:`ACCOEngine.microbatch_done`. The contract is ``shared/spec/acco-algorithm.md``.

The round timeline (``acco`` mode; G̃ is computed at the estimate θ̃, G at the real θ)::

    round   compute side (main thread)          communication side (worker thread)    live after
    -----   --------------------------------    ----------------------------------   ----------
      0     acc  = G̃_0 at θ_0                   (nothing in flight)                   θ_0
      1     acc += G_0 at θ_0   (carry G̃_0)     θ̃_1 = Peek(θ_0, ΣG̃_0 / Σc̃_0)          θ̃_1
      2     acc  = G̃_1 at θ̃_1                   θ_1 = Opt(θ_0, Σ(G̃_0+G_0) / Σ(c̃_0+c_0)) θ_1
      3     acc += G_1 at θ_1   (carry G̃_1)     θ̃_2 = Peek(θ_1, ΣG̃_1 / Σc̃_1)          θ̃_2
      …

At the end of every round the main thread (1) waits for the communication launched at the end
of the previous round, (2) copies its all-gathered result into the model (it becomes the live
parameters of the next round), (3) copies the accumulator into the communication buffer and
(4) hands that payload to the worker: reduce-scatter -> divide by the global count -> step (or
Peek) the local 1/N fp32 master shard -> all-gather. ``dpu`` does the same with a real step
every round and no carry; ``ddp`` waits for its own payload at once (synchronous ZeRO-1).

Memory per rank for Φ parameters (model in dtype d, AdamW): the model (Φ·d), the fp32
accumulator (4Φ), one communication buffer shared by the reduce-scatter input and the
all-gather output (Φ·max(reduce dtype, d)), and the 1/N shard: fp32 master + optimizer state +
reduce/gather staging (≈ 20Φ/N). The estimate step adds no memory for AdamW, Adam and SGD.
"""

from __future__ import annotations

import datetime
import enum
import logging
import math
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from acco_hooks._collectives import all_gather, reduce_scatter_sum
from acco_hooks._peek import has_functional_peek, peek
from acco_hooks._worker import CommWorker

__all__ = ["ACCOCommunicationError", "ACCOEngine", "MODES", "real_updates"]

logger = logging.getLogger(__name__)

MODES = ("acco", "dpu", "ddp")
NONFINITE_POLICIES = ("skip", "raise")
# Dtypes the collectives can sum on every backend (float8 has no add on CPU, integers no mean).
REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_STATE_VERSION = 1


def real_updates(mode: str, rounds: int) -> int:
    """Real optimizer updates in ``rounds`` rounds: every other round in ``acco``, every round
    in ``dpu`` and ``ddp``. Schedules counted in updates use it."""
    return rounds // 2 if mode == "acco" else rounds


class ACCOCommunicationError(RuntimeError):
    """A round's communication failed (a peer died or hung, a collective or the shard step
    raised). Every rank of the group fails its round the same way: a collective cannot complete
    without all its ranks. The engine cannot continue: restart from the last complete checkpoint.
    """


class _Job(enum.Enum):
    """What one round's communication computes from its averaged gradient."""

    UPDATE = "update"  # θ_{t+1} = Opt(θ_t, g): the optimizer state and LR schedule advance
    ESTIMATE = "estimate"  # θ̃_{t+1} = Peek(θ_t, g): nothing advances


class _GroupBuffers:
    """The flat, padded buffers of one parameter group, and their per-parameter views.

    The group's parameters are laid end to end in one flat vector padded with zeros to a
    multiple of the world size; rank r owns elements ``[r*shard, (r+1)*shard)`` of it.
    """

    __slots__ = (
        # Layout (``locals``: the tensors holding this rank's data; a DTensor's local shard)
        "params", "locals", "names", "padded_numel", "shard_numel", "gather_dtype",
        # Slices of this rank's shard whose squared norm counts less than once in the global
        # gradient norm: parameters replicated over a mesh dimension outside the data-parallel one
        "norm_discounts",
        # Full-size buffers (the compute side's accumulator; the payload / result buffer)
        "accumulator", "accumulator_views", "comm_input", "gathered", "gathered_views",
        # Shard-size buffers (the communication side)
        "shard_sum", "master", "gather_input",
    )  # fmt: skip

    def __init__(
        self, params: list[Tensor], names: list[str], world_size: int, rank: int,
        reduce_dtype: torch.dtype, data_parallel_ranks: tuple[int, ...],
    ) -> None:  # fmt: skip
        self.params, self.names = params, names
        self.locals = [_local(p) for p in params]
        device = self.locals[0].device
        numel = sum(t.numel() for t in self.locals)
        self.shard_numel = max(1, math.ceil(numel / world_size))
        self.padded_numel = self.shard_numel * world_size
        dtypes = {t.dtype for t in self.locals}
        self.gather_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        self.norm_discounts = _norm_discounts(
            params, self.locals, rank, self.shard_numel, data_parallel_ranks
        )

        # Gradients accumulate in fp32 whatever the model dtype; the padding stays zero.
        self.accumulator = torch.zeros(self.padded_numel, dtype=torch.float32, device=device)
        self.accumulator_views = _split(self.accumulator, self.locals)
        # The reduce-scatter reads the payload once, before the all-gather writes the new
        # parameters: one byte buffer serves as both, so ACCO costs one model-sized buffer.
        itemsize = max(reduce_dtype.itemsize, self.gather_dtype.itemsize)
        raw = torch.empty(self.padded_numel * itemsize, dtype=torch.uint8, device=device)
        self.comm_input = raw[: self.padded_numel * reduce_dtype.itemsize].view(reduce_dtype)
        self.gathered = raw[: self.padded_numel * self.gather_dtype.itemsize].view(
            self.gather_dtype
        )
        self.gathered_views = _split(self.gathered, self.locals)

        self.shard_sum = torch.empty(self.shard_numel, dtype=reduce_dtype, device=device)
        self.gather_input = torch.empty(self.shard_numel, dtype=self.gather_dtype, device=device)
        flat = torch.zeros(self.padded_numel, dtype=torch.float32, device=device)
        torch._foreach_copy_(_split(flat, self.locals), self.locals)
        start = rank * self.shard_numel
        self.master = flat[start : start + self.shard_numel].clone()

    def copy_gathered_into_params(self) -> None:
        if all(t.dtype == self.gather_dtype for t in self.locals):
            torch._foreach_copy_(self.locals, self.gathered_views)
        else:
            for t, view in zip(self.locals, self.gathered_views):
                t.copy_(view)


def _split(flat: Tensor, tensors: list[Tensor]) -> list[Tensor]:
    views, offset = [], 0
    for t in tensors:
        views.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return views


def _local(param: Tensor) -> Tensor:
    """The plain tensor that holds this rank's values of ``param`` (shares its storage)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    return local.detach()


def _replication(param: Tensor, data_parallel_ranks: tuple[int, ...]) -> int:
    """On how many ranks outside the data-parallel group a parameter's local values repeat.

    A DTensor replicated over a tensor-parallel mesh dimension repeats its values there. The
    replicate dimension of an HSDP mesh is the engine's own data-parallel group, whose ranks
    hold the same values by construction: it does not count.
    """
    if not isinstance(param, DTensor):
        return 1
    mesh = param.device_mesh
    return math.prod(
        mesh.size(dim) for dim, placement in enumerate(param.placements)
        if isinstance(placement, Replicate)
        and tuple(sorted(dist.get_process_group_ranks(mesh.get_group(dim)))) != data_parallel_ranks
    )  # fmt: skip


def _norm_discounts(
    params: list[Tensor], locals_: list[Tensor], rank: int, shard_numel: int,
    data_parallel_ranks: tuple[int, ...],
) -> list[tuple[int, int, float]]:  # fmt: skip
    """``(start, end, 1 - 1/replication)`` for shard slices of replicated parameters."""
    discounts, offset = [], 0
    shard_start, shard_end = rank * shard_numel, (rank + 1) * shard_numel
    for param, local in zip(params, locals_):
        replication = _replication(param, data_parallel_ranks)
        start, end = max(offset, shard_start), min(offset + local.numel(), shard_end)
        if replication > 1 and start < end:
            discounts.append((start - shard_start, end - shard_start, 1.0 - 1.0 / replication))
        offset += local.numel()
    return discounts


class ACCOEngine:
    r"""Sharded optimizer with ACCO, DPU or synchronous ZeRO-1 rounds over one process group.

    A front-end feeds it each micro-batch's parameter gradients (:meth:`accumulate_grad`) and
    then calls :meth:`microbatch_done`; the engine decides when a round ends and runs the
    communication of each round on a background thread. See the module docstring for the
    timeline and ``ACCOOptimizer`` for the user-facing documentation of every argument.

    Args:
        params: parameters or parameter-group dicts, as for any ``torch.optim.Optimizer``;
            ``(name, parameter)`` pairs are accepted and the names used in error messages.
            Parameters with ``requires_grad=False`` are left alone.
        optimizer_class: the ``torch.optim.Optimizer`` subclass stepped on the local shard.
        mode: ``"acco"``, ``"dpu"`` or ``"ddp"``.
        process_group: the data-parallel group (a ``ProcessGroup`` or a 1-D ``DeviceMesh``).
            ``None``: the default group, or a single local worker without ``torch.distributed``.
        accumulation_steps: micro-batches per round (the minimum, with
            ``accumulate_until_ready``).
        accumulate_until_ready: keep accumulating past ``accumulation_steps`` while the previous
            round's communication runs, instead of waiting for it.
        reduce_dtype: dtype of the gradient on the wire. Default: ``torch.float32``.
        max_grad_norm: clip the averaged gradient to this global L2 norm. Default: no clipping.
        lr_scheduler: ``callable(optimizer) -> LRScheduler``, built on the shard optimizer and
            stepped after every real update.
        nonfinite: what a round with a NaN/Inf in the averaged gradient does: ``"skip"`` (every
            rank skips that update, or that estimate and the update it belongs to, counts it in
            ``skipped_rounds`` and warns) or ``"raise"`` (``FloatingPointError``).
        timeout: seconds after which a collective of the engine's group fails (a hung peer).
            Default: the default process group's timeout.
        norm_process_group: the ranks whose shards make up the whole model, for the global
            gradient norm: the data-parallel group times the tensor/pipeline-parallel ranks
            (with TP, replicated parameters count once). Default: the data-parallel group (times
            ``fsdp_process_group``).
        fsdp_process_group: HSDP: the ranks over which FSDP2 shards each model replica (a
            ``ProcessGroup`` or 1-D ``DeviceMesh``, e.g. the intra-node ``fsdp`` dimension).
            ``params`` are then FSDP's sharded parameters, whose gradients arrive
            reduce-scattered and *summed* over this group (gradient divide factor 1); the
            engine shards each local FSDP shard again over ``process_group``, and sums the
            micro-batch weights and the skip decision over both groups. Default: no FSDP.
        **optimizer_kwargs: passed to ``optimizer_class``.
    """

    __slots__ = (
        # Configuration
        "mode", "accumulation_steps", "accumulate_until_ready", "reduce_dtype", "max_grad_norm",
        "nonfinite", "timeout",
        # Process groups (used by the worker thread only) and coordinates
        "_group", "_count_group", "_norm_group", "world_size", "rank", "fsdp_world_size",
        "device",
        # What close() (or, for an engine its owner forgot, the finalizer) releases
        "process_groups", "_release", "__weakref__",
        # Buffers and the shard optimizer
        "_groups", "_slot_of", "optimizer", "lr_scheduler",
        # In-flight work, and the failure that stopped the engine (if any)
        "_worker", "_in_flight", "_in_flight_job", "_in_flight_round", "_in_flight_seen",
        "_failure",
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
        _validate_config(
            optimizer_class, mode, accumulation_steps, accumulate_until_ready, reduce_dtype,
            max_grad_norm, lr_scheduler, nonfinite, timeout,
        )  # fmt: skip
        self.mode = mode
        self.nonfinite = nonfinite
        self.timeout = timeout
        self.accumulation_steps = accumulation_steps
        self.accumulate_until_ready = accumulate_until_ready
        self.reduce_dtype = reduce_dtype or torch.float32
        self.max_grad_norm = max_grad_norm

        groups = _normalize_param_groups(params)
        devices = {p.device for g in groups for p in g["params"]}
        if len(devices) != 1:
            raise ValueError(
                f"acco_hooks: parameters are on several devices {sorted(map(str, devices))}; "
                "move the whole model to one device before building the optimizer"
            )
        self.device = devices.pop()

        if fsdp_process_group is not None and accumulate_until_ready:
            raise ValueError(
                "acco_hooks: accumulate_until_ready=True cannot be combined with "
                "fsdp_process_group: the FSDP ranks of a replica reduce-scatter together, so they "
                "must run the same micro-batches; set accumulate_until_ready=False"
            )
        data_parallel_ranks = _ranks_of(process_group)
        self._group = _dedicated_group(data_parallel_ranks, timeout)
        # The ranks whose gradients make up one averaged gradient: the data-parallel group, or
        # with FSDP every shard of every replica. Their weights and NaN flags are summed.
        self._count_group, self.fsdp_world_size = self._group, 1
        if fsdp_process_group is not None:
            fsdp_ranks = _ranks_of(fsdp_process_group)
            if fsdp_ranks is None:
                raise ValueError(
                    "acco_hooks: fsdp_process_group needs torch.distributed to be initialized"
                )
            self.fsdp_world_size = len(fsdp_ranks)
            self._count_group = _dedicated_group(
                _product_ranks(data_parallel_ranks, fsdp_ranks), timeout
            )
        self._norm_group = (
            self._count_group
            if norm_process_group is None
            else _dedicated_group(_ranks_of(norm_process_group), timeout)
        )
        self.world_size = 1 if self._group is None else dist.get_world_size(self._group)
        self.rank = 0 if self._group is None else dist.get_rank(self._group)
        if self._group is not None:
            _broadcast_from_first_rank(
                [_local(p) for g in groups for p in g["params"]], self._group
            )

        self._groups = [
            _GroupBuffers(g["params"], g["names"], self.world_size, self.rank, self.reduce_dtype,
                          data_parallel_ranks or (0,))  # fmt: skip
            for g in groups
        ]
        self._slot_of = {
            p: (gi, pi) for gi, g in enumerate(self._groups) for pi, p in enumerate(g.params)
        }
        shard_groups = [
            {**{k: v for k, v in g.items() if k not in ("params", "names")}, "params": [b.master]}
            for g, b in zip(groups, self._groups)
        ]
        self.optimizer = optimizer_class(shard_groups, **optimizer_kwargs)
        self.lr_scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None else None

        self._worker = CommWorker(self.device)
        # Every group built above is this engine's alone; close() destroys them. An engine its
        # owner never closes is released when it is garbage-collected or at interpreter exit:
        # a gloo group destructed during interpreter finalization can abort the process.
        self.process_groups: tuple[dist.ProcessGroup, ...] = tuple(
            dict.fromkeys(
                g for g in (self._group, self._count_group, self._norm_group) if g is not None
            )
        )
        self._release = weakref.finalize(
            self, _release_communication, self._worker, self.process_groups
        )
        self._in_flight: Future | None = None
        self._in_flight_job: _Job | None = None
        self._in_flight_round = -1
        self._in_flight_seen = False  # its statistics were taken (state_dict() waits early)
        self._failure: ACCOCommunicationError | None = None
        self.round_index = 0
        self.num_updates = 0
        self.skipped_rounds = 0
        self._round_microbatches = 0
        self._local_count = 0.0
        self._grad_arrived = [[False] * len(g.params) for g in self._groups]
        self.last_wait_s = 0.0
        self.last_round_microbatches = 0
        self.last_global_count = 0.0
        self.last_grad_norm: float | None = None
        logger.info(
            "acco_hooks: mode=%s world_size=%d fsdp_world_size=%d accumulation_steps=%d "
            "accumulate_until_ready=%s reduce_dtype=%s max_grad_norm=%s optimizer=%s (estimate: "
            "%s), %d params in %d groups",
            mode, self.world_size, self.fsdp_world_size, accumulation_steps,
            accumulate_until_ready, self.reduce_dtype,
            max_grad_norm, optimizer_class.__name__,
            "functional" if has_functional_peek(self.optimizer) else "snapshot-and-restore",
            sum(len(g.params) for g in self._groups), len(self._groups),
        )  # fmt: skip

    # ---------------------------------------------------------------- compute side (main thread)

    @property
    def params(self) -> list[Tensor]:
        """The model parameters the engine trains, in layout order."""
        return [p for g in self._groups for p in g.params]

    @property
    def microbatches_in_round(self) -> int:
        """Micro-batches counted so far in the round being accumulated."""
        return self._round_microbatches

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
        self._groups[gi].accumulator_views[pi].add_(grad)
        self._grad_arrived[gi][pi] = True

    def hook_param_grads(self) -> list[Any]:
        """Move each gradient into the accumulator as soon as backward produces it.

        Registers a post-accumulate-grad hook on every parameter, which hands ``.grad`` to
        :meth:`accumulate_grad` and drops it, so ``.grad`` is ``None`` after backward.

        Returns:
            The hook handles (``handle.remove()`` detaches them).
        """

        # A weak reference: the parameters must not keep an engine its owner dropped alive (it
        # is then released, see close()); their gradients then stay in ``.grad`` as usual.
        engine_ref = weakref.ref(self)

        def move_grad_to_engine(param: Tensor) -> None:
            engine = engine_ref()
            if engine is not None:
                engine.accumulate_grad(param, param.grad)
                param.grad = None

        return [p.register_post_accumulate_grad_hook(move_grad_to_engine) for p in self.params]

    def microbatch_done(self, weight: float = 1.0) -> bool:
        """Count one micro-batch; end the round when it may. Returns whether a round ended.

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
        self._round_microbatches += 1
        self._local_count += weight
        if self._round_microbatches < self.accumulation_steps:
            return False
        if (
            self.accumulate_until_ready
            and self._in_flight is not None
            and not self._in_flight.done()
        ):
            return False  # the caller runs another micro-batch while the network works
        self._end_round()
        return True

    def _end_round(self) -> None:
        self._check_every_grad_arrived()
        start = time.perf_counter()
        self._finish_in_flight(apply=True)
        self.last_wait_s = time.perf_counter() - start

        estimate = self.mode == "acco" and self.round_index % 2 == 0
        for g in self._groups:
            g.comm_input.copy_(g.accumulator)
            if not estimate:  # acco carries G̃ into the next round; everything else restarts
                g.accumulator.zero_()
        count = self._local_count
        if not estimate:
            self._local_count = 0.0
        job = _Job.ESTIMATE if estimate else _Job.UPDATE
        self._in_flight = self._worker.submit(self._communicate, job, count)
        self._in_flight_job, self._in_flight_seen = job, False
        self._in_flight_round = self.round_index

        self.last_round_microbatches = self._round_microbatches
        self._round_microbatches = 0
        self.round_index += 1
        for arrived in self._grad_arrived:
            arrived[:] = [False] * len(arrived)
        if self.mode == "ddp":
            self._finish_in_flight(apply=True)

    def _check_every_grad_arrived(self) -> None:
        missing = [
            g.names[pi]
            for g, arrived in zip(self._groups, self._grad_arrived)
            for pi, ok in enumerate(arrived)
            if not ok
        ]
        if missing and len(missing) == sum(len(g.params) for g in self._groups):
            raise RuntimeError(
                f"acco_hooks: no gradient reached any parameter during round {self.round_index}: "
                "call loss.backward() before each step()"
            )
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise RuntimeError(
                f"acco_hooks: no gradient reached {shown} during round {self.round_index}. Every "
                "trained parameter must get a gradient in every round: run backward() before "
                "step(), and set requires_grad=False on parameters that are not trained (or leave "
                "them out of the optimizer's params)"
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

    def _finish_in_flight(self, apply: bool) -> None:
        """Wait for the in-flight communication; with ``apply``, its result becomes live."""
        if self._in_flight is None:
            return
        if self._failure is not None:
            raise self._failure
        # Backstop only: a dead peer fails the collective within the group's timeout.
        backstop = None if self.timeout is None else self.timeout + 60.0
        try:
            stats = self._worker.wait(self._in_flight, timeout_s=backstop)
        except BaseException as exc:
            self._failure = ACCOCommunicationError(
                f"acco_hooks: the communication of round {self._in_flight_round} failed on rank "
                f"{self.rank} of the data-parallel group: {type(exc).__name__}: {exc}. The other "
                "ranks fail their round too; restart from the last complete checkpoint"
            )
            raise self._failure from exc
        if stats is not None and not self._in_flight_seen:  # None: a re-gather after a load
            self._in_flight_seen = True
            self.last_global_count, self.last_grad_norm, nonfinite = stats
            if nonfinite:
                self._on_nonfinite()
        if apply:
            with torch.no_grad():
                for g in self._groups:
                    g.copy_gathered_into_params()
            self._in_flight = None
            self._in_flight_job = None

    def _on_nonfinite(self) -> None:
        what = "update" if self._in_flight_job is _Job.UPDATE else "estimate"
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

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds, by the categories of the spec's memory table."""

        def nbytes(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        state = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
        return {
            "model": nbytes(t for g in self._groups for t in g.locals),
            "grad_accumulator": nbytes(g.accumulator for g in self._groups),
            # comm_input and gathered share one byte buffer
            "comm_buffer": sum(
                g.padded_numel * max(self.reduce_dtype.itemsize, g.gather_dtype.itemsize)
                for g in self._groups
            ),
            "master_shard": nbytes(g.master for g in self._groups),
            "optimizer_state": nbytes(state),
            "shard_staging": nbytes({  # each tensor once: with fp32 on the wire the
                id(t): t                 # reduce-scatter output is the master's gradient
                for g in self._groups for t in (g.shard_sum, g.gather_input, g.master.grad)
                if t is not None
            }.values()),
        }

    @torch.no_grad()
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
        for g in self._groups:
            flat = torch.zeros(g.padded_numel, dtype=torch.float32, device=self.device)
            torch._foreach_copy_(_split(flat, g.locals), g.locals)
            g.master.copy_(flat[self.rank * g.shard_numel : (self.rank + 1) * g.shard_numel])

    def flush(self) -> None:
        """Wait for in-flight communication and leave the latest real parameters θ in the model.

        An estimate in flight is kept and applied at the next round end as usual (the model
        already holds the real θ it was computed from), so training may go on exactly. A real
        update in flight is applied now; training may go on from it (the next round then
        computes at θ_{t+1} where it would have used θ̃_{t+1}: the estimate is exact).
        """
        if self._in_flight is None:
            return
        self._finish_in_flight(apply=self._in_flight_job is _Job.UPDATE)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran: the thread is joined and the process groups destroyed."""
        return not self._release.alive

    def close(self, *, barrier: bool = True) -> None:
        """Drain the communication, stop its thread and destroy the engine's process groups.

        Args:
            barrier: meet the other ranks at a barrier on each of the engine's groups first,
                so that no rank tears a group down while a peer still finishes its last
                collective on it. Every rank must then call ``close()`` (as each one does when
                it ends training). Pass ``False`` when closing after an error on this rank
                alone: the peers then fail their next collective with a clear error instead
                of waiting. Skipped anyway after a communication failure.

        Idempotent; the engine runs no round afterwards. :attr:`closed` tells whether it ran.
        """
        if self.closed:
            return
        try:
            if self._in_flight is not None and self._failure is None:
                self._finish_in_flight(apply=False)
        except (ACCOCommunicationError, FloatingPointError):
            pass  # already reported to the training loop by the call that failed
        finally:
            if barrier and self._failure is None and self.process_groups:
                backstop = None if self.timeout is None else self.timeout + 60.0
                try:
                    peers_met = self._worker.submit(_barrier_each, self.process_groups)
                    self._worker.wait(peers_met, timeout_s=backstop)
                except Exception:  # noqa: BLE001 - a peer died meanwhile: tear down anyway
                    logger.warning("acco_hooks: close(): a peer never reached the barrier",
                                   exc_info=True)  # fmt: skip
            self._release()
            # Drop the last references too: the groups' C++ objects go now, not at exit.
            self._group = self._count_group = self._norm_group = None
            self.process_groups = ()

    def __enter__(self) -> ACCOEngine:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.close(barrier=exc_type is None)

    # ------------------------------------------------------- communication side (worker thread)

    def _communicate(self, job: _Job, local_count: float) -> tuple[float, float | None, bool]:
        """reduce-scatter -> average -> clip -> step or estimate -> all-gather.

        Returns (global count, gradient norm or None, whether the round was non-finite).
        """
        if self._group is None:
            for g in self._groups:
                g.shard_sum.copy_(g.comm_input)
        else:
            for g in self._groups:
                reduce_scatter_sum(g.shard_sum, g.comm_input, self._group)
        # The count and a "my shard has NaN/Inf" flag travel together: every rank then agrees on
        # whether to skip, although each has seen only its own shard.
        finite = all(bool(torch.isfinite(g.shard_sum).all()) for g in self._groups)
        counts = torch.tensor([local_count, 0.0 if finite else 1.0], dtype=torch.float64,
                              device=self.device)  # fmt: skip
        if self._count_group is not None:
            dist.all_reduce(counts, group=self._count_group)
        global_count, nonfinite = counts[0].item(), counts[1].item() > 0
        if nonfinite:  # every rank: no step, no estimate; the live parameters become θ
            for g in self._groups:
                g.gather_input.copy_(g.master)
            self._all_gather()
            return global_count, None, True
        if global_count <= 0:
            raise RuntimeError(
                "acco_hooks: no rank contributed a micro-batch to this round (the global count "
                "is 0); at least one rank must run a real micro-batch in every round"
            )

        grads = []
        for g in self._groups:
            if g.shard_sum.dtype == torch.float32:  # average in place: no shard-sized copy
                g.master.grad = g.shard_sum.div_(global_count)
            else:
                if g.master.grad is None or g.master.grad is g.shard_sum:
                    g.master.grad = torch.empty_like(g.master)
                g.master.grad.copy_(g.shard_sum).div_(global_count)
            grads.append(g.master.grad)
        grad_norm = self._clip_(grads) if self.max_grad_norm is not None else None

        if job is _Job.UPDATE:
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.num_updates += 1
            for g in self._groups:
                g.gather_input.copy_(g.master)
        else:
            peek(self.optimizer, [g.gather_input for g in self._groups])
        self._all_gather()
        return global_count, grad_norm, False

    def _clip_(self, grads: list[Tensor]) -> float:
        """Clip the averaged gradient to ``max_grad_norm`` (global L2 norm, as torch does)."""
        terms = []
        for g, grad in zip(self._groups, grads):
            terms.append(grad.double().pow(2).sum())
            for start, end, discount in g.norm_discounts:  # replicated: count each value once
                terms.append(-discount * grad[start:end].double().pow(2).sum())
        sq = torch.stack(terms).sum().reshape(1)
        if self._norm_group is not None:
            dist.all_reduce(sq, group=self._norm_group)
        norm = sq.sqrt().float().squeeze(0)
        coef = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, coef)
        return norm.item()

    def _all_gather(self) -> None:
        if self._group is None:
            for g in self._groups:
                g.gathered.copy_(g.gather_input)
            return
        for g in self._groups:
            all_gather(g.gathered, g.gather_input, self._group)

    # --------------------------------------------------------------------------- checkpointing

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-exactly, for this rank.

        In-flight communication is waited for first (its result is kept, not applied, so
        saving never changes the training trajectory). Save the model's ``state_dict()`` too:
        it holds the live parameters (in ``acco``, possibly the estimate θ̃).

        Like ``torch.optim.Optimizer.state_dict``, tensors are references: save the dict before
        the next ``step()``.
        """
        if self._in_flight is not None:
            self._finish_in_flight(apply=False)
        return {
            "version": _STATE_VERSION,
            "mode": self.mode,
            "world_size": self.world_size,
            "fsdp_world_size": self.fsdp_world_size,
            "param_shapes": [[tuple(p.shape) for p in g.params] for g in self._groups],
            "round_index": self.round_index,
            "num_updates": self.num_updates,
            "skipped_rounds": self.skipped_rounds,
            "round_microbatches": self._round_microbatches,
            "local_count": self._local_count,
            "grad_arrived": [list(a) for a in self._grad_arrived],
            "accumulator": [g.accumulator for g in self._groups],
            "master": [g.master for g in self._groups],
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            "pending_job": None if self._in_flight_job is None else self._in_flight_job.value,
            "pending_shard": [g.gather_input for g in self._groups],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output saved by the same rank of a same-sized run."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"acco_hooks: load_state_dict: unknown state version {state.get('version')!r} "
                f"(this acco_hooks writes version {_STATE_VERSION})"
            )
        if state["world_size"] != self.world_size:
            raise ValueError(
                f"acco_hooks: load_state_dict: the checkpoint was saved with a data-parallel world "
                f"size of {state['world_size']}, this run has {self.world_size}. Resharding the "
                f"optimizer state is not supported yet: resume with {state['world_size']} "
                "data-parallel ranks"
            )
        saved_fsdp = state.get("fsdp_world_size", 1)
        if saved_fsdp != self.fsdp_world_size:
            raise ValueError(
                f"acco_hooks: load_state_dict: the checkpoint was saved with the model sharded "
                f"{saved_fsdp} ways by FSDP inside each replica, this run shards it "
                f"{self.fsdp_world_size} ways. Resharding the optimizer state is not supported "
                f"yet: resume with an FSDP (data_parallel_shard) degree of {saved_fsdp}"
            )
        if state["mode"] != self.mode:
            raise ValueError(
                f"acco_hooks: load_state_dict: the checkpoint was saved in mode={state['mode']!r}, "
                f"this engine has mode={self.mode!r}; build the optimizer with "
                f"mode={state['mode']!r} to resume"
            )
        shapes = [[tuple(p.shape) for p in g.params] for g in self._groups]
        if [[tuple(s) for s in g] for g in state["param_shapes"]] != shapes:
            raise ValueError(
                "acco_hooks: load_state_dict: the checkpoint's parameter groups and shapes differ "
                "from this optimizer's; build it over the same parameters in the same order"
            )
        if (self.lr_scheduler is None) != (state["lr_scheduler"] is None):
            raise ValueError(
                "acco_hooks: load_state_dict: the checkpoint "
                + ("has no" if state["lr_scheduler"] is None else "has an")
                + " LR scheduler state but this optimizer "
                + ("has one" if self.lr_scheduler is not None else "has none")
                + "; pass the same lr_scheduler argument as the saved run"
            )
        if self._in_flight is not None:
            self._finish_in_flight(apply=False)
        with torch.no_grad():
            for g, acc, master, shard in zip(
                self._groups, state["accumulator"], state["master"], state["pending_shard"]
            ):
                g.accumulator.copy_(acc)
                g.master.copy_(master)
                g.gather_input.copy_(shard)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.round_index = state["round_index"]
        self.num_updates = state["num_updates"]
        self.skipped_rounds = state.get("skipped_rounds", 0)
        self._round_microbatches = state["round_microbatches"]
        self._local_count = state["local_count"]
        self._grad_arrived = [list(a) for a in state["grad_arrived"]]
        self._in_flight = self._in_flight_job = None
        if state["pending_job"] is not None:
            # The saved run had a finished, not yet applied result: every rank kept its shard of
            # it; gathering the shards again rebuilds the full result bit for bit.
            self._in_flight = self._worker.submit(self._regather)
            self._in_flight_job = _Job(state["pending_job"])

    def _regather(self) -> None:
        self._all_gather()


# ------------------------------------------------------------------------------------- helpers


def _validate_config(
    optimizer_class, mode, accumulation_steps, accumulate_until_ready, reduce_dtype,
    max_grad_norm, lr_scheduler, nonfinite, timeout,
) -> None:  # fmt: skip
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(
            f"acco_hooks: optimizer_class must be a torch.optim.Optimizer subclass such as "
            f"torch.optim.AdamW (the class, not an instance), got {optimizer_class!r}"
        )
    if mode not in MODES:
        raise ValueError(f"acco_hooks: mode={mode!r} is not one of {', '.join(map(repr, MODES))}")
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise ValueError(
            f"acco_hooks: accumulation_steps={accumulation_steps!r} must be an integer >= 1 "
            "(the number of micro-batches per round)"
        )
    if not isinstance(accumulate_until_ready, bool):
        raise TypeError(
            f"acco_hooks: accumulate_until_ready={accumulate_until_ready!r} must be True or False"
        )
    if reduce_dtype is not None and reduce_dtype not in REDUCE_DTYPES:
        raise ValueError(
            f"acco_hooks: reduce_dtype={reduce_dtype!r} must be one of torch.float32, "
            "torch.bfloat16, torch.float16, torch.float64 (the dtypes collectives can sum), or "
            "None for float32"
        )
    if max_grad_norm is not None and not _positive_number(max_grad_norm):
        raise ValueError(
            f"acco_hooks: max_grad_norm={max_grad_norm!r} must be a finite number > 0, or None "
            "for no clipping"
        )
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(
            f"acco_hooks: nonfinite={nonfinite!r} is not one of 'skip' (skip the round's update "
            "on every rank) or 'raise'"
        )
    if timeout is not None and not _positive_number(timeout, low=1e-3, high=1e12):
        raise ValueError(
            f"acco_hooks: timeout={timeout!r} must be a number of seconds between 0.001 and "
            "1e12, or None for the default process group's timeout"
        )
    if lr_scheduler is not None and not callable(lr_scheduler):
        raise TypeError(
            "acco_hooks: lr_scheduler must be a callable that builds the scheduler from the "
            "optimizer, e.g. lr_scheduler=lambda opt: CosineAnnealingLR(opt, T_max=1000)"
        )


def _positive_number(value: Any, low: float = 0.0, high: float = math.inf) -> bool:
    """A real number (not a bool), finite as a float, > 0 and within [low, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        as_float = float(value)
    except OverflowError:  # an int beyond the float range
        return False
    return math.isfinite(as_float) and as_float > 0 and low <= as_float <= high


def _normalize_param_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """Parameter groups as dicts with ``params`` and ``names``; frozen parameters removed."""
    if isinstance(params, Tensor):
        raise TypeError("acco_hooks: params must be an iterable of tensors or dicts, got a Tensor")
    items = list(params)
    if not items:
        raise ValueError("acco_hooks: got an empty parameter list")
    groups = items if isinstance(items[0], dict) else [{"params": items}]
    normalized, seen = [], set()
    for gi, group in enumerate(groups):
        if not isinstance(group, dict):
            raise TypeError("acco_hooks: mix of parameter-group dicts and tensors in params")
        members = group["params"]
        members = [members] if isinstance(members, Tensor) else list(members)
        tensors, names = [], []
        for pi, item in enumerate(members):
            name, p = item if isinstance(item, tuple) else (f"params[{gi}][{pi}]", item)
            if not isinstance(p, Tensor):
                raise TypeError(f"acco_hooks: {name} is a {type(p).__name__}, not a tensor")
            if p in seen:
                raise ValueError(f"acco_hooks: {name} appears more than once in params")
            seen.add(p)
            if not p.requires_grad:
                continue
            if not p.is_floating_point():
                raise TypeError(f"acco_hooks: {name} has dtype {p.dtype}; only floating parameters train")
            tensors.append(p)
            names.append(name)
        if tensors:
            normalized.append({**group, "params": tensors, "names": names})
    if not normalized:
        raise ValueError("acco_hooks: none of the given parameters requires grad")
    return normalized


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
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (dist.get_rank(), fsdp_ranks))
    fsdp_of = dict(every)
    return tuple(sorted({r for peer in data_parallel_ranks for r in fsdp_of[peer]}))


def _dedicated_group(
    my_ranks: tuple[int, ...] | None, timeout: float | None = None
) -> dist.ProcessGroup | None:
    """A new process group over ``my_ranks``, for the worker thread alone.

    Two threads issuing collectives on one group deadlock, and ``init_device_mesh`` hands out
    the WORLD group for a dimension spanning every rank, so the worker never shares a group with
    the training loop. ``new_group`` must be called by every rank for every group in the same
    order: the rank sets of every rank are gathered first.
    """
    if my_ranks is None:
        return None  # a single local worker
    every_ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every_ranks, my_ranks)
    mine = None
    for ranks in sorted(set(map(tuple, every_ranks))):
        group = dist.new_group(
            list(ranks), timeout=None if timeout is None else datetime.timedelta(seconds=timeout)
        )
        if ranks == my_ranks:
            mine = group
    return mine


def _barrier_each(groups: tuple[dist.ProcessGroup, ...]) -> None:
    for group in groups:  # the same order on every rank: the order they were created in
        dist.barrier(group=group)


def _release_communication(worker: CommWorker, groups: tuple[dist.ProcessGroup, ...]) -> None:
    """Join the worker thread, then destroy the groups it was the only user of."""
    worker.close()
    if not dist.is_available() or not dist.is_initialized():
        return  # the user already destroyed every group, ours included
    for group in groups:
        try:
            dist.destroy_process_group(group)
        except ValueError:
            pass  # destroyed already


@torch.no_grad()
def _broadcast_from_first_rank(params: list[Tensor], group: dist.ProcessGroup) -> None:
    """Start every replica from the first rank's parameters, as DDP does."""
    src = dist.get_global_rank(group, 0)
    for p in params:
        dist.broadcast(p.detach(), src=src, group=group)
