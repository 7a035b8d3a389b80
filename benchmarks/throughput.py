"""Throughput of ACCO, DPU, synchronous ZeRO-1 and torchtitan's DDP/FSDP on a capped link.

    sudo python -m benchmarks.throughput                  # ~15 min on 2 cores
    python -m benchmarks.throughput --plot-only           # redraw from the JSON

Two ranks, one per network namespace and per core, joined by a veth pair capped with tbf
(``benchmarks/netbed.py``). Every run trains torchtitan's llama3 debug model (6.2M parameters)
through ``train_titan.py`` on the embedded data, with the same micro-batches per round (local
batch 4 x 128 tokens, ``--microbatches`` per rank). The round time is the median over steps 3..N
of the per-step time torchtitan itself measures (tokens per rank / its ``tps``).

Also measured:
- compute only: one process, no communication, the same micro-batches;
- communication only: ``benchmarks/comm_only.py``, one engine round end (reduce-scatter + AdamW
  step of the shard + all-gather) with no compute.

Reported per cap: overlap efficiency E = max(compute, comm) / acco round time (1.0 is the
physical limit) and speedup S = ddp round time / acco round time. The engine's modes use the
same collectives (a send/recv ring on gloo); torchtitan's DDP and FSDP use gloo's own
all-reduce / reduce-scatter / all-gather.

Writes ``docs/results/throughput.json`` and ``docs/figures/throughput.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "throughput.json"
FIGURE = ROOT / "docs" / "figures" / "throughput.png"
MODES = {  # name -> (config, extra overrides)
    "acco": ("debug_cpu_acco.toml", ("--acco.mode", "acco")),
    "dpu": ("debug_cpu_acco.toml", ("--acco.mode", "dpu")),
    "ddp": ("debug_cpu_acco.toml", ("--acco.mode", "ddp")),
    "titan_ddp": ("debug_cpu_titan_ddp.toml", ()),
    "titan_fsdp": ("debug_cpu_titan_fsdp.toml", ()),
}
STEP = re.compile(r"step:\s*(\d+)\s+loss:.*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")
LOCAL_BATCH, SEQ_LEN = 4, 128


def parse_steps(output: str, tokens_per_rank: int) -> dict[str, float]:
    """Median round time (s) over steps >= 3 and the peak RSS (GiB) from torchtitan's log."""
    rows = [(int(s), float(m), float(t.replace(",", ""))) for s, m, t in STEP.findall(output)]
    times = [tokens_per_rank / tps for step, _, tps in rows if step >= 3]
    if not times:
        raise RuntimeError(f"no step lines in the output:\n{output[-3000:]}")
    return {"round_s": statistics.median(times), "round_s_all": times,
            "peak_rss_gib": max(m for _, m, _ in rows)}  # fmt: skip


def titan_args(config: str, extra: tuple[str, ...], rounds: int, microbatches: int, dp: int,
               dump: str) -> list[str]:  # fmt: skip
    return [sys.executable, str(ROOT / "train_titan.py"),
            "--job.config_file", str(ROOT / "torchtitan_configs" / config),
            "--job.dump_folder", dump, "--metrics.disable_color_printing",
            "--training.steps", str(rounds), "--training.local_batch_size", str(LOCAL_BATCH),
            "--training.seq_len", str(SEQ_LEN),
            "--training.global_batch_size", str(LOCAL_BATCH * dp * microbatches), *extra]  # fmt: skip


def compute_only_round_s(rounds: int, microbatches: int) -> float:
    """Median round time of one process on core 0 with no communication at all."""
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29641", "OMP_NUM_THREADS": "1"}  # fmt: skip
    cmd = ["taskset", "-c", "0", *titan_args(
        "debug_cpu_titan_ddp.toml", ("--parallelism.data_parallel_replicate_degree", "1"),
        rounds, microbatches, 1, "/tmp/acco_bench/compute")]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=900)
    tokens_per_rank = LOCAL_BATCH * SEQ_LEN * microbatches
    return parse_steps(proc.stdout + proc.stderr, tokens_per_rank)["round_s"]


