"""``ACCOOptimizer``: the ACCO engine for a plain ``backward(); step()`` training loop."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from acco_hooks._frontend import EngineFrontEnd
from acco_hooks.engine import ACCOEngine

__all__ = ["ACCOOptimizer"]


class ACCOOptimizer(EngineFrontEnd):
    r"""Data-parallel sharded optimizer that keeps computing while it communicates (ACCO).

    Each rank runs its own model replica. Gradients are summed locally over the micro-batches of
    a *round*; at the round end they go to a background thread that reduce-scatters them,
    steps this rank's 1/N shard of the fp32 master weights with ``optimizer_class`` (ZeRO-1)
    and all-gathers the new parameters, while the training loop already computes the next
    round's micro-batches. In ``acco`` mode every other round is computed at an estimate θ̃ of
    the next parameters, which removes the damage of the one-round delay (arXiv 2406.02613).

    Gradients never stay in ``.grad``: a hook moves each one into the engine's fp32
    accumulator as soon as backward produces it. Until :meth:`step` counts the micro-batch,
    ``.grad`` holds a placeholder that refuses every operation by name (clipping in the loop
    would clip nothing: pass ``max_grad_norm=``); after it, ``None``. ``zero_grad()`` is a
    no-op. The model holds the *live* parameters: in ``acco`` mode
    these alternate between the real θ and the estimate θ̃; call :meth:`flush` to put the real
    θ in the model (before evaluating or exporting it).

    Tuning and the meaning of every setting: :class:`~acco_hooks.engine.EngineSettings` (the
    one place they are declared and checked). In short: ``mode="acco"`` to train, ``"ddp"`` as
    the synchronous baseline; ``accumulation_steps=k`` micro-batches per round, where ``k`` in
    ``acco`` matches ``2k`` in ``ddp`` per update; ``accumulate_until_ready=True`` on
    heterogeneous hardware; ``reduce_dtype=torch.bfloat16`` halves the bytes on the wire.

    .. warning::
        LR schedulers must be given as ``lr_scheduler=`` (a function building the scheduler
        from the shard optimizer), never attached to the ``ACCOOptimizer`` and stepped by the
        loop: the loop cannot know when a real update happens (every round in ``ddp``/``dpu``,
        every other round in ``acco``, whenever communication finishes with
        ``accumulate_until_ready``). The engine steps it once after each real update θ_t →
        θ_{t+1}, and the estimate θ̃_{t+1} uses the learning rate of the update it anticipates.

    Args:
        params: parameters, ``(name, parameter)`` pairs (e.g. ``model.named_parameters()``) or
            parameter-group dicts with per-group options, as for any torch optimizer.
        optimizer_class: the torch optimizer class run on the shard, e.g. ``torch.optim.AdamW``.
            Its step must be per element (Adafactor and Muon are refused, any other class is
            probed: ``acco_hooks.engine.shard_optimizer``). AdamW, Adam and SGD get a
            copy-free estimate step; other classes work by snapshot-and-restore of their state.
        **kwargs: the settings (``mode``, ``accumulation_steps``, ``accumulate_until_ready``,
            ``reduce_dtype``, ``max_grad_norm``, ``nonfinite``, ``timeout``, or
            ``settings=EngineSettings(...)``), the engine's other arguments
            (``process_group``: the data-parallel group or 1-D mesh, default the whole world;
            ``lr_scheduler``: ``callable(optimizer) -> LRScheduler``, see the warning above;
            ``manager``: a ``torchft.Manager``, for replica groups that outlive a lost group;
            a group that joins a running job takes a live group's state here and goes on
            from ``engine.round_index``, ``examples/torchft_train.py``; ``replica_groups``:
            the number of groups the job is launched with, which its first round waits for),
            then the keyword arguments of ``optimizer_class`` (``lr``, ``betas``, ...). See
            :class:`~acco_hooks.engine.ACCOEngine`.

    Example::

        >>> opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="acco",
        ...                     accumulation_steps=4, lr=6e-4, weight_decay=0.1,
        ...                     lr_scheduler=lambda o: CosineAnnealingLR(o, T_max=1000))
        >>> for batch in loader:
        ...     model(batch).backward()    # loss of ONE micro-batch, not divided by 4
        ...     opt.step()                 # counts it; ends the round when it may
        >>> opt.flush()                    # the model now holds the real parameters
    """

    # torch.amp.GradScaler hands such an optimizer its scale instead of unscaling .grad (which
    # is empty here): step() sees it and refuses loss scaling by name.
    _step_supports_amp_scaling = True

    def __init__(
        self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer], **kwargs: Any
    ) -> None:
        # The settings are the engine's own: one signature, one validation.
        super().__init__(ACCOEngine(params, optimizer_class, **kwargs))
        self.engine.hook_param_grads()
        self._grads_at_last_step = 0

    def step(self, weight: float = 1.0) -> bool:
        """Count the micro-batch just back-propagated; end the round when it may.

        Never waits for the network in ``acco``/``dpu`` unless the round must end and the
        previous round's communication is still running.

        Args:
            weight: how many units the micro-batch's loss sums over. Default 1: the loss is a
                mean over the micro-batch and every micro-batch weighs the same. Pass the token
                count with a token-summed loss to average per token across ranks.

        Returns:
            ``True`` if this call ended a round.

        Raises:
            RuntimeError: no gradient reached the engine since the last ``step()`` (a missing
                ``backward()``), or the step comes from ``torch.amp.GradScaler``.
            TypeError: ``weight`` is a closure (``optimizer.step(closure)``).
        """
        if callable(weight):
            raise TypeError(
                "acco_hooks: step(closure) is not supported: run forward and backward in the "
                "training loop, then call step() (step(weight) takes the micro-batch's weight)"
            )
        if "found_inf" in vars(self) or "grad_scale" in vars(self):
            del self.found_inf, self.grad_scale
            raise RuntimeError(
                "acco_hooks: torch.amp.GradScaler is not supported: the engine would average "
                "gradients still multiplied by the loss scale. Train in bfloat16 autocast (no "
                "loss scaling needed) or in float32, without the scaler"
            )
        received = self.engine.grads_received
        if received == self._grads_at_last_step and self._grads_expected() and not self.closed:
            raise RuntimeError(
                "acco_hooks: step() was called, but no gradient reached the optimizer since the "
                "last step(): call loss.backward() before each step() (a rank out of data "
                "counts an empty micro-batch with engine.skip_microbatch())"
            )
        ended = self.engine.microbatch_done(weight)
        self._grads_at_last_step = received  # not before: an interrupted step() is repeated
        return ended

    def _grads_expected(self) -> bool:
        """Whether the backward before a ``step()`` hands the engine gradients (``False`` for a
        micro-batch whose gradients FSDP keeps unsharded until the round's last one)."""
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op before ``backward()`` or after ``step()`` (standard loops run unchanged).

        Raises:
            RuntimeError: between a ``backward()`` and its ``step()``: the gradient is already
                in the round's accumulator, so the discard a loop means here cannot happen.
        """
        if self.engine.grads_received != self._grads_at_last_step and not self.closed:
            raise RuntimeError(
                "acco_hooks: zero_grad() between backward() and step(): that gradient already "
                "went into the engine's round accumulator and cannot be discarded. Call "
                "step() after every backward() (each call counts one micro-batch; the engine "
                "ends the round), and zero_grad() before backward() or after step()"
            )
