"""Every schedule and ``mode="auto"`` against synchronous ZeRO-1, per token, on capped links.

    python -m benchmarks.auto_sweep                        # as root (the netbed), ~25 min
    python -m benchmarks.auto_sweep --plot-only            # redraw from the JSON

2 gloo ranks on the two-host netbed (``benchmarks.netbed``), one core each, a 1.05M-parameter
MLP through the public API (``ACCOOptimizer``), 20 micro-batches per real update in every arm,
so tokens per update are equal and the ratio of update times is the per-token speedup:

* ``ddp``: synchronous ZeRO-1, one round of 20;
* ``acco``: today's schedule, 10 + 10, float32 estimate;
* ``acco_bf16``: 10 + 10 with a bfloat16 estimate;
* ``law_fp32`` / ``law_bf16``: the split the generalized law picks for the c and C measured in
  this link's ``ddp`` run (``acco_hooks.advisor.best_schedule``), float32 / bfloat16 estimate;
* ``auto``: ``mode="auto"``; its time is that of the updates after its decision.

``--compute real``: each micro-batch is a forward and backward of the MLP. ``--compute sleep``:
each is a sleep of the compute time measured in the real mode, plus the addition of a fixed
gradient: the core is free while the "device" computes, as on a GPU, so the schedule's own
efficiency shows apart from this machine's contention between compute and the communication
thread. Per arm the median update time over the timed updates; ``speedup`` = ddp's ÷ the arm's.

Writes ``docs/results/auto_sweep.json`` and ``docs/figures/auto_sweep.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "auto_sweep.json"
FIGURE = ROOT / "docs" / "figures" / "auto_sweep.png"
RATES = ("none", "1gbit", "200mbit", "100mbit", "50mbit")
MICROBATCHES = 20  # per real update, every arm
WIDTH, BATCH = 724, 256  # two 724x724 layers: 1.05M parameters; ~10 ms per micro-batch here


def worker(args: argparse.Namespace) -> None:
    """One rank of one arm: train ``args.updates`` updates, print one JSON line on rank 0."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from acco_hooks import ACCOOptimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
    settings = json.loads(args.settings)
    opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, foreach=True,
                        accumulation_steps=settings.pop("accumulation_steps"), **settings)  # fmt: skip
    engine = opt.engine
    x = torch.randn(BATCH, WIDTH)
    fixed = [torch.full_like(p, 1e-3) for p in model.parameters()]
    boundaries, compute = [], []
    while engine.updates_launched < args.updates:
        start = time.perf_counter()
        if args.compute == "real":
            model(x).pow(2).mean().backward()
        else:  # the device computes; the core is free
            time.sleep(args.microbatch_s)
            for p, g in zip(model.parameters(), fixed):
                engine.accumulate_grad(p, g)
        compute.append(time.perf_counter() - start)
        launched = engine.updates_launched
        opt.step()
        if engine.updates_launched != launched:  # an update's micro-batches are all in
            boundaries.append(time.perf_counter())
    opt.flush()
    update_s = [b - a for a, b in zip(boundaries, boundaries[1:])]
    timed = update_s[-args.timed:]
    figures = dict(engine.advisor.figures)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({
            "update_s": update_s, "median_update_s": statistics.median(timed),
            "per_microbatch_s": statistics.median(compute[: MICROBATCHES * 3]),
            "advisor": figures, "final_schedule": list(engine.schedule),
        }), flush=True)  # fmt: skip
    opt.close()
    dist.destroy_process_group()


