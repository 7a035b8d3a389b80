"""The schedule of a real update, and ``mode="auto"``'s choice of it by timing.

A **schedule** says how one real update's micro-batches run: synchronously in one round
(``ddp``), or in two overlapped rounds, an estimate round and an update round (``acco``).

**The generalized law.** An update of ``n`` micro-batches of compute ``c`` each is split into an
estimate round of ``k₁`` micro-batches, which hides the previous update's communication ``C``,
and an update round of ``k₂ = n - k₁``, which hides the estimate's communication ``αC`` (``α`` <
1 when the estimate round travels narrower, ``estimate_dtype``: α is its share of the update's
bytes, ½ for bfloat16 and about ¼ for float8 against a float32 update)::

    T_sync = n·c + C            T_acco(k₁, α) = max(k₁·c, C) + max(k₂·c, αC)

ACCO as the paper builds it is ``k₁ = k₂ = k``, ``α = 1``. With the split chosen so that each
round's compute just covers what it hides, the ceiling becomes ``1 + 1/(1 + α)``: 1.67× for a
bfloat16 estimate of a float32 update, 1.8× for float8. An estimate that needs no communication
(``α = 0``: extrapolated from past updates, or a Peek of the local gradient) would make it
``T = max(n·c, C)``, never slower than synchronous and 2× at ``C = n·c``; none is offered
(``docs/when_acco_helps.md``: the one measured fails the convergence gate).
:func:`best_schedule` searches every split and estimate format; ``mode="auto"``
(:class:`AutoSchedule`) runs the synchronous schedule whenever none of them is faster as
measured, so it is never slower than ``ddp`` by more than its trials cost.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["AUTO_ESTIMATE_DTYPES", "AutoSchedule", "Schedule", "best_schedule",
           "candidate_schedules", "schedule_seconds"]  # fmt: skip

logger = logging.getLogger("acco_hooks")


class Schedule(NamedTuple):
    """How one real update's micro-batches run: synchronously, or in two overlapped rounds."""

    estimate_microbatches: int
    """Micro-batches of the estimate round; 0: synchronous (one round, no estimate)."""
    update_microbatches: int
    """Micro-batches of the update round (of the one round when synchronous)."""
    estimate_dtype: str = ""
    """The estimate round's dtype on the wire ('' when synchronous)."""

    @property
    def synchronous(self) -> bool:
        return self.estimate_microbatches == 0

    def describe(self) -> str:
        if self.synchronous:
            return f"synchronous ({self.update_microbatches} micro-batches per update)"
        return (f"acco (estimate round {self.estimate_microbatches} micro-batches in "
                f"{self.estimate_dtype}, update round {self.update_microbatches})")  # fmt: skip


def schedule_seconds(
    per_microbatch_s: float, comm_s: float, schedule: Schedule, estimate_comm_s: float
) -> float:
    """Seconds per real update of ``schedule`` by the generalized law (module docstring).

    Args:
        per_microbatch_s: compute of one micro-batch (c).
        comm_s: the update's communication (C).
        schedule: the split, and whether it is synchronous.
        estimate_comm_s: the estimate round's communication (αC).
    """
    if schedule.synchronous:
        return schedule.update_microbatches * per_microbatch_s + comm_s
    return (max(schedule.estimate_microbatches * per_microbatch_s, comm_s)
            + max(schedule.update_microbatches * per_microbatch_s, estimate_comm_s))  # fmt: skip


def candidate_schedules(
    microbatches: int, estimate_dtypes: Sequence[str], estimate_microbatches: int | None = None
) -> list[Schedule]:
    """Every schedule of ``microbatches`` per update: synchronous first, then each split with
    each of ``estimate_dtypes``: ``estimate_microbatches`` when given, else each split whose
    update round keeps between a quarter and half of the update. The law never prefers an
    update round larger than the estimate round (it hides the smaller communication), and the
    convergence gate measured splits down to a quarter (docs/when_acco_helps.md; away from the
    gate's learning rate, its gap map measured the 3 + 1 float8 split and the even one)."""
    if estimate_microbatches:
        splits = [estimate_microbatches]
    else:
        splits = range(math.ceil(microbatches / 2), microbatches - math.ceil(microbatches / 4) + 1)
    return [Schedule(0, microbatches)] + [
        Schedule(k, microbatches - k, d) for d in estimate_dtypes for k in splits
    ]


def best_schedule(
    per_microbatch_s: float, comm_s: float, candidates: list[Schedule],
    estimate_comm_s: dict[str, float],
) -> tuple[Schedule, float]:  # fmt: skip
    """The candidate the law prices fastest, and its per-token speedup over the synchronous one.

    Args:
        estimate_comm_s: an estimate round's communication by its dtype's name.
    """
    def seconds(schedule: Schedule) -> float:
        alpha_c = estimate_comm_s.get(schedule.estimate_dtype, comm_s)
        return schedule_seconds(per_microbatch_s, comm_s, schedule, alpha_c)

    def preference(schedule: Schedule) -> tuple:
        # equals: the synchronous one, then the most even split, then the widest estimate
        return (seconds(schedule), not schedule.synchronous,
                abs(schedule.estimate_microbatches - schedule.update_microbatches),
                schedule.estimate_dtype != candidates[-1].estimate_dtype)  # fmt: skip

    best = min(candidates, key=preference)
    return best, seconds(candidates[0]) / max(seconds(best), 1e-12)


