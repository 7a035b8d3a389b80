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

FSDP2 has no public switch that keeps HSDP's intra-node reduce-scatter and drops the
cross-replica all-reduce while still writing ``.grad``: :func:`turn_off_replica_all_reduce`,
the one place that reaches into FSDP2's internals, adjusts its parameter groups' mesh info for
that, and refuses a torch without them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from acco_hooks.engine import ACCOEngine, EngineSettings
from acco_hooks.optimizer import ACCOOptimizer

__all__ = ["ACCOHSDPOptimizer", "fsdp_modules", "set_gradient_sync_for_next_microbatch",
           "turn_off_replica_all_reduce"]  # fmt: skip


def set_gradient_sync_for_next_microbatch(
    engine: ACCOEngine, modules: list[FSDPModule], every_microbatch: bool = False
) -> bool:
    """Let FSDP reduce-scatter gradients in the next backward only if it may end the round.

    Call it before each micro-batch. With ``every_microbatch`` FSDP reduce-scatters every
    micro-batch (the engine then accumulates the shards) instead of accumulating unsharded
    gradients until the round's last one.

    Returns:
        Whether the next backward hands the engine gradients.
    """
    last = engine.microbatches_in_round + 1 >= engine.round_size
    for module in modules:
        module.set_requires_gradient_sync(every_microbatch or last, recurse=False)
    return every_microbatch or last


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
            the process groups, which come from the mesh.

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
        settings.check_until_ready("the shard dimension of the FSDP mesh")
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


# ----------------------------------------------------- the one reach into FSDP2's internals


def fsdp_modules(modules: Iterable[nn.Module]) -> list[FSDPModule]:
    """Every ``FSDPModule`` in ``modules`` and their submodules."""
    return [m for root in modules for m in root.modules() if isinstance(m, FSDPModule)]


def turn_off_replica_all_reduce(modules: list[FSDPModule]) -> tuple[Any, Any]:
    """Make HSDP stop after its reduce-scatter; return the (replicate, shard) mesh groups.

    ``set_requires_all_reduce(False)`` is not enough: FSDP2 then keeps the reduce-scattered
    gradient aside for a later all-reduce and never writes ``.grad``. Each parameter group is
    instead told that its mesh is FSDP-only (``FSDPMeshInfo`` on the shard dimension), so it
    reduce-scatters over the shard dimension and writes the summed shard gradient; the
    parameters keep their (Replicate, Shard) placements. This relies on FSDP2's parameter
    group internals (``torch.distributed.fsdp._fully_shard``, torch 2.13); a torch without
    them is refused with an error rather than silently all-reducing.
    """
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo
    except ImportError as exc:  # pragma: no cover - other torch versions
        raise RuntimeError(
            f"acco_hooks: this torch ({torch.__version__}) has no FSDP2 mesh internals that "
            "ACCOHSDPOptimizer can adjust; use torch 2.13"
        ) from exc
    groups = None
    param_groups = {  # fully_shard([a, b]) gives a and b one state: visit each group once
        id(g): g for module in modules for g in _param_groups(module._get_fsdp_state())
    }
    for param_group in param_groups.values():
        info = param_group.mesh_info
        if not isinstance(info, HSDPMeshInfo):
            raise ValueError(
                "acco_hooks: ACCOHSDPOptimizer needs a model wrapped with fully_shard on a "
                "2-D DeviceMesh (replicate, shard), e.g. init_device_mesh(device, (R, S), "
                "mesh_dim_names=('dp_replicate', 'dp_shard')); this module is sharded on a "
                f"{info.mesh.ndim}-D mesh {info.mesh.mesh_dim_names}. For pure data "
                "parallelism use ACCOOptimizer"
            )
        groups = groups or (info.replicate_process_group, info.shard_process_group)
        # The same mesh info without the replicate dimension. Its other fields stay: with
        # spmd_types parameters (torchtitan 0.3.0's default backend) ``dp_mesh_dims`` is what
        # keeps the replicate dimension's gradient Partial, i.e. not all-reduced by DTensor.
        param_group.mesh_info = FSDPMeshInfo(**{
            f.name: getattr(info, f.name) for f in dataclasses.fields(FSDPMeshInfo)
            if f.init and f.name != "replicate_mesh_dim"
        })  # fmt: skip
        # With reshard_after_forward=True the post-forward mesh is the mesh itself: another
        # object would read as resharding to a smaller mesh (torch 2.14 refuses that).
        if getattr(param_group, "post_forward_mesh_info", None) is info:
            param_group.post_forward_mesh_info = param_group.mesh_info
    if groups is None:
        raise ValueError(
            "acco_hooks: ACCOHSDPOptimizer: the model has no parameters managed by fully_shard; "
            "wrap it with fully_shard(module, mesh=mesh_2d) first"
        )
    return groups


def _param_groups(state: Any) -> list[Any]:
    """A state's FSDP parameter groups: a list on torch 2.13, at most one on torch 2.11."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)  # torch 2.11 (a GPU image's torch)
    return [] if group is None else [group]
