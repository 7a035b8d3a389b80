"""Rank functions for the HSDP tests: TinyNet under FSDP2 on a (replicate, shard) mesh; and
under tensor parallelism on a (replicate, tp) mesh, where replicas of unequal speed run
``accumulate_until_ready``."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tests.scenario import (
    OPTIMIZERS,
    Config,
    make_model,
    make_scheduler,
    microbatch_loss,
    param_groups,
)


def sharded_tiny_net(replicas: int, shards: int, device: str = "cpu", model: str = "tiny"):
    """The scenario's ``model`` (TinyNet, or DeepNet: "deep", "deep_on_grid") under FSDP2 on a
    (replicate, shard) mesh: TinyNet's linear layers a unit each, DeepNet one unit (its forward
    reads its layers' weights without calling them, so only the root's hooks gather them)."""
    mesh = init_device_mesh(device, (replicas, shards), mesh_dim_names=("dp_replicate", "dp_shard"))
    net = make_model(model=model).to(device)
    for layer in (() if model.startswith("deep") else (net.fc1, net.fc2)):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)  # the root holds `gain` (1 element: one shard is empty)
    return net, mesh


def hsdp_run(rank: int, world_size: int, cfg: Config, replicas: int, sync_every: bool = False) -> dict[str, Any]:
    """The scenario's training with ACCOHSDPOptimizer; every rank is one worker of ``cfg``."""
    from acco_hooks import ACCOHSDPOptimizer

    model, _ = sharded_tiny_net(replicas, world_size // replicas, cfg.device, cfg.model)
    opt_class, kwargs = OPTIMIZERS[cfg.optimizer]
    opt = ACCOHSDPOptimizer(
        model, opt_class, params=param_groups(model, cfg.two_groups, cfg.optimizer),
        mode=cfg.mode, accumulation_steps=cfg.micro[rank], max_grad_norm=cfg.max_grad_norm,
        lr_scheduler=make_scheduler if cfg.scheduler else None, estimate_dtype=cfg.estimate_dtype,
        sync_every_microbatch=sync_every, **kwargs, **cfg.optimizer_kwargs,
    )  # fmt: skip
    weight = cfg.weights[rank] if cfg.weights else 1.0
    for r in range(cfg.rounds):
        for micro in range(cfg.micro[rank]):
            (weight * microbatch_loss(model, rank, r, micro)).backward()
            ended = opt.step(weight)
            assert ended == (micro == cfg.micro[rank] - 1), (r, micro, ended)
    opt.flush()
    result = {
        "params": {
            n: p.full_tensor().detach().to("cpu", copy=True) for n, p in model.named_parameters()
        },
        "memory": opt.engine.memory_bytes(),
        "owned_whole": opt.engine.owned_whole,
        "num_updates": opt.num_updates,
        "lr": [g["lr"] for g in opt.param_groups],
    }
    opt.close()
    return result


class HeldLambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """The scenario's schedule (``make_scheduler``), whose step holds this rank's communication
    thread for ``hold_s`` after each real update: one rank's round stays in flight longer
    than its replica's other rank's."""

    def __init__(self, optimizer: torch.optim.Optimizer, hold_s: float) -> None:
        self.hold_s = 0.0  # not while it is built
        super().__init__(optimizer, lambda t: 1.0 / (1.0 + 0.5 * t))
        self.hold_s = hold_s

    def step(self, epoch: Any = None) -> None:
        time.sleep(self.hold_s)
        super().step(epoch)


def tensor_parallel_tiny_net(replicas: int, tp: int):
    """TinyNet with ``fc1`` split by columns and ``fc2`` by rows over the ``tp`` ranks of a
    (replicate, tp) mesh, as torchtitan splits a feed-forward; ``gain`` stays whole on each."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (replicas, tp), mesh_dim_names=("dp_replicate", "tp"))
    # fc1's 7 outputs split 4 + 3: its output stays a DTensor, which knows that (a local shard
    # would be taken for half of 8 or 6 by fc2)
    model = parallelize_module(make_model(), mesh["tp"], {
        "fc1": ColwiseParallel(use_local_output=False), "fc2": RowwiseParallel(),
    })  # fmt: skip
    return model, mesh


def until_ready_run(rank: int, world_size: int, layout: str, mode: str, replicas: int,
                    rounds: int, cap: int) -> dict[str, Any]:  # fmt: skip
    """accumulate_until_ready across replicas of 2 ranks each, split by FSDP (``layout`` =
    "fsdp": ACCOHSDPOptimizer) or by tensor parallelism ("tp": the engine as torchtitan builds
    it, the replica's ranks given as ``norm_process_group``). The second rank of each replica
    holds its update's communication (``HeldLambdaLR``), and the second replica computes
    slower. Every rank records how many micro-batches it ran in each round, which the
    reference replays. Under FSDP each rank reads its own micro-batches; under TP the ranks of
    a replica read the replica's."""
    import torch.distributed as dist

    from acco_hooks import ACCOEngine, ACCOHSDPOptimizer

    per_replica = world_size // replicas
    replica = rank // per_replica
    opt_class, kwargs = OPTIMIZERS["adamw"]
    # The hold outlasts the cap's micro-batches of TinyNet many times over on a busy CPU too;
    # the second replica, slower, fits fewer of them in it
    hold_s = 0.4 if rank % per_replica == 1 else 0.0
    slow_s = 0.08 if replica == 1 else 0.0
    settings = dict(mode=mode, accumulation_steps=2, accumulate_until_ready=True,
                    max_microbatches_per_round=cap, lr_scheduler=lambda o: HeldLambdaLR(o, hold_s))  # fmt: skip
    if layout == "fsdp":
        model, _ = sharded_tiny_net(replicas, per_replica)
        opt = ACCOHSDPOptimizer(model, opt_class, params=param_groups(model, True), **settings, **kwargs)
        engine, front, data_rank, microbatch_done = opt.engine, opt, rank, opt.step
    else:
        model, mesh = tensor_parallel_tiny_net(replicas, per_replica)
        engine = ACCOEngine(param_groups(model, True), opt_class, process_group=mesh["dp_replicate"],
                            norm_process_group=dist.group.WORLD, **settings, **kwargs)  # fmt: skip
        engine.hook_param_grads(placeholders=False)
        front, data_rank, microbatch_done = engine, replica, engine.microbatch_done
    counts = []
    while engine.round_index < rounds:
        microbatch_loss(model, data_rank, engine.round_index, engine.microbatches_in_round).backward()
        time.sleep(slow_s)
        if microbatch_done():
            counts.append(engine.last_round_microbatches)
    front.flush()
    result = {  # under TP gain is a plain tensor, whole on each rank
        "params": {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                   for n, p in model.named_parameters()},
        "counts": counts, "num_updates": engine.num_updates,
    }  # fmt: skip
    front.close()
    return result


def until_ready_runs(rank: int, world_size: int, layout: str, modes: list[str], replicas: int,
                     rounds: int, cap: int) -> list[dict[str, Any]]:  # fmt: skip
    """``until_ready_run`` in each mode, in one launch of the processes."""
    return [until_ready_run(rank, world_size, layout, mode, replicas, rounds, cap) for mode in modes]


def hsdp_runs(rank: int, world_size: int, runs: list[tuple[Config, bool]], replicas: int) -> list[dict[str, Any]]:
    """Several ``hsdp_run`` in one launch of the processes: ``(config, sync_every)`` each."""
    return [hsdp_run(rank, world_size, cfg, replicas, sync_every) for cfg, sync_every in runs]


def _build(cfg: Config, replicas: int, world_size: int, sync_every: bool = False):
    from acco_hooks import ACCOHSDPOptimizer

    model, _ = sharded_tiny_net(replicas, world_size // replicas)
    opt_class, kwargs = OPTIMIZERS[cfg.optimizer]
    opt = ACCOHSDPOptimizer(model, opt_class, params=param_groups(model, True), mode=cfg.mode,
                            accumulation_steps=2, lr_scheduler=make_scheduler,
                            sync_every_microbatch=sync_every, **kwargs)  # fmt: skip
    return model, opt


def _train(model, opt, rank: int, first: int, last: int) -> None:
    for i in range(first, last):
        microbatch_loss(model, rank, i // 2, i % 2).backward()
        opt.step()


def hsdp_resume(
    rank: int, world_size: int, cfg: Config, replicas: int, save_at: int, sync_every: bool
) -> dict[str, Any]:
    """Train straight; then train to ``save_at``, rebuild everything, load, finish; compare."""
    total = 2 * cfg.rounds
    model, opt = _build(cfg, replicas, world_size, sync_every)
    _train(model, opt, rank, 0, total)
    opt.flush()
    straight = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    opt.close()

    model, opt = _build(cfg, replicas, world_size, sync_every)
    _train(model, opt, rank, 0, save_at)
    mid_round = None
    if not sync_every and save_at % 2:
        try:
            opt.state_dict()
        except RuntimeError as exc:
            mid_round = str(exc)
        _train(model, opt, rank, save_at, save_at + 1)  # go on to the round end, save there
        save_at += 1
    saved_model = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    saved_opt = dict(opt.state_dict())
    saved_opt = torch.utils._pytree.tree_map(  # the state holds references: copy them now
        lambda v: v.clone() if isinstance(v, torch.Tensor) else v, saved_opt
    )
    opt.close()

    model, opt = _build(cfg, replicas, world_size, sync_every)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.to_local().copy_(saved_model[n])
    opt.load_state_dict(saved_opt)
    _train(model, opt, rank, save_at, total)
    opt.flush()
    resumed = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    opt.close()
    return {"straight": straight, "resumed": resumed, "mid_round": mid_round}


def hsdp_resumes(
    rank: int, world_size: int, cases: list[tuple[Config, int, bool]], replicas: int
) -> list[dict[str, Any]]:
    """Several ``hsdp_resume`` in one launch: ``(config, save_at, sync_every)`` each."""
    return [hsdp_resume(rank, world_size, cfg, replicas, at, every) for cfg, at, every in cases]


def hsdp_bad_inputs(rank: int, world_size: int) -> dict[str, str]:
    """What ACCOHSDPOptimizer and the engine refuse, as messages."""
    from acco_hooks import ACCOHSDPOptimizer

    errors = {}
    mesh_1d = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    model = make_model()
    fully_shard(model, mesh=mesh_1d)
    try:
        ACCOHSDPOptimizer(model, torch.optim.AdamW, lr=1e-3)
    except ValueError as exc:
        errors["1d_mesh"] = str(exc)
    try:
        ACCOHSDPOptimizer(make_model(), torch.optim.AdamW, lr=1e-3)
    except ValueError as exc:
        errors["not_sharded"] = str(exc)
    return errors



def tensor_parallel_split_net(replicas: int, tp: int):
    """SplitNet (tests/scenario.py) on a (replicate, tp) mesh, its layers split column- then
    row-wise in turn as torchtitan splits a feed-forward."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (replicas, tp), mesh_dim_names=("dp_replicate", "tp"))
    # a column-wise layer's output stays a DTensor: its uneven split (4 + 3) is known to the
    # row-wise layer that reads it
    plan = {f"layers.{i}": ColwiseParallel(use_local_output=False) if i % 2 == 0
            else RowwiseParallel() for i in range(4)}  # fmt: skip
    model = parallelize_module(make_model(model="split"), mesh["tp"], plan)
    # gain replicated over the TP ranks as a DTensor, as torchtitan's plans leave its norms: the
    # engine counts it once in the gradient norm (a plain tensor is each rank's own)
    model.gain = torch.nn.Parameter(distribute_tensor(model.gain.detach(), mesh["tp"], [Replicate()]))
    return model, mesh


def tensor_parallel_run(rank: int, world_size: int, cfg: Config, replicas: int) -> dict[str, Any]:
    """The scenario's training on replicas of tensor-parallel ranks, the engine built as
    torchtitan builds it (the replicas' group, every rank as ``norm_process_group``); the ranks
    of a replica read the replica's micro-batches: replica r is worker r of ``cfg``."""
    import torch.distributed as dist

    from acco_hooks import ACCOEngine

    model, mesh = tensor_parallel_split_net(replicas, world_size // replicas)
    replica = rank // (world_size // replicas)
    opt_class, kwargs = OPTIMIZERS[cfg.optimizer]
    engine = ACCOEngine(
        param_groups(model, cfg.two_groups, cfg.optimizer), opt_class,
        process_group=mesh["dp_replicate"], norm_process_group=dist.group.WORLD, mode=cfg.mode,
        accumulation_steps=cfg.micro[replica], max_grad_norm=cfg.max_grad_norm,
        lr_scheduler=make_scheduler if cfg.scheduler else None, estimate_dtype=cfg.estimate_dtype,
        **kwargs,
    )  # fmt: skip
    engine.hook_param_grads(placeholders=False)
    for r in range(cfg.rounds):
        for micro in range(cfg.micro[replica]):
            microbatch_loss(model, replica, r, micro).backward()
            engine.microbatch_done()
    engine.flush()
    result = {
        "params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
        "memory": engine.memory_bytes(), "owned_whole": engine.owned_whole,
        "num_updates": engine.num_updates,
    }  # fmt: skip
    engine.close()
    return result


def tensor_parallel_runs(rank: int, world_size: int, runs: list[Config], replicas: int) -> list[dict[str, Any]]:
    """``tensor_parallel_run`` of each config, in one launch of the processes."""
    return [tensor_parallel_run(rank, world_size, cfg, replicas) for cfg in runs]
