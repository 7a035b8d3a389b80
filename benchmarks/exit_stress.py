"""Launch the jobs where a rank aborted at interpreter exit, many times, and count the aborts.

    python -m benchmarks.exit_stress --launches 50                 # every job, one at a time
    python -m benchmarks.exit_stress --launches 50 --parallel 2    # two at a time: under load
    python -m benchmarks.exit_stress --jobs no_sync --launches 200 --label before

The abort this counts: a run trains, logs ``train_titan: done``, and then one rank dies at
interpreter exit with ``terminate called without an active exception`` (SIGABRT, torchrun's
``exitcode: -6``). A non-main C++ thread (a gloo worker, for one) that drops the last reference
to a Python-backed tensor while the interpreter finalizes takes the GIL and ends in
``std::terminate``. It is a race, so one clean launch proves nothing: this script launches each
job ``--launches`` times through ``torchrun --standalone`` exactly as the tests do (2 CPU ranks,
3 short steps, ``OMP_NUM_THREADS=1``) and classifies every launch:

- ``ok``: rc 0 and every rank logged ``train_titan: done``;
- ``abort``: the output has ``terminate called`` or a rank ended with SIGABRT;
- ``failed``: any other non-zero exit (its log tail is kept).

The jobs, on the installed torchtitan release (``--jobs`` picks some):

- ``no_sync``: torchtitan 0.2.2's DDP with ``no_sync`` accumulation
  (``benchmarks/titan_no_sync.py``), the run of ``test_the_no_sync_baseline_...``;
- ``titan_ddp``: torchtitan's DDP baseline (on 0.3.0 FSDP2 on a replicate mesh), once per
  ``spmd_backend`` on 0.3.0 (``titan_ddp[partial_dtensor]`` is where 0.3.0 aborted);
- ``titan_fsdp``: torchtitan's FSDP2 baseline;
- ``main``: the README main job (``debug_cpu_acco.toml``; ``--main-steps`` shortens it, its
  exit path does not depend on the number of steps);
- ``exit_race[plain]`` and ``exit_race[finish]``: the race alone, in a few seconds per launch
  (this module's :func:`exit_race`): DDP on a small model, a process group kept alive by a
  reference cycle with automatic garbage collection off (as in torchtitan's trainer), a
  collective right before the end; then ``destroy_process_group()`` as PyTorch documents
  (``plain``, which aborts now and then: the control that shows this script can see the abort)
  or ``scaffolding.process_exit.finish()`` (``finish``, what every process of the checkout
  does).

``--parallel K`` runs K launches at once, so that each runs while others load the machine (with
2 ranks per launch, K = 2 puts two processes on each of 2 cores); ``--load CMD`` runs a shell
command over and over meanwhile, e.g. ``--load "python -m pytest -q tests/engine"``, the load
of a test suite.
``--core-files`` lets an aborting rank write a core file (``ulimit -c unlimited``; where it goes
is the kernel's ``core_pattern``), for ``gdb python CORE`` and ``thread apply all bt``.

Writes ``docs/results/exit_stress_<release>_<label>.json`` (or ``--out``): per job the counts,
how many launches left through ``finish()``'s second layer, the seconds per launch and the log
tail of each launch that was not ``ok``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import gc
import os
import pathlib
import re
import resource
import subprocess
import sys
import tempfile
import time

from benchmarks.harness import RESULTS, ROOT, header, torchrun, write_result

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
    if main_steps:
        main += ("--training.steps", str(main_steps))
    ddp = ("--job.config_file", "torchtitan_configs/debug_cpu_titan_ddp.toml", *FAST)
    fsdp = ("--job.config_file", "torchtitan_configs/debug_cpu_titan_fsdp.toml", *FAST)
    race = {f"exit_race[{t}]": ("--exit-race", t) for t in ("plain", "finish")}
    if titan_030:
        return {
            "titan_ddp[partial_dtensor]": (*ddp, "--parallelism.spmd_backend", "partial_dtensor"),
            "titan_ddp[spmd_types]": (*ddp, "--parallelism.spmd_backend", "spmd_types"),
            "titan_fsdp": fsdp,
            "main": main,
            **race,
        }
    return {
        "no_sync": (*ddp, "--experimental.custom_import", "benchmarks.titan_no_sync"),
        "titan_ddp": ddp,
        "titan_fsdp": fsdp,
        "main": main,
        **race,
    }


def exit_race(teardown: str) -> None:
    """One rank of the ``exit_race`` job (run by ``torchrun``): the abort's ingredients alone."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from scaffolding.process_exit import finish

    dist.init_process_group("gloo")
    gc.disable()  # as torchtitan's trainer does
    model = DistributedDataParallel(torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4))))
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


