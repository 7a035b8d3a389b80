"""What a torchtitan checkpoint every K steps costs an ACCO run per token, synchronous and with
torchtitan's asynchronous DCP save (``[checkpoint] async_mode = "async"``).

    python -m benchmarks.checkpoint_cost            # ~8 min on 2 cores

``train_titan.py`` with ``debug_cpu_acco.toml`` on 2 gloo ranks, 40 steps, once without
checkpoints and once per (K, async_mode). Per run: the seconds per step from step 6 to the last
(startup and the first steps excluded), so the cost per token at equal tokens per update is the
ratio to the run without checkpoints; and the seconds the training loop stood still per save
(torchtitan's "Finished saving the checkpoint (or staging if async is enabled) in X seconds").
The runs alternate, ``--repeats`` times, so drifts of the machine hit every configuration alike.

Writes ``docs/results/checkpoint_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
from pathlib import Path

from benchmarks.harness import RESULTS, ROOT, machine, run, step_lines, torchrun, write_result

RESULT_FILE = RESULTS / "checkpoint_cost.json"
STEPS, FIRST_TIMED = 40, 6
SAVE = re.compile(r"Finished saving the checkpoint \(or staging if async is enabled\)\s*in "
                  r"([\d.]+) seconds")  # fmt: skip


def one_run(dump: Path, interval: int | None, async_mode: str) -> dict:
    checkpoint = [] if interval is None else [
        "--checkpoint.enable", "--checkpoint.interval", str(interval),
        "--checkpoint.async_mode", async_mode, "--checkpoint.keep_latest_k", "2",
    ]  # fmt: skip
    output = run(torchrun(2, str(ROOT / "train_titan.py"), "--job.config_file",
                          str(ROOT / "torchtitan_configs" / "debug_cpu_acco.toml"),
                          "--job.dump_folder", str(dump), "--metrics.disable_color_printing",
                          "--training.steps", str(STEPS), *checkpoint),
                 env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    when = {row["step"]: row["ts"] for row in step_lines(output)}
    seconds = (when[STEPS] - when[FIRST_TIMED]) / (STEPS - FIRST_TIMED)
    saves = [float(s) for s in SAVE.findall(output)]
    return {"s_per_step": seconds, "saves": len(saves),
            "blocked_s_per_save": statistics.mean(saves) if saves else 0.0}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--intervals", default="1,5,20")
    p.add_argument("--out", default=str(RESULT_FILE))
    args = p.parse_args()
    configs = [(None, "disabled")] + [(int(k), mode) for k in args.intervals.split(",")
                                      for mode in ("disabled", "async")]  # fmt: skip
    runs: dict[str, list[dict]] = {}
    for repeat in range(args.repeats):
        for interval, mode in configs:
            name = "none" if interval is None else f"K={interval} {mode}"
            with tempfile.TemporaryDirectory() as tmp:
                run = one_run(Path(tmp), interval, mode)
            runs.setdefault(name, []).append(run)
            print(f"repeat {repeat} {name}: {json.dumps(run)}", flush=True)
    base = statistics.mean(r["s_per_step"] for r in runs["none"])
    summary = {
        name: {
            "cost_per_token_vs_none": round(statistics.mean(r["s_per_step"] for r in rs) / base, 3),
            "cost_per_token_each_repeat": [round(r["s_per_step"] / base, 3) for r in rs],
            "blocked_s_per_save": round(statistics.mean(r["blocked_s_per_save"] for r in rs), 3),
        }
        for name, rs in runs.items()
    }  # fmt: skip
    print(json.dumps(summary, indent=1))
    write_result(args.out, {
        "what": "train_titan.py, debug_cpu_acco.toml (Llama-3 debug model, acco) on 2 gloo "
                f"ranks, {STEPS} steps; seconds per step from step {FIRST_TIMED} on, relative to "
                "the run without checkpoints; blocked_s_per_save is torchtitan's own figure",
        "command": "python -m benchmarks.checkpoint_cost", "machine": machine(),
        "s_per_step_without_checkpoints": round(base, 4), "summary": summary, "runs": runs,
    })  # fmt: skip


if __name__ == "__main__":
    main()
