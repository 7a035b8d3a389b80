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

Phases (run them in order; each skips runs already complete in ``--out``)::

    # ddp alone over a grid of learning rates, per batch: its best one
    python -m benchmarks.convergence.gap_map sweep --batches 8 32 128
    # every arm at 1x, 2x and 4x ddp's best, seeds 0 and 1 (add --seeds 2 where the gap is
    # within 3x its spread)
    python -m benchmarks.convergence.gap_map map --batches 8 32 128 --seeds 0 1

``map`` takes ddp's best learning rate from every complete ddp run at seed 0 in ``--out``, the
map's own included: where its ``ddp`` runs at 2x or 4x beat the sweep's best, the best moves,
and running ``map`` again adds the runs the new best needs (run it until it has none to add).
``--jobs 2`` runs two at once (one core each). Results: ``docs/results/gap_map.json`` (every
run's curves, settings and command; ``run.py``'s records), keyed
``gap/b<batch>-lr<lr>/<data>/<arm>/seed<N>``. Wall times in it are not comparable (runs
share the machine; this map is numerics only). ``plot.py`` draws and tabulates the map.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.convergence import run
from benchmarks.harness import write_result

OUT = "docs/results/gap_map.json"
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


@dataclasses.dataclass(frozen=True)
class Point:
    """One place on the map: sequences per update and the learning rate."""

    batch: int
    lr: float

    @property
    def name(self) -> str:
        return f"gap/b{self.batch}-lr{self.lr:g}"

    @property
    def local_batch(self) -> int:
        return self.batch // MICROBATCHES_PER_UPDATE


def spec_for(point: Point, arm: str, seed: int, corpus: str = "stdlib") -> run.RunSpec:
    """``run.py``'s settings for one run of ``arm`` at ``point`` (one rank)."""
    if point.batch % (2 * MICROBATCHES_PER_UPDATE) or point.batch not in UPDATES:
        raise ValueError(f"batch {point.batch}: one of {sorted(UPDATES)}")
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
    spec = run.plan_one(args, overrides, corpus, "sequences", seed, arm)
    return dataclasses.replace(spec, experiment=point.name)


def heldout_final(record: dict[str, Any] | None) -> float:
    if not record or not record.get("complete"):
        return math.nan
    return float(record["summary"].get("heldout_loss_final", math.nan))


def best_lr(results: dict[str, Any], batch: int, arm: str = "ddp", seed: int = 0) -> float | None:
    """The learning rate of ``arm``'s lowest final held-out loss at ``batch`` among the runs in
    ``results``, or ``None`` if it has none there (a diverged run reads nan: never the best)."""
    scored = [(heldout_final(r), float(r["overrides"][r["overrides"].index("--optimizer.lr") + 1]))
              for r in results["runs"].values()
              if r["experiment"].startswith(f"gap/b{batch}-") and r["arm"] == arm
              and r["seed"] == seed]  # fmt: skip
    scored = [(loss, lr) for loss, lr in scored if math.isfinite(loss)]
    return min(scored)[1] if scored else None


def plan(args: argparse.Namespace, results: dict[str, Any]) -> list[run.RunSpec]:
    if args.phase == "sweep":
        return [spec_for(Point(b, lr), "ddp", 0) for b in args.batches for lr in args.lrs]
    specs = []
    for batch in args.batches:
        best = best_lr(results, batch)
        if best is None:
            raise SystemExit(f"no complete ddp sweep at batch {batch} in {args.out}: run the "
                             "sweep phase first")  # fmt: skip
        for seed in args.seeds:
            for factor in args.lr_factors:
                specs += [spec_for(Point(batch, best * factor), arm, seed) for arm in args.arms]
    return specs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.convergence.gap_map",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("phase", choices=("sweep", "map"))
    add("--batches", nargs="+", type=int, default=[32], help="sequences per update")
    add("--lrs", nargs="+", type=float, default=list(SWEEP_LRS), help="sweep: ddp's grid")
    add("--lr-factors", nargs="+", type=float, default=list(LR_FACTORS),
        help="map: multiples of ddp's best learning rate at the batch")
    add("--arms", nargs="+", default=list(MAP_ARMS), choices=[*run.MODES, *run.SCHEDULE_ARMS])
    add("--seeds", nargs="+", type=int, default=[0, 1])
    add("--jobs", type=int, default=2, help="runs at once (one rank, one core each)")
    add("--out", default=OUT)
    add("--workdir", default="outputs/gap_map")
    add("--print-every", type=int, default=0)
    args = parser.parse_args(argv)
    out = run.REPO / args.out
    args.workdir = str(run.REPO / args.workdir)
    args.nproc = 1
    results = json.loads(out.read_text()) if out.exists() else {"version": 1, "runs": {}}
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
            results["runs"][spec.key] = record
            write_result(out, results)
            failed += not record["complete"]
            print(f"{spec.key}: complete={record['complete']} held-out "
                  f"{heldout_final(record):.4f} ({record['wall_s']:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
