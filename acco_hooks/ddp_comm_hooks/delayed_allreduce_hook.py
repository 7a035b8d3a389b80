"""``delayed_allreduce_hook``: DDP's all-reduce, one round late, so backward never waits.

This is the naive delayed parameter update (DPU, also known as PipeSGD) with the user's own,
unsharded optimizer. It is useful as a baseline and for optimizers the ACCO engine cannot
shard. It has no estimate step, so it suffers the one-step delay that ACCO corrects.
"""


import functools
import logging
import weakref

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["DelayedAllReduceState", "delayed_allreduce_hook"]

logger = logging.getLogger(__name__)


class _PendingAllReduce:
    """One bucket's all-reduce of one round: waited for (and averaged) once, when needed."""

    __slots__ = ("work", "flat", "averaged")

    def __init__(self, work: dist.Work, flat: Tensor) -> None:
        self.work, self.flat, self.averaged = work, flat, False

    def result(self, world_size: int) -> Tensor:
        if not self.averaged:
            self.work.wait()
            self.flat.div_(world_size)
            self.averaged = True
        return self.flat


class DelayedAllReduceState:
    r"""State of :func:`delayed_allreduce_hook`.

    Each bucket's all-reduce is launched during round k's backward and consumed during round
    k+1's. What it still holds (the previous round's all-reduces) is keyed by parameter, so the
    state survives DDP's bucket rebuild after the first iteration.

    .. warning::
        The first backward has no previous round: the hook leaves ``.grad`` as ``None``, so
        ``optimizer.step()`` skips every parameter. The weights do not decay and Adam's step
        does not advance on a zero gradient. Call ``optimizer.step()`` and ``zero_grad()`` as
        usual.

    .. warning::
        A round is one *synchronized* backward. To accumulate several micro-batches per
        optimizer step, run all but the last under ``ddp_model.no_sync()``: a backward that
        would add to the gradient the hook delivered (``zero_grad()`` not called since) is
        refused, since that delivered average would be all-reduced again.

    With ``find_unused_parameters=True``, a parameter no rank used in a round gets ``None``
    one round later, as DDP leaves it in that step, and optimizers skip it there.

    Args:
        process_group: DDP's process group. Default: the whole world.

    Example::

        >>> ddp_model.register_comm_hook(DelayedAllReduceState(), delayed_allreduce_hook)
        >>> for batch in loader:
        ...     ddp_model(batch).loss.backward()   # .grad: the PREVIOUS round's average
        ...     optimizer.step()
        ...     optimizer.zero_grad()
        >>> state.flush()
    """

    __slots__ = (
        # The process group and its size
        "process_group", "world_size",
        # Rounds (synchronised backward passes) seen so far
        "round_index",
        # In-flight all-reduces by parameter: this round's, and the previous round's
        "_launched", "_previous", "_backward_open",
        # Parameters no rank used in the previous round (DDP left their .grad alone)
        "_unused_previous",
        # What the hook delivered, by parameter: the .grad tensor and its version then; the
        # parameters whose gradient is checked before autograd adds to it
        "_delivered", "_checked", "__weakref__",
    )  # fmt: skip

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.round_index = 0
        self._launched: dict[Tensor, tuple[_PendingAllReduce, int]] = {}
        self._previous: dict[Tensor, tuple[_PendingAllReduce, int]] = {}
        self._backward_open = False
        self._unused_previous: set[Tensor] = set()
        self._delivered: dict[Tensor, tuple[Tensor, int]] = {}
        self._checked: set[Tensor] = set()

    def flush(self) -> None:
        """Wait for the all-reduces still in flight (the last round's, which no step applies).

        Call it before ``destroy_process_group()``: tearing a group down under a pending gloo
        collective aborts the process.
        """
        for pending, _ in list(self._previous.values()) + list(self._launched.values()):
            pending.result(self.world_size)

    def _end_of_backward(self) -> None:
        """Runs after DDP copied the buckets into ``.grad``: this round's launches become old.

        DDP leaves the ``.grad`` of a parameter no rank used alone (``find_unused_parameters``):
        such a parameter is unused this round, and gets the previous round's average here
        instead of through its bucket; one unused in the previous round gets ``None``.
        """
        # .grad untouched by DDP: None after zero_grad() (a zeroed tensor otherwise, which
        # DDP's plain path would also hand the optimizer)
        unused_now = {param for param in self._launched if param.grad is None}
        for param in self._launched:
            if self.round_index == 0 or param in self._unused_previous:
                param.grad = None  # nothing to apply: optimizers skip the parameter
            elif param in unused_now:
                previous, start = self._previous[param]
                averaged = previous.result(self.world_size)[start : start + param.numel()]
                param.grad = averaged.view_as(param).clone()
        self._delivered = {param: (param.grad, param.grad._version)
                           for param in self._launched if param.grad is not None}  # fmt: skip
        self._unused_previous = unused_now
        self._previous, self._launched = self._launched, {}
        self.round_index += 1
        self._backward_open = False

    def _check_accumulation(self, param: Tensor) -> None:
        """Before autograd adds a gradient to ``param.grad``: refuse to add it to the average
        the hook delivered, untouched since (no ``zero_grad()``)."""
        delivered = self._delivered.get(param)
        if delivered is not None and param.grad is delivered[0] and param.grad._version == delivered[1]:
            raise RuntimeError(
                "delayed_allreduce_hook: this backward() adds to the gradient the hook "
                "delivered at the previous synchronized backward, which no zero_grad() cleared: "
                "that average would be all-reduced again. Call optimizer.step() and "
                "optimizer.zero_grad() after every synchronized backward(); to accumulate "
                "several micro-batches per step, run all but the last under ddp_model.no_sync()"
            )


