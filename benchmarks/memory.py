"""Memory per rank of each mode against the spec's table (torchtitan's llama3 debug model).

    python -m benchmarks.memory            # ~2 min, 2 (HSDP: 4) gloo ranks over loopback

acco, dpu, ddp, a plain unsharded AdamW and ``acco_hsdp`` (2 replicas of 2 FSDP2 shards): the
bytes by category (``ACCOEngine.memory_bytes()``), the peak RSS growth over 6 rounds and the
checkpoint's size. docs/results.md (section 2) and docs/hsdp.md explain them. Writes
outputs/results/memory.json (``--out``; the published file: docs/results/memory.json).
"""

from __future__ import annotations

import argparse
import io
import resource

import torch

from benchmarks.harness import add_out_option, run_ranks, write_result

MODES = {"adamw_unsharded": 1, "ddp": 2, "dpu": 2, "acco": 2, "acco_hsdp": 4}  # mode -> ranks
MIB = 1 << 20


def rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def debug_model(world_size: int = 1, hsdp: bool = False) -> torch.nn.Module:
    """torchtitan's llama3 debug model, seeded; with ``hsdp``, FSDP2 on a (replicate=2,
    shard=world/2) mesh, one unit per block as torchtitan does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.models.llama3 import Transformer, llama3_args

    torch.manual_seed(0)
    model = Transformer(llama3_args["debugmodel"])
    with torch.no_grad():
        model.init_weights()
    if not hsdp:
        return model
    mesh = init_device_mesh("cpu", (2, world_size // 2),
                            mesh_dim_names=("dp_replicate", "dp_shard"))  # fmt: skip
    fully_shard(model.tok_embeddings, mesh=mesh)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard([model.norm, model.output], mesh=mesh)
    return fully_shard(model, mesh=mesh)


def microbatch(model: torch.nn.Module, tokens: torch.Tensor) -> None:
    """Forward and backward of next-token prediction on ``tokens`` (2 x 129 of the vocab 2048)."""
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()


def run(rank: int, world_size: int, mode: str) -> dict:
    """One rank of ``mode``: 6 rounds of one micro-batch each, and the bytes they held."""
    from acco_hooks import ACCOHSDPOptimizer, ACCOOptimizer
    from acco_hooks.engine.buffers import local_tensor

    model = debug_model(world_size, hsdp=mode == "acco_hsdp")
    params = list(model.parameters())
    tokens = torch.randint(0, 2048, (2, 129), generator=torch.Generator().manual_seed(rank))
    microbatch(model, tokens)  # activations and autograd buffers exist before the baseline
    model.zero_grad(set_to_none=True)
    baseline = rss_peak_bytes()
    if mode == "adamw_unsharded":
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=False)
        for _ in range(6):
            microbatch(model, tokens)
            opt.step()
            opt.zero_grad(set_to_none=False)  # grads stay allocated, as in a training loop
        state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        tracked = {"model": sum(p.numel() * 4 for p in params),
                   "grads": sum(p.grad.numel() * 4 for p in params),
                   "optimizer_state": sum(v.numel() * v.element_size() for v in state)}  # fmt: skip
        return {"tracked_bytes": tracked, "rss_growth_bytes": rss_peak_bytes() - baseline,
                "params": sum(p.numel() for p in params)}  # fmt: skip
    if mode == "acco_hsdp":
        opt = ACCOHSDPOptimizer(model, torch.optim.AdamW, mode="acco", lr=1e-4)
    else:
        opt = ACCOOptimizer(params, torch.optim.AdamW, mode=mode, lr=1e-4)
    checkpoint_bytes = {}
    for round_index in range(1, 7):
        microbatch(model, tokens)
        opt.step()
        if round_index in (5, 6):  # acco: after an estimate round (5) and an update (6)
            buffer = io.BytesIO()
            torch.save(opt.state_dict(), buffer)
            checkpoint_bytes[f"after_round_{round_index}"] = buffer.tell()
    opt.flush()
    tracked = opt.engine.memory_bytes()
    opt.close()
    return {"tracked_bytes": tracked, "rss_growth_bytes": rss_peak_bytes() - baseline,
            "params": sum(p.numel() for p in params),
            "model_bytes": sum(local_tensor(p).numel() * p.element_size() for p in params),
            "checkpoint_bytes": checkpoint_bytes}  # fmt: skip


def report(results: dict) -> None:
    """One table, MiB per rank: the bytes by category, then the measured peak RSS growth and
    the checkpoint sizes."""
    columns = {"spec (acco N=2)": dict(results["spec_prediction_acco_n2"])}
    columns.update({mode: dict(results[mode]["tracked_bytes"]) for mode in MODES})
    rows = list(dict.fromkeys(cat for column in columns.values() for cat in column))
    for mode in MODES:
        columns[mode]["peak RSS growth"] = results[mode]["rss_growth_bytes"]
        for when, size in results[mode].get("checkpoint_bytes", {}).items():
            columns[mode][f"checkpoint {when}"] = size
    rows += ["peak RSS growth", "checkpoint after_round_5", "checkpoint after_round_6"]
    params = results["acco"]["params"]
    print(f"llama3 debug model, {params:,} parameters ({4 * params / MIB:.1f} MiB fp32), "
          "MiB per rank:")  # fmt: skip
    print(f"{'':<25}" + "".join(f"{name:>16}" for name in columns))
    for row in rows:
        cells = [column.get(row) for column in columns.values()]
        cells = ["-" if cell is None else f"{cell / MIB:.1f}" for cell in cells]
        print(f"{row:<25}" + "".join(f"{cell:>16}" for cell in cells))
    rss_cost = results["estimate_step_rss_cost_bytes"] / MIB
    print(f"estimate step (peak RSS growth of acco - dpu): {rss_cost:+.1f} MiB")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_option(parser, "memory")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results = {mode: run_ranks("benchmarks.memory:run", world, mode)[0]
               for mode, world in MODES.items()}  # fmt: skip
    acco, hsdp = results["acco"], results["acco_hsdp"]
    params = acco["params"]
    # the spec's table for an fp32 model, fp32 accumulation and fp32 on the wire, N = 2
    spec = {"model": 4 * params, "grad_accumulator": 4 * params, "comm_buffer": 4 * params,
            "master_shard": 4 * params // 2, "optimizer_state": 8 * params // 2}  # fmt: skip
    results["spec_prediction_acco_n2"] = spec
    results["estimate_step_rss_cost_bytes"] = (
        acco["rss_growth_bytes"] - results["dpu"]["rss_growth_bytes"]
    )
    # categories both hold (estimate_wire is empty with a float32 estimate)
    results["hsdp_reduction_vs_acco"] = {
        cat: size / hsdp["tracked_bytes"][cat]
        for cat, size in acco["tracked_bytes"].items() if hsdp["tracked_bytes"][cat]
    }  # fmt: skip
    out = write_result(args.out, results)
    report(results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
