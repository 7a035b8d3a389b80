"""A rank's engine state: what it is, how it is saved, checked before a load, and resharded.

An engine's state is everything a resumed run needs to go on where the saved one was, round for
round (``ACCOEngine.state_dict``):

* **per element, 1/N of the model** (DTensor or ShardedTensor chunks of each parameter group's
  part vector, ``placement``; DCP saves every rank's and loads them on any number of ranks):
  the fp32 master shard, the optimizer's per-element state, the shard of a finished result not
  yet applied (``pending_shard``) and, in ``acco``, the carried half-batch ΣG̃;
* **the same on every rank**: the round counters, the schedule (``auto``'s choice and what it
  measured) and the weights of the update under way (acco's c̃, W, and where a resharded resume
  reweighs ΣG̃), all ``RoundState.state_dict``; the LR scheduler, and the optimizer's
  per-parameter values (a step count);
* **one rank's own**, under a key of that rank (``rank_state``): saved in the middle of a round,
  its accumulated gradients and their weight. Such a state resumes on the same ranks only.

Besides, the *live* parameters (those the next round computes at; in ``acco`` possibly θ̃)
are saved as master-shaped chunks (:func:`save_live_parameters`), for front-ends whose model
checkpoint holds the real θ.

Each function takes the engine's parts explicitly (:class:`StateParts`: its settings, its rounds'
bookkeeping ``rounds.RoundState``, buffers, placement, optimizer, groups) and reads nothing else
of the engine. A load first checks that the state fits (:func:`check_loadable`), before anything
changes. Loaded onto another number of ranks, the carried ΣG̃ may be in the saved world's units;
the last part of this module says what an update round weighed there, so that the next update
averages both halves in this world's (``communication`` reweighs).
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from acco_hooks.engine.buffers import GroupBuffers, local_tensor
from acco_hooks.engine.communication import (
    EngineGroups,
    Job,
    RoundPlan,
    all_gather_into,
    reduce_scatter_accumulators,
)
from acco_hooks.engine.placement import ShardPlacement, to_local_chunks
from acco_hooks.engine.rounds import RoundState
from acco_hooks.engine.schedule import Schedule
from acco_hooks.engine.settings import EngineSettings
from acco_hooks.engine.shard_optimizer import (
    GroupedOptimizer,
    ShardStateLayout,
    first_step_state,
    state_index,
)
from acco_hooks.engine.wire import WIRE_FORMATS

__all__ = [
    "STATE_VERSION", "StateParts", "check_loadable", "handover_state", "load_handover",
    "load_live_parameters", "load_optimizer_state_by_name", "load_state", "save_live_parameters",
    "save_state",
]  # fmt: skip

# 7: a whole-parameter group's optimizer state other than per element is by parameter name
# (``owned``), and a grouped shard optimizer names each group's class (``optimizer_class``).
# 6: ``replica_groups``: the torchft replica groups whose sums the counters and the carried ΣG̃
# hold (5 recorded a group's own ranks alone, as if it were the whole job: 1 group).
# 5: ``update_weight`` is a whole update's weight (4: its update round's, measured only when it
# added a carried ΣG̃), ``carried_reweigh`` says in which units a carried ΣG̃ is, the parameter
# names and shapes are keyed by model part (4: one list, the same key on every pipeline stage),
# and optimizer state is per element or per parameter by what the optimizer keeps (4: by shape).
# 4: acco's carried weight c̃ is in ``estimate_count`` alone (3 kept each rank's share of it in
# that rank's count) and ``update_weight`` replaces 3's ``unit_weights``.
# 3: every per-element shard is a DTensor over the data-parallel group (``placement``), so that
# DCP saves every rank's and reshards it; what only one rank holds is under a key of its own.
# 2 kept flat shards (same-shaped runs only); 1 carried acco's half-batch in the accumulator.
STATE_VERSION = 7


class StateParts(NamedTuple):
    """What a rank's state is made of, as its engine holds it: what this module saves and loads."""

    settings: EngineSettings
    rounds: RoundState
    """The training loop's counters and this rank's round being accumulated."""
    buffers: list[GroupBuffers]
    """Per parameter group: the master shard, the accumulator, the pending result's shard."""
    placement: ShardPlacement
    """Where each shard's elements lie in the model: the DTensor chunks DCP saves."""
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    state_layouts: list[ShardStateLayout]
    """Per group: which of its optimizer's state is per element, per parameter."""
    groups: EngineGroups
    device: torch.device
    run_on_thread: Callable[..., Any]
    """Runs a collective on the engine's communication thread (which owns its groups), waited for."""


