"""Launch the jobs where a rank aborted at interpreter exit, many times, and count the aborts.

    python -m benchmarks.exit_stress --launches 50 --main-steps 4 --label after
    python -m benchmarks.exit_stress ... --parallel 2 --load "python -m pytest -q -m titan tests"

Each job is launched ``--launches`` times through ``torchrun --standalone`` as the tests do (2 CPU
ranks, ``OMP_NUM_THREADS=1``), ``--parallel`` at once, while ``--load`` runs over and over; every
launch is ``ok``, ``abort`` (``terminate called`` or SIGABRT) or ``failed``. ``exit_race[plain]``
and ``exit_race[finish]`` are the race alone (:func:`exit_race`). What the abort is and the
results: docs/reliability.md, "Process teardown", and docs/results.md, section 9. Writes
``outputs/results/exit_stress_<release>_<label>.json`` (or ``--out``; the published files:
``docs/results/exit_stress_*.json``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import gc
import os
import pathlib
import re
import resource
import subprocess
import sys
import tempfile
import time

from benchmarks.harness import (
    ROOT,
    add_out_option,
    header,
    launch,
    result_file,
    torchrun,
    write_result,
)

FAST = ("--training.steps", "3", "--training.global_batch_size", "8", "--optimizer.lr", "3e-3",
        "--training.seq_len", "64", "--training.local_batch_size", "2")  # fmt: skip
ABORT = re.compile(r"terminate called|exitcode\s*:\s*-6|Signal 6 \(SIGABRT\)|SIGABRT")
DONE = "train_titan: done"
# scaffolding.process_exit.finish() found a group's worker threads still running and left
# without interpreter finalization (the second layer of the fix); counted, per launch.
FELL_BACK = "leaving without interpreter finalization"


def jobs(titan_030: bool, main_steps: int | None) -> dict[str, tuple[str, ...]]:
    """Every job's arguments on the installed release (``train_titan.py``'s, or this module's)."""
    main = ("--job.config_file", "torchtitan_configs/debug_cpu_acco.toml")
    if main_steps:  # its exit path does not depend on the number of steps
        main += ("--training.steps", str(main_steps))
    ddp = ("--job.config_file", "torchtitan_configs/debug_cpu_titan_ddp.toml", *FAST)
    fsdp = ("--job.config_file", "torchtitan_configs/debug_cpu_titan_fsdp.toml", *FAST)
    if titan_030:  # torchtitan 0.3.0's DDP is FSDP2 on a replicate mesh: once per spmd_backend
        baselines = {f"titan_ddp[{backend}]": (*ddp, "--parallelism.spmd_backend", backend)
                     for backend in ("partial_dtensor", "spmd_types")}  # fmt: skip
    else:  # 0.2.2: DDP, and DDP with no_sync accumulation (benchmarks/titan_no_sync.py)
        no_sync = (*ddp, "--experimental.custom_import", "benchmarks.titan_no_sync")
        baselines = {"no_sync": no_sync, "titan_ddp": ddp}
    race = {f"exit_race[{teardown}]": ("--exit-race", teardown) for teardown in ("plain", "finish")}
    return {**baselines, "titan_fsdp": fsdp, "main": main, **race}


