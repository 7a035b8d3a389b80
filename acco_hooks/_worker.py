"""The communication side: one background thread that owns the engine's process group.

Why a thread and not async collectives from the training loop: gloo's ``Work`` objects cannot
be polled (``is_completed()`` stays False until ``wait()``) and have no futures, so the chain
reduce-scatter -> shard step -> all-gather cannot be driven from the main thread without
blocking it. A thread that runs the chain with blocking collectives overlaps 0.91-0.97 of the
communication on a bandwidth-capped link (``shared/notes/cpu-comm-worker.md``). torch ops and
gloo collectives release the GIL, so the training loop keeps running.

The thread must be the *only* user of its process group: two threads issuing collectives on one
group deadlock. The engine therefore builds a dedicated group for it.

On CUDA the same thread runs its work on a side stream of its own. Two events order it with the
training loop: a job starts (on that stream) after the work the caller had queued when it
submitted the job, and the job's future completes only once its device work has finished, not
once its kernels and collectives are queued. NCCL collectives return to the host as soon as they
are enqueued, so a future set at that point would say "done" while the all-gather still runs:
``accumulate_until_ready`` would end rounds early and the advisor would time the enqueueing.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any, Callable

import torch

__all__ = ["CommWorker"]

logger = logging.getLogger(__name__)

# How often a waiting training loop re-checks that the worker thread is still alive.
_LIVENESS_POLL_S = 1.0

class CommWorker:
    """A FIFO of jobs executed in order on one daemon thread.

    Every job's outcome (its return value or any exception, ``BaseException`` included) is
    delivered through the ``Future`` returned by :meth:`submit`, so a failure on the
    communication side always reaches the training loop instead of killing the thread silently.

    Args:
        device: the device the jobs compute on. For CUDA the jobs run on a dedicated stream,
            and the thread makes ``device`` its current device (the CUDA current device is
            per thread: a new thread would otherwise allocate on device 0).
        name: the thread's name (shows up in ``py-spy`` dumps and tracebacks).
    """

    __slots__ = ("_jobs", "_thread", "_stream", "_closed")

    def __init__(self, device: torch.device, name: str = "acco-comm") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stream = None
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            self._stream = torch.cuda.Stream(torch.device("cuda", index))
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)``; return the future of its result.

        On CUDA the job waits (on the worker's stream) for all work already queued on the
        caller's current stream, so buffers the caller just wrote are complete when it reads
        them. The future completes once the job's device work has finished (the thread waits
        for an event recorded after it), so ``future.done()`` means the result is in memory;
        :meth:`wait` also orders the caller's stream after the worker's.
        """
        if self._closed:
            raise RuntimeError("acco_hooks: the communication worker is closed")
        future: Future = Future()
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._stream.device))
        self._jobs.put((future, fn, args, ready))
        return future

    def wait(self, future: Future, timeout_s: float | None = None) -> Any:
        """Block until ``future`` is done and return its result (re-raising its exception).

        Re-checks every second that the worker thread is alive, so a dead worker can never
        leave the training loop waiting forever. ``timeout_s`` bounds the whole wait.
        """
        waited = 0.0
        while True:
            try:
                result = future.result(timeout=_LIVENESS_POLL_S)
                break
            except FutureTimeoutError:  # the builtin TimeoutError only from Python 3.11
                waited += _LIVENESS_POLL_S
                if not self._thread.is_alive():
                    raise RuntimeError(
                        "acco_hooks: the communication worker thread died without reporting "
                        "an error; the in-flight round is lost"
                    ) from None
                if timeout_s is not None and waited >= timeout_s:
                    raise TimeoutError(
                        f"acco_hooks: communication did not finish within {timeout_s:.0f} s; "
                        "a peer rank is probably dead or stuck"
                    ) from None
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        return result

    def close(self, timeout_s: float = 60.0) -> None:
        """Let the thread finish the queued jobs, exit, and join it. Idempotent.

        Joining matters: a process that tears down its process groups while this thread is
        still alive can abort in gloo's destructors.
        """
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        if self._stream is not None:
            torch.cuda.set_device(self._stream.device)
        while True:
            item = self._jobs.get()
            if item is None:
                return
            future, fn, args, ready = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if self._stream is not None:
                    result = self._run_on_stream(fn, args, ready)
                else:
                    result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - every failure must reach the loop
                logger.debug("acco_hooks: communication job failed", exc_info=True)
                future.set_exception(exc)
            else:
                future.set_result(result)

    def _run_on_stream(self, fn: Callable[..., Any], args: tuple, ready: Any) -> Any:
        """Run ``fn(*args)`` on the stream after ``ready``; return when its device work is done."""
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            result = fn(*args)
        # blocking: the thread sleeps until the device gets there instead of spinning on a core
        # the training loop needs.
        finished = torch.cuda.Event(blocking=True)
        finished.record(self._stream)
        finished.synchronize()
        return result
