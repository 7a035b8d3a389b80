"""What the ranks of a model replica pay to agree on each round's end under
``accumulate_until_ready``, beside the micro-batch they agree after.

    python -m benchmarks.replica_agreement                  # ~1 min on 2 cores
    python -m benchmarks.replica_agreement --out docs/results/replica_agreement.json

4 gloo ranks on loopback, 2 replicas of 2 FSDP ranks (``ACCOHSDPOptimizer`` over torchtitan's
llama3 debug model, 4 sequences of 128 tokens per micro-batch). Each rank times, on its
training thread, the agreement itself (``EngineGroups.replica_waits``: one all-reduce of one
value over the replica's two ranks) as the engine runs it, after each micro-batch past
``accumulation_steps``, while the other replica's slow link keeps the round in flight; and the
micro-batch's forward and backward. Writes ``outputs/results/replica_agreement.json``
(``--out``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks import harness
from benchmarks.harness import LOCAL_BATCH, SEQ_LEN

WORLD, REPLICAS = 4, 2


def worker(rank: int, world_size: int, rounds: int) -> dict:
    """One rank: its agreements' and its micro-batches' seconds."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.models.llama3 import Transformer, llama3_args

    from acco_hooks import ACCOHSDPOptimizer
    from acco_hooks.engine.communication import EngineGroups

    torch.set_num_threads(1)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (REPLICAS, world_size // REPLICAS),
                            mesh_dim_names=("dp_replicate", "dp_shard"))  # fmt: skip
    args = llama3_args["debugmodel"]
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = ACCOHSDPOptimizer(model, torch.optim.AdamW, mode="acco", accumulation_steps=2,
                            accumulate_until_ready=True, max_microbatches_per_round=6,
                            lr=1e-3, sync_every_microbatch=True)  # fmt: skip
    engine, agreements, microbatches = opt.engine, [], []
    timed = EngineGroups.replica_waits

    def timed_waits(self, in_flight, device):  # the engine's own call, timed
        start = time.perf_counter()
        waits = timed(self, in_flight, device)
        agreements.append(time.perf_counter() - start)
        return waits

    EngineGroups.replica_waits = timed_waits
    generator = torch.Generator().manual_seed(rank)
    slow_link = rank // (world_size // REPLICAS) == 1  # the second replica's rounds end late
    while engine.round_index < rounds:
        tokens = torch.randint(0, args.vocab_size, (LOCAL_BATCH, SEQ_LEN + 1), generator=generator)
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                 tokens[:, 1:].flatten())  # fmt: skip
        loss.backward()
        microbatches.append(time.perf_counter() - start)
        if slow_link and engine.microbatches_in_round == 1:
            time.sleep(0.5)  # holds this replica's round end, and so the other's communication
        opt.step()
    opt.flush()
    opt.close()
    dist.barrier()
    return {"agreement_s": agreements, "microbatch_s": microbatches}


def measure(args: argparse.Namespace) -> dict:
    ranks = harness.run_ranks("benchmarks.replica_agreement:worker", WORLD, args.rounds)
    agreements = [t for rank in ranks for t in rank["agreement_s"]]
    microbatches = [t for rank in ranks for t in rank["microbatch_s"]]
    results = {
        **harness.header(), "model": "torchtitan llama3 debugmodel (6.16M parameters)",
        "layout": "2 replicas x 2 FSDP ranks, gloo on loopback", "rounds": args.rounds,
        "local_batch": LOCAL_BATCH, "seq_len": SEQ_LEN, "agreements": len(agreements),
        "agreement_median_s": statistics.median(agreements),
        "agreement_p90_s": sorted(agreements)[int(0.9 * (len(agreements) - 1))],
        "microbatch_median_s": statistics.median(microbatches),
        "per_rank": ranks,
    }  # fmt: skip
    results["agreement_over_microbatch"] = (
        results["agreement_median_s"] / results["microbatch_median_s"]
    )
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12, help="rounds every rank runs")
    harness.add_out_option(parser, "replica_agreement")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    results = measure(args)
    print(f"agreement: median {1e6 * results['agreement_median_s']:.0f} us "
          f"(p90 {1e6 * results['agreement_p90_s']:.0f} us) over {results['agreements']}; "
          f"micro-batch: median {1e3 * results['microbatch_median_s']:.0f} ms; "
          f"ratio {results['agreement_over_microbatch']:.2e}")  # fmt: skip
    harness.write_result(args.out, results)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