# ---------------------------------------------------------------- saving


def save_state(parts: StateParts, pending: RoundPlan | None) -> dict[str, Any]:
    """The body of ``ACCOEngine.state_dict``, which documents it. ``pending``: the plan of a
    finished result not yet applied (``None``: there is none)."""
    rounds, buffers, rank = parts.rounds, parts.buffers, parts.groups.rank
    narrow = pending is not None and pending.wire is not None
    partial = bool(rounds.microbatches)
    if narrow:  # the pending result is θ̃ − θ, decoded: each rank's range of it, as any shard
        for g in buffers:
            g.gather_input.copy_(g.gathered[rank * g.shard_numel :][: g.shard_numel])
    carried = None
    if parts.settings.has_estimate_round:  # one key whatever the schedule: any run loads it
        if (rounds.between_halves and not partial and rounds.estimate_kept
                and not rounds.carry_next_update):  # fmt: skip
            carried = _kept_estimate_sum(parts)
        else:
            carried = _carried(parts)
    chunks = parts.placement.chunks
    return {
        **_header(parts), **rounds.state_dict(),
        "round_microbatches": rounds.microbatches,
        "lr_scheduler": None if parts.lr_scheduler is None else parts.lr_scheduler.state_dict(),
        "pending_job": None if pending is None else pending.job.value,
        "pending_wire": pending.wire.name if narrow else None,
        # per element, DTensors: every rank's part is saved, and any world loads it
        "master": chunks([g.master for g in buffers]),
        "pending_shard": chunks([g.gather_input for g in buffers]),
        "carried": None if carried is None else chunks(carried),
        "optimizer": _optimizer_state(parts),
        # Mid-round: model-sized, this rank's alone; a key no other rank writes
        "partial_round": partial,
        "rank_state": {_rank_key(): {
            "accumulator": [g.accumulator for g in buffers], **rounds.local_state_dict(),
        }} if partial else {},
    }  # fmt: skip


def _carried(parts: StateParts) -> list[Tensor]:
    """The carried ΣG̃ shards; zeros where an engine that never carries has none."""
    return [torch.zeros(g.shard_numel, device=parts.device) if g.carried is None else g.carried
            for g in parts.buffers]  # fmt: skip


def _header(parts: StateParts) -> dict[str, Any]:
    """What a state must match to be loaded (``check_loadable``)."""
    groups, place = parts.groups, parts.placement
    return {
        "version": STATE_VERSION, "mode": parts.settings.mode.value,
        "optimizer_class": _class_name(parts.optimizer), "world_size": groups.world_size,
        "fsdp_world_size": groups.fsdp_world_size,
        # torchft: the job's data-parallel ranks are world_size in each of these groups
        "replica_groups": 1 if groups.replicas is None else groups.replicas.summed_groups,
        # by model part, as the shards: every pipeline stage's is saved
        "params": dict(zip(place.keys, place.param_names)),
        "param_shapes": dict(zip(place.keys, place.global_shapes)),
        "accumulation_steps": parts.settings.accumulation_steps,
    }  # fmt: skip


