"""Whether ACCO speeds this run up: the per-token law, and the engine's measurement of it.

With ``K`` the compute of one round (``accumulation_steps`` micro-batches) and ``C`` one
round's communication (reduce-scatter, shard step, all-gather), a real ACCO update spans two
rounds, so it costs ``2·max(K, C)`` when communication and compute overlap perfectly, against
``2K + C`` for a synchronous ZeRO-1 update over the same tokens (2k micro-batches, one
communication). Per token::

    S = (2K + C) / (2·max(K, C))

1 without communication, at most 1.5 at ``C = K``, 1 again at ``C = 2K`` and below 1 beyond:
ACCO communicates twice per update, so it only wins while one round's compute hides a round's
communication. The engine follows this schedule (one reduce-scatter and one all-gather of the
whole model per round); nothing it does is cheaper.

:class:`Advisor` measures on the engine's own rounds, on every rank:

* ``K`` from micro-batches that ran while no communication was in flight (the first round's,
  and any after a round's communication finished). Micro-batches that overlap communication
  are slower wherever the communication takes compute resources (a CPU core, GPU SMs); a
  synchronous run never overlaps, so its ``2K + C`` uses the undisturbed ``K``.
* ``C``, the communication job's time on the communication thread.
* the round time ``T`` ACCO actually takes (round end to round end).

``predicted_speedup = (2K + C) / (2T)``: synchronous ZeRO-1 as the law prices it against ACCO
as measured, so imperfect overlap is included. ``ideal_speedup`` is the law itself, the
ceiling for this ``K`` and ``C``. Rank 0 logs one ``acco advisor:`` line with both and, when
ACCO does not pay, what to change.
"""

from __future__ import annotations

import logging
import statistics

import torch.distributed as dist

__all__ = ["Advisor", "predicted_speedup"]

logger = logging.getLogger("acco_hooks")

# Rounds ignored while the process warms up (allocations, the first collectives), then measured.
WARMUP_ROUNDS, MEASURED_ROUNDS = 2, 4


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
    """

    __slots__ = (
        "accumulation_steps", "overlapping", "report",
        # measurements: undisturbed micro-batches, any micro-batch, rounds, communications
        "_quiet_microbatch", "_microbatch", "_round", "_round_microbatches", "_comm",
        "figures",
    )  # fmt: skip

    def __init__(self, accumulation_steps: int, overlapping: bool = True) -> None:
        self.accumulation_steps = accumulation_steps
        self.overlapping = overlapping
        self.report = not dist.is_initialized() or dist.get_rank() == 0  # one line per job
        self._quiet_microbatch: list[float] = []
        self._microbatch: list[float] = []
        self._round: list[float] = []
        self._round_microbatches: list[int] = []
        self._comm: list[float] = []
        self.figures: dict[str, float] = {}

    def record_microbatch(self, seconds: float, communicating: bool) -> None:
        """One micro-batch's time; ``communicating``: a communication was in flight meanwhile."""
        if not self.figures:
            (self._microbatch if communicating else self._quiet_microbatch).append(seconds)

    def record_round(self, seconds: float, microbatches: int) -> None:
        """One round's time, round end to round end, and its micro-batches on this rank."""
        if not self.figures:
            self._round.append(seconds)
            self._round_microbatches.append(microbatches)
            self._maybe_conclude()

    def record_comm(self, seconds: float) -> None:
        """One round's communication job, timed on the communication thread."""
        if not self.figures:
            self._comm.append(seconds)
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
        if self.report:
            logger.info("%s", self.advice())

    def advice(self) -> str:
        """The ``acco advisor:`` line: the figures, and the fix when ACCO does not pay."""
        figures = self.figures
        compute, comm = figures["compute_per_round_s"], figures["comm_per_round_s"]
        speedup, ideal = figures["predicted_speedup"], figures["ideal_speedup"]
        line = (f"acco advisor: compute_per_round={compute:.4f}s comm_per_round={comm:.4f}s "
                f"predicted_speedup={speedup:.2f} round={figures['round_s']:.4f}s "
                f"ideal_speedup={ideal:.2f} (per token, vs synchronous ZeRO-1 over the same "
                "tokens; ceiling 1.50 at comm = compute)")  # fmt: skip
        per_microbatch = compute / max(self.accumulation_steps, 1)
        steps = max(1, round(comm / per_microbatch)) if per_microbatch > 0 else 1
        if ideal < 1.0:
            line += (f". WARNING: ACCO is slower here: one round's communication takes "
                     f"{comm / max(compute, 1e-12):.1f}x its compute. Raise accumulation_steps "
                     f"to about {steps} (C/c), or use mode='ddp'")  # fmt: skip
        elif speedup < 1.0:
            line += (f". WARNING: ACCO is slower here although the law allows {ideal:.2f}: a "
                     f"round takes {figures['round_s']:.3f}s where perfect overlap would take "
                     f"{max(compute, comm):.3f}s, so communication slows the compute down (e.g. "
                     "the communication thread shares the CPU cores that compute). Give each "
                     "rank more cores or use mode='ddp'")  # fmt: skip
        elif ideal < 1.25 and comm < compute:
            line += (f". Communication is small next to compute here (C/K = {comm / compute:.2f}"
                     "), so there is little to hide: ACCO peaks at C = K, i.e. accumulation_steps "
                     f"about {steps} if a smaller batch per update suits the training, or on "
                     "slower links")  # fmt: skip
        return line
