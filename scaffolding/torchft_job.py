"""A torchft job on one machine: a lighthouse and one launcher per replica group.

What a cluster does with one node per group (``examples/torchft_train.py`` shows the commands),
here on loopback for the tests and ``benchmarks/torchft_recovery.py``: each group's launcher
(forked with its ranks from a process that imported the program once for every job, or
``torchrun``) runs in a session of its own, so that losing a "node" (a group SIGKILLing its
process group) takes exactly that group, and everything this module started is killed when it
returns, also on an error or a timeout.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from scaffolding import forked_ranks
from scaffolding.ports import free_port

__all__ = ["announce_first_quorum_request", "free_port", "run_groups", "run_reference"]

EXAMPLE = "examples.torchft_train"
ROOT = Path(__file__).resolve().parent.parent
LIGHTHOUSE_LOG = "lighthouse.log"  # in run_groups' ``out``
# torchft's lighthouse without the 2-3 s of CPU its console script spends importing torch
LIGHTHOUSE = ROOT / "scaffolding" / "lighthouse.py"
# what a started process is waited and killed by (pid: its session's, its group's)
Process = subprocess.Popen | forked_ranks.ForkedJob


def run_groups(
    groups: int, group_size: int | Sequence[int], args: Sequence[str], out: Path, *,
    timeout_s: float = 240.0,
    heartbeat_timeout_ms: int = 2000, replica_args: dict[int, Sequence[str]] | None = None,
    start_together: bool | Sequence[int] = True, restart: dict[int, Sequence[str]] | None = None,
    program: Sequence[str] = ("-m", EXAMPLE), launcher: str = "forked",
) -> list[int]:  # fmt: skip
    """Run ``examples.torchft_train`` as ``groups`` replica groups of ``group_size`` processes
    (or ``group_size[i]`` in group ``i``: groups that differ, which the engine refuses) under
    one lighthouse; return each group's exit status (``torchrun``'s). Each group's output
    goes to ``out/g{i}.log``; ``replica_args`` adds arguments to some groups. With
    ``start_together`` no group starts training before every group's Manager is up (or, given
    groups, no group of those before theirs, and the others start as they come: late): the
    groups start at slightly different moments here, and one that missed the first quorum
    would join the running job. ``restart``: a group that exits is started again, once, with
    these arguments instead of its ``replica_args`` (what a node's restart does; its output
    goes to ``out/g{i}_restart.log`` and its exit status is returned). ``program``: what
    each group runs, the example by default; another program (``train_titan.py``) gets
    ``args`` and the group's ``replica_args`` alone (its replica id among them).
    ``launcher``: how a group starts its ranks (``_launcher``): forked by default, torchrun's
    agent for a measurement of what a node's restart costs."""
    out.mkdir(parents=True, exist_ok=True)
    sizes = [group_size] * groups if isinstance(group_size, int) else list(group_size)
    with _sessions() as started:
        # the lighthouse binds a port of its own (0) and says which: a port picked here and
        # released may be taken (another test's connection) before the lighthouse binds it
        started.append(_start(
            [sys.executable, str(LIGHTHOUSE), "--min_replicas", "1", "--quorum_tick_ms", "100",
             "--join_timeout_ms", "10000", "--heartbeat_timeout_ms", str(heartbeat_timeout_ms),
             "--bind", "[::]:0"], {"RUST_LOG": "info"}, out / LIGHTHOUSE_LOG,
        ))  # fmt: skip
        port = _listening_port(started[-1], out / LIGHTHOUSE_LOG)

        def start(i: int, extra: Sequence[str], log: str) -> Process:
            # the manager's server binds a port of its own (0) and publishes it in the group's
            # store: a port picked here first may be taken by another process before it binds
            env = {"TORCHFT_LIGHTHOUSE": f"http://localhost:{port}", "TORCHFT_MANAGER_PORT": "0"}
            own = []  # the example's own flags
            if tuple(program) == ("-m", EXAMPLE):
                own = ["--replica-id", str(i), "--groups", str(groups), "--out", str(out)]
                if start_together is True:
                    own.append("--start-together")
                elif start_together and i in start_together:
                    own += ["--start-together", *map(str, start_together)]
            job = _start_group(sizes[i], program, launcher, [*own, *args, *extra], env, out / log)
            started.append(job)
            return job

        jobs = [start(i, (replica_args or {}).get(i, ()), f"g{i}.log") for i in range(groups)]
        deadline = time.monotonic() + timeout_s
        pending = dict(restart or {})
        while pending:  # a group that exits comes back once
            for i, extra in list(pending.items()):
                if jobs[i].poll() is not None:
                    jobs[i] = start(i, extra, f"g{i}_restart.log")
                    del pending[i]
            if pending and all(job.poll() is not None for job in jobs):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"a torchft job's process ran past {timeout_s:.0f} s")
            time.sleep(0.05)
        return _wait(jobs, max(0.0, deadline - time.monotonic()))