def _optimizer_state(parts: StateParts, agree: bool = True) -> dict[str, Any]:
    """The shard optimizer's state, by what each group's class keeps (``shard_optimizer``),
    not by shape (a group's shard may have one element):

    * ``per_element``: a flat group's tensors of one value per parameter element (moments,
      momentum), laid out as the master shard and saved as its chunks;
    * ``shared``: a flat group's per-parameter values (a step count), one per group, the same
      on every rank;
    * ``owned``: a whole-parameter group's state, each parameter's by its name, from the rank
      that owns it (Muon's momentum, Adafactor's row and column variances, which some of its
      parameters keep and others not), read on load by whichever rank owns it then;
    * ``rank_state``: keys the probe never saw, this rank's own.

    Before its first step, the state a first step creates, so that DCP has tensors to load
    into (``stepped`` says it is not real). ``stepped`` is one value that DCP saves from one
    rank: on whole parameters a rank that owns none keeps no state, so with ``agree`` the ranks
    agree on it (a collective on the engine's thread; a torchft handover, a per-rank state taken
    while that thread waits, keeps its own)."""
    optimizer, buffers, layouts = parts.optimizer, parts.buffers, parts.state_layouts
    saved = optimizer.state_dict()
    stepped = bool(saved["state"])
    data = parts.groups.data
    if agree and data is not None and any(g.layout.whole for g in buffers):
        # over every rank that may own a parameter: the FSDP and tensor-parallel ranks too
        # (``whole_pieces``); the norm group holds them
        flag = torch.tensor([float(stepped)], dtype=torch.float64, device=parts.device)
        parts.run_on_thread(dist.all_reduce, flag, dist.ReduceOp.MAX, parts.groups.norm)
        stepped = bool(flag.item())
    state = saved["state"] if saved["state"] or stepped else first_step_state(
        optimizer, layouts[0].optimizer_kwargs)  # fmt: skip
    index = state_index(optimizer)
    # per group: the state of each tensor the optimizer steps (one, the master, when flat)
    held = [[state.get(index[id(p)], {}) for p in g.stepped] for g in buffers]
    per_element, shared, owned, other = {}, {}, {}, {}
    for name in sorted({name for entry in state.values() for name in entry}):
        vectors, values = [], []
        for g, layout, states in zip(buffers, layouts, held):
            found = [s.get(name) for s in states]
            if g.layout.whole:  # by name: each key only where a parameter keeps it
                for pi, value in zip(g.owned, found):
                    if value is not None:
                        owned.setdefault(g.names[pi], {})[name] = value
                vectors.append(None)
                values.append(None)
                continue
            if name in layout.per_element and all(
                v is None or isinstance(v, Tensor) and v.shape == (g.shard_numel,) for v in found
            ):  # only the groups that keep it (SGD without momentum keeps no buffer)
                vectors.append(found[0])
            else:
                vectors.append(None)
            values.append(None if vectors[-1] is not None else found[0])
        if any(v is not None for v in vectors):
            per_element[name] = parts.placement.chunks(vectors)
        if any(v is not None for v in values):
            if all(name in layout.per_parameter for layout, v in zip(layouts, values)
                   if v is not None):  # a step count: the same on every rank
                shared[name] = values
            else:
                other[name] = values  # a key the probe never saw: this rank's own
    return {"param_groups": saved["param_groups"], "stepped": stepped,
            "per_element": per_element, "shared": shared, "owned": owned,
            "rank_state": {_rank_key(): other} if other else {}}  # fmt: skip


def _kept_estimate_sum(parts: StateParts) -> list[Tensor]:
    """ΣG̃ of a narrow estimate round as the reduce dtype's carried half-batch: the
    accumulators reduce-scattered in fp32 (on the engine's thread, which owns its groups)."""
    sums = [torch.empty(g.shard_numel, device=parts.device) for g in parts.buffers]
    parts.run_on_thread(reduce_scatter_accumulators, sums, parts.buffers, parts.groups)
    return sums


# ---------------------------------------------------------------- loading


def load_state(parts: StateParts, state: dict[str, Any]) -> RoundPlan | None:
    """The body of ``ACCOEngine.load_state_dict``, which documents it; the engine has waited
    for its round in flight (kept, not applied). Returns the plan of the saved run's finished,
    not yet applied result, whose shards are back in the buffers: the engine gathers them again
    (``None``: there was none)."""
    rank_key = _rank_key()
    check_loadable(state, parts, rank_key)  # first: a state refused changes nothing
    own = state["rank_state"].get(rank_key) if state["partial_round"] else None
    place, buffers = parts.placement, parts.buffers
    place.fill([g.master for g in buffers], state["master"])
    if state["pending_shard"] is not None:
        place.fill([g.gather_input for g in buffers], state["pending_shard"])
    # Between an estimate and its update, ΣG̃ is the carried half-batch, also where the
    # estimate was sent narrower (the saving run kept it in its accumulators): the update
    # adds it, and an engine that never carries gets the buffer for it now.
    carry_next_update = bool(state["estimate_count"]) and (
        own is None or (state["version"] >= 5 and state["carry_next_update"])
    )  # fmt: skip
    if carry_next_update:
        for g in buffers:
            if g.carried is None:
                g.carried = torch.zeros(g.shard_numel, device=parts.device)
    if state["carried"] is not None and buffers[0].carried is not None:
        place.fill([g.carried for g in buffers], state["carried"])
    with torch.no_grad():
        for gi, g in enumerate(buffers):
            g.accumulator.zero_()
            if own is not None:
                g.accumulator.copy_(own["accumulator"][gi])
    _load_optimizer_state(parts, state["optimizer"], rank_key)
    if parts.lr_scheduler is not None:
        parts.lr_scheduler.load_state_dict(state["lr_scheduler"])
    # the saved counters in this run's units: older versions and another world translated
    reweigh = _carried_reweigh(state, parts)
    counters = {
        **state, "unit_weights": _saved_unit_weights(state), "carried_reweigh": reweigh,
        "update_weight": _update_weight_after_load(state, parts, reweigh),
        "carry_next_update": carry_next_update,
    }  # fmt: skip
    local = None if own is None else {
        **own, "local_unit_weights": state["version"] < 5 or own["local_unit_weights"],
    }  # fmt: skip
    # Resharded onto ranks that take another number of micro-batches per update (the same
    # global batch), the next update starts on this engine's own schedule.
    parts.rounds.load_state_dict(
        counters, state["round_microbatches"], local,
        keep_schedule=state["accumulation_steps"] != parts.settings.accumulation_steps,
    )  # fmt: skip
    if state["pending_job"] is None:
        return None
    wire = state["pending_wire"]
    return RoundPlan(
        Job(state["pending_job"]), 0.0, wire=None if wire is None else WIRE_FORMATS[wire]
    )


