"""Does a change cost anything? The same torchtitan ACCO job from two checkouts, alternated.

    git worktree add /tmp/before <commit>               # the code before the change
    sudo python -m benchmarks.before_after --before /tmp/before --after . \\
        --out docs/results/regression_<what-changed>.json

Each repeat runs ``acco``, ``dpu`` and ``ddp`` from each checkout on the netbed, the checkouts in
alternating order; per cap and mode, after/before of the median round times beside the spread
of each checkout's repeats (docs/results.md, section 7).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import subprocess
import sys

from benchmarks.harness import LOCAL_BATCH, SEQ_LEN, header
from benchmarks.throughput import MODEL, netbed_parser, over_caps, titan_on_link

MODES = ("acco", "dpu", "ddp")


def _commit(tree: pathlib.Path) -> str:
    """The commit a checkout is at, with "+changes" where its work tree differs from it."""
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    return head + ("+changes" if dirty else "")


def measure(args: argparse.Namespace) -> dict:
    trees = {name: pathlib.Path(path).resolve()
             for name, path in (("before", args.before), ("after", args.after))}  # fmt: skip
    k = args.microbatches
    results: dict = {
        "what": args.what, **header(), "model": MODEL,
        "trees": {name: str(path) for name, path in trees.items()},
        "commits": {name: _commit(path) for name, path in trees.items()},
        "microbatches_per_round": k, "local_batch": LOCAL_BATCH, "seq_len": SEQ_LEN,
        "rounds": args.rounds, "repeats": args.repeats, "rates": {},
    }  # fmt: skip

    def row_at(link, rate: str) -> dict:
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
            spread = {tree: (max(t) - min(t)) / statistics.median(t) for tree, t in by_tree.items()}
            row[mode] = {"round_s": by_tree, "median_round_s": medians,
                         "after_over_before": medians["after"] / medians["before"],
                         "spread_of_repeats": spread}  # fmt: skip
            print(f"{rate:>8} {mode}: after/before {row[mode]['after_over_before']:.3f} (spread "
                  f"of repeats: before {spread['before']:.1%}, after {spread['after']:.1%})",
                  flush=True)  # fmt: skip
        return row

    return over_caps(args.rates, results, args.out, row_at)


def main() -> None:
    parser = netbed_parser(__doc__, "none,200mbit", "comma-separated tbf caps", repeats=4)
    parser.add_argument("--before", required=True, help="checkout of the code before the change")
    parser.add_argument("--after", required=True, help="checkout of the code after the change")
    parser.add_argument("--what", default="", help="the change, in words (kept in the file)")
    parser.add_argument("--out", required=True, help="the result file (JSON)")
    args = parser.parse_args()
    measure(args)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
