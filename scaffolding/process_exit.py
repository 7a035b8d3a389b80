"""The end of a distributed process: no process group may outlive the interpreter.

Why this exists. A process that trained successfully could still die at exit with
``terminate called without an active exception`` (SIGABRT). The core file of one such rank
(torch 2.13, gloo) showed the sequence:

1. the last collective's ``wait()`` returns on the main thread as soon as its result is ready;
   the gloo worker thread that ran it (``pt_gloo_runloop``) still owns the finished
   ``AsyncWork`` for a moment, and with it the tensors the collective was called with;
2. the main thread hurries on: ``destroy_process_group()``, return, interpreter finalization.
   ``destroy_process_group()`` only forgets the groups: one that something else still
   references (a DDP reducer, an FSDP state, a device mesh) lives on, with its worker threads.
   torchtitan's trainer turns automatic garbage collection off, so its reference cycles keep
   every group alive into finalization;
3. the worker thread then destroys the ``AsyncWork``; the last reference to a tensor that
   Python once held takes the GIL to free its Python object, finds the interpreter
   finalizing, and ``pthread_exit`` unwinds a ``noexcept`` destructor: ``std::terminate``
   (PyTorch issue 190489).

So the fix has two layers. :func:`release_process_groups` collects the cycles and destroys
every group while the interpreter is alive: each group's C++ object goes with its last
reference, its destructor drains its queue and joins its worker threads, and every tensor they
held is released with the GIL available. :func:`finish` does that, and where a group's worker
threads still run afterwards (held by code outside this project), it leaves without finalizing:
exit handlers run, logs and streams are flushed, then ``os._exit`` with the exit code.

Every process the checkout launches that trains on a process group ends with :func:`finish`
(``train_titan.py``, the examples, the benchmark and test workers). A plain training script
needs none of this if it ends as PyTorch documents, with ``destroy_process_group()`` once
nothing holds a group any more; acco_hooks' own objects release their groups and threads at
``close()``. See the README's "Ending a script" and docs/reliability.md.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import pathlib
import sys

import torch.distributed as dist

logger = logging.getLogger(__name__)

# Native thread names of the process-group backends' workers, which hold a collective's
# tensors while it runs: gloo's run loops (``pt_gloo_runloop``) and NCCL's watchdog and
# friends (``pt_nccl_*``; not exercised on this project's CPU machines).
_GROUP_THREAD_PREFIXES = ("pt_gloo", "pt_nccl")


def group_worker_threads() -> int:
    """How many native threads of process-group backends this process runs (Linux; 0 where
    ``/proc`` cannot tell)."""
    tasks = pathlib.Path("/proc/self/task")
    if not tasks.is_dir():
        return 0
    count = 0
    for task in tasks.iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended while we looked
            continue
        count += name.startswith(_GROUP_THREAD_PREFIXES)
    return count


def release_process_groups() -> int:
    """Destroy every process group now, while the interpreter is alive.

    Collects garbage first (torchtitan turns automatic collection off, and cycles through the
    model's DDP or FSDP state keep groups alive), destroys every group, collects again, and
    turns automatic collection back on.

    Returns:
        How many process-group worker threads still run: 0 unless something outside this
        process's control still references a group.
    """
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    gc.enable()
    return group_worker_threads()


def finish(exit_code: int = 0, *, finalize: bool = True) -> None:
    """End a process that ran on process groups, without an abort at interpreter exit.

    Call it last, once every log line is written and every checkpoint and metric writer is
    closed (a trainer's ``close()``). Returns when nothing is left that finalization could
    trip over, for the usual exit with ``exit_code``; otherwise exits the process here.

    Args:
        exit_code: the process's exit status when it leaves here, without finalizing.
        finalize: ``False`` leaves here in any case, as when a group is still held: for a
            process with nothing left that finalization must release but a large heap of
            modules to tear down. ``train_titan.py``: torchtitan's imports (inductor, datasets,
            pandas) take 1.8 s per process to finalize on a 2-core machine, on every rank.
            Threads still running are not waited for: close what must finish first (a
            trainer's ``close()`` waits for its checkpoint saves).
    """
    left = release_process_groups()
    if left == 0 and finalize:
        return
    if left and finalize:
        # A group's worker threads outlive destroy_process_group(): something we do not own
        # holds the group. Finalizing the interpreter under them is the abort above. (A
        # caller that leaves without finalization in any case knows: a torchft Manager's
        # process group, say, which lives as long as the Manager.)
        logger.warning(
            "%d process-group worker threads are still running after destroy_process_group(): "
            "something still holds a process group; leaving without interpreter finalization",
            left,
        )
    # Skip finalization, after doing what it would have done for this process: the exit
    # handlers (which include logging's flush and close) and the standard streams. Idle
    # worker threads (inductor's compile pool) would wait forever for the shutdown signal
    # that finalization sends them: leaving does not join them.
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing more can be written anyway
            pass
    os._exit(exit_code)
