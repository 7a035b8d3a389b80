"""The ``[acco]`` section of a torchtitan run: its fields, its checks against the run's
parallelism, and the engine settings it resolves to. For both torchtitan releases.

Nothing here imports torchtitan: the 0.2.2 adapter puts :class:`ACCO` into its ``JobConfig``
(a TOML section), the 0.3.0 adapter into ``ACCOTrainer.Config`` (a config-function field and
``--acco.*`` flags), and both validate it with :func:`validate_acco` before anything is built.
torchtitan's ``ParallelismConfig`` and ``Training`` sections have the same field names in both
releases.

No ``from __future__ import annotations``: torchtitan 0.2.2's ConfigManager reads the field
types (``dataclasses.fields(...).type``) to build nested sections from TOML.
"""

import importlib.util
from dataclasses import dataclass
from typing import Any, ClassVar

from acco_hooks._frontend import launcher_world_size
from acco_hooks.engine import ACCOSettings, EngineSettings
from acco_hooks.engine.settings import Check, boolean, check_accumulation_steps

__all__ = ["ACCO", "validate_acco"]


def spelling(name: str, value: Any) -> str:
    """How a refusal names an ``acco`` setting: ``[acco] mode = 'x'``."""
    return f"[acco] {name} = {value!r}"


def _zero_or_micro_batches(value: Any) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        return None
    if check_accumulation_steps(value) is None:
        return None
    return ("must be an integer >= 1 (micro-batches per round), or 0 to use torchtitan's "
            "gradient accumulation steps")  # fmt: skip


@dataclass
class ACCO(ACCOSettings):
    """ACCO on the data_parallel_replicate dimension of a torchtitan run.

    ``mode``, ``accumulate_until_ready``, ``reduce_dtype``, ``nonfinite``, ``timeout`` and
    ``max_microbatches_per_round`` are the engine's own settings
    (:class:`acco_hooks.engine.ACCOSettings`); the round size follows
    torchtitan's gradient accumulation unless set here, clipping is ``training.max_norm``.
    """

    enable: bool = False
    """Replace torchtitan's data-parallel wrapping and optimizer with the ACCO engine over the
    data_parallel_replicate dimension. With data_parallel_shard_degree > 1 (HSDP), FSDP2 keeps
    sharding each replica over the fsdp dimension and ACCO replaces only the cross-replica
    all-reduce. Tensor and pipeline parallelism stay as configured."""

    accumulation_steps: int = 0
    """Micro-batches per round. 0: torchtitan's gradient accumulation steps, i.e.
    training.global_batch_size / (training.local_batch_size x data-parallel degree)."""

    fsdp_sync_every_microbatch: bool = False
    """With data_parallel_shard_degree > 1: let FSDP reduce-scatter the gradients of every
    micro-batch (less memory) instead of only the round's last one (less intra-replica
    traffic; the default). Pipeline parallel schedules reduce-scatter every micro-batch anyway."""

    checks: ClassVar[dict[str, Check]] = {
        **ACCOSettings.checks,
        "enable": boolean,
        "accumulation_steps": _zero_or_micro_batches,
        "fsdp_sync_every_microbatch": boolean,
    }


def _data_parallel_degrees(parallelism: Any, world_size: int) -> tuple[int, int]:
    """``(replicate, shard)`` degrees, a -1 resolved to what the world size leaves.

    torchtitan resolves a shard degree of -1 itself; a replicate degree of -1 (as many
    replicas as the world size leaves, what a job that may restart on fewer nodes needs) is
    ACCO's, resolved here.
    """
    others = (parallelism.context_parallel_degree * parallelism.tensor_parallel_degree
              * parallelism.pipeline_parallel_degree)  # fmt: skip
    replicate = parallelism.data_parallel_replicate_degree
    shard = parallelism.data_parallel_shard_degree
    if replicate == -1 and shard == -1:
        raise ValueError(
            "[parallelism] data_parallel_replicate_degree = -1 and data_parallel_shard_degree = "
            "-1: at most one of them can be what the world size leaves. Set "
            "data_parallel_shard_degree to the FSDP degree inside a replica (e.g. the GPUs of a "
            "node), or to 1 for ACCO across plain replicas"
        )
    if replicate == -1:
        if world_size % (shard * others):
            raise ValueError(
                f"[parallelism] data_parallel_replicate_degree = -1: the world size {world_size} "
                f"is not a multiple of data_parallel_shard_degree × tensor × pipeline × context "
                f"parallel degrees = {shard * others}; run on a multiple of {shard * others} ranks"
            )
        replicate = world_size // (shard * others)
    if shard == -1 and replicate > 0:
        shard = world_size // max(1, replicate * others)
    return replicate, shard


