"""Every schedule and ``mode="auto"`` against synchronous ZeRO-1, per token, on capped links.

    python -m benchmarks.auto_sweep                        # as root (the netbed), ~50 min
    python -m benchmarks.auto_sweep --plot-only            # redraw from the JSON
    python -m benchmarks.auto_sweep --paired 6 --updates 40   # no cap: ddp, auto, acco alternated
    python -m benchmarks.auto_sweep --out docs/results/auto_sweep.json   # the published files

2 ranks on the netbed, the MLP of ``benchmarks.round_overhead``, 20 micro-batches per update in
every arm (:func:`arm_settings`), so the ratio of update times is the per-token speedup. What
it shows: docs/when_acco_helps.md, "Measured: every schedule and auto on six links". Writes
``outputs/results/auto_sweep.json`` (``--paired``: ``auto_no_cap.json``) and ``auto_sweep.png``
beside it (``--out``; the published files, ``docs/results/auto_sweep.json`` and
``docs/figures/auto_sweep.png``: ``--out docs/results/auto_sweep.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from itertools import pairwise
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import ROOT, emit, header, result_lines, run_on_link, write_result
from benchmarks.round_overhead import BATCH, WIDTH, microbatch, mlp

# The issue's links, and 300mbit: C between one and two rounds' compute (K = 10 micro-batches)
RATES = ("none", "1gbit", "300mbit", "200mbit", "100mbit", "50mbit")
MICROBATCHES = 20  # per real update, every arm
ARMS = ("ddp", "acco", "acco_bf16", "acco_fp8", "law", "auto")


def worker(args: argparse.Namespace) -> None:
    """One rank: train each arm of ``args.settings`` (one dict, or a list that ``--paired``
    alternates ``args.paired`` times in these processes), print a JSON line per run on rank 0."""
    import torch
    import torch.distributed as dist

    from scaffolding.process_exit import finish

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    settings = json.loads(args.settings)
    arms = settings if isinstance(settings, list) else [settings]
    for repeat in range(args.paired or 1):
        for arm in arms if repeat % 2 == 0 else arms[::-1]:
            result = train(dict(arm), args)
            if dist.get_rank() == 0:
                emit({**result, "settings": arm})
    finish()  # scaffolding/process_exit.py: no abort at exit


def train(settings: dict, args: argparse.Namespace) -> dict:
    """``args.updates`` real updates of the MLP under ``settings``; the update times."""
    import torch

    from acco_hooks import ACCOOptimizer

    model, x, fixed = mlp()
    steps = settings.pop("accumulation_steps")
    opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, fused=True,
                        accumulation_steps=steps, **settings)  # fmt: skip
    engine = opt.engine
    boundaries, compute, schedules = [], [], []
    while engine.updates_launched < args.updates:
        compute.append(microbatch(model, x, fixed, engine, args))
        launched = engine.updates_launched
        opt.step()
        if engine.updates_launched != launched:  # an update's micro-batches are all in
            boundaries.append(time.perf_counter())
            schedules.append(list(engine.schedule))
    opt.flush()
    update_s = [b - a for a, b in pairwise(boundaries)]
    result = {
        "update_s": update_s, "median_update_s": statistics.median(update_s[-args.timed:]),
        "mean_update_s_from_3rd": statistics.fmean(update_s[1:]),
        "per_microbatch_s": statistics.median(compute[: MICROBATCHES * 3]),
        "advisor": dict(engine.advisor.figures),
        "estimate_fractions": engine.advisor.estimate_fractions,
        "schedules": schedules, "final_schedule": list(engine.schedule),
    }  # fmt: skip
    opt.close()
    return result


def launch(link, settings, compute: str, microbatch_s: float, updates: int,
           args: argparse.Namespace, timeout_s: float = 900) -> list[dict]:  # fmt: skip
    """Both ranks of :func:`worker` on ``link``: rank 0's results."""
    argv = [sys.executable, "-m", "benchmarks.auto_sweep", "--worker", "--settings",
            json.dumps(settings), "--compute", compute, "--microbatch-s", str(microbatch_s),
            "--updates", str(updates), "--timed", str(args.timed),
            "--paired", str(args.paired)]  # fmt: skip
    out = run_on_link(link, argv, env={"PYTHONPATH": str(ROOT)}, timeout_s=timeout_s)
    return result_lines(out)


