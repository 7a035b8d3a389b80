"""scaffolding.process_exit: how every process of the checkout ends (docs/reliability.md,
"Process teardown").

Each test runs a one-rank gloo process of its own, since what is tested is the end of a process:
its exit status, what it printed, and which of its native threads were still running.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).parents[1]

PROLOGUE = """
import atexit, gc, sys
import torch
import torch.distributed as dist
from scaffolding.process_exit import finish, group_worker_threads

dist.init_process_group("gloo")
"""


def _run(body: str) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
    script = PROLOGUE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)  # fmt: skip


def test_finish_destroys_groups_that_reference_cycles_hold_and_returns() -> None:
    """Automatic collection off and a group held only by a reference cycle (a torchtitan
    trainer's situation), a collective on it just before the end: finish() destroys every
    group, joins their worker threads, and returns for the normal exit."""
    proc = _run("""
        gc.disable()
        holder = {"group": dist.new_group([0])}
        holder["self"] = holder
        total = torch.ones(3)
        dist.all_reduce(total, group=holder["group"])
        before = group_worker_threads()
        del holder, total
        finish()
        print(f"threads before={before} after={group_worker_threads()} gc={gc.isenabled()}")
        print("finish returned")
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "finish returned" in proc.stdout
    before = int(proc.stdout.split("threads before=")[1].split()[0])
    assert before >= 2  # the default group's and the new group's gloo workers
    assert "after=0 gc=True" in proc.stdout
    assert "leaving without interpreter finalization" not in proc.stderr


def test_finish_leaves_without_finalizing_when_a_group_is_still_held() -> None:
    """A group that something else still references keeps its worker threads after
    destroy_process_group(): finish() runs the exit handlers, flushes what was printed, and
    exits with the given status without finalizing the interpreter (so nothing after it runs)."""
    proc = _run("""
        HELD_ELSEWHERE = dist.group.WORLD  # stands for a holder the process does not control
        atexit.register(print, "exit handler ran")
        print("printed before finish, not flushed")
        finish(exit_code=3)
        print("after finish")
    """)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["printed before finish, not flushed", "exit handler ran"]
    assert ("2 process-group worker threads are still running after destroy_process_group()"
            in proc.stderr)  # fmt: skip
    assert "terminate called" not in proc.stderr


def test_finish_without_finalizing_runs_the_exit_handlers_and_leaves() -> None:
    """finalize=False (train_titan.py's end): nothing is held, and finish() still leaves
    without finalizing, after the exit handlers and a flush of what was printed, with status 0
    and no warning (no group was held); an idle worker thread, such as an executor's that only
    finalization would tell to stop, does not keep it waiting."""
    proc = _run("""
        import concurrent.futures
        pool = concurrent.futures.ThreadPoolExecutor(1)
        pool.submit(print, "pool worker ran").result()
        atexit.register(print, "exit handler ran")
        print("printed before finish, not flushed")
        finish(finalize=False)
        print("after finish")
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["pool worker ran", "printed before finish, not flushed",
                                        "exit handler ran"]  # fmt: skip
    assert "still running" not in proc.stderr


def test_exit_stress_counts_clean_launches(tmp_path) -> None:
    """benchmarks/exit_stress.py (the proof by repetition) launches a job, classifies every
    launch and writes its figures: the race's job ends through finish(), so both launches are
    clean."""
    import json

    out = tmp_path / "stress.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.exit_stress", "--jobs", "exit_race[finish]",
         "--launches", "2", "--out", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    job = json.loads(out.read_text())["jobs"]["exit_race[finish]"]
    assert (job["ok"], job["abort"], job["failed"]) == (2, 0, 0), job