def _check_global_batch(training: Any, data_parallel: int, shard: int) -> None:
    """torchtitan splits ``global_batch_size`` into local batches on every data-parallel
    rank: refuse a world it does not divide, naming the replica counts that would."""
    global_batch, local_batch = training.global_batch_size, training.local_batch_size
    if global_batch <= 0 or global_batch % (local_batch * data_parallel) == 0:
        return
    per_replica = local_batch * shard
    fits = [r for r in range(1, global_batch // per_replica + 1)
            if global_batch % (per_replica * r) == 0]  # fmt: skip
    raise ValueError(
        f"[training] global_batch_size = {global_batch} is not a multiple of local_batch_size "
        f"× data-parallel ranks = {local_batch} × {data_parallel}: set global_batch_size to a "
        f"multiple of {local_batch * data_parallel}, or run "
        + (f"{' or '.join(map(str, fits))} replica{'s' if fits != [1] else ''}" if fits
           else "with a smaller local_batch_size")
    )


def _check_replica_groups(ft: Any, acco: ACCO) -> None:
    """Refuse a ``[fault_tolerance]`` section the engine cannot run across torchft groups."""
    if importlib.util.find_spec("torchft") is None:
        raise ValueError(
            "[fault_tolerance] enable = true needs torchft: pip install 'acco_hooks[ft]'"
        )
    if ft.semi_sync_method is not None:
        raise ValueError(
            f"[fault_tolerance] semi_sync_method = {ft.semi_sync_method!r} with [acco] enable: "
            "that is torchtitan's own training method (local SGD, DiLoCo) across the groups, "
            "and ACCO is another one; unset semi_sync_method, or [acco] enable = false"
        )
    if ft.process_group not in ("gloo", "nccl"):
        raise ValueError(
            f"[fault_tolerance] process_group = {ft.process_group!r}: use 'gloo' or 'nccl'"
        )
    if ft.group_size < 1 or not 0 <= ft.replica_id < ft.group_size:
        raise ValueError(
            f"[fault_tolerance] replica_id = {ft.replica_id}, group_size = {ft.group_size}: "
            "set group_size to the number of replica groups (the data is split over them) "
            "and replica_id to this group's index, from 0 to group_size - 1"
        )
    if acco.accumulate_until_ready and acco.max_microbatches_per_round is None:
        raise ValueError(
            "[acco] accumulate_until_ready = true with [fault_tolerance] enable needs [acco] "
            "max_microbatches_per_round: a group that joins reads its data on from the "
            "positions the rounds before took, and a round that accumulates until ready runs "
            "another number of micro-batches on each group; with a cap every round takes the "
            "cap's positions, so that a joining group reads nothing its lost predecessor read. "
            "Set max_microbatches_per_round"
        )


def validate_acco(
    acco: ACCO,
    parallelism: Any,
    training: Any,
    optimizer_names: list[str],
    *,
    early_step_in_backward: bool = False,
    world_size: int | None = None,
    train_timeout_seconds: float | None = None,
    fault_tolerance: Any = None,
    whole_parameter_optimizers: tuple[str, ...] = (),
) -> EngineSettings | None:
    """Refuse bad ``[acco]`` settings or an unsupported parallelism before anything is built,
    and build the engine's settings: the one place the torchtitan path checks and builds them.
    Resolves ``data_parallel_replicate_degree = -1`` in ``parallelism`` (torchtitan takes -1
    for the shard degree only).

    Args:
        acco: the section.
        parallelism: torchtitan's ``ParallelismConfig`` (0.2.2 or 0.3.0).
        training: torchtitan's ``Training`` section (the batch sizes give the round's size;
            ``max_norm`` the clipping, off when <= 0).
        optimizer_names: the optimizer of every parameter group (0.2.2 has exactly one).
        whole_parameter_optimizers: the names of the release's optimizers that the engine
            runs on whole parameters (0.3.0: "DistMuon" and "Muon", torch's Muon), beside
            "Adam" and "AdamW".
        early_step_in_backward: torchtitan 0.2.2's ``[optimizer]`` option of that name.
        world_size: default: the launcher's (``$WORLD_SIZE``, 1 without one).
        train_timeout_seconds: torchtitan's ``[comm] train_timeout_seconds``: the engine's
            collective timeout where ``[acco] timeout`` is unset.
        fault_tolerance: torchtitan's ``[fault_tolerance]`` section (0.2.2's, or the
            ``experiments.torchft`` one ACCO's 0.3.0 trainer has; ``None``: none): with
            ``enable``, the engine's process group is one torchft replica group and
            ``group_size`` of them train together.

    Returns:
        The engine's settings (``[acco]``'s own, micro-batches per round from
        ``accumulation_steps`` or torchtitan's gradient accumulation), or ``None`` when
        ``enable`` is off.

    Raises:
        ValueError: naming the setting and the fix.
    """
    acco.check(spelling, names=("enable",))
    if not acco.enable:
        return None
    acco.check(spelling, names=("accumulation_steps", "fsdp_sync_every_microbatch"))
    par = parallelism
    replicate, shard = _data_parallel_degrees(par, world_size or launcher_world_size())
    ft = fault_tolerance if fault_tolerance is not None and fault_tolerance.enable else None
    # torchtitan's global batch spans every replica group, as in its own torchft trainer
    groups = ft.group_size if ft is not None else 1
    par.data_parallel_replicate_degree = replicate
    # One replica without FSDP is allowed: the engine runs its rounds over this rank alone (on
    # one GPU: ACCO's overhead against plain torchtitan, with nothing to hide). FSDP with one
    # replica per torchft replica group is HSDP too: the groups are the replicas.
    if replicate < 1 or (replicate * groups == 1 and shard > 1):
        raise ValueError(
            f"[parallelism] data_parallel_replicate_degree = {replicate}: [acco] enable runs "
            f"across model replicas; with data_parallel_shard_degree = {shard} set "
            "data_parallel_replicate_degree >= 2 (FSDP then shards each replica: HSDP), or "
            "[acco] enable = false for torchtitan's own FSDP"
        )

    def set_round_size(steps: int) -> str:
        if acco.accumulation_steps or training.global_batch_size <= 0:
            return f"set [acco] accumulation_steps = {steps} (--acco.accumulation_steps {steps})"
        batch = steps * training.local_batch_size * replicate * shard * groups
        return (f"set [training] global_batch_size = {batch} (--training.global_batch_size "
                f"{batch}: {steps} micro-batches of local_batch_size = "
                f"{training.local_batch_size} on {replicate * shard * groups} data-parallel "
                "ranks)")

    if ft is not None:
        _check_replica_groups(ft, acco)
    # torchtitan's gradient accumulation steps: the global batch over the local batch times
    # the data-parallel degree (one step when global_batch_size is -1)
    round_size = acco.accumulation_steps or max(
        1, training.global_batch_size // (training.local_batch_size * replicate * shard * groups)
    )
    settings = acco.to_engine_settings(
        accumulation_steps=round_size,
        max_grad_norm=training.max_norm if training.max_norm > 0 else None,
        # torchtitan's own collectives fail after train_timeout_seconds: the engine's too. The
        # process group's default (30 min) is no bound: gloo can miss a dead peer's closed
        # socket in the engine's ring exchange, and the survivors then wait the whole timeout
        # before an elastic agent can restart them (docs/reliability.md).
        timeout=acco.timeout if acco.timeout is not None else train_timeout_seconds,
        spell=spelling, set_steps=set_round_size,
    )  # fmt: skip
    if par.context_parallel_degree != 1 or par.expert_parallel_degree != 1:
        raise ValueError(
            "[acco] enable supports tensor and pipeline parallelism only: set "
            "context_parallel_degree = 1 and expert_parallel_degree = 1"
        )
    _check_global_batch(training, replicate * shard * groups, shard * groups)
    runs = ("Adam", "AdamW", *whole_parameter_optimizers)
    if (len(optimizer_names) != 1 and not whole_parameter_optimizers) or any(
        name not in runs for name in optimizer_names
    ):
        named = optimizer_names[0] if len(optimizer_names) == 1 else optimizer_names
        raise ValueError(
            f"[optimizer] name = {named!r}: the ACCO trainer supports one 'Adam' or 'AdamW' "
            "optimizer over every parameter"
            + (f", or parameter groups each stepped by one of {list(runs)}"
               if whole_parameter_optimizers else "")
        )
    whole = sorted({name for name in optimizer_names if name in whole_parameter_optimizers})
    # FSDP or tensor parallelism inside a replica, and pipeline stages, run (the engine brings
    # each matrix together on its owner); FSDP over tensor-parallel matrices and torchft's
    # groups do not yet
    fsdp_over_tp = shard > 1 and par.tensor_parallel_degree > 1
    if whole and (fsdp_over_tp or ft is not None):
        raise ValueError(
            f"optimizer.param_groups: {whole[0]} steps each matrix whole on the rank that owns "
            "it, which the ACCO engine does not run beside "
            + (f"data_parallel_shard_degree = {shard} with tensor_parallel_degree = "
               f"{par.tensor_parallel_degree} (FSDP over tensor-parallel matrices: each rank "
               "holds a piece of a piece)" if fsdp_over_tp else
               "[fault_tolerance] (torchft replica groups; ACCOOptimizer runs them)")
            + f" yet: train the {whole[0]} recipe with FSDP or tensor parallelism inside a "
            "replica, not both" + ("" if fsdp_over_tp else ", without [fault_tolerance]")
            + ", or step every group with 'AdamW'"
        )
    if early_step_in_backward:
        raise ValueError(
            "[optimizer] early_step_in_backward = true cannot be combined with [acco] enable: "
            "the engine steps the optimizer on its communication thread"
        )
    return settings
