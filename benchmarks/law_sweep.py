"""ACCO's per-token speedup against the law, swept over C/K on a capped link.

    sudo python -m benchmarks.law_sweep                   # ~20 min on 2 cores
    python -m benchmarks.law_sweep --plot-only            # redraw from the JSON
    python -m benchmarks.law_sweep --plot-only --out docs/results/law_sweep.json  # the published

acco with k micro-batches per round against the engine's ``ddp`` with 2k per update, torchtitan
runs on the netbed as in ``benchmarks.throughput``, each cap ``--repeats`` times, next to the
law and the engine's own ``acco advisor:`` prediction (docs/results.md, section 0). Writes
``outputs/results/law_sweep.json`` and ``law_sweep.png`` beside it (``--out``; the published
files, ``docs/results/law_sweep.json`` and ``docs/figures/law_sweep.png``: ``--out
docs/results/law_sweep.json``).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics

from benchmarks import throughput
from benchmarks.harness import (
    LOCAL_BATCH,
    SEQ_LEN,
    add_out_option,
    figure_file,
    header,
    pyplot,
    save_figure,
)
from benchmarks.throughput import MODEL, comm_only_s, compute_only_round_s, titan_on_link

ADVISOR = re.compile(r"acco advisor: compute_per_round=([\d.]+)s comm_per_round=([\d.]+)s "
                     r"predicted_speedup=([\d.]+) round=([\d.]+)s "
                     r"ideal_speedup=([\d.]+)")  # fmt: skip
ADVISOR_KEYS = ("compute_per_round_s", "comm_per_round_s", "predicted_speedup", "round_s",
                "ideal_speedup")  # fmt: skip


def measure(args: argparse.Namespace) -> dict:
    from acco_hooks.engine.advisor import predicted_speedup

    k = args.microbatches
    results: dict = {
        **header(), "model": MODEL, "k": k,
        "local_batch": LOCAL_BATCH, "seq_len": SEQ_LEN, "rounds": args.rounds,
        "repeats": args.repeats, "rates": {},
    }  # fmt: skip
    compute = results["compute_K_s"] = compute_only_round_s(args.rounds, k)
    print(f"K (compute of {k} micro-batches): {compute:.3f} s", flush=True)

    def row_at(link, rate: str) -> dict:
        comm = statistics.median(comm_only_s(link)["comm_s"])
        row: dict = {"comm_C_s": comm, "C_over_K": comm / compute,
                     "law_S": predicted_speedup(compute, comm),
                     "acco_round_s": [], "ddp_round_s": [], "measured_S": [],
                     "advisor": []}  # fmt: skip
        for repeat in range(args.repeats):
            times = {}
            for mode, micro in (("acco", k), ("ddp", 2 * k)):
                steps, out = titan_on_link(link, mode, args.rounds, micro, f"/tmp/acco_law/{mode}")
                times[mode] = steps["round_s"]
                if mode == "acco" and (found := ADVISOR.search(out)):
                    row["advisor"].append(dict(zip(ADVISOR_KEYS, map(float, found.groups()))))
            row["acco_round_s"].append(times["acco"])
            row["ddp_round_s"].append(times["ddp"])
            row["measured_S"].append(times["ddp"] / (2 * times["acco"]))
            print(f"{rate:>8} run {repeat}: acco(k={k}) {times['acco']:.3f} s/round, "
                  f"ddp(2k) {times['ddp']:.3f} s/update -> S={row['measured_S'][-1]:.3f} "
                  f"(law {row['law_S']:.3f} at C/K={row['C_over_K']:.2f})", flush=True)  # fmt: skip
        row["measured_S_mean"] = statistics.fmean(row["measured_S"])
        row["measured_S_std"] = statistics.stdev(row["measured_S"]) if args.repeats > 1 else 0.0
        row["of_law"] = row["measured_S_mean"] / row["law_S"]
        # The advisor's prediction (made inside the acco run) against the S measured with it
        pairs = zip(row["advisor"], row["measured_S"])
        row["advisor_error"] = [a["predicted_speedup"] / measured - 1 for a, measured in pairs]
        return row

    return throughput.over_caps(args.rates, results, args.out, row_at)


def plot(results: dict, figure) -> None:
    plt = pyplot()
    rows = sorted(results["rates"].items(), key=lambda item: item[1]["C_over_K"])
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    grid = [i / 100 for i in range(501)]
    ax.plot(grid, [(2 + x) / (2 * max(1.0, x)) for x in grid], "k-", linewidth=1,
            label="law (2K + C) / (2 max(K, C))")  # fmt: skip
    for rate, row in rows:
        ax.scatter([row["C_over_K"]] * len(row["measured_S"]), row["measured_S"], s=12,
                   color="tab:blue", alpha=0.5)  # fmt: skip
        ax.errorbar(row["C_over_K"], row["measured_S_mean"], yerr=row["measured_S_std"], fmt="o",
                    color="tab:blue", capsize=3)  # fmt: skip
        ax.annotate(rate, (row["C_over_K"], row["measured_S_mean"]), fontsize=7,
                    textcoords="offset points", xytext=(4, 4))  # fmt: skip
    ax.scatter([], [], s=12, color="tab:blue", alpha=0.5, label="each run")
    ax.errorbar([], [], yerr=[], fmt="o", color="tab:blue", label="mean ± std")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xlabel("C / K (one round's communication / one round's compute)")
    ax.set_ylabel("per-token speedup S of acco(k) over ddp(2k)")
    ax.set_title(f"{results['model']}, 2 ranks, k = {results['k']}, netbed caps", fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, figure)


def main() -> None:
    parser = throughput.netbed_parser(__doc__, "1400mbit,670mbit,340mbit,170mbit,85mbit",
                           "tbf caps, chosen for C/K about 0.25, 0.5, 1, 2, 4 at k = 4", repeats=3)
    parser.add_argument("--plot-only", action="store_true", help="redraw from --out")
    add_out_option(parser, "law_sweep")
    args = parser.parse_args()
    results = json.loads(args.out.read_text()) if args.plot_only else measure(args)
    for rate, row in results["rates"].items():
        advised = [a["predicted_speedup"] for a in row["advisor"]]
        worst = max((abs(e) for e in row.get("advisor_error", [])), default=float("nan"))
        advisor = statistics.fmean(advised) if advised else float("nan")
        print(f"{rate:>9}: C/K={row['C_over_K']:.2f} law S={row['law_S']:.3f} measured "
              f"{row['measured_S_mean']:.3f} ± {row['measured_S_std']:.3f} "
              f"({row['of_law']:.0%} of the law); advisor {advisor:.3f} "
              f"(worst run {worst:.1%} off; target within 10 %)")  # fmt: skip
    plot(results, figure_file(args.out, "law_sweep"))
    if not args.plot_only:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