def arms(ddp: dict | None) -> dict[str, dict]:
    """Each arm's settings; the law's splits need this link's ``ddp`` figures."""
    out = {
        "ddp": dict(mode="ddp", accumulation_steps=MICROBATCHES),
        "acco": dict(mode="acco", accumulation_steps=MICROBATCHES // 2),
        "acco_bf16": dict(mode="acco", accumulation_steps=MICROBATCHES // 2,
                          estimate_reduce_dtype="bfloat16"),
        "auto": dict(mode="auto", accumulation_steps=MICROBATCHES),
    }  # fmt: skip
    if ddp is not None:
        import torch

        from acco_hooks.advisor import best_schedule, candidate_schedules

        c, comm = ddp["per_microbatch_s"], ddp["comm_s"]
        for name, dtype, alpha in (("law_fp32", torch.float32, 1.0), ("law_bf16", torch.bfloat16, 0.5)):
            candidates = candidate_schedules(MICROBATCHES, torch.float32, estimate_dtype=dtype)
            best, _ = best_schedule(c, comm, candidates[1:], {"bfloat16": alpha * comm})
            out[name] = dict(mode="acco", accumulation_steps=best.update_microbatches,
                             estimate_microbatches=best.estimate_microbatches,
                             estimate_reduce_dtype=best.estimate_dtype)  # fmt: skip
    return out


def run_arm(link, settings: dict, compute: str, microbatch_s: float, updates: int,
            timed: int) -> dict:  # fmt: skip
    from benchmarks.netbed import run_two_ranks

    argv = [sys.executable, "-m", "benchmarks.auto_sweep", "--worker", "--settings",
            json.dumps(settings), "--compute", compute, "--microbatch-s", str(microbatch_s),
            "--updates", str(updates), "--timed", str(timed)]  # fmt: skip
    status, out0, out1 = run_two_ranks(link, argv, env={"PYTHONPATH": str(ROOT)}, timeout_s=900)
    lines = [line for line in out0.splitlines() if line.startswith("RESULT ")]
    if status or not lines:
        raise SystemExit(f"auto_sweep: {settings} failed ({status}):\n{out0[-3000:]}\n{out1[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def measure(args: argparse.Namespace) -> dict:
    from benchmarks.netbed import two_host_link
    from benchmarks.throughput import _machine

    results: dict = {
        "date": datetime.date.today().isoformat(), "machine": _machine(),
        "model": f"MLP 2 x Linear({WIDTH}, {WIDTH}), 1.05M parameters, batch {BATCH}",
        "microbatches_per_update": MICROBATCHES, "updates": args.updates, "timed": args.timed,
        "auto_updates": args.auto_updates, "runs": {},
    }  # fmt: skip
    with two_host_link() as link:
        for compute in args.compute:
            microbatch_s = results.get("real_microbatch_s", args.microbatch_s)
            for rate in args.rates:
                link.set_rate(rate)
                key = f"{compute}/{rate}"
                runs: dict = {}
                ddp = run_arm(link, arms(None)["ddp"], compute, microbatch_s, args.updates, args.timed)
                ddp["comm_s"] = ddp["advisor"].get("comm_per_round_s", 0.0)
                runs["ddp"] = ddp
                if compute == "real" and rate == "none":
                    results["real_microbatch_s"] = ddp["per_microbatch_s"]
                for name, settings in arms(ddp).items():
                    if name == "ddp":
                        continue
                    updates = args.auto_updates if name == "auto" else args.updates
                    runs[name] = run_arm(link, settings, compute, microbatch_s, updates, args.timed)
                    runs[name]["settings"] = settings
                for name, run in runs.items():
                    run["speedup"] = ddp["median_update_s"] / run["median_update_s"]
                results["runs"][key] = runs
                print(f"{key}: c={ddp['per_microbatch_s']*1e3:.1f}ms C={ddp['comm_s']*1e3:.0f}ms "
                      + " ".join(f"{n}={r['speedup']:.2f}" for n, r in runs.items()), flush=True)
                RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    return results


def law_speedup(c: float, comm: float, settings: dict) -> float:
    """The generalized law's speedup of an arm, with α = ½ for a bfloat16 estimate."""
    from acco_hooks.advisor import Schedule, schedule_seconds

    n = MICROBATCHES
    if settings["mode"] == "ddp":
        return 1.0
    k2 = settings["accumulation_steps"]
    k1 = settings.get("estimate_microbatches") or k2
    alpha = 0.5 if settings.get("estimate_reduce_dtype") == "bfloat16" else 1.0
    return (n * c + comm) / schedule_seconds(c, comm, Schedule(k1, k2, "x"), alpha * comm)


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    computes = sorted({key.split("/")[0] for key in results["runs"]})
    fig, axes = plt.subplots(1, len(computes), figsize=(6 * len(computes), 4.5), squeeze=False)
    markers = {"acco": "o", "acco_bf16": "s", "law_fp32": "^", "law_bf16": "v", "auto": "*"}
    for ax, compute in zip(axes[0], computes):
        for key, runs in results["runs"].items():
            if not key.startswith(compute + "/"):
                continue
            ddp = runs["ddp"]
            ratio = ddp["comm_s"] / (ddp["per_microbatch_s"] * MICROBATCHES / 2)
            for name, marker in markers.items():
                if name in runs:
                    ax.scatter(ratio, runs[name]["speedup"], marker=marker,
                               label=name if key.endswith("/none") else None, s=60)  # fmt: skip
                    if "settings" in runs[name] and name != "auto":
                        ax.scatter(ratio, law_speedup(ddp["per_microbatch_s"], ddp["comm_s"],
                                                      runs[name]["settings"]),
                                   marker=marker, facecolors="none", edgecolors="gray", s=60)  # fmt: skip
            ax.annotate(key.split("/")[1], (ratio, 0.55), fontsize=8, ha="center")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("C / K (K: compute of 10 micro-batches, measured in the ddp run)")
        ax.set_ylabel("per-token speedup over synchronous ZeRO-1")
        ax.set_title(f"compute: {compute} (hollow grey: the generalized law)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    FIGURE.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURE, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--settings", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--microbatch-s", type=float, default=0.010,
                        help="--compute sleep alone: seconds per micro-batch")  # fmt: skip
    parser.add_argument("--compute", nargs="+", default=["real", "sleep"],
                        choices=["real", "sleep"])  # fmt: skip
    parser.add_argument("--rates", nargs="+", default=list(RATES))
    parser.add_argument("--updates", type=int, default=14, help="real updates per fixed arm")
    parser.add_argument("--auto-updates", type=int, default=34,
                        help="real updates of the auto arm (it decides within ~25)")  # fmt: skip
    parser.add_argument("--timed", type=int, default=8, help="last updates timed per arm")
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args()
    if args.worker:
        args.compute = args.compute[0]
        worker(args)
        return
    results = json.loads(RESULTS.read_text()) if args.plot_only else measure(args)
    plot(results)
    print(f"wrote {RESULTS.relative_to(ROOT)} and {FIGURE.relative_to(ROOT)}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
