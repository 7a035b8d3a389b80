"""FSDP2 plumbing that ACCO across HSDP replicas needs: which modules FSDP wraps, when FSDP
reduce-scatters within a round, and turning off HSDP's cross-replica all-reduce.

Two front-ends use it: :class:`acco_hooks.optim.ACCOHSDPOptimizer` (a plain loop) and the
torchtitan adapters (``acco_hooks.titan``), each building on it without importing the other.

FSDP2 has no public switch that keeps HSDP's intra-node reduce-scatter and drops the
cross-replica all-reduce while still writing ``.grad``: :func:`turn_off_replica_all_reduce`,
the one place that reaches into FSDP2's internals, adjusts its parameter groups' mesh info for
that, and refuses a torch without them.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from acco_hooks.engine import ACCOEngine

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = ["fsdp_modules", "set_gradient_sync_for_next_microbatch", "turn_off_replica_all_reduce"]


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


# ----------------------------------------------------- the one reach into FSDP2's internals


def fsdp_modules(modules: Iterable[nn.Module]) -> list[FSDPModule]:
    """Every ``FSDPModule`` in ``modules`` and their submodules.

    ``torch.distributed.fsdp`` is not imported for this (1 s of CPU, most of ``import
    acco_hooks``): a process that never imported it has no ``fully_shard`` module.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return []
    return [m for root in modules for m in root.modules() if isinstance(m, fsdp.FSDPModule)]


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
