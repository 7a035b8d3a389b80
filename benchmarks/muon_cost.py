"""What Muon on whole parameters costs ACCO, per token, against synchronous ZeRO-1 with the same
recipe.

    sudo python -m benchmarks.muon_cost                     # ~10 min on 2 cores
    python -m benchmarks.muon_cost --out docs/results/muon_cost.json   # (sudo) the published

torchtitan's llama3 debug model in a plain loop through ``ACCOOptimizer``, two ranks on the
netbed (one core each), at equal tokens per update: ``acco`` with k micro-batches per round
against the engine's ``ddp`` with 2k, for two recipes:

- ``adamw``: AdamW on every parameter (the flat layout);
- ``muon``: ``torch.optim.Muon`` on the hidden matrices (whole parameters, each on the rank
  that owns it) and AdamW on the embeddings, the output projection and the norms, the
  standard recipe.

Per arm: the median time per update (after warm-up), the shard optimizer's step on the
communication thread (timed with torch's ``register_step_pre_hook`` / ``post_hook``: real
updates, and acco's estimate steps, which for Muon step a snapshot), the bytes each round
sends (the padding of the whole-parameter layout included) and ``engine.memory_bytes()``.
On this CPU the step runs on the core the compute uses, so whatever it costs comes out of the
overlap; on a GPU it is a kernel stream of its own (Moonlight reports Newton–Schulz at 1–3 %
of forward and backward). Also the layout's padding by world size, for this model and for
Llama 3 8B (``--padding-only`` computes it alone). Writes ``outputs/results/muon_cost.json``
(``--out``).

``--layout hsdp``: each host one replica of 2 FSDP ranks (both on its core), through
``ACCOHSDPOptimizer``: no rank holds a whole matrix, and each round brings every Muon matrix
together on the rank of the 2 × 2 grid that owns it and sends it back (two all-to-alls over the
replica's FSDP group, inside the host: ``acco_hooks/engine/whole_pieces.py``). Per arm also the
seconds of those exchanges per round and the bytes each rank sends in them, beside the round's
whole time on the communication thread. Its results go under ``"hsdp"`` in the same file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from benchmarks import harness
from benchmarks.harness import LOCAL_BATCH, SEQ_LEN

RECIPES = ("adamw", "muon")
MODES = {"acco": 1, "ddp": 2}  # micro-batches per round, in units of k
MUON_OPTIONS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1,
                "adjust_lr_fn": "match_rms_adamw"}  # fmt: skip
ADAMW_OPTIONS = {"lr": 8e-4, "betas": (0.9, 0.95), "weight_decay": 0.1}
WARMUP_UPDATES = 2


def recipe_groups(model, recipe: str, ns_steps: int | None = None) -> list[dict]:
    """The parameter groups of ``recipe`` (module docstring); ``ns_steps``: Muon's Newton–Schulz
    iterations where not torch's default (5)."""
    import torch

    named = list(model.named_parameters())
    if recipe == "adamw":
        return [{"params": named}]
    hidden = [(n, p) for n, p in named if p.ndim == 2 and n.startswith("layers.")]
    rest = [(n, p) for n, p in named if not (p.ndim == 2 and n.startswith("layers."))]
    muon = {**MUON_OPTIONS, **({} if ns_steps is None else {"ns_steps": ns_steps})}
    return [{"params": hidden, "optimizer_class": torch.optim.Muon, **muon},
            {"params": rest}]  # fmt: skip


# Hidden matrices of Llama 3 8B per layer (32 layers): wq, wk, wv, wo, w1, w2, w3
LLAMA3_8B_LAYER = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096),
                   (4096, 14336), (14336, 4096)]  # fmt: skip
WORLD_SIZES = (2, 4, 8, 16, 32, 64, 128)


def padding_by_world_size() -> dict:
    """The whole-parameter layout's padding (a fraction of the vector it sends) of the Muon
    group, by data-parallel world size: the debug model's 6 layers and Llama 3 8B's 32."""
    from acco_hooks.engine.layout import whole_parameter_layout

    models = {"debugmodel": [(256, 256)] * 4 + [(768, 256), (256, 768), (768, 256)],
              "llama3_8b": LLAMA3_8B_LAYER}  # fmt: skip
    layers = {"debugmodel": 6, "llama3_8b": 32}
    out = {}
    for name, shapes in models.items():
        numels = [a * b for a, b in shapes] * layers[name]
        out[name] = {n: whole_parameter_layout(numels, n).padding
                     / whole_parameter_layout(numels, n).padded_numel for n in WORLD_SIZES}  # fmt: skip
    return out


LAYOUTS = ("rank", "hsdp")  # one rank a replica; 2 FSDP ranks a replica (module docstring)


