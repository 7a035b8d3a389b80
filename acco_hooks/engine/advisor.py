"""Whether ACCO speeds this run up: the per-token law and the engine's measurement of it.

(The law generalized to uneven splits and narrower estimates, and ``mode="auto"``'s choice of
schedule, are in ``schedule.py``.)

With ``K`` the compute of one round (``accumulation_steps`` micro-batches) and ``C`` one
round's communication (reduce-scatter, shard step, all-gather), a real ACCO update spans two
rounds, so it costs ``2·max(K, C)`` when communication and compute overlap perfectly, against
``2K + C`` for a synchronous ZeRO-1 update over the same tokens (2k micro-batches, one
communication). Per token::

    S = (2K + C) / (2·max(K, C))

1 without communication, at most 1.5 at ``C = K``, 1 again at ``C = 2K`` and below 1 beyond:
ACCO communicates twice per update, so it only wins while one round's compute hides a round's
communication.

:class:`Advisor` measures on the engine's own rounds, on every rank:

* ``K`` from micro-batches that ran while no communication was in flight (the first round's,
  and any after a round's communication finished). Micro-batches that overlap communication
  are slower wherever the communication takes compute resources (a CPU core, GPU SMs); a
  synchronous run never overlaps, so its ``2K + C`` uses the undisturbed ``K``.
* ``C``, the communication job's time on the communication thread.
* the round time ``T`` ACCO actually takes (round end to round end).
* the slowest and the fastest rank's compute per micro-batch, over the ranks that hold the same
  part of the model (one small collective in each of the first rounds). Where they differ,
  every round waits for the slowest rank, and the faster ranks' ``C`` holds that wait: their
  advisor would take unequal ranks for a slow link. The advice is then
  ``accumulate_until_ready``.

``predicted_speedup = (2K + C) / (2T)``: synchronous ZeRO-1 as the law prices it against ACCO
as measured, so imperfect overlap is included. ``ideal_speedup`` is the law itself, the
ceiling for this ``K`` and ``C``. Rank 0 logs one ``acco advisor:`` line with both at INFO and,
when ACCO does not pay, a WARNING line with what to change.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable

import torch.distributed as dist

from acco_hooks.engine.schedule import best_schedule, candidate_schedules

__all__ = ["Advisor", "MicrobatchClock", "predicted_speedup"]

logger = logging.getLogger("acco_hooks")

# Rounds ignored while the process warms up (allocations, the first collectives), then measured.
WARMUP_ROUNDS, MEASURED_ROUNDS = 2, 4
# The slowest rank's compute per micro-batch over the fastest's from which the advisor calls
# the ranks unequal. Equal GPUs of one kind differ by a few percent; the kinds a mixed cluster
# holds differ by 2-3x (an H100 beside an A100), a throttled or shared node by tens of percent.
UNEQUAL_SPEED = 1.3

# Where C > 2K and the batch cannot grow, communicating less often is the alternative: in the
# project's comparison (benchmarks/diloco.py; the regime map in docs/when_acco_helps.md)
# torchft's DiLoCo reached synchronous training's held-out loss first on every link with C
# above 2K at one micro-batch per round (docs/results/diloco_vs_acco.json) and level with it
# at C = 3K with two (docs/results/diloco_window.json, first on one seed of two), and on no
# link below 2K.
DILOCO_ADVICE = (
    ". If the batch cannot grow, synchronize less often: torchft's DiLoCo reached synchronous "
    "training's held-out loss first, or level with it, wherever C > 2K in "
    "docs/when_acco_helps.md ('Beside DiLoCo'); in torchtitan: [fault_tolerance] enable = "
    "true, semi_sync_method = \"diloco\", "
    "sync_steps = 20, one job per replica group and a torchft lighthouse"
)


def predicted_speedup(compute_s: float, comm_s: float) -> float:
    """Per-token speedup of ACCO over synchronous ZeRO-1 at equal tokens per update.

    Args:
        compute_s: compute of one round (K).
        comm_s: one round's communication (C).

    Returns:
        ``(2K + C) / (2·max(K, C))``.
    """
    if compute_s <= 0 and comm_s <= 0:
        return 1.0
    return (2 * compute_s + comm_s) / (2 * max(compute_s, comm_s))


class Advisor:
    """Compute, communication and round time of the engine's first measured rounds.

    The engine calls :meth:`record_microbatch` for each micro-batch after the first,
    :meth:`record_round` at each round end and :meth:`record_comm` for each finished
    communication. ``figures`` is empty until ``MEASURED_ROUNDS`` rounds after
    ``WARMUP_ROUNDS`` were seen; then it holds ``compute_per_round_s`` (K),
    ``comm_per_round_s`` (C), ``round_s`` (T), ``predicted_speedup`` and ``ideal_speedup``.

    Args:
        accumulation_steps: the engine's minimum micro-batches per round.
        overlapping: whether the engine overlaps rounds (``acco``, ``dpu``). In ``ddp`` mode
            nothing overlaps and ``predicted_speedup`` is the law's ideal.
        microbatches_per_update: the micro-batches of a real update (what ``auto`` splits).
        estimate_fractions: α of each estimate format ``auto`` may send (its share of the
            update's bytes), by name.
        until_ready: the engine runs with ``accumulate_until_ready``: faster ranks do not wait
            for the slowest, so unequal speeds need no advice.
    """

    __slots__ = (
        "accumulation_steps", "overlapping", "microbatches_per_update", "estimate_fractions",
        "until_ready", "report",
        # measurements: undisturbed micro-batches, any micro-batch, rounds, communications,
        # this round's micro-batches, each round's slowest and fastest rank
        "_quiet_microbatch", "_microbatch", "_round", "_round_microbatches", "_comm",
        "_this_round", "_speed_range",
        "figures",
    )  # fmt: skip

    # the rounds whose figures the advisor reads: the engine sends each rank's compute per
    # micro-batch to a collective in these (``take_round_compute``)
    rounds_measured = WARMUP_ROUNDS + MEASURED_ROUNDS

    def __init__(
        self, accumulation_steps: int, overlapping: bool = True,
        microbatches_per_update: int | None = None,
        estimate_fractions: dict[str, float] | None = None, until_ready: bool = False,
    ) -> None:  # fmt: skip
        self.accumulation_steps = accumulation_steps
        self.overlapping = overlapping
        self.microbatches_per_update = microbatches_per_update or accumulation_steps
        self.estimate_fractions = estimate_fractions or {"float32": 1.0}
        self.until_ready = until_ready
        self.report = not dist.is_initialized() or dist.get_rank() == 0  # one line per job
        self._quiet_microbatch: list[float] = []
        self._microbatch: list[float] = []
        self._round: list[float] = []
        self._round_microbatches: list[int] = []
        self._comm: list[float] = []
        self._this_round: list[float] = []
        self._speed_range: list[tuple[float, float] | None] = []
        self.figures: dict[str, float] = {}

    def record_microbatch(self, seconds: float, communicating: bool) -> None:
        """One micro-batch's time; ``communicating``: a communication was in flight meanwhile."""
        if not self.figures:
            (self._microbatch if communicating else self._quiet_microbatch).append(seconds)
            self._this_round.append(seconds)

    def take_round_compute(self) -> float:
        """This rank's mean compute per micro-batch in the round that ends (NaN if none was
        timed), for the collective that finds the slowest and the fastest rank; the next
        round starts counting afresh."""
        seconds = statistics.fmean(self._this_round) if self._this_round else math.nan
        self._this_round = []
        return seconds

    def record_round(self, seconds: float, microbatches: int) -> None:
        """One round's time, round end to round end, and its micro-batches on this rank."""
        if not self.figures:
            self._round.append(seconds)
            self._round_microbatches.append(microbatches)
            self._maybe_conclude()

    def record_comm(self, seconds: float,
                    speed_range: tuple[float, float] | None = None) -> None:  # fmt: skip
        """One round's communication job, timed on the communication thread, and the slowest
        and the fastest rank's compute per micro-batch in that round (None: not measured)."""
        if not self.figures:
            self._comm.append(seconds)
            self._speed_range.append(speed_range)
            self._maybe_conclude()

    def _maybe_conclude(self) -> None:
        needed = WARMUP_ROUNDS + MEASURED_ROUNDS
        if len(self._round) < needed or len(self._comm) < needed:
            return
        round_s = statistics.median(self._round[WARMUP_ROUNDS:needed])
        comm = statistics.median(self._comm[WARMUP_ROUNDS:needed])
        microbatches = statistics.median(self._round_microbatches[WARMUP_ROUNDS:needed])
        # Undisturbed micro-batches if there were any; else every one (an upper bound on K).
        per_microbatch = statistics.median(self._quiet_microbatch or self._microbatch or [0.0])
        compute = microbatches * per_microbatch
        ideal = predicted_speedup(compute, comm)
        measured_acco = (2 * compute + comm) / (2 * round_s) if round_s > 0 else ideal
        self.figures = {
            "compute_per_round_s": compute, "comm_per_round_s": comm, "round_s": round_s,
            "predicted_speedup": measured_acco if self.overlapping else ideal,
            "ideal_speedup": ideal,
        }  # fmt: skip
        ranges = [r for r in self._speed_range[WARMUP_ROUNDS:needed] if r is not None]
        if ranges:  # several ranks: each round's slowest and fastest, their medians
            slowest = statistics.median(r[0] for r in ranges)
            fastest = statistics.median(r[1] for r in ranges)
            self.figures["slowest_over_fastest"] = slowest / fastest if fastest > 0 else 1.0
        if self.report:
            logger.info("%s", self.advice())
            suggestion = self.suggestion()
            if suggestion is not None:
                logger.debug("%s", suggestion)
            finding = self.finding()
            if finding is not None:
                # A WARNING record: Python prints it with no logging configured, where an INFO
                # line reaches only the users who set logging up.
                logger.warning("%s", finding)

    def advice(self) -> str:
        """The ``acco advisor:`` line: the figures per round and per token (speedups: per
        token against synchronous ZeRO-1 over the same tokens; the law's ceiling is 1.5 at
        comm = compute). The same figures go to the metrics (``figures``)."""
        figures = self.figures
        spread = figures.get("slowest_over_fastest")
        return (f"acco advisor: compute_per_round={figures['compute_per_round_s']:.4f}s "
                f"comm_per_round={figures['comm_per_round_s']:.4f}s "
                f"predicted_speedup={figures['predicted_speedup']:.2f} "
                f"round={figures['round_s']:.4f}s ideal_speedup={figures['ideal_speedup']:.2f}"
                + ("" if spread is None else f" slowest_over_fastest={spread:.2f}"))

    def finding(self) -> str | None:
        """One line when ACCO is slower than synchronous ZeRO-1 here, with the fix; else None."""
        figures = self.figures
        compute, comm = figures["compute_per_round_s"], figures["comm_per_round_s"]
        speedup, ideal = figures["predicted_speedup"], figures["ideal_speedup"]
        per_microbatch = compute / max(self.accumulation_steps, 1)
        steps = max(1, round(comm / per_microbatch)) if per_microbatch > 0 else 1
        spread = figures.get("slowest_over_fastest", 1.0)
        if spread >= UNEQUAL_SPEED and not self.until_ready:
            # before the slow-link advice: a faster rank's C holds its wait for the slowest.
            # A cap of k x spread gives the fastest rank its speed's share of an update.
            cap = math.ceil(self.accumulation_steps * spread)
            return (f"acco advisor: the ranks compute at unequal speed: the slowest rank's "
                    f"micro-batch takes {spread:.1f}x the fastest's, and every round waits for "
                    "it (on a faster rank comm_per_round holds that wait). Set "
                    f"accumulate_until_ready=True, with max_microbatches_per_round={cap} for "
                    "an update as large as one split to the ranks' speeds: the faster ranks "
                    "then run micro-batches while the round communicates, and each update "
                    "weighs every one of them (docs/when_acco_helps.md, 'heterogeneous "
                    "workers'; each micro-batch must hold independent samples)")  # fmt: skip
        if ideal < 1.0:
            return (f"acco advisor: ACCO is slower here ({speedup:.2f}x synchronous per token): "
                    f"a round communicates {comm / max(compute, 1e-12):.1f}x as long as it "
                    f"computes. Raise accumulation_steps to about {steps}, or use mode='ddp'"
                    + DILOCO_ADVICE)
        if speedup < 1.0:
            return (f"acco advisor: ACCO is slower here ({speedup:.2f}x synchronous per token) "
                    f"although the law allows {ideal:.2f}: communication slows the compute "
                    "(e.g. the communication thread shares its CPU cores). Give each rank more "
                    "cores, or use mode='ddp'")  # fmt: skip
        return None

    def suggestion(self) -> str | None:
        """Where ACCO pays little or ``mode='auto'`` would pick another schedule: one line of
        what to try, for a reader who asks (``logger.debug``); else None."""
        figures = self.figures
        compute, comm = figures["compute_per_round_s"], figures["comm_per_round_s"]
        per_microbatch = compute / max(self.accumulation_steps, 1)
        if self.microbatches_per_update < 2 or per_microbatch <= 0:
            return None
        fractions = self.estimate_fractions
        candidates = candidate_schedules(self.microbatches_per_update, list(fractions))
        best, best_speedup = best_schedule(per_microbatch, comm, candidates,
                                           {d: a * comm for d, a in fractions.items()})  # fmt: skip
        return (f"acco advisor: mode='auto' would try {best.describe()}, priced at "
                f"{best_speedup:.2f}x synchronous")


class MicrobatchClock:
    """Times each micro-batch's compute and each round, for the advisor (and ``auto``).

    A micro-batch is timed from its mark (:meth:`mark`: ``ACCOEngine.start_microbatch``) to its
    count (:meth:`stop`); unmarked, from the previous count. Once a front-end marks micro-batches,
    an unmarked one (an empty micro-batch that pads a short step) is not timed. The process's
    first micro-batch warms up: untimed.
    """

    __slots__ = ("round_started", "started", "overlapped", "marked", "marks")

    def __init__(self) -> None:
        self.round_started: float | None = None  # the last round end
        self.started: float | None = None  # the micro-batch under way's start
        self.overlapped = False  # a communication was in flight when it started
        self.marked = False  # mark() started the micro-batch under way
        self.marks = False  # the front-end marks each micro-batch's start

    def mark(self, communicating: bool, wait: Callable[[], None]) -> None:
        """The micro-batch's compute starts now; ``wait()`` first lets queued device work end."""
        self.marks = True
        if self.started is None:  # the first micro-batch: untimed
            return
        wait()
        self.started, self.marked, self.overlapped = time.perf_counter(), True, communicating

    def stop(self, wait: Callable[[], None]) -> tuple[float, bool] | None:
        """The micro-batch is counted: its seconds and whether a communication overlapped it
        (``None``: untimed)."""
        if self.started is None or (self.marks and not self.marked):
            return None
        wait()
        return time.perf_counter() - self.started, self.overlapped

    def restart(self, communicating: bool) -> None:
        """After a count: unmarked, the next micro-batch's compute starts now."""
        self.started, self.marked, self.overlapped = time.perf_counter(), False, communicating

    def round_ended(self) -> float | None:
        """A round ended now: the seconds since the previous round end (``None``: the first)."""
        now, previous = time.perf_counter(), self.round_started
        self.round_started = now
        return None if previous is None else now - previous
