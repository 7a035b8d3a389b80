"""A run's rounds: which schedule they follow, where they are, and what the update under way weighs.

The training loop's side of the engine (the communication thread's is ``communication``). One
:class:`RoundState` per engine holds

* **the schedule**: how an update's micro-batches run (``schedule``: one synchronous round, or
  an estimate round and an update round), whether the next round is an estimate round, and in
  ``mode="auto"`` the controller that picks the next schedule and the one every rank agreed on;
* **the counters**: rounds ended, real updates applied, updates whose micro-batches are all in,
  rounds skipped for a non-finite gradient;
* **the weights of the update under way**: acco's carried ΣG̃ weighs c̃ (``estimate_count``); W
  (``update_weight``) is what a whole update weighed while every update weighed the same; and
  after a resharded resume, in which units the carried ΣG̃ still is;
* **this rank's round being accumulated**: its micro-batches, their weights' sum, and which
  parameters got a gradient.

It turns the round's end into the :class:`~acco_hooks.engine.communication.RoundPlan` the
communication thread runs (:meth:`RoundState.plan_round`) and takes back what the job reports
(:meth:`RoundState.take_result`). ``state`` saves and loads it (:meth:`RoundState.state_dict`,
the same on every rank: a torchft replica group that joins a running job takes a live group's).
"""

from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist
from torch import Tensor

from acco_hooks.engine.communication import Job, RoundPlan, RoundResult
from acco_hooks.engine.schedule import (
    AUTO_ESTIMATE_DTYPES,
    AutoSchedule,
    Schedule,
    candidate_schedules,
)
from acco_hooks.engine.settings import EngineSettings, Mode, SettingError
from acco_hooks.engine.wire import WIRE_FORMATS, backend_can_send

__all__ = ["RoundState", "estimate_formats", "name_some", "wire_fraction"]


