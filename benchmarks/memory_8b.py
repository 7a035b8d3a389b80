"""Per-GPU memory of each shipped 8B config, by node count: a calculator, before you launch.

    python -m benchmarks.memory_8b          # seconds; writes outputs/results/memory_8b.json
    python -m benchmarks.memory_8b --out docs/results/memory_8b.json    # the published file

For every ``torchtitan_configs/llama3_8b_*.toml`` on 2, 4, 8 and 16 nodes of 8 GPUs, the GiB
one GPU holds, by the categories docs/torchtitan.md lists ("Memory per GPU before you launch"),
and what the optimizer state and the total become under torchft with a replica group per node
(per model replica where it spans nodes; ``manager=``: each group shards a whole optimizer
state over its own ranks).
Beside them, what torchft's DiLoCo holds in the same layout (``diloco_per_gpu_bytes``: torchtitan's
fault-tolerant trainer, a replica group per node, FSDP over the group's GPUs, the buffers
torchft 0.2.0's ``local_sgd.py`` allocates), and ``--check-diloco``: those buffers measured in one
small run of DiLoCo itself (``check_diloco``), against the same arithmetic at the small model.
The parameter count is exact (the 8B model built on the meta device); the rest is arithmetic
on the engine's buffer layout (``acco_hooks/engine/buffers.py``). A pipeline stage holds 1/PP
of the model, embedding and output counted as the even split. Activations are an estimate:
34·s·b·h bytes per layer and micro-batch with selective checkpointing (Korthikanti et al.,
2022, bf16), divided by TP; PP's in-flight micro-batches are not counted. Nor are the CUDA
context, fragmentation and compile workspace: hence a budget of 70 of an H100's 80 GB.
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

from benchmarks.harness import ROOT, add_out_option, write_result

GPUS_PER_NODE = 8
NODES = (2, 4, 8, 16)
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 1 << 30
H100_BUDGET_GIB = 70  # of an 80 GB H100, leaving room for the CUDA context and fragmentation


def model_facts(flavor: str = "8B") -> dict[str, int]:
    """The llama3 ``flavor``'s exact parameter count and the shapes the activation estimate
    needs (the 8B model by default)."""
    import torch
    from torchtitan.models.llama3 import Transformer, llama3_args

    args = llama3_args[flavor]
    with torch.device("meta"):
        model = Transformer(args)
    return {"params": sum(p.numel() for p in model.parameters()), "layers": args.n_layers,
            "hidden": args.dim, "largest": max(p.numel() for p in model.parameters())}  # fmt: skip


def activation_bytes(cfg: dict, facts: dict[str, int]) -> float:
    """The activation estimate of one micro-batch (module docstring), on one GPU."""
    par, training = cfg["parallelism"], cfg["training"]
    tp, pp = par.get("tensor_parallel_degree", 1), par.get("pipeline_parallel_degree", 1)
    tokens = training["local_batch_size"] * training["seq_len"]
    return (facts["layers"] / pp) * 34 * tokens * facts["hidden"] / tp


def per_gpu_bytes(
    config: pathlib.Path | dict, nodes: int, facts: dict[str, int], ndigits: int | None = 2
) -> dict[str, float]:  # fmt: skip
    """GiB per GPU, by category, for the job config ``config`` (a TOML file, or one read
    already) on ``nodes`` nodes, rounded to ``ndigits`` (None: not rounded)."""
    import tomllib

    cfg = tomllib.loads(config.read_text()) if isinstance(config, pathlib.Path) else config
    par, training, acco = cfg["parallelism"], cfg["training"], cfg["acco"]
    tp, pp = par.get("tensor_parallel_degree", 1), par.get("pipeline_parallel_degree", 1)
    shard = par.get("data_parallel_shard_degree", 1)
    replicas = nodes * GPUS_PER_NODE // (tp * pp * shard)
    local = facts["params"] / (tp * pp * shard)  # the elements of the model on this GPU
    model_bytes = BYTES[training.get("dtype", "float32")]
    reduce_bytes = BYTES[acco.get("reduce_dtype", "float32")]
    fsdp_unsharded = 0.0
    if shard > 1 and not acco.get("fsdp_sync_every_microbatch", False):
        fsdp_unsharded = local * shard * model_bytes  # a whole replica's gradients, unsharded
    # per shard element: fp32 master, AdamW's two moments, the reduce-scattered sum, the shard to
    # gather; the master's fp32 gradient where the sum is narrower (otherwise the sum is it);
    # acco's carried half-batch sum (the engine's memory_bytes(), benchmarks/fake_rank.py)
    shard_side = (4 + 8 + reduce_bytes + model_bytes + (4 if reduce_bytes != 4 else 0)
                  + (4 if acco["mode"] == "acco" else 0))  # fmt: skip
    activations = activation_bytes(cfg, facts)
    figures = {
        "replicas": replicas,
        "params": local * model_bytes,
        "grads": local * 4 + fsdp_unsharded,
        "comm_buffer": local * max(reduce_bytes, model_bytes),
        "optimizer": local * shard_side / replicas,
        "activations_estimate": activations,
    }
    total = sum(v for k, v in figures.items() if k != "replicas")
    # Under torchft (manager=) with the smallest replica groups (one node; one model replica
    # where it spans nodes, 3-D) each group holds a whole optimizer state, sharded over its own
    # data-parallel ranks only: the replicas inside one node.
    replicas_per_node = max(1, GPUS_PER_NODE // (tp * pp * shard))
    optimizer_ft = local * shard_side / replicas_per_node

    def gib(n: float) -> float:
        return n / GIB if ndigits is None else round(n / GIB, ndigits)

    row = {k: (v if k == "replicas" else gib(v)) for k, v in figures.items()}
    row["total"] = gib(total)
    row["optimizer_torchft"] = gib(optimizer_ft)
    row["total_torchft"] = gib(total - figures["optimizer"] + optimizer_ft)
    row["runs"] = replicas >= 2  # ACCO (and its ddp mode) needs two replicas
    row["fits_h100_80gb"] = row["total"] <= H100_BUDGET_GIB
    return row


# torchft's DiLoCo, as torchtitan 0.2.2's fault-tolerant trainer wires it (torchft 0.2.0,
# torchft/local_sgd.py). Each of its buffers takes the parameter's dtype; at fp32 parameters,
# the engine's numerics (fp32 master and moments), 4 bytes an element. bf16 parameters would
# halve every parameter-sized figure, and run AdamW in bf16 too.
DILOCO_STATE_BYTES = 4
# The arms of benchmarks/diloco.py: (fragments, fragment_sync_delay)
DILOCO_VARIANTS = {"diloco": (1, 0), "streaming_diloco": (2, 1)}


def diloco_buffers(
    local: float, fragment: float, sync_delay: int, largest: float, backup_elsewhere: bool = True,
) -> dict[str, float]:  # fmt: skip
    """Bytes of DiLoCo's own buffers on one device, beyond plain training's parameters,
    gradients and inner optimizer state.

    Args:
        local: elements of the parameters this device holds (its FSDP shard).
        fragment: elements of the fragment synchronized at once (``local`` without fragments).
        sync_delay: torchft's ``fragment_sync_delay``.
        largest: elements of this device's largest parameter tensor.
        backup_elsewhere: the backup of the global parameters is on another device than the
            parameters (pinned host memory beside a GPU, torchft's default).

    Returns:
        ``outer_momentum``: the outer SGD's Nesterov momentum, one per fragment, beside the
        parameters (created at a fragment's first sync); ``pseudo_gradient_held``: with a
        sync delay, a fragment's pseudo-gradient, computed ``sync_delay`` inner steps before
        its sync and held through them; ``sync_extra``: the peak a sync adds (the inner
        gradients are still held then, the activations are not): the fragment's pseudo-
        gradient and a copy of its local parameters, and one tensor of the backup copied to
        the parameters' device while both exist; ``host_backup``: the backup itself.
    """
    b = DILOCO_STATE_BYTES
    return {
        "outer_momentum": b * local,
        "pseudo_gradient_held": b * fragment if sync_delay else 0.0,
        "sync_extra": 2 * b * fragment + (b * largest if backup_elsewhere else 0.0),
        "host_backup": b * local,
    }


def diloco_per_gpu_bytes(
    config: pathlib.Path | dict, facts: dict[str, int], fragments: int = 1, sync_delay: int = 0,
    ndigits: int | None = 2,
) -> dict[str, float]:  # fmt: skip
    """GiB per GPU of torchft's DiLoCo in ``config``'s tensor- and pipeline-parallel layout,
    on any number of nodes.

    A replica group is a node (a model replica, where one spans nodes); FSDP shards the model
    over the group's GPUs, and nothing is sharded across groups, so the figures do not change
    with the number of nodes. Per element of the local shard, 4 bytes each: the parameters,
    the inner gradients and AdamW's two moments (as plain FSDP training holds them), then
    :func:`diloco_buffers`. ``total`` is the larger of ``total_training`` (with the
    activations) and ``total_at_sync`` (without them, the sync's extra instead).

    Activations: the estimate's 16-bit ones where FSDP shards the group (its mixed precision
    computes in bf16), twice that where it does not: torchtitan 0.2.2 turns mixed precision off
    with TP or PP and no FSDP (``maybe_enable_amp``), so fp32 parameters compute in fp32. bf16
    parameters would halve that and every parameter-sized figure, and run AdamW in bf16.
    """
    import tomllib

    cfg = tomllib.loads(config.read_text()) if isinstance(config, pathlib.Path) else config
    par = cfg["parallelism"]
    tp, pp = par.get("tensor_parallel_degree", 1), par.get("pipeline_parallel_degree", 1)
    group_gpus = max(GPUS_PER_NODE, tp * pp)
    local = facts["params"] / group_gpus
    # the embedding and the output layer, sharded by TP and FSDP, not by the pipeline
    largest = facts["largest"] / (group_gpus / pp)
    fsdp = group_gpus // (tp * pp)
    activations = activation_bytes(cfg, facts) * (1 if fsdp > 1 or tp * pp == 1 else 2)
    b = DILOCO_STATE_BYTES
    buffers = diloco_buffers(local, local / fragments, sync_delay, largest)
    training = {"params": b * local, "grads": b * local, "optimizer": 2 * b * local,
                "outer_momentum": buffers["outer_momentum"],
                "pseudo_gradient_held": buffers["pseudo_gradient_held"]}  # fmt: skip
    held = sum(training.values())
    total_training = held + activations
    total_at_sync = held - buffers["pseudo_gradient_held"] + buffers["sync_extra"]

    def gib(n: float) -> float:
        return n / GIB if ndigits is None else round(n / GIB, ndigits)

    row = {"fsdp_in_group": fsdp, **{k: gib(v) for k, v in training.items()},
           "activations_estimate": gib(activations),
           "sync_extra": gib(buffers["sync_extra"]), "total_training": gib(total_training),
           "total_at_sync": gib(total_at_sync), "total": gib(max(total_training, total_at_sync)),
           "host_backup": gib(buffers["host_backup"])}  # fmt: skip
    row["fits_h100_80gb"] = row["total"] <= H100_BUDGET_GIB
    return row


class _Done:
    """A finished collective: what torchft's ``Manager.allreduce`` returns, waited on."""

    def __init__(self, tensor: Any) -> None:
        import torch

        self._future = torch.futures.Future()
        self._future.set_result(tensor)

    def wait(self, timeout: Any = None) -> bool:
        return True

    def get_future(self) -> Any:
        return self._future


class OneGroupManager:
    """What DiLoCo asks of torchft's ``Manager``, in a job of one replica group: every quorum
    is this group, every commit succeeds, and the average over the groups is this group's own
    value (as torchft's own DiLoCo tests stand a manager in). No collective allocates here."""

    _use_async_quorum = False

    def __init__(self) -> None:
        self._step = 0

    def start_quorum(self, *args: Any, **kwargs: Any) -> None:
        pass

    def should_commit(self, *args: Any, **kwargs: Any) -> bool:
        self._step += 1
        return True

    def current_step(self) -> int:
        return self._step

    def allreduce(self, tensor: Any, should_quantize: bool = False) -> _Done:
        return _Done(tensor)

    def errored(self) -> None:
        return None

    def allow_state_dict_read(self) -> None:
        pass

    def disallow_state_dict_read(self) -> None:
        pass

    def register_state_dict_fn(self, *args: Any, **kwargs: Any) -> None:
        pass


HOOK_MARK = "memory_8b::diloco_hook"


def _hook_peak_and_net(prof: Any) -> tuple[int, int]:
    """The most bytes allocated at once during the window's ``HOOK_MARK`` range above its
    start, and at its end: the allocator's own events (``profile_memory``), in time order. A
    block allocated before the profiler started is freed unseen, hence one profiled step: what
    the hook frees that the step allocated (its gradients) is seen."""
    events = prof.profiler.kineto_results.events()  # each allocation and free, timed
    (mark,) = [e for e in events if e.name() == HOOK_MARK]
    live = before = peak = 0
    for event in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        if event.start_ns() > mark.end_ns():
            break
        if event.start_ns() >= mark.start_ns():
            peak = max(peak, live + event.nbytes() - before)
        else:
            before += event.nbytes()
        live += event.nbytes()
    return peak, live - before


def check_diloco(fragments: int, sync_delay: int, sync_every: int = 4, periods: int = 3) -> dict:
    """Run torchft's DiLoCo on torchtitan's Llama-3 debug model (fp32, this CPU, one replica
    group, :class:`OneGroupManager`) and measure its buffers against :func:`diloco_buffers`
    at the model's own sizes.

    Measured: the outer optimizers' momentum and the backup (their tensors, read from torchft's
    and torch's objects after the run), and the bytes each sync allocates, from the profiler's
    allocation events in DiLoCo's optimizer hook, each step profiled whole (the periods after
    the first: a fragment's first sync creates its momentum). With a sync delay, a sync's extra is what the hook that
    prepares it keeps (the pseudo-gradient, held) plus the peak of the hook that performs it.
    Here the backup and the parameters share the CPU: no tensor of the backup is copied over
    (``backup_elsewhere=False``), which on a GPU adds one tensor (:func:`diloco_buffers`).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torchft.local_sgd import DiLoCo
    from torchtitan.models.llama3 import Transformer, llama3_args

    torch.manual_seed(0)
    args = llama3_args["debugmodel"]
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    layers = list(model.layers.values())
    half = len(layers) // 2
    parts = ([model] if fragments == 1 else
             [torch.nn.ModuleList([model.tok_embeddings, *layers[:half]]),
              torch.nn.ModuleList([*layers[half:], model.norm, model.output])])  # fmt: skip
    assert len(parts) == fragments, "the check splits the model in 1 or 2 fragments"
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # torchtitan's outer optimizer, one per fragment (components/ft/manager.py)
    outers = [torch.optim.SGD(list(part.parameters()), lr=0.7, momentum=0.9, nesterov=True)
              for part in parts]  # fmt: skip
    hooks: list[dict] = []
    post_hook = DiLoCo._step_post_hook

    def marked(diloco: Any, *hook_args: Any) -> None:
        with torch.profiler.record_function(HOOK_MARK):
            post_hook(diloco, *hook_args)

    DiLoCo._step_post_hook = marked
    try:
        diloco = DiLoCo(OneGroupManager(), parts, inner, outers, sync_every=sync_every,
                        fragment_sync_delay=sync_delay)  # fmt: skip
        tokens = torch.randint(0, args.vocab_size, (2, 65))
        with diloco:
            for _ in range(periods * sync_every):
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                    inner.zero_grad()
                    logits = model(tokens[:, :-1])
                    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                             tokens[:, 1:].flatten())  # fmt: skip
                    loss.backward()
                    step = diloco._local_step + 1
                    inner.step()
                peak, net = _hook_peak_and_net(prof)
                hooks.append({"local_step": step, "peak": peak, "net": net})
    finally:
        DiLoCo._step_post_hook = post_hook
    per_fragment = sync_every // fragments  # inner steps between two syncs of the job
    perform_at = per_fragment
    local = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    syncs = []
    for i, hook in enumerate(hooks):
        if hook["local_step"] != perform_at or i < sync_every:  # not in the first period
            continue
        held = hooks[i - sync_delay]["net"] if sync_delay else 0
        fragment = (i // per_fragment) % fragments
        numel = sum(p.numel() for p in parts[fragment].parameters())
        expected = diloco_buffers(local, numel, sync_delay, largest, backup_elsewhere=False)
        syncs.append({"fragment": fragment, "fragment_numel": numel,
                      "pseudo_gradient_held": held, "sync_extra": held + hook["peak"],
                      "predicted": {k: expected[k] for k in ("pseudo_gradient_held", "sync_extra")}})  # fmt: skip
    momentum = sum(state["momentum_buffer"].nbytes for outer in outers
                   for state in outer.state.values())  # fmt: skip
    backup = [t for fragment in diloco._fragments for t in fragment.original_parameters.values()]
    expected = diloco_buffers(local, local / fragments, sync_delay, largest, backup_elsewhere=False)
    return {
        "fragments": fragments, "fragment_sync_delay": sync_delay, "sync_every": sync_every,
        "params": local, "largest_tensor": largest,
        "outer_momentum": momentum, "host_backup": sum(t.nbytes for t in backup),
        "backup_devices": sorted({str(t.device) for t in backup}),
        "predicted": {k: expected[k] for k in ("outer_momentum", "host_backup")},
        "syncs": syncs,
    }  # fmt: skip


def _note(row: dict) -> str:
    if not row["runs"]:
        return "needs 2 replicas: more nodes"
    return "" if row["fits_h100_80gb"] else f"over {H100_BUDGET_GIB} GiB: smaller local_batch_size"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_option(parser, "memory_8b")
    parser.add_argument("--check-diloco", action="store_true",
                        help="also run torchft's DiLoCo on the debug model and measure its "
                        "buffers against the arithmetic (check_diloco; ~1 min on a CPU)")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    facts = model_facts()
    results = {"params": facts["params"], "gpus_per_node": GPUS_PER_NODE, "configs": {}}
    print(f"Llama-3 8B: {facts['params']:,} parameters; GiB per GPU ({GPUS_PER_NODE} GPUs/node)")
    print(f"{'config':<26}{'nodes':>6}{'R':>4}{'params':>8}{'grads':>8}{'comm':>7}{'optim':>7}"
          f"{'act*':>7}{'total':>8}{'ft:optim':>9}{'ft:total':>9}  note")  # fmt: skip
    for path in sorted((ROOT / "torchtitan_configs").glob("llama3_8b_*.toml")):
        rows = results["configs"][path.name] = {}
        for nodes in NODES:
            row = rows[nodes] = per_gpu_bytes(path, nodes, facts)
            print(f"{path.stem:<26}{nodes:>6}{row['replicas']:>4}{row['params']:>8}"
                  f"{row['grads']:>8}{row['comm_buffer']:>7}{row['optimizer']:>7}"
                  f"{row['activations_estimate']:>7}"
                  f"{row['total']:>8}{row['optimizer_torchft']:>9}"
                  f"{row['total_torchft']:>9}  {_note(row)}")  # fmt: skip
    print("act*: an estimate (selective activation checkpointing), see the module docstring")
    print("ft:*: under torchft, a replica group per node (per model replica in 3-D): the "
          "optimizer state is sharded over the group's data-parallel ranks only")
    print("\ntorchft DiLoCo in the same layouts (any number of nodes; fp32 state): GiB per GPU")
    print(f"{'config':<26}{'variant':>17}{'fsdp':>5}{'params':>8}{'grads':>7}{'optim':>7}"
          f"{'outer':>7}{'held':>6}{'act*':>7}{'sync+':>7}{'train':>7}{'@sync':>7}{'total':>7}"
          f"{'host':>6}")  # fmt: skip
    results["diloco"] = {}
    for path in sorted((ROOT / "torchtitan_configs").glob("llama3_8b_*.toml")):
        rows = results["diloco"][path.name] = {}
        for variant, (fragments, delay) in DILOCO_VARIANTS.items():
            row = rows[variant] = diloco_per_gpu_bytes(path, facts, fragments, delay)
            print(f"{path.stem:<26}{variant:>17}{row['fsdp_in_group']:>5}{row['params']:>8}"
                  f"{row['grads']:>7}{row['optimizer']:>7}{row['outer_momentum']:>7}"
                  f"{row['pseudo_gradient_held']:>6}{row['activations_estimate']:>7}"
                  f"{row['sync_extra']:>7}{row['total_training']:>7}{row['total_at_sync']:>7}"
                  f"{row['total']:>7}{row['host_backup']:>6}")  # fmt: skip
    print("outer: the outer Nesterov momentum; held: a fragment's pseudo-gradient held through "
          "the sync delay; sync+: what a sync adds; host: the pinned backup (host memory)")
    if args.check_diloco:
        results["diloco_check"] = []
        for fragments, delay in DILOCO_VARIANTS.values():
            check = check_diloco(fragments, delay)
            results["diloco_check"].append(check)
            sync = check["syncs"][-1]
            print(f"check, DiLoCo on the debug model ({fragments} fragment(s), delay {delay}): "
                  f"outer momentum {check['outer_momentum']:,} B (predicted "
                  f"{check['predicted']['outer_momentum']:,.0f}), backup "
                  f"{check['host_backup']:,} B on {check['backup_devices']}, a sync's extra "
                  f"{sync['sync_extra']:,} B (predicted {sync['predicted']['sync_extra']:,.0f})")  # fmt: skip
    out = write_result(args.out, results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