def paired(args: argparse.Namespace) -> dict:
    """``--paired N``: ddp and auto (and the paper's acco) in the same two processes on the
    uncapped netbed, alternated N times: what separate launches add to the noise (±4 % here)
    stays out of the ratio."""
    from benchmarks.netbed import two_host_link

    arms = [arm_settings(name, None) for name in ("ddp", "auto", "acco")]
    results: dict = {**header(), "link": "netbed, no cap", "updates": args.updates,
                     "timed": args.timed, "alternations": args.paired, "runs": {}}  # fmt: skip
    with two_host_link() as link:
        for compute in args.compute:
            runs = launch(link, arms, compute, args.microbatch_s, args.updates, args, 3000)
            by_mode: dict[str, list] = {}
            for run in runs:
                by_mode.setdefault(run["settings"]["mode"], []).append(run)
            summary = {mode: paired_summary(by_mode["ddp"], rs) for mode, rs in by_mode.items()}
            results["runs"][compute] = {"runs": runs, "summary": summary}
            print(compute, {m: (round(v["speedup"], 3), [round(x, 3) for x in v["speedup_per_run"]])
                            for m, v in summary.items()}, flush=True)  # fmt: skip
            write_result(args.out, results)
    return results


def paired_summary(ddp: list[dict], runs: list[dict]) -> dict:
    """One arm's speedups over ddp's runs of the same processes."""

    def median(runs: list[dict], key: str) -> float:
        return statistics.median(run[key] for run in runs)

    return {
        "speedup_per_run": [median(ddp, "median_update_s") / r["median_update_s"] for r in runs],
        "speedup": median(ddp, "median_update_s") / median(runs, "median_update_s"),
        "speedup_whole_run": (median(ddp, "mean_update_s_from_3rd")
                              / median(runs, "mean_update_s_from_3rd")),
        "final_schedules": [r["final_schedule"] for r in runs],
    }  # fmt: skip


