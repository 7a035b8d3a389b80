"""Run a function on N gloo (or NCCL) processes and collect what each rank returns.

:class:`RankPool` keeps a few processes alive and gives each call a fresh default process group
over the first N of them, so that a test pays for starting Python and importing torch once per
session, not once per call (2 s for 2 ranks on a 2-core machine, more than many tests' own
work). :func:`run_distributed` runs on the session's pool (:func:`shared_pool`) unless the
call needs processes of its own: ``fresh_processes=True`` (a resume whose subject is a new
process, a rank that sets process-wide state), ranks that may die, NCCL, or more ranks than the
pool holds.

Every call's ranks meet on a store this (the test's) process hosts: :func:`call_store` binds
port 0 once and hands each call a fresh key prefix. No port is picked, released and bound
again by someone else (another test's job could take a port between the pick and the bind),
and a rank that kills itself takes no store down with it.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import gc
import importlib
import io
import itertools
import os
import queue
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scaffolding.process_exit import finish, release_process_groups

# A test whose processes have not finished by then fails instead of hanging the suite.
DEFAULT_DEADLINE_S = 180.0
# The shared pool's size: the largest world a pooled call may ask for.
SHARED_POOL_RANKS = 4


_store: dist.TCPStore | None = None
_calls = itertools.count()


def call_store() -> tuple[int, str]:
    """The port of the store this process hosts for its calls' ranks, and a prefix of keys no
    earlier call used."""
    global _store
    if _store is None:
        _store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=60))  # fmt: skip
    return _store.port, f"call{next(_calls)}/"


def _init_group(backend: str, rank: int, world_size: int, where: tuple[int, str],
                device_id=None) -> None:  # fmt: skip
    port, prefix = where
    client = dist.TCPStore("127.0.0.1", port, is_master=False,
                           timeout=datetime.timedelta(seconds=60))  # fmt: skip
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, client), rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=60),
                            device_id=device_id)  # fmt: skip


def _entry(
    rank: int, world_size: int, where: tuple[int, str], fn_path: str, args: tuple, outdir: str,
    orderly_teardown: bool = True, backend: str = "gloo",
) -> None:  # fmt: skip
    # A rank that aborts (SIGABRT from C++) shows every thread's Python stack in the test log.
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    device_id = None
    if backend == "nccl":  # one GPU per rank, bound before the first collective
        device_id = torch.device("cuda", rank)
        torch.cuda.set_device(device_id)
    _init_group(backend, rank, world_size, where, device_id)
    try:
        module, name = fn_path.rsplit(":", 1)
        result = getattr(importlib.import_module(module), name)(rank, world_size, *args)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
        if orderly_teardown:
            # Nobody destroys the group while a peer's last collectives may still be draining
            # (a gloo teardown under traffic can abort the process).
            dist.barrier()
    except BaseException:
        with contextlib.suppress(Exception):  # after a peer died, teardown may fail too
            dist.destroy_process_group()
        raise
    # Every group destroyed and its threads joined before the interpreter finalizes, or no
    # finalization at all (scaffolding/process_exit.py: why a finished rank could abort).
    finish()


def run_distributed(
    fn_path: str, world_size: int, *args, deadline_s: float = DEFAULT_DEADLINE_S,
    may_die: tuple[int, ...] = (), backend: str = "gloo", fresh_processes: bool = False,
):  # fmt: skip
    """Call ``module:function(rank, world_size, *args)`` on ``world_size`` gloo processes.

    ``backend="nccl"`` runs them on NCCL instead, rank r on GPU r.

    Returns the list of per-rank return values. A rank's exception is re-raised here; ranks
    still running after ``deadline_s`` are killed and the call fails. Ranks in ``may_die`` may
    end without a result (``None``), e.g. a rank that kills itself to test fault handling; the
    others are then left to finish on their own instead of being terminated.

    Gloo calls of up to :data:`SHARED_POOL_RANKS` ranks run on the session's processes
    (:func:`shared_pool`); ``fresh_processes=True`` starts new ones for this call, for a
    function whose subject is a new process or that changes process-wide state (an
    environment variable, a library's global settings).
    """
    if not (fresh_processes or may_die or backend != "gloo" or world_size > SHARED_POOL_RANKS):
        return shared_pool().run(fn_path, world_size, *args, deadline_s=deadline_s)
    if may_die:
        assert backend == "gloo", "may_die runs on gloo only"
        return _run_with_dying_ranks(fn_path, world_size, args, deadline_s, may_die)
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(
            _entry,
            args=(world_size, call_store(), fn_path, args, outdir, True, backend),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + deadline_s
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{fn_path} on {world_size} ranks ran past {deadline_s:.0f} s")
        return [
            torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]


def _run_with_dying_ranks(fn_path, world_size, args, deadline_s, may_die):
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.get_context("spawn")
        where = call_store()
        procs = [ctx.Process(target=_entry, args=(r, world_size, where, fn_path, args, outdir, False))
                 for r in range(world_size)]  # fmt: skip
        for p in procs:
            p.start()
        deadline = time.monotonic() + deadline_s
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise TimeoutError(f"{fn_path}: a surviving rank did not finish in {deadline_s:.0f} s")
            time.sleep(0.2)
        results = []
        for rank, p in enumerate(procs):
            path = os.path.join(outdir, f"rank{rank}.pt")
            if os.path.exists(path):
                results.append(torch.load(path, weights_only=False))
            elif rank in may_die:
                results.append(None)
            else:
                raise RuntimeError(f"{fn_path}: rank {rank} exited with {p.exitcode} and no result")
        return results


# ------------------------------------------------------------------ processes kept between calls


def _pool_worker(rank: int, inbox: mp.Queue, outbox: mp.Queue) -> None:
    """Run each task on a process group of its own: init, call, barrier, destroy."""
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    while (task := inbox.get()) is not None:
        where, world_size, fn_path, args = task
        try:
            _init_group("gloo", rank, world_size, where)
            module, name = fn_path.rsplit(":", 1)
            result = getattr(importlib.import_module(module), name)(rank, world_size, *args)
            dist.barrier()  # no rank tears the group down under a peer's last collective
            buffer = io.BytesIO()
            torch.save(result, buffer)
            outbox.put((rank, True, buffer.getvalue()))
        except BaseException:  # noqa: BLE001 - reported to the caller, who fails the test
            outbox.put((rank, False, traceback.format_exc()))
        finally:
            # what the task left (an engine nobody closed) goes before its group does
            release_process_groups()
            # What survives a task (torch, the modules it imported) is frozen out of the
            # collector's view: the next task's collections walk only what that task makes
            gc.freeze()
    finish()


class RankPool:
    """Up to ``max_world_size`` processes that run one distributed call after another.

    :meth:`run` calls ``module:function(rank, world_size, *args)`` on ranks ``0 ..
    world_size - 1``, each time in a new gloo default group (the process group of an earlier
    call is destroyed); ranks above ``world_size`` wait. A call that fails or runs past its
    deadline kills every process, and the next call starts new ones.
    """

    def __init__(self, max_world_size: int) -> None:
        self.max_world_size = max_world_size
        self._procs: list = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(self.max_world_size)]
        self._procs = [ctx.Process(target=_pool_worker, args=(r, inbox, self._outbox), daemon=True)
                       for r, inbox in enumerate(self._inboxes)]  # fmt: skip
        for p in self._procs:
            p.start()

    def run(self, fn_path: str, world_size: int, *args, deadline_s: float = DEFAULT_DEADLINE_S):
        """The list of per-rank return values; a rank's exception fails the call with its
        traceback."""
        assert 1 <= world_size <= self.max_world_size, world_size
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        where = call_store()
        for r in range(world_size):
            self._inboxes[r].put((where, world_size, fn_path, args))
        results, failures = {}, []
        deadline = time.monotonic() + deadline_s
        while len(results) + len(failures) < world_size:
            try:  # after a failure, the peers get a few seconds to report theirs
                left = deadline - time.monotonic() if not failures else 5.0
                rank, ok, payload = self._outbox.get(timeout=max(left, 0.01))
            except queue.Empty:
                break
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                failures.append(f"rank {rank}:\n{payload}")
        if failures or len(results) < world_size:
            self.close()  # a peer may be stuck in a collective: start over next time
            raise RuntimeError(f"{fn_path} on {world_size} ranks: "
                               + ("\n".join(failures) or f"ran past {deadline_s:.0f} s"))
        return [results[r] for r in range(world_size)]

    def close(self) -> None:
        """Stop every process (politely, then by force)."""
        for p, inbox in zip(self._procs, getattr(self, "_inboxes", [])):
            if p.is_alive():
                inbox.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []


_shared: list[RankPool] = []


def shared_pool() -> RankPool:
    """The session's :class:`RankPool` of :data:`SHARED_POOL_RANKS` processes, started on
    first use and stopped at interpreter exit (tests/conftest.py's ``rank_pool`` fixture
    stops it at the session's end)."""
    if not _shared:
        _shared.append(RankPool(SHARED_POOL_RANKS))
        atexit.register(_shared[0].close)
    return _shared[0]
