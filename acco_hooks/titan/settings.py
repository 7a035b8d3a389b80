"""The ``[acco]`` settings of a torchtitan run and their validation, for every torchtitan release.

Nothing here imports torchtitan: the 0.2.2 adapter puts :class:`ACCO` into its ``JobConfig``
(a TOML section), the 0.3.0 adapter into ``ACCOTrainer.Config`` (a config-function field and
``--acco.*`` flags), and both validate it with :func:`validate_acco_settings` before anything
is built. torchtitan's ``ParallelismConfig`` has the same field names in both releases.

No ``from __future__ import annotations`` here: torchtitan 0.2.2's ConfigManager reads the
field types (``dataclasses.fields(...).type``) to build nested sections from TOML.
"""

import os
from dataclasses import dataclass
from typing import Any

import torch

from acco_hooks.engine import MODES

__all__ = ["ACCO", "REDUCE_DTYPES", "validate_acco_settings"]

REDUCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ACCO:
    enable: bool = False
    """Replace torchtitan's data-parallel wrapping and optimizer with the ACCO engine over the
    data_parallel_replicate dimension. With data_parallel_shard_degree > 1 (HSDP), FSDP2 keeps
    sharding each replica over the fsdp dimension and ACCO replaces only the cross-replica
    all-reduce. Tensor and pipeline parallelism stay as configured."""

    mode: str = "acco"
    """'acco' (overlapped, with the estimate step), 'dpu' (overlapped, one-step-delayed update
    without estimate) or 'ddp' (synchronous ZeRO-1, the baseline). One training step is one
    round; in 'acco' a real optimizer update happens every other round."""

    accumulation_steps: int = 0
    """Micro-batches per round. 0: torchtitan's gradient accumulation steps, i.e.
    training.global_batch_size / (training.local_batch_size x data-parallel degree)."""

    accumulate_until_ready: bool = False
    """Keep running micro-batches past accumulation_steps while the previous round still
    communicates, instead of waiting (heterogeneous hardware). Pure data parallelism only."""

    reduce_dtype: str = "float32"
    """Dtype of the gradients on the wire: 'float32', 'bfloat16' or 'float16'. Accumulation and
    the optimizer's master weights stay float32."""

    fsdp_sync_every_microbatch: bool = False
    """With data_parallel_shard_degree > 1: let FSDP reduce-scatter the gradients of every
    micro-batch (less memory) instead of only the round's last one (less intra-replica
    traffic; the default). Pipeline parallel schedules reduce-scatter every micro-batch anyway."""


def validate_acco_settings(
    acco: ACCO,
    parallelism: Any,
    optimizer_names: list[str],
    *,
    early_step_in_backward: bool = False,
    world_size: int | None = None,
) -> None:
    """Refuse bad ``[acco]`` settings or an unsupported parallelism before anything is built.

    Args:
        acco: the settings.
        parallelism: torchtitan's ``ParallelismConfig`` (0.2.2 or 0.3.0).
        optimizer_names: the optimizer of every parameter group (0.2.2 has exactly one).
        early_step_in_backward: torchtitan 0.2.2's ``[optimizer]`` option of that name.
        world_size: default ``$WORLD_SIZE``.

    Raises:
        ValueError: naming the setting and the fix.
    """
    if not isinstance(acco.enable, bool):
        raise ValueError(f"[acco] enable = {acco.enable!r}: must be true or false")
    if not acco.enable:
        return
    if not isinstance(acco.mode, str) or acco.mode not in MODES:
        raise ValueError(
            f"[acco] mode = {acco.mode!r} is not one of {', '.join(map(repr, MODES))}"
        )
    steps = acco.accumulation_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(
            f"[acco] accumulation_steps = {steps!r}: must be an integer >= 1, or 0 to use "
            "torchtitan's gradient accumulation steps"
        )
    if not isinstance(acco.accumulate_until_ready, bool):
        raise ValueError(
            f"[acco] accumulate_until_ready = {acco.accumulate_until_ready!r}: must be true or false"
        )
    if not isinstance(acco.reduce_dtype, str) or acco.reduce_dtype not in REDUCE_DTYPES:
        raise ValueError(
            f"[acco] reduce_dtype = {acco.reduce_dtype!r} is not one of "
            f"{', '.join(map(repr, REDUCE_DTYPES))}"
        )

    par = parallelism
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    others = par.context_parallel_degree * par.tensor_parallel_degree * par.pipeline_parallel_degree
    replicate = par.data_parallel_replicate_degree
    shard = par.data_parallel_shard_degree
    if shard == -1 and replicate > 0:
        shard = world_size // max(1, replicate * others)
    # One replica without FSDP is allowed: the engine runs its rounds over this rank alone (on
    # one GPU: ACCO's overhead against plain torchtitan, with nothing to hide).
    if replicate < 1 or (replicate == 1 and shard > 1):
        raise ValueError(
            f"[parallelism] data_parallel_replicate_degree = {replicate}: [acco] enable runs "
            f"across model replicas; with data_parallel_shard_degree = {shard} set "
            "data_parallel_replicate_degree >= 2 (FSDP then shards each replica: HSDP), or "
            "[acco] enable = false for torchtitan's own FSDP"
        )
    if not isinstance(acco.fsdp_sync_every_microbatch, bool):
        raise ValueError(
            f"[acco] fsdp_sync_every_microbatch = {acco.fsdp_sync_every_microbatch!r}: must be "
            "true or false"
        )
    if acco.accumulate_until_ready and shard > 1:
        raise ValueError(
            f"[acco] accumulate_until_ready = true needs every rank of a model replica to run the "
            f"same micro-batches, which the data_parallel_shard_degree = {shard} FSDP ranks of a "
            "replica cannot agree on: set it to false with data_parallel_shard_degree > 1"
        )
    if par.context_parallel_degree != 1 or par.expert_parallel_degree != 1:
        raise ValueError(
            "[acco] enable supports tensor and pipeline parallelism only: set "
            "context_parallel_degree = 1 and expert_parallel_degree = 1"
        )
    if acco.accumulate_until_ready and (
        par.tensor_parallel_degree > 1 or par.pipeline_parallel_degree > 1
    ):
        raise ValueError(
            "[acco] accumulate_until_ready = true needs every rank of a model replica to run the "
            "same micro-batches, which tensor/pipeline parallel ranks cannot agree on: set it "
            "to false with tensor_parallel_degree or pipeline_parallel_degree > 1"
        )
    if len(optimizer_names) != 1 or optimizer_names[0] not in ("Adam", "AdamW"):
        named = optimizer_names[0] if len(optimizer_names) == 1 else optimizer_names
        raise ValueError(
            f"[optimizer] name = {named!r}: the ACCO trainer supports one 'Adam' or 'AdamW' "
            "optimizer over every parameter"
        )
    if early_step_in_backward:
        raise ValueError(
            "[optimizer] early_step_in_backward = true cannot be combined with [acco] enable: "
            "the engine steps the optimizer on its communication thread"
        )
