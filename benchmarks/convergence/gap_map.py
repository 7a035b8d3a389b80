"""The delay's cost per token over batch size and learning rate: ``acco`` and the schedule
``auto`` picks most, against ``ddp``, at equal tokens per update (issue 86, docs/when_acco_helps.md).

The engine's numerics depend on which micro-batches fall in which round, not on how many ranks
run them (``tests/engine/test_engine_reference.py``), so each run is one rank that runs every
micro-batch of an update: two runs fit the machine's two cores at once. Every run reads the
same corpus in its seed's order (``data.py``, sequences shuffled) and is scored on the same 512
held-out sequences. Each point is a batch (sequences of 64 tokens per update) and a learning
rate; every run of a batch has 4 micro-batches per update (``ddp``: 4 in one round; ``acco``:
2 + 2; ``acco_split_fp8``: 3 + 1 with the estimate round in float8, the split and format
``mode="auto"`` picks most), so the estimate θ̃ sees half an update's sequences, or 3/4.
``--data parts``: the same runs on the stream of 2 replicas that each read their own half of the
corpus (``data.replica_parts``: each of the rank's micro-batches is both replicas' micro-batches
of one round); ``--width``: the debug model at another width (``slow_rank.WIDE_FLAVORS``), with
its own ddp sweep.

Phases (run them in order; each skips runs already complete in ``--out``)::

    # ddp alone over a grid of learning rates, per batch: its best one
    python -m benchmarks.convergence.gap_map sweep --batches 8 32 128
    # every arm at 1x, 2x and 4x ddp's best, seeds 0 and 1 (add --seeds 2 where the gap is
    # within 3x its spread); each arm's own best: --lr-factors 0.5 0.25; the control:
    # --arms dpu --lr-factors 1
    python -m benchmarks.convergence.gap_map map --batches 8 32 128 --seeds 0 1
    # non-i.i.d. replicas at ddp's best (of its i.i.d. sweep)
    python -m benchmarks.convergence.gap_map map --data parts --lr-factors 1 --seeds 0 1
    # a wider model: its own sweep, then the map
    python -m benchmarks.convergence.gap_map sweep --width 768 --lrs 8e-4 1.6e-3 3.2e-3
    python -m benchmarks.convergence.gap_map map --width 768 --lr-factors 1 --seeds 0 1

``map`` takes ddp's best learning rate from every complete i.i.d. ddp run of the model's width
at seed 0 in ``--out``, the map's own included: where its ``ddp`` runs at 2x or 4x beat the sweep's best, the best moves,
and running ``map`` again adds the runs the new best needs (run it until it has none to add).
``--jobs 2`` runs two at once (one core each); several ``gap_map`` processes may share one
``--out`` (each run is added to the file as it is then, under a lock). Results: ``docs/results/gap_map.json`` (every
run's curves, settings and command; ``run.py``'s records), keyed
``gap/b<batch>-lr<lr>[-w<width>]/<corpus>-<order>/<arm>/seed<N>``. Wall times in it are not comparable (runs
share the machine; this map is numerics only). ``report`` tabulates the map (printed, and the
file's top-level ``"summary"``) and draws ``docs/figures/gap_map.png``: every run's final
held-out loss against the learning rate, one panel per batch, data and width.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import pathlib
import re
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.convergence import data, run
from benchmarks.convergence.plot import mean_std
from benchmarks.convergence.slow_rank import WIDE_FLAVORS
from benchmarks.harness import pyplot, save_figure, write_result

OUT = "docs/results/gap_map.json"
FIGURE = "docs/figures/gap_map.png"
SEQ_LEN = 64
HELDOUT_SEQUENCES = 512  # the same held-out sequences for every run
MICROBATCHES_PER_UPDATE = 4
# sequences per update -> (real updates per run, updates between validations, which divides
# them: torchtitan validates at multiples of it, and the last one scores the run): about as
# many tokens as the gate's runs (200 updates of 16) at the small batches, more at the large one
UPDATES = {8: (400, 50), 16: (200, 25), 32: (200, 25), 128: (100, 10)}
SWEEP_LRS = (4e-4, 8e-4, 1.6e-3, 3.2e-3, 6.4e-3)  # the gate's 8e-4 x 1/2 ... 8
MAP_ARMS = ("ddp", "acco", "acco_split_fp8")
LR_FACTORS = (1, 2, 4)
DEBUG_WIDTH = 256  # torchtitan's debugmodel
WIDTHS = (DEBUG_WIDTH, *WIDE_FLAVORS.values())
REPLICAS = 2  # --data parts: the replicas that each read their own part of the corpus
DATA = ("iid", "parts")
WARMUP = 2  # warm-up updates: the convergence gate's (the debug_cpu TOMLs')
_EXPERIMENT = re.compile(r"gap/b(?P<batch>\d+)-lr(?P<lr>[^-/]+(?:e-\d+)?)"
                         r"(?:-w(?P<width>\d+))?(?:-wu(?P<warmup>\d+))?")


@dataclasses.dataclass(frozen=True)
class Point:
    """One place on the map: sequences per update, the learning rate, the model's width and
    the warm-up updates of the learning rate schedule."""

    batch: int
    lr: float
    width: int = DEBUG_WIDTH
    warmup: int = WARMUP

    @property
    def name(self) -> str:
        wide = "" if self.width == DEBUG_WIDTH else f"-w{self.width}"
        warmup = "" if self.warmup == WARMUP else f"-wu{self.warmup}"
        return f"gap/b{self.batch}-lr{self.lr:g}{wide}{warmup}"

    @property
    def curve(self) -> tuple[int, int, int]:
        """What the points of one learning-rate curve share: batch, width, warm-up."""
        return (self.batch, self.width, self.warmup)

    @property
    def local_batch(self) -> int:
        return self.batch // MICROBATCHES_PER_UPDATE


def spec_for(point: Point, arm: str, seed: int, data_kind: str = "iid",
             corpus: str = "stdlib") -> run.RunSpec:  # fmt: skip
    """``run.py``'s settings for one run of ``arm`` at ``point`` (one rank) on ``data_kind``:
    ``"iid"`` (sequences shuffled) or ``"parts"`` (:data:`REPLICAS` replicas each on its part)."""
    if point.batch % (2 * MICROBATCHES_PER_UPDATE) or point.batch not in UPDATES:
        raise ValueError(f"batch {point.batch}: one of {sorted(UPDATES)}")
    if point.width not in WIDTHS:
        raise ValueError(f"width {point.width}: one of {WIDTHS}")
    if data_kind not in DATA:
        raise ValueError(f"data {data_kind!r}: one of {DATA}")
    updates, heldout_every = UPDATES[point.batch]
    args = argparse.Namespace(
        heterogeneous=False, batch_per_update=point.batch, nproc=1, updates=updates,
        heldout_every=heldout_every, heldout_steps=HELDOUT_SEQUENCES // point.local_batch,
        data_seed=None,
    )  # fmt: skip
    overrides = ("--training.seq_len", str(SEQ_LEN),
                 "--training.local_batch_size", str(point.local_batch),
                 "--parallelism.data_parallel_replicate_degree", "1",
                 "--optimizer.lr", f"{point.lr:g}")  # fmt: skip
    if point.width != DEBUG_WIDTH:
        overrides += ("--model.flavor", f"debugmodel_w{point.width}")
    if point.warmup != WARMUP:
        overrides += ("--lr_scheduler.warmup_steps", str(point.warmup))  # counted in updates
    # a batch is a multiple of 8: each micro-batch splits evenly between the 2 replicas
    order = ("sequences" if data_kind == "iid"
             else data.replica_parts(REPLICAS, point.local_batch // REPLICAS))  # fmt: skip
    spec = run.plan_one(args, overrides, corpus, order, seed, arm)
    return dataclasses.replace(spec, experiment=point.name)


def heldout_final(record: dict[str, Any] | None) -> float:
    if not record or not record.get("complete"):
        return math.nan
    return float(record["summary"].get("heldout_loss_final", math.nan))


def point_of(record: dict[str, Any]) -> Point:
    """The :class:`Point` a record of this map ran."""
    match = _EXPERIMENT.fullmatch(record["experiment"])
    if match is None:
        raise ValueError(f"{record['experiment']!r} is not a point of the gap map")
    return Point(int(match["batch"]), float(match["lr"]), int(match["width"] or DEBUG_WIDTH),
                 int(match["warmup"] or WARMUP))


def best_lr(results: dict[str, Any], batch: int, arm: str = "ddp", seed: int = 0,
            width: int = DEBUG_WIDTH, warmup: int = WARMUP) -> float | None:  # fmt: skip
    """The learning rate of ``arm``'s lowest final held-out loss at ``batch``, ``width`` and
    ``warmup`` on i.i.d. data among the runs in ``results``, or ``None`` if it has none there (a
    diverged run reads nan: never the best)."""
    points = {key: point_of(r) for key, r in results["runs"].items()}
    scored = [(heldout_final(r), points[key].lr) for key, r in results["runs"].items()
              if points[key].curve == (batch, width, warmup) and r["arm"] == arm
              and r["seed"] == seed and r["data_order"] == "sequences"]  # fmt: skip
    scored = [(loss, lr) for loss, lr in scored if math.isfinite(loss)]
    return min(scored)[1] if scored else None


def plan(args: argparse.Namespace, results: dict[str, Any]) -> list[run.RunSpec]:
    if args.phase == "sweep":
        return [spec_for(Point(b, lr, args.width, args.warmup), "ddp", 0) for b in args.batches
                for lr in args.lrs]  # fmt: skip
    specs = []
    for batch in args.batches:
        best = best_lr(results, batch, width=args.width)
        if best is None:
            wide = f" --width {args.width}" if args.width != DEBUG_WIDTH else ""
            raise SystemExit(f"no complete ddp sweep at batch {batch}{wide} in {args.out}: run "
                             f"the sweep phase first (sweep --batches {batch}{wide})")  # fmt: skip
        for seed in args.seeds:
            for factor in args.lr_factors:
                # another warm-up keeps the rates of the gate's: it is a control at them
                point = Point(batch, best * factor, args.width, args.warmup)
                specs += [spec_for(point, arm, seed, args.data) for arm in args.arms]
    return specs


def add_run(out: pathlib.Path, key: str, record: dict[str, Any]) -> dict[str, Any]:
    """``out`` with ``record`` added at ``key``, read and written under a lock: another process
    that runs other points of the map into the same file keeps its runs."""
    from filelock import FileLock

    with FileLock(str(out) + ".lock"):
        results = json.loads(out.read_text()) if out.exists() else {"version": 1, "runs": {}}
        results["runs"][key] = record
        write_result(out, results)
    return results


# ----------------------------------------------------------------------------- the report


def finals(results: dict[str, Any], lowest: bool = False
           ) -> dict[tuple[Point, str, str], dict[int, float]]:  # fmt: skip
    """``(point, data order, arm) -> {seed: final held-out loss}`` of the complete runs (a run
    that diverged reads nan); ``lowest``: the lowest held-out loss of the run's validations
    instead of its last (the loss of the best checkpoint, blind to a late rise)."""
    out: dict[tuple[Point, str, str], dict[int, float]] = {}
    for record in results["runs"].values():
        if record.get("complete"):
            key = (point_of(record), record["data_order"], record["arm"])
            loss = heldout_final(record)
            if lowest and math.isfinite(loss):
                loss = min(map(float, record["heldout_loss"]))
            out.setdefault(key, {})[record["seed"]] = loss
    return out


def _gap(losses: dict[int, float], reference: dict[int, float]) -> dict[str, Any]:
    """The gap of ``losses`` to ``reference`` in % of the reference, paired by seed; ``seeds``:
    how many the issue's rule asks for (3 where the mean is within 3x its spread)."""
    per_seed = {s: 100 * (losses[s] - reference[s]) / reference[s]
                for s in sorted(losses) if s in reference}  # fmt: skip
    mean, std = mean_std(list(per_seed.values()))
    wanted = 3 if len(per_seed) < 2 or not abs(mean) > 3 * std else 2
    return {"gap_pct": {str(s): g for s, g in per_seed.items()}, "gap_pct_mean": mean,
            "gap_pct_std": std, "seeds_wanted": wanted}  # fmt: skip


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Every point's arms against ``ddp`` at the same learning rate (``points``; ``lowest_gap``:
    the same for the runs' lowest held-out losses), and every arm
    at its own best learning rate against ``ddp`` at its own (``own_best``: among the rates run
    on 2 or more seeds, the lowest mean over the seeds all of them ran; the gap paired by
    seed)."""
    table, lowest = finals(results), finals(results, lowest=True)
    points = []
    for (point, order, arm), losses in sorted(table.items(), key=lambda kv: (
            kv[0][0].width, kv[0][0].warmup, kv[0][1], kv[0][0].batch, kv[0][0].lr,
            MAP_ARMS.index(kv[0][2]) if kv[0][2] in MAP_ARMS else 9)):  # fmt: skip
        best = best_lr(results, point.batch, width=point.width)
        row = {"batch": point.batch, "lr": point.lr, "width": point.width,
               "warmup": point.warmup, "data": order,
               "arm": arm, "lr_factor": point.lr / best if best else None,
               "loss": {str(s): v for s, v in sorted(losses.items())}}  # fmt: skip
        row["lowest"] = {str(s): v for s, v in sorted(lowest[(point, order, arm)].items())}
        if arm != "ddp" and (point, order, "ddp") in table:
            row |= _gap(losses, table[(point, order, "ddp")])
            row["lowest_gap"] = _gap(lowest[(point, order, arm)], lowest[(point, order, "ddp")])
        points.append(row)
    own_best = []
    for curve, order in sorted({(p.curve, o) for p, o, _ in table}):
        best: dict[str, tuple[float, dict[int, float]]] = {}  # arm -> (lr, losses)
        for arm in {a for p, o, a in table if (p.curve, o) == (curve, order)}:
            candidates = {p.lr: losses for (p, o, a), losses in table.items()
                          if (p.curve, o, a) == (curve, order, arm) and len(losses) >= 2}
            # compared on the seeds every candidate ran: a third seed must not decide it
            common = set.intersection(*(set(v) for v in candidates.values())) if candidates else ()
            means = {lr: mean_std([v[s] for s in common])[0] for lr, v in candidates.items()}
            means = {lr: m for lr, m in means.items() if math.isfinite(m)}
            if means:
                lr = min(means, key=means.get)
                best[arm] = (lr, candidates[lr])
        if "ddp" not in best:
            continue
        for arm, (lr, losses) in best.items():
            row = {"batch": curve[0], "width": curve[1], "warmup": curve[2], "data": order,
                   "arm": arm, "lr": lr, "ddp_lr": best["ddp"][0],
                   "loss": {str(s): v for s, v in losses.items()}}  # fmt: skip
            if arm != "ddp":
                row |= _gap(losses, best["ddp"][1])
            own_best.append(row)
    return {"points": points, "own_best": own_best}


def _fmt_gap(row: dict[str, Any]) -> str:
    if "gap_pct_mean" not in row:
        return ""
    per_seed = ", ".join(f"{g:+.2f}" for g in row["gap_pct"].values())
    spread = "" if len(row["gap_pct"]) < 2 else f" ± {row['gap_pct_std']:.2f}"
    return f"{row['gap_pct_mean']:+.2f}{spread} % ({per_seed})"


def print_summary(summary: dict[str, Any]) -> None:
    print("| batch | data | width | warm-up | lr (x ddp's best) | arm | final held-out loss per "
          "seed | gap to ddp, mean ± std (per seed) | seeds the rule wants | the same for the "
          "lowest held-out loss of each run |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in summary["points"]:
        factor = f" ({row['lr_factor']:g}x)" if row["lr_factor"] else ""
        losses = " / ".join(f"{v:.4f}" for v in row["loss"].values())
        wanted = row.get("seeds_wanted", "")
        print(f"| {row['batch']} | {row['data']} | {row['width']} | {row['warmup']} | "
              f"{row['lr']:g}{factor} | "
              f"{row['arm']} | {losses} | {_fmt_gap(row)} | {wanted} | "
              f"{_fmt_gap(row.get('lowest_gap', {}))} |")
    print("\neach arm at its own best learning rate (lowest mean over >= 2 seeds):")
    for row in summary["own_best"]:
        print(f"  b{row['batch']} {row['data']} w{row['width']} wu{row['warmup']} {row['arm']}: "
              f"lr {row['lr']:g} "
              f"(ddp {row['ddp_lr']:g}) {_fmt_gap(row)}")


def plot(results: dict[str, Any], path: pathlib.Path) -> None:
    """Every run's final held-out loss against the learning rate, one panel per batch, data
    and width; a line through each arm's mean over its seeds."""
    plt = pyplot()
    from matplotlib.ticker import NullFormatter

    table = finals(results)
    # the i.i.d. debug model's batches first, then the non-i.i.d., warm-up and width points
    panels = sorted({(p.curve, o) for p, o, _ in table},
                    key=lambda c: (c[0][1], c[0][2], c[1] != "sequences", c[0][0]))  # fmt: skip
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.8 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    colors = {"ddp": "#264653", "acco": "#e76f51", "acco_split_fp8": "#e9c46a", "dpu": "#2a9d8f"}
    for ax, (curve, order) in zip(axes.flat, panels):
        batch, width, warmup = curve
        for arm in sorted({a for p, o, a in table}, key=lambda a: (a not in MAP_ARMS, a)):
            runs = sorted((p.lr, losses) for (p, o, a), losses in table.items()
                          if (p.curve, o, a) == (curve, order, arm))  # fmt: skip
            if not runs:
                continue
            color = colors.get(arm, "gray")
            for lr, losses in runs:
                finite = [v for v in losses.values() if math.isfinite(v)]
                ax.scatter([lr] * len(finite), finite, s=14, color=color, alpha=0.6)
            means = [(lr, mean_std(list(losses.values()))[0]) for lr, losses in runs]
            ax.plot(*zip(*means), color=color, label=arm, marker="_")
        best = best_lr(results, batch, width=width)
        if best:
            ax.axvline(best, color="gray", lw=0.6, ls=":")
        data_name = "i.i.d." if order == "sequences" else "non-i.i.d."
        ax.set(xscale="log", xlabel="learning rate (dotted: ddp's best)",
               ylabel="final held-out loss",
               title=f"{batch} seq/update, {data_name}, w{width}, warm-up {warmup}")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.convergence.gap_map",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("phase", choices=("sweep", "map", "report"))
    add("--batches", nargs="+", type=int, default=[32], help="sequences per update")
    add("--lrs", nargs="+", type=float, default=list(SWEEP_LRS), help="sweep: ddp's grid")
    add("--lr-factors", nargs="+", type=float, default=list(LR_FACTORS),
        help="map: multiples of ddp's best learning rate at the batch")
    add("--arms", nargs="+", default=list(MAP_ARMS), choices=[*run.MODES, *run.SCHEDULE_ARMS])
    add("--seeds", nargs="+", type=int, default=[0, 1])
    add("--data", choices=DATA, default="iid",
        help="map: i.i.d. sequences, or 2 replicas that each read their own half of the corpus")
    add("--width", type=int, choices=WIDTHS, default=DEBUG_WIDTH,
        help="the model's width (the debug model's: 256)")
    add("--warmup", type=int, default=WARMUP,
        help="warm-up updates (a control: map takes ddp's best rate of the gate's warm-up)")
    add("--jobs", type=int, default=2, help="runs at once (one rank, one core each)")
    add("--out", default=OUT)
    add("--workdir", default="outputs/gap_map")
    add("--print-every", type=int, default=0)
    add("--figure", default=FIGURE, help="report: the figure")
    args = parser.parse_args(argv)
    if args.phase == "sweep" and args.data != "iid":
        parser.error("--data parts is for the map: its learning rates come from ddp's i.i.d. sweep")
    out = run.REPO / args.out
    args.workdir = str(run.REPO / args.workdir)
    args.nproc = 1
    results = json.loads(out.read_text()) if out.exists() else {"version": 1, "runs": {}}
    if args.phase == "report":
        results["summary"] = summarize(results)
        print_summary(results["summary"])
        plot(results, run.REPO / args.figure)
        write_result(out, results)
        return 0
    todo = []
    for spec in plan(args, results):
        old = results["runs"].get(spec.key)
        if old and old.get("complete") and run.same_settings(old, spec):
            continue
        if spec not in todo:
            todo.append(spec)
    print(f"{len(todo)} runs to go", flush=True)
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        running = {pool.submit(run.run_one, spec, args): spec for spec in todo}
        for future in concurrent.futures.as_completed(running):
            spec, record = running[future], future.result()
            results = add_run(out, spec.key, record)
            failed += not record["complete"]
            print(f"{spec.key}: complete={record['complete']} held-out "
                  f"{heldout_final(record):.4f} ({record['wall_s']:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