def _load_optimizer_state(parts: StateParts, saved: dict[str, Any], rank_key: str) -> None:
    optimizer, buffers, place = parts.optimizer, parts.buffers, parts.placement
    # The saved hyperparameters, over this engine's own tensors: on another number of ranks a
    # whole-parameter group's rank owns other parameters, and another number of them
    own = optimizer.state_dict()["param_groups"]
    groups = [{**group, "params": mine["params"]} for group, mine in zip(saved["param_groups"], own)]
    if not saved["stepped"]:
        optimizer.state.clear()  # as built: no step yet
        optimizer.load_state_dict({"state": {}, "param_groups": groups})
        return
    index = state_index(optimizer)
    state: dict[int, dict[str, Any]] = {index[id(p)]: {} for g in buffers for p in g.stepped}
    for name, chunks in saved["per_element"].items():
        vectors = [torch.empty(g.shard_numel, dtype=_local_dtype(chunks, key), device=parts.device)
                   if key in chunks else None
                   for g, key in zip(buffers, place.keys)]  # fmt: skip
        place.fill(vectors, chunks)
        for g, vector in zip(buffers, vectors):
            if vector is not None:  # a flat group's: the master's own layout
                state[index[id(g.master)]][name] = vector
    for values in (saved["shared"], saved["rank_state"].get(rank_key, {})):
        for name, per_group in values.items():
            for g, value in zip(buffers, per_group):
                if value is not None:
                    state[index[id(g.master)]][name] = value
    owned = saved.get("owned", {})  # whole parameters: each one's own, by name
    for g in buffers:
        if g.layout.whole:
            for p, pi in zip(g.stepped, g.owned):
                state[index[id(p)]].update(owned.get(g.names[pi], {}))
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def load_optimizer_state_by_name(parts: StateParts, state: dict[str, dict[str, Any]]) -> None:
    """The body of ``ACCOEngine.load_optimizer_state_by_name``, which documents it."""
    shard_state, rank = {}, parts.groups.rank
    index = state_index(parts.optimizer)
    for g, layout in zip(parts.buffers, parts.state_layouts):
        keys = sorted(layout.per_element | layout.per_parameter)
        missing = [f"{name}.{key}" for name in g.names for key in keys
                   if key not in state.get(name, {})]  # fmt: skip
        if missing:
            raise KeyError(f"acco_hooks: load_optimizer_state_by_name: no {missing[0]} "
                           f"(and {len(missing) - 1} more) in the state given")  # fmt: skip
        if layout.layout == "whole":  # each owned parameter's own, in its shape
            if g.exchange is not None:
                raise ValueError(
                    f"acco_hooks: load_optimizer_state_by_name: {g.names[0]}'s group is stepped "
                    "whole, and the ranks of a replica split it (FSDP, tensor parallelism): the "
                    "state by name of such a run holds pieces, not the matrices its owners "
                    "step. Load a checkpoint of the engine (state_dict), or start the optimizer "
                    "afresh"
                )
            for param, pi in zip(g.stepped, g.owned):
                shard_state[index[id(param)]] = {  # copies: torch steps them in place
                    key: copy.deepcopy(local_tensor(value) if isinstance(value, Tensor) else value)
                    for key, value in state[g.names[pi]].items() if key in keys
                }  # fmt: skip
            continue
        shard_state[index[id(g.master)]] = {
            **{key: g.shard_of([local_tensor(state[name][key]) for name in g.names], rank).clone()
               for key in layout.per_element},
            # a copy: torch's optimizers count their steps in place
            **{key: copy.deepcopy(state[g.names[0]][key]) for key in layout.per_parameter},
        }  # fmt: skip
    groups = parts.optimizer.state_dict()["param_groups"]
    parts.optimizer.load_state_dict({"state": shard_state, "param_groups": groups})


