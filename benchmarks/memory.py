"""Memory per rank of each mode against the spec's table (torchtitan's llama3 debug model).

    python -m benchmarks.memory            # ~2 min, 2 (HSDP: 4) gloo ranks over loopback

For acco, dpu and ddp (the engine) and a plain unsharded AdamW: the bytes the optimizer side
holds by category (``ACCOEngine.memory_bytes()``), the spec's prediction for the same
categories (fp32 model, so 4 bytes per element everywhere), and the growth of the process's peak
RSS over 6 rounds of real forward/backward (activations included; the same for every mode). The
estimate step's cost is read off as acco's peak RSS minus dpu's (dpu never estimates).
The HSDP row (``acco_hsdp``) runs ACCO across R=2 replicas, each sharded by FSDP2 over S=2
ranks (``ACCOHSDPOptimizer``, 4 ranks): everything the engine holds is 1/S of the ``acco`` row
(R=2 replicas without FSDP), the master shard and optimizer state included.
The engine's checkpoint per rank (``torch.save`` of ``state_dict()``) is measured after round
5 (in acco: after an estimate round, with its half-batch carried) and round 6, against the
rank's model bytes. Writes docs/results/memory.json.
"""

from __future__ import annotations

import io
import resource

import torch

from benchmarks.harness import RESULTS, run_ranks, write_result

OUT = RESULTS / "memory.json"


def _rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(rank: int, world_size: int, mode: str) -> dict:
    from torchtitan.models.llama3 import Transformer, llama3_args

    from acco_hooks import ACCOOptimizer

    torch.manual_seed(0)
    model = Transformer(llama3_args["debugmodel"])
    with torch.no_grad():
        model.init_weights()
    if mode == "acco_hsdp":
        model = _fully_shard_2x2(model, world_size)
    tokens = torch.randint(0, 2048, (2, 129), generator=torch.Generator().manual_seed(rank))
    loss_fn = torch.nn.functional.cross_entropy

    def microbatch():
        logits = model(tokens[:, :-1])
        loss_fn(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()

    microbatch()  # activations and autograd buffers exist before the baseline is taken
    model.zero_grad(set_to_none=True)
    baseline = _rss_peak_bytes()
    if mode == "adamw_unsharded":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        for _ in range(6):
            microbatch()
            opt.step()
            opt.zero_grad(set_to_none=False)  # grads stay allocated, as in a training loop
        tracked = {
            "model": sum(p.numel() * 4 for p in model.parameters()),
            "grads": sum(p.grad.numel() * 4 for p in model.parameters()),
            "optimizer_state": sum(v.numel() * v.element_size() for s in opt.state.values()
                                   for v in s.values() if torch.is_tensor(v)),  # fmt: skip
        }
    else:
        if mode == "acco_hsdp":
            from acco_hooks import ACCOHSDPOptimizer

            opt = ACCOHSDPOptimizer(model, torch.optim.AdamW, mode="acco", lr=1e-4)
        else:
            opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode=mode, lr=1e-4)
        checkpoint_bytes = {}
        for round_index in range(1, 7):
            microbatch()
            opt.step()
            if round_index in (5, 6):  # acco: after an estimate round (5) and an update (6)
                checkpoint_bytes[f"after_round_{round_index}"] = _saved_bytes(opt.state_dict())
        opt.flush()
        tracked = opt.engine.memory_bytes()
        opt.close()
        return {"tracked_bytes": tracked, "rss_growth_bytes": _rss_peak_bytes() - baseline,
                "params": sum(p.numel() for p in model.parameters()),
                "model_bytes": sum(_local(p).numel() * p.element_size() for p in model.parameters()),
                "checkpoint_bytes": checkpoint_bytes}  # fmt: skip
    return {"tracked_bytes": tracked, "rss_growth_bytes": _rss_peak_bytes() - baseline,
            "params": sum(p.numel() for p in model.parameters())}  # fmt: skip


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


