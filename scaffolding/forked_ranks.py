"""A job's ranks as forks of a process that imported their modules already.

Why this exists. A rank of ``train_titan.py`` spends 6-8 s of CPU importing torch, torchtitan
and their dependencies (dynamo and inductor through torch's attention modules, datasets,
pandas) before it reads its config, and a 4-step run of the debug model then trains for about
one second. The test suite launches a hundred such jobs of 2 to 8 ranks on a 2-core machine:
most of its time went to importing the same modules again in every rank, and to torchrun's
agent (2.5 s per job), whose restarts and rendezvous those jobs do not use.

:func:`run` starts a job's ranks the way torchrun's workers start, minus the imports: a server
process imports ``preload`` once, then forks one process per rank for each job it is given.
Each rank gets the environment the caller had, with the variables torchrun sets for its
workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ...), and
the job's store is the forking process's, as torchrun's is its agent's
(``TORCHELASTIC_USE_AGENT_STORE``): it binds port 0 itself, so no port is picked and released
for another process to take first. The program runs as ``__main__``, as
``python -m M`` or ``python script.py`` would. As torchrun's agent does, the server ends every
rank of a job once one of them fails. :func:`start` is the same job started and left running
(a torchft replica group that a test kills and restarts): the server forks its launcher, in a
session of its own, which forks the ranks. A job that needs the agent itself (an elastic
restart, torchrun's own output) or whose subject is a new process's start launches with
torchrun.

What a fork does not redo: variables read while the preloaded modules were imported (by torch
at import, say ``OMP_NUM_THREADS``, which torchrun sets to 1 and so does the server) keep the
server's values. CPU jobs only: a fork cannot use CUDA once its parent initialized it, so the
server refuses to start where a GPU is visible; GPU jobs launch with torchrun.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["ForkedJob", "run", "start", "train_titan_preload"]

ROOT = Path(__file__).resolve().parent.parent

# one server per preload list, started on first use and stopped at exit
_servers: dict[tuple[str, ...], subprocess.Popen] = {}
_requests = threading.Lock()


def run(
    nproc: int, argv: Sequence[str], log: Path, *, preload: Sequence[str],
    env: Mapping[str, str] | None = None, cwd: Path = ROOT, timeout_s: float = 600.0,
) -> int:  # fmt: skip
    """Run ``python *argv`` as ``nproc`` ranks of one job; return its exit status.

    Args:
        nproc: the ranks (one node: ``LOCAL_RANK == RANK``).
        argv: what follows ``python``: ``["script.py", ...]`` or ``["-m", "module", ...]``.
        log: every rank's stdout and stderr, appended as they come (torchrun's default).
        preload: the modules the server imports once, in this order, before it forks.
        env: the ranks' environment (``os.environ`` by default), before torchrun's variables.
        cwd: the ranks' working directory.
        timeout_s: every rank still running after this long is killed and the call fails.

    Returns:
        0 when every rank exited 0; otherwise the status of the first rank that failed (the
        others were killed then), negative for a signal, as ``subprocess`` reports it.
    """
    job = {"nproc": nproc, "argv": list(argv), "log": str(log), "cwd": str(cwd),
           "env": dict(os.environ if env is None else env), "timeout_s": timeout_s}  # fmt: skip
    result = _request(tuple(preload), job)
    if result["timed_out"]:
        raise TimeoutError(f"{' '.join(argv)} on {nproc} ranks ran past {timeout_s:.0f} s")
    return result["status"]


def start(
    nproc: int, argv: Sequence[str], log: Path, *, preload: Sequence[str],
    env: Mapping[str, str] | None = None, cwd: Path = ROOT,
) -> ForkedJob:  # fmt: skip
    """Start ``python *argv`` as ``nproc`` ranks of one job, like ``torchrun --standalone
    --nproc_per_node nproc``, and return at once: what a test that starts, kills and restarts
    whole jobs (``scaffolding.torchft_job``'s replica groups) runs instead of torchrun's agent.

    The server forks the job's launcher, which forks its ranks: no import is paid again. The
    launcher runs in a session of its own with its ranks in its process group, so that a kill
    of that group (a rank's own ``os.killpg(os.getpgid(0), ...)``, or the caller's
    ``os.killpg(job.pid, ...)``) takes the whole job, as losing its node would; every rank
    writes to ``log``. The launcher exits 0 when every rank did, else 1 (torchrun's statuses),
    having ended the other ranks once one failed.
    """
    environ = dict(os.environ if env is None else env)
    environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's, as the server imported torch with
    job = {"nproc": nproc, "argv": list(argv), "log": str(log), "cwd": str(cwd), "env": environ}
    preload = tuple(preload)
    return ForkedJob(preload, _request(preload, {"start": job})["pid"])


class ForkedJob:
    """A job :func:`start` forked: what ``subprocess.Popen`` gives a caller to wait for it and
    kill it by (``pid``, the job's process group and session too; ``poll``, ``wait``,
    ``returncode``). Its status comes from the server, whose child the launcher is."""

    def __init__(self, preload: tuple[str, ...], pid: int) -> None:
        self._preload = preload
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = _request(self._preload, {"poll": self.pid})["status"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked job {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode


def train_titan_preload() -> tuple[str, ...]:
    """What a rank of ``train_titan.py`` imports on a CPU before it reads its config, in its
    order: the CPU shim first (it imports torchtitan's trainer), then the installed
    release's front-end."""
    from acco_hooks.titan import TITAN_030

    release = (("acco_hooks.titan.v030", "acco_hooks.titan.toml_compat") if TITAN_030
               else ("acco_hooks.titan.v022",))  # fmt: skip
    return ("scaffolding.cpu_shim", *release, "scaffolding.stdlib_data",
            "scaffolding.process_exit", "acco_hooks.elastic")  # fmt: skip


def _request(preload: tuple[str, ...], message: dict) -> dict:
    """Send ``message`` to the server for ``preload`` (started on first use); its reply."""
    with _requests:  # one exchange at a time: a thread's run_groups beside the caller's own
        server = _server(preload)
        server.stdin.write(json.dumps(message) + "\n")
        server.stdin.flush()
        reply = server.stdout.readline()
    if not reply:
        _servers.pop(preload, None)
        raise RuntimeError(f"the forked-ranks server for {list(preload)} died "
                           f"(exit status {server.wait()})")  # fmt: skip
    return json.loads(reply)


def _server(preload: tuple[str, ...]) -> subprocess.Popen:
    server = _servers.get(preload)
    if server is None or server.poll() is not None:
        # torchrun's default for its workers, read by OpenMP when torch is imported
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        server = subprocess.Popen(
            [sys.executable, "-m", "scaffolding.forked_ranks", *preload], cwd=ROOT, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        _servers[preload] = server
    return server


@atexit.register
def _stop_servers() -> None:
    for server in _servers.values():
        server.stdin.close()  # the server's loop ends at end of input
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
    _servers.clear()


# ------------------------------------------------------------------------------- the server


def _preload(preload: Sequence[str]) -> None:
    """Import what the ranks will fork with; refuse where a GPU is visible.

    The imported objects are then frozen out of the garbage collector's view
    (:func:`gc.freeze`): a rank's collections (torchtitan's, and ``process_exit``'s two at its
    end) would otherwise walk the whole preloaded heap, and writing each object's header
    copies every page of it into the rank (py-spy: 10 % of a 3-D job's CPU went to the two
    collections at exit alone).
    """
    for name in preload:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        raise SystemExit("scaffolding.forked_ranks: a forked rank cannot use CUDA once its "
                         "parent initialized it; launch GPU jobs with torchrun")  # fmt: skip


def _serve(preload: Sequence[str]) -> None:
    """Answer one request a line: a job to run (its status once it ended), a job to start
    (its launcher's pid), or a started job's status (``None`` while it runs)."""
    _preload(preload)
    replies = os.fdopen(os.dup(1), "w")  # fd 1 becomes /dev/null: nothing else writes here
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    for line in sys.stdin:
        request = json.loads(line)
        if "start" in request:
            reply = {"pid": _start_launcher(request["start"], replies.fileno())}
        elif "poll" in request:
            pid, wait_status = os.waitpid(request["poll"], os.WNOHANG)
            reply = {"status": os.waitstatus_to_exitcode(wait_status) if pid else None}
        else:
            status, timed_out = _run_job(request)
            reply = {"status": status, "timed_out": timed_out}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    # At the end of input: nothing of the server's needs finalizing, and a finalization of its
    # frozen heap (extension modules' objects never freed) makes nanobind report leaks
    os._exit(0)


def _start_launcher(job: dict, replies_fd: int) -> int:
    """Fork ``job``'s launcher in a session of its own; its pid once it is in it. The
    launcher forks the ranks (in its process group), waits for them, and exits 0 when every
    rank did, else 1."""
    in_session_r, in_session_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(in_session_w)
        os.read(in_session_r, 1)  # a kill of the session it replies with must find it
        os.close(in_session_r)
        return pid
    code = 1
    try:
        os.setsid()
        os.close(in_session_r)
        os.write(in_session_w, b"x")
        os.close(in_session_w)
        os.close(replies_fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        out = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        launched = {**job, "log": None, "timeout_s": float("inf"), "own_group": False}
        status, _ = _run_job(launched)
        code = 0 if status == 0 else 1
    except BaseException:  # noqa: BLE001 - to the job's log, status 1
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run_job(job: dict) -> tuple[int, bool]:
    nproc, own_groups = job["nproc"], job.get("own_group", True)
    sys.stdout.flush()
    sys.stderr.flush()
    ranks, port_pipes = {}, []
    for rank in range(nproc):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(write_end)
            for _, earlier in port_pipes:
                os.close(earlier)
            _rank(rank, nproc, read_end, job)  # never returns
        os.close(read_end)
        port_pipes.append((pid, write_end))
        ranks[pid] = rank
    # The store starts once every rank is forked: a fork copies no thread, so a rank forked
    # beside a running store server would hold a copy of its state without the thread.
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
    for _, write_end in port_pipes:
        os.write(write_end, f"{store.port}\n".encode())
        os.close(write_end)
    try:
        return _wait_for_ranks(ranks, job, own_groups)
    finally:
        del store


def _wait_for_ranks(ranks: dict[int, int], job: dict, own_groups: bool) -> tuple[int, bool]:
    deadline = time.monotonic() + job["timeout_s"]
    status, running = 0, set(ranks)
    while running:
        # by pid: the server's other children (launchers it started) are not this job's
        ended = [(pid, wait_status) for pid, wait_status in
                 (os.waitpid(pid, os.WNOHANG) for pid in list(running)) if pid]  # fmt: skip
        if not ended:
            if time.monotonic() > deadline:
                _kill(running, own_groups)
                for pid in running:
                    os.waitpid(pid, 0)
                return -signal.SIGKILL, True
            time.sleep(0.02)
            continue
        for pid, wait_status in ended:
            running.discard(pid)
            code = os.waitstatus_to_exitcode(wait_status)
            if code != 0 and status == 0:
                status = code
                _kill(running, own_groups)  # as torchrun's agent: one failed rank ends the job
    return status, False


def _kill(pids: set[int], own_groups: bool) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            if own_groups:
                os.killpg(pid, signal.SIGKILL)  # the rank and what it started
            else:  # a launched job's rank, in the launcher's group
                os.kill(pid, signal.SIGKILL)


def _rank(rank: int, nproc: int, port_pipe: int, job: dict) -> None:
    """One rank: what ``python *argv`` does in a process torchrun started. Exits."""
    code = 1
    try:
        with os.fdopen(port_pipe) as pipe:  # the job's store, once the launcher started it
            port = int(pipe.readline())
        if job.get("own_group", True):
            os.setpgid(0, 0)  # its own group: a kill takes what it started too
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        if job["log"] is not None:  # else the launcher's streams
            out = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(out, 1)
            os.dup2(out, 2)
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        os.environ.update({
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc), "ROLE_NAME": "default",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "none",
        })  # fmt: skip
        argv = job["argv"]
        # sys.path as the interpreter starts it: the program's folder, then PYTHONPATH's
        pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[1:1] = [p for p in pythonpath if p not in sys.path]
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = job["cwd"]
            # preloaded: its imports stay cached, and runpy runs it afresh as __main__ (left in
            # sys.modules, runpy warns that it may run twice)
            sys.modules.pop(argv[1], None)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:  # sys.exit("message"): printed, status 1
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, status 1
        traceback.print_exc()
    try:
        # what the end of a process does (its exit handlers, its streams), then no
        # finalization, as scaffolding.process_exit.finish(finalize=False)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


if __name__ == "__main__":
    _serve(sys.argv[1:])