def worker(rank: int, world_size: int, recipe: str, mode: str, k: int, updates: int,
           layout: str = "rank", ns_steps: int | None = None) -> dict:  # fmt: skip
    """One rank of one arm, its process group set up: its timings and sizes. ``ns_steps``:
    the tests' (one Newton–Schulz iteration: in bfloat16 on a CPU without AVX-512, torch's 5
    are most of a short run's time, and the sizes and counts they check do not change)."""
    import torch
    from torchtitan.models.llama3 import Transformer, llama3_args

    from acco_hooks import ACCOHSDPOptimizer, ACCOOptimizer
    from acco_hooks.engine.whole_pieces import PieceExchange

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Transformer(llama3_args["debugmodel"])
    with torch.no_grad():
        model.init_weights()
    per_round = k * MODES[mode]
    options = dict(mode=mode, accumulation_steps=per_round, **ADAMW_OPTIONS)
    exchanges: list[tuple[float, int]] = []  # (seconds, bytes sent to the other FSDP ranks)
    if layout == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, world_size // 2),
                                mesh_dim_names=("dp_replicate", "dp_shard"))  # fmt: skip
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        # each exchange of whole matrices, timed on the communication thread
        for name in ("gather", "scatter"):
            plain = getattr(PieceExchange, name)

            def timed(self, *args, plain=plain):
                started = time.perf_counter()
                plain(self, *args)
                exchanges.append((time.perf_counter() - started, self.bytes_per_exchange()))

            setattr(PieceExchange, name, timed)
        opt = ACCOHSDPOptimizer(model, torch.optim.AdamW,
                                params=recipe_groups(model, recipe, ns_steps), **options)  # fmt: skip
        warm_exchanges = len(exchanges)  # the masters' gather when the engine was built
    else:
        opt = ACCOOptimizer(recipe_groups(model, recipe, ns_steps), torch.optim.AdamW,
                            **options)  # fmt: skip
    # each class's steps on the communication thread: real updates, and acco's estimates of a
    # class without a copy-free one (Muon's: a step of a snapshot)
    steps: dict[str, list[float]] = {}
    shard = opt.engine.optimizer
    for part in getattr(shard, "optimizers", [shard]):
        name, started = type(part).__name__, []
        part.register_step_pre_hook(lambda *_, started=started: started.append(time.perf_counter()))
        part.register_step_post_hook(lambda *_, name=name, started=started: steps.setdefault(
            name, []).append(time.perf_counter() - started[-1]))  # fmt: skip
    generator = torch.Generator().manual_seed(rank)
    vocab = llama3_args["debugmodel"].vocab_size
    update_ends = []
    rounds_per_update = 2 if mode == "acco" else 1
    for _ in range(WARMUP_UPDATES + updates):
        for _ in range(rounds_per_update * per_round):
            tokens = torch.randint(vocab, (LOCAL_BATCH, SEQ_LEN + 1), generator=generator)
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
        update_ends.append(time.perf_counter())
    opt.flush()
    layouts = opt.engine.layouts
    reduce_bytes = 4  # float32 on the wire both ways
    result = {
        "update_s_all": [b - a for a, b in zip(update_ends[WARMUP_UPDATES - 1 :],
                                               update_ends[WARMUP_UPDATES:])],
        # per class, every step after the warm-up (its updates, and its estimates in acco)
        "shard_step_s_all": {name: times[len(times) * WARMUP_UPDATES // (WARMUP_UPDATES + updates):]
                             for name, times in steps.items()},
        "memory_bytes": opt.engine.memory_bytes(),
        "layouts": [{"kind": layout.kind, "padded_numel": layout.padded_numel,
                     "padding": layout.padding} for layout in layouts],
        # each round: a reduce-scatter of the padded vectors and an all-gather of them
        "bytes_per_round": 2 * reduce_bytes * sum(layout.padded_numel for layout in layouts),
        "advisor": opt.engine.advisor.figures,
    }  # fmt: skip
    if layout == "hsdp":
        rounds = (WARMUP_UPDATES + updates) * rounds_per_update
        timed = exchanges[warm_exchanges:]
        result["whole_exchange_s_per_round"] = sum(t for t, _ in timed) / rounds
        result["whole_exchange_bytes_per_round"] = sum(b for _, b in timed) / rounds
    opt.close()
    return result


def measure(args: argparse.Namespace) -> dict:
    from benchmarks.netbed import two_host_link

    k = args.microbatches
    results: dict = {
        **harness.header(), "model": "torchtitan llama3 debugmodel (6.16M parameters)",
        "microbatches_per_round_acco": k, "microbatches_per_update": 2 * k,
        "local_batch": LOCAL_BATCH, "seq_len": SEQ_LEN, "updates": args.updates,
        "warmup_updates": WARMUP_UPDATES, "repeats": args.repeats, "muon": MUON_OPTIONS,
        "adamw": ADAMW_OPTIONS,
        "rates": {}, "padding_fraction": padding_by_world_size(),
    }  # fmt: skip
    if args.layout == "hsdp":  # beside the one-rank-a-replica figures of the same file
        previous = json.loads(args.out.read_text()) if args.out.exists() else {}
        results = {**previous, "hsdp": {**results, "layout": "2 replicas x 2 FSDP ranks"}}
        table = results["hsdp"]
    else:
        table = results
    per_host = 2 if args.layout == "hsdp" else 1
    with two_host_link() as link:
        for rate in args.rates:
            link.set_rate(rate)
            row = table["rates"][rate] = {"runs": {}}
            for repeat in range(args.repeats):  # the arms in turn, so that load falls on all
                for recipe in RECIPES:
                    for mode in MODES:
                        argv = [sys.executable, "-m", "benchmarks.muon_cost", "--worker", recipe,
                                mode, str(k), str(args.updates), args.layout]  # fmt: skip
                        output = harness.run_on_link(link, argv, timeout_s=1800,
                                                     ranks_per_host=per_host)  # fmt: skip
                        run = harness.result_lines(output)[-1]
                        row["runs"].setdefault(f"{recipe}_{mode}", []).append(run)
                        steps = ", ".join(f"{name} {statistics.median(t) * 1e3:.0f} ms"
                                          for name, t in run["shard_step_s_all"].items())
                        exchange = ("" if "whole_exchange_s_per_round" not in run else
                                    f"; whole matrices brought together and back "
                                    f"{run['whole_exchange_s_per_round'] * 1e3:.0f} ms, "
                                    f"{run['whole_exchange_bytes_per_round'] / 2**20:.2f} MiB "
                                    f"sent a round")  # fmt: skip
                        print(f"{rate:>8} #{repeat} {recipe:>6} {mode:>5}: "
                              f"{statistics.median(run['update_s_all']):.3f} s/update; steps on "
                              f"the communication thread: {steps}{exchange}",
                              flush=True)  # fmt: skip
            for recipe in RECIPES:
                per_repeat = [
                    statistics.median(d["update_s_all"]) / statistics.median(a["update_s_all"])
                    for a, d in zip(row["runs"][f"{recipe}_acco"], row["runs"][f"{recipe}_ddp"])
                ]  # fmt: skip
                row[f"{recipe}_speedup_per_token"] = statistics.median(per_repeat)
                row[f"{recipe}_speedup_per_token_all"] = per_repeat
                for mode in MODES:
                    runs = row["runs"][f"{recipe}_{mode}"]
                    row[f"{recipe}_{mode}_update_s"] = statistics.median(
                        t for run in runs for t in run["update_s_all"])
                    row[f"{recipe}_{mode}_shard_step_s"] = {
                        name: statistics.median(t for run in runs
                                                for t in run["shard_step_s_all"][name])
                        for name in runs[0]["shard_step_s_all"]
                    }  # fmt: skip
                print(f"{rate:>8} {recipe:>6}: acco over ddp per token "
                      f"{row[f'{recipe}_speedup_per_token']:.2f}x (each repeat: "
                      + ", ".join(f"{v:.2f}" for v in per_repeat) + ")", flush=True)
            harness.write_result(args.out, results)
    return results


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        recipe, mode, k, updates, layout = argv[1], argv[2], int(argv[3]), int(argv[4]), argv[5]
        import torch.distributed as dist

        from scaffolding.process_exit import finish

        dist.init_process_group("gloo")
        result = worker(dist.get_rank(), dist.get_world_size(), recipe, mode, k, updates, layout)
        harness.emit(result)
        finish()  # scaffolding/process_exit.py: no abort at exit
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=lambda t: t.split(","), default="none,1gbit",
                        help="comma-separated tbf caps per host (none = no cap)")
    parser.add_argument("--microbatches", type=int, default=2,
                        help="k: micro-batches per acco round (ddp: 2k per update)")
    parser.add_argument("--updates", type=int, default=6, help="timed updates per arm")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every arm per cap")
    parser.add_argument("--layout", choices=LAYOUTS, default="rank",
                        help="rank: one rank a replica; hsdp: 2 FSDP ranks a replica, the Muon "
                             "matrices brought together on their owners (module docstring)")
    parser.add_argument("--padding-only", action="store_true",
                        help="(re)compute the padding table into --out, time nothing")
    harness.add_out_option(parser, "muon_cost")
    args = parser.parse_args(argv)
    if args.padding_only:
        results = json.loads(args.out.read_text())
        results["padding_fraction"] = padding_by_world_size()
        harness.write_result(args.out, results)
        print(json.dumps(results["padding_fraction"], indent=1))
        return
    results = measure(args)
    table = results["hsdp"] if args.layout == "hsdp" else results
    print(json.dumps({rate: {key: value for key, value in row.items()
                             if key.endswith("speedup_per_token")}
                      for rate, row in table["rates"].items()}))  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
