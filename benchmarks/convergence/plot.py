"""Figures and summaries of the results files of ``benchmarks/convergence/run.py``.

    python -m benchmarks.convergence.plot  # the default results files, figures in docs/figures

One figure per experiment and data, ``<out-dir>/<experiment>_<data>.png``; the data is named
``iid`` (sequence-shuffled stdlib), ``documents``, ``torch-iid``, ... The tables it prints go
into each results file as its top-level ``"summary"``, keyed by the data, and ``spread`` from
the runs of ``--data-seed``. What the panels and numbers mean: ``docs/results.md`` sections 4
and 5. Only runs marked ``complete`` count; a file without held-out data (an older one) still
gives the training-loss panels and tables.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.convergence.run import training_tokens_per_s
from benchmarks.harness import pyplot, save_figure, write_result

plt = pyplot()

REPO = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_RESULTS = ("docs/results/convergence_heldout.json", "docs/results/heterogeneous.json",
                   "docs/results/convergence_spread.json")
# How a summary names the data of a group of runs: "iid" for sequence-shuffled data (independent
# samples per micro-batch), "documents" for the document stream; other corpora than stdlib first.
DATA_NAMES = {"sequences": "iid", "documents": "documents"}
DEFAULT_FIGURES = "docs/figures"
COLORS = {"ddp": "#264653", "acco": "#e76f51", "dpu": "#2a9d8f", "acco_until_ready": "#e76f51",
          "dpu_until_ready": "#2a9d8f", "ddp_matched": "#8a5a9e", "acco_capped": "#e9c46a"}
ORDER = ("ddp", "acco", "dpu", "acco_until_ready", "ddp_matched", "acco_capped",
         "dpu_until_ready")  # fmt: skip
HETERO_ARM = "acco_until_ready"  # compared with ddp in the heterogeneous summary

Runs = dict[str, list[dict[str, Any]]]  # arm -> complete records, by seed


def read_results(path: pathlib.Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def data_name(record: dict[str, Any]) -> str:
    """The summary's name of a run's data: ``iid``, ``documents``, ``torch-iid``, ..."""
    corpus = record.get("corpus", "stdlib")
    order = DATA_NAMES.get(record.get("data_order", "documents"), record.get("data_order"))
    return order if corpus == "stdlib" else f"{corpus}-{order}"


def group_runs(runs: dict[str, dict[str, Any]], experiment: str, data: str | None = None) -> Runs:
    """Complete runs of ``experiment`` (on ``data``, if given) but those of ``--data-seed``,
    grouped by arm, in a stable order."""
    grouped: Runs = {}
    for record in runs.values():
        if (record.get("experiment") == experiment and record.get("complete") and record["loss"]
                and data in (None, data_name(record))
                and record.get("data_seed") is None):  # fmt: skip
            grouped.setdefault(record["arm"], []).append(record)
    for records in grouped.values():
        records.sort(key=lambda r: r["seed"])
    rank = {arm: i for i, arm in enumerate(ORDER)}
    return dict(sorted(grouped.items(), key=lambda kv: (rank.get(kv[0], len(ORDER)), kv[0])))


def load_runs(path: pathlib.Path, experiment: str) -> Runs:
    """Complete runs of ``experiment`` in the results file ``path``."""
    return group_runs(read_results(path).get("runs", {}), experiment)


# ----------------------------------------------------------------------------- statistics


def final_loss(losses: Sequence[float], tail: float = 0.05) -> float:
    """Mean of the last ``tail`` fraction of the steps (at least one step)."""
    if not losses:
        return math.nan
    n = max(1, math.ceil(tail * len(losses)))
    return float(np.mean(losses[-n:]))


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value; NaN for none)."""
    arr = np.asarray(values, dtype=float)
    if len(arr) == 0:
        return math.nan, math.nan
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


