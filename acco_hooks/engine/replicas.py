"""Replica groups under a torchft ``Manager``: the reduction across groups that outlives a group.

With ``manager=`` (a ``torchft.Manager``), the engine's data-parallel group is one *replica
group* (typically one node, its own ``torchrun``), and the groups in torchft's current quorum
together make one data-parallel run. Each group holds a whole optimizer state, sharded over its
own ranks (ZeRO-1 inside the group, or HSDP: FSDP shards times the engine's replicas, and tensor
or pipeline parallel parts beside them); rank r of every group holds the same piece of the
model. A round's job (``communication.communicate``) becomes::

    reduce-scatter inside the group ─► sum rank r's shard over the groups (the manager) ─►
    ÷ global weight ─► clip ─► step or Peek ─► all-gather inside the group

and the slow link, the one between the groups, carries 1/n of the gradients per rank, while
the training loop computes the next round as usual.

**One round, one torchft step.** Each attempt starts a quorum, sums the payload over the groups
in it and asks ``should_commit``. A group that died makes the sum fail on the others; no group
commits, nothing of the round is applied, and the same payload (kept aside, since a failed
collective may leave its buffer half-summed) is summed again in a new quorum without the dead
group, until a quorum commits or the round's patience (twice ``timeout``; with
``timeout=None`` twice the manager's own timeout) runs out. Attempts after the second wait a
little longer each (0.1 s, doubling, at most 5 s): a quorum that cannot commit (fewer groups
than the manager's ``min_replica_size``) is asked a few times a patience, not hundreds. The
average is then over the groups that took part (the weights as without torchft), and in
``acco`` the carried half-batch and its weight are the committed estimate round's on every
survivor: the estimate/update pairing holds across the change.

**What every group must agree on** travels in every sum beside the tensors, as small integers
and their squares (equal sums of both over k groups mean that all k agree):

* from every group, also in the first step a group takes (before it trains or takes a state):
  its settings (the engine's settings, the optimizer and its arguments, the LR scheduler, the
  parameters' names and shapes, the group's layout) and its number of ranks;
* from the groups whose tensors are in the sum: the round index, the optimizer's
  hyperparameters as the round will step with them (an LR scheduler's learning rate, one set by
  hand) and, in the first round, a checksum of the parameters (replicas that were not
  initialized the same).

A difference is refused by name. Groups of another number of ranks never commit a step
together (rank r of one group has no rank r to sum with in the other), so what they differ in
is read from the sums of the ranks that do meet, before anything else: every group's first
rank. A group's first step is therefore one of its own, before the step it joins in
(:meth:`join`): a quorum without healing and without a commit, in which every group that starts
with the job sends its marks (torchft zeroes what a group it is healing sends, and would hide
them), alone first, and compares them before it sends anything shaped by its size (a shard is
another size in a group of another size, and gloo aborts the process on a sum of two sizes).
The whole job then stops, by name, before the first round. A group that joins a running job
sees the live groups' marks there, and is refused by name, alone, if it differs: the live
groups see nothing of a group until it trains with them (torchft zeroes a joiner's sums), and
go on as the run they were. A sum's marks are its first tensor.

**``mode="auto"``** changes the schedule at update boundaries, and every group must change it at
the same one. As inside a group, where the first rank's proposal is the one run, one group
decides: the quorum's first participating group (torchft's ``participating_rank() == 0``) adds
its proposal to an update round's sum, and every group runs what the sum says. When that group
is lost, the next first one decides from its own timings (every group timed the same schedules).
Only the reduce dtype's schedules are candidates (an estimate sent narrower is refused, above).

**A group that joins** (one restarted after it was lost, or started late) takes a live
group's state before it trains: healing, torchft's mechanism, with what the engine holds. Every
group takes one torchft step before its first round (:meth:`join`), after the one that compares
(above). At the job's start all groups are in that step and sum zeros (with torchft's
``init_sync``, rank r of every group takes the state of the one group its rank picks, and the
group loads together). Later, the live groups are in some round's sum when the joiner's step
meets them (the round after the one its first step met): torchft hands the
joiner a live group's state as it was at that round's end (``state.handover_state``:
parameters, master shard, optimizer state, LR scheduler, counters, the carried half-batch); the
joiner sends zeros in that sum, takes its result, and then sits that round out
(``skip_microbatch``): its job steps with the same sum from the same state, and from the next
round on it computes at the same parameters as every group. A torchft step is therefore a round
plus one. torchft heals a group only in the attempt whose quorum finds it behind: where that
sum then fails (another group died in it), the state handed over stays this group's for the
retries of the same round.

**A group that falls behind.** torchft's commit is each group's own: a sum that fails on one
group alone (an error on its link once the others had their result) is committed by the others,
which go on to the next round, and retried by that group alone. Its retry meets them a round
(or more) further, behind by a committed round, and torchft heals it there: it sends zeros,
takes the others' state and that round's sum, and its communication thread stops the round's
job (:class:`GroupFellBehind`). The engine then loads the state on the training loop's thread
and sits the round under way out, as a group that joins does (``ACCOEngine``; the loop reads on
from ``microbatches_scheduled`` at its next round end).
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import logging
import os
import re
import socket
import time
import urllib.parse
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.constants import default_pg_timeout

from acco_hooks._versions import check_supported_versions

__all__ = ["GroupFellBehind", "ReplicaGroups", "check_lighthouse_address", "describe_replica_group"]

logger = logging.getLogger(__name__)

# A mark is an integer below 2**20, so that the sums of marks and of their squares over up to
# 2**12 groups are exact in float64.
_FINGERPRINT_BITS = 20
# What a group adds to every sum beside its tensors, one float64 slot each:
_TAKES_PART = 0  # 1: this group's tensors are in the sum (not a joiner's zeros)
_ROUND = slice(1, 4)  # the round index, the parameters' checksum (round 0), the hyperparameters
_ROUND_SQUARES = slice(4, 7)
_DECIDES, _PROPOSAL = 7, 8  # mode="auto": 1 and the proposal, from the deciding group alone
_PRESENT = 9  # 1 from every group, in the first step it takes too
_GROUP = slice(10, 12)  # the settings, the group's number of ranks
_GROUP_SQUARES = slice(12, 14)
_SUMMED = 14
_STATE_KEY = "acco_hooks"
# The wait before each attempt after the second: doubling from the first, at most the last
_BACKOFF_S = (0.1, 5.0)
# The least a quorum is given (what is left of a round's patience may be less), and how often
# a group at the job's start asks again while it waits for the others (``start_groups``)
_LEAST_QUORUM_S = 1.0
_START_POLL_S = 0.2


def describe_replica_group(
    settings: Any, classes: list[type], optimizer_kwargs: dict[str, Any],
    param_groups: list[dict[str, Any]], process_group: Any, fsdp_process_group: Any,
    norm_process_group: Any,
) -> str:  # fmt: skip
    """What every torchft replica group must build the same, as text (``replicas``); the
    group's layout is its replicas, FSDP shards and the ranks of its whole model (tensor and
    pipeline parallel parts)."""
    def size(group: Any) -> int:  # a ProcessGroup or a 1-D DeviceMesh (None: the world)
        return dist.get_world_size(group) if dist.is_initialized() else 1

    group_size = (size(process_group),
                  *(1 if group is None else size(group)
                    for group in (fsdp_process_group, norm_process_group)))  # fmt: skip
    layout = [[(name, tuple(p.shape), str(p.dtype)) for name, p in zip(g["names"], g["params"])]
              for g in param_groups]  # fmt: skip
    options = [{k: v for k, v in g.items() if k not in ("params", "names")} for g in param_groups]
    return repr((settings, classes, sorted(optimizer_kwargs.items()),
                 layout, options, group_size))  # fmt: skip


class GroupFellBehind(Exception):
    """This replica group's sum of round ``round_index`` failed where the other groups committed
    it; its retry met them in round ``joined_round``, where torchft handed it a live group's
    state and this group took that round's sum. Raised out of the round's job on the
    communication thread: the engine loads the state (:meth:`ReplicaGroups.take_rejoin`) and
    sits ``joined_round`` out."""

    def __init__(self, round_index: int, joined_round: int) -> None:
        super().__init__(f"round {round_index}: this replica group fell behind the others, "
                         f"which summed round {joined_round} already")  # fmt: skip
        self.round_index, self.joined_round = round_index, joined_round


class ReplicaGroups:
    """The replica groups of a torchft ``Manager``, as the engine's communication thread uses
    them: :meth:`attach` and :meth:`join` once, before the first round, then :meth:`sum` once
    per round.

    Args:
        manager: the ``torchft.Manager`` of this replica group.
        description: what every group must build the same (the settings, the optimizer and its
            arguments, the parameters' names and shapes, the group's layout), as text.
        group_size: this replica group's number of ranks (its ``torchrun``'s world).
        narrow_estimate: ``estimate_dtype`` is narrower than ``reduce_dtype`` (refused).
        until_ready_uncapped: ``accumulate_until_ready`` without ``max_microbatches_per_round``
            (refused: the cap gives every round its data positions in every group).
        timeout: the engine's ``timeout`` (seconds; ``None``: the manager's own timeout): the
            longest a sum over the groups may wait for a silent peer. A round looks for a
            quorum that commits for :attr:`patience_s`, twice that: one failed sum notices the
            dead group, and the quorum without it forms within the other (the lighthouse's
            heartbeat timeout).
    """

    __slots__ = ("_description", "_hyperparameters", "_joined", "_members", "_quorums", "_received",
                 "_rejoin", "_serve", "_settings_mark", "_size", "groups", "logs", "manager",
                 "patience_s", "start_groups", "summed_groups", "timeout")  # fmt: skip

    def __init__(
        self, manager: Any, description: str, *, group_size: int, narrow_estimate: bool,
        until_ready_uncapped: bool, timeout: float | None, start_groups: int | None = None,
        logs: bool = True,
    ) -> None:  # fmt: skip
        try:
            from torchft import Manager
        except ImportError:
            raise ImportError(
                "acco_hooks: manager= needs torchft: pip install 'acco_hooks[ft]' (torchft 0.2)"
            ) from None
        check_supported_versions(torchft=importlib.metadata.version("torchft"))
        if narrow_estimate:
            raise ValueError(
                "acco_hooks: an estimate_dtype narrower than reduce_dtype is not supported with "
                "a torchft manager yet (the estimate would be summed across groups encoded). "
                "Leave estimate_dtype unset"
            )
        if until_ready_uncapped:
            raise ValueError(
                "acco_hooks: accumulate_until_ready=True with a torchft manager needs "
                "max_microbatches_per_round: a group that joins reads its data on from the "
                "positions the rounds before took, and a round that accumulates until ready "
                "runs another number of micro-batches on each group; with a cap every round "
                "takes the cap's positions (microbatches_scheduled), so that no group reads "
                "what another read. Set max_microbatches_per_round"
            )
        if not isinstance(manager, Manager):
            raise TypeError(
                f"acco_hooks: manager must be a torchft.Manager, got {type(manager).__name__}"
            )
        if start_groups is not None and (not isinstance(start_groups, int) or start_groups < 1):
            raise ValueError(f"acco_hooks: replica_groups must be a positive int (the replica "
                             f"groups the job is launched with), got {start_groups!r}")  # fmt: skip
        self.manager, self.timeout, self.start_groups = manager, timeout, start_groups
        self._quorums = _QuorumRecorder.install(manager)
        self.logs = logs  # whether this rank says what happens to the job (one rank a group)
        # The groups (their names, as the lighthouse has them) of the last committed quorum
        self._members: tuple[str, ...] | None = None
        # timeout=None: the manager's own, which bounds its collectives and votes (torchft 0.2
        # keeps it as _timeout)
        manager_timeout = getattr(manager, "_timeout", default_pg_timeout).total_seconds()
        self.patience_s = 2.0 * (manager_timeout if timeout is None else timeout)
        self._description, self._size = description, group_size
        self._settings_mark = _mark(description)  # with the LR scheduler, in attach()
        self._serve: Callable[[], dict[str, Any]] | None = None  # the engine's handover
        self._hyperparameters: Callable[[], str] = str
        self._received: dict[str, Any] | None = None  # a live group's, as torchft hands it
        # a round whose sum this group took while joining or catching up: (round, sums, marks)
        self._joined: tuple[int, list[Tensor], Tensor] | None = None
        self._rejoin: tuple[dict[str, Any], int] | None = None  # for take_rejoin()
        # The groups in the job's first step (this one's, at the start: every group's), and
        # the groups whose tensors the last committed sum holds
        self.groups = self.summed_groups = 1
        # torchft asks a live group for its state when another one joins (on its own thread),
        # and gives it to the joiner (in should_commit, or start_quorum without async quorum)
        manager.register_state_dict_fn(_STATE_KEY, self._receive, self._hand_over)

    def attach(
        self, serve: Callable[[], dict[str, Any]], hyperparameters: Callable[[], str],
        lr_scheduler: Any,
    ) -> None:  # fmt: skip
        """The engine, once built: ``serve()`` is what a joining group gets from this one
        (called on torchft's thread while this group's communication waits for the quorum:
        ``state.handover_state``); ``hyperparameters()`` the shard optimizer's as the round
        being summed will step with them (read in each sum); ``lr_scheduler`` the one it built
        (its class and arguments are settings every group must share)."""
        self._serve, self._hyperparameters = serve, hyperparameters
        self._settings_mark = _mark(self._description + repr(_describe_scheduler(lr_scheduler)))

    def join(
        self, skipped: list[Tensor], agree: Callable[[float], float]
    ) -> tuple[dict[str, Any] | None, int | None]:  # fmt: skip
        """This group's first torchft steps, before its first round. Returns the state a live
        group handed over (``None``: none, every group starts here) and the round the live
        groups are summing (``None``: none; this group then sits it out, and the next
        :meth:`sum` is that round's, already taken).

        Args:
            skipped: zeros shaped as the tensors :meth:`sum` sums (this group's part of the
                round it joins in: nothing).
            agree: the sum of a number over this group's ranks (the first step's outcome: every
                rank goes on, or every rank tries again).
        """
        self._compare_with_the_job(skipped, agree)
        manager = self.manager
        deadline = time.monotonic() + self.patience_s
        received, attempt = None, 0
        while True:
            attempt += 1
            self._received = None
            self._quorum("joining the job", deadline, attempt)
            # torchft moved a joiner's step to the live groups': 0 only while every group in
            # the quorum is at its join step, a round's step otherwise
            round_index = manager.current_step() - 1
            seen, summed = self._compare(skipped)
            committed = manager.should_commit()
            if self._received is not None:  # healed in this attempt (its sum may still fail)
                received = (self._received, round_index)
            if committed:
                break
            self._retry_or_give_up("joining the job", attempt, deadline)
        self._received = None
        self._members = self._quorums.replica_ids()  # the job as this group starts in it
        if round_index < 0:  # the job's start: init_sync's state, if any
            return (None if received is None else received[0]), None
        if received is None or received[1] != round_index:
            raise RuntimeError(
                f"acco_hooks: this replica group joined a job at round {round_index}, and torchft "
                "committed the step without handing it a live group's state of that round; "
                "restart this group (its torchrun)"
            )
        self._joined = (round_index, summed, seen)
        return received[0], round_index

    def _compare_with_the_job(self, skipped: list[Tensor], agree: Callable[[float], float]) -> None:
        """The first step: a quorum in which no group heals, so that every group starting with
        the job sends its settings and number of ranks; compared before this group trains. Not
        committed (torchft's step stays where it was). Tried again while some rank of this
        group had no sum (every rank goes on together), and, with :attr:`start_groups`, while
        fewer groups are up at the job's start (for at most :attr:`patience_s`).

        A group whose name (its Manager's ``replica_id``) a live group has is refused here, by
        name, once it took part in the sum with nothing: an earlier start of it still running
        would otherwise be summed twice, with the data read twice."""
        manager = self.manager
        deadline = time.monotonic() + self.patience_s
        attempt, waiting = 0, False
        while True:
            attempt += 1
            self._quorum("comparing settings with the other replica groups", deadline, attempt,
                         allow_heal=False)  # fmt: skip
            seen, _ = self._compare(skipped)
            # a rank of a group of another size has no peer to sum with: the first rank of
            # each group compares, and the others try again with it
            if agree(float(manager.errored() is not None)) == 0:
                self._refuse_a_second_start()
                # every rank waits on, or none (each reads its own clock)
                if agree(float(not self._waits_for_the_others(deadline, waiting))) > 0:
                    break
                waiting = True
                time.sleep(_START_POLL_S)
                continue
            self._retry_or_give_up("comparing settings with the other replica groups", attempt,
                                   deadline, "a rank of this group had no sum")  # fmt: skip
        # a joiner behind the live groups is not in their sum (torchft zeroes it)
        self.groups = round(seen[_PRESENT].item()) + (0 if manager.is_participating() else 1)

    def _refuse_a_second_start(self) -> None:
        """Refuse this group if another group in the quorum has its name: the lighthouse tells
        starts of a group apart by the uuid each start of a Manager adds to the name."""
        ids, own = self._quorums.replica_ids(), self._quorums.own_replica_id()
        name = _group_name(own)
        others = [i for i in ids if i != own and _group_name(i) == name]
        if others:
            raise RuntimeError(
                f"acco_hooks: a replica group named {name!r} is in the job already ({others[0]}; "
                f"this start is {own}): two groups of one name read the same data and are "
                "summed twice. Is an earlier start of this group still running? A torchrun "
                "killed with SIGKILL leaves its workers running (they are in sessions of their "
                "own): stop them (pkill -f with the group's command line; pgrep -af shows what "
                "is left), or give this group a replica_id of its own"
            )

    def _waits_for_the_others(self, deadline: float, waiting: bool) -> bool:
        """With :attr:`start_groups`: whether the first step waits on for more groups (the
        job's start, fewer groups up, within the patience), saying so once."""
        if self.start_groups is None:
            return False
        ids, ahead = self._quorums.replica_ids(), self._quorums.max_step()
        if len(ids) >= self.start_groups or ahead > self.manager.current_step():
            return False  # every group is up, or the job runs already: this group joins it
        if time.monotonic() > deadline:
            if self.logs:
                logger.warning(
                    "acco_hooks: the job starts with %d of its %d replica groups "
                    "(replica_groups): the others did not come up within %.0f s, and join the "
                    "running job when they do", len(ids), self.start_groups, self.patience_s,
                )  # fmt: skip
            return False
        if not waiting and self.logs:
            logger.warning(
                "acco_hooks: %d of the job's %d replica groups are up (%s): the first round "
                "waits up to %.0f s for the others", len(ids), self.start_groups,
                ", ".join(_display(ids)), self.patience_s,
            )  # fmt: skip
        return True

    def _compare(self, skipped: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """A step this group takes part in with nothing: its marks summed first and compared
        (refused by name), and only then the zeros shaped as a round's tensors, which are
        another size in a group of another number of ranks (gloo aborts the process on a sum
        of two sizes). Returns the summed marks and tensors."""
        seen = self._reduce([self._group_marks()])[0]
        if self.manager.errored() is None:
            _check_group_marks(seen, self._group_marks())
        return seen, self._reduce(skipped)

    def take_rejoin(self) -> tuple[dict[str, Any], int]:
        """After :class:`GroupFellBehind`: the live group's state torchft handed over, and the
        round whose sum this group took (the next :meth:`sum` is that round's)."""
        rejoin, self._rejoin = self._rejoin, None
        if rejoin is None:
            raise RuntimeError("acco_hooks: no live group's state to take")
        return rejoin

    def resume_at(self, round_index: int) -> None:
        """After a checkpoint load: torchft's step follows the engine's rounds again (round r
        is step r + 1: every group took one step as it joined), so that a group joining later
        is told the round the others are summing. Every group must load the same checkpoint
        (a round index that differs is refused by name in the next sum)."""
        manager = self.manager
        manager.load_state_dict({"step": round_index + 1,
                                 "batches_committed": manager.batches_committed()})  # fmt: skip

    def _receive(self, state: dict[str, Any]) -> None:
        self._received = state

    def _hand_over(self) -> dict[str, Any]:
        if self._serve is None:
            raise RuntimeError("acco_hooks: a replica group asked for this group's state "
                               "before its engine was built")  # fmt: skip
        return self._serve()

    def sum(
        self, tensors: list[Tensor], round_index: int, master: list[Tensor],
        proposal: int | None = None,
    ) -> tuple[int, int | None]:  # fmt: skip
        """Sum each of ``tensors`` over the replica groups of a quorum that commits. Refuses
        (``RuntimeError``) groups that disagree.

        Every attempt starts a quorum; one that fails (a group died) is not committed anywhere
        and the sum is taken again, from the same inputs, in the next quorum.

        Args:
            proposal: ``mode="auto"``, an update round: the schedule this rank proposes next
                (an index into the candidates).

        Returns:
            How many groups took part, and the deciding group's proposal (``None``: none was
            given, or the deciding group was one joining in this round, which proposes
            nothing): the same on every group.

        Raises:
            GroupFellBehind: this group's sum failed where the others committed it, and it
                took a later round's sum with a live group's state (:meth:`take_rejoin`).
        """
        manager = self.manager
        marks = self._group_marks()
        own = torch.tensor(self._round_marks(round_index, master), dtype=torch.float64)
        marks[_TAKES_PART], marks[_ROUND], marks[_ROUND_SQUARES] = 1.0, own, own * own
        joined, self._joined = self._joined, None
        if joined is not None:  # this round was summed while this group joined
            if joined[0] != round_index:
                raise RuntimeError(f"acco_hooks: joined at round {joined[0]}, summing round "
                                   f"{round_index}: the engine lost its place")  # fmt: skip
            summed, seen, attempt = joined[1], joined[2], 0
        else:
            started = time.monotonic()
            deadline = started + self.patience_s
            received, attempt, zeros = None, 0, None
            while True:
                attempt += 1
                self._received = None
                self._quorum(f"round {round_index}", deadline, attempt)
                at = manager.current_step() - 1
                # torchft moved this group's step to the others' (healing it): they committed
                # this round already, and this group's payload is one they summed
                behind = at != round_index
                if behind and zeros is None:
                    zeros = [torch.zeros_like(t) for t in tensors]
                # the quorum's first group decides auto's schedule (set per quorum: it may be
                # another group's turn after one was lost)
                decides = (not behind and proposal is not None
                           and manager.participating_rank() == 0)  # fmt: skip
                marks[_DECIDES] = 1.0 if decides else 0.0
                marks[_PROPOSAL] = float(proposal) if decides else 0.0
                # the marks first: a group's first steps sum them alone and compare them before
                # they send anything shaped by their size (``_compare``)
                seen, *summed = self._reduce([self._group_marks(), *zeros] if behind
                                             else [marks, *tensors])  # fmt: skip
                if manager.errored() is None:
                    _check_group_marks(seen, marks)
                committed = manager.should_commit()
                if self._received is not None:
                    received = (self._received, at)
                if committed:
                    break
                self._retry_or_give_up(f"round {round_index}", attempt, deadline)
            self._received = None
            if behind:
                if received is None or received[1] != at:
                    raise RuntimeError(
                        f"acco_hooks: round {round_index}: this replica group's sum failed where "
                        f"the others committed it, and torchft committed round {at} without "
                        "handing it a live group's state; restart this group (its torchrun)"
                    )
                self._joined, self._rejoin = (at, summed, seen), (received[0], at)
                raise GroupFellBehind(round_index, at)
        participants = round(seen[_TAKES_PART].item())
        _check_round_marks(seen, marks, participants, round_index)
        torch._foreach_copy_(tensors, summed)
        self.summed_groups = participants
        if joined is None:
            self._say_what_changed(round_index, attempt, time.monotonic() - started, participants)
        deciders, decided = seen[_DECIDES].item(), seen[_PROPOSAL].item()
        if deciders > 1:  # torchft numbers the participants: one is first
            raise RuntimeError(f"acco_hooks: round {round_index}: {deciders:g} replica groups "
                               "proposed auto's schedule, expected one")  # fmt: skip
        return participants, (round(decided) if deciders == 1 else None)

    def _reduce(self, tensors: list[Tensor]) -> list[Tensor]:
        """Each of ``tensors`` summed over the quorum's groups, into copies: a failed sum may
        leave its buffer half-summed, and the attempt after it starts from the originals."""
        sums = [t.clone() for t in tensors]
        works = [self.manager.allreduce(t, reduce_op=dist.ReduceOp.SUM) for t in sums]
        for work in works:
            work.wait()
        return sums

    def _retry_or_give_up(
        self, what: str, attempt: int, deadline: float,
        no_error: str = "the manager's vote was no: fewer groups than its min_replica_size?",
    ) -> None:  # fmt: skip
        """After a failed attempt: give up past the patience, else wait (nothing before the
        second attempt, which a lost group's quorum needs at once; then longer each time).
        ``no_error``: why, when this rank's manager saw no error. The first failure of a sum
        is said once (this group's first rank), and the commit that follows (``sum``)."""
        error = self.manager.errored()
        reason = no_error if error is None else _reason(error)
        now = time.monotonic()
        if now > deadline:
            raise RuntimeError(
                f"acco_hooks: {what}: no quorum of replica groups committed within "
                f"{self.patience_s:.0f} s ({attempt} attempts; {self._patience_setting()}; the "
                f"last: {reason}). "
                + (_lighthouse_down() or "Are at least the manager's min_replica_size groups "
                   "alive?")
            )  # fmt: skip
        first, most = _BACKOFF_S
        wait = 0.0 if attempt == 1 else min(most, first * 2 ** (attempt - 2), deadline - now)
        logger.log(
            logging.WARNING if attempt == 1 and self.logs else logging.INFO,
            "acco_hooks: %s: the sum over the replica groups failed (%s); trying again in a new "
            "quorum%s", what, reason, f" in {wait:.1f} s (attempt {attempt + 1})" if wait else "",
        )  # fmt: skip
        time.sleep(wait)

    def _quorum(self, what: str, deadline: float, attempt: int, allow_heal: bool = True) -> None:
        """Start a quorum and wait for it, for what is left of the patience. torchft keeps a
        quorum that failed (its next ``start_quorum`` raises it again), so no attempt follows
        one: the round fails, with the lighthouse's state named."""
        left = max(deadline - time.monotonic(), _LEAST_QUORUM_S)
        self.manager.start_quorum(allow_heal=allow_heal, timeout=datetime.timedelta(seconds=left))
        try:
            self.manager.wait_quorum()
        except Exception as error:  # noqa: BLE001 - torchft's reason, in the error raised
            raise RuntimeError(
                f"acco_hooks: {what}: no quorum of replica groups formed within "
                f"{self.patience_s:.0f} s (attempt {attempt}; {self._patience_setting()}): "
                + (_lighthouse_down() or "the lighthouse answers, but formed no quorum in time: "
                   "fewer live groups than its --min_replicas?")
                + f" (torchft: {_reason(error)})"
            ) from None  # fmt: skip

    def _patience_setting(self) -> str:
        return "twice " + ("the manager's timeout" if self.timeout is None
                           else f"timeout={self.timeout:g}")  # fmt: skip

    def _say_what_changed(
        self, round_index: int, attempt: int, took_s: float, participants: int
    ) -> None:  # fmt: skip
        """One line (this group's first rank) where a round's sum took more than one attempt
        or the quorum's groups changed: which group left or came, and when it committed."""
        ids, members = self._quorums.replica_ids(), self._members
        self._members = ids
        left = [] if members is None else [i for i in members if i not in ids]
        came = [] if members is None else [i for i in ids if i not in members]
        if not self.logs or not (attempt > 1 or left or came):
            return
        changes = ([f"{', '.join(_display(left, members))} left the job"] if left else []) + (
            [f"{', '.join(_display(came, ids))} joined the quorum"] if came else [])  # fmt: skip
        logger.warning(
            "acco_hooks: round %d committed%s %.1f s after its sum began, summed over %d replica "
            "group%s (the quorum: %s)%s", round_index,
            f" at attempt {attempt}," if attempt > 1 else "", took_s, participants,
            "" if participants == 1 else "s", ", ".join(_display(ids)),
            "".join(f"; {change}" for change in changes),
        )  # fmt: skip

    def _group_marks(self) -> Tensor:
        """The marks every group sends in every sum: present, its settings, its size."""
        marks = torch.zeros(_SUMMED, dtype=torch.float64)
        own = torch.tensor([float(self._settings_mark), float(self._size)], dtype=torch.float64)
        marks[_PRESENT], marks[_GROUP], marks[_GROUP_SQUARES] = 1.0, own, own * own
        return marks

    def _round_marks(self, round_index: int, master: list[Tensor]) -> list[float]:
        """The round, in the first round a checksum of this rank's master shard (the initial
        parameters), and the optimizer's hyperparameters as this round steps with them."""
        checksum = 0
        if round_index == 0:
            for shard in master:
                checksum = zlib.crc32(shard.detach().cpu().contiguous().numpy().tobytes(), checksum)
        bits = 1 << _FINGERPRINT_BITS
        return [float(round_index % bits), float(checksum % bits),
                float(_mark(self._hyperparameters()))]  # fmt: skip


def _check_group_marks(seen: Tensor, own: Tensor) -> None:
    """Refuse a sum in which the groups present differ in their settings or size."""
    present = seen[_PRESENT].item()
    if present == 0 or (torch.equal(seen[_GROUP], own[_GROUP] * present)
                        and torch.equal(seen[_GROUP_SQUARES], own[_GROUP_SQUARES] * present)):
        return  # fmt: skip
    size, ranks = own[_GROUP][1].item(), seen[_GROUP][1].item()
    if ranks != size * present or seen[_GROUP_SQUARES][1] != own[_GROUP_SQUARES][1] * present:
        raise RuntimeError(
            f"acco_hooks: the replica groups differ in their number of ranks: this group has "
            f"{size:g}, the {present:g} groups in this sum have {ranks:g} in all. Every replica "
            "group must run the same number of ranks (the same torchrun --nproc_per_node, and "
            "the same layout inside): rank r of each group holds the same part of the model "
            "and sums it with rank r of the others"
        )
    raise RuntimeError(
        "acco_hooks: the replica groups differ in their settings (mode, accumulation_steps, "
        "the optimizer and its arguments, the LR scheduler, the parameters' names and shapes, "
        "the group's layout). Every group must build the same model and optimizer with the "
        "same settings and lr_scheduler; a group that joins a running job takes the others' "
        "state, not their settings"
    )


def _check_round_marks(seen: Tensor, own: Tensor, participants: int, round_index: int) -> None:
    """Refuse a committed sum whose groups differ in their round, initial parameters or
    hyperparameters."""
    values, squares = seen[_ROUND], seen[_ROUND_SQUARES]
    if torch.equal(values, own[_ROUND] * participants) and torch.equal(
        squares, own[_ROUND_SQUARES] * participants
    ):
        return
    what = [
        ("round index", "load the same checkpoint on every group (or none)"),
        ("initial parameters", ("seed them the same, or load the same checkpoint on every "
                                "group, or use torchft's init_sync")),
        ("optimizer hyperparameters (the learning rate, ...) for this round",
         ("give every group the same lr_scheduler, and change a hyperparameter by hand (a "
          "learning rate) at the same round in every group")),
    ]  # fmt: skip
    differ = [what[i] for i in range(len(what))
              if values[i] != own[_ROUND][i] * participants
              or squares[i] != own[_ROUND_SQUARES][i] * participants]  # fmt: skip
    raise RuntimeError(
        f"acco_hooks: round {round_index}: the replica groups differ in their "
        + " and ".join(name for name, _ in differ) + ": "
        + "; ".join(fix for _, fix in differ)
    )  # fmt: skip


def _describe_scheduler(scheduler: Any) -> Any:
    """An LR scheduler as every group builds it: its class and its plain state (its arguments,
    the base learning rates); values that are not plain data (functions) are left out, and the
    learning rate each round steps with is compared in every sum."""
    if scheduler is None:
        return None
    return (f"{type(scheduler).__module__}.{type(scheduler).__qualname__}",
            sorted((k, v) for k, v in scheduler.state_dict().items() if _plain(v)))  # fmt: skip


def _plain(value: Any) -> bool:
    if isinstance(value, (bool, int, float, str, type(None))):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def _mark(text: str) -> int:
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "little") % (1 << _FINGERPRINT_BITS)


class _QuorumRecorder:
    """This rank's torchft ``ManagerClient``, keeping the last quorum it returned.

    torchft 0.2's ``Manager`` reads the quorum's replica ids (the names the groups gave their
    Managers, each with the uuid a start of a Manager draws) and its highest step in
    ``_async_quorum``, and keeps neither where a caller can read them. The engine needs them:
    to refuse a second start of a live group, to say which group left or came, and to tell a
    running job from one that starts. Written on torchft's quorum thread, read after
    ``wait_quorum``."""

    __slots__ = ("_client", "last")

    def __init__(self, client: Any) -> None:
        self._client, self.last = client, None

    @classmethod
    def install(cls, manager: Any) -> _QuorumRecorder:
        client = getattr(manager, "_client", None)
        if isinstance(client, cls):
            return client
        if client is None or not hasattr(client, "_quorum"):
            raise RuntimeError(
                "acco_hooks: this torchft Manager has no ManagerClient to read its quorums from "
                "(torchft 0.2's Manager._client): install the torchft release acco_hooks "
                "supports, pip install 'acco_hooks[ft]'"
            )
        manager._client = recorder = cls(client)
        return recorder

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self.last = self._client._quorum(*args, **kwargs)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def replica_ids(self) -> tuple[str, ...]:
        return () if self.last is None else tuple(self.last.replica_ids)

    def own_replica_id(self) -> str:
        """This group's id in the last quorum (torchft numbers the quorum's ids in order)."""
        ids = self.replica_ids()
        return ids[self.last.replica_rank] if 0 <= self.last.replica_rank < len(ids) else ""

    def max_step(self) -> int:
        return 0 if self.last is None else self.last.max_step


def _group_name(replica_id: str) -> str:
    """A group's name without the uuid torchft adds to it at each start of its Manager."""
    return replica_id.rsplit(":", 1)[0] if ":" in replica_id else replica_id


def _display(ids: Any, among: Any = None) -> list[str]:
    """Groups by name; with their uuid where two starts of one name are among ``among``."""
    names = [_group_name(i) for i in (ids if among is None else among)]
    return [i if names.count(_group_name(i)) > 1 else _group_name(i) for i in ids]


def _reason(error: BaseException) -> str:
    """The reason in a torchft or gloo error, without the traceback torchft's text carries or
    gloo's source location and advice: its first line's first sentence."""
    text = (str(error).strip().splitlines() or [""])[0]
    status = re.search(r'message: "([^"]*)"', text)  # a gRPC status from torchft's client
    if status:
        return status.group(1)
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h|rs):\d+\]\s*", "", text)
    return re.split(r"(?<=\.)\s", text, maxsplit=1)[0] or type(error).__name__


def check_lighthouse_address(address: str | None = None) -> str:
    """The torchft lighthouse's address a ``Manager`` is built with: ``address``, else
    ``$TORCHFT_LIGHTHOUSE``. Refused by name when it is missing or names no host (an unset
    shell variable: ``http://$HEAD:29510`` with ``HEAD`` unset is ``http://:29510``), which
    torchft reports as a DNS error after its connect timeout."""
    address = address or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not address:
        raise ValueError("acco_hooks: no torchft lighthouse: set TORCHFT_LIGHTHOUSE to its "
                         "address, e.g. export TORCHFT_LIGHTHOUSE=http://localhost:29510")
    url = urllib.parse.urlsplit(address)
    try:
        port = url.port
    except ValueError:
        port = None
    if not url.hostname or port is None:
        raise ValueError(
            f"acco_hooks: the torchft lighthouse's address {address!r} "
            f"(TORCHFT_LIGHTHOUSE) names no {'host' if not url.hostname else 'port'}: "
            "give http://HOST:PORT, the host the lighthouse runs on as every node reaches it "
            "(on one machine: http://localhost:29510)"
        )
    return address


def _lighthouse_down() -> str | None:
    """Why ``$TORCHFT_LIGHTHOUSE`` takes no connection, if it takes none: for an error that
    must say why no quorum formed (the lighthouse lost, or too few live groups)."""
    address = os.environ.get("TORCHFT_LIGHTHOUSE")
    if not address:
        return None  # the Manager's lighthouse_addr, which torchft keeps to itself
    url = urllib.parse.urlsplit(address)
    try:
        with socket.create_connection((url.hostname or "", url.port or 0), timeout=1.0):
            pass
    except (OSError, ValueError) as error:
        why = getattr(error, "strerror", None) or str(error) or type(error).__name__
        return f"the lighthouse at {address} does not answer ({why}): is it up?"
    return None