# ---------------------------------------------------------------- checked before a load


def check_loadable(state: dict[str, Any], parts: StateParts, rank_key: str) -> None:
    """Raise ``ValueError`` naming the first difference between a checkpoint and the engine
    of ``parts`` that forbids loading it, before anything is loaded."""
    settings, groups = parts.settings, parts.groups
    mode, steps = settings.mode, settings.accumulation_steps
    version = state.get("version")
    if version not in (3, 4, 5, 6, STATE_VERSION) or (version == 3 and (
        (state["partial_round"] and state["estimate_count"]) or state["pending_wire"]
    )):  # 3 kept each rank's share of c̃ in its local count, and a narrow result encoded
        raise ValueError(
            f"acco_hooks: load_state_dict: the checkpoint has engine state version "
            f"{version!r}"
            + (" saved inside acco's update round or with a narrow estimate pending"
               if version == 3 else "")
            + f", this acco_hooks reads versions 4 to {STATE_VERSION}, and 3 saved at a step "
            "boundary (version 2 kept flat shards that only a run of the same shape could "
            "load). Resume it with the acco_hooks that wrote it"
        )
    saved_class, own_class = state.get("optimizer_class"), _class_name(parts.optimizer)
    if saved_class is not None and saved_class != own_class:  # version 3 did not say
        raise ValueError(
            f"acco_hooks: load_state_dict: the checkpoint's shard optimizer is {saved_class}, "
            f"this engine steps {own_class}: their states do not mean the same. Build the "
            f"optimizer with optimizer_class={saved_class} to resume"
        )
    if state["mode"] != mode:
        raise ValueError(
            f"acco_hooks: load_state_dict: the checkpoint was saved in mode={state['mode']!r}, "
            f"this engine has mode={mode!r}; build the optimizer with "
            f"mode={state['mode']!r} to resume"
        )
    same_ranks = (_saved_ranks(state), state["fsdp_world_size"]) == (
        _job_ranks(parts), groups.fsdp_world_size
    )  # fmt: skip
    if state["accumulation_steps"] != steps and same_ranks:
        raise ValueError(
            f"acco_hooks: load_state_dict: the checkpoint was saved with accumulation_steps="
            f"{state['accumulation_steps']}, this optimizer has accumulation_steps={steps}: "
            "the resumed run would take another batch per update than the saved one. Build "
            f"the optimizer with accumulation_steps={state['accumulation_steps']} to resume"
        )
    saved = Schedule(*state["schedule"])
    if state["accumulation_steps"] == steps and saved not in parts.rounds.candidates:
        raise ValueError(
            f"acco_hooks: load_state_dict: the checkpoint was saved running "
            f"{saved.describe()}, which this engine's estimate_microbatches="
            f"{settings.estimate_microbatches!r} and estimate_dtype="
            f"{settings.estimate_dtype!r} do not run: build the optimizer with the "
            "saved run's estimate settings to resume"
        )
    place = parts.placement
    if state["fsdp_world_size"] != groups.fsdp_world_size and not place.reshards_fsdp:
        raise ValueError(
            f"acco_hooks: load_state_dict: the checkpoint was saved with the model sharded "
            f"{state['fsdp_world_size']} ways by FSDP inside each replica, this run shards it "
            f"{groups.fsdp_world_size} ways, and in a way that keeps one vector per FSDP rank "
            "(a parameter FSDP did not split along dim 0): resume with an FSDP "
            f"(data_parallel_shard) degree of {state['fsdp_world_size']}"
        )
    names, shapes = state["params"], state["param_shapes"]
    if isinstance(names, dict):  # version 5: by model part (every pipeline stage its own)
        names = [names.get(key) for key in place.keys] if set(names) == set(place.keys) else None
        shapes = [shapes.get(key, ()) for key in place.keys]
    if names != place.param_names or set(state["master"]) != set(place.keys) or [
        [tuple(s) for s in g] for g in shapes
    ] != place.global_shapes:
        raise ValueError(
            "acco_hooks: load_state_dict: the checkpoint's parameter groups, names or shapes "
            "differ from this optimizer's; build it over the same parameters in the same order"
            + (" (or it was saved with another FSDP degree by a run that kept one vector per "
               "FSDP rank)" if state["fsdp_world_size"] != groups.fsdp_world_size else "")
        )
    _warn_if_matched_by_position(place.param_names, place.global_shapes)
    has_lr_scheduler = parts.lr_scheduler is not None
    if has_lr_scheduler != (state["lr_scheduler"] is not None):
        raise ValueError(
            "acco_hooks: load_state_dict: the checkpoint "
            + ("has no" if state["lr_scheduler"] is None else "has an")
            + " LR scheduler state but this optimizer "
            + ("has one" if has_lr_scheduler else "has none")
            + "; pass the same lr_scheduler argument as the saved run"
        )
    saved_shape = (state["world_size"], state["fsdp_world_size"])
    shape = (groups.world_size, groups.fsdp_world_size)
    what = (f"{saved_shape[0]} data-parallel ranks"
            + (f" × FSDP {saved_shape[1]}" if saved_shape[1] > 1 else ""))  # fmt: skip
    resume = (f"resume with {saved_shape[0]} data-parallel ranks"
              + (f" and an FSDP degree of {saved_shape[1]}" if saved_shape[1] > 1 else ""))
    if state["partial_round"] and rank_key not in state["rank_state"]:
        raise ValueError(
            f"acco_hooks: load_state_dict: the checkpoint was saved in the middle of a round "
            f"(round {state['round_index']}, {state['round_microbatches']} micro-batches in), "
            f"and this rank's accumulated gradients ({rank_key}) are not in what was loaded: "
            + ("they exist only on the ranks of the saved run "
               if saved_shape != shape else
               "a distributed checkpoint loads only what the loading optimizer's state_dict() "
               "holds, ")
            + f"({what}). {resume[0].upper() + resume[1:]} from per-rank files "
            "(acco_hooks.checkpoint), or save when step() ends a round"
        )
    if not place.matches(state["master"]):
        raise ValueError(
            f"acco_hooks: load_state_dict: the checkpoint holds another rank's part of the "
            f"optimizer state (it was saved by {what}; this is rank {groups.rank} of "
            f"{groups.world_size}): a per-rank file loads on the rank that wrote it, in a run "
            f"of the same shape. To resume on other ranks, save with torch.distributed."
            "checkpoint (dcp.save of opt.state_dict()) and dcp.load into this optimizer's "
            "state_dict() before load_state_dict"
        )
    if saved_shape == shape:
        return
    others = [name for own in state["optimizer"]["rank_state"].values() for name in own]
    if others:
        raise ValueError(
            f"acco_hooks: load_state_dict: the checkpoint was saved by {what}, this run has "
            f"{groups.world_size}"
            + (f" × FSDP {groups.fsdp_world_size}" if groups.fsdp_world_size > 1 else "")
            + f"; the optimizer keeps state {sorted(set(others))} that is not one value per "
            f"parameter element, which cannot be resharded: {resume}"
        )


