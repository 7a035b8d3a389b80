"""ACCO's per-token speedup on paper: the law, fitted to the testbed, applied to Llama-3 8B.

    python -m benchmarks.scaling_model      # reads docs/results/law_sweep.json

Per token at equal tokens per optimizer update (``acco_hooks.engine.advisor``, ``benchmarks.law_sweep``),
with K the compute of one round of k micro-batches and C one round's communication::

    C       = alpha + (N-1)/N * P * (b_reduce + b_gather) * 8 / (eta * B)   ring RS + all-gather
    K       = k * t_microbatch
    ZeRO-1  = 2K + C                                  one synchronous update over 2k micro-batches
    ACCO    = 2 * (max(K, C) + delta * min(K, C))     two overlapped rounds of k micro-batches
    S       = (2K + C) / (2 * (max(K, C) + delta * min(K, C)))

delta = 0 is the ideal overlap (the law, at most 1.5 at C = K, 1 at C = 2K, below 1 beyond);
delta > 0 is the part of the shorter side that the overlap does not hide. With P the parameters
a rank communicates, B its share of the link, eta the link efficiency and alpha the fixed cost
of a round end.

Fit, on docs/results/law_sweep.json: eta and alpha from the comm-only C per cap, delta from
every ACCO run; applied to Llama-3 8B on H100 nodes at the config's k and at the best k k*
(docs/results.md, section 3); and to a mixed cluster, H100 nodes beside slower nodes
(:func:`mixed_cluster`). Writes outputs/results/scaling.json and scaling.png beside it
(``--out``; the published files, docs/results/scaling.json and docs/figures/scaling.png:
``--out docs/results/scaling.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import tomllib

from benchmarks.harness import (
    RESULTS,
    ROOT,
    add_out_option,
    figure_file,
    pyplot,
    save_figure,
    write_result,
)

LAW_SWEEP = RESULTS / "law_sweep.json"
CONFIG = ROOT / "torchtitan_configs" / "llama3_8b_acco.toml"

# The testbed (benchmarks.comm_only, gloo ring of acco_hooks.engine.collectives): 2 ranks, the debug
# model's 6,163,712 fp32 parameters, fp32 reduce-scatter then fp32 all-gather, each moving
# (N-1)/N of the buffer per rank (24,654,848 bytes of comm buffer, see throughput.json).
TESTBED = {"ranks": 2, "params": 6_163_712, "reduce_bytes": 4, "gather_bytes": 4}

# Llama-3 8B as torchtitan builds it (llama3_args["8B"], counted on the meta device).
LLAMA3_8B = {"params": 8_030_261_248, "embedding_params": 525_336_576, "layers": 32, "dim": 4096}
H100 = {"peak_flops": 989e12, "mfu": 0.40, "gpus_per_node": 8}
# A mixed cluster: how many times longer a slower node's micro-batch takes than an H100 node's.
# The vendors' datasheets give dense BF16 peaks of 989 TFLOP/s (H100 SXM) and 312 TFLOP/s
# (A100 SXM): 3.17x at one MFU. Measured LLM training speedups of H100 over A100 are quoted at
# 2-3x; 2x is the low end of that range (no single measurement of it is named here), and
# also a node throttled to half its speed.
SLOWER_NODES = (("A100 SXM, datasheet peaks (989 / 312 TFLOP/s)", 989 / 312),
                ("2x slower (low end of quoted H100/A100 speedups; a throttled node)", 2.0))
MIXED_SPLITS = ((7, 1), (4, 4), (1, 7))  # (H100 nodes, slower nodes), 8 nodes
MIXED_LINKS = (("cross-site 25 GbE", 25), ("100 GbE", 100), ("8 x 400G InfiniBand", 3200))
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

LINKS = (  # (name, Gbit/s per node)
    ("cross-site 10 GbE", 10),
    ("cross-site 25 GbE", 25),
    ("100 GbE", 100),
    ("200 GbE", 200),
    ("8 x 400G InfiniBand", 3200),
)
NODES = (4, 8, 32)


def rate_bits(rate: str) -> float:
    """A tbf rate string ("1400mbit", "1gbit", "85kbit") in bits per second."""
    for suffix, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if rate.endswith(suffix):
            return float(rate.removesuffix(suffix)) * scale
    raise ValueError(f"not a tbf rate: {rate!r}")


def wire_seconds(ranks: int, params: float, bytes_per_param: int, bits_per_s: float) -> float:
    """Ring reduce-scatter + all-gather at line rate: (N-1)/N of the buffer each way, per rank."""
    return (ranks - 1) / ranks * params * bytes_per_param * 8 / bits_per_s


def _rms(values: list[float]) -> float:
    return math.sqrt(sum(v * v for v in values) / len(values))


def fit(sweep: dict) -> dict:
    """eta, alpha from the comm-only C per cap; delta from every ACCO run; with residuals."""
    rates = [(rate, row) for rate, row in sweep["rates"].items() if rate != "none"]
    wire = TESTBED["reduce_bytes"] + TESTBED["gather_bytes"]
    xs = [wire_seconds(TESTBED["ranks"], TESTBED["params"], wire, rate_bits(r)) for r, _ in rates]
    cs = [row["comm_C_s"] for _, row in rates]
    mean_x, mean_c = sum(xs) / len(xs), sum(cs) / len(cs)
    covariance = sum((x - mean_x) * (c - mean_c) for x, c in zip(xs, cs))
    slope = covariance / sum((x - mean_x) ** 2 for x in xs)
    alpha = mean_c - slope * mean_x
    comm_residuals = [c - (alpha + slope * x) for x, c in zip(xs, cs)]

    compute = sweep["compute_K_s"]
    # A cap re-measured on its own carries the K its runs were compared with.
    runs = [(row.get("compute_K_s", compute), row["comm_C_s"], t)
            for _, row in rates for t in row["acco_round_s"]]  # fmt: skip
    x_d = [min(k, c) for k, c, _ in runs]
    y_d = [t - max(k, c) for k, c, t in runs]
    delta = sum(x * y for x, y in zip(x_d, y_d)) / sum(x * x for x in x_d)
    delta_residuals = [y - delta * x for x, y in zip(x_d, y_d)]
    constant = sum(y_d) / len(y_d)  # the other shape: a fixed cost per round, for comparison

    ddp_residuals = [t - (2 * row.get("compute_K_s", compute) + row["comm_C_s"])
                     for _, row in rates for t in row["ddp_round_s"]]  # fmt: skip
    return {
        "source": str(LAW_SWEEP.relative_to(ROOT)), "testbed": sweep.get("machine", ""),
        "testbed_wire": TESTBED, "compute_K_s": compute, "k": sweep.get("k"),
        "eta": 1 / slope, "alpha_s": alpha,
        "comm_fit": {"caps": [r for r, _ in rates], "line_rate_s": xs, "measured_C_s": cs,
                     "residual_s": comm_residuals, "residual_rms_s": _rms(comm_residuals),
                     "residual_max_abs_s": max(map(abs, comm_residuals))},
        "delta": delta,
        "delta_fit": {"runs": len(runs), "model": "T_acco - max(K, C) = delta * min(K, C)",
                      "residual_rms_s": _rms(delta_residuals),
                      "residual_max_abs_s": max(map(abs, delta_residuals)),
                      "residual_s": delta_residuals, "constant_overhead_s": constant,
                      "constant_overhead_residual_rms_s": _rms([y - constant for y in y_d])},
        "ddp_check": {"model": "T_ddp(2k) - (2K + C), not fitted",
                      "residual_mean_s": sum(ddp_residuals) / len(ddp_residuals),
                      "residual_rms_s": _rms(ddp_residuals),
                      "residual_max_abs_s": max(map(abs, ddp_residuals))},
    }  # fmt: skip


def setup(config: pathlib.Path = CONFIG) -> dict:
    """The 8B run's shape, read from the torchtitan config, and the compute of one micro-batch."""
    cfg = tomllib.loads(config.read_text())
    training, par, acco = cfg["training"], cfg["parallelism"], cfg["acco"]
    tp = par["tensor_parallel_degree"]
    # torchtitan's get_dense_model_nparams_and_flops: 6 (P - embedding) + 12 L d T.
    flops_per_token = (6 * (LLAMA3_8B["params"] - LLAMA3_8B["embedding_params"])
                       + 12 * LLAMA3_8B["layers"] * LLAMA3_8B["dim"] * training["seq_len"])
    tokens = training["local_batch_size"] * training["seq_len"]  # per node (one rank per TP group)
    microbatch_s = tokens * flops_per_token / (tp * H100["peak_flops"] * H100["mfu"])
    return {
        "config": str(config.relative_to(ROOT)), "tensor_parallel": tp,
        "gpus_per_node": H100["gpus_per_node"], "params_per_gpu": LLAMA3_8B["params"] / tp,
        "reduce_bytes": BYTES[acco.get("reduce_dtype", "float32")],
        "gather_bytes": BYTES[training.get("dtype", "float32")],
        "k": acco["accumulation_steps"], "tokens_per_microbatch_per_node": tokens,
        "flops_per_token": flops_per_token, "microbatch_s": microbatch_s,
    }  # fmt: skip


