"""Per-token throughput of ACCO against the synchronous baselines users run, on a capped link.

    sudo python -m benchmarks.throughput                  # ~20 min on 2 cores
    python -m benchmarks.throughput --plot-only           # redraw from the JSON
    python -m benchmarks.throughput --plot-only --out docs/results/throughput.json  # the published

torchtitan's llama3 debug model on the netbed, every arm at equal tokens per update (the arms,
S and E: docs/results.md, section 1); also the plumbing that ``benchmarks.law_sweep`` and
``benchmarks.before_after`` share. Writes ``outputs/results/throughput.json`` and
``throughput.png`` beside it (``--out``; the published files, ``docs/results/throughput.json``
and ``docs/figures/throughput.png``: ``--out docs/results/throughput.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from benchmarks import harness
from benchmarks.harness import LOCAL_BATCH, SEQ_LEN, parse_steps, run_on_link, titan_args

# An ACCO update spans two rounds of k micro-batches; every other arm makes it in one step of 2k.
MODES = {  # name -> (config, extra overrides, micro-batches per step in units of k)
    "acco": ("debug_cpu_acco.toml", ("--acco.mode", "acco"), 1),
    "dpu": ("debug_cpu_acco.toml", ("--acco.mode", "dpu"), 2),
    "ddp": ("debug_cpu_acco.toml", ("--acco.mode", "ddp"), 2),
    "titan_ddp_no_sync": ("debug_cpu_titan_ddp.toml",
                          ("--experimental.custom_import", "benchmarks.titan_no_sync"), 2),
    "titan_ddp": ("debug_cpu_titan_ddp.toml", (), 2),
    "titan_fsdp": ("debug_cpu_titan_fsdp.toml", (), 2),
}
PER_MICROBATCH_SYNC = ("titan_ddp", "titan_fsdp")  # communicate on every micro-batch
BASELINES = ("ddp", "titan_ddp_no_sync", "titan_ddp", "titan_fsdp", "dpu")
MODEL = "torchtitan llama3 debugmodel (6.16M parameters)"


def compute_only_round_s(rounds: int, microbatches: int) -> float:
    """Median round time of one process on core 0 with no communication at all."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29641", "OMP_NUM_THREADS": "1"}  # fmt: skip
    cmd = ["taskset", "-c", "0", *titan_args(
        "debug_cpu_titan_ddp.toml", ("--parallelism.data_parallel_replicate_degree", "1"),
        rounds, microbatches, 1, "/tmp/acco_bench/compute")]  # fmt: skip
    output = harness.run(cmd, env=env)
    return parse_steps(output, LOCAL_BATCH * SEQ_LEN * microbatches)["round_s"]


def comm_only_s(link) -> dict:
    """``benchmarks.comm_only`` on the link as it is capped now: its RESULT."""
    argv = [sys.executable, "-m", "benchmarks.comm_only", "--rounds", "5"]
    return harness.result_lines(run_on_link(link, argv, timeout_s=900))[-1]


def titan_on_link(link, mode: str, steps: int, microbatches: int, dump: str,
                  **kw) -> tuple[dict, str]:  # fmt: skip
    """A torchtitan run of ``mode`` (of :data:`MODES`) on the link: its step times
    (:func:`parse_steps`) and rank 0's output."""
    config, extra, _ = MODES[mode]
    output = run_on_link(link, titan_args(config, extra, steps, microbatches, 2, dump, **kw))
    return parse_steps(output, LOCAL_BATCH * SEQ_LEN * microbatches), output


def over_caps(rates: list[str], results: dict, path, row_at) -> dict:
    """``results["rates"][rate] = row_at(link, rate)`` for each cap on the netbed, the file
    rewritten after every cap, so that a later failure keeps what was measured."""
    from benchmarks.netbed import two_host_link

    with two_host_link() as link:
        for rate in rates:
            link.set_rate(rate)
            results["rates"][rate] = row_at(link, rate)
            harness.write_result(path, results)
    return results


def comma_list(text: str) -> list[str]:
    return text.split(",")


