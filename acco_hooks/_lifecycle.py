"""The engine's lifecycle around the round schedule: its gradient hooks, the real weights θ
(``flush()``, ``real_weights()``), and ``close()``.

They touch the round in flight only through :meth:`ACCOEngine._finish_in_flight`, the one place
that waits for the communication thread and applies its result.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from acco_hooks._buffers import memory_bytes
from acco_hooks._comm_job import ACCOCommunicationError, Job
from acco_hooks._groups import barrier_each
from acco_hooks._ownership import claim, release

__all__ = ["EngineLifecycleMixin"]

logger = logging.getLogger("acco_hooks.engine")


class EngineLifecycleMixin:
    """Hooks, ``flush()``, ``real_weights()``, ``close()`` and the context manager of
    :class:`ACCOEngine`."""

    __slots__ = ()

    def hook_param_grads(self, on_grad: Callable[[Tensor], None] | None = None) -> None:
        """Register a post-accumulate-grad hook on every parameter; :meth:`close` removes them.

        Args:
            on_grad: what the hook does with the parameter. Default: hand ``.grad`` to
                :meth:`accumulate_grad` and drop it, so ``.grad`` is ``None`` after backward.
                The DDP hook passes its own (DDP's buckets deliver the gradients there).
        """
        if on_grad is None:
            # A weak reference: the parameters must not keep an engine its owner dropped alive
            # (it is then released); their gradients then stay in ``.grad`` as usual.
            engine_ref = weakref.ref(self)

            def on_grad(param: Tensor) -> None:
                engine = engine_ref()
                if engine is not None:
                    engine.accumulate_grad(param, param.grad)
                    param.grad = None

        params = self.params
        try:
            claim(self, params, [name for g in self._buffers for name in g.names])
        except RuntimeError:
            self.close(flush=False, barrier=False)  # its groups go now, not with the traceback
            raise
        self._hook_handles += [p.register_post_accumulate_grad_hook(on_grad) for p in params]

    def flush(self) -> None:
        """Wait for in-flight communication and leave the latest real parameters θ in the model.

        An estimate in flight is kept and applied at the next round end as usual (the model
        already holds the real θ it was computed from), so training may go on exactly. A real
        update in flight is applied now; training may go on from it (the next round then
        computes at θ_{t+1} where it would have used θ̃_{t+1}: the estimate is exact). Use
        :meth:`real_weights` to look at θ without changing the trajectory.
        """
        if self._in_flight is not None:
            self._finish_in_flight(apply=self._in_flight_job is Job.UPDATE)

    @contextlib.contextmanager
    def real_weights(self) -> Iterator[dict[str, Tensor] | None]:
        """Within the block the model holds the real parameters θ; after it, what it held before.

        The real θ is what :meth:`flush` would leave in the model. When a real update is in
        flight (``acco`` after an estimate was applied, ``dpu``), the block waits for it, as
        the next round end would, but does not apply it: its result stays pending and is
        applied at the round end as usual, so evaluating inside the block never changes the
        training trajectory. Costs one copy of the live parameters while the block runs.

        Yields:
            The live parameters the block replaced (by name), or ``None`` when the model
            already held θ.

        Example::

            >>> with opt.real_weights():
            ...     val_loss = evaluate(model)
        """
        self._raise_if_failed()
        if self._in_flight is None or self._in_flight_job is not Job.UPDATE:
            yield None
            return
        self._finish_in_flight(apply=False)
        live = {n: t.clone() for g in self._buffers for n, t in zip(g.names, g.locals)}
        with torch.no_grad():
            for g in self._buffers:
                g.copy_gathered_into_params()
        try:
            yield live
        finally:
            with torch.no_grad():
                for g in self._buffers:
                    torch._foreach_copy_(g.locals, [live[n] for n in g.names])

    @property
    def process_groups(self) -> tuple[Any, ...]:
        """The process groups this engine built for its thread (empty once closed)."""
        return () if self._groups is None else self._groups.owned

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran: the thread is joined and the process groups destroyed."""
        return not self._release.alive

    def close(self, *, flush: bool = True, barrier: bool = True) -> None:
        """Finish or drop the round in flight, stop the thread, destroy the engine's groups.

        Args:
            flush: ``True``: a real update in flight is applied, and the model ends at the real
                parameters θ, as after :meth:`flush`. ``False``: it is dropped, and the model
                keeps the live parameters (in ``acco`` possibly the estimate θ̃). Skipped after
                a communication failure.
            barrier: meet the other ranks at a barrier on each of the engine's groups first,
                so that no rank tears a group down while a peer still finishes its last
                collective on it. Every rank must then call ``close()`` (as each one does when
                it ends training). Pass ``False`` when closing after an error on this rank
                alone: the peers then fail their next collective with a clear error instead
                of waiting. Skipped anyway after a communication failure.

        Removes the gradient hooks. Idempotent; the engine runs no round afterwards.
        """
        if self.closed:
            return
        try:
            if self._in_flight is not None and self._failure is None:
                self._finish_in_flight(apply=flush and self._in_flight_job is Job.UPDATE)
        except (ACCOCommunicationError, FloatingPointError):
            pass  # already reported to the training loop by the call that failed
        finally:
            for handle in self._hook_handles:
                handle.remove()
            self._hook_handles = []
            release(self)
            if barrier and self._failure is None and self.process_groups:
                self._meet_peers()
            self._release()
            # Drop the last references too: the groups' C++ objects go now, not at exit. A
            # result not applied above is dropped for good (a later flush() applies nothing).
            self._groups = None
            self._in_flight = self._in_flight_job = None

    def _meet_peers(self) -> None:
        backstop = None if self.timeout is None else self.timeout + 60.0
        try:
            job = self._worker.submit(barrier_each, self.process_groups)
            self._worker.wait(job, timeout_s=backstop)
        except Exception:  # noqa: BLE001 - a peer died meanwhile: tear down anyway
            logger.warning("acco_hooks: close(): a peer never reached the barrier", exc_info=True)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds, by the categories of the spec's memory table."""
        return memory_bytes(self._buffers, self.optimizer, self.reduce_dtype)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.close(flush=exc_type is None, barrier=exc_type is None)
