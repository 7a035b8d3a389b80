"""Draw docs/figures/timeline.png from a profiler trace of the README's main job.

    python docs/figures/timeline.py            # runs the job under the profiler, then draws

It runs the main job (``train_titan.py --job.config_file torchtitan_configs/debug_cpu_acco.toml``
on 2 CPU processes; ``--training.steps 12``: the same rounds, fewer of them) with every
thread recorded by ``torch.profiler``, keeps the engine's ``acco::`` ranges of each rank
(``docs/results/timeline_trace.json``: rank, thread, label, start and length in ms) and draws
four rounds of both ranks: the training loop's thread above, the communication thread below.
Between two round ends the loop computes the next micro-batches; what the loop waits for is
``acco::wait``. The profiler slows every operator, so read the shape, not the milliseconds.
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULT = ROOT / "docs" / "results" / "timeline_trace.json"
FIGURE = ROOT / "docs" / "figures" / "timeline.png"
JOB = ["--job.config_file", "torchtitan_configs/debug_cpu_acco.toml", "--training.steps", "12"]
LOOP_LABELS = ("acco::round_end", "acco::wait", "acco::apply")
COMM_LABELS = ("acco::reduce_scatter", "acco::shard_step", "acco::estimate_step",
               "acco::all_gather")  # fmt: skip
COLORS = {
    "compute": "#2a9d8f", "acco::round_end": "#e9c46a", "acco::wait": "#e76f51",
    "acco::apply": "#f4a261", "acco::reduce_scatter": "#a8c5da", "acco::shard_step": "#264653",
    "acco::estimate_step": "#8ab17d", "acco::all_gather": "#5e81ac",
}  # fmt: skip
ROUNDS_DRAWN = 4


def profile_one_rank(trace_dir: str, job_args: list[str]) -> None:
    """In a torchrun child: the main job under a profiler that records every thread."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(ROOT))
    sys.argv = ["train_titan.py", *job_args]
    import train_titan

    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as trace:
        train_titan.main()
    trace.export_chrome_trace(os.path.join(trace_dir, f"rank{os.environ['RANK']}.json"))


def acco_ranges(chrome_trace: str, rank: int) -> list[dict]:
    """The ``acco::`` ranges of one rank's trace, the loop's thread named ``loop``."""
    trace = json.loads(pathlib.Path(chrome_trace).read_text())
    # Kineto's times are microseconds after baseTimeNanoseconds: on one machine, one clock
    base_us = trace.get("baseTimeNanoseconds", 0) / 1e3
    ranges = [e for e in trace["traceEvents"]
              if e.get("ph") == "X" and str(e.get("name", "")).startswith("acco::")]  # fmt: skip
    loop_tid = next(e["tid"] for e in ranges if e["name"] in LOOP_LABELS)
    return [{"rank": rank, "thread": "loop" if e["tid"] == loop_tid else "communication",
             "label": e["name"], "start_ms": (base_us + e["ts"]) / 1e3, "ms": e["dur"] / 1e3}
            for e in sorted(ranges, key=lambda e: e["ts"])]  # fmt: skip


def run_job() -> list[dict]:
    with tempfile.TemporaryDirectory() as trace_dir:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", "2", __file__, "--trace-dir", trace_dir, *JOB]  # fmt: skip
        subprocess.run(command, cwd=ROOT, check=True)
        ranges = [r for rank in (0, 1)
                  for r in acco_ranges(os.path.join(trace_dir, f"rank{rank}.json"), rank)]  # fmt: skip
    origin = min(r["start_ms"] for r in ranges)
    for r in ranges:
        r["start_ms"] = round(r["start_ms"] - origin, 3)
        r["ms"] = round(r["ms"], 3)
    return ranges


def draw(ranges: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    # A window of ROUNDS_DRAWN rounds from the middle of the run, on rank 0's round ends.
    ends = [r for r in ranges if r["rank"] == 0 and r["label"] == "acco::round_end"]
    first = ends[len(ends) // 2 - ROUNDS_DRAWN // 2]
    last = ends[len(ends) // 2 + ROUNDS_DRAWN // 2]
    t0, t1 = first["start_ms"], last["start_ms"] + last["ms"]
    fig, ax = plt.subplots(figsize=(11, 3.6))
    rows = {(0, "loop"): 3, (0, "communication"): 2, (1, "loop"): 1, (1, "communication"): 0}
    for rank in (0, 1):
        loop = [r for r in ranges if r["rank"] == rank and r["thread"] == "loop"]
        round_ends = [r for r in loop if r["label"] == "acco::round_end"]
        # compute: the loop's time between one round end and the next
        for before, after in itertools.pairwise(round_ends):
            ax.broken_barh([(before["start_ms"] + before["ms"],
                             after["start_ms"] - before["start_ms"] - before["ms"])],
                           (rows[rank, "loop"] - 0.4, 0.8), color=COLORS["compute"])  # fmt: skip
        for r in ranges:
            if r["rank"] != rank:
                continue
            inner = r["label"] in ("acco::wait", "acco::apply")
            height = 0.5 if inner else 0.8
            ax.broken_barh([(r["start_ms"], r["ms"])],
                           (rows[rank, r["thread"]] - height / 2, height),
                           color=COLORS[r["label"]])  # fmt: skip
    ax.set_xlim(t0 - 5, t1 + 5)
    ax.set_yticks(list(rows.values()),
                  [f"rank {rank}: {thread}" for rank, thread in rows])  # fmt: skip
    ax.set_xlabel("ms since the job's first acco:: range (profiled: every operator is slower)")
    ax.set_title(f"The README main job (acco, 2 CPU ranks), {ROUNDS_DRAWN} rounds from a "
                 "torch.profiler trace")  # fmt: skip
    ax.legend(handles=[Patch(color=c, label=k.removeprefix("acco::")) for k, c in COLORS.items()],
              loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=8, fontsize=8,
              frameon=False)  # fmt: skip
    fig.tight_layout()
    fig.savefig(FIGURE, dpi=130)
    print(f"wrote {FIGURE.relative_to(ROOT)}")


def main() -> None:
    if "--trace-dir" in sys.argv:  # a torchrun child
        at = sys.argv.index("--trace-dir")
        profile_one_rank(sys.argv[at + 1], sys.argv[at + 2:])
        return
    ranges = run_job()
    RESULT.write_text(json.dumps({
        "what": "acco:: ranges of the README main job (--training.steps 12) under "
                "torch.profiler with every thread recorded; ms from the first range of either rank",
        "date": time.strftime("%Y-%m-%d"), "machine": platform.platform(),
        "cpus": os.cpu_count(), "command": "python docs/figures/timeline.py",
        "ranges": ranges,
    }, indent=1) + "\n")  # fmt: skip
    print(f"wrote {RESULT.relative_to(ROOT)}: {len(ranges)} ranges")
    draw(ranges)


if __name__ == "__main__":
    main()