# The names normalize_param_groups gives parameters passed without one
_POSITIONAL_NAME = re.compile(r"params\[\d+\]\[\d+\]")


def _warn_if_matched_by_position(names: list[list[str]], shapes: list[list[tuple]]) -> None:
    """Parameters given without names load the checkpoint by position: where two share a shape,
    a saved run that listed them in another order would swap their master weights and moments
    unseen (the model loads by name)."""
    repeated = sum(
        len(group_shapes) - len(set(group_shapes))
        for group_names, group_shapes in zip(names, shapes)
        if any(_POSITIONAL_NAME.fullmatch(name) for name in group_names)
    )  # fmt: skip
    if repeated:
        warnings.warn(
            "acco_hooks: load_state_dict: the optimizer's parameters were given without names, "
            "so the checkpoint's optimizer state is matched to them by position, and some of "
            "them share a shape: had the saved run listed them in another order, they would "
            "take each other's master weights and moments unnoticed. Build the optimizer over "
            "model.named_parameters() (or (name, parameter) pairs) so that checkpoints match by "
            "name",
            UserWarning,
            stacklevel=4,
        )


# ---------------------------------------------------------------- resharded: the carried ΣG̃'s units


def _resharded(state: dict[str, Any], parts: StateParts) -> bool:
    """Whether ``state`` was saved by a run of another shape (the job's data-parallel ranks,
    FSDP degree, round size). A live torchft group's handover is this job's own state."""
    if state.get("handed_over"):
        return False
    saved = (_saved_ranks(state), state["fsdp_world_size"], state["accumulation_steps"])
    return saved != (_job_ranks(parts), parts.groups.fsdp_world_size,
                     parts.settings.accumulation_steps)  # fmt: skip