def arm_settings(name: str, ddp: dict | None) -> dict | None:
    """An arm's ``ACCOOptimizer`` settings; ``law`` needs this link's ``ddp`` figures.

    ``ddp``: synchronous ZeRO-1; ``acco``: the paper's 10 + 10, and ``acco_bf16`` / ``acco_fp8``
    with the estimate round in bfloat16 / float8; ``law``: the schedule the generalized law
    prices fastest for ddp's c and C (None when that is ddp itself); ``auto``: ``mode="auto"``.
    """
    if name in ("ddp", "auto"):
        return {"mode": name, "accumulation_steps": MICROBATCHES}
    if name.startswith("acco"):
        dtype = {"acco": None, "acco_bf16": "bfloat16", "acco_fp8": "float8_e4m3fn"}[name]
        return {"mode": "acco", "accumulation_steps": MICROBATCHES // 2, "estimate_dtype": dtype}
    best = law_best(ddp)
    if best.synchronous:  # nothing to hide: the law's pick is ddp itself
        return None
    return {"mode": "acco", "accumulation_steps": best.update_microbatches,
            "estimate_microbatches": best.estimate_microbatches,
            "estimate_dtype": best.estimate_dtype}  # fmt: skip


def law_best(ddp: dict):
    """``best_schedule`` among ``auto``'s candidates, for ddp's c, C and each format's α."""
    from acco_hooks.engine.schedule import best_schedule, candidate_schedules

    c, comm, fractions = ddp["per_microbatch_s"], ddp["comm_s"], ddp["fractions"]
    candidates = candidate_schedules(MICROBATCHES, list(fractions))
    best, _ = best_schedule(c, comm, candidates, {d: a * comm for d, a in fractions.items()})
    return best


def law_speedup(ddp: dict, schedule: list) -> float:
    """The generalized law's per-token speedup of ``schedule`` with this link's c, C and α."""
    from acco_hooks.engine.schedule import Schedule, schedule_seconds

    c, comm = ddp["per_microbatch_s"], ddp["comm_s"]
    schedule = Schedule(*schedule)
    alpha = ddp["fractions"].get(schedule.estimate_dtype, 1.0)
    return (MICROBATCHES * c + comm) / schedule_seconds(c, comm, schedule, alpha * comm)


def fractions(runs: dict) -> dict[str, float]:
    """α of each estimate format, as the engine computed it (the acco arms report theirs)."""
    found = {"float32": 1.0}
    for run in runs.values():
        found.update(run.get("estimate_fractions") or {})
    return found


def measure(args: argparse.Namespace) -> dict:
    import torch

    from benchmarks.netbed import two_host_link

    results: dict = {
        **header(), "torch": torch.__version__,
        "model": f"MLP 2 x Linear({WIDTH}, {WIDTH}), 1.05M parameters, batch {BATCH}, fused AdamW",
        "microbatches_per_update": MICROBATCHES, "updates": args.updates, "timed": args.timed,
        "auto_updates": args.auto_updates, "repeats": args.repeats, "runs": {},
    }  # fmt: skip
    if args.out.exists() and args.resume:
        results = json.loads(args.out.read_text())
    with two_host_link() as link:
        for compute in args.compute:
            # sleep as long as a real micro-batch took, once the real runs measured it
            microbatch_s = results.get("real_microbatch_s", args.microbatch_s)
            for rate in args.rates:
                key = f"{compute}/{rate}"
                if key in results["runs"]:
                    continue
                link.set_rate(rate)
                results["runs"][key] = [repeat(link, key, compute, microbatch_s, results, args)
                                        for _ in range(args.repeats)]  # fmt: skip
                write_result(args.out, results)
    return results


def repeat(link, key: str, compute: str, microbatch_s: float, results: dict,
           args: argparse.Namespace) -> dict:  # fmt: skip
    """Every arm once, ddp first (the law's arm needs its figures); their speedups."""
    ddp = launch(link, arm_settings("ddp", None), compute, microbatch_s, args.updates, args)[-1]
    ddp["comm_s"] = ddp["advisor"].get("comm_per_round_s", 0.0)
    runs = {"ddp": ddp}
    if key == "real/none" and "real_microbatch_s" not in results:
        results["real_microbatch_s"] = ddp["per_microbatch_s"]
    for name in ARMS[1:]:
        settings = arm_settings(name, {**ddp, "fractions": fractions(runs)})
        if settings is not None:
            updates = args.auto_updates if name == "auto" else args.updates
            runs[name] = launch(link, settings, compute, microbatch_s, updates, args)[-1]
    figures = {**ddp, "fractions": fractions(runs)}
    for run in runs.values():
        run["speedup"] = ddp["median_update_s"] / run["median_update_s"]
        run["law_speedup"] = law_speedup(figures, run["final_schedule"])
    auto = runs.get("auto", {})
    if auto:
        auto["speedup_whole_run"] = ddp["mean_update_s_from_3rd"] / auto["mean_update_s_from_3rd"]
        auto["law_best_speedup"] = law_speedup(figures, list(law_best(figures)))
    shown = " ".join(f"{n}={r['speedup']:.2f}(law {r['law_speedup']:.2f})" for n, r in runs.items())
    if auto:
        shown += f" auto_whole={auto['speedup_whole_run']:.2f}"
    print(f"{key}: c={ddp['per_microbatch_s']*1e3:.1f}ms C={ddp['comm_s']*1e3:.0f}ms {shown}",
          flush=True)  # fmt: skip
    return runs


def plot(results: dict, figure: Path) -> None:
    plt = harness.pyplot()
    computes = [c for c in ("real", "sleep") if any(k.startswith(c + "/") for k in results["runs"])]
    fig, axes = plt.subplots(1, len(computes), figsize=(6.5 * len(computes), 4.8), squeeze=False)
    styles = {"acco": ("o", "C0"), "acco_bf16": ("s", "C1"), "acco_fp8": ("D", "C2"),
              "law": ("^", "C3"), "auto": ("*", "C4")}  # fmt: skip
    for ax, compute in zip(axes[0], computes):
        for key, repeats in results["runs"].items():
            if not key.startswith(compute + "/"):
                continue
            for index, runs in enumerate(repeats):
                ddp = runs["ddp"]
                ratio = ddp["comm_s"] / (ddp["per_microbatch_s"] * MICROBATCHES / 2)
                for name, (marker, color) in styles.items():
                    if name not in runs:
                        continue
                    first = key.endswith("/none") and index == 0
                    ax.scatter(ratio, runs[name]["speedup"], marker=marker, color=color,
                               label=name if first else None,
                               s=70 if name == "auto" else 40)  # fmt: skip
                    ax.scatter(ratio, runs[name]["law_speedup"], marker=marker, facecolors="none",
                               edgecolors=color, s=40, alpha=0.6)  # fmt: skip
            ax.annotate(key.split("/")[1], (ratio, 0.55), fontsize=8, ha="center")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.axhline(1.5, color="gray", lw=0.5, ls=":")
        ax.set_xscale("log")
        ax.set_ylim(0.5, 2.1)
        ax.set_xlabel("C / K (C: ddp's communication; K: compute of 10 micro-batches)")
        ax.set_ylabel("per-token speedup over synchronous ZeRO-1")
        ax.set_title(f"compute: {compute} (filled: measured, every repeat; hollow: the law)")
        ax.legend(fontsize=8, loc="upper right")
    harness.save_figure(fig, figure, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--settings", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--microbatch-s", type=float, default=0.009,
                        help="--compute sleep alone: seconds per micro-batch")  # fmt: skip
    parser.add_argument("--compute", nargs="+", default=["real", "sleep"],
                        choices=["real", "sleep"])  # fmt: skip
    parser.add_argument("--rates", nargs="+", default=list(RATES))
    parser.add_argument("--updates", type=int, default=14, help="real updates per fixed arm")
    parser.add_argument("--auto-updates", type=int, default=40,
                        help="real updates of the auto arm (it decides within ~25)")  # fmt: skip
    parser.add_argument("--timed", type=int, default=8, help="last updates timed per arm")
    parser.add_argument("--repeats", type=int, default=2, help="runs of every arm per link")
    parser.add_argument("--resume", action="store_true", help="keep the links already measured")
    parser.add_argument("--paired", type=int, default=0,
                        help="alternate ddp, auto and acco this many times in one pair of "
                        "processes, no cap (default --out: outputs/results/auto_no_cap.json)")
    parser.add_argument("--plot-only", action="store_true", help="redraw from --out")
    harness.add_out_option(parser, "auto_sweep", "outputs/results/auto_sweep.json, --paired: "
                           "outputs/results/auto_no_cap.json")  # fmt: skip
    args = parser.parse_args()
    if args.out is None:
        args.out = harness.result_file("auto_no_cap" if args.paired else "auto_sweep")
    if args.worker:
        args.compute = args.compute[0]
        worker(args)
        return
    if args.paired:
        paired(args)
        print(f"wrote {args.out}")
        return
    results = json.loads(args.out.read_text()) if args.plot_only else measure(args)
    plot(results, harness.figure_file(args.out, "auto_sweep"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
