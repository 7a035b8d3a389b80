"""The engine's buffers: each parameter group's padded vector, its shards and their memory.

A group's parameters lie in one padded vector of N shards (N: the data-parallel world size),
where its :class:`~acco_hooks.engine.layout.ShardLayout` puts them (end to end, or each whole in
one rank's shard); rank r owns elements ``[r*shard, (r+1)*shard)``. Each group has:

====================  ===========  ========================================================
buffer                size, dtype  role
====================  ===========  ========================================================
``accumulator``       Φ, fp32      the round's summed micro-batch gradients (compute side)
``comm_input``        Φ, reduce    the payload handed to the communication side ...
``gathered``          Φ, model     ... sharing its bytes with the all-gathered result
``shard_sum``         Φ/N, reduce  the reduce-scattered gradient of this rank's shard
``master``            Φ/N, fp32    this rank's master weights, stepped by the shard optimizer
``gather_input``      Φ/N, model   the new shard (θ or θ̃) to all-gather
``carried``           Φ/N, fp32    ``acco``: the estimate round's reduce-scattered sum ΣG̃,
                                   added to the update round's sum
====================  ===========  ========================================================

An estimate round sent narrower than the update (``estimate_dtype``, ``wire``) needs, when the
engine may run one:

====================  ===========  ========================================================
``wire_front``        Φ·w          the first bytes of the communication buffer, free once
                                   the payload is encoded: the reduce-scatter receives there
``wire_tail``         Φ·w          after the communication buffer: the encoded payload is
                                   sent from there, the encoded θ̃ − θ received there
``difference``        Φ/N, fp32    θ̃ − θ of this rank's shard
``encoded_shard``     Φ/N·w        that difference, encoded: what this rank sends
====================  ===========  ========================================================

(w: bytes per element of the widest narrow format; 2 for bfloat16, ≈1.03 for float8.)

A parameter replicated over a mesh dimension other than the data-parallel one (tensor
parallelism) counts once in the global gradient norm: ``norm_discounts`` says where.

Memory per rank for Φ parameters (model in dtype d, AdamW): the model (Φ·d), the fp32
accumulator (4Φ), one communication buffer shared by the reduce-scatter input and the
all-gather output (Φ·max(reduce dtype, d)), and the 1/N shard: fp32 master + optimizer state +
reduce/gather staging (20Φ/N for AdamW with fp32 on the wire and an fp32 model; a narrower
reduce dtype adds the master's fp32 gradient, 4Φ/N), and in ``acco`` the carried half-batch
sum (4Φ/N). The estimate step adds no memory for AdamW, Adam and SGD.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from acco_hooks.engine.layout import (
    ShardLayout,
    balanced_owners,
    flat_layout,
    whole_parameter_layout,
)
from acco_hooks.engine.shard_optimizer import GroupedOptimizer, build_shard_optimizer
from acco_hooks.engine.whole_pieces import PieceExchange, split_of

__all__ = ["GroupBuffers", "build_shard", "is_dtensor", "local_tensor", "memory_bytes",
           "normalize_param_groups"]  # fmt: skip


def normalize_param_groups(
    params: Iterable[Any],
) -> tuple[list[dict[str, Any]], list[tuple[str, Tensor]]]:
    """Parameter groups as dicts with ``params`` and ``names``, and the frozen parameters
    (``requires_grad=False``) left out of them, by name.

    All on one device, each tensor once, floating point. A group whose parameters are all
    frozen stays, empty, at its index (as in a torch optimizer, where a schedule or a warm-up
    addresses groups by index); it has no buffers and steps nothing.
    """
    if isinstance(params, Tensor):
        raise TypeError("acco_hooks: params must be an iterable of tensors or dicts, got a Tensor")
    items = list(params)
    if not items:
        raise ValueError("acco_hooks: got an empty parameter list")
    groups = items if isinstance(items[0], dict) else [{"params": items}]
    normalized, seen, frozen = [], set(), []
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
                frozen.append((name, p))
                continue
            if not p.is_floating_point():
                raise TypeError(f"acco_hooks: {name} has dtype {p.dtype}; only floating parameters train")
            tensors.append(p)
            names.append(name)
        normalized.append({**group, "params": tensors, "names": names})
    if not any(g["params"] for g in normalized):
        raise ValueError("acco_hooks: none of the given parameters requires grad")
    devices = {p.device for g in normalized for p in g["params"]}
    if len(devices) != 1:
        raise ValueError(
            f"acco_hooks: parameters are on several devices {sorted(map(str, devices))}; "
            "move the whole model to one device before building the optimizer"
        )
    return normalized, frozen


class GroupBuffers:
    """The padded buffers of one parameter group, and their per-parameter views.

    The group's parameters lie in one padded vector where ``layout`` puts them; rank r owns
    elements ``[r*shard, (r+1)*shard)`` of it.
    """

    __slots__ = (
        # Layout (``locals``: the tensors holding this rank's data; a DTensor's local shard)
        "params", "locals", "names", "layout", "rank", "padded_numel", "shard_numel", "gather_dtype",
        # Slices of this rank's shard whose squared norm counts less than once in the global
        # gradient norm: parameters replicated over a mesh dimension outside the data-parallel one
        "norm_discounts",
        # Full-size buffers (the compute side's accumulator; the payload / result buffer)
        "accumulator", "accumulator_views", "comm_input", "gathered", "gathered_views",
        # Shard-size buffers (the communication side); ``carried`` in acco only
        "shard_sum", "master", "gather_input", "carried",
        # What the shard optimizer steps: the master itself (flat), or a view of it per
        # parameter this rank owns, in the parameter's shape (whole parameters); ``owned``: the
        # indices of those parameters. Split inside a replica (FSDP, tensor parallelism:
        # ``exchange``) the parameters it owns are held whole, beside the master's pieces (``whole_pieces``)
        "stepped", "owned", "exchange",
        # A narrow estimate round's (``wire``): None when the engine never sends one
        "wire_front", "wire_tail", "difference", "encoded_shard",
    )  # fmt: skip

    def __init__(
        self, params: list[Tensor], names: list[str], world_size: int, rank: int,
        reduce_dtype: torch.dtype, data_parallel_ranks: tuple[int, ...], carry: bool = False,
        wire_bytes: Callable[[int], int] | None = None, layout: ShardLayout | None = None,
        exchange: PieceExchange | None = None,
    ) -> None:  # fmt: skip
        """``wire_bytes(n)``: the most bytes n values take in a narrow format the engine may
        send its estimate in (None: it never does). ``layout``: where the parameters lie in
        the vector (default: the flat layout). ``exchange``: whole parameters split inside a replica
        (FSDP, tensor parallelism), whose pieces this rank brings to their owners and back; the whole tensors it steps are then
        filled by the engine (``gather_whole_masters``)."""
        self.params, self.names = params, names
        self.locals = [local_tensor(p) for p in params]
        device = self.locals[0].device
        if layout is None:
            layout = flat_layout([t.numel() for t in self.locals], world_size)
        self.layout, self.rank = layout, rank
        self.shard_numel, self.padded_numel = layout.shard_numel, layout.padded_numel
        dtypes = {t.dtype for t in self.locals}
        self.gather_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        self.norm_discounts = _norm_discounts(params, layout, rank, data_parallel_ranks)

        # Gradients accumulate in fp32 whatever the model dtype; the padding stays zero.
        self.accumulator = torch.zeros(self.padded_numel, dtype=torch.float32, device=device)
        self.accumulator_views = self.views(self.accumulator)
        # The reduce-scatter reads the payload once, before the all-gather writes the new
        # parameters: one byte buffer serves as both, so ACCO costs one model-sized buffer.
        itemsize = max(reduce_dtype.itemsize, self.gather_dtype.itemsize)
        size = self.padded_numel * itemsize
        encoded = 0 if wire_bytes is None else world_size * wire_bytes(self.shard_numel)
        front = max(size, encoded)
        raw = torch.empty(front + encoded, dtype=torch.uint8, device=device)
        self.comm_input = raw[: self.padded_numel * reduce_dtype.itemsize].view(reduce_dtype)
        self.gathered = raw[: self.padded_numel * self.gather_dtype.itemsize].view(
            self.gather_dtype
        )
        self.gathered_views = self.views(self.gathered)

        self.shard_sum = torch.empty(self.shard_numel, dtype=reduce_dtype, device=device)
        self.gather_input = torch.empty(self.shard_numel, dtype=self.gather_dtype, device=device)
        self.master = torch.empty(self.shard_numel, dtype=torch.float32, device=device)
        self.carried = (
            torch.zeros(self.shard_numel, dtype=torch.float32, device=device) if carry else None
        )
        self.wire_front = self.wire_tail = self.difference = self.encoded_shard = None
        if wire_bytes is not None:
            self.wire_front, self.wire_tail = raw[:encoded], raw[front:]
            self.difference = torch.empty(self.shard_numel, dtype=torch.float32, device=device)
            self.encoded_shard = torch.empty(wire_bytes(self.shard_numel), dtype=torch.uint8,
                                             device=device)  # fmt: skip
        self.reset_master(rank)
        self.exchange = exchange
        if exchange is None:
            self.owned = layout.owned(rank) if layout.whole else []
            self.stepped = self.shard_views(self.master)
        else:  # the whole fp32 master and gradient of each parameter this rank owns
            self.owned = exchange.owned
            self.stepped = [torch.zeros(exchange.shapes[i], dtype=torch.float32, device=device)
                            for i in self.owned]  # fmt: skip
            for whole in self.stepped:
                whole.grad = torch.zeros_like(whole)

    def shard_views(self, shard: Tensor) -> list[Tensor]:
        """What of ``shard`` (one of this rank's shard-sized buffers) the optimizer steps, as
        :attr:`stepped` is of the master: ``shard`` itself in the flat layout; in the
        whole-parameter layout a view per parameter this rank owns, in its local shape (not
        where a replica splits them: the shard then holds pieces)."""
        assert self.exchange is None, "split inside a replica, the shard holds pieces"
        if not self.layout.whole:
            return [shard]
        return [shard[p.at_shard : p.at_shard + p.numel].view(self.locals[p.index].shape)
                for p in self.layout.pieces(self.rank)]  # fmt: skip

    def views(self, vector: Tensor) -> list[Tensor]:
        """Each parameter's place in ``vector`` (one of the group's padded vectors), shaped as
        its local tensor."""
        return self.layout.views(vector, [t.shape for t in self.locals])

    def copy_gathered_into_params(self, difference: bool = False) -> None:
        """The live parameters become ``gathered``; with ``difference``, ``gathered`` holds
        θ̃ − θ (a narrow estimate) and is added to them."""
        if all(t.dtype == self.gather_dtype for t in self.locals):
            if difference:
                torch._foreach_add_(self.locals, self.gathered_views)
            else:
                torch._foreach_copy_(self.locals, self.gathered_views)
            return
        for t, view in zip(self.locals, self.gathered_views):
            t.add_(view) if difference else t.copy_(view)

    @torch.no_grad()
    def reset_master(self, rank: int) -> None:
        """Take this rank's fp32 master shard from the parameters' current values."""
        self.master.copy_(self.shard_of(self.locals, rank))

    @torch.no_grad()
    def shard_of(self, tensors: list[Tensor], rank: int) -> Tensor:
        """Rank ``rank``'s fp32 shard of ``tensors``, one per parameter and shaped as its local
        tensor, laid out as the parameters are (the padding zero)."""
        vector = torch.zeros(self.padded_numel, dtype=torch.float32, device=self.accumulator.device)
        torch._foreach_copy_(self.views(vector), list(tensors))
        return vector[rank * self.shard_numel : (rank + 1) * self.shard_numel]

    def moved_params(self) -> list[str]:
        """Names of parameters whose storage is no longer the one the buffers were laid over.

        ``model.to(...)``, a dtype cast or ``param.data = ...`` re-allocates a parameter: the
        engine would go on writing updates into the old memory.
        """
        return [
            name for name, param, held in zip(self.names, self.params, self.locals)
            if (now := local_tensor(param)).data_ptr() != held.data_ptr()
            or now.dtype != held.dtype or now.device != held.device
        ]  # fmt: skip


def build_shard(
    param_groups: list[dict[str, Any]], world_size: int, rank: int,
    data_parallel_ranks: tuple[int, ...], *, reduce_dtype: torch.dtype, carry: bool,
    wire_bytes: Callable[[int], int] | None,
    classes: list[type], class_kwargs: dict[type, dict[str, Any]],
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None,
    whole: list[bool] | None = None, piece_ranks: tuple[int, ...] = (), piece_rank: int = 0,
) -> tuple[list[GroupBuffers], torch.optim.Optimizer, Any]:  # fmt: skip
    """Lay each parameter group out in its buffers; build the shard optimizer (and its
    scheduler) over this rank's fp32 master shard.

    Takes no process group: a traceback through a refused optimizer argument must not keep the
    engine's groups alive.

    Args:
        param_groups, world_size, rank, data_parallel_ranks: what is laid out, over which ranks.
        reduce_dtype: the communication buffer's dtype (the update round's format).
        carry: hold ``carried``, the float32 shard of an estimate round sent in the reduce
            dtype (its ΣG̃, which the update round adds).
        wire_bytes: the bytes of ``n`` values in the widest narrower estimate format, or
            ``None`` when no estimate travels narrower (no wire buffers).
        classes, class_kwargs: each group's optimizer class, and each class's keyword
            arguments (``shard_optimizer.constructor_kwargs``).
        lr_scheduler: builds the shard optimizer's scheduler.
        whole: per group, whether it lies on the whole-parameter layout (default: flat).
        piece_ranks, piece_rank: the global ranks a replica splits its whole-stepped
            parameters over (FSDP's, or tensor parallelism's), and this rank's index among
            them; a whole-parameter group's owners are then on the replicas × piece ranks grid
            (``whole_pieces``).

    Returns:
        ``(buffers, optimizer, lr_scheduler)``, one ``GroupBuffers`` per parameter group that
        has parameters; the optimizer has every group, at its index.
    """
    whole = whole or [False] * len(param_groups)
    buffers = []
    for g, kept in zip(param_groups, whole):
        if not g["params"]:
            continue
        layout, exchange = _layout(g, world_size, rank, kept, piece_ranks, piece_rank)
        buffers.append(GroupBuffers(g["params"], g["names"], world_size, rank, reduce_dtype,
                                    data_parallel_ranks, carry, wire_bytes, layout, exchange))

    # every group, at its index: an empty one (all its parameters frozen) steps nothing
    stepped = iter(b.stepped for b in buffers)
    shard_groups = [
        {**{k: v for k, v in g.items() if k not in ("params", "names")},
         "params": next(stepped) if g["params"] else []}
        for g in param_groups
    ]  # fmt: skip
    optimizer = build_shard_optimizer(classes, shard_groups, class_kwargs)
    scheduler = None if lr_scheduler is None else _build_scheduler(lr_scheduler, optimizer)
    return buffers, optimizer, scheduler


def _layout(
    group: dict[str, Any], world_size: int, rank: int, whole: bool,
    piece_ranks: tuple[int, ...], piece_rank: int,
) -> tuple[ShardLayout, PieceExchange | None]:  # fmt: skip
    """A group's layout, and where a replica splits its whole-stepped parameters (FSDP, tensor
    parallelism) its :class:`PieceExchange`."""
    params = group["params"]
    numels = [local_tensor(p).numel() for p in params]
    if not whole:
        return flat_layout(numels, world_size), None
    if len(piece_ranks) <= 1:
        return whole_parameter_layout(numels, world_size), None
    splits = [split_of(p, local_tensor(p), piece_ranks) for p in params]
    for name, split in zip(group["names"], splits):
        if isinstance(split, str):
            raise ValueError(
                f"acco_hooks: {name} is stepped whole, and {split}: the engine brings a matrix "
                "together from the pieces of one set of ranks that torch.chunk cuts (FSDP's "
                "dim 0, or a tensor-parallel Shard). Step its group with a per-element "
                "optimizer (torch.optim.AdamW), or split it over one set of ranks"
            )
    size = len(piece_ranks)
    # a split tensor: one owner on the replicas x piece ranks grid; one whole on every piece
    # rank: each steps its own copy, in one replica
    split, kept = ([i for i, s in enumerate(splits) if (s.dim is None) == unsplit]
                   for unsplit in (False, True))  # fmt: skip
    owners: list[tuple[int, int]] = [(0, 0)] * len(params)
    slots = balanced_owners([math.prod(splits[i].shape) for i in split], world_size * size)
    for i, slot in zip(split, slots):
        owners[i] = (slot // size, slot % size)
    for i, replica in zip(kept, balanced_owners([numels[i] for i in kept], world_size)):
        owners[i] = (replica, piece_rank)
    layout = whole_parameter_layout(numels, world_size, owners=[r for r, _ in owners])
    return layout, PieceExchange(layout, rank, owners, piece_rank, size, splits)


def _build_scheduler(
    lr_scheduler: Callable[[torch.optim.Optimizer], Any], optimizer: torch.optim.Optimizer
) -> Any:
    """``lr_scheduler(optimizer)``, refused by name where the engine cannot step it, or where it
    fails on the groups of several classes."""
    try:
        scheduler = lr_scheduler(optimizer)
    except (ValueError, KeyError, TypeError) as error:
        if not isinstance(optimizer, GroupedOptimizer):
            raise
        keeps = [f"{type(part).__name__} keeps "
                 + " and ".join(repr(k) for k in ("momentum", "betas") if k in part.defaults)
                 for part in optimizer.optimizers if {"momentum", "betas"} & part.defaults.keys()]
        raise ValueError(
            f"acco_hooks: lr_scheduler= failed on the shard optimizer "
            f"({type(error).__name__}: {error}). Its parameter groups are stepped by "
            f"{' and '.join(type(part).__name__ for part in optimizer.optimizers)}: each keeps its "
            "own class's options, and optimizer.defaults holds only those every class has"
            + (f" ({'; '.join(keeps)})" if keeps else "") + ". OneCycleLR and CyclicLR with "
            "cycle_momentum=True cycle one momentum option in every group: build them with "
            "cycle_momentum=False (the learning rate still cycles in every group), or step "
            "every group with classes that keep the same momentum option"
        ) from error
    _check_scheduler(scheduler)
    return scheduler


def _check_scheduler(scheduler: Any) -> None:
    """Refuse a scheduler the engine cannot step: it steps it after each real update, on its
    communication thread, with no argument (no metric exists there)."""
    name = type(scheduler).__qualname__
    step = getattr(scheduler, "step", None)
    needs = [] if not callable(step) else [
        p.name for p in inspect.signature(step).parameters.values()
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]  # fmt: skip
    if not callable(step) or needs:
        raise TypeError(
            f"acco_hooks: lr_scheduler= built a {name}, whose step() "
            + (f"needs {', '.join(needs)}" if callable(step) else "does not exist")
            + " (ReduceLROnPlateau steps on a validation metric): the engine steps the scheduler "
            "after each real update, on its communication thread, with no argument. Use a "
            "schedule of the update count (CosineAnnealingLR, LambdaLR, OneCycleLR, "
            "SequentialLR, ...)"
        )


def memory_bytes(
    buffers: list[GroupBuffers], optimizer: torch.optim.Optimizer, reduce_dtype: torch.dtype
) -> dict[str, int]:
    """Bytes this rank holds, by the categories of the spec's memory table."""

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
    return {
        "model": nbytes(t for g in buffers for t in g.locals),
        "grad_accumulator": nbytes(g.accumulator for g in buffers),
        # comm_input and gathered share one byte buffer (with a narrow estimate's wire after it)
        "comm_buffer": sum(
            g.padded_numel * max(reduce_dtype.itemsize, g.gather_dtype.itemsize) for g in buffers
        ),
        "estimate_wire": nbytes(t for g in buffers for t in (g.wire_tail, g.difference,
                                                               g.encoded_shard) if t is not None),
        "master_shard": nbytes(g.master for g in buffers),
        # split inside a replica, the matrices this rank steps whole: their fp32 master and gradient
        "whole_on_owner": nbytes(t for g in buffers if g.exchange is not None
                                 for whole in g.stepped for t in (whole, whole.grad)),
        "carried_shard": nbytes(g.carried for g in buffers if g.carried is not None),
        "optimizer_state": nbytes(state),
        "shard_staging": nbytes({  # each tensor once: with fp32 on the wire the
            id(t): t                 # reduce-scatter output is the master's gradient
            for g in buffers
            for t in (g.shard_sum, g.gather_input, g.master.grad)
            if t is not None
        }.values()),
    }


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a ``DTensor``, without importing ``torch.distributed.tensor``.

    Its import costs 1.2 s of CPU, most of ``import acco_hooks``, in every process of a job
    (each rank, each launch of a test's or a benchmark's ranks); a process that never imported
    it holds no DTensor, and one that holds any (FSDP, tensor parallelism) imported it.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def local_tensor(param: Tensor) -> Tensor:
    """The plain tensor that holds this rank's values of ``param`` (shares its storage)."""
    local = param.to_local() if is_dtensor(param) else param
    return local.detach()


