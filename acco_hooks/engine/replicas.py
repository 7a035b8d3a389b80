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
group, until a quorum commits or the round's patience (twice ``timeout``) runs out. The
average is then over the groups that took part (the weights as without torchft), and in
``acco`` the carried half-batch and its weight are the committed estimate round's on every
survivor: the estimate/update pairing holds across the change.

**What every group must agree on** is checked in every round, in the same sum: the settings,
the round index and, in the first round, a checksum of the parameters (replicas that were not
initialized the same). A mismatch is refused by name.

**``mode="auto"``** changes the schedule at update boundaries, and every group must change it at
the same one. As inside a group, where the first rank's proposal is the one run, one group
decides: the quorum's first participating group (torchft's ``participating_rank() == 0``) adds
its proposal to an update round's sum, and every group runs what the sum says. When that group
is lost, the next first one decides from its own timings (every group timed the same schedules).
Only the reduce dtype's schedules are candidates (an estimate sent narrower is refused, above).

**A group that joins** (one restarted after it was lost, or started late) takes a live
group's state before it trains: healing, torchft's mechanism, with what the engine holds. Every
group takes one torchft step before its first round (:meth:`join`). At the job's start all
groups are in that step: nothing is summed (with torchft's ``init_sync``, rank r of every
group takes the state of the one group its rank picks, and the group loads together). Later,
the live groups are in some round's sum when the joiner's step meets them: torchft hands the joiner a live group's state as it was
at that round's end (``state.handover_state``: parameters, master shard, optimizer state, LR
scheduler, counters, the carried half-batch); the joiner sends zeros in that sum, takes its
result, and then sits that round out (``skip_microbatch``): its job steps with the same sum from
the same state, and from the next round on it computes at the same parameters as every group.
A torchft step is therefore a round plus one.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import time
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from acco_hooks._versions import check_supported_versions

__all__ = ["ReplicaGroups"]

logger = logging.getLogger(__name__)

# A fingerprint's parts are integers below 2**20, so that their sums and the sums of their
# squares over up to 2**12 groups are exact in float64: equal sums of both over k groups mean
# that all k agree.
_FINGERPRINT_BITS = 20
_MARKS = 3  # the settings, the round index, the initial parameters' checksum
# What a group adds to a round's sum beside its tensors: 1 (it takes part), its marks, their
# squares, and, from the deciding group of mode="auto", 1 and its proposal
_SUMMED = 1 + 2 * _MARKS + 2
_STATE_KEY = "acco_hooks"


