"""HSDP + ACCO: FSDP's gradient reduce-scatter once per round or every micro-batch.

    python -m benchmarks.hsdp_sync         # ~2 min, 4 gloo ranks (2 replicas x 2 FSDP shards)

Both settings on torchtitan's llama3 debug model, 4 micro-batches per round, alternating (twice
each): FSDP reduce-scatter calls per round, seconds per round and the growth of the peak RSS
(the largest of the 4 ranks, median of the 2 runs). docs/hsdp.md ("One reduce-scatter per
round") reads them. Writes outputs/results/hsdp_sync.json (``--out``; the published file:
docs/results/hsdp_sync.json).
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch
import torch.distributed as dist

from benchmarks.harness import add_out_option, run_ranks, write_result
from benchmarks.memory import MIB, debug_model, microbatch, rss_peak_bytes

MICROBATCHES, ROUNDS, WARMUP = 4, 8, 2
SETTINGS = {"once_per_round": False, "every_microbatch": True}  # name -> sync_every_microbatch


def run(rank: int, world_size: int, sync_every: bool) -> dict:
    from acco_hooks import ACCOHSDPOptimizer

    model = debug_model(world_size, hsdp=True)
    opt = ACCOHSDPOptimizer(model, torch.optim.AdamW, mode="acco", lr=1e-4,
                            accumulation_steps=MICROBATCHES,
                            sync_every_microbatch=sync_every)  # fmt: skip
    generator = torch.Generator().manual_seed(rank)
    baseline = rss_peak_bytes()
    round_times, round_calls = [], []
    calls = [0]
    reduce_scatter = dist.reduce_scatter_single

    def counting_reduce_scatter(*args, **kwargs):
        calls[0] += 1
        return reduce_scatter(*args, **kwargs)

    # what FSDP2 calls; not a MagicMock(wraps=...): it would keep every call's tensors alive
    with mock.patch.object(dist, "reduce_scatter_single", counting_reduce_scatter):
        for r in range(ROUNDS):
            start, calls[0] = time.perf_counter(), 0
            for _ in range(MICROBATCHES):
                microbatch(model, torch.randint(0, 2048, (2, 129), generator=generator))
                opt.step()
            if r >= WARMUP:
                round_times.append(time.perf_counter() - start)
                round_calls.append(calls[0])
        opt.flush()
    opt.close()
    return {"seconds_per_round": statistics.median(round_times),
            "reduce_scatters_per_round": statistics.median(round_calls),
            "rss_growth_bytes": rss_peak_bytes() - baseline}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_option(parser, "hsdp_sync")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    samples: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for _ in range(2):
        for name, sync_every in SETTINGS.items():
            per_rank = run_ranks("benchmarks.hsdp_sync:run", 4, sync_every)
            samples[name].append({k: max(r[k] for r in per_rank) for k in per_rank[0]})
    results = {name: {k: statistics.median(s[k] for s in runs) for k in runs[0]}
               for name, runs in samples.items()}  # fmt: skip
    once, every = results["once_per_round"], results["every_microbatch"]
    results["ratios_every_over_once"] = {k: every[k] / once[k] for k in once if once[k]}
    results["setup"] = {"model": "llama3 debugmodel (6.2M params)", "replicas": 2,
                        "fsdp_shards": 2, "microbatches_per_round": MICROBATCHES,
                        "microbatch": "2 x 128 tokens",
                        "backend": "gloo, loopback, 2 CPU cores"}  # fmt: skip
    out = write_result(args.out, results)
    print(f"{'FSDP reduce-scatter':<22}{'calls/round':>12}{'s/round':>10}{'peak RSS growth':>18}")
    for name in SETTINGS:
        r = results[name]
        print(f"{name:<22}{r['reduce_scatters_per_round']:>12.0f}{r['seconds_per_round']:>10.3f}"
              f"{r['rss_growth_bytes'] / MIB:>14.1f} MiB")  # fmt: skip
    ratios = results["ratios_every_over_once"]
    print(f"every / once: time x{ratios['seconds_per_round']:.2f}, "
          f"peak RSS growth x{ratios.get('rss_growth_bytes', float('nan')):.2f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
