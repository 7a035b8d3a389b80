"""Communication-only round time of the ACCO engine on torchtitan's llama3 debug model.

Run as two ranks on the netbed (``benchmarks.throughput`` does): no forward or backward, only
what a ``mode="ddp"`` round end costs (reduce-scatter, the AdamW step of the 1/N shard,
all-gather), waited for. Prints one ``RESULT`` line: {"comm_s": [...], "memory_bytes": ...,
"params": N}, ``memory_bytes`` being ``ACCOEngine.memory_bytes()`` after the rounds.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torchtitan.models.llama3 import Transformer, llama3_args

from acco_hooks import ACCOEngine
from benchmarks.harness import emit
from scaffolding.process_exit import finish


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Transformer(llama3_args["debugmodel"])
    with torch.no_grad():  # torchtitan initialises in place
        model.init_weights()
    engine = ACCOEngine(model.named_parameters(), torch.optim.AdamW, mode="ddp", lr=1e-4)
    grads = [torch.zeros_like(p) for p in engine.params]
    times = []
    for _ in range(args.rounds + 1):
        for p, g in zip(engine.params, grads):
            engine.accumulate_grad(p, g)
        start = time.perf_counter()
        engine.microbatch_done()
        times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        emit({"comm_s": times[1:], "memory_bytes": engine.memory_bytes(),
              "params": sum(p.numel() for p in engine.params)})  # fmt: skip
    engine.close()
    finish()  # scaffolding/process_exit.py: no abort at exit


if __name__ == "__main__":
    main()