def netbed_parser(description: str, rates: str, rates_help: str,
                  repeats: int) -> argparse.ArgumentParser:  # fmt: skip
    """The options the torchtitan netbed benchmarks share."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawTextHelpFormatter)  # fmt: skip
    parser.add_argument("--rates", type=comma_list, default=rates, help=rates_help)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4,
                        help="micro-batches per round per rank")  # fmt: skip
    if repeats:
        parser.add_argument("--repeats", type=int, default=repeats, help="runs per cap")
    return parser


def measure(args: argparse.Namespace) -> dict:
    k = args.microbatches
    tokens = 2 * k * LOCAL_BATCH * SEQ_LEN  # per update and rank
    results: dict = {
        **harness.header(), "model": MODEL,
        "microbatches_per_round": k, "microbatches_per_update": 2 * k,
        "local_batch": LOCAL_BATCH, "seq_len": SEQ_LEN, "rounds": args.rounds,
        "tokens_per_update_per_rank": tokens, "rates": {},
    }  # fmt: skip
    compute = results["compute_only_s"] = compute_only_round_s(args.rounds, k)
    print(f"compute only: {compute:.3f} s per {k} micro-batches", flush=True)

    def row_at(link, rate: str) -> dict:
        comm = comm_only_s(link)
        row: dict = {"comm_only_s": statistics.median(comm["comm_s"]),
                     "engine_memory_bytes": comm["memory_bytes"]}  # fmt: skip
        for mode, (_, _, units) in MODES.items():
            if mode in PER_MICROBATCH_SYNC and rate not in args.per_microbatch_rates:
                continue
            # the 2k arms: half as many steps, each twice as long
            steps = args.rounds if units == 1 else max(4, args.rounds // 2 + 1)
            dump = f"/tmp/acco_bench/{mode}"
            run = row[mode] = titan_on_link(link, mode, steps, units * k, dump)[0]
            run["microbatches_per_step"] = units * k
            run["update_s"] = run["round_s"] * (2 // units)
            run["tokens_per_s"] = 2 * tokens / run["update_s"]
            print(f"{rate:>8} {mode:>18}: {run['update_s']:.3f} s/update", flush=True)
        acco = row["acco"]
        row["overlap_efficiency_E"] = max(compute, row["comm_only_s"]) / acco["round_s"]
        row["speedup_per_token"] = {b: row[b]["update_s"] / acco["update_s"]
                                    for b in BASELINES if b in row}  # fmt: skip
        shown = " ".join(f"{b}={v:.2f}" for b, v in row["speedup_per_token"].items())
        print(f"{rate:>8}: compute {compute:.3f} comm {row['comm_only_s']:.3f} "
              f"E={row['overlap_efficiency_E']:.3f} per-token S over {shown}",
              flush=True)  # fmt: skip
        return row

    return over_caps(args.rates, results, args.out, row_at)


def plot(results: dict, figure) -> None:
    plt = harness.pyplot()
    rates = list(results["rates"])
    modes = [m for m in MODES if any(m in results["rates"][r] for r in rates)]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12.5, 4.4), gridspec_kw={"width_ratios": [3, 1.6]})
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        rows = [(x, results["rates"][r][mode]) for x, r in enumerate(rates)
                if mode in results["rates"][r]]  # fmt: skip
        scale = [row["update_s"] / row["round_s"] for _, row in rows]  # 2 for acco's two rounds
        medians = [row["update_s"] for _, row in rows]
        spread = [[m - f * min(row["round_s_all"]) for m, f, (_, row) in zip(medians, scale, rows)],
                  [f * max(row["round_s_all"]) - m
                   for m, f, (_, row) in zip(medians, scale, rows)]]  # fmt: skip
        ax.bar([x + i * width for x, _ in rows], medians, width, yerr=spread, capsize=2, label=mode)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rates))], [f"cap {r}" for r in rates])
    ax.set_ylabel(f"s per update ({results['microbatches_per_update']} micro-batches per rank)")
    ax.set_title(f"{results['model']}, 2 ranks, equal tokens per update (acco: 2 rounds of "
                 f"{results['microbatches_per_round']})\nbars: median step time; whiskers: "
                 "fastest and slowest measured step", fontsize=9)  # fmt: skip
    ax.legend(fontsize=8)
    for baseline in BASELINES:
        xs = [x for x, r in enumerate(rates)
              if baseline in results["rates"][r]["speedup_per_token"]]  # fmt: skip
        ys = [results["rates"][rates[x]]["speedup_per_token"][baseline] for x in xs]
        ax2.plot(xs, ys, "o-", label=f"over {baseline}")
    ax2.axhline(1.0, color="gray", linewidth=0.8)
    ax2.set_xticks(range(len(rates)), rates)
    ax2.set_xlabel("link cap per host")
    ax2.set_ylabel("per-token speedup of acco")
    ax2.set_title("S = T_update(baseline) / T_update(acco)\n(> 1: acco is faster per token)",
                  fontsize=9)  # fmt: skip
    ax2.legend(fontsize=7)
    harness.save_figure(fig, figure)


def main() -> None:
    parser = netbed_parser(__doc__, "none,1gbit,200mbit,50mbit",
                           "comma-separated tbf caps per host (none = no cap)",
                           repeats=0)  # fmt: skip
    parser.add_argument("--per-microbatch-rates", type=comma_list, default="none,1gbit,200mbit",
                        help="caps at which titan_ddp and titan_fsdp also run")
    parser.add_argument("--plot-only", action="store_true", help="redraw from --out")
    harness.add_out_option(parser, "throughput")
    args = parser.parse_args()
    results = json.loads(args.out.read_text()) if args.plot_only else measure(args)
    plot(results, harness.figure_file(args.out, "throughput"))
    if not args.plot_only:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
