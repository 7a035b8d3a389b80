"""Time of the shard optimizer's step: torch.optim.AdamW for-loop vs foreach vs fused, on CPU.

    python -m benchmarks.shard_step            # a few seconds, one process, one thread

``AdamW.step()`` on one rank's flat fp32 master shard of the llama3 debug model over 2 ranks,
with debug_cpu_acco.toml's hyperparameters; the implementations take turns step by step, so
that the machine's load falls on all alike. docs/results.md reads the medians. Writes
``outputs/results/shard_step.json`` (``--out``; the published file:
``docs/results/shard_step.json``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.harness import add_out_option, header, write_result

PARAMS, WORLD_SIZE = 6_163_712, 2  # torchtitan llama3 debugmodel; ranks on the testbed
WARMUP, STEPS = 3, 20
HYPER = {"lr": 8e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
IMPLEMENTATIONS = {  # torchtitan's [optimizer] implementation -> AdamW keywords
    "for-loop": {"foreach": False, "fused": False},
    "foreach": {"foreach": True, "fused": False},
    "fused": {"foreach": False, "fused": True},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_option(parser, "shard_step")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    numel = -(-PARAMS // WORLD_SIZE)  # the engine's shard_numel: ceil(Φ / N)
    generator = torch.Generator().manual_seed(0)
    optimizers = {}
    for name, kwargs in IMPLEMENTATIONS.items():
        shard = torch.randn(numel, generator=generator).mul_(0.02)
        shard.grad = torch.randn(numel, generator=generator).mul_(1e-3)
        optimizers[name] = torch.optim.AdamW([shard], **HYPER, **kwargs)
    samples: dict[str, list[float]] = {name: [] for name in optimizers}
    for index in range(WARMUP + STEPS):
        for name, optimizer in optimizers.items():
            start = time.perf_counter()
            optimizer.step()
            elapsed = time.perf_counter() - start
            if index >= WARMUP:
                samples[name].append(elapsed)
    medians = {name: statistics.median(times) for name, times in samples.items()}
    results = {
        **header(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "shard": {"numel": numel, "dtype": "float32", "model_params": PARAMS,
                  "world_size": WORLD_SIZE},
        "optimizer": "torch.optim.AdamW", "hyperparameters": HYPER,
        "warmup_steps": WARMUP, "timed_steps": STEPS,
        "median_step_s": medians,
        "relative_to_for_loop": {name: m / medians["for-loop"] for name, m in medians.items()},
        "step_s_all": samples,
    }  # fmt: skip
    out = write_result(args.out, results)
    print(f"AdamW.step() on a flat fp32 shard of {numel:,} elements, 1 thread, "
          f"median of {STEPS} steps ({torch.__version__})")  # fmt: skip
    print(f"{'implementation':<16}{'median':>12}{'min':>12}{'max':>12}{'vs for-loop':>14}")
    for name, times in samples.items():
        relative = results["relative_to_for_loop"][name]
        print(f"{name:<16}{medians[name] * 1e3:>9.1f} ms{min(times) * 1e3:>9.1f} ms"
              f"{max(times) * 1e3:>9.1f} ms{relative:>13.2f}x")  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