def speedup(compute_s: float, comm_s: float, delta: float) -> float:
    """Per token: ZeRO-1 over 2k micro-batches against two ACCO rounds of k."""
    acco = max(compute_s, comm_s) + delta * min(compute_s, comm_s)
    return (2 * compute_s + comm_s) / (2 * acco)


def best_k(comm_s: float, microbatch_s: float, delta: float) -> int:
    """The k that maximises S: the peak is at K = C (for delta < 1/2), so floor or ceil."""
    ratio = comm_s / microbatch_s
    candidates = {max(1, math.floor(ratio)), max(1, math.ceil(ratio))}
    return max(sorted(candidates), key=lambda k: speedup(k * microbatch_s, comm_s, delta))


def predict(fitted: dict, run: dict, nodes: int, gbit_per_node: float, name: str = "") -> dict:
    per_gpu_link = gbit_per_node * 1e9 / run["gpus_per_node"]  # the NICs shared evenly
    wire = run["reduce_bytes"] + run["gather_bytes"]
    line_rate_s = wire_seconds(nodes, run["params_per_gpu"], wire, per_gpu_link)
    comm = fitted["alpha_s"] + line_rate_s / fitted["eta"]
    t, k = run["microbatch_s"], run["k"]
    compute = k * t
    k_star = best_k(comm, t, fitted["delta"])
    tokens_per_update = 2 * run["tokens_per_microbatch_per_node"] * nodes
    return {
        "link": name, "gbit_per_node": gbit_per_node, "nodes": nodes,
        "microbatch_s": t, "comm_C_s": comm,
        "k": k, "compute_K_s": compute, "C_over_K": comm / compute,
        "zero1_update_s": 2 * compute + comm,
        "acco_two_rounds_s": 2 * (max(compute, comm) + fitted["delta"] * min(compute, comm)),
        "S_fitted_delta": speedup(compute, comm, fitted["delta"]),
        "S_ideal": speedup(compute, comm, 0.0),
        "tokens_per_update": k * tokens_per_update,
        "k_star": k_star, "C_over_K_at_k_star": comm / (k_star * t),
        "S_fitted_delta_at_k_star": speedup(k_star * t, comm, fitted["delta"]),
        "S_ideal_at_k_star": speedup(k_star * t, comm, 0.0),
        "tokens_per_update_at_k_star": k_star * tokens_per_update,
    }  # fmt: skip