def band(records: list[dict[str, Any]], x_key: str, smooth_tokens: int
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """x, mean, min, max over seeds of the loss smoothed over ``smooth_tokens`` tokens (each
    run's mean tokens per step), on the shortest run's x grid."""
    curves = []
    for record in records:
        window = 1
        if smooth_tokens > 0 and record["tokens"]:
            per_step = record["tokens"][-1] / len(record["tokens"])
            window = max(1, round(smooth_tokens / per_step))
        curves.append((np.asarray(record[x_key], dtype=float), smooth(record["loss"], window)))
    grid = min((x for x, _ in curves), key=lambda x: x[-1])
    ys = np.stack([np.interp(grid, x, y) for x, y in curves])
    return grid, ys.mean(axis=0), ys.min(axis=0), ys.max(axis=0)


def heldout_curve(record: dict[str, Any], x_key: str = "heldout_tokens"
                  ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """x (``heldout_tokens`` or ``heldout_time_s``) and held-out loss of one run."""
    points = [(x, y) for x, y in zip(record.get(x_key, []), record.get("heldout_loss", []))
              if x is not None]  # fmt: skip
    x, y = zip(*points) if points else ((), ())
    return np.asarray(x, dtype=float), np.asarray(y, dtype=float)


def has_heldout(grouped: Runs) -> bool:
    return any(r.get("heldout_loss") for records in grouped.values() for r in records)


def heldout_mean(records: list[dict[str, Any]]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """Tokens, mean and sample std of the held-out loss over seeds, at the steps all share."""
    shared = set.intersection(*(set(r["heldout_step"]) for r in records))
    if not shared:
        return np.array([]), np.array([]), np.array([])
    rows = []
    for record in records:
        by_step = dict(zip(record["heldout_step"],
                           zip(record["heldout_tokens"], record["heldout_loss"])))  # fmt: skip
        rows.append([by_step[s] for s in sorted(shared)])
    arr = np.asarray(rows, dtype=float)  # seeds x steps x (tokens, loss)
    std = arr[:, :, 1].std(axis=0, ddof=1) if len(records) > 1 else np.zeros(len(shared))
    return arr[:, :, 0].mean(axis=0), arr[:, :, 1].mean(axis=0), std


def gap_at(x_ref: np.ndarray, y_ref: np.ndarray, x: np.ndarray, y: np.ndarray,
           exact: bool) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """``y - y_ref`` at the points of ``x_ref``: those ``x`` also has (``exact``), or all
    within the range of ``x``, ``y`` interpolated linearly."""
    if not len(x) or not len(x_ref):
        return np.array([]), np.array([])
    if exact:
        keep = np.isin(x_ref, x)
    else:
        keep = (x_ref >= x.min()) & (x_ref <= x.max())
    order = np.argsort(x)
    return x_ref[keep], np.interp(x_ref[keep], x[order], y[order]) - y_ref[keep]


def by_seed(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {r["seed"]: r for r in records}


def first_crossing(x: np.ndarray, loss: np.ndarray, level: float) -> float:
    """Where a held-out curve first reaches ``level`` (linear between validations), or NaN."""
    below = np.flatnonzero(loss <= level)
    if not len(below) or below[0] == 0:
        return math.nan
    i = below[0]
    fraction = (loss[i - 1] - level) / (loss[i - 1] - loss[i])
    return float(x[i - 1] + fraction * (x[i] - x[i - 1]))


# ----------------------------------------------------------------------------- summaries


def final_table(grouped: Runs, tail: float) -> list[dict[str, Any]]:
    """Per arm: seeds, final training loss mean ± std, relative gap of the mean to ddp's (%)."""
    rows = []
    for arm, records in grouped.items():
        mean, std = mean_std([final_loss(r["loss"], tail) for r in records])
        rows.append({"arm": arm, "seeds": [r["seed"] for r in records], "mean": mean, "std": std,
                     "updates": records[0]["updates"], "tokens": records[0]["tokens"][-1]})
    ddp = next((row["mean"] for row in rows if row["arm"] == "ddp"), None)
    for row in rows:
        row["gap_pct"] = 100 * (row["mean"] - ddp) / ddp if ddp else math.nan
    return rows


def heldout_table(grouped: Runs) -> list[dict[str, Any]]:
    """Per arm: held-out loss after the final update per seed, mean ± std, and the paired gap
    to ddp of the same seed (per seed, mean ± std, mean relative to ddp's mean in %)."""
    ddp = by_seed(grouped.get("ddp", []))
    ddp_mean = mean_std([r["heldout_loss"][-1] for r in ddp.values() if r.get("heldout_loss")])[0]
    rows = []
    for arm, records in grouped.items():
        final = {r["seed"]: float(r["heldout_loss"][-1]) for r in records if r.get("heldout_loss")}
        if not final:
            continue
        gaps = {seed: final[seed] - float(ddp[seed]["heldout_loss"][-1])
                for seed in final if seed in ddp and ddp[seed].get("heldout_loss")}  # fmt: skip
        mean, std = mean_std(list(final.values()))
        gap_mean, gap_std = mean_std(list(gaps.values()))
        nan = math.isnan(ddp_mean)
        rows.append({
            "arm": arm, "seeds": sorted(final), "updates": records[0]["heldout_updates"][-1],
            "tokens": records[0]["heldout_tokens"][-1],
            "per_seed": {str(s): v for s, v in final.items()}, "mean": mean, "std": std,
            "paired_gap_to_ddp": {str(s): v for s, v in gaps.items()},
            "paired_gap_mean": gap_mean, "paired_gap_std": gap_std,
            "paired_gap_pct": math.nan if nan else 100 * gap_mean / ddp_mean,
            "paired_gap_pct_std": math.nan if nan else 100 * gap_std / ddp_mean,
        })  # fmt: skip
    return rows


def _mean_of(records: list[dict[str, Any]], key: str) -> float:
    """The mean over runs of one number of their summaries (NaN where one lacks it)."""
    return float(np.mean([r["summary"].get(key, math.nan) for r in records]))


def hetero_table(grouped: Runs) -> list[dict[str, Any]]:
    """Per arm: tokens/s per seed and mean ± std, train time, micro-batches per round per rank
    (means over seeds of the runs' summaries)."""
    rows = []
    for arm, records in grouped.items():
        ranks = sorted(records[0].get("microbatches", {}), key=int)
        tps = {str(r["seed"]): r["summary"].get("tokens_per_s", math.nan) for r in records}
        tps_mean, tps_std = mean_std(list(tps.values()))
        rows.append({
            "arm": arm, "seeds": [r["seed"] for r in records],
            "slow_factor": records[0].get("slow_factor", math.nan),
            "nominal_per_round": records[0].get("microbatches_per_round_nominal"),
            "updates": records[0]["updates"], "train_s": _mean_of(records, "train_s"),
            "tokens": _mean_of(records, "tokens"),
            "tokens_per_s": tps_mean, "tokens_per_s_std": tps_std, "tokens_per_s_per_seed": tps,
            "rank_tps": {rk: _mean_of(records, f"tokens_per_s_rank{rk}") for rk in ranks},
            "microbatches": {rk: _mean_of(records, f"microbatches_rank{rk}") for rk in ranks},
            "per_step": {rk: _mean_of(records, f"microbatches_per_step_rank{rk}") for rk in ranks},
        })  # fmt: skip
    return rows


def hetero_comparison(grouped: Runs, arm: str = HETERO_ARM) -> dict[str, Any]:
    """``arm`` against ddp, per seed: tokens/s ratio, held-out gap at equal tokens.

    Equal tokens: T* = the fewer of the two runs' final held-out token counts; both held-out
    curves are interpolated linearly at T*, the gap is ``arm − ddp``. ``gap_final_update``:
    the two runs' held-out losses after their last update (their tokens may differ).
    """
    ours, ddp = by_seed(grouped.get(arm, [])), by_seed(grouped.get("ddp", []))
    per_seed: dict[str, dict[str, float]] = {}
    for seed in sorted(set(ours) & set(ddp)):
        a, d = ours[seed], ddp[seed]
        row = {"tokens_per_s_ratio": a["summary"]["tokens_per_s"] / d["summary"]["tokens_per_s"],
               "tokens_per_s_training_ratio": (training_tokens_per_s(a)
                                               / training_tokens_per_s(d))}  # fmt: skip
        xa, ya = heldout_curve(a)
        xd, yd = heldout_curve(d)
        if len(xa) and len(xd):
            tokens = min(xa[-1], xd[-1])
            row.update({
                "equal_tokens": float(tokens),
                "heldout_at_equal_tokens": float(np.interp(tokens, xa, ya)),
                "heldout_ddp_at_equal_tokens": float(np.interp(tokens, xd, yd)),
                "gap_final_update": float(ya[-1] - yd[-1]),
                "tokens_final": float(xa[-1]), "tokens_final_ddp": float(xd[-1]),
            })  # fmt: skip
            row["gap_at_equal_tokens"] = (row["heldout_at_equal_tokens"]
                                          - row["heldout_ddp_at_equal_tokens"])  # fmt: skip
            row["gap_pct"] = 100 * row["gap_at_equal_tokens"] / row["heldout_ddp_at_equal_tokens"]
        per_seed[str(seed)] = row
    out: dict[str, Any] = {"arm": arm, "per_seed": per_seed}
    for key in ("tokens_per_s_ratio", "tokens_per_s_training_ratio", "gap_at_equal_tokens",
                "gap_pct", "gap_final_update"):
        values = [row[key] for row in per_seed.values() if key in row]
        out[key + "_mean"], out[key + "_std"] = mean_std(values)
    return out


def time_to_heldout(grouped: Runs, arm: str = HETERO_ARM) -> dict[str, Any]:
    """Speed at equal loss: training time and tokens for each arm to reach held-out losses.

    The levels are the ones every run of both arms reaches: from the highest final held-out
    loss down in steps of 0.1, up to 4 levels. ``speedup`` is ddp's time / ``arm``'s, per seed.
    """
    ours, ddp = by_seed(grouped.get(arm, [])), by_seed(grouped.get("ddp", []))
    seeds = sorted(set(ours) & set(ddp))
    runs = [ours[s] for s in seeds] + [ddp[s] for s in seeds]
    if not seeds or not all(r.get("heldout_loss") for r in runs):
        return {}
    reached = max(min(r["heldout_loss"]) for r in runs)
    out: dict[str, Any] = {"arm": arm, "levels": {}}
    for i in range(4):
        level = round(math.ceil(reached * 10) / 10 + 0.1 * i, 1)
        row: dict[str, Any] = {"per_seed": {}}
        for seed in seeds:
            times, tokens = [], []
            for record in (ours[seed], ddp[seed]):
                loss = np.asarray(record["heldout_loss"])
                times.append(first_crossing(np.asarray(record["heldout_time_s"]), loss, level))
                tokens.append(first_crossing(np.asarray(record["heldout_tokens"]), loss, level))
            row["per_seed"][str(seed)] = {"time_s": times[0], "time_s_ddp": times[1],
                                          "tokens": tokens[0], "tokens_ddp": tokens[1],
                                          "speedup": times[1] / times[0],
                                          "tokens_ratio": tokens[0] / tokens[1]}  # fmt: skip
        for key in ("speedup", "tokens_ratio"):
            values = [v[key] for v in row["per_seed"].values()]
            row[key + "_mean"], row[key + "_std"] = mean_std(values)
        out["levels"][f"{level:.1f}"] = row
    return out


def convergence_summary(grouped: Runs, tail: float) -> dict[str, Any]:
    return {"heldout_final_update": heldout_table(grouped),
            "train_loss_final": final_table(grouped, tail), "train_loss_tail": tail}


def heterogeneous_summary(grouped: Runs) -> dict[str, Any]:
    """Per arm, and each arm against ddp; ``heldout_gap_pct`` and ``tokens_per_s_ratio`` at the
    top: ``acco_until_ready``'s (held-out gap at equal tokens in % of ddp's loss, per seed)."""
    versus = {arm: hetero_comparison(grouped, arm) for arm in grouped if arm != "ddp"}
    main = versus.get(HETERO_ARM, hetero_comparison(grouped))
    return {
        "heldout_gap_pct": {"mean": main["gap_pct_mean"], "std": main["gap_pct_std"],
                            "per_seed": {s: v.get("gap_pct") for s, v in main["per_seed"].items()}},
        # training steps only (validations left out: run.training_tokens_per_s), and all in
        "tokens_per_s_ratio": {"mean": main["tokens_per_s_training_ratio_mean"],
                               "std": main["tokens_per_s_training_ratio_std"],
                               "with_validations": {"mean": main["tokens_per_s_ratio_mean"],
                                                    "std": main["tokens_per_s_ratio_std"]}},
        "arms": hetero_table(grouped), "vs_ddp": main, "arms_vs_ddp": versus,
        "time_to_heldout": time_to_heldout(grouped),
    }  # fmt: skip


def spread_summary(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The two sources of seed-to-seed spread apart, per arm and data: the held-out loss after
    the final update over initialisations (one data order) and over data orders (one
    initialisation), mean ± sample std. From the runs of ``--data-seed`` (and the ordinary run
    whose seed is that data seed: the same run)."""
    out: dict[str, Any] = {}
    for record in runs.values():
        if not (record.get("complete") and record.get("heldout_loss")
                and record.get("data_seed") is not None):  # fmt: skip
            continue
        row = out.setdefault(f"{data_name(record)}/{record['arm']}", {"init": {}, "data": {}})
        seed, data_seed = str(record["seed"]), str(record["data_seed"])
        final = record["heldout_loss"][-1]
        row["init"].setdefault(data_seed, {})[seed] = final  # initialisations at one data order
        row["data"].setdefault(seed, {})[data_seed] = final  # data orders at one initialisation
    for row in out.values():
        for kind in ("init", "data"):
            spreads = {}
            for fixed, values in row[kind].items():
                if len(values) > 1:
                    mean, std = mean_std(list(values.values()))
                    spreads[fixed] = {"per_seed": values, "mean": mean, "std": std}
            row[kind] = spreads
    return out


# ----------------------------------------------------------------------------- printing


def print_final_table(title: str, rows: list[dict[str, Any]], tail: float) -> None:
    print(f"{title}: final training loss = mean of the last {tail:.0%} of steps; mean ± sample "
          "std over seeds; gap = (mean - ddp mean) / ddp mean")  # fmt: skip
    print(f"  {'mode':<18}{'seeds':<10}{'updates':>8}{'tokens':>12}{'final loss':>20}{'gap':>10}")
    for r in rows:
        seeds = ",".join(map(str, r["seeds"]))
        loss = f"{r['mean']:.4f} ± {r['std']:.4f}"
        print(f"  {r['arm']:<18}{seeds:<10}{r['updates']:>8}{r['tokens']:>12,}{loss:>20}"
              f"{r['gap_pct']:>+9.2f}%")  # fmt: skip


def print_heldout_table(rows: list[dict[str, Any]]) -> None:
    print("convergence: held-out loss after the final update, mean ± sample std over seeds; "
          "paired gap = mode - ddp with the same seed, mean ± std over seeds (and per seed)")
    print(f"  {'mode':<8}{'seeds':<8}{'updates':>8}{'tokens':>11}{'held-out loss':>20}"
          f"{'paired gap to ddp':>26}  per seed")  # fmt: skip
    for r in rows:
        seeds = ",".join(map(str, r["seeds"]))
        loss = f"{r['mean']:.4f} ± {r['std']:.4f}"
        gap = (f"{r['paired_gap_mean']:+.4f} ± {r['paired_gap_std']:.4f} "
               f"({r['paired_gap_pct']:+.2f}%)")  # fmt: skip
        per_seed = " ".join(f"{v:+.4f}" for v in r["paired_gap_to_ddp"].values())
        print(f"  {r['arm']:<8}{seeds:<8}{r['updates']:>8}{r['tokens']:>11,}{loss:>20}{gap:>26}"
              f"  {per_seed}")  # fmt: skip


def print_hetero_table(summary: dict[str, Any]) -> None:
    print("heterogeneous: tokens/s = actual tokens of all ranks / training time (mean ± std "
          "over seeds); micro-batches per rank: total (per round)")  # fmt: skip
    for r in summary["arms"]:
        ranks = " ".join(
            f"rank{rk}: {r['microbatches'][rk]:.0f} ({r['per_step'][rk]:.2f}/step, "
            f"{r['rank_tps'][rk]:.0f} tok/s)" for rk in r["microbatches"]
        )  # fmt: skip
        print(f"  {r['arm']:<18} slow x{r['slow_factor']:g} seeds={len(r['seeds'])} "
              f"train={r['train_s']:.1f}s tokens={r['tokens']:,.0f} "
              f"tokens/s={r['tokens_per_s']:.0f} ± {r['tokens_per_s_std']:.0f}  {ranks}")
    for c in summary["arms_vs_ddp"].values():
        if not c["per_seed"]:
            continue
        arm, per_seed = c["arm"], c["per_seed"]
        ratios = " ".join(f"seed{s}: {v['tokens_per_s_ratio']:.2f}" for s, v in per_seed.items())
        print(f"  tokens/s {arm} / ddp: {c['tokens_per_s_ratio_mean']:.2f} ± "
              f"{c['tokens_per_s_ratio_std']:.2f}  ({ratios}); training steps only: "
              f"{c['tokens_per_s_training_ratio_mean']:.2f} ± "
              f"{c['tokens_per_s_training_ratio_std']:.2f}")
        if math.isnan(c["gap_at_equal_tokens_mean"]):
            continue
        gaps = " ".join(f"seed{s}: {v['gap_at_equal_tokens']:+.4f} at {v['equal_tokens']:,.0f}"
                        for s, v in per_seed.items() if "gap_at_equal_tokens" in v)  # fmt: skip
        print(f"  held-out {arm} - ddp at equal tokens: {c['gap_at_equal_tokens_mean']:+.4f} ± "
              f"{c['gap_at_equal_tokens_std']:.4f} ({c['gap_pct_mean']:+.2f} ± "
              f"{c['gap_pct_std']:.2f}% of ddp's)  ({gaps}); after the final update: "
              f"{c['gap_final_update_mean']:+.4f} ± {c['gap_final_update_std']:.4f}")
    speed = summary["time_to_heldout"]
    for level, row in speed.get("levels", {}).items():
        print(f"  to held-out {level}: ddp time / {speed['arm']} time = "
              f"{row['speedup_mean']:.2f} ± {row['speedup_std']:.2f}; {speed['arm']} needs "
              f"{row['tokens_ratio_mean']:.2f} ± {row['tokens_ratio_std']:.2f}x ddp's tokens")


def print_spread(spread: dict[str, Any]) -> None:
    for name, row in spread.items():
        for kind, label in (("init", "initialisations at data seed"),
                            ("data", "data orders at initialisation")):  # fmt: skip
            for fixed, values in row[kind].items():
                print(f"spread of {name}'s final held-out loss over {label} {fixed}: "
                      f"{values['mean']:.4f} ± {values['std']:.4f} ({len(values['per_seed'])})")


# ----------------------------------------------------------------------------- figures


def _smooth_label(smooth_tokens: int) -> str:
    if smooth_tokens <= 0:
        return "no smoothing"
    return f"trailing moving average over {smooth_tokens:,} tokens"


def _plot_bands(ax: plt.Axes, grouped: Runs, x_key: str, smooth_tokens: int, scale: float) -> None:
    for arm, records in grouped.items():
        x, mean, lo, hi = band(records, x_key, smooth_tokens)
        color = COLORS.get(arm)
        ax.plot(x / scale, mean, color=color, lw=1.5, label=f"{arm} (mean of {len(records)})")
        ax.fill_between(x / scale, lo, hi, color=color, alpha=0.25, lw=0)


def _plot_heldout_seeds(ax: plt.Axes, grouped: Runs, x_key: str, scale: float) -> None:
    """Every seed's held-out curve, one colour per arm, a marker per validation."""
    for arm, records in grouped.items():
        for i, record in enumerate(records):
            x, y = heldout_curve(record, x_key)
            ax.plot(x / scale, y, color=COLORS.get(arm), lw=1.0, alpha=0.7, marker=".", ms=4,
                    label=f"{arm}, seeds: {len(records)}" if i == 0 else None)  # fmt: skip


def _plot_mean_std(ax: plt.Axes, x: np.ndarray, mean: np.ndarray, std: np.ndarray, arm: str,
                   label: str) -> None:  # fmt: skip
    ax.errorbar(x / 1e6, mean, yerr=std, color=COLORS.get(arm), lw=1.6, capsize=3, marker="o",
                ms=3, label=label)  # fmt: skip


def _bars(ax: plt.Axes, groups: list[str], series: dict[str, list[float]], fmt: str,
          colors: dict[str, str | None]) -> None:  # fmt: skip
    """One bar per series in each group, side by side, each labelled with its value."""
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
        bars = ax.bar(np.arange(len(groups)) + i * width, values, width, color=colors.get(label),
                      label=label)  # fmt: skip
        ax.bar_label(bars, fmt=fmt, fontsize=8)
    ax.set_xticks(np.arange(len(groups)) + width * (len(series) - 1) / 2)
    ax.set_xticklabels(groups)
    ax.legend(fontsize=8)


def plot_convergence(grouped: Runs, out: pathlib.Path, smooth_tokens: int) -> None:
    """Training loss vs tokens (mean and min-max band over seeds); with held-out data, the
    held-out loss (every seed, mean ± std) and its paired gap to ddp (same seed)."""
    heldout = has_heldout(grouped)  # an older results file has the training loss alone
    fig, axes = plt.subplots(1, 3 if heldout else 1, figsize=(18 if heldout else 6, 4.8),
                             squeeze=False)  # fmt: skip
    axes = axes[0]
    _plot_bands(axes[0], grouped, "tokens", smooth_tokens, 1e6)
    axes[0].set_ylabel("training loss")
    axes[0].set_title(f"training loss ({_smooth_label(smooth_tokens)})", fontsize=10)
    axes[0].legend(title="line: mean, band: min–max over seeds", fontsize=8)
    if heldout:
        for arm, records in grouped.items():
            for record in records:
                xs, ys = heldout_curve(record)
                axes[1].plot(xs / 1e6, ys, color=COLORS.get(arm), lw=0.8, alpha=0.45)
            label = f"{arm} (mean ± std, {len(records)} seeds)"
            _plot_mean_std(axes[1], *heldout_mean(records), arm, label)
        axes[1].set_ylabel("held-out loss (stdlib_validation)")
        axes[1].set_title("held-out loss: thin lines = seeds", fontsize=10)
        axes[1].legend(fontsize=8)
        ddp = by_seed(grouped.get("ddp", []))
        for arm, records in grouped.items():
            if arm == "ddp":
                continue
            gaps = []  # per seed: {tokens: held-out loss - ddp's at the same seed and tokens}
            for record in (r for r in records if r["seed"] in ddp):
                x, gap = gap_at(*heldout_curve(ddp[record["seed"]]), *heldout_curve(record),
                                exact=True)  # fmt: skip
                axes[2].plot(x / 1e6, gap, color=COLORS.get(arm), lw=0.8, alpha=0.45, marker=".")
                gaps.append(dict(zip(x.tolist(), gap.tolist())))
            shared = sorted(set.intersection(*(set(g) for g in gaps))) if gaps else []
            if shared:
                values = np.asarray([[g[t] for t in shared] for g in gaps])
                std = values.std(axis=0, ddof=1) if len(gaps) > 1 else np.zeros(len(shared))
                label = f"{arm} − ddp (mean ± std, {len(gaps)} seeds)"
                _plot_mean_std(axes[2], np.asarray(shared), values.mean(axis=0), std, arm, label)
        axes[2].axhline(0.0, color=COLORS["ddp"], lw=1, ls="--")
        axes[2].set_ylabel("held-out loss − ddp's, same seed")
        axes[2].set_title("paired gap to ddp: thin lines = seeds", fontsize=10)
        axes[2].legend(fontsize=8)
    for ax in axes:
        ax.set_xlabel("tokens seen, all ranks (millions)")
        ax.grid(alpha=0.3)
    updates = "/".join(map(str, sorted({r["updates"] for rs in grouped.values() for r in rs})))
    fig.suptitle(f"ACCO / DPU / DDP, llama3 debug model, 2 CPU ranks, {updates} updates")
    save_figure(fig, out, dpi=120)


def plot_heterogeneous(grouped: Runs, out: pathlib.Path, smooth_tokens: int,
                       summary: dict[str, Any]) -> None:  # fmt: skip
    """Held-out (or, without it, training) loss vs tokens and time; tokens/s; micro-batches."""
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    (ax_tokens, ax_time), (ax_tps, ax_mb) = axes
    if has_heldout(grouped):
        _plot_heldout_seeds(ax_tokens, grouped, "heldout_tokens", 1e6)
        _plot_heldout_seeds(ax_time, grouped, "heldout_time_s", 1.0)
        ylabel = "held-out loss (stdlib_validation)"
    else:
        _plot_bands(ax_tokens, grouped, "tokens", smooth_tokens, 1e6)
        _plot_bands(ax_time, grouped, "time_s", smooth_tokens, 1.0)
        ylabel = f"training loss ({_smooth_label(smooth_tokens)})"
    ax_tokens.set_xlabel("tokens processed, all ranks (millions)")
    ax_time.set_xlabel("training time (s)")
    for ax in (ax_tokens, ax_time):
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    comparison, rows = summary["vs_ddp"], summary["arms"]
    gap = comparison["gap_at_equal_tokens_mean"]
    if not math.isnan(gap):
        ax_tokens.set_title(f"{HETERO_ARM} − ddp at equal tokens: {gap:+.4f} ± "
                            f"{comparison['gap_at_equal_tokens_std']:.4f}", fontsize=10)
    seeds = sorted({s for r in rows for s in r["tokens_per_s_per_seed"]}, key=int)
    _bars(ax_tps, [f"seed {s}" for s in seeds],
          {r["arm"]: [r["tokens_per_s_per_seed"].get(s, 0.0) for s in seeds] for r in rows},
          "%.0f", COLORS)  # fmt: skip
    ax_tps.set_ylabel("tokens/s, all ranks")
    if comparison["per_seed"]:
        factor = float(rows[0]["slow_factor"])
        ax_tps.set_title(f"{HETERO_ARM} / ddp: {comparison['tokens_per_s_ratio_mean']:.2f}× ± "
                         f"{comparison['tokens_per_s_ratio_std']:.2f} (compute-bound ceiling "
                         f"(factor + 1) / 2 = {(factor + 1) / 2:.2f}×)", fontsize=10)  # fmt: skip
    ranks = sorted({rk for r in rows for rk in r["per_step"]}, key=int)
    _bars(ax_mb, [f"{r['arm']}\n({r['nominal_per_round']} nominal per rank)" for r in rows],
          {f"rank {rk}": [r["per_step"].get(rk, 0.0) for r in rows] for rk in ranks},
          "%.2f", {})  # fmt: skip
    ax_mb.set_ylabel("micro-batches per step (round), mean over seeds")
    slow = "/".join(f"{r['slow_factor']:g}" for r in rows[:1])
    updates = "/".join(map(str, sorted({r["updates"] for r in rows})))
    fig.suptitle(f"rank 1 {slow}× slower per micro-batch, {updates} real updates per arm, "
                 "2 CPU ranks")  # fmt: skip
    save_figure(fig, out, dpi=120)


# ----------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.convergence.plot",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--results", nargs="+", default=list(DEFAULT_RESULTS),
                        help="JSON files written by run.py (missing ones are skipped)")
    parser.add_argument("--out-dir", default=DEFAULT_FIGURES, help="where the PNGs go")
    parser.add_argument("--smooth-tokens", type=int, default=32768,
                        help="training-loss moving-average span in tokens (0: none)")
    parser.add_argument("--tail", type=float, default=0.05,
                        help="final training loss: fraction of steps averaged")
    parser.add_argument("--no-write-summary", action="store_true",
                        help="print only; do not write the 'summary' key into the results files")
    args = parser.parse_args(argv)
    out_dir = REPO / args.out_dir  # paths relative to the checkout; an absolute one replaces REPO
    paths = [REPO / path for path in args.results]
    files = {path: read_results(path) for path in paths if path.exists()}
    for missing in (p for p in paths if p not in files):
        print(f"skipped {missing}: no such file", file=sys.stderr)
    summaries: dict[pathlib.Path, dict[str, Any]] = {path: {} for path in files}
    done = 0
    for experiment in ("convergence", "heterogeneous"):
        runs, sources = {}, []
        for path, results in files.items():  # a run in a later file replaces an earlier one
            found = {k: v for k, v in results.get("runs", {}).items()
                     if v.get("experiment") == experiment}  # fmt: skip
            runs.update(found)
            sources += [path] if found else []
        for data in sorted({data_name(r) for r in runs.values()}):
            grouped = group_runs(runs, experiment, data)
            if not grouped:
                continue
            done += 1
            print(f"== {experiment}, data: {data}")
            png = out_dir / f"{experiment}_{data}.png"
            if experiment == "convergence":
                plot_convergence(grouped, png, args.smooth_tokens)
                summary = convergence_summary(grouped, args.tail)
                if summary["heldout_final_update"]:
                    print_heldout_table(summary["heldout_final_update"])
                print_final_table("convergence", summary["train_loss_final"], args.tail)
            else:
                summary = heterogeneous_summary(grouped)
                plot_heterogeneous(grouped, png, args.smooth_tokens, summary)
                print_hetero_table(summary)
            for path in sources:  # a file holding both experiments keys by experiment too
                both = len({r.get("experiment") for r in files[path].get("runs", {}).values()})
                summaries[path][f"{experiment}/{data}" if both > 1 else data] = summary
    print_spread(spread_summary({k: v for results in files.values()
                                 for k, v in results.get("runs", {}).items()}))  # fmt: skip
    for path, results in files.items():
        mine = spread_summary(results.get("runs", {}))
        if mine:
            summaries[path]["spread"] = mine
            done += 1
    if not done:
        print(f"no complete runs in {', '.join(map(str, files)) or args.results}", file=sys.stderr)
        return 1
    if not args.no_write_summary:
        for path, summary in summaries.items():
            if summary:
                write_result(path, {**files[path], "summary": summary})
                print(f"summary written into {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
