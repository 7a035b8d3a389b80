"""Replica groups under a torchft ``Manager``: the reduction across groups that outlives a group.

With ``manager=`` (a ``torchft.Manager``), the engine's data-parallel group is one *replica
group* (typically one node, its own ``torchrun``), and the groups in torchft's current quorum
together make one data-parallel run. Each group holds a whole optimizer state, sharded over its
own ranks (ZeRO-1 inside the group); rank r of every group owns the same 1/n of the model. A
round's job (``communication.communicate``) becomes::

    reduce-scatter inside the group ─► sum rank r's shard over the groups (the manager) ─►
    ÷ global weight ─► clip ─► step or Peek ─► all-gather inside the group

and the slow link, the one between the groups, carries 1/n of the gradients per rank, while
the training loop computes the next round as usual.

**One round, one torchft step.** Each attempt starts a quorum, sums the payload over the groups
in it and asks ``should_commit``. A group that died makes the sum fail on the others; no group
commits, nothing of the round is applied, and the same payload (kept aside, since a failed
collective may leave its buffer half-summed) is summed again in a new quorum without the dead
group, until a quorum commits or the round's patience (twice ``timeout``) runs out. The average is then over the groups that
took part (the weights as without torchft), and in ``acco`` the carried half-batch and its
weight are the committed estimate round's on every survivor: the estimate/update pairing holds
across the change.

**What every group must agree on** is checked in every round, in the same sum: the settings,
the round index (a group that joins mid-run would otherwise add gradients computed at other
parameters) and, in the first round, a checksum of the parameters (replicas that were not
initialized the same). A group that joins a running job needs the state of a live peer
(healing), which is not built yet: it is refused by name.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import time
import zlib
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
_STATE_KEY = "acco_hooks"


class ReplicaGroups:
    """The replica groups of a torchft ``Manager``, as the engine's communication thread uses
    them: :meth:`sum` is the one call, made once per round.

    Args:
        manager: the ``torchft.Manager`` of this replica group.
        description: what every group must build the same (the settings, the optimizer and its
            arguments, the parameters' names and shapes, the group's size), as text.
        mode: the engine's mode (``auto`` is refused).
        narrow_estimate: ``estimate_dtype`` is narrower than ``reduce_dtype`` (refused).
        split_by: the HSDP or 3-D process groups the engine was given (refused), or ``None``.
        timeout: the engine's ``timeout`` (seconds; ``None``: none): the longest a sum over
            the groups may wait for a silent peer. A round looks for a quorum that commits for
            :attr:`patience_s`, twice that: one failed sum notices the dead group, and the
            quorum without it forms within the other (the lighthouse's heartbeat timeout).
    """

    __slots__ = ("_settings_mark", "manager", "patience_s", "rounds_committed", "timeout")

    def __init__(
        self, manager: Any, description: str, *, mode: str, narrow_estimate: bool,
        split_by: str | None, timeout: float | None,
    ) -> None:  # fmt: skip
        try:
            from torchft import Manager
        except ImportError:
            raise ImportError(
                "acco_hooks: manager= needs torchft: pip install 'acco_hooks[ft]' (torchft 0.2)"
            ) from None
        check_supported_versions(torchft=importlib.metadata.version("torchft"))
        if mode == "auto":
            raise ValueError(
                "acco_hooks: mode='auto' with a torchft manager is not supported yet: every "
                "replica group would have to agree on each schedule change. Use mode='acco', "
                "'dpu' or 'ddp'"
            )
        if narrow_estimate:
            raise ValueError(
                "acco_hooks: an estimate_dtype narrower than reduce_dtype is not supported with "
                "a torchft manager yet (the estimate would be summed across groups encoded). "
                "Leave estimate_dtype unset"
            )
        if split_by is not None:
            raise ValueError(
                f"acco_hooks: a torchft manager with {split_by} is not supported yet, only the "
                "plain data-parallel engine: leave them out, or train without the manager"
            )
        if not isinstance(manager, Manager):
            raise TypeError(
                f"acco_hooks: manager must be a torchft.Manager, got {type(manager).__name__}"
            )
        self.manager, self.timeout = manager, timeout
        self.patience_s = None if timeout is None else 2.0 * timeout
        self.rounds_committed = 0  # what a joining group would have to catch up with
        self._settings_mark = _small(hashlib.sha256(description.encode()).digest())
        # torchft asks a live group for its state when another one joins (on its own thread)
        manager.register_state_dict_fn(
            _STATE_KEY, _refuse_healing, lambda: {"round_index": self.rounds_committed}
        )

    def sum(self, tensors: list[Tensor], round_index: int, master: list[Tensor]) -> int:
        """Sum each of ``tensors`` over the replica groups of a quorum that commits; return
        how many groups took part. Refuses (``RuntimeError``) groups that disagree.

        Every attempt starts a quorum; one that fails (a group died) is not committed anywhere
        and the sum is taken again, from the same inputs, in the next quorum.
        """
        manager = self.manager
        marks = torch.tensor(self._fingerprint(round_index, master), dtype=torch.float64)
        # 1 for "this group's tensors are in the sum": torchft zeroes what a group that is not
        # taking part (one it is healing) sends, and counts groups its own way
        marks = torch.cat([marks.new_ones(1), marks, marks * marks])
        deadline = None if self.patience_s is None else time.monotonic() + self.patience_s
        attempt = 0
        while True:
            attempt += 1
            manager.start_quorum()
            sums = [t.clone() for t in tensors]  # a failed sum may leave its buffer half-summed
            seen = marks.clone()
            works = [manager.allreduce(t, reduce_op=dist.ReduceOp.SUM) for t in (*sums, seen)]
            for work in works:
                work.wait()
            if manager.should_commit():
                participants = round(seen[0].item())
                _check_fingerprints(seen[1:], marks[1:], participants, round_index)
                torch._foreach_copy_(tensors, sums)
                self.rounds_committed = round_index + 1
                if attempt > 1:
                    logger.warning(
                        "acco_hooks: round %d committed at attempt %d, over %d replica groups",
                        round_index, attempt, participants,
                    )  # fmt: skip
                return participants
            logger.warning(
                "acco_hooks: round %d: the sum over replica groups did not commit (%s); summing "
                "it again in a new quorum", round_index, manager.errored() or "no quorum",
            )  # fmt: skip
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(
                    f"acco_hooks: round {round_index}: no quorum of replica groups committed "
                    f"within {self.patience_s:.0f} s (twice timeout={self.timeout:g}; "
                    f"{attempt} attempts): is the lighthouse up, and are at least "
                    "min_replica_size groups alive?"
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


def _refuse_healing(state: dict[str, int]) -> None:
    """A group that joins a running job: its state would come from a live peer, which is not
    built yet. At the job's start (round 0) there is nothing to take: the first round's
    checksum proves the parameters equal."""
    if state["round_index"] == 0:
        return
    raise RuntimeError(
        f"acco_hooks: this replica group joined a job that is at round {state['round_index']}; "
        "taking a live group's state (healing) is not supported yet. Restart every group "
        "together (from the last checkpoint), or train on without this group"
    )


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
        "same, or load the same checkpoint on every group); a group that joins a running job "
        "would need a live peer's state, which acco_hooks does not hand over yet: restart every "
        "group together"
    )


def _small(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "little") % (1 << _FINGERPRINT_BITS)
