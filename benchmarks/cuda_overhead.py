"""ACCO's cost where there is nothing to hide: one GPU, against plain torchtitan.

    python -m benchmarks.cuda_overhead                 # one CUDA GPU, ~5 min
    python -m benchmarks.cuda_overhead --smoke         # any device: the debug model, 1 repeat, k = 1

One process trains a torchtitan llama3 ``--flavor`` through ``train_titan.py`` with one replica:
no byte crosses a network, so every difference is overhead. The default, ``bench_88m`` (88M
parameters), is added to torchtitan 0.2.2's flavors (``BENCH_FLAVORS``): the debug model is
launch-bound on a GPU. **Per token, at equal tokens per optimizer update:** ACCO's update spans
two rounds of k micro-batches (``--microbatches``); the other arms make one update of 2k:

- ``titan``: torchtitan without ACCO, its AdamW in ``--titan-optimizer``'s implementation;
- ``acco``: the engine in acco mode (update time: two rounds);
- ``ddp``: the engine's synchronous ZeRO-1 on one rank (the engine without the estimate).

Each arm runs ``--repeats`` times, interleaved, eager and (in the first ``--compiled-repeats``)
compiled. Time per update: the median over steps >= 3 of torchtitan's step time (tokens / its
``tps``); peak memory: its ``memory:``; overhead = T(arm) / T(titan) - 1 (target: <= 3 % for
acco). docs/cuda.md shows the results. Writes outputs/results/cuda_overhead.json (``--smoke``:
outputs/cuda_overhead_smoke.json; ``--out``: elsewhere, the published file being
docs/results/cuda_overhead.json) after every run, and each run's log to outputs/cuda_overhead/.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import runpy
import statistics
import sys
import time

from benchmarks import harness

SMOKE_RESULTS = harness.ROOT / "outputs" / "cuda_overhead_smoke.json"
LOGS = harness.ROOT / "outputs" / "cuda_overhead"  # {arm}_{repeat}.log; the arms' dump folders
BENCH_FLAVORS = {"bench_88m": {"dim": 768, "n_layers": 12, "n_heads": 12, "vocab_size": 2048,
                               "rope_theta": 500000}}  # fmt: skip
RUN_RANK = "--run-rank"  # the argument that makes this module one rank's entry (run_rank)
ONE_REPLICA = ("--parallelism.data_parallel_replicate_degree", "1")
# arm -> (config, extra arguments, micro-batches per step in units of k, steps per update)
ARMS: dict[str, tuple[str, tuple[str, ...], int, int]] = {
    "titan": ("debug_cpu_titan_ddp.toml", ONE_REPLICA, 2, 1),
    "acco": ("debug_cpu_acco.toml", (*ONE_REPLICA, "--acco.mode", "acco"), 1, 2),
    "ddp": ("debug_cpu_acco.toml", (*ONE_REPLICA, "--acco.mode", "ddp"), 2, 1),
}


def run_arm(arm: str, compiled: bool, args: argparse.Namespace, log) -> dict:
    """One training run of ``arm``: its time per update and peak memory; its output to ``log``."""
    config, extra, micro_units, steps_per_update = ARMS[arm]
    microbatches = micro_units * args.microbatches
    if arm == "titan":  # the job config's for-loop suits the CPU; torchtitan's default is fused
        extra = (*extra, "--optimizer.implementation", args.titan_optimizer)
    extra = (*extra, "--model.flavor", args.flavor, *(("--compile.enable",) if compiled else ()))
    rank_args = harness.titan_args(config, extra, args.updates * steps_per_update, microbatches,
                                   1, str(LOGS / arm), local_batch=args.local_batch,
                                   seq_len=args.seq_len)[2:]  # fmt: skip
    start = time.perf_counter()
    command = harness.torchrun(1, "-m", "benchmarks.cuda_overhead", RUN_RANK, *rank_args)
    output = harness.run(command, timeout_s=1800, env={"LOG_RANK": "0"}, log=log)
    wall_s = time.perf_counter() - start
    steps = harness.parse_steps(output, args.local_batch * args.seq_len * microbatches)
    return {"update_s": steps["round_s"] * steps_per_update,
            "peak_memory_gib": steps["peak_rss_gib"],
            "step_s_all": steps["round_s_all"], "run_wall_s": wall_s}  # fmt: skip


def run_rank(titan_argv: list[str]) -> None:
    """One rank's entry under torchrun: ``train_titan.py`` with ``BENCH_FLAVORS`` registered."""
    # First: torchtitan 0.2.2's ConfigManager.parse_args binds sys.argv[1:] when it is imported.
    sys.argv = [str(harness.ROOT / "train_titan.py"), *titan_argv]
    from acco_hooks.titan import TITAN_030

    if not TITAN_030:
        from torchtitan.models.llama3 import TransformerModelArgs, llama3_args

        for name, shape in BENCH_FLAVORS.items():
            llama3_args.setdefault(name, TransformerModelArgs(**shape))
    runpy.run_path(sys.argv[0], run_name="__main__")


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per arm: the median time per update, its range, the overhead and the peak memory."""
    medians = {key: statistics.median(r["update_s"] for r in rs) for key, rs in runs.items()}
    summary = {}
    for key, results in runs.items():
        baseline = "titan_compiled" if key.endswith("_compiled") else "titan"
        times = [r["update_s"] for r in results]
        summary[key] = {"update_s_median": medians[key], "update_s_min": min(times),
                        "update_s_max": max(times),
                        "overhead_vs_titan": medians[key] / medians[baseline] - 1,
                        "peak_memory_gib": max(r["peak_memory_gib"] for r in results)}  # fmt: skip
    return summary


def measure(args: argparse.Namespace, out) -> dict:
    """Every arm, ``args.repeats`` times, interleaved; ``out`` is rewritten after every run, so
    that a run cut short (a time limit on a lent GPU) still leaves the runs it finished."""
    import torch

    results = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke only)",
        "torch": torch.__version__, "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "flavor": args.flavor, "flavor_shape": BENCH_FLAVORS.get(args.flavor),
        "local_batch": args.local_batch, "seq_len": args.seq_len,
        "microbatches_per_round": args.microbatches,
        "tokens_per_update": 2 * args.microbatches * args.local_batch * args.seq_len,
        "updates": args.updates, "repeats": args.repeats, "arms": args.arms,
        "titan_optimizer": args.titan_optimizer,
        "compiled_repeats": min(args.compiled_repeats, args.repeats) if args.compile else 0,
        "complete": False, "summary": {}, "runs": {},
    }  # fmt: skip
    for repeat in range(args.repeats):
        compiled_too = args.compile and repeat < args.compiled_repeats
        for compiled in (False, True) if compiled_too else (False,):
            for arm in args.arms:
                key = f"{arm}{'_compiled' if compiled else ''}"
                run = run_arm(arm, compiled, args, LOGS / f"{key}_{repeat}.log")
                results["runs"].setdefault(key, []).append(run)
                print(f"repeat {repeat} {key:15s} update {run['update_s'] * 1e3:8.2f} ms  "
                      f"peak {run['peak_memory_gib']:.2f} GiB", flush=True)  # fmt: skip
                results["summary"] = summarize(results["runs"])
                harness.write_result(out, results)
    results["complete"] = True
    harness.write_result(out, results)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--flavor", default="bench_88m", help=f"llama3 flavor, or one of {sorted(BENCH_FLAVORS)}")
    add("--local-batch", type=int, default=8, help="sequences per micro-batch")
    add("--seq-len", type=int, default=512, help="tokens per sequence")
    add("--microbatches", type=int, default=4, help="k: micro-batches per round")
    add("--updates", type=int, default=20, help="optimizer updates per run")
    add("--repeats", type=int, default=3, help="runs of every arm, interleaved")
    add("--compiled-repeats", type=int, default=3, help="how many repeats also run compiled")
    add("--arms", default=",".join(ARMS), type=lambda text: [arm for arm in text.split(",") if arm],
        help=f"which of {', '.join(ARMS)} to run (titan is the baseline)")  # fmt: skip
    add("--titan-optimizer", default="fused", choices=["fused", "foreach", "for-loop"],
        help="the titan arm's AdamW implementation (the engine steps fused AdamW)")  # fmt: skip
    add("--no-compile", dest="compile", action="store_false", help="skip the compiled arms")
    add("--smoke", action="store_true",
        help="check the harness on any device: the debug model, 1 repeat, 4 updates, "
        "no compile")  # fmt: skip
    harness.add_out_option(parser, "cuda_overhead", "outputs/results/cuda_overhead.json, "
                           "--smoke: outputs/cuda_overhead_smoke.json")  # fmt: skip
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = SMOKE_RESULTS if args.smoke else harness.result_file("cuda_overhead")
    if args.smoke:
        # the harness, not a timing: the fewest micro-batches that still make 4 updates
        args.repeats, args.updates, args.compile, args.microbatches = 1, 4, False, 1
        args.flavor = "debugmodel"
        args.local_batch, args.seq_len = harness.LOCAL_BATCH, harness.SEQ_LEN
    import torch

    from acco_hooks.titan import TITAN_030

    if not args.smoke and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (torch.cuda.is_available() is False); --smoke checks the "
                     "harness on the CPU")  # fmt: skip
    if args.flavor in BENCH_FLAVORS and TITAN_030:
        parser.error(f"--flavor {args.flavor} is added to torchtitan 0.2.2's llama3 flavors; "
                     "with torchtitan 0.3.0 name one of its own (--flavor debugmodel)")  # fmt: skip
    if "titan" not in args.arms or not set(args.arms) <= set(ARMS):
        parser.error(f"--arms {','.join(args.arms)}: name arms of {', '.join(ARMS)}, titan "
                     "among them (the baseline)")  # fmt: skip
    return args


def main() -> None:
    if sys.argv[1:2] == [RUN_RANK]:
        run_rank(sys.argv[2:])
        return
    args = parse_args()
    results = measure(args, args.out)
    for key, row in results["summary"].items():
        print(f"{key:15s} {row['update_s_median'] * 1e3:8.2f} ms/update "
              f"[{row['update_s_min'] * 1e3:.2f}, {row['update_s_max'] * 1e3:.2f}]  "
              f"overhead {row['overhead_vs_titan']:+.1%}  peak {row['peak_memory_gib']:.2f} GiB")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