def _saved_ranks(state: dict[str, Any]) -> int:
    """The saved job's data-parallel ranks: a torchft job's are its groups' (version 6)."""
    return state["world_size"] * state.get("replica_groups", 1)


def _job_ranks(parts: StateParts) -> int:
    """This job's data-parallel ranks; under torchft, over the groups that started with it."""
    replicas = parts.groups.replicas
    return parts.groups.world_size * (1 if replicas is None else replicas.groups)


def _carried_reweigh(state: dict[str, Any], parts: StateParts) -> float | None:
    """Resumed between acco's estimate round and its update in other units than the saved
    ΣG̃'s: what an update round weighed in them, against which ΣG̃ and c̃ are reweighed
    (``communicate``); ``None`` to keep them. A state saved right after such a load, before
    that update, still holds ΣG̃ in the earlier units, and says what they weighed.
    """
    if not state["estimate_count"]:
        return None
    if state["version"] >= 5 and state["carried_reweigh"] is not None:
        return state["carried_reweigh"]
    return _saved_update_round_weight(state) if _resharded(state, parts) else None


def _saved_update_round_weight(state: dict[str, Any]) -> float | None:
    """What the saved run's update round weighed, when a new split changes it; ``None`` when
    the weights are data units, which no split changes.

    The update averages (ΣG̃ + ΣG) / (c̃ + c), and on the new world the carried half must weigh
    what it would weigh there. What a weight counts decides:

    * every micro-batch weighed 1 (a mean loss, ``step()``): a weight counts micro-batches, N·s
      of them on N ranks × s; the update round weighed the estimate round's weight per
      micro-batch times its own micro-batches;
    * shares of an update (the Hugging Face Trainer's, ``weights_are_shares``): an update
      weighs the same whatever its data, W, so the update round weighed W − c̃ (before the
      first update finished, the estimate round's share per micro-batch stands in);
    * any other weight counts what the loss sums over (tokens, ``step(weight=tokens)``):
      ΣG̃ and c̃ do not depend on the split and are kept.

    Version 4 kept the update round's weight while every update weighed the same, version 3
    only whether every weight was 1.
    """
    version, carried = state["version"], state["estimate_count"]
    schedule = Schedule(*state["schedule"])  # between its rounds: an estimate round ran
    by_microbatches = carried * schedule.update_microbatches / schedule.estimate_microbatches
    if version == 3:
        return state["world_size"] * state["accumulation_steps"] if state["unit_weights"] else None
    if version == 4:
        weight = state["update_weight"]
        return None if weight is None else weight or by_microbatches
    if state["unit_weights"]:
        return by_microbatches
    if not state["weights_are_shares"]:
        return None
    whole = state["update_weight"]
    return whole - carried if whole and whole > carried else by_microbatches


def _saved_unit_weights(state: dict[str, Any]) -> bool:
    """Whether every micro-batch of the saved run weighed 1 (version 4 did not say; an update
    round of unit weights weighs ranks × FSDP ranks × accumulation_steps)."""
    if state["version"] == 4:
        return state["update_weight"] == (
            state["world_size"] * state["fsdp_world_size"] * state["accumulation_steps"]
        )  # fmt: skip
    return bool(state["unit_weights"])


def _update_weight_after_load(
    state: dict[str, Any], parts: StateParts, reweigh: float | None
) -> float | None:
    """The loaded engine's W: the saved one while it is in the units the engine's carried ΣG̃
    is in (the same shape, or a reweigh pending); else measured anew (0.0) on this world,
    unless the weights were data units (``None``)."""
    if state["version"] < 5:  # 4's was an update round's, 3 kept none
        return None if state.get("update_weight", 0.0) is None else 0.0
    weight = state["update_weight"]
    if weight is None or reweigh is not None or not _resharded(state, parts):
        return weight
    return 0.0


