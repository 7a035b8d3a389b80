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

:class:`Advisor` takes ``K`` and ``C`` from the engine's own rounds on every rank, and rank 0
logs one ``acco advisor:`` line with the prediction and, when it is below 1 or far from the
ceiling, what to change.
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
    """Median compute and communication per round over the first measured rounds.

    ``figures`` is empty until ``MEASURED_ROUNDS`` rounds after ``WARMUP_ROUNDS`` were seen;
    then it holds ``compute_per_round_s``, ``comm_per_round_s`` and ``predicted_speedup``.
    """

    __slots__ = ("accumulation_steps", "report", "_compute", "_comm", "figures")

    def __init__(self, accumulation_steps: int) -> None:
        self.accumulation_steps = accumulation_steps
        self.report = not dist.is_initialized() or dist.get_rank() == 0  # one line per job
        self._compute: list[float] = []
        self._comm: list[float] = []
        self.figures: dict[str, float] = {}

    def record(self, compute_s: float | None, comm_s: float | None) -> None:
        """One round's compute (main thread) or one job's communication (worker thread)."""
        if self.figures:
            return
        if compute_s is not None:
            self._compute.append(compute_s)
        if comm_s is not None:
            self._comm.append(comm_s)
        needed = WARMUP_ROUNDS + MEASURED_ROUNDS
        if len(self._compute) >= needed and len(self._comm) >= needed:
            compute = statistics.median(self._compute[WARMUP_ROUNDS:needed])
            comm = statistics.median(self._comm[WARMUP_ROUNDS:needed])
            self.figures = {"compute_per_round_s": compute, "comm_per_round_s": comm,
                            "predicted_speedup": predicted_speedup(compute, comm)}  # fmt: skip
            if self.report:
                logger.info("%s", self.advice())

    def advice(self) -> str:
        """The ``acco advisor:`` line: the figures, and the fix when ACCO does not pay."""
        compute, comm = self.figures["compute_per_round_s"], self.figures["comm_per_round_s"]
        speedup = self.figures["predicted_speedup"]
        line = (f"acco advisor: compute_per_round={compute:.4f}s comm_per_round={comm:.4f}s "
                f"predicted_speedup={speedup:.2f} (per token, vs synchronous ZeRO-1; ceiling "
                "1.50 at comm = compute)")  # fmt: skip
        per_microbatch = compute / self.accumulation_steps
        if speedup < 1.0:
            steps = max(1, round(comm / per_microbatch)) if per_microbatch > 0 else 1
            line += (f". WARNING: ACCO is slower here: one round's communication takes "
                     f"{comm / max(compute, 1e-12):.1f}x its compute. Raise accumulation_steps "
                     f"to about {steps} (C/c), or use mode='ddp'")  # fmt: skip
        elif speedup < 1.25 and comm < compute:
            line += (f". Communication is small next to compute here (C/K = {comm / compute:.2f}"
                     "), so there is little to hide: ACCO peaks at C = K, i.e. accumulation_steps "
                     f"about {max(1, round(comm / per_microbatch))} if a smaller batch per "
                     "update suits the training, or on slower links")
        return line
