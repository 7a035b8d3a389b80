"""Per-token throughput of ACCO against the synchronous baselines users run, on a capped link.

    sudo python -m benchmarks.throughput                  # ~20 min on 2 cores
    python -m benchmarks.throughput --plot-only           # redraw from the JSON

Two ranks, one per network namespace and per core, joined by a veth pair capped with tbf
(``benchmarks/netbed.py``). Every run trains torchtitan's llama3 debug model (6.2M parameters)
through ``train_titan.py`` on the embedded data, local batch 4 x 128 tokens per micro-batch.

**Per token, at equal tokens per optimizer update.** An ACCO update spans two rounds of k
micro-batches per rank (``--microbatches``); every other arm makes one update of 2k
micro-batches per rank in one step:

- ``acco`` (k per round; its update time is two rounds), and ``dpu`` (2k per round: the
  delayed update spans one round);
- ``ddp``: the engine's synchronous ZeRO-1, the same collectives as acco, waited for;
- ``titan_ddp``: torchtitan's own DDP with its gradient accumulation, which all-reduces every
  micro-batch;
- ``titan_ddp_no_sync``: the same DDP, synchronising only the update's last micro-batch
  (``no_sync`` accumulation, ``benchmarks/titan_no_sync.py``), as a hand-written loop does;
- ``titan_fsdp``: torchtitan's FSDP2 (reduce-scatter per micro-batch, all-gather per forward
  and backward).

The time per update is the median over steps >= 3 of torchtitan's own per-step time (tokens
per rank / its ``tps``), times two for acco. Arms that communicate every micro-batch are run
only at the caps in ``--per-microbatch-rates`` (at 50 Mbit/s they take over a minute per
update). Also measured: compute only (one process, k micro-batches, no communication) and
communication only (``benchmarks/comm_only.py``: one engine round end, no compute).

Reported per cap: per-token speedup S = T_baseline(update) / T_acco(update) for every
baseline, and ACCO's overlap efficiency E = max(compute, comm) / acco round time (per round,
1.0 is the physical limit).

Writes ``docs/results/throughput.json`` and ``docs/figures/throughput.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from benchmarks.harness import (
    FIGURES,
    LOCAL_BATCH,
    RESULTS,
    SEQ_LEN,
    header,
    parse_steps,
    pyplot,
    result_lines,
    run,
    run_on_link,
    save_figure,
    titan_args,
    write_result,
)  # fmt: skip

RESULT_FILE = RESULTS / "throughput.json"
FIGURE = FIGURES / "throughput.png"
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
    return parse_steps(run(cmd, env=env), LOCAL_BATCH * SEQ_LEN * microbatches)["round_s"]


def comm_only_s(link) -> dict:
    """``benchmarks.comm_only`` on the link as it is capped now: its RESULT."""
    return result_lines(run_on_link(link, [sys.executable, "-m", "benchmarks.comm_only", "--rounds",
                                      "5"], timeout_s=900))[-1]  # fmt: skip


def titan_on_link(link, mode: str, steps: int, microbatches: int, dump: str,
                  **kw) -> tuple[dict, str]:  # fmt: skip
    """A torchtitan run of ``mode`` (of :data:`MODES`) on the link: its step times
    (:func:`parse_steps`) and rank 0's output."""
    config, extra, _ = MODES[mode]
    output = run_on_link(link, titan_args(config, extra, steps, microbatches, 2, dump, **kw))
    return parse_steps(output, LOCAL_BATCH * SEQ_LEN * microbatches), output


