"""A model of round time vs model size, world size and link bandwidth, fitted to the testbed.

    python -m benchmarks.scaling_model      # reads docs/results/throughput.json

Model (per data-parallel rank, one round of k micro-batches):

    T_comm = alpha + (N-1)/N * P * (b_reduce + b_gather) / (eta * B)     ring reduce-scatter + all-gather
    T_comp = k * t_microbatch
    T_ddp  = T_comp + T_comm                                             synchronous ZeRO-1
    T_acco = max(T_comp, T_comm) + delta * min(T_comp, T_comm)           overlapped

with P the parameters a rank holds, B its share of the link, eta the link efficiency and alpha
the fixed cost of a round end (the shard step, copies, latency). eta and alpha are fitted to the
communication-only times measured at each cap, delta (the part of the shorter side that is not
hidden) to the measured ACCO round times.

Prediction for Llama-3 8B on H100 nodes, TP 8 inside a node (NVLink), ACCO across nodes. The
assumptions are stated in the output: P = 8.03e9 / 8 per GPU; the node's NIC bandwidth split
evenly between its 8 GPUs; bf16 on the wire both ways; per node and round 2 micro-batches of
4 x 8192 tokens (the llama3_8b_acco.toml config); 989 TFLOP/s dense bf16 per GPU at 40 % MFU;
FLOPs per token 6P + 12 L d T (torchtitan's formula); eta, alpha and delta as fitted on the
testbed (a CPU testbed: on GPUs the shard step is faster and delta should be smaller).
Writes docs/results/scaling.json and docs/figures/scaling.png.
"""

from __future__ import annotations

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
THROUGHPUT = ROOT / "docs" / "results" / "throughput.json"
OUT = ROOT / "docs" / "results" / "scaling.json"
FIGURE = ROOT / "docs" / "figures" / "scaling.png"

DEBUG_PARAMS = 6_163_712
H100 = {"peak_flops": 989e12, "mfu": 0.40}
LLAMA3_8B = {"params": 8.03e9, "layers": 32, "dim": 4096, "seq_len": 8192}


def rate_bits(rate: str) -> float:
    return float(rate.removesuffix("gbit")) * 1e9 if rate.endswith("gbit") else float(rate.removesuffix("mbit")) * 1e6


def fit(results: dict) -> dict:
    """eta, alpha from comm-only times; delta from ACCO round times (least squares)."""
    n, bytes_per_elt = 2, 4 + 4  # fp32 reduce and gather on the testbed
    rows = [(r, row) for r, row in results["rates"].items() if r != "none"]
    xs = [(n - 1) / n * DEBUG_PARAMS * bytes_per_elt * 8 / rate_bits(r) for r, _ in rows]  # s at line rate
    ys = [row["comm_only_s"] for _, row in rows]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    alpha = mean_y - slope * mean_x
    compute = results["compute_only_s"]
    deltas = [
        (row["acco"]["round_s"] - max(compute, row["comm_only_s"])) / min(compute, row["comm_only_s"])
        for _, row in rows
    ]
    return {"eta": 1 / slope, "alpha_s": max(alpha, 0.0), "delta": max(0.0, sum(deltas) / len(deltas)),
            "compute_only_s": compute}  # fmt: skip


def predict(fitted: dict, nodes: int, gbit_per_node: float, microbatches: int = 2) -> dict:
    gpus_per_node, tokens = 8, 4 * LLAMA3_8B["seq_len"]
    params_per_gpu = LLAMA3_8B["params"] / gpus_per_node
    link = gbit_per_node * 1e9 / gpus_per_node  # bits/s per GPU
    comm = fitted["alpha_s"] + (nodes - 1) / nodes * params_per_gpu * (2 + 2) * 8 / (fitted["eta"] * link)
    flops_per_token = 6 * LLAMA3_8B["params"] + 12 * LLAMA3_8B["layers"] * LLAMA3_8B["dim"] * LLAMA3_8B["seq_len"]
    per_gpu_flops = H100["peak_flops"] * H100["mfu"]
    microbatch_s = tokens * flops_per_token / gpus_per_node / per_gpu_flops
    compute = microbatches * microbatch_s
    ddp = compute + comm
    acco = max(compute, comm) + fitted["delta"] * min(compute, comm)
    hide = max(1, -(-int(comm * 1000) // int(microbatch_s * 1000)))  # micro-batches to cover comm
    return {"nodes": nodes, "gbit_per_node": gbit_per_node, "compute_s": compute, "comm_s": comm,
            "ddp_round_s": ddp, "acco_round_s": acco, "speedup": ddp / acco,
            "microbatches_to_hide_comm": hide}  # fmt: skip


def main() -> None:
    results = json.loads(THROUGHPUT.read_text())
    fitted = fit(results)
    print(f"fitted on the testbed: eta={fitted['eta']:.3f} alpha={fitted['alpha_s']*1e3:.0f} ms "
          f"delta={fitted['delta']:.3f}")  # fmt: skip
    predictions = [predict(fitted, nodes, gbit) for gbit in (100, 200, 400) for nodes in (4, 8, 16, 32)]
    print(f"{'nodes':>5} {'Gbit/s':>6} {'compute':>8} {'comm':>6} {'ddp':>6} {'acco':>6} {'S':>5} {'k to hide':>9}")
    for p in predictions:
        print(f"{p['nodes']:>5} {p['gbit_per_node']:>6.0f} {p['compute_s']:>8.2f} {p['comm_s']:>6.2f} "
              f"{p['ddp_round_s']:>6.2f} {p['acco_round_s']:>6.2f} {p['speedup']:>5.2f} "
              f"{p['microbatches_to_hide_comm']:>9}")  # fmt: skip
    OUT.write_text(json.dumps({"fitted": fitted, "assumptions": __doc__.split("Prediction for")[1],
                               "predictions": predictions}, indent=1) + "\n")  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for gbit in (100, 200, 400):
        rows = [p for p in predictions if p["gbit_per_node"] == gbit]
        ax.plot([p["nodes"] for p in rows], [p["speedup"] for p in rows], "o-", label=f"{gbit} Gbit/s per node")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("H100 nodes (TP 8 inside, ACCO across)")
    ax.set_ylabel("predicted speedup ACCO / ZeRO-1 per round")
    ax.set_title("Llama-3 8B, 2 micro-batches of 4x8192 tokens per node and round (model)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(FIGURE, dpi=110)
    print(f"wrote {OUT} and {FIGURE}")


if __name__ == "__main__":
    main()
