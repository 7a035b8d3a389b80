"""HSDP with ACCO across replicas: FSDP2 inside a node, the engine across nodes.

A model too large to replicate is sharded by FSDP2 over the GPUs of a node (fast links) and
replicated across nodes (slow links)::

                 node 0 (replica 0)              node 1 (replica 1)
    fsdp dim     rank 0 ─ rank 1 ─ … ─ S-1       rank S ─ … ─ 2S-1
                   │                               │
    replicate    rank 0 ══════════ ACCO ══════════ rank S        (one engine group per
    dim            rank 1 ═══════════ ACCO ══════════ rank S+1    FSDP shard index)

FSDP2 keeps its intra-node reduce-scatter in backward, so each rank receives the gradient of
its 1/S shard summed over the node. The cross-node all-reduce that HSDP would run next is
turned off; instead the engine runs ACCO over the replicate dimension on that local shard:
reduce-scatter across replicas -> step a 1/(S·R) fp32 master shard -> all-gather across
replicas -> write into FSDP's sharded parameters (θ or θ̃) at the round end. The optimizer
state is sharded S·R ways and the slow exchange overlaps the next round's compute.

Within a round, FSDP's gradient reduce-scatter runs once, on the round's last micro-batch
(``requires_gradient_sync`` is off before); earlier micro-batches accumulate unsharded
gradients, as ``no_sync`` does for DDP. ``sync_every_microbatch=True`` reduce-scatters every
micro-batch instead: less memory, S-1 more intra-node reduce-scatters per round.

With ``accumulate_until_ready`` a replica runs more micro-batches while the previous round
still communicates; its FSDP ranks agree after each one whether to run another (the engine's
``EngineGroups.replica_waits``: one all-reduce of one value over the replica's ranks), so that
they run the same ones, and FSDP reduce-scatters every micro-batch from the
``accumulation_steps``-th on, since any of them may end the round.

The FSDP2 plumbing (which modules FSDP wraps, when it reduce-scatters, turning off the
cross-replica all-reduce) is :mod:`acco_hooks.fsdp`'s, shared with the torchtitan adapters.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from acco_hooks.engine import EngineSettings
from acco_hooks.fsdp import (
    fsdp_modules,
    set_gradient_sync_for_next_microbatch,
    turn_off_replica_all_reduce,
)
from acco_hooks.optim.acco_optimizer import ACCOOptimizer

__all__ = ["ACCOHSDPOptimizer"]


class ACCOHSDPOptimizer(ACCOOptimizer):
    r"""ACCO over the replicate dimension of a model sharded with FSDP2 on a 2-D (HSDP) mesh.

    Takes a model already wrapped with ``fully_shard(..., mesh=mesh_2d)`` where ``mesh_2d`` is
    (replicate, shard), turns off FSDP's cross-replica all-reduce, and builds the engine over
    the replicate dimension on this rank's FSDP shards (:attr:`engine`). FSDP's reduce-scatter
    is set to sum (divide factor 1, and ``set_force_sum_reduction_for_comms`` on gloo, which
    has no PREMUL_SUM); the engine divides by the global weight. The training loop is that of
    ``ACCOOptimizer``: ``loss.backward(); opt.step()`` per micro-batch.

    The averaged gradient of a round is that of pure data parallelism over all S·R ranks: each
    replica contributes its FSDP-summed gradient and the sum of its ranks' weights.

    Args:
        model: the ``fully_shard``-wrapped model (its ``FSDPModule`` submodules are adjusted).
        optimizer_class: the torch optimizer class stepped on the shard, e.g.
            ``torch.optim.AdamW``.
        params: what to optimize; default ``model.named_parameters()``.
        sync_every_microbatch: let FSDP reduce-scatter every micro-batch instead of once per
            round (less memory for unsharded gradients, more intra-node traffic).
        \*\*kwargs: the settings and optimizer arguments of ``ACCOOptimizer`` (``mode``,
            ``accumulation_steps``, ``reduce_dtype``, ``max_grad_norm``, ``lr``, ...), except
            the process groups, which come from the mesh. With ``manager`` (a torchft
            ``Manager``) the mesh is one replica group's, and each group holds HSDP of its own
            (``acco_hooks/engine/replicas.py``; ``replica_groups`` as in ``ACCOOptimizer``).

    Example::

        >>> mesh = init_device_mesh("cuda", (nodes, gpus_per_node),
        ...                         mesh_dim_names=("dp_replicate", "dp_shard"))
        >>> for block in model.layers:
        ...     fully_shard(block, mesh=mesh)
        >>> fully_shard(model, mesh=mesh)
        >>> opt = ACCOHSDPOptimizer(model, torch.optim.AdamW, mode="acco",
        ...                         accumulation_steps=4, lr=3e-4)
        >>> for batch in loader:
        ...     model(batch).backward()
        ...     opt.step()
        >>> opt.flush()
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        *,
        params: Iterable[Any] | None = None,
        sync_every_microbatch: bool = False,
        **kwargs: Any,
    ) -> None:
        if not isinstance(sync_every_microbatch, bool):
            raise TypeError(
                f"acco_hooks: sync_every_microbatch={sync_every_microbatch!r} must be True or False"
            )
        for taken in ("process_group", "fsdp_process_group"):
            if taken in kwargs:
                raise TypeError(
                    f"acco_hooks: ACCOHSDPOptimizer takes its groups from the model's 2-D mesh; "
                    f"drop {taken}="
                )
        # The settings are checked before the model is touched: a refused one leaves it as it was.
        settings, kwargs = EngineSettings.from_keywords(kwargs.pop("settings", None), kwargs)
        self.fsdp_modules = fsdp_modules([model])
        replicate_group, shard_group = turn_off_replica_all_reduce(self.fsdp_modules)
        gloo = dist.get_backend(shard_group) == "gloo"
        for module in self.fsdp_modules:
            module.set_gradient_divide_factor(1.0)
            if gloo:
                module.set_force_sum_reduction_for_comms(True)
        self.sync_every_microbatch = sync_every_microbatch
        # FSDP2 runs post-accumulate-grad hooks on the sharded parameters once it wrote their
        # reduce-scattered gradient: the hooks ACCOOptimizer attaches take each shard from there.
        super().__init__(
            model.named_parameters() if params is None else params, optimizer_class,
            settings=settings, process_group=replicate_group, fsdp_process_group=shard_group,
            **kwargs,
        )  # fmt: skip
        self._set_gradient_sync()
        # FSDP2 adds a reduce-scattered gradient to the .grad it finds (a second backward before
        # step()), outside autograd's hooks: the engine's placeholder must be gone before it
        engine = weakref.ref(self.engine)
        self._clear_before_forward = model.register_forward_pre_hook(
            lambda *_: None if engine() is None else engine().clear_placeholders()
        )

    def close(self, *, flush: bool = True, barrier: bool = True) -> None:
        """As :meth:`ACCOOptimizer.close`; also removes the hook on the model's forward."""
        self._clear_before_forward.remove()
        super().close(flush=flush, barrier=barrier)

    def _set_gradient_sync(self) -> None:
        self._gradient_sync = set_gradient_sync_for_next_microbatch(
            self.engine, self.fsdp_modules, self.sync_every_microbatch
        )

    def _grads_expected(self) -> bool:
        return self._gradient_sync  # without it FSDP keeps the gradients until the round's last

    def step(self, weight: float = 1.0) -> bool:
        """Count the micro-batch just back-propagated; end the round when it may.

        Args:
            weight: as for ``ACCOOptimizer.step``: 1 for a mean loss, the token count for a
                token-summed loss.

        Returns:
            ``True`` if this call ended a round.
        """
        ended = super().step(weight)
        self._set_gradient_sync()
        return ended

    def state_dict(self) -> dict[str, Any]:
        """This rank's engine state (save the model's sharded ``state_dict()`` with it).

        Raises:
            RuntimeError: in the middle of a round without ``sync_every_microbatch``: FSDP
                holds the round's unsharded gradients, which no checkpoint contains.
        """
        if self.engine.microbatches_in_round and not self.sync_every_microbatch:
            raise RuntimeError(
                "acco_hooks: ACCOHSDPOptimizer.state_dict() in the middle of a round: FSDP still "
                "holds this round's unsharded gradients, which a checkpoint cannot contain. Save "
                "when step() returned True (a round ended), or build the optimizer with "
                "sync_every_microbatch=True"
            )
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (through DCP also of another number of replicas or
        another FSDP degree)."""
        super().load_state_dict(state_dict)
        self._set_gradient_sync()
