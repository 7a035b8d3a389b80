"""What an ACCO round costs beyond its compute when there is nothing to hide, before and after.

    git worktree add /tmp/before 567055e                 # the engine before mode="auto"
    sudo python -m benchmarks.round_overhead --before /tmp/before   # ~10 min

2 ranks on the uncapped netbed, the MLP below, each arm importing its checkout's acco_hooks
through ``PYTHONPATH``; per round, its time, the compute in it and their difference (the fixed
cost), the arms interleaved ``--repeats`` times. What it shows: docs/results.md, section 8.
Writes ``outputs/results/round_overhead.json`` (``--out``; the published file:
``docs/results/round_overhead.json``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIDTH, BATCH, UPDATE = 724, 256, 20  # two 724x724 layers: 1.05M parameters
HALF = UPDATE // 2
ARMS = {  # name: (checkout, settings); before: foreach AdamW (what the issue measured)
    "ddp_before": ("before", {"mode": "ddp", "accumulation_steps": UPDATE, "foreach": True}),
    "acco_before": ("before", {"mode": "acco", "accumulation_steps": HALF, "foreach": True}),
    "ddp": ("after", {"mode": "ddp", "accumulation_steps": UPDATE, "fused": True}),
    "acco_foreach": ("after", {"mode": "acco", "accumulation_steps": HALF, "foreach": True}),
    "acco": ("after", {"mode": "acco", "accumulation_steps": HALF, "fused": True}),
    "acco_bf16": ("after", {"mode": "acco", "accumulation_steps": HALF, "fused": True,
                            "estimate_dtype": "bfloat16"}),
    "acco_fp8": ("after", {"mode": "acco", "accumulation_steps": HALF, "fused": True,
                           "estimate_dtype": "float8_e4m3fn"}),
}  # fmt: skip


def mlp():
    """The MLP (seeded), its input, and the fixed gradient that ``--compute sleep`` adds."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
    fixed = [torch.full_like(p, 1e-3) for p in model.parameters()]
    return model, torch.randn(BATCH, WIDTH), fixed


def microbatch(model, x, fixed, engine, args: argparse.Namespace) -> float:
    """One micro-batch, its compute time: forward and backward (``real``), or a sleep while the
    core is free, as when a GPU computes, and a fixed gradient (``sleep``)."""
    start = time.perf_counter()
    if args.compute == "real":
        model(x).pow(2).mean().backward()
    else:
        time.sleep(args.microbatch_s)
        for p, g in zip(model.parameters(), fixed):
            engine.accumulate_grad(p, g)
    return time.perf_counter() - start


def worker(args: argparse.Namespace) -> None:
    """One rank: ``args.rounds`` rounds through the public API of whichever acco_hooks is on
    the path (``step()`` returns whether a round ended, in every version)."""
    import torch
    import torch.distributed as dist

    from acco_hooks import ACCOOptimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, x, fixed = mlp()
    opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, **json.loads(args.settings))
    rounds, computed, last = [], 0.0, time.perf_counter()
    while len(rounds) < args.rounds:
        computed += microbatch(model, x, fixed, opt.engine, args)
        if opt.step():
            now = time.perf_counter()
            rounds.append((now - last, computed))
            last, computed = now, 0.0
    opt.flush()
    if dist.get_rank() == 0:
        timed = rounds[2:]
        this_checkout("benchmarks/harness.py").emit({
            "round_s": statistics.median(r for r, _ in timed),
            "compute_s": statistics.median(c for _, c in timed),
            "overhead_s": statistics.median(r - c for r, c in timed),
            "comm_per_round_s": opt.engine.advisor.figures.get("comm_per_round_s"),
        })  # fmt: skip
    opt.close()
    this_checkout("scaffolding/process_exit.py").finish()  # no abort at exit


def this_checkout(path: str):
    """A module of this checkout, loaded by its path: the arm's checkout comes first on the
    worker's path, and an older one has no such module."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(args: argparse.Namespace) -> dict:
    from benchmarks.harness import header, result_lines, run_on_link, write_result
    from benchmarks.netbed import two_host_link

    trees = {"before": str(Path(args.before).resolve()), "after": str(ROOT)}
    results: dict = {
        **header(), "trees": trees,
        "model": f"MLP 2 x Linear({WIDTH}, {WIDTH}), 1.05M parameters, batch {BATCH}",
        "microbatches_per_update": UPDATE, "rounds": args.rounds, "repeats": args.repeats,
        "link": "netbed, no cap", "runs": {},
    }  # fmt: skip
    with two_host_link() as link:
        for compute in args.compute:
            runs: dict = {name: [] for name in ARMS}
            for _ in range(args.repeats):
                for name, (tree, settings) in ARMS.items():
                    # a script, not -m: the arm's checkout, first on the path, has no such module
                    argv = [sys.executable, str(Path(__file__).resolve()), "--worker",
                            "--settings", json.dumps(settings), "--compute", compute,
                            "--microbatch-s", str(args.microbatch_s), "--rounds",
                            str(args.rounds)]  # fmt: skip
                    out = run_on_link(link, argv, env={"PYTHONPATH": trees[tree]}, timeout_s=900)
                    runs[name].append(result_lines(out)[-1])  # with its checkout's acco_hooks
                    print(f"{compute} {name}: {runs[name][-1]}", flush=True)
            summary = {}
            for name, repeats in runs.items():
                figures = {key: statistics.median(r[key] for r in repeats)
                           for key in ("round_s", "compute_s", "overhead_s")}  # fmt: skip
                figures["update_s"] = figures["round_s"] * (1 if name.startswith("ddp") else 2)
                summary[name] = figures
            for name, figures in summary.items():
                ddp = summary["ddp_before" if name.endswith("_before") else "ddp"]
                figures["speedup_vs_ddp"] = ddp["update_s"] / figures["update_s"]
            results["runs"][compute] = {"runs": runs, "summary": summary}
            write_result(args.out, results)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--settings", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--before", default=None, help="the checkout to compare against")
    parser.add_argument("--compute", nargs="+", default=["real", "sleep"],
                        choices=["real", "sleep"])  # fmt: skip
    parser.add_argument("--microbatch-s", type=float, default=0.009,
                        help="--compute sleep: seconds per micro-batch")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=24, help="rounds per run (2 untimed)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None,
                        help="the result file (default: outputs/results/round_overhead.json; --out "
                        "docs/results/round_overhead.json rewrites the published one)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.out is None and not args.worker:
        # not at import: a worker runs with another checkout's benchmarks on its path
        from benchmarks.harness import result_file

        args.out = result_file("round_overhead")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        args.compute = args.compute[0]
        worker(args)
        return
    if args.before is None:
        raise SystemExit("round_overhead: --before CHECKOUT is needed (git worktree add ...)")
    for compute, result in measure(args)["runs"].items():
        for name, figures in result["summary"].items():
            print(f"{compute:5s} {name:13s} round {figures['round_s'] * 1e3:6.1f} ms, compute "
                  f"{figures['compute_s'] * 1e3:6.1f} ms, fixed cost "
                  f"{figures['overhead_s'] * 1e3:5.1f} ms per round; per token "
                  f"{figures['speedup_vs_ddp']:.3f}x its ddp")  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
