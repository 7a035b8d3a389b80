"""Plot and tabulate the results of ``benchmarks/convergence/run.py``.

What it shows
    ``docs/figures/convergence.png``: training loss vs tokens seen (all ranks) per mode: the mean
    over seeds as a line and the min-max over seeds as a band, after a trailing moving average
    over ``--smooth-tokens`` tokens (the same token span for every mode; 0 turns it off; the
    title says which). Right panel: the second half of training, zoomed in.
    ``docs/figures/heterogeneous.png`` (if the JSON has heterogeneous runs): loss vs tokens
    processed, loss vs training time, and the micro-batches each rank ran per step.

    Printed tables: per mode the final loss = mean of the (unsmoothed) logged loss over the last
    ``--tail`` (5 %) of steps of each run, then mean ± sample std over seeds, and the relative
    gap of the mean to ddp's; for heterogeneous runs also tokens/s (all ranks and per rank) and
    micro-batches per rank.

Reproduce::

    python -m benchmarks.convergence.run --updates 300 --seeds 0 1 2
    python -m benchmarks.convergence.run --heterogeneous --updates 300 --seeds 0 1 2
    python -m benchmarks.convergence.plot  # --results docs/results/convergence.json

Assumptions: only runs marked ``complete`` are used. Seeds of one mode are put on a common
x grid (their own tokens; linear interpolation where runs differ, as in heterogeneous runs
where the fast rank's extra micro-batches make tokens per step vary) cut to the shortest run.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_RESULTS = "docs/results/convergence.json"
DEFAULT_FIGURES = "docs/figures"
COLORS = {"ddp": "#264653", "acco": "#e76f51", "dpu": "#2a9d8f", "acco_until_ready": "#e76f51",
          "dpu_until_ready": "#2a9d8f"}  # fmt: skip
ORDER = ("ddp", "acco", "dpu", "acco_until_ready", "dpu_until_ready")


def load_runs(path: pathlib.Path, experiment: str) -> dict[str, list[dict[str, Any]]]:
    """Complete runs of ``experiment``, grouped by arm (mode), in a stable order."""
    runs = json.loads(path.read_text(encoding="utf-8")).get("runs", {})
    grouped: dict[str, list[dict[str, Any]]] = {}
    for record in runs.values():
        if record.get("experiment") == experiment and record.get("complete") and record["loss"]:
            grouped.setdefault(record["arm"], []).append(record)
    for records in grouped.values():
        records.sort(key=lambda r: r["seed"])
    rank = {arm: i for i, arm in enumerate(ORDER)}
    return dict(sorted(grouped.items(), key=lambda kv: (rank.get(kv[0], len(ORDER)), kv[0])))


def final_loss(losses: Sequence[float], tail: float = 0.05) -> float:
    """Mean of the last ``tail`` fraction of the steps (at least one step)."""
    if not losses:
        return math.nan
    n = max(1, math.ceil(tail * len(losses)))
    return float(np.mean(losses[-n:]))


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    arr = np.asarray(values, dtype=float)
    return float(arr.mean()), float(arr.std(ddof=1)) if len(arr) > 1 else 0.0


def smooth(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing moving average over ``window`` steps (shorter at the start); 1: unchanged."""
    arr = np.asarray(values, dtype=float)
    if window <= 1 or len(arr) == 0:
        return arr
    cumsum = np.cumsum(np.insert(arr, 0, 0.0))
    idx = np.arange(1, len(arr) + 1)
    lo = np.maximum(idx - window, 0)
    return (cumsum[idx] - cumsum[lo]) / (idx - lo)


def window_steps(record: dict[str, Any], smooth_tokens: int) -> int:
    """Steps spanning ``smooth_tokens`` tokens in ``record`` (its mean tokens per step)."""
    if smooth_tokens <= 0 or not record["tokens"]:
        return 1
    per_step = record["tokens"][-1] / len(record["tokens"])
    return max(1, round(smooth_tokens / per_step))