class ReplicaGroups:
    """The replica groups of a torchft ``Manager``, as the engine's communication thread uses
    them: :meth:`join` once, before the first round, then :meth:`sum` once per round.

    Args:
        manager: the ``torchft.Manager`` of this replica group.
        description: what every group must build the same (the settings, the optimizer and its
            arguments, the parameters' names and shapes, the group's layout), as text.
        narrow_estimate: ``estimate_dtype`` is narrower than ``reduce_dtype`` (refused).
        timeout: the engine's ``timeout`` (seconds; ``None``: none): the longest a sum over
            the groups may wait for a silent peer. A round looks for a quorum that commits for
            :attr:`patience_s`, twice that: one failed sum notices the dead group, and the
            quorum without it forms within the other (the lighthouse's heartbeat timeout).
    """

    __slots__ = ("_joined", "_received", "_serve", "_settings_mark", "manager", "patience_s",
                 "timeout")  # fmt: skip

    def __init__(
        self, manager: Any, description: str, *, narrow_estimate: bool,
        timeout: float | None,
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
        if not isinstance(manager, Manager):
            raise TypeError(
                f"acco_hooks: manager must be a torchft.Manager, got {type(manager).__name__}"
            )
        self.manager, self.timeout = manager, timeout
        self.patience_s = None if timeout is None else 2.0 * timeout
        self._settings_mark = _small(hashlib.sha256(description.encode()).digest())
        self._serve: Callable[[], dict[str, Any]] | None = None  # the engine's handover
        self._received: dict[str, Any] | None = None  # a live group's, as torchft hands it
        # a round whose sum this group took while joining: (round, sums, fingerprints)
        self._joined: tuple[int, list[Tensor], Tensor] | None = None
        # torchft asks a live group for its state when another one joins (on its own thread),
        # and gives it to the joiner (in should_commit, or start_quorum without async quorum)
        manager.register_state_dict_fn(_STATE_KEY, self._receive, self._hand_over)

    def attach(self, serve: Callable[[], dict[str, Any]]) -> None:
        """What a joining group gets from this one: ``serve()``, called on torchft's thread
        while this group's communication waits for the quorum (``state.handover_state``)."""
        self._serve = serve

    def join(self, skipped: list[Tensor]) -> tuple[dict[str, Any] | None, int | None]:
        """This group's first torchft step, before its first round. Returns the state a live
        group handed over (``None``: none, every group starts here) and the round the live
        groups are summing (``None``: none; this group then sits it out, and the next
        :meth:`sum` is that round's, already taken).

        Args:
            skipped: zeros shaped as the tensors :meth:`sum` sums (this group's part of the
                round it joins in: nothing).
        """
        manager = self.manager
        deadline = None if self.patience_s is None else time.monotonic() + self.patience_s
        attempt = 0
        while True:
            attempt += 1
            self._received = None
            manager.start_quorum()
            manager.wait_quorum()
            # torchft moved a joiner's step to the live groups': 0 only while every group in
            # the quorum is at its join step, a round's step otherwise
            round_index = manager.current_step() - 1
            summed = None
            if round_index >= 0:
                summed = self._reduce([*skipped, torch.zeros(_SUMMED, dtype=torch.float64)])
            if manager.should_commit():
                break
            self._retry_or_give_up("joining the job", attempt, deadline)
        received, self._received = self._received, None
        if summed is None:
            return received, None
        if received is None:
            raise RuntimeError(
                f"acco_hooks: this replica group joined a job at round {round_index}, and torchft "
                "committed the step without handing it a live group's state; restart this "
                "group (its torchrun)"
            )
        self._joined = (round_index, summed[:-1], summed[-1])
        return received, round_index

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
        """
        manager = self.manager
        marks = torch.tensor(self._fingerprint(round_index, master), dtype=torch.float64)
        # 1 for "this group's tensors are in the sum": torchft zeroes what a group that is not
        # taking part (one it is healing) sends, and counts groups its own way
        marks = torch.cat([marks.new_ones(1), marks, marks * marks, marks.new_zeros(2)])
        joined, self._joined = self._joined, None
        if joined is not None:  # this round was summed while this group joined
            if joined[0] != round_index:
                raise RuntimeError(f"acco_hooks: joined at round {joined[0]}, summing round "
                                   f"{round_index}: the engine lost its place")  # fmt: skip
            summed, seen, attempt = joined[1], joined[2], 0
        else:
            deadline = None if self.patience_s is None else time.monotonic() + self.patience_s
            attempt = 0
            while True:
                attempt += 1
                manager.start_quorum()
                # the quorum's first group decides auto's schedule (set per quorum: it may be
                # another group's turn after one was lost)
                decides = proposal is not None and manager.participating_rank() == 0
                marks[-2:] = torch.tensor([1.0, float(proposal)] if decides else [0.0, 0.0])
                *summed, seen = self._reduce([*tensors, marks])
                if manager.should_commit():
                    break
                self._retry_or_give_up(f"round {round_index}", attempt, deadline)
        participants = round(seen[0].item())
        fingerprints = slice(1, 1 + 2 * _MARKS)
        _check_fingerprints(seen[fingerprints], marks[fingerprints], participants, round_index)
        torch._foreach_copy_(tensors, summed)
        if attempt > 1:
            logger.warning(
                "acco_hooks: round %d committed at attempt %d, over %d replica groups",
                round_index, attempt, participants,
            )  # fmt: skip
        deciders, decided = seen[-2].item(), seen[-1].item()
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

    def _retry_or_give_up(self, what: str, attempt: int, deadline: float | None) -> None:
        logger.warning(
            "acco_hooks: %s: the sum over replica groups did not commit (%s); trying again in a "
            "new quorum", what, self.manager.errored() or "no quorum",
        )  # fmt: skip
        if deadline is not None and time.monotonic() > deadline:
            raise RuntimeError(
                f"acco_hooks: {what}: no quorum of replica groups committed within "
                f"{self.patience_s:.0f} s (twice timeout={self.timeout:g}; {attempt} attempts): "
                "is the lighthouse up, and are at least min_replica_size groups alive?"
            )

    def _fingerprint(self, round_index: int, master: list[Tensor]) -> list[float]:
        """The settings, the round, and in the first round a checksum of this rank's master
        shard (the initial parameters)."""
        checksum = 0
        if round_index == 0:
            for shard in master:
                checksum = zlib.crc32(shard.detach().cpu().contiguous().numpy().tobytes(), checksum)
        bits = 1 << _FINGERPRINT_BITS
        return [float(self._settings_mark), float(round_index % bits), float(checksum % bits)]


def _check_fingerprints(seen: Tensor, own: Tensor, participants: int, round_index: int) -> None:
    n = own.numel() // 2
    agree = torch.equal(seen, own * participants)
    if agree:
        return
    what = [
        ("settings (mode, accumulation_steps, the optimizer and its arguments, the parameters' "
         "names and shapes, the group's size)"),
        "round index",
        "initial parameters",
    ]  # fmt: skip
    differ = [what[i] for i in range(n)
              if seen[i] != own[i] * participants or seen[n + i] != own[n + i] * participants]
    raise RuntimeError(
        f"acco_hooks: round {round_index}: the replica groups differ in their "
        f"{' and '.join(differ) or 'fingerprints'}. Every group must build the same model and "
        "optimizer with the same settings and start from the same parameters (seed them the "
        "same, or load the same checkpoint on every group, or use torchft's init_sync); a group "
        "that joins a running job takes the others' state, not their settings or model"
    )


def _small(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "little") % (1 << _FINGERPRINT_BITS)
