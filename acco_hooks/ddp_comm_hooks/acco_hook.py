"""``acco_hook``: ACCO for an existing ``DistributedDataParallel`` training loop."""


import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.join import Joinable, JoinHook
from torch.nn.parallel import DistributedDataParallel

from acco_hooks._frontend import EngineFrontEnd
from acco_hooks.engine import ACCOEngine
from acco_hooks.engine.buffers import normalize_param_groups

__all__ = ["ACCOState", "acco_hook"]

logger = logging.getLogger(__name__)


class ACCOState(EngineFrontEnd, Joinable):
    r"""State of :func:`acco_hook`: the ACCO engine over a DDP model's parameters.

    The hook takes each bucket's local gradients into the engine's fp32 accumulator and lets
    DDP go on at once. The engine communicates once per *round*, on its own thread and
    process group, while the next round's micro-batches run. :meth:`step` replaces both
    ``optimizer.step()`` and ``optimizer.zero_grad()``: it counts the micro-batch and ends the
    round when it may. The engine owns the optimizer, sharded ZeRO-1 style over DDP's process
    group.

    Every setting of the engine (:class:`~acco_hooks.engine.EngineSettings`: ``mode``,
    ``accumulation_steps``, ``accumulate_until_ready``, ``reduce_dtype``, ``max_grad_norm``,
    ``nonfinite``, ``timeout``) and ``lr_scheduler`` are accepted here with the same meaning as
    for :class:`acco_hooks.ACCOOptimizer`, followed by the keyword arguments of
    ``optimizer_class``.

    .. warning::
        DDP rebuilds its buckets after the first iteration, and under ``static_graph`` or
        ``find_unused_parameters`` their content changes. The state is therefore keyed by
        parameter and never by bucket index or size.

    .. warning::
        With uneven inputs, pass the state to DDP's join context after the model:
        ``with Join([ddp_model, state]):``. A rank that has run out of data then counts empty
        micro-batches, so its rounds, and the collectives of each round, stay in step with the
        other ranks. Do not combine this with ``no_sync()``: DDP does not tell a joined rank
        about ``no_sync`` iterations.

    Args:
        ddp_model: the ``DistributedDataParallel`` model to register the hook on.
        optimizer_class: the torch optimizer class stepped on the shard, e.g. ``torch.optim.AdamW``.
        param_groups: optional parameter groups (dicts, as for a torch optimizer) over the
            model's parameters. Default: one group of every trainable parameter, by name.
        **kwargs: ``ACCOOptimizer`` settings and ``optimizer_class`` arguments.

    Example::

        >>> ddp_model = DDP(model)
        >>> state = ACCOState(ddp_model, torch.optim.AdamW, mode="acco", lr=6e-4, weight_decay=0.1)
        >>> ddp_model.register_comm_hook(state, acco_hook)
        >>> for batch in loader:
        ...     ddp_model(batch).loss.backward()
        ...     state.step()
        >>> state.flush()
    """

    __slots__ = (
        # The DDP model the state serves
        "ddp_model",
        # The engine (optimizer, shard, communication thread)
        "engine",
        # What reached the engine since the last step(): bucket gradients from the hook, and
        # parameters whose .grad autograd accumulated (these stay in .grad under no_sync())
        "_delivered", "_accumulated",
        # Parameters whose gradient is in .grad until DDP's backward ends (then in the engine),
        # whether that end is queued, and whether every micro-batch weighed 1 (for Join)
        "_in_grad", "_backward_open", "_unit_weights",
    )  # fmt: skip

    def __init__(
        self,
        ddp_model: DistributedDataParallel,
        optimizer_class: type[torch.optim.Optimizer],
        *,
        param_groups: Any = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(ddp_model, DistributedDataParallel):
            raise TypeError(
                f"ACCOState needs a torch.nn.parallel.DistributedDataParallel model, got "
                f"{type(ddp_model).__name__}: wrap it first, ddp_model = DDP(model)"
            )
        Joinable.__init__(self)
        self.ddp_model = ddp_model
        named = list(ddp_model.module.named_parameters())
        # listed once: a group's params may be a generator, read here and by the engine
        param_groups = named if param_groups is None else [
            {**g, "params": [g["params"]] if isinstance(g["params"], Tensor) else list(g["params"])}
            if isinstance(g, dict) else g for g in param_groups
        ]  # fmt: skip
        given = {id(p) for g in normalize_param_groups(param_groups)[0] for p in g["params"]}
        ignored_trained = [n for n, p in named if n in ddp_model.parameters_to_ignore
                           and p.requires_grad and id(p) in given]  # fmt: skip
        if ignored_trained:
            shown = ", ".join(ignored_trained[:5]) + (" and more" if len(ignored_trained) > 5 else "")
            raise ValueError(
                f"ACCOState: DDP ignores {shown} (its parameters_to_ignore): they are this "
                "rank's own, and the engine would overwrite them with rank 0's and average their "
                "gradients over every rank. Leave them out, param_groups=[(n, p) for n, p in "
                "ddp_model.module.named_parameters() if n not in ddp_model.parameters_to_ignore], "
                "and step them with a torch optimizer of your own, as plain DDP's optimizer would"
            )
        model_params = set(ddp_model.module.parameters())
        # With find_unused_parameters a rank that did not use a parameter gets zeros for it from
        # DDP: the engine then needs it on one rank at least (plain DDP would skip it).
        EngineFrontEnd.__init__(self, ACCOEngine(
            param_groups, optimizer_class, process_group=ddp_model.process_group,
            gradients_may_skip_ranks=ddp_model.find_unused_parameters, **kwargs
        ))  # fmt: skip
        if not set(self.engine.params) <= model_params:
            raise ValueError("ACCOState: param_groups holds tensors that are not parameters of ddp_model")
        self._delivered: set[Tensor] = set()
        self._accumulated: set[Tensor] = set()
        self._in_grad: set[Tensor] = set()
        self._backward_open = False
        self._unit_weights = True
        self.engine.hook_param_grads(self._on_grad)

    def step(self, weight: float = 1.0) -> bool:
        """Count the micro-batch just back-propagated; end the round when it may.

        Replaces ``optimizer.step()`` and ``optimizer.zero_grad()``.

        Args:
            weight: the number of units the micro-batch's loss sums over (default 1), as in
                :meth:`acco_hooks.ACCOOptimizer.step`.

        Returns:
            ``True`` if this call ended a round.
        """
        if not self._accumulated and not self._delivered:
            raise RuntimeError(
                "ACCOState.step() was called but no backward() ran since the last step(): call "
                "loss.backward() on the DDP model's output first"
            )
        self._accumulated.clear()
        self._delivered.clear()
        self._unit_weights = self._unit_weights and weight == 1.0
        return self.engine.microbatch_done(weight)

    def _on_grad(self, param: Tensor) -> None:
        """Autograd accumulated ``param``'s gradient into ``.grad`` (DDP's hook reads it next)."""
        self._accumulated.add(param)
        self._in_grad.add(param)
        if not self._backward_open:
            self._backward_open = True
            # DDP queues its own end-of-backward callback (which copies the buckets into .grad)
            # after the last bucket; a callback queued from a callback runs after it.
            queue = torch.autograd.Variable._execution_engine.queue_callback
            queue(lambda: queue(self._end_of_backward))

    def _end_of_backward(self) -> None:
        """After DDP is done with ``.grad``: the gradients it left there (a backward under
        ``no_sync()``, which skips the hook) go to the engine, and every ``.grad`` holds a
        placeholder until :meth:`step`, so that the loop cannot clip or read what the engine
        has (``ownership``)."""
        self._backward_open = False
        with torch.no_grad():
            for param in self._in_grad - self._delivered:
                self.engine.accumulate_grad(param, param.grad)
        self._in_grad.clear()
        self.engine.leave_placeholders()

    # Joinable: a rank out of data counts empty micro-batches while the others train.
    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _ACCOJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.engine.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.ddp_model.process_group


class _ACCOJoinHook(JoinHook):
    """A rank out of data, while the others train: one empty micro-batch per their iteration.

    Plain DDP under ``Join`` divides by the initial world size by default
    (``divide_by_initial_world_size=True``): a joined rank counts as a rank that contributed a
    zero gradient. The empty micro-batch then weighs what one of this rank's micro-batches
    weighed, 1; with ``False``, or where this rank's micro-batches carried token weights (a
    joined rank has no tokens), nothing, and the average is over the micro-batches that ran.
    """

    def __init__(self, state: ACCOState, divide_by_initial_world_size: bool) -> None:
        self.state = state
        self.divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        """One iteration of the ranks still training: this rank contributes nothing."""
        state = self.state
        state._delivered.clear()
        state._accumulated.clear()
        as_a_rank = self.divide_by_initial_world_size and state._unit_weights
        state.engine.skip_microbatch(weight=1.0 if as_a_rank else 0.0)


def acco_hook(state: ACCOState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    r"""Take a DDP bucket's gradients into the ACCO engine; never wait for the network.

    1. Add each gradient of the bucket to the engine's fp32 accumulator, keyed by parameter.
       A parameter whose gradient already came since the last ``state.step()`` is refused: the
       loop forgot ``state.step()``, and its micro-batches would never be applied. With
       ``find_unused_parameters``, the zeros DDP fills in for a parameter this rank did not use
       are left out: the engine checks that some rank trained each parameter in the round.
    2. Zero the bucket, so that ``.grad`` is zero after backward: the gradient now lives in
       the engine, and the next micro-batch starts from zero without ``zero_grad()``.
    3. Return an already completed future. DDP's all-reduce is replaced, not doubled. The
       engine communicates once per round, at the round end in ``state.step()``, on its own
       thread.

    Args:
        state: the :class:`ACCOState` built for the same DDP model.
        bucket: the bucket of gradients DDP hands the hook.

    Returns:
        A completed future holding the zeroed bucket buffer.

    Example::

        >>> state = ACCOState(ddp_model, torch.optim.AdamW, lr=6e-4)
        >>> ddp_model.register_comm_hook(state, acco_hook)
    """
    engine: ACCOEngine = state.engine
    unused_here_is_zero = state.ddp_model.find_unused_parameters
    for param, grad in zip(bucket.parameters(), bucket.gradients()):
        if param in state._delivered:
            # A second synchronized backward before step(): the loop forgot state.step() (and
            # may still call its old optimizer.step()). Nothing would ever be applied.
            raise RuntimeError(
                "acco_hook: a backward() reached the hook again before ACCOState.step() counted "
                "the previous one: call state.step() after every backward() (it replaces "
                "optimizer.step() and zero_grad(), so nothing else steps the model). To add "
                "several backward() passes into one micro-batch, run all but the last under "
                "ddp_model.no_sync()"
            )
        if unused_here_is_zero and param not in state._accumulated:
            state._delivered.add(param)  # DDP's zeros: this rank's backward did not use it
            continue
        try:
            engine.accumulate_grad(param, grad)
        except KeyError:
            raise RuntimeError(
                "acco_hook: the bucket holds a parameter that this ACCOState does not train: "
                "the state was built for another model (or another parameter set). Build "
                "ACCOState(ddp_model, ...) with the DDP model you register the hook on"
            ) from None
        state._delivered.add(param)
    buffer = bucket.buffer()
    buffer.zero_()
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future
