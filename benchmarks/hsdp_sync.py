"""HSDP + ACCO: FSDP's gradient reduce-scatter once per round or every micro-batch.

    python -m benchmarks.hsdp_sync         # ~2 min, 4 gloo ranks (2 replicas x 2 FSDP shards)

Within a round the FSDP ranks of a replica can either reduce-scatter every micro-batch's
gradients (the engine sums the shards; FSDP frees the unsharded gradients at once) or
accumulate unsharded gradients and reduce-scatter once, on the round's last micro-batch
(``requires_gradient_sync`` off before it, the default). This runs both on torchtitan's llama3
debug model with 4 micro-batches per round and reports, per setting: FSDP reduce-scatter calls
per round, seconds per round, and the growth of the peak RSS over training. The two settings
alternate (twice each); figures are medians. Writes docs/results/hsdp_sync.json.
"""

from __future__ import annotations

import resource
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.harness import RESULTS, run_ranks, write_result

OUT = RESULTS / "hsdp_sync.json"
MICROBATCHES, ROUNDS, WARMUP = 4, 8, 2


def run(rank: int, world_size: int, sync_every: bool) -> dict:
    from torchtitan.models.llama3 import Transformer, llama3_args

    from acco_hooks import ACCOHSDPOptimizer
    from benchmarks.memory import _fully_shard_2x2

    torch.manual_seed(0)
    model = Transformer(llama3_args["debugmodel"])
    with torch.no_grad():
        model.init_weights()
    model = _fully_shard_2x2(model, world_size)
    calls = [0]
    reduce_scatter = dist.reduce_scatter_single

    def counting_reduce_scatter(*args, **kwargs):
        calls[0] += 1
        return reduce_scatter(*args, **kwargs)

    dist.reduce_scatter_single = counting_reduce_scatter  # what FSDP2 calls
    opt = ACCOHSDPOptimizer(model, torch.optim.AdamW, mode="acco", lr=1e-4,
                            accumulation_steps=MICROBATCHES, sync_every_microbatch=sync_every)  # fmt: skip
    generator = torch.Generator().manual_seed(rank)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    round_times, round_calls = [], []
    for r in range(ROUNDS):
        start, calls[0] = time.perf_counter(), 0
        for _ in range(MICROBATCHES):
            tokens = torch.randint(0, 2048, (2, 129), generator=generator)
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            opt.step()
        if r >= WARMUP:
            round_times.append(time.perf_counter() - start)
            round_calls.append(calls[0])
    opt.flush()
    opt.close()
    dist.reduce_scatter_single = reduce_scatter
    return {
        "seconds_per_round": statistics.median(round_times),
        "reduce_scatters_per_round": statistics.median(round_calls),
        "rss_growth_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline,
    }


def main() -> None:
    samples: dict[str, list[dict]] = {"once_per_round": [], "every_microbatch": []}
    for _ in range(2):
        for name, sync_every in (("once_per_round", False), ("every_microbatch", True)):
            per_rank = run_ranks("benchmarks.hsdp_sync:run", 4, sync_every)
            samples[name].append({k: max(r[k] for r in per_rank) for k in per_rank[0]})
    results = {
        name: {k: statistics.median(s[k] for s in runs) for k in runs[0]}
        for name, runs in samples.items()
    }
    once, every = results["once_per_round"], results["every_microbatch"]
    results["ratios_every_over_once"] = {k: every[k] / once[k] for k in once if once[k]}
    results["setup"] = {"model": "llama3 debugmodel (6.2M params)", "replicas": 2,
                        "fsdp_shards": 2, "microbatches_per_round": MICROBATCHES,
                        "microbatch": "2 x 128 tokens", "backend": "gloo, loopback, 2 CPU cores"}  # fmt: skip
    write_result(OUT, results)
    mib = 1 << 20
    print(f"{'FSDP reduce-scatter':<22}{'calls/round':>12}{'s/round':>10}{'peak RSS growth':>18}")
    for name in ("once_per_round", "every_microbatch"):
        r = results[name]
        print(f"{name:<22}{r['reduce_scatters_per_round']:>12.0f}{r['seconds_per_round']:>10.3f}"
              f"{r['rss_growth_bytes'] / mib:>14.1f} MiB")  # fmt: skip
    ratios = results["ratios_every_over_once"]
    print(f"every / once: time x{ratios['seconds_per_round']:.2f}, "
          f"peak RSS growth x{ratios.get('rss_growth_bytes', float('nan')):.2f}")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