class RoundState:
    """Where a run's rounds are, and what they weigh; see the module's docstring.

    Args:
        settings: the engine's settings.
        formats: the estimate formats the engine may send (:func:`estimate_formats`).
        fractions: per format, its bytes over an update's (:func:`wire_fraction`).
        params_per_group: the number of parameters of each of the engine's groups.
        weights_are_shares: the micro-batch weights are each rank's shares of an update
            (``ACCOEngine``).
        report: ``auto`` logs its choices (one rank of the job).
    """

    __slots__ = (
        # how an update runs, which round is next, and mode="auto"'s controller and the
        # schedule every rank agreed on
        "schedule", "estimate_next", "auto", "agreed", "reduce_format",
        # where the rounds are, and the data positions each round takes
        "round_index", "num_updates", "updates_launched", "skipped_rounds", "positions_per_round",
        # what the update under way weighs, and what the weights count
        "estimate_count", "update_weight", "reweigh_carried", "carry_next_update",
        "weights_are_shares", "unit_weights",
        # this rank's round being accumulated
        "microbatches", "local_count", "local_unit", "grad_arrived",
    )  # fmt: skip

    def __init__(
        self, settings: EngineSettings, formats: list[str], fractions: dict[str, float],
        params_per_group: list[int], weights_are_shares: bool, report: bool,
    ) -> None:  # fmt: skip
        steps = settings.accumulation_steps
        self.auto: AutoSchedule | None = None
        if not formats:  # ddp, dpu: one round per update
            self.schedule = Schedule(0, steps)
        elif settings.mode is Mode.ACCO:
            self.schedule = Schedule(settings.estimate_microbatches or steps, steps, formats[0])
        else:
            candidates = candidate_schedules(steps, formats, settings.estimate_microbatches)
            self.auto = AutoSchedule(candidates, settings.reduce_format, fractions, report=report)
            self.schedule = candidates[0]
        self.estimate_next, self.agreed = True, None
        self.reduce_format = settings.reduce_format
        self.round_index = self.num_updates = self.updates_launched = self.skipped_rounds = 0
        # accumulate_until_ready with a cap: every round takes the cap's positions of the data,
        # however many micro-batches each rank ran in it (None: the schedule's own)
        self.positions_per_round = (settings.max_microbatches_per_round
                                    if settings.accumulate_until_ready else None)  # fmt: skip
        self.estimate_count = 0.0  # c̃: the global weight of the estimate round acco carries
        # W: the global weight of one whole update (its estimate and update rounds) while every
        # update weighed the same, in the units the carried ΣG̃ is in; None once two differed
        # (the weights are data units: tokens), 0.0 before the first update finished
        self.update_weight: float | None = 0.0
        # Resumed between an estimate and its update with ΣG̃ in another world's units: what
        # an update round weighed there, against which ΣG̃ and c̃ are reweighed (None: kept)
        self.reweigh_carried: float | None = None
        # Resumed between an estimate sent narrower and its update: the checkpoint held ΣG̃ as
        # a carried half-batch, which the update adds although its schedule carries none
        self.carry_next_update = False
        # What the micro-batch weights count: shares of an update (a front-end says so), or
        # units (tokens; 1: a mean), and whether every one so far, on every rank, weighed 1
        self.weights_are_shares, self.unit_weights = weights_are_shares, True
        # this rank's micro-batches in the accumulators: how many, their weights' sum, whether
        # each weighed exactly 1, and which parameters got a gradient
        self.microbatches, self.local_count, self.local_unit = 0, 0.0, True
        self.grad_arrived = [[False] * n for n in params_per_group]

    # ------------------------------------------------------------ what the schedule says

    @property
    def candidates(self) -> list[Schedule]:
        """``auto``'s candidate schedules (the synchronous one first); otherwise the one."""
        return list(self.auto.candidates) if self.auto is not None else [self.schedule]

    @property
    def between_halves(self) -> bool:
        """acco between its estimate round and its update round: ΣG̃ waits for the update."""
        return not self.schedule.synchronous and not self.estimate_next

    @property
    def estimate_kept(self) -> bool:
        """The estimate round is sent narrower than the reduce dtype: the accumulators keep
        its gradients (and the local counts its weight) for the update round to send."""
        return self.schedule.estimate_dtype != self.reduce_format

    @property
    def round_size(self) -> int:
        """Micro-batches the round being accumulated runs (``ACCOEngine.round_size``)."""
        if self.schedule.synchronous or not self.estimate_next:
            return self.schedule.update_microbatches
        return self.schedule.estimate_microbatches

    @property
    def microbatches_scheduled(self) -> int:
        """Micro-batches taken since training started (``ACCOEngine.microbatches_scheduled``)."""
        if self.positions_per_round is not None:
            return self.round_index * self.positions_per_round + self.microbatches
        schedule = self.schedule  # in auto every candidate takes accumulation_steps per update
        per_update = schedule.estimate_microbatches + schedule.update_microbatches
        return (self.updates_launched * per_update + self.microbatches
                + (schedule.estimate_microbatches if self.between_halves else 0))  # fmt: skip

    # ------------------------------------------------------------ a round, from count to result

    def count(self, weight: float) -> tuple[int, float, bool]:
        """Count one micro-batch of this rank; returns what :meth:`uncount` puts back."""
        counted = (self.microbatches, self.local_count, self.local_unit)
        self.microbatches += 1
        self.local_count += weight
        self.local_unit = self.local_unit and weight == 1.0
        return counted

    def uncount(self, counted: tuple[int, float, bool]) -> None:
        """Undo :meth:`count`: a round end interrupted before its round was launched."""
        self.microbatches, self.local_count, self.local_unit = counted

    def all_arrived(self) -> None:
        """Every parameter counts as having its gradient (a micro-batch that sends none)."""
        for arrived in self.grad_arrived:
            arrived[:] = [True] * len(arrived)

    def check_inputs(
        self, names: list[list[str]], moved: list[str], frozen: list[tuple[str, Tensor]],
        each_rank: bool,
    ) -> None:  # fmt: skip
        """At the round end: every parameter got a gradient (on this rank, with ``each_rank``;
        else the round's communication checks over every rank), none was ``moved`` since the
        engine was built, and none of those ``frozen`` then was unfrozen since (a torch
        optimizer would train it now). ``names``: each group's parameter names."""
        unfrozen = [name for name, p in frozen if p.requires_grad]
        if unfrozen:
            raise RuntimeError(
                f"acco_hooks: {name_some(unfrozen)} had requires_grad=False when the optimizer "
                "was built and requires grad now: the engine left it out and would never train "
                "it (a torch optimizer given it would). Build the optimizer after unfreezing, or "
                "give the unfrozen parameters to a new one"
            )
        if moved:
            raise RuntimeError(
                f"acco_hooks: {name_some(moved)} moved or changed dtype after the optimizer was "
                "built (model.to(), a dtype cast, param.data = ...): the engine holds views of "
                "the old memory and would train parameters the model no longer uses. Move or "
                "cast the model first, then build the optimizer"
            )
        missing = [name for group, arrived in zip(names, self.grad_arrived)
                   for name, ok in zip(group, arrived) if not ok and each_rank]  # fmt: skip
        if missing and len(missing) == sum(len(group) for group in names):
            raise RuntimeError(
                f"acco_hooks: no gradient reached any parameter during round "
                f"{self.round_index}: call loss.backward() before each step()"
            )
        if missing:
            raise RuntimeError(
                f"acco_hooks: no gradient reached {name_some(missing)} during round "
                f"{self.round_index}. Every trained parameter must get a gradient in every "
                "round: run backward() before step(), and set requires_grad=False on "
                "parameters that are not trained (or leave them out of the optimizer's params)"
            )

    def plan_round(self, arrivals: bool) -> RoundPlan:
        """End the round being accumulated: what its communication does.

        acco's update round averages both halves: its job adds the estimate round's
        reduce-scattered ΣG̃, kept on the shard side ("carry"), and its count c̃. An estimate
        sent narrower (``wire``) is not carried: the accumulators and the local count keep it
        (``keeps_accumulator``), and the update round sends both rounds' sum in the reduce
        dtype. A run resumed between a narrow estimate and its update carries too: the
        checkpoint made the kept gradients a carried half-batch.

        The local counts restart unless the accumulators keep their gradients; the caller
        copies the accumulators into the payload (and zeroes them likewise), launches it and
        then calls :meth:`round_launched`.

        Args:
            arrivals: the plan says which parameters got a gradient on this rank (DDP's
                ``find_unused_parameters``: the communication checks them over every rank).
        """
        schedule = self.schedule
        estimate = not schedule.synchronous and self.estimate_next
        keeps = estimate and self.estimate_kept
        carry = (not schedule.synchronous and not self.estimate_kept) or (
            not estimate and self.carry_next_update
        )
        update_carries = carry and not estimate
        plan = RoundPlan(
            Job.ESTIMATE if estimate else Job.UPDATE, self.local_count, self.round_index,
            unit_weights=self.local_unit,
            wire=WIRE_FORMATS[schedule.estimate_dtype] if keeps else None,
            carry=carry, keeps_accumulator=keeps,
            carried_count=self.estimate_count if update_carries else 0.0,
            reweigh_carried=self.reweigh_carried if update_carries else None,
            proposal=None if self.auto is None or estimate
            else self.auto.candidates.index(self.auto.target),
            arrived=tuple(float(ok) for arrived in self.grad_arrived for ok in arrived)
            if arrivals else None,
        )  # fmt: skip
        if not keeps:
            self.local_count, self.local_unit = 0.0, True
        if not estimate:
            self.reweigh_carried, self.carry_next_update = None, False
        return plan

    def round_launched(self, plan: RoundPlan) -> int:
        """The round of ``plan`` is on its way: the next one starts. Returns its micro-batches."""
        microbatches, self.microbatches = self.microbatches, 0
        self.round_index += 1
        for arrived in self.grad_arrived:
            arrived[:] = [False] * len(arrived)
        if not self.schedule.synchronous:
            self.estimate_next = plan.job is not Job.ESTIMATE
        return microbatches

    def take_result(self, result: RoundResult, plan: RoundPlan) -> None:
        """Count what a finished job reports: its weight (c̃ of an estimate, W of an update),
        a real update, ``auto``'s timing and the schedule every rank agreed on."""
        self.unit_weights = self.unit_weights and result.unit_weights
        if plan.job is Job.ESTIMATE:
            self.estimate_count = result.global_count
        elif plan.reweigh_carried is not None:  # the first update in this world's units
            self.update_weight = result.global_count
        elif self.update_weight is not None:  # W: both rounds, the carried ΣG̃'s weight too
            first = self.update_weight == 0.0
            if first or math.isclose(result.global_count, self.update_weight, rel_tol=1e-9):
                self.update_weight = result.global_count
            else:
                self.update_weight = None
        self.num_updates += result.updated
        if self.auto is not None:
            wire = plan.wire
            self.auto.record_comm(self.reduce_format if wire is None else wire.name, result.comm_s)
            if result.schedule_choice is not None:
                self.agreed = self.auto.candidates[result.schedule_choice]

    # ------------------------------------------------------------ saved and loaded

    def state_dict(self) -> dict[str, Any]:
        """The counters, the same on every rank: where the rounds are and what the update under
        way weighs. Plain values, a copy: a torchft handover serves one taken at a round end
        from another thread. This rank's round being accumulated is not in it
        (:meth:`local_state_dict`)."""
        half = self.between_halves
        return {
            "round_index": self.round_index, "num_updates": self.num_updates,
            "skipped_rounds": self.skipped_rounds,
            "schedule": tuple(self.schedule), "estimate_next": self.estimate_next,
            "updates_launched": self.updates_launched,
            "auto": None if self.auto is None else {
                **self.auto.state_dict(),
                "agreed": None if self.agreed is None else tuple(self.agreed),
            },
            # acco between its estimate round and its update: ΣG̃ is carried, and its weight;
            # W, and, resumed from another world with ΣG̃ still in its units, what an update
            # round weighed there
            "estimate_count": self.estimate_count if half else 0.0,
            "unit_weights": self.unit_weights, "weights_are_shares": self.weights_are_shares,
            "update_weight": self.update_weight,
            "carried_reweigh": self.reweigh_carried if half else None,
            # resumed between a narrow estimate and its update: ΣG̃ is carried, not kept in the
            # accumulators (which hold the update round's gradients alone)
            "carry_next_update": self.carry_next_update,
        }  # fmt: skip

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's round being accumulated, beside its accumulators (mid-round only)."""
        return {"local_count": self.local_count, "local_unit_weights": self.local_unit,
                "grad_arrived": [list(a) for a in self.grad_arrived]}  # fmt: skip

    def load_state_dict(
        self, counters: dict[str, Any], microbatches: int, local: dict[str, Any] | None,
        keep_schedule: bool,
    ) -> None:  # fmt: skip
        """Take :meth:`state_dict`'s counters, in this run's units (``state`` translates an
        older or resharded checkpoint's), ``microbatches`` counted in the round under way and
        this rank's :meth:`local_state_dict` (``None``: a round boundary). ``keep_schedule``:
        this run takes another number of micro-batches per update, so the next update starts
        on its own schedule, not the saved one."""
        self.round_index, self.num_updates = counters["round_index"], counters["num_updates"]
        self.skipped_rounds = counters["skipped_rounds"]
        self.updates_launched = counters["updates_launched"]
        self.estimate_next = counters["estimate_next"]
        self.estimate_count = counters["estimate_count"]
        self.unit_weights = counters["unit_weights"]
        self.update_weight = counters["update_weight"]
        self.reweigh_carried = counters["carried_reweigh"]
        self.carry_next_update = counters["carry_next_update"]
        self.microbatches = microbatches
        if local is None:
            self.local_count, self.local_unit = 0.0, True
            self.grad_arrived = [[False] * len(a) for a in self.grad_arrived]
        else:
            self.local_count, self.local_unit = local["local_count"], local["local_unit_weights"]
            self.grad_arrived = [list(a) for a in local["grad_arrived"]]
        if keep_schedule:
            return
        self.schedule = Schedule(*counters["schedule"])
        if self.auto is not None and counters["auto"] is not None:
            self.auto.load_state_dict(counters["auto"])
            agreed = counters["auto"]["agreed"]
            self.agreed = None if agreed is None else Schedule(*agreed)