def run_reference(
    groups: int, group_size: int, args: Sequence[str], out: Path, timeout_s: float = 120.0,
    program: Sequence[str] = ("-m", EXAMPLE),
) -> int:  # fmt: skip
    """The same job as one group of ``groups * group_size`` processes, without torchft; its
    ranks are forked from a process that imported the program's modules once
    (``scaffolding.forked_ranks``: a reference needs no agent, and a run of either program
    here spends most of its time importing). Its output goes to ``out/reference.log``."""
    out.mkdir(parents=True, exist_ok=True)
    example = tuple(program) == ("-m", EXAMPLE)
    own = ["--groups", str(groups), "--out", str(out)] if example else []
    preload = (EXAMPLE,) if example else forked_ranks.train_titan_preload()
    log = out / "reference.log"
    log.write_bytes(b"")
    return forked_ranks.run(groups * group_size, [*program, *own, *args], log, preload=preload,
                            timeout_s=timeout_s)  # fmt: skip


def announce_first_quorum_request(
    manager: Any, replica_name: str, out: Path, announce: Path, timeout_s: float = 60.0
) -> None:  # fmt: skip
    """Make ``manager`` (a joining group's torchft ``Manager``, named ``replica_name``) write
    ``announce`` once the lighthouse ``run_groups`` started for ``out`` has received its
    first quorum request; until then its first ``start_quorum`` call does not return.

    Why the lighthouse, not the call: ``start_quorum`` hands the request to a thread, and
    the lighthouse forms a live group's next quorum at once (torchft's "fast quorum": the
    same participants as the last one) unless another group's request is already there,
    however long that group has heartbeated. A live group that holds until ``announce``
    exists therefore meets the joiner in its next quorum, on a loaded machine too. The
    lighthouse logs each request with the group's name and the uuid its ``Manager`` took
    at this start; a request logged after the call began is this start's (an earlier start
    of the group was lost before it)."""
    log = out / LIGHTHOUSE_LOG
    request = f"Received quorum request for replica {replica_name}:".encode()
    start_quorum = manager.start_quorum

    def start_quorum_then_announce(*args: Any, **kwargs: Any) -> None:
        if announce.exists():
            start_quorum(*args, **kwargs)
            return
        since = log.stat().st_size
        start_quorum(*args, **kwargs)
        deadline = time.monotonic() + timeout_s
        while True:
            with open(log, "rb") as f:
                f.seek(since)
                if request in f.read():
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the lighthouse ({log}) logged no quorum request from "
                                   f"{replica_name} within {timeout_s:.0f} s")  # fmt: skip
            time.sleep(0.02)
        announce.write_text("")

    manager.start_quorum = start_quorum_then_announce


def _listening_port(lighthouse: subprocess.Popen, log: Path, timeout_s: float = 60.0) -> int:
    """The port the lighthouse says it listens on (its first log line)."""
    deadline = time.monotonic() + timeout_s
    while True:
        said = re.search(r"Lighthouse listening on: \S+:(\d+)", log.read_text(errors="replace"))
        if said:
            return int(said.group(1))
        if lighthouse.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the lighthouse did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.05)


def _start_group(processes: int, program: Sequence[str], launcher: str, argv: Sequence[str],
                 env: dict[str, str], log: Path) -> Process:  # fmt: skip
    """A group's launcher, started in a session of its own, running ``program`` with ``argv``.
    ``"forked"``: forked, with its ranks, from a process that imported the program's modules
    once for every group of every job (``scaffolding.forked_ranks.start``; a group's start here
    is mostly imports, which 2 cores would pay for every rank and agent of every group);
    ``"torchrun"``: the agent a node runs."""
    if launcher == "forked":
        preload = ((EXAMPLE,) if tuple(program) == ("-m", EXAMPLE)
                   else forked_ranks.train_titan_preload())  # fmt: skip
        return forked_ranks.start(processes, [*program, *argv], log, preload=preload,
                                  env={**os.environ, **env})  # fmt: skip
    if launcher != "torchrun":
        raise ValueError(f"launcher={launcher!r}: 'forked' or 'torchrun'")
    # --standalone: the agent's rendezvous store binds a free port itself (no port picked here
    # and released first, which another process may take before the store binds it)
    return _start([sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", str(processes), *program, *argv], env, log)  # fmt: skip


def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen(
            argv, cwd=ROOT, env={**os.environ, **env}, stdout=f, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own session: a group's kill takes that group alone
        )  # fmt: skip


def _wait(procs: list[Process], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"a torchft job's process ran past {timeout_s:.0f} s") from None
    return [proc.returncode for proc in procs]


@contextlib.contextmanager
def _sessions() -> Iterator[list[Process]]:
    """The processes started inside; each one's session is killed on the way out."""
    started: list[Process] = []
    try:
        yield started
    finally:
        for proc in started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