def mixed_cluster(fitted: dict, run: dict, fast_nodes: int, slow_nodes: int, ratio: float,
                  gbit_per_node: float) -> dict:  # fmt: skip
    """Tokens per second of 8B training on ``fast_nodes`` H100 nodes beside ``slow_nodes``
    nodes whose micro-batch takes ``ratio`` times as long, one replica a node, k micro-batches
    a round (the config's):

    * ``sync``: synchronous ZeRO-1, every node 2k micro-batches an update, each update
      waiting for the slow nodes: ``2k·t_slow + C``;
    * ``sync_balanced``: the same, each H100 node running ``floor(ratio·2k)`` micro-batches an
      update instead (a split fixed in advance for speeds that do not change);
    * ``acco``: two rounds of k micro-batches on every node, each ``max(k·t_slow, C) +
      δ·min(k·t_slow, C)``;
    * ``acco_until_ready``: the same rounds, each H100 node running micro-batches until the
      round is ready, ``max(k, T / t_fast)`` of them, and the round ends after the one under way
      (half a micro-batch later, on average);
    * ``acco_until_ready_capped``: with ``max_microbatches_per_round`` at half the balanced
      split's count, so that an update holds the tokens of ``sync_balanced``'s: the comparison
      at equal tokens per update. A node that reaches the cap waits for the round.

    Tokens per update differ otherwise (the uncapped until-ready one grows with C): the rates
    assume one token trains as much in any of them, which the CPU runs measured for
    until-ready (docs/results.md, section 5), not at 8B.
    """
    nodes = fast_nodes + slow_nodes
    wire = run["reduce_bytes"] + run["gather_bytes"]
    per_gpu_link = gbit_per_node * 1e9 / run["gpus_per_node"]
    comm = fitted["alpha_s"] + wire_seconds(nodes, run["params_per_gpu"], wire,
                                            per_gpu_link) / fitted["eta"]  # fmt: skip
    t_fast, k, tokens = run["microbatch_s"], run["k"], run["tokens_per_microbatch_per_node"]
    t_slow, delta = ratio * t_fast, fitted["delta"]
    balanced = math.floor(ratio * 2 * k)
    cap = balanced / 2
    round_s = max(k * t_slow, comm) + delta * min(k * t_slow, comm)
    fast_microbatches = max(k, round_s / t_fast)
    capped = min(cap, fast_microbatches)
    capped_round_s = max(round_s, cap * t_fast) if capped == cap else round_s + t_fast / 2
    arms = {  # (seconds per update, tokens per update)
        "sync": (2 * k * t_slow + comm, 2 * k * tokens * nodes),
        "sync_balanced": (max(2 * k * t_slow, balanced * t_fast) + comm,
                          tokens * (2 * k * slow_nodes + balanced * fast_nodes)),
        "acco": (2 * round_s, 2 * k * tokens * nodes),
        "acco_until_ready": (2 * (round_s + t_fast / 2),
                             2 * tokens * (k * slow_nodes + fast_microbatches * fast_nodes)),
        "acco_until_ready_capped": (2 * capped_round_s,
                                    2 * tokens * (k * slow_nodes + capped * fast_nodes)),
    }  # fmt: skip
    rate = {name: tok / seconds for name, (seconds, tok) in arms.items()}
    return {
        "fast_nodes": fast_nodes, "slow_nodes": slow_nodes, "slow_over_fast": ratio,
        "gbit_per_node": gbit_per_node, "microbatch_s": [t_fast, t_slow], "comm_C_s": comm,
        "update_s": {name: seconds for name, (seconds, _) in arms.items()},
        "tokens_per_update": {name: tok for name, (_, tok) in arms.items()},
        "tokens_per_s": rate,
        "over_sync": {name: r / rate["sync"] for name, r in rate.items()},
        "capped_over_sync_balanced": rate["acco_until_ready_capped"] / rate["sync_balanced"],
        "max_microbatches_per_round": cap,
        "fast_node_microbatches_per_round": fast_microbatches,
    }  # fmt: skip