def _replication(param: Tensor, data_parallel_ranks: tuple[int, ...]) -> int:
    """On how many ranks outside the data-parallel group a parameter's local values repeat.

    A DTensor replicated over a tensor-parallel mesh dimension repeats its values there. The
    replicate dimension of an HSDP mesh is the engine's own data-parallel group, whose ranks
    hold the same values by construction: it does not count.
    """
    if not is_dtensor(param):
        return 1
    from torch.distributed.tensor import Replicate

    mesh = param.device_mesh
    return math.prod(
        mesh.size(dim) for dim, placement in enumerate(param.placements)
        if isinstance(placement, Replicate)
        and tuple(sorted(dist.get_process_group_ranks(mesh.get_group(dim)))) != data_parallel_ranks
    )  # fmt: skip


def _norm_discounts(
    params: list[Tensor], layout: ShardLayout, rank: int, data_parallel_ranks: tuple[int, ...]
) -> list[tuple[int, int, float]]:
    """``(start, end, 1 - 1/replication)`` for shard slices of replicated parameters."""
    discounts = []
    for piece in layout.pieces(rank):
        replication = _replication(params[piece.index], data_parallel_ranks)
        if replication > 1:
            discounts.append((piece.at_shard, piece.at_shard + piece.numel,
                              1.0 - 1.0 / replication))  # fmt: skip
    return discounts
