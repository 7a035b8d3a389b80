"""How long a surviving rank takes to fail after its peer is SIGKILLed (2 gloo processes).

    python -m benchmarks.peer_death            # ~10 s on 2 cores: 3 runs of 2 processes

The scenario of ``tests/engine/test_faults.py::test_killed_rank_makes_the_survivor_fail_clearly``
(:func:`killed_peer_run`); the detection time runs from the SIGKILL to ``ACCOCommunicationError``
in the survivor's loop, on the same clock, so it includes at most one micro-batch of compute
(docs/reliability.md). Writes ``outputs/results/peer_death.json`` (or ``--out``; the published
file: ``docs/results/peer_death.json``).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import statistics
import tempfile
import time

import torch

from benchmarks.harness import add_out_option, header, run_ranks, write_result

KILL_BEFORE_ROUND = 5


def killed_peer_run(rank: int, world_size: int, stamp_dir: str) -> dict:
    """One rank: a tiny model trains in ``mode="acco"``; rank 1 notes the time and SIGKILLs
    itself before round 5, with round 4's communication in flight; rank 0 returns when and how
    the error reached it (the engine's ``timeout=`` plays no part: the dead peer's sockets
    close). ``tests/engine/test_faults.py`` runs it too, for the error's message."""
    from acco_hooks import ACCOCommunicationError, ACCOOptimizer

    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="acco", lr=1e-2, timeout=30)
    try:
        for r in range(50):
            if rank == 1 and r == KILL_BEFORE_ROUND:
                pathlib.Path(stamp_dir, "killed_at").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            g = torch.Generator().manual_seed(10_007 * rank + 101 * r)
            x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    except ACCOCommunicationError as exc:
        return {"error_at": time.time(), "round": r, "message": str(exc)}
    return {"error_at": None, "round": r, "message": "no error"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    add_out_option(p, "peer_death")
    args = p.parse_args()
    runs = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as stamp_dir:
            survivor, dead = run_ranks("benchmarks.peer_death:killed_peer_run", 2, stamp_dir,
                                       may_die=(1,))  # fmt: skip
            killed_at = float(pathlib.Path(stamp_dir, "killed_at").read_text())
        assert dead is None and survivor["error_at"] is not None, survivor
        runs.append({**survivor, "killed_at": killed_at,
                     "detection_s": survivor["error_at"] - killed_at})  # fmt: skip
    detection = [run["detection_s"] for run in runs]
    results = {
        **header(), "torch": torch.__version__, "backend": "gloo (loopback)", "world_size": 2,
        "mode": "acco", "engine_timeout_s": 30, "killed_before_round": KILL_BEFORE_ROUND,
        "detection_s": detection, "detection_s_median": statistics.median(detection),
        "runs": runs,
    }  # fmt: skip
    out = write_result(args.out, results)
    print(f"SIGKILL of rank 1 -> ACCOCommunicationError on rank 0, {args.repeats} runs (gloo):")
    for run in runs:
        print(f"  {run['detection_s'] * 1e3:7.1f} ms (raised in round {run['round']}): "
              f"{run['message'].splitlines()[0][:90]}")  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
