"""Per-GPU memory of each shipped 8B config, by node count: a calculator, before you launch.

    python -m benchmarks.memory_8b          # seconds; writes outputs/results/memory_8b.json
    python -m benchmarks.memory_8b --out docs/results/memory_8b.json    # the published file

For every ``torchtitan_configs/llama3_8b_*.toml`` on 2, 4, 8 and 16 nodes of 8 GPUs, the GiB
one GPU holds, by the categories docs/torchtitan.md lists ("Memory per GPU before you launch"),
and what the optimizer state and the total become under torchft with a replica group per node
(per model replica where it spans nodes; ``manager=``: each group shards a whole optimizer
state over its own ranks).
The parameter count is exact (the 8B model built on the meta device); the rest is arithmetic
on the engine's buffer layout (``acco_hooks/engine/buffers.py``). A pipeline stage holds 1/PP
of the model, embedding and output counted as the even split. Activations are an estimate:
34·s·b·h bytes per layer and micro-batch with selective checkpointing (Korthikanti et al.,
2022, bf16), divided by TP; PP's in-flight micro-batches are not counted. Nor are the CUDA
context, fragmentation and compile workspace: hence a budget of 70 of an H100's 80 GB.
"""

from __future__ import annotations

import argparse
import pathlib

from benchmarks.harness import ROOT, add_out_option, write_result

GPUS_PER_NODE = 8
NODES = (2, 4, 8, 16)
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 1 << 30
H100_BUDGET_GIB = 70  # of an 80 GB H100, leaving room for the CUDA context and fragmentation


def model_facts(flavor: str = "8B") -> dict[str, int]:
    """The llama3 ``flavor``'s exact parameter count and the shapes the activation estimate
    needs (the 8B model by default)."""
    import torch
    from torchtitan.models.llama3 import Transformer, llama3_args

    args = llama3_args[flavor]
    with torch.device("meta"):
        model = Transformer(args)
    return {"params": sum(p.numel() for p in model.parameters()), "layers": args.n_layers,
            "hidden": args.dim}  # fmt: skip


def per_gpu_bytes(
    config: pathlib.Path | dict, nodes: int, facts: dict[str, int], ndigits: int | None = 2
) -> dict[str, float]:  # fmt: skip
    """GiB per GPU, by category, for the job config ``config`` (a TOML file, or one read
    already) on ``nodes`` nodes, rounded to ``ndigits`` (None: not rounded)."""
    import tomllib

    cfg = tomllib.loads(config.read_text()) if isinstance(config, pathlib.Path) else config
    par, training, acco = cfg["parallelism"], cfg["training"], cfg["acco"]
    tp, pp = par.get("tensor_parallel_degree", 1), par.get("pipeline_parallel_degree", 1)
    shard = par.get("data_parallel_shard_degree", 1)
    replicas = nodes * GPUS_PER_NODE // (tp * pp * shard)
    local = facts["params"] / (tp * pp * shard)  # the elements of the model on this GPU
    model_bytes = BYTES[training.get("dtype", "float32")]
    reduce_bytes = BYTES[acco.get("reduce_dtype", "float32")]
    fsdp_unsharded = 0.0
    if shard > 1 and not acco.get("fsdp_sync_every_microbatch", False):
        fsdp_unsharded = local * shard * model_bytes  # a whole replica's gradients, unsharded
    # per shard element: fp32 master, AdamW's two moments, the reduce-scattered sum, the shard to
    # gather; the master's fp32 gradient where the sum is narrower (otherwise the sum is it);
    # acco's carried half-batch sum (the engine's memory_bytes(), benchmarks/fake_rank.py)
    shard_side = (4 + 8 + reduce_bytes + model_bytes + (4 if reduce_bytes != 4 else 0)
                  + (4 if acco["mode"] == "acco" else 0))  # fmt: skip
    tokens = training["local_batch_size"] * training["seq_len"]
    activations = (facts["layers"] / pp) * 34 * tokens * facts["hidden"] / tp
    figures = {
        "replicas": replicas,
        "params": local * model_bytes,
        "grads": local * 4 + fsdp_unsharded,
        "comm_buffer": local * max(reduce_bytes, model_bytes),
        "optimizer": local * shard_side / replicas,
        "activations_estimate": activations,
    }
    total = sum(v for k, v in figures.items() if k != "replicas")
    # Under torchft (manager=) with the smallest replica groups (one node; one model replica
    # where it spans nodes, 3-D) each group holds a whole optimizer state, sharded over its own
    # data-parallel ranks only: the replicas inside one node.
    replicas_per_node = max(1, GPUS_PER_NODE // (tp * pp * shard))
    optimizer_ft = local * shard_side / replicas_per_node

    def gib(n: float) -> float:
        return n / GIB if ndigits is None else round(n / GIB, ndigits)

    row = {k: (v if k == "replicas" else gib(v)) for k, v in figures.items()}
    row["total"] = gib(total)
    row["optimizer_torchft"] = gib(optimizer_ft)
    row["total_torchft"] = gib(total - figures["optimizer"] + optimizer_ft)
    row["runs"] = replicas >= 2  # ACCO (and its ddp mode) needs two replicas
    row["fits_h100_80gb"] = row["total"] <= H100_BUDGET_GIB
    return row


def _note(row: dict) -> str:
    if not row["runs"]:
        return "needs 2 replicas: more nodes"
    return "" if row["fits_h100_80gb"] else f"over {H100_BUDGET_GIB} GiB: smaller local_batch_size"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_option(parser, "memory_8b")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    facts = model_facts()
    results = {"params": facts["params"], "gpus_per_node": GPUS_PER_NODE, "configs": {}}
    print(f"Llama-3 8B: {facts['params']:,} parameters; GiB per GPU ({GPUS_PER_NODE} GPUs/node)")
    print(f"{'config':<26}{'nodes':>6}{'R':>4}{'params':>8}{'grads':>8}{'comm':>7}{'optim':>7}"
          f"{'act*':>7}{'total':>8}{'ft:optim':>9}{'ft:total':>9}  note")  # fmt: skip
    for path in sorted((ROOT / "torchtitan_configs").glob("llama3_8b_*.toml")):
        rows = results["configs"][path.name] = {}
        for nodes in NODES:
            row = rows[nodes] = per_gpu_bytes(path, nodes, facts)
            print(f"{path.stem:<26}{nodes:>6}{row['replicas']:>4}{row['params']:>8}"
                  f"{row['grads']:>8}{row['comm_buffer']:>7}{row['optimizer']:>7}"
                  f"{row['activations_estimate']:>7}"
                  f"{row['total']:>8}{row['optimizer_torchft']:>9}"
                  f"{row['total_torchft']:>9}  {_note(row)}")  # fmt: skip
    print("act*: an estimate (selective activation checkpointing), see the module docstring")
    print("ft:*: under torchft, a replica group per node (per model replica in 3-D): the "
          "optimizer state is sharded over the group's data-parallel ranks only")
    out = write_result(args.out, results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