def _saved_bytes(state: dict) -> int:
    """Bytes ``torch.save`` writes for this rank's engine state."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.tell()


def _fully_shard_2x2(model: torch.nn.Module, world_size: int) -> torch.nn.Module:
    """FSDP2 on a (replicate=2, shard=world/2) mesh, one unit per block as torchtitan does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    fully_shard(model.tok_embeddings, mesh=mesh)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard([model.norm, model.output], mesh=mesh)
    return fully_shard(model, mesh=mesh)


def spec_prediction(params: int, n: int) -> dict:
    """The spec's table for an fp32 model, fp32 accumulation and fp32 on the wire."""
    return {"model": 4 * params, "grad_accumulator": 4 * params, "comm_buffer": 4 * params,
            "master_shard": 4 * params // n, "optimizer_state": 8 * params // n}  # fmt: skip


def main() -> None:
    results = {}
    for mode in ("adamw_unsharded", "ddp", "dpu", "acco", "acco_hsdp"):
        world = {"adamw_unsharded": 1, "acco_hsdp": 4}.get(mode, 2)
        results[mode] = run_ranks("benchmarks.memory:run", world, mode)[0]
    params = results["acco"]["params"]
    results["spec_prediction_acco_n2"] = spec_prediction(params, 2)
    results["estimate_step_rss_cost_bytes"] = (
        results["acco"]["rss_growth_bytes"] - results["dpu"]["rss_growth_bytes"]
    )
    mib = 1 << 20
    print(f"parameters: {params:,} ({4 * params / mib:.1f} MiB fp32), 2 ranks")
    print(f"{'category':<18}" + "".join(f"{m:>17}" for m in ("spec (acco)", "acco", "dpu", "ddp")))
    for cat in ("model", "grad_accumulator", "comm_buffer", "master_shard", "carried_shard",
                "optimizer_state", "shard_staging"):  # fmt: skip
        cells = [results["spec_prediction_acco_n2"].get(cat)] + [
            results[m]["tracked_bytes"].get(cat) for m in ("acco", "dpu", "ddp")
        ]
        print(f"{cat:<18}" + "".join(f"{'-' if c is None else f'{c / mib:.1f} MiB':>17}" for c in cells))
    unsharded = results["adamw_unsharded"]["tracked_bytes"]
    print(f"unsharded AdamW: optimizer state {unsharded['optimizer_state'] / mib:.1f} MiB, "
          f"grads {unsharded['grads'] / mib:.1f} MiB")  # fmt: skip
    hsdp, acco = results["acco_hsdp"]["tracked_bytes"], results["acco"]["tracked_bytes"]
    # categories both hold (estimate_wire is empty with a float32 estimate)
    results["hsdp_reduction_vs_acco"] = {cat: acco[cat] / hsdp[cat] for cat in acco if hsdp[cat]}
    print("HSDP (2 replicas x 2 FSDP shards) vs acco over 2 plain replicas, per rank:")
    for cat, ratio in results["hsdp_reduction_vs_acco"].items():
        print(f"  {cat:<18}{acco[cat] / mib:8.1f} MiB -> {hsdp[cat] / mib:6.1f} MiB (/{ratio:.2f})")
    write_result(OUT, results)
    for mode in ("adamw_unsharded", "ddp", "dpu", "acco", "acco_hsdp"):
        print(f"peak RSS growth over training, {mode}: {results[mode]['rss_growth_bytes'] / mib:.1f} MiB")
    print(f"estimate step (acco - dpu peak RSS): {results['estimate_step_rss_cost_bytes'] / mib:+.1f} MiB")
    print("engine checkpoint per rank (torch.save of state_dict()) against the rank's model bytes:")
    for mode in ("ddp", "dpu", "acco", "acco_hsdp"):
        model_bytes = results[mode]["model_bytes"]
        cells = ", ".join(f"{when.replace('_', ' ')}: {size / mib:.1f} MiB ({size / model_bytes:.2f}x)"
                          for when, size in results[mode]["checkpoint_bytes"].items())  # fmt: skip
        print(f"  {mode:<10} model {model_bytes / mib:.1f} MiB; {cells}")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
