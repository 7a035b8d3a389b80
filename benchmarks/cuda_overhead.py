"""ACCO's cost where there is nothing to hide: one GPU, against plain torchtitan.

    python -m benchmarks.cuda_overhead                 # one CUDA GPU, ~10 min
    python -m benchmarks.cuda_overhead --smoke         # any device: 1 repeat, no compile

One process trains torchtitan's llama3 ``--flavor`` (default the debug model, 6.2M parameters:
launch-bound, the worst case for the engine's per-round work) through ``train_titan.py`` with
``data_parallel_replicate_degree = 1``. No byte crosses a network, so every difference is
overhead: the engine's hooks, its fp32 accumulator, the round end, the estimate step.

**Per token, at equal tokens per optimizer update.** ACCO's update spans two rounds of k
micro-batches (``--microbatches``); the other arms make one update of 2k micro-batches:

- ``titan``: torchtitan without ACCO (its optimizer and gradient accumulation);
- ``acco``: the engine in acco mode (update time: two rounds);
- ``ddp``: the engine's synchronous ZeRO-1 on one rank (the engine without the estimate).

Each arm runs eager and with ``--compile.enable``, ``--repeats`` times, interleaved. The time
per update is the median over steps >= 3 of torchtitan's per-step time (tokens / its ``tps``),
times two for acco; the peak memory is torchtitan's ``memory:`` (on CUDA its peak reserved
GiB). Reported: every repeat, and overhead = T(arm) / T(titan) - 1 from the medians; the
target is <= 3 % for acco.

Writes ``docs/results/cuda_overhead.json`` (``--smoke``: ``outputs/cuda_overhead_smoke.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys

from benchmarks.throughput import LOCAL_BATCH, SEQ_LEN, parse_steps, titan_args

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "cuda_overhead.json"
SMOKE_RESULTS = ROOT / "outputs" / "cuda_overhead_smoke.json"
ONE_REPLICA = ("--parallelism.data_parallel_replicate_degree", "1")
# arm -> (config, extra arguments, micro-batches per step in units of k, steps per update)
ARMS: dict[str, tuple[str, tuple[str, ...], int, int]] = {
    "titan": ("debug_cpu_titan_ddp.toml", ONE_REPLICA, 2, 1),
    "acco": ("debug_cpu_acco.toml", (*ONE_REPLICA, "--acco.mode", "acco"), 1, 2),
    "ddp": ("debug_cpu_acco.toml", (*ONE_REPLICA, "--acco.mode", "ddp"), 2, 1),
}


def run_arm(arm: str, compiled: bool, args: argparse.Namespace) -> dict:
    """One training run of ``arm``; its time per update and peak memory."""
    config, extra, micro_units, steps_per_update = ARMS[arm]
    microbatches = micro_units * args.microbatches
    extra = (*extra, "--model.flavor", args.flavor, *(("--compile.enable",) if compiled else ()))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           *titan_args(config, extra, args.updates * steps_per_update, microbatches, 1,
                       str(ROOT / "outputs" / "cuda_overhead" / arm))[1:]]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800,
                          env={**os.environ, "LOG_RANK": "0"})  # fmt: skip
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{arm} (compile={compiled}) failed:\n{output[-4000:]}")
    steps = parse_steps(output, LOCAL_BATCH * SEQ_LEN * microbatches)
    return {"update_s": steps["round_s"] * steps_per_update,
            "peak_memory_gib": steps["peak_rss_gib"],
            "step_s_all": steps["round_s_all"]}  # fmt: skip


def measure(args: argparse.Namespace) -> dict:
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke only)"
    runs: dict[str, list[dict]] = {}
    for repeat in range(args.repeats):
        for compiled in (False, True) if args.compile else (False,):
            for arm in ARMS:
                key = f"{arm}{'_compiled' if compiled else ''}"
                result = run_arm(arm, compiled, args)
                runs.setdefault(key, []).append(result)
                print(f"repeat {repeat} {key:15s} update {result['update_s'] * 1e3:8.2f} ms  "
                      f"peak {result['peak_memory_gib']:.2f} GiB", flush=True)  # fmt: skip
    summary = {}
    for key, results in runs.items():
        baseline = "titan_compiled" if key.endswith("_compiled") else "titan"
        update_s = statistics.median(r["update_s"] for r in results)
        titan_s = statistics.median(r["update_s"] for r in runs[baseline])
        summary[key] = {
            "update_s_median": update_s,
            "update_s_min": min(r["update_s"] for r in results),
            "update_s_max": max(r["update_s"] for r in results),
            "overhead_vs_titan": update_s / titan_s - 1,
            "peak_memory_gib": max(r["peak_memory_gib"] for r in results),
        }
    return {
        "device": device, "torch": torch.__version__, "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "flavor": args.flavor, "microbatches_per_round": args.microbatches,
        "tokens_per_update": 2 * args.microbatches * LOCAL_BATCH * SEQ_LEN,
        "updates": args.updates, "repeats": args.repeats, "summary": summary, "runs": runs,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debugmodel", help="torchtitan llama3 flavor")
    parser.add_argument("--microbatches", type=int, default=4, help="k: micro-batches per round")
    parser.add_argument("--updates", type=int, default=20, help="optimizer updates per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every arm, interleaved")
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="skip the torch.compile arms")  # fmt: skip
    parser.add_argument("--smoke", action="store_true",
                        help="check the harness on any device: 1 repeat, 4 updates, no compile, "
                        f"results to {SMOKE_RESULTS.relative_to(ROOT)}")  # fmt: skip
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.updates, args.compile = 1, 4, False
    else:
        import torch

        if not torch.cuda.is_available():
            parser.error("needs a CUDA GPU (torch.cuda.is_available() is False); --smoke checks "
                         "the harness on the CPU")  # fmt: skip
    results = measure(args)
    out = SMOKE_RESULTS if args.smoke else RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    for key, row in results["summary"].items():
        print(f"{key:15s} {row['update_s_median'] * 1e3:8.2f} ms/update "
              f"[{row['update_s_min'] * 1e3:.2f}, {row['update_s_max'] * 1e3:.2f}]  "
              f"overhead {row['overhead_vs_titan']:+.1%}  peak {row['peak_memory_gib']:.2f} GiB")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
