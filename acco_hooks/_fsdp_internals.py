"""The one place that reaches into FSDP2's internals: HSDP without its cross-replica all-reduce.

FSDP2 has no public switch that keeps HSDP's intra-node reduce-scatter and drops the
cross-replica all-reduce while still writing ``.grad``; :func:`turn_off_replica_all_reduce`
adjusts its parameter groups' mesh info for that, and refuses a torch without them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["fsdp_modules", "turn_off_replica_all_reduce"]


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
        param_group.mesh_info = FSDPMeshInfo(
            mesh=info.mesh, shard_mesh_dim=info.shard_mesh_dim
        )
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