# mode="auto": the estimate formats narrower than the update that it may try (those the backend
# can send), each of which keeps held-out loss within 1 % of ddp's (docs/when_acco_helps.md).
AUTO_ESTIMATE_DTYPES = ("bfloat16", "float8_e4m3fn")
# mode="auto": updates ignored after each change of schedule (the first overlapped one hides
# nothing), updates timed per schedule, schedules tried per decision, updates of a chosen
# overlapped schedule timed again to confirm it, and after how many updates a decision is
# taken again (links change under other jobs).
AUTO_SETTLE_UPDATES, AUTO_TIMED_UPDATES, AUTO_TRIALS = 2, 3, 3
AUTO_CONFIRM_UPDATES, AUTO_REDECIDE_UPDATES = 10, 200
# A schedule is tried when the law prices it this much faster than the fastest one timed, and
# replaces the synchronous one when it is timed this much faster.
AUTO_TRY_BELOW, AUTO_KEEP_BELOW = 0.95, 0.98
_SAMPLES = 64  # the most timings kept per kind between two decisions


class AutoSchedule:
    """``mode="auto"``: the schedule the next real updates should run, from timed updates.

    It times the synchronous schedule first, prices every candidate by the generalized law
    with the compute and communication it measured, tries the fastest-priced one, re-prices
    with what that trial measured (a narrower estimate's real ``αC``, and how much slower than
    its price it ran) and may try another, up to ``AUTO_TRIALS``; then
    it keeps the fastest schedule *as timed*, the synchronous one unless another beats it by
    2 %: the law only chooses what to try. An overlapped schedule it keeps is timed again over
    ``AUTO_CONFIRM_UPDATES`` updates, and dropped for the synchronous one unless it still beats
    it by 2 %. Every ``AUTO_REDECIDE_UPDATES`` updates it decides again from scratch.

    The engine feeds it on every rank; only one rank's :attr:`target` is run (the engine
    agrees on it through its communication), so every rank runs the same schedule.

    Args:
        candidates: the schedules it may run, the synchronous one first
            (:func:`candidate_schedules`).
        reduce_dtype: the update's format on the wire (its communication is ``C``).
        estimate_fractions: α of each estimate format (its share of the update's bytes), which
            prices an estimate format before a trial has timed it.
        report: whether this rank logs the choice.
    """

    __slots__ = ("candidates", "reduce_dtype", "estimate_fractions", "report", "target",
                 "chosen", "figures", "_timed", "_microbatch", "_comm", "_last_run",
                 "_run_length", "_trials", "_held", "_confirming")  # fmt: skip

    def __init__(self, candidates: list[Schedule], reduce_dtype: str,
                 estimate_fractions: dict[str, float], report: bool) -> None:  # fmt: skip
        self.candidates = candidates
        self.reduce_dtype = reduce_dtype
        self.estimate_fractions = estimate_fractions
        self.report = report
        self.target = candidates[0]  # what it wants run now
        self.chosen: Schedule | None = None  # its last decision
        self.figures: dict[str, float] = {}  # what that decision was based on
        self._restart()
        self._last_run: Schedule | None = None
        self._run_length = 0
        self._held: int | None = None  # updates since the decision; None while deciding
        self._confirming: list[float] | None = None  # the chosen overlapped one, timed again

    def _restart(self) -> None:
        self._timed: dict[Schedule, list[float]] = {}
        self._microbatch: list[float] = []
        self._comm: dict[str, list[float]] = {}
        self._trials = 0

    @property
    def takes_microbatch_times(self) -> bool:
        """Whether it still keeps micro-batch times (it keeps ``_SAMPLES`` per decision)."""
        return len(self._microbatch) < _SAMPLES

    def record_microbatch(self, seconds: float, communicating: bool) -> None:
        """One micro-batch's compute; only those with no communication in flight price c."""
        if not communicating and len(self._microbatch) < _SAMPLES:
            self._microbatch.append(seconds)

    def record_comm(self, dtype: str, seconds: float) -> None:
        """One round's communication job, by the format it was sent in."""
        samples = self._comm.setdefault(dtype, [])
        if len(samples) < _SAMPLES:
            samples.append(seconds)

    def record_update(self, ran: Schedule, seconds: float) -> None:
        """One real update's time (update boundary to update boundary) under ``ran``."""
        if ran != self._last_run:
            self._last_run, self._run_length = ran, 0
        self._run_length += 1
        if self._held is not None:
            self._held += 1
            if (self._confirming is not None and ran == self.chosen
                    and self._run_length > AUTO_SETTLE_UPDATES):
                self._confirm(seconds)
            if self._held >= AUTO_REDECIDE_UPDATES:
                self._held = None
                self._restart()
                self.target = self.candidates[0]
            return
        if ran != self.target or self._run_length <= AUTO_SETTLE_UPDATES:
            return  # the engine has not switched yet, or the schedule is still settling
        timed = self._timed.setdefault(ran, [])
        timed.append(seconds)
        if len(timed) >= AUTO_TIMED_UPDATES:
            self._decide()

    def _decide(self) -> None:
        timed = {s: statistics.median(t) for s, t in self._timed.items()
                 if len(t) >= AUTO_TIMED_UPDATES}  # fmt: skip
        synchronous = self.candidates[0]
        per_microbatch = statistics.median(self._microbatch or [0.0])
        comm = statistics.median(self._comm.get(self.reduce_dtype) or [0.0])
        estimate_comm = {d: statistics.median(t) for d, t in self._comm.items()}
        for dtype, fraction in self.estimate_fractions.items():  # untried: by their bytes
            estimate_comm.setdefault(dtype, comm * fraction)
        def priced(schedule: Schedule) -> float:
            return schedule_seconds(per_microbatch, comm, schedule,
                                    estimate_comm.get(schedule.estimate_dtype, comm))  # fmt: skip

        # What the law leaves out of every update (the loop's own work between micro-batches,
        # the bookkeeping at the round ends), as the synchronous schedule timed it; and what it
        # misses of an overlapped one beyond that (the overlap slowing the compute down, a
        # thread's hand-offs), as the trials so far timed it: later prices include both.
        overhead = max(timed.get(synchronous, 0.0) / max(priced(synchronous), 1e-12), 1.0)
        missed = max([timed[s] / max(priced(s) * overhead, 1e-12)
                      for s in timed if not s.synchronous] + [1.0])  # fmt: skip
        untried = [s for s in self.candidates if s not in timed]
        fastest_timed = min(timed.values())
        if untried and self._trials < AUTO_TRIALS:
            best, _ = best_schedule(per_microbatch, comm, [synchronous, *untried], estimate_comm)
            trial = priced(best) * overhead * missed
            if not best.synchronous and trial < AUTO_TRY_BELOW * fastest_timed:
                self._trials += 1
                self.target = best
                return
        best = min(timed, key=timed.get)
        if timed[best] > AUTO_KEEP_BELOW * timed.get(synchronous, float("inf")):
            best = synchronous if synchronous in timed else best
        speedup = timed.get(synchronous, timed[best]) / timed[best]
        self.figures = {"per_microbatch_s": per_microbatch, "comm_s": comm,
                        "synchronous_update_s": timed.get(synchronous, float("nan")),
                        "chosen_update_s": timed[best], "measured_speedup": speedup,
                        "predicted_speedup": priced(synchronous) / max(priced(best), 1e-12)}  # fmt: skip
        changed = best != self.chosen
        self.chosen = self.target = best
        self._held = 0
        self._confirming = None if best.synchronous else []
        if self.report and changed:
            logger.info("%s", self.describe())
            logger.debug("acco auto: timed %s", ", ".join(
                f"{schedule.describe()} {seconds:.4f}s" for schedule, seconds in timed.items()))

    def _confirm(self, seconds: float) -> None:
        """Time the chosen overlapped schedule over more updates than its trial had: a trial of
        a few updates can be lucky on a noisy machine. Slower than the synchronous schedule's
        time (by the same 2 %): back to synchronous until the next decision."""
        self._confirming.append(seconds)
        if len(self._confirming) < AUTO_CONFIRM_UPDATES:
            return
        confirmed = statistics.median(self._confirming)
        self._confirming = None
        synchronous_s = self.figures["synchronous_update_s"]
        if confirmed <= AUTO_KEEP_BELOW * synchronous_s:
            return
        self.chosen = self.target = self.candidates[0]
        self.figures.update(chosen_update_s=synchronous_s, measured_speedup=1.0)
        if self.report:
            logger.info("acco auto: %s took %.4fs per update over %d more updates, not below "
                        "%.4fs synchronous: back to synchronous", self._last_run.describe(),
                        confirmed, AUTO_CONFIRM_UPDATES, synchronous_s)

    def describe(self) -> str:
        """The ``acco auto:`` line: what runs, and how much faster than synchronous it was timed
        (the figures, per micro-batch and per update, go to the metrics)."""
        f = self.figures
        return (f"acco auto: runs {self.chosen.describe()}: {f['measured_speedup']:.2f}x "
                f"synchronous per token ({f['chosen_update_s']:.4f}s vs "
                f"{f['synchronous_update_s']:.4f}s per update; the law: "
                f"{f['predicted_speedup']:.2f})")

    def state_dict(self) -> dict:
        """The decision and what it rests on (a resumed run keeps its schedule).

        The figures are one tuple of ``(name, value)`` pairs, not a dict: DCP loads only the
        keys the state it loads into holds, and a fresh controller's figures have none.
        """
        return {"target": tuple(self.target), "chosen": None if self.chosen is None else
                tuple(self.chosen), "figures": tuple(self.figures.items()), "held": self._held,
                "confirming": self._confirming}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.target = Schedule(*state["target"])
        self.chosen = None if state["chosen"] is None else Schedule(*state["chosen"])
        self.figures, self._held = dict(state["figures"]), state["held"]
        self._confirming = state.get("confirming")
        self._restart()