# ---------------------------------------------------------------- the estimate's formats


def estimate_formats(settings: EngineSettings, data_group: Any, replicas: bool) -> list[str]:
    """The formats the engine may send an estimate round in, by name: none in ``ddp`` and
    ``dpu``, ``estimate_dtype`` in ``acco``; in ``auto`` that one, or the reduce dtype and each
    narrower one of ``AUTO_ESTIMATE_DTYPES`` the backend of ``data_group`` can send (none across
    torchft replica groups, ``replicas``, whose sum takes the reduce dtype only)."""
    if not settings.has_estimate_round:
        return []
    chosen = settings.estimate_format
    if chosen == "float8_e4m3fn" and not backend_can_send(data_group):
        raise SettingError(
            f"acco_hooks: estimate_dtype={settings.estimate_dtype!r} sends bytes with "
            f"all_to_all_single, which the {dist.get_backend(data_group)!r} backend of the "
            "data-parallel group does not run here: use a gloo or NCCL process group, or "
            "estimate_dtype='bfloat16'",
            "estimate_dtype",
        )
    if settings.mode is Mode.ACCO or settings.estimate_dtype is not None:
        return [chosen]
    if replicas:
        return [settings.reduce_format]
    reduce = settings.reduce_torch_dtype
    return [settings.reduce_format] + [
        name for name in AUTO_ESTIMATE_DTYPES
        if WIRE_FORMATS[name].dtype.itemsize < reduce.itemsize
        and (name != "float8_e4m3fn" or backend_can_send(data_group))
    ]  # fmt: skip


def wire_fraction(buffers: list[Any], settings: EngineSettings, name: str) -> float:
    """α of an estimate format: its bytes on the wire, both ways, over the update's."""
    if name == settings.reduce_format:
        return 1.0
    wire = WIRE_FORMATS[name]
    update = sum(g.padded_numel * (settings.reduce_torch_dtype.itemsize + g.gather_dtype.itemsize)
                 for g in buffers)  # fmt: skip
    world_size = buffers[0].padded_numel // buffers[0].shard_numel
    return sum(2 * world_size * wire.nbytes(g.shard_numel) for g in buffers) / update


def name_some(names: list[str]) -> str:
    """The first five of ``names``, for an error message."""
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