def _before_accumulation(state_ref: weakref.ref, param: Tensor, grad: Tensor) -> None:
    state = state_ref()
    if state is not None:
        state._check_accumulation(param)


def delayed_allreduce_hook(
    state: DelayedAllReduceState, bucket: dist.GradBucket
) -> torch.futures.Future[Tensor]:
    r"""Launch this round's all-reduce of the bucket; return the previous round's average.

    1. Copy the bucket (this round's local gradients) and launch its all-reduce without
       waiting.
    2. Fill the bucket with the previous round's averaged gradients of the same parameters
       (waiting for that all-reduce, which had a whole round to finish), taken parameter by
       parameter because DDP may have rebuilt its buckets in between.
    3. Return the bucket at once: backward never waits on this round's network traffic.

    Args:
        state: a :class:`DelayedAllReduceState`.
        bucket: the bucket of gradients DDP hands the hook.

    Returns:
        A completed future holding the previous round's averaged gradients.

    Example::

        >>> ddp_model.register_comm_hook(DelayedAllReduceState(), delayed_allreduce_hook)
    """
    if not state._backward_open:
        state._backward_open = True
        # DDP queues its own end-of-backward callback (which copies the buckets into .grad)
        # after the last bucket; a callback queued from a callback runs after it.
        queue = torch.autograd.Variable._execution_engine.queue_callback
        queue(lambda: queue(state._end_of_backward))
    for param in bucket.parameters():
        if param not in state._checked:  # once per parameter: runs before autograd accumulates
            state._checked.add(param)
            state_ref = weakref.ref(state)
            param.register_hook(functools.partial(_before_accumulation, state_ref, param))
    buffer = bucket.buffer()
    flat = buffer.clone()
    pending = _PendingAllReduce(dist.all_reduce(flat, group=state.process_group, async_op=True), flat)
    offset = 0
    for param in bucket.parameters():
        state._launched[param] = (pending, offset)
        offset += param.numel()

    if state.round_index == 0:
        buffer.zero_()
    else:
        for param, grad in zip(bucket.parameters(), bucket.gradients()):
            previous, start = state._previous[param]
            averaged = previous.result(state.world_size)
            grad.copy_(averaged[start : start + param.numel()].view_as(grad))
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future
