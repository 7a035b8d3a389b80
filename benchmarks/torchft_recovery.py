"""How long the survivors of a lost replica group wait under torchft, beside torchrun's elastic
restart, and what torchft costs per round while every group is alive.

    python -m benchmarks.torchft_recovery           # ~3 min on 2 cores: 6 runs
    python -m benchmarks.torchft_recovery --out docs/results/torchft_recovery.json  # publish

The shape of ``benchmarks/elastic_recovery.py``: 2 replica groups × 2 gloo ranks on loopback
(``scaffolding/torchft_job.py``, the lighthouse at torchft's default 5 s heartbeat timeout),
``examples/torchft_train.py`` in ``acco`` with 2 micro-batches of ~0.05 s compute a round (about
0.2 s of compute per update), collectives timing out after 20 s, as there. In each run one
group SIGKILLs itself at a random round, at one of the three points the tests use (in the
middle of a round; after an estimate round's sum, before its update; inside a round's sum):

* **recovery**: from the kill to the first round end at which the survivors' training loop
  applies an update whose sum was launched after the kill (summed over the survivors alone),
  and the longest wait of a round end after the kill (what the loop stood still);
* **per round while all are alive**: the survivors' median time between round ends before the
  kill, against the same job as one group of 4 ranks without torchft, run right after it.

Writes ``outputs/results/torchft_recovery.json`` (``--out``: elsewhere; the published file is
``docs/results/torchft_recovery.json``). Reads ``docs/results/elastic_recovery.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.harness import RESULTS, add_out_option, machine, write_result
from scaffolding.torchft_job import run_groups, run_reference

ELASTIC_FILE = RESULTS / "elastic_recovery.json"
KILL_POINTS = ("mid_round", "after_estimate", "in_reduction")
ROUNDS = 60
ARGS = ["--mode", "acco", "--rounds", str(ROUNDS), "--accumulation-steps", "2",
        "--microbatch-seconds", "0.05", "--timeout", "20"]  # fmt: skip


def one_run(kill_at: str, kill_round: int, workdir: Path) -> dict:
    out = workdir / f"{kill_at}_{kill_round}"
    kill = ["--kill-group", "1", "--kill-at", kill_at, "--kill-round", str(kill_round)]
    status = run_groups(2, 2, ARGS, out, heartbeat_timeout_ms=5000, replica_args={1: kill},
                        launcher="torchrun")  # as measured: a node runs torchrun
    reference_status = run_reference(2, 2, ARGS, out)
    killed_at = float((out / "killed_at").read_text())
    survivor = torch.load(out / "params_g0_r0.pt")["round_ends"]
    reference = torch.load(out / "params_ref_r0.pt")["round_ends"]
    before = [end for end in survivor if end[2] <= killed_at]
    # An update is applied one round end after the one that launched its sum: the first update
    # whose sum was launched after the kill, applied (what the loop waits for after a loss)
    resumed = next(end[2] for launch, end in itertools.pairwise(survivor)
                   if end[1] > launch[1] and launch[2] > killed_at)  # fmt: skip
    stall = max(end[3] for end in survivor if end[2] > killed_at)
    log = (out / "g0.log").read_text()
    return {
        "kill_at": kill_at, "kill_round": kill_round, "survivor_rc": status[0],
        "lost_group_rc": status[1], "reference_rc": reference_status,
        "kill_to_next_update_s": round(resumed - killed_at, 2),
        "longest_round_end_wait_after_kill_s": round(stall, 2),
        "sum_taken_again": "committed at attempt" in log,
        "round_s_all_alive": round(_median_round_s(before[1:]), 4),
        "round_s_reference": round(_median_round_s(reference[1 : len(before)]), 4),
        "updates": survivor[-1][1],
    }  # fmt: skip


def _median_round_s(round_ends: list[tuple]) -> float:
    times = [end[2] for end in round_ends]
    return statistics.median(b - a for a, b in itertools.pairwise(times))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=6, help="runs, the kill points in turn")
    p.add_argument("--seed", type=int, default=0, help="of the kill rounds")
    add_out_option(p, "torchft_recovery")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    runs = []
    with tempfile.TemporaryDirectory(prefix="torchft_recovery_") as workdir:
        for i in range(args.runs):
            kill_at = KILL_POINTS[i % len(KILL_POINTS)]
            kill_round = rng.randrange(10, 30) // 2 * 2  # an estimate round, for after_estimate
            run = one_run(kill_at, kill_round, Path(workdir))
            runs.append(run)
            print(json.dumps(run), flush=True)
    recovery = [r["kill_to_next_update_s"] for r in runs]
    stalls = [r["longest_round_end_wait_after_kill_s"] for r in runs]
    overhead = [r["round_s_all_alive"] / r["round_s_reference"] for r in runs]
    elastic = json.loads(ELASTIC_FILE.read_text())["summary"]["kill_to_first_resumed_step_s"]
    result = {
        "what": "2 replica groups x 2 gloo ranks on loopback (examples/torchft_train.py, acco, "
                "2 micro-batches of ~0.05 s a round), torchft lighthouse with its default 5 s "
                "heartbeat timeout; one group SIGKILLed at a random round, at each kill point in "
                "turn; the same job as one group of 4 ranks without torchft as the reference",
        "command": "python -m benchmarks.torchft_recovery",
        "machine": machine(),
        "summary": {
            "all_survivors_rc_0": all(r["survivor_rc"] == 0 for r in runs),
            "kill_to_next_update_s": {"min": min(recovery), "median": statistics.median(recovery),
                                      "max": max(recovery)},
            "longest_round_end_wait_after_kill_s": {
                "min": min(stalls), "median": statistics.median(stalls), "max": max(stalls)},
            "elastic_restart_kill_to_first_resumed_step_s": elastic,
            "round_time_all_alive_over_reference": {
                "min": round(min(overhead), 3), "median": round(statistics.median(overhead), 3),
                "max": round(max(overhead), 3)},
        },
        "runs": runs,
    }  # fmt: skip
    out = write_result(args.out, result)
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