def band(records: list[dict[str, Any]], x_key: str, smooth_tokens: int
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """x, mean, min, max over seeds of the smoothed loss, on the shortest run's x grid."""
    curves = []
    for record in records:
        y = smooth(record["loss"], window_steps(record, smooth_tokens))
        curves.append((np.asarray(record[x_key], dtype=float), y))
    grid = min((x for x, _ in curves), key=lambda x: x[-1])
    ys = np.stack([np.interp(grid, x, y) for x, y in curves])
    return grid, ys.mean(axis=0), ys.min(axis=0), ys.max(axis=0)


def final_table(grouped: dict[str, list[dict[str, Any]]], tail: float) -> list[dict[str, Any]]:
    """Per arm: seeds, final loss mean ± std, relative gap of the mean to ddp's (in %)."""
    rows = []
    for arm, records in grouped.items():
        mean, std = mean_std([final_loss(r["loss"], tail) for r in records])
        rows.append({"arm": arm, "seeds": [r["seed"] for r in records], "mean": mean, "std": std,
                     "updates": records[0]["updates"], "tokens": records[0]["tokens"][-1]})
    ddp = next((row["mean"] for row in rows if row["arm"] == "ddp"), None)
    for row in rows:
        row["gap_pct"] = 100 * (row["mean"] - ddp) / ddp if ddp else math.nan
    return rows


def print_final_table(title: str, rows: list[dict[str, Any]], tail: float) -> None:
    print(f"{title}: final loss = mean of the last {tail:.0%} of steps; mean ± sample std over "
          "seeds; gap = (mean - ddp mean) / ddp mean")  # fmt: skip
    print(f"  {'mode':<18}{'seeds':<10}{'updates':>8}{'tokens':>12}{'final loss':>20}{'gap':>10}")
    for r in rows:
        seeds = ",".join(map(str, r["seeds"]))
        loss = f"{r['mean']:.4f} ± {r['std']:.4f}"
        print(f"  {r['arm']:<18}{seeds:<10}{r['updates']:>8}{r['tokens']:>12,}{loss:>20}"
              f"{r['gap_pct']:>+9.2f}%")  # fmt: skip


def hetero_table(grouped: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per arm, means over seeds: train time, tokens/s (all, per rank), micro-batches per rank."""
    rows = []
    for arm, records in grouped.items():
        summaries = [r["summary"] for r in records]
        ranks = sorted(records[0].get("microbatches", {}), key=int)

        def avg(key: str) -> float:
            return float(np.mean([s.get(key, math.nan) for s in summaries]))

        rows.append({
            "arm": arm, "seeds": len(records), "slow_s": records[0].get("slow_seconds", 0.0),
            "train_s": avg("train_s"), "tokens_per_s": avg("tokens_per_s"),
            "rank_tps": {rk: avg(f"tokens_per_s_rank{rk}") for rk in ranks},
            "microbatches": {rk: avg(f"microbatches_rank{rk}") for rk in ranks},
            "per_step": {rk: avg(f"microbatches_per_step_rank{rk}") for rk in ranks},
        })  # fmt: skip
    return rows


def print_hetero_table(rows: list[dict[str, Any]]) -> None:
    print("heterogeneous (means over seeds): tokens/s = tokens of all ranks / training time; "
          "micro-batches per rank: total (per step)")  # fmt: skip
    for r in rows:
        ranks = " ".join(
            f"rank{rk}: {r['microbatches'][rk]:.0f} ({r['per_step'][rk]:.2f}/step, "
            f"{r['rank_tps'][rk]:.0f} tok/s)" for rk in r["microbatches"]
        )  # fmt: skip
        print(f"  {r['arm']:<18} slow={r['slow_s']:.2f}s seeds={r['seeds']} "
              f"train={r['train_s']:.1f}s tokens/s={r['tokens_per_s']:.0f}  {ranks}")  # fmt: skip


def _smooth_label(smooth_tokens: int) -> str:
    if smooth_tokens <= 0:
        return "no smoothing"
    return f"trailing moving average over {smooth_tokens:,} tokens"


def _plot_bands(ax: plt.Axes, grouped: dict, x_key: str, smooth_tokens: int, scale: float) -> None:
    for arm, records in grouped.items():
        x, mean, lo, hi = band(records, x_key, smooth_tokens)
        color = COLORS.get(arm)
        ax.plot(x / scale, mean, color=color, lw=1.5, label=f"{arm} (mean of {len(records)})")
        ax.fill_between(x / scale, lo, hi, color=color, alpha=0.25, lw=0)


def plot_convergence(grouped: dict, out: pathlib.Path, smooth_tokens: int) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax in axes:
        _plot_bands(ax, grouped, "tokens", smooth_tokens, 1e6)
        ax.set_xlabel("tokens seen, all ranks (millions)")
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
    end = min(min(r["tokens"][-1] for r in records) for records in grouped.values()) / 1e6
    axes[1].set_xlim(end / 2, end)
    axes[1].set_ylim(*_tail_ylim(grouped, smooth_tokens))
    axes[1].set_title("second half (zoom)")
    axes[0].legend(title="line: mean, band: min–max over seeds")
    updates = "/".join(map(str, sorted({r["updates"] for rs in grouped.values() for r in rs})))
    fig.suptitle(f"ACCO / DPU / DDP, llama3 debug model, 2 CPU ranks, {updates} updates — "
                 f"{_smooth_label(smooth_tokens)}")  # fmt: skip
    _save(fig, out)


def _save(fig, out: pathlib.Path) -> None:
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _tail_ylim(grouped: dict, smooth_tokens: int) -> tuple[float, float]:
    lows, highs = [], []
    for records in grouped.values():
        x, _, lo, hi = band(records, "tokens", smooth_tokens)
        half = x >= x[-1] / 2
        lows.append(lo[half].min())
        highs.append(hi[half].max())
    pad = 0.05 * (max(highs) - min(lows) or 1.0)
    return min(lows) - pad, max(highs) + pad


def plot_heterogeneous(grouped: dict, out: pathlib.Path, smooth_tokens: int) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    _plot_bands(axes[0], grouped, "tokens", smooth_tokens, 1e6)
    axes[0].set_xlabel("tokens processed, all ranks (millions)")
    _plot_bands(axes[1], grouped, "time_s", smooth_tokens, 1.0)
    axes[1].set_xlabel("training time (s)")
    for ax in axes[:2]:
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
    axes[0].legend(title="line: mean, band: min–max over seeds")
    rows = hetero_table(grouped)
    ranks = sorted({rk for r in rows for rk in r["per_step"]}, key=int)
    width = 0.8 / max(len(ranks), 1)
    for i, rk in enumerate(ranks):
        values = [r["per_step"].get(rk, 0.0) for r in rows]
        bars = axes[2].bar(np.arange(len(rows)) + i * width, values, width, label=f"rank {rk}")
        axes[2].bar_label(bars, fmt="%.2f", fontsize=8)
    axes[2].set_xticks(np.arange(len(rows)) + width * (len(ranks) - 1) / 2)
    axes[2].set_xticklabels([f"{r['arm']}\n{r['tokens_per_s']:.0f} tok/s" for r in rows])
    axes[2].set_ylabel("micro-batches per step (round)")
    axes[2].legend()
    slow = "/".join(f"{s:g}" for s in sorted({r["slow_s"] for r in rows}))
    fig.suptitle(f"rank 1 sleeps {slow} s per micro-batch, same real updates — "
                 f"{_smooth_label(smooth_tokens)}")  # fmt: skip
    _save(fig, out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.convergence.plot",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--results", default=DEFAULT_RESULTS, help="JSON written by run.py")
    parser.add_argument("--out-dir", default=DEFAULT_FIGURES, help="where the PNGs go")
    parser.add_argument("--smooth-tokens", type=int, default=32768,
                        help="moving-average span in tokens (0: none)")
    parser.add_argument("--tail", type=float, default=0.05, help="final-loss fraction of steps")
    args = parser.parse_args(argv)
    results = pathlib.Path(args.results)
    results = results if results.is_absolute() else REPO / results
    out_dir = pathlib.Path(args.out_dir)
    out_dir = out_dir if out_dir.is_absolute() else REPO / out_dir
    convergence = load_runs(results, "convergence")
    heterogeneous = load_runs(results, "heterogeneous")
    if not convergence and not heterogeneous:
        print(f"no complete runs in {results}", file=sys.stderr)
        return 1
    if convergence:
        plot_convergence(convergence, out_dir / "convergence.png", args.smooth_tokens)
        print_final_table("convergence", final_table(convergence, args.tail), args.tail)
        print(f"wrote {out_dir / 'convergence.png'}")
    if heterogeneous:
        plot_heterogeneous(heterogeneous, out_dir / "heterogeneous.png", args.smooth_tokens)
        print_final_table("heterogeneous", final_table(heterogeneous, args.tail), args.tail)
        print_hetero_table(hetero_table(heterogeneous))
        print(f"wrote {out_dir / 'heterogeneous.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