# ---------------------------------------------------------------- the live parameters


def save_live_parameters(parts: StateParts, live: dict[str, Tensor] | None) -> dict[str, Any]:
    """The body of ``ACCOEngine.live_state_dict``, which documents it. ``live``: the live
    parameters by name where the model holds others (inside ``real_weights``)."""
    shards = []
    for g in parts.buffers:
        shard = torch.zeros(g.shard_numel, dtype=g.gather_dtype, device=parts.device)
        tensors = g.locals if live is None else [live[n] for n in g.names]
        for piece in g.layout.pieces(parts.groups.rank):  # the parameters' parts in this shard
            shard[piece.at_shard : piece.at_shard + piece.numel] = (
                tensors[piece.index].reshape(-1)[piece.at_tensor : piece.at_tensor + piece.numel]
            )
        shards.append(shard)
    return parts.placement.chunks(shards)


def load_live_parameters(parts: StateParts, state: dict[str, Any]) -> None:
    """The body of ``ACCOEngine.load_live_state_dict``, which documents it."""
    shards = [torch.empty(g.shard_numel, dtype=g.gather_dtype, device=parts.device)
              for g in parts.buffers]  # fmt: skip
    parts.placement.fill(shards, state)
    gathered = [torch.empty(g.padded_numel, dtype=g.gather_dtype, device=parts.device)
                for g in parts.buffers]  # fmt: skip
    parts.run_on_thread(all_gather_into, gathered, shards, parts.groups)
    with torch.no_grad():
        for g, vector in zip(parts.buffers, gathered):
            torch._foreach_copy_(g.locals, g.views(vector))


# ---------------------------------------------------------------- handed to a joining group


def handover_state(
    parts: StateParts, counters: dict[str, Any], live: dict[str, Tensor] | None
) -> dict[str, Any]:
    """What a replica group that joins a torchft job takes from a live one (``replicas``):
    this rank's state at the end of the round whose communication is waiting for the joiner,
    as a per-rank state (``LocalChunk`` s, no process group in it) with the live parameters.

    Called on torchft's thread while the engine's communication thread waits for the quorum,
    before it sums the round: the shard side (master, optimizer, carried ΣG̃, LR scheduler) is
    still as the previous round left it, and ``counters`` are the training loop's
    (``RoundState.state_dict``) taken at that round's end, before its communication started.
    The joiner loads it, sends nothing for that round and takes the round's sum as every group
    does: from then on its state is theirs (``load_handover``).
    """
    carried = _carried(parts) if parts.settings.has_estimate_round else None
    chunks = parts.placement.chunks
    state = {
        **_header(parts), **counters, "round_microbatches": 0,
        # the job's own state, in its own units, whatever this group's count of groups says
        "handed_over": True,
        "lr_scheduler": None if parts.lr_scheduler is None else parts.lr_scheduler.state_dict(),
        "pending_job": None, "pending_wire": None,
        "master": chunks([g.master for g in parts.buffers]), "pending_shard": None,
        "carried": None if carried is None else chunks(carried),
        "optimizer": _optimizer_state(parts, agree=False), "partial_round": False,
        "rank_state": {},
    }  # fmt: skip
    return to_local_chunks({"state": state, "live": save_live_parameters(parts, live)})


def load_handover(parts: StateParts, handover: dict[str, Any]) -> None:
    """Take a live group's :func:`handover_state` (checked as a checkpoint is first)."""
    load_state(parts, handover["state"])
    load_live_parameters(parts, handover["live"])


# ---------------------------------------------------------------- helpers


def _local_dtype(chunks: dict[str, Any], key: str) -> torch.dtype:
    chunk = chunks[key]
    return chunk.data.dtype if hasattr(chunk, "offset") else chunk.dtype


def _rank_key() -> str:
    """The key of what this rank alone holds (its accumulators mid-round, optimizer state that
    is not per element): its global rank, which a per-rank file is named by."""
    return f"rank{dist.get_rank() if dist.is_initialized() else 0}"


def _class_name(optimizer: torch.optim.Optimizer) -> str:
    """The shard optimizer's class; a grouped one's, each group's, in the groups' order."""
    if isinstance(optimizer, GroupedOptimizer):
        return "+".join(_class_name(optimizer.optimizers[o]) for o, _ in optimizer.order)
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