def launch(args: tuple[str, ...], workdir: pathlib.Path, core_files: bool) -> dict:
    """One ``torchrun --standalone --nproc_per_node 2 train_titan.py ...``, classified."""
    if args[0] == "--exit-race":
        cmd = torchrun(2, "-m", "benchmarks.exit_stress", *args)
    else:
        cmd = torchrun(2, str(ROOT / "train_titan.py"), *args, "--job.dump_folder",
                       str(workdir / "dump"), "--metrics.disable_color_printing")  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOG_RANK": "all"}

    def allow_core_files() -> None:
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY,) * 2)

    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
                              preexec_fn=allow_core_files if core_files else None)  # fmt: skip
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, output = "timeout", f"{exc.stdout or ''}{exc.stderr or ''}"
    seconds = time.monotonic() - start
    if ABORT.search(output):
        outcome = "abort"
    elif rc == 0 and (args[0] == "--exit-race" or output.count(DONE) == 2):
        outcome = "ok"
    else:
        outcome = "failed"
    result = {"outcome": outcome, "rc": rc, "seconds": round(seconds, 1),
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
    parser.add_argument("--main-steps", type=int, default=None,
                        help="steps of the main job (default: the README's)")
    parser.add_argument("--core-files", action="store_true", help="let aborting ranks dump core")
    parser.add_argument("--load", default=None, help="a shell command run over and over meanwhile")
    parser.add_argument("--label", default="after", help="names the result file")
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="the result file (default: docs/results/exit_stress_<release>_<label>.json)")
    args = parser.parse_args()
    release = "titan030" if TITAN_030 else "titan022"
    every = jobs(TITAN_030, args.main_steps)
    chosen = args.jobs or list(every)
    unknown = sorted(set(chosen) - set(every))
    if unknown:
        parser.error(f"--jobs {' '.join(unknown)}: the jobs on this release are {', '.join(every)}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()  # fmt: skip
    results = {
        **header(), "commit": commit,
        "torch": __import__("torch").__version__, "torchtitan_release": release,
        "launches_per_job": args.launches, "parallel": args.parallel, "load": args.load,
        "command": " ".join(["python -m benchmarks.exit_stress", *sys.argv[1:]]), "jobs": {},
    }  # fmt: skip
    out = args.out or RESULTS / f"exit_stress_{release}_{args.label}.json"
    with tempfile.TemporaryDirectory() as tmp, background_load(args.load), \
            concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:  # fmt: skip
        for name in chosen:
            workdirs = [pathlib.Path(tmp, f"{name}-{i}") for i in range(args.launches)]
            launches = list(pool.map(lambda w: launch(every[name], w, args.core_files), workdirs))
            counts = {k: sum(r["outcome"] == k for r in launches) for k in ("ok", "abort", "failed")}
            fell_back = sum(r["ranks_left_without_finalizing"] > 0 for r in launches)
            seconds = sorted(r["seconds"] for r in launches)
            results["jobs"][name] = {
                **counts, "launches_that_left_without_finalizing": fell_back,
                "seconds_median": seconds[len(seconds) // 2],
                "not_ok": [r for r in launches if r["outcome"] != "ok"],
            }
            print(f"{name}: {args.launches} launches ({args.parallel} at once): {counts['ok']} ok, "
                  f"{counts['abort']} aborted at exit, {counts['failed']} failed otherwise, "
                  f"{fell_back} left without finalizing; "
                  f"{seconds[len(seconds) // 2]:.0f} s each (median)", flush=True)  # fmt: skip
            write_result(out, results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