def main_args(description: str, rates: str, rates_help: str) -> argparse.Namespace:
    """The command line both netbed benchmarks share."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawTextHelpFormatter)  # fmt: skip
    parser.add_argument("--rates", default=rates, help=rates_help)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per round per rank")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cap (law_sweep)")
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args()
    args.rates = args.rates.split(",")
    return args


def measure(args: argparse.Namespace) -> dict:
    from benchmarks.netbed import run_two_ranks, two_host_link

    tokens_per_rank = LOCAL_BATCH * SEQ_LEN * args.microbatches
    results: dict = {
        "date": datetime.date.today().isoformat(), "machine": _machine(),
        "model": "torchtitan llama3 debugmodel (6.16M parameters)",
        "microbatches_per_round": args.microbatches, "local_batch": LOCAL_BATCH,
        "seq_len": SEQ_LEN, "rounds": args.rounds, "rates": {},
    }  # fmt: skip

    results["compute_only_s"] = compute_only_round_s(args.rounds, args.microbatches)
    print(f"compute only: {results['compute_only_s']:.3f} s/round", flush=True)

    with two_host_link() as link:
        for rate in args.rates:
            link.set_rate(rate)
            row: dict = {}
            status, out, _ = run_two_ranks(link, [sys.executable, "-m", "benchmarks.comm_only",
                                                  "--rounds", "5"], timeout_s=900)  # fmt: skip
            comm = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
            row["comm_only_s"] = statistics.median(comm["comm_s"])
            row["engine_memory_bytes"] = comm["memory_bytes"]
            for mode, (config, extra) in MODES.items():
                cmd = titan_args(config, extra, args.rounds, args.microbatches, 2,
                                 f"/tmp/acco_bench/{mode}")  # fmt: skip
                status, out, out1 = run_two_ranks(link, cmd, timeout_s=1800)
                if status:
                    raise RuntimeError(f"{mode} at {rate} failed:\n{out[-3000:]}\n{out1[-3000:]}")
                row[mode] = parse_steps(out, tokens_per_rank)
                row[mode]["tokens_per_s"] = 2 * tokens_per_rank / row[mode]["round_s"]
                print(f"{rate:>8} {mode:>10}: {row[mode]['round_s']:.3f} s/round", flush=True)
            compute, comm_s, acco = results["compute_only_s"], row["comm_only_s"], row["acco"]["round_s"]
            row["overlap_efficiency_E"] = max(compute, comm_s) / acco
            row["speedup_S"] = row["ddp"]["round_s"] / acco
            print(f"{rate:>8}: compute {compute:.3f} comm {comm_s:.3f} -> E={row['overlap_efficiency_E']:.3f} "
                  f"S={row['speedup_S']:.3f}", flush=True)  # fmt: skip
            results["rates"][rate] = row
            _save(results)  # a later failure keeps what was measured
    return results


def _machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())  # fmt: skip
    return f"{os.cpu_count()} cores ({cpu}), {platform.system()} {platform.release()}"


def _save(results: dict) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(results["rates"])
    modes = list(MODES)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 1.3]})
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        values = [results["rates"][r][mode]["round_s"] for r in rates]
        ax.bar([x + i * width for x in range(len(rates))], values, width, label=mode)
    for x, r in enumerate(rates):
        row = results["rates"][r]
        ax.hlines(row["comm_only_s"], x - 0.1, x + 0.9, colors="black", linestyles="dotted")
    ax.axhline(results["compute_only_s"], color="gray", linestyle="--", label="compute only")
    ax.plot([], [], "k:", label="communication only (engine)")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rates))], [f"cap {r}" for r in rates])
    ax.set_yscale("log")
    ax.set_ylabel("seconds per round (same micro-batches, log scale)")
    ax.set_title(f"{results['model']}, 2 ranks, {results['microbatches_per_round']} "
                 f"micro-batches/round/rank", fontsize=9)  # fmt: skip
    ax.legend(fontsize=8)
    ax2.plot(rates, [results["rates"][r]["overlap_efficiency_E"] for r in rates], "o-", label="E")
    ax2.plot(rates, [results["rates"][r]["speedup_S"] for r in rates], "s-", label="S = ddp / acco")
    ax2.axhline(1.0, color="gray", linewidth=0.8)
    ax2.set_title("overlap efficiency and speedup", fontsize=9)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    FIGURE.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURE, dpi=110)
    print(f"wrote {FIGURE}")


def main() -> None:
    args = main_args(__doc__, "none,1gbit,200mbit,50mbit",
                     "comma-separated tbf caps per host (none = no cap)")  # fmt: skip
    results = json.loads(RESULTS.read_text()) if args.plot_only else measure(args)
    plot(results)


if __name__ == "__main__":
    main()
