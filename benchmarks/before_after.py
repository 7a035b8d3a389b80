"""Does a change cost anything? The same torchtitan ACCO job from two checkouts, alternated.

    git worktree add /tmp/before <commit>               # the code before the change
    sudo python -m benchmarks.before_after --before /tmp/before --after . \\
        --out docs/results/regression_<what-changed>.json

Each repeat runs every mode (``acco``, ``dpu``, ``ddp``) from each checkout, the two checkouts
in alternating order (before first in even repeats, after first in odd ones), so that drift of
the machine over the run hits both alike. A run is ``benchmarks.throughput``'s: two ranks, one
per network namespace and per core (``benchmarks/netbed.py``), torchtitan's llama3 debug model
through that checkout's ``train_titan.py`` and job configs, ``--microbatches`` micro-batches of
4 x 128 tokens per round; its figure is the median round time over steps >= 3.

Reported per cap and mode: every run's round time, the median of each checkout, and
after/before, the ratio of the medians, next to the spread of each checkout's own repeats (the
noise a ratio has to clear).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

from benchmarks.harness import LOCAL_BATCH, SEQ_LEN, header, write_result
from benchmarks.throughput import MODEL, titan_on_link

MODES = ("acco", "dpu", "ddp")


def measure(args: argparse.Namespace) -> dict:
    from benchmarks.netbed import two_host_link

    trees = {name: pathlib.Path(path).resolve()
             for name, path in (("before", args.before), ("after", args.after))}  # fmt: skip
    k = args.microbatches
    results: dict = {
        "what": args.what, **header(), "model": MODEL,
        "trees": {name: str(path) for name, path in trees.items()},
        "microbatches_per_round": k, "local_batch": LOCAL_BATCH, "seq_len": SEQ_LEN,
        "rounds": args.rounds, "repeats": args.repeats, "rates": {},
    }  # fmt: skip
    with two_host_link() as link:
        for rate in args.rates:
            link.set_rate(rate)
            runs: dict = {mode: {"before": [], "after": []} for mode in MODES}
            for repeat in range(args.repeats):
                order = ("before", "after") if repeat % 2 == 0 else ("after", "before")
                for tree in order:
                    for mode in MODES:
                        round_s = titan_on_link(link, mode, args.rounds, k,
                                                f"/tmp/acco_bench/{tree}_{mode}",
                                                root=trees[tree])[0]["round_s"]  # fmt: skip
                        runs[mode][tree].append(round_s)
                        print(f"{rate:>8} repeat {repeat} {tree:>6} {mode}: {round_s:.4f} s/round",
                              flush=True)  # fmt: skip
            row = {}
            for mode, by_tree in runs.items():
                medians = {tree: statistics.median(times) for tree, times in by_tree.items()}
                row[mode] = {
                    "round_s": by_tree,
                    "median_round_s": medians,
                    "after_over_before": medians["after"] / medians["before"],
                    "spread_of_repeats": {tree: (max(t) - min(t)) / statistics.median(t)
                                          for tree, t in by_tree.items()},
                }  # fmt: skip
                print(f"{rate:>8} {mode}: after/before {row[mode]['after_over_before']:.3f} "
                      f"(spread of repeats: before {row[mode]['spread_of_repeats']['before']:.1%},"
                      f" after {row[mode]['spread_of_repeats']['after']:.1%})", flush=True)
            results["rates"][rate] = row
            write_result(args.out, results)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)  # fmt: skip
    parser.add_argument("--before", required=True, help="checkout of the code before the change")
    parser.add_argument("--after", required=True, help="checkout of the code after the change")
    parser.add_argument("--what", default="", help="the change, in words (kept in the file)")
    parser.add_argument("--out", required=True, help="the result file (JSON)")
    parser.add_argument("--rates", default="none,200mbit", help="comma-separated tbf caps")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    args.rates = args.rates.split(",")
    measure(args)


if __name__ == "__main__":
    sys.exit(main())
