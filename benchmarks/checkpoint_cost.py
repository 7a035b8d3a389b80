"""What a torchtitan checkpoint every K steps costs an ACCO run per token, synchronous and with
torchtitan's asynchronous DCP save (``[checkpoint] async_mode = "async"``).

    python -m benchmarks.checkpoint_cost            # ~8 min on 2 cores

``debug_cpu_acco.toml`` on 2 gloo ranks, 40 steps, without checkpoints and once per (K,
async_mode), alternated ``--repeats`` times: seconds per step from step 6 on against the run
without checkpoints, and torchtitan's own "Finished saving ... in X seconds" per save
(docs/multinode.md, "How often to checkpoint"). Writes ``outputs/results/checkpoint_cost.json``
(``--out``; the published file: ``docs/results/checkpoint_cost.json``).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
from pathlib import Path

from benchmarks.harness import (
    add_out_option,
    machine,
    run,
    step_lines,
    titan_args,
    torchrun,
    write_result,
)

STEPS, FIRST_TIMED = 40, 6
SAVE = re.compile(r"Finished saving the checkpoint \(or staging if async is enabled\)\s*in "
                  r"([\d.]+) seconds")  # fmt: skip


def one_run(dump: Path, interval: int | None, async_mode: str) -> dict:
    checkpoint = [] if interval is None else [
        "--checkpoint.enable", "--checkpoint.interval", str(interval),
        "--checkpoint.async_mode", async_mode, "--checkpoint.keep_latest_k", "2",
    ]  # fmt: skip
    # the config's own batch: 1 micro-batch of 4 x 128 tokens per rank and step
    argv = titan_args("debug_cpu_acco.toml", checkpoint, STEPS, 1, 2, str(dump))
    output = run(torchrun(2, *argv[1:]), env={"OMP_NUM_THREADS": "1"})  # [0]: the python
    when = {row["step"]: row["ts"] for row in step_lines(output)}
    seconds = (when[STEPS] - when[FIRST_TIMED]) / (STEPS - FIRST_TIMED)
    saves = [float(s) for s in SAVE.findall(output)]
    return {"s_per_step": seconds, "saves": len(saves),
            "blocked_s_per_save": statistics.mean(saves) if saves else 0.0}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--intervals", default="1,5,20")
    add_out_option(p, "checkpoint_cost")
    args = p.parse_args()
    configs = [(None, "disabled")] + [(int(k), mode) for k in args.intervals.split(",")
                                      for mode in ("disabled", "async")]  # fmt: skip
    runs: dict[str, list[dict]] = {}
    for repeat in range(args.repeats):
        for interval, mode in configs:
            name = "none" if interval is None else f"K={interval} {mode}"
            with tempfile.TemporaryDirectory() as tmp:
                result = one_run(Path(tmp), interval, mode)
            runs.setdefault(name, []).append(result)
            print(f"repeat {repeat} {name}: {json.dumps(result)}", flush=True)
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
    out = write_result(args.out, {
        "what": "train_titan.py, debug_cpu_acco.toml (Llama-3 debug model, acco) on 2 gloo "
                f"ranks, {STEPS} steps; seconds per step from step {FIRST_TIMED} on, relative to "
                "the run without checkpoints; blocked_s_per_save is torchtitan's own figure",
        "command": "python -m benchmarks.checkpoint_cost", "machine": machine(),
        "s_per_step_without_checkpoints": round(base, 4), "summary": summary, "runs": runs,
    })  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