def plot(fitted: dict, run: dict, figure: pathlib.Path) -> None:
    plt = pyplot()
    grid = [10 * (3200 / 10) ** (i / 200) for i in range(201)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    colors = {4: "tab:blue", 8: "tab:orange", 32: "tab:green"}
    for ax, at_best in zip(axes, (False, True)):
        for nodes in NODES:
            rows = [predict(fitted, run, nodes, gbit) for gbit in grid]
            key = "_at_k_star" if at_best else ""
            ax.plot(grid, [r["S_fitted_delta" + key] for r in rows], "-", color=colors[nodes],
                    label=f"{nodes} nodes, fitted δ = {fitted['delta']:.2f}")  # fmt: skip
            ax.plot(grid, [r["S_ideal" + key] for r in rows], "--", color=colors[nodes],
                    linewidth=0.9, label=f"{nodes} nodes, ideal overlap δ = 0")  # fmt: skip
        for _, gbit in LINKS:
            ax.axvline(gbit, color="lightgray", linewidth=0.6, zorder=0)
        ax.axhline(1.0, color="black", linewidth=0.9)
        ax.axhline(1.5, color="gray", linewidth=0.6, linestyle=":")
        ax.set_xscale("log")
        ticks = [gbit for _, gbit in LINKS]
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("link bandwidth per node, Gbit/s (log scale)")
        ax.set_title("k* micro-batches per round, k* ≈ C / t_microbatch (best k)" if at_best
                     else f"k = {run['k']} micro-batches per round (llama3_8b_acco.toml)",
                     fontsize=9)  # fmt: skip
    axes[0].set_ylabel("per-token speedup S, ACCO(k) / sync ZeRO-1(2k)")
    axes[0].legend(fontsize=7, loc="upper right")
    fig.suptitle("Llama-3 8B, TP 8 in a node, ACCO across nodes, H100 at 40 % MFU — MODEL, not a "
                 "measurement; fitted on a 2-core CPU testbed (docs/results/scaling.json)",
                 fontsize=9)  # fmt: skip
    save_figure(fig, figure)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_option(parser, "scaling")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    fitted = fit(json.loads(LAW_SWEEP.read_text()))
    run = setup()
    cf, df = fitted["comm_fit"], fitted["delta_fit"]
    print(f"fit on {fitted['source']}: eta = {fitted['eta']:.3f}, "
          f"alpha = {fitted['alpha_s'] * 1e3:.1f} ms "
          f"(residual RMS {cf['residual_rms_s'] * 1e3:.1f} ms, "
          f"max {cf['residual_max_abs_s'] * 1e3:.1f} ms over {len(cf['caps'])} caps); "
          f"delta = {fitted['delta']:.3f} (residual RMS "
          f"{df['residual_rms_s'] * 1e3:.1f} ms, max {df['residual_max_abs_s'] * 1e3:.1f} ms over "
          f"{df['runs']} acco runs; a constant {df['constant_overhead_s'] * 1e3:.0f} ms per round "
          f"instead: RMS {df['constant_overhead_residual_rms_s'] * 1e3:.1f} ms)")  # fmt: skip
    print(f"8B: t_microbatch = {run['microbatch_s']:.3f} s "
          f"({run['tokens_per_microbatch_per_node']} tokens "
          f"per node, {run['flops_per_token'] / 1e9:.2f} GFLOP/token), k = {run['k']}")  # fmt: skip
    rows = [predict(fitted, run, nodes, gbit, name) for name, gbit in LINKS for nodes in NODES]
    print(f"{'link':>20} {'Gb/s':>5} {'nodes':>5} {'K':>6} {'C':>6} {'C/K':>5} {'S δ=0':>6} "
          f"{'S δfit':>6} {'k*':>4} {'S* δ=0':>6} {'S* δfit':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['link']:>20} {r['gbit_per_node']:>5} {r['nodes']:>5} {r['compute_K_s']:>6.2f} "
              f"{r['comm_C_s']:>6.2f} {r['C_over_K']:>5.2f} {r['S_ideal']:>6.3f} "
              f"{r['S_fitted_delta']:>6.3f} {r['k_star']:>4} {r['S_ideal_at_k_star']:>6.3f} "
              f"{r['S_fitted_delta_at_k_star']:>7.3f}")  # fmt: skip
    assumptions = [
        ("A MODEL, not a measurement: eta, alpha and delta come from a 2-core CPU testbed (gloo, "
         "tbf-capped veth); nothing here ran on an H100."),
        (f"Llama-3 8B, {LLAMA3_8B['params']} parameters, TP {run['tensor_parallel']} inside a "
         f"node (NVLink), ACCO across nodes: {run['params_per_gpu']:.4g} parameters per GPU on "
         "the wire."),
        (f"bytes on the wire per parameter: reduce {run['reduce_bytes']} + gather "
         f"{run['gather_bytes']} (bf16 both ways, {run['config']})."),
        "each node's link bandwidth shared evenly by its 8 GPUs (8 x 400G IB: one NIC per GPU).",
        (f"a micro-batch is {run['tokens_per_microbatch_per_node']} tokens per node "
         f"(local_batch_size x seq_len); k = {run['k']} micro-batches per ACCO round "
         "([acco] accumulation_steps); the ZeRO-1 baseline uses 2k per update (equal tokens)."),
        (f"989 TFLOP/s dense bf16 per GPU at 40 % MFU; torchtitan's FLOPs per token "
         f"6 (P - embedding) + 12 L d T = {run['flops_per_token']:.4g}."),
        ("alpha (fixed cost of a round end) is the testbed's; on GPUs the shard step is faster, "
         "and NCCL over IB/RoCE has its own efficiency: eta is the testbed's too."),
        ("delta = 0 is the ideal overlap (the law); fitted delta is the CPU testbed's, where "
         "compute and communication share a core: pessimistic for GPUs."),
        ("raising k raises the tokens per update for both ACCO and ZeRO-1 (equal tokens per "
         "update); whether the larger batch converges as well is not modelled."),
    ]
    mixed = [{"slower_nodes": name, "link": link, **mixed_cluster(fitted, run, fast, slow, ratio,
                                                                  gbit)}
             for name, ratio in SLOWER_NODES for link, gbit in MIXED_LINKS
             for fast, slow in MIXED_SPLITS]  # fmt: skip
    print("\nmixed cluster, 8 nodes, tokens/s over synchronous ZeRO-1 (each update waits for the "
          "slow nodes):")
    print(f"{'slower':>6} {'link':>20} {'H100+slow':>9} {'C/K_slow':>8} {'balanced':>8} "
          f"{'acco':>6} {'ur capped':>9} {'capped/bal':>10} {'ur':>6} {'ur tokens':>9}")
    for r in mixed:
        c_over_k = r["comm_C_s"] / (run["k"] * r["microbatch_s"][1])
        over, tokens = r["over_sync"], r["tokens_per_update"]
        print(f"{r['slow_over_fast']:>6.2f} {r['link']:>20} "
              f"{r['fast_nodes']:>4}+{r['slow_nodes']:<4} {c_over_k:>8.2f} "
              f"{over['sync_balanced']:>8.2f} {over['acco']:>6.2f} "
              f"{over['acco_until_ready_capped']:>9.2f} {r['capped_over_sync_balanced']:>10.2f} "
              f"{over['acco_until_ready']:>6.2f} "
              f"{tokens['acco_until_ready'] / tokens['sync']:>8.1f}x")  # fmt: skip
    assumptions.append(
        "mixed cluster: the slower node's micro-batch takes the named ratio of an H100 node's "
        "(the datasheets' dense BF16 peaks, or 2x), the same MFU, the same link per node; "
        "tokens per update differ between the arms, and the rates assume a token trains as "
        "much in each (measured for until-ready on CPU only, docs/results.md section 5).")
    out = write_result(args.out, {"model": __doc__.split("Fit, on")[0].strip(), "fit": fitted,
                                  "setup": run, "assumptions": assumptions,
                                  "rows": rows, "mixed_cluster": mixed})  # fmt: skip
    plot(fitted, run, figure_file(out, "scaling"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