def main_args(description: str, rates: str, rates_help: str) -> argparse.Namespace:
    """The command line both netbed benchmarks share."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawTextHelpFormatter)  # fmt: skip
    parser.add_argument("--rates", default=rates, help=rates_help)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per round per rank")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cap (law_sweep)")
    parser.add_argument("--per-microbatch-rates", default="none,1gbit,200mbit",
                        help="throughput: caps at which titan_ddp and titan_fsdp also run")
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args()
    args.rates = args.rates.split(",")
    args.per_microbatch_rates = args.per_microbatch_rates.split(",")
    return args


def measure(args: argparse.Namespace) -> dict:
    from benchmarks.netbed import two_host_link

    k = args.microbatches
    results: dict = {
        **header(), "model": MODEL,
        "microbatches_per_round": k, "microbatches_per_update": 2 * k,
        "local_batch": LOCAL_BATCH, "seq_len": SEQ_LEN, "rounds": args.rounds,
        "tokens_per_update_per_rank": 2 * k * LOCAL_BATCH * SEQ_LEN, "rates": {},
    }  # fmt: skip
    results["compute_only_s"] = compute_only_round_s(args.rounds, k)
    print(f"compute only: {results['compute_only_s']:.3f} s per {k} micro-batches", flush=True)
    update_steps = max(4, args.rounds // 2 + 1)  # the 2k arms: half as many, longer steps

    with two_host_link() as link:
        for rate in args.rates:
            link.set_rate(rate)
            comm = comm_only_s(link)
            row: dict = {"comm_only_s": statistics.median(comm["comm_s"]),
                         "engine_memory_bytes": comm["memory_bytes"]}  # fmt: skip
            for mode, (_, _, units) in MODES.items():
                if mode in PER_MICROBATCH_SYNC and rate not in args.per_microbatch_rates:
                    continue
                steps = args.rounds if units == 1 else update_steps
                row[mode] = titan_on_link(link, mode, steps, units * k, f"/tmp/acco_bench/{mode}")[0]
                row[mode]["microbatches_per_step"] = units * k
                row[mode]["update_s"] = row[mode]["round_s"] * (2 // units)
                row[mode]["tokens_per_s"] = 2 * results["tokens_per_update_per_rank"] / row[mode]["update_s"]
                print(f"{rate:>8} {mode:>18}: {row[mode]['update_s']:.3f} s/update", flush=True)
            compute, comm_s = results["compute_only_s"], row["comm_only_s"]
            acco = row["acco"]
            row["overlap_efficiency_E"] = max(compute, comm_s) / acco["round_s"]
            row["speedup_per_token"] = {b: row[b]["update_s"] / acco["update_s"]
                                        for b in BASELINES if b in row}  # fmt: skip
            shown = " ".join(f"{b}={v:.2f}" for b, v in row["speedup_per_token"].items())
            print(f"{rate:>8}: compute {compute:.3f} comm {comm_s:.3f} E={row['overlap_efficiency_E']:.3f}"
                  f" per-token S over {shown}", flush=True)  # fmt: skip
            results["rates"][rate] = row
            write_result(RESULT_FILE, results)
    return results


def plot(results: dict) -> None:
    plt = pyplot()
    rates = list(results["rates"])
    modes = [m for m in MODES if any(m in results["rates"][r] for r in rates)]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12.5, 4.4), gridspec_kw={"width_ratios": [3, 1.6]})
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        rows = [(x, results["rates"][r][mode]) for x, r in enumerate(rates) if mode in results["rates"][r]]
        scale = [row["update_s"] / row["round_s"] for _, row in rows]  # 2 for acco's two rounds
        medians = [row["update_s"] for _, row in rows]
        spread = [[m - f * min(row["round_s_all"]) for m, f, (_, row) in zip(medians, scale, rows)],
                  [f * max(row["round_s_all"]) - m for m, f, (_, row) in zip(medians, scale, rows)]]  # fmt: skip
        ax.bar([x + i * width for x, _ in rows], medians, width, yerr=spread, capsize=2, label=mode)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rates))], [f"cap {r}" for r in rates])
    ax.set_ylabel(f"s per update ({results['microbatches_per_update']} micro-batches per rank)")
    ax.set_title(f"{results['model']}, 2 ranks, equal tokens per update (acco: 2 rounds of "
                 f"{results['microbatches_per_round']})\nbars: median step time; whiskers: "
                 "fastest and slowest measured step", fontsize=9)  # fmt: skip
    ax.legend(fontsize=8)
    for j, baseline in enumerate(BASELINES):
        xs = [x for x, r in enumerate(rates) if baseline in results["rates"][r]["speedup_per_token"]]
        ys = [results["rates"][rates[x]]["speedup_per_token"][baseline] for x in xs]
        ax2.plot(xs, ys, "o-", label=f"over {baseline}")
    ax2.axhline(1.0, color="gray", linewidth=0.8)
    ax2.set_xticks(range(len(rates)), rates)
    ax2.set_xlabel("link cap per host")
    ax2.set_ylabel("per-token speedup of acco")
    ax2.set_title("S = T_update(baseline) / T_update(acco)\n(> 1: acco is faster per token)",
                  fontsize=9)  # fmt: skip
    ax2.legend(fontsize=7)
    save_figure(fig, FIGURE)


def main() -> None:
    args = main_args(__doc__, "none,1gbit,200mbit,50mbit",
                     "comma-separated tbf caps per host (none = no cap)")  # fmt: skip
    results = json.loads(RESULT_FILE.read_text()) if args.plot_only else measure(args)
    plot(results)


if __name__ == "__main__":
    main()