def exit_race(teardown: str) -> None:
    """One rank of the ``exit_race`` job (run by ``torchrun``): the abort's ingredients alone,
    ended by ``destroy_process_group()`` (``plain``) or ``finish()`` (``finish``)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from scaffolding.process_exit import finish

    dist.init_process_group("gloo")
    gc.disable()  # as torchtitan's trainer does
    model = DistributedDataParallel(torch.nn.Sequential(*(torch.nn.Linear(64, 64)
                                                          for _ in range(4))))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters())
    cycle = {"model": model, "opt": opt}
    cycle["self"] = cycle  # like a trainer's cycles: only the collector frees the group
    for _ in range(3):
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        total = torch.tensor(1.0)
        dist.all_reduce(total)  # a collective on a tensor Python holds, right before the end
    del model, opt, cycle, total
    if teardown == "plain":
        dist.destroy_process_group()
    else:
        finish()


def launch_once(args: tuple[str, ...], workdir: pathlib.Path, core_files: bool) -> dict:
    """One ``torchrun --standalone --nproc_per_node 2`` of a job, classified."""
    if args[0] == "--exit-race":
        cmd = torchrun(2, "-m", "benchmarks.exit_stress", *args)
    else:
        cmd = torchrun(2, str(ROOT / "train_titan.py"), *args, "--job.dump_folder",
                       str(workdir / "dump"), "--metrics.disable_color_printing")  # fmt: skip
    # --core-files: core dumps of aborting ranks, for gdb's "thread apply all bt"
    unlimited = functools.partial(resource.setrlimit, resource.RLIMIT_CORE,
                                  (resource.RLIM_INFINITY,) * 2)  # fmt: skip
    start = time.monotonic()
    rc, output = launch(cmd, 600, {"OMP_NUM_THREADS": "1", "LOG_RANK": "all"},
                        preexec_fn=unlimited if core_files else None)  # fmt: skip
    if ABORT.search(output):
        outcome = "abort"
    elif rc == 0 and (args[0] == "--exit-race" or output.count(DONE) == 2):
        outcome = "ok"
    else:
        outcome = "failed"
    result = {"outcome": outcome, "rc": rc, "seconds": round(time.monotonic() - start, 1),
              "ranks_left_without_finalizing": output.count(FELL_BACK)}  # fmt: skip
    if outcome != "ok":
        result["log_tail"] = output[-3000:]
    return result


@contextlib.contextmanager
def background_load(command: str | None):
    """Run ``command`` in a loop (a new process group, killed at the end) while the body runs."""
    if not command:
        yield
        return
    loop = subprocess.Popen(["bash", "-c", f"while true; do {command}; done"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    try:
        yield
    finally:
        os.killpg(loop.pid, 9)
        loop.wait()


def main() -> None:
    if sys.argv[1:2] == ["--exit-race"]:  # one rank of the exit_race job, under torchrun
        exit_race(sys.argv[2])
        return
    from acco_hooks.titan import TITAN_030

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", nargs="*", help="some of the jobs (default: all)")
    parser.add_argument("--launches", type=int, default=50, help="launches per job")
    parser.add_argument("--parallel", type=int, default=1, help="launches at once (load)")
    parser.add_argument("--main-steps", type=int, help="steps of the main job (default: README's)")
    parser.add_argument("--core-files", action="store_true", help="let aborting ranks dump core")
    parser.add_argument("--load", help="a shell command run over and over meanwhile")
    parser.add_argument("--label", default="after", help="names the result file")
    add_out_option(parser, "exit_stress_<release>_<label>",
                   "outputs/results/exit_stress_<release>_<label>.json")  # fmt: skip
    args = parser.parse_args()
    release = "titan030" if TITAN_030 else "titan022"
    every = jobs(TITAN_030, args.main_steps)
    chosen = args.jobs or list(every)
    unknown = sorted(set(chosen) - set(every))
    if unknown:
        parser.error(f"--jobs {' '.join(unknown)}: the jobs on this release are {', '.join(every)}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT, check=False).stdout.strip()  # fmt: skip
    results = {
        **header(), "commit": commit,
        "torch": __import__("torch").__version__, "torchtitan_release": release,
        "launches_per_job": args.launches, "parallel": args.parallel, "load": args.load,
        "command": " ".join(["python -m benchmarks.exit_stress", *sys.argv[1:]]), "jobs": {},
    }  # fmt: skip
    out = args.out or result_file(f"exit_stress_{release}_{args.label}")
    with tempfile.TemporaryDirectory() as tmp, background_load(args.load), \
            concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:  # fmt: skip
        for name in chosen:
            one = functools.partial(launch_once, every[name], core_files=args.core_files)
            launches = list(pool.map(one, [pathlib.Path(tmp, f"{name}-{i}")
                                           for i in range(args.launches)]))  # fmt: skip
            counts = {outcome: sum(r["outcome"] == outcome for r in launches)
                      for outcome in ("ok", "abort", "failed")}  # fmt: skip
            fell_back = sum(r["ranks_left_without_finalizing"] > 0 for r in launches)
            median = sorted(r["seconds"] for r in launches)[len(launches) // 2]
            results["jobs"][name] = {
                **counts, "launches_that_left_without_finalizing": fell_back,
                "seconds_median": median, "not_ok": [r for r in launches if r["outcome"] != "ok"],
            }  # fmt: skip
            print(f"{name}: {args.launches} launches ({args.parallel} at once): {counts['ok']} ok, "
                  f"{counts['abort']} aborted at exit, {counts['failed']} failed otherwise, "
                  f"{fell_back} left without finalizing; {median:.0f} s each (median)",
                  flush=True)  # fmt: skip
            write_result(out, results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
