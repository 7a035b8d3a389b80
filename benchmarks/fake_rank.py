"""One rank of a job at its real shape, on one device: torchtitan's ``--comm.mode fake_backend``.

    python -m benchmarks.fake_rank            # one CUDA GPU: a rank of each 8B config, ~6 min
    python -m benchmarks.fake_rank --smoke    # any device: the debug model, a world of 8
    python -m benchmarks.fake_rank --seq-len 64 --local-batch 1 --out docs/results/fake_rank_8b_cpu.json
                                              # a CPU: the 8B ranks with short sequences (~10 min, 17 GB)

A job of 32 or 64 GPUs cannot run on one, but one of its ranks can. With ``--comm.mode
fake_backend`` and ``NGPU`` set to the job's world size, torchtitan 0.2.2 builds the job as rank
0 of that world on torch's ``fake`` process-group backend, whose collectives return at once and
move nothing. That rank's model part (its tensor-parallel slice or FSDP shard),
its activations, ACCO's buffers and its optimizer shard are the real ones, and its forward,
backward and shard step take the real time; the numbers it trains are not (no collective brings
the other ranks' values): the run measures, it does not learn.

For each case, a job config at the world its ``[parallelism]`` degrees make (as shipped: 4 nodes
of 8 GPUs), a few rounds through ``train_titan.py``:

- ``engine_mib``: what the engine holds, by category (``ACCOEngine.memory_bytes()``, which the
  trainer logs at the end), against ``predicted_mib``, ``benchmarks/memory_8b.py``'s figures for
  the same config and world (its ``optimizer`` is the engine's master, moments, staging and
  carried shards together);
- ``peak_memory_gib``: torchtitan's step lines' ``memory:``, the device's peak (on CUDA the
  caching allocator's peak reserved; on a CPU the peak RSS), against the calculator's total;
- ``microbatch_s``: K, one micro-batch's compute time, the median step time over steps >= 3
  (from torchtitan's ``tps``, which it prints as an integer: coarse below 100 tokens/s, as on a
  CPU at the 8B shape) over the round's micro-batches: nothing waits for a network.

The 8B cases read the embedded ``stdlib`` corpus (no download; its token ids are below 2048, the
model keeps Llama-3's 128256-row vocabulary). ``--smoke`` runs the debug model in the 8B
configs' layouts scaled to a world of 8 (TP 2, FSDP 2), as ``tests/benchmarks`` does on a CPU.

Not the 3-D configs (``llama3_8b_*_3d.toml``): a pipeline stage cannot build on the fake
backend. torch's pipelining exchanges each stage's input and output shapes with
``send_object_list``/``recv_object_list`` before the first step, and a fake receive brings no
object (torchtitan's own trainer fails there alike, ``EOFError`` or a bogus allocation);
upstream torchtitan's static stage metadata (pytorch/torchtitan#4540, open) is what lifts it.
And eager: the 8B configs compile their blocks, and with tensor parallelism and selective
activation checkpointing torch 2.13's AOT autograd refuses a ``DeviceMesh`` among the tensors
saved for backward (``expected all tensors_saved_with_vc_check to be Tensors``), on the CPU
with torchtitan's own trainer and real gloo ranks too; whether a GPU does the same is one of the
things its run finds out.

Writes outputs/results/fake_rank_8b.json (``--smoke``: outputs/fake_rank_smoke.json; ``--out``:
elsewhere, e.g. the published docs/results/fake_rank_8b_cpu.json) after every case, and each
case's log to outputs/fake_rank/.
"""

from __future__ import annotations

import argparse
import math
import platform
import re
import sys
import tomllib

from benchmarks import harness, memory_8b

SMOKE_RESULTS = harness.ROOT / "outputs" / "fake_rank_smoke.json"
LOGS = harness.ROOT / "outputs" / "fake_rank"  # {case}.log, and each case's dump folder
CONFIGS = harness.ROOT / "torchtitan_configs"
# the 8B cases: each config as shipped, but for its data and eager (see the module docstring)
CASES_8B: dict[str, tuple[str, dict[str, object]]] = {
    name: (f"{name}.toml", {"training.dataset": "stdlib",
                            "model.hf_assets_path": "./outputs/stdlib/tokenizer",
                            "compile.enable": False})
    for name in ("llama3_8b_acco", "llama3_8b_hsdp_acco", "llama3_8b_zero1")
}  # fmt: skip
# the 8B configs' layouts and settings with the debug model, in a world of 8
_SMOKE_TP = {"parallelism.tensor_parallel_degree": 2, "acco.accumulation_steps": 2}
SMOKE_CASES: dict[str, tuple[str, dict[str, object]]] = {
    "acco_tp": ("debug_cpu_acco.toml", {**_SMOKE_TP, "parallelism.data_parallel_replicate_degree": 4}),
    "hsdp_acco": ("debug_cpu_hsdp_acco.toml", {"parallelism.data_parallel_shard_degree": 2,
                                               "parallelism.data_parallel_replicate_degree": 4,
                                               "acco.accumulation_steps": 4,
                                               "acco.fsdp_sync_every_microbatch": True}),
    "zero1_tp": ("debug_cpu_acco.toml", {**_SMOKE_TP, "acco.mode": "ddp",
                                         "acco.accumulation_steps": 4,
                                         "parallelism.data_parallel_replicate_degree": 4}),
}  # fmt: skip
ENGINE_MEMORY = re.compile(r"ACCO engine memory per rank \(MiB\): (?P<figures>.*)")
# the calculator's categories, as sums of the engine's
PREDICTED_AS = {"params": ("model",), "grads": ("grad_accumulator",),
                "comm_buffer": ("comm_buffer",),
                "optimizer": ("master_shard", "optimizer_state", "shard_staging",
                              "carried_shard", "estimate_wire", "whole_on_owner")}  # fmt: skip


def job_config(config: str, overrides: dict[str, object]) -> dict:
    """The TOML ``config`` as the run reads it: with ``overrides`` (``"section.key": value``)."""
    cfg = tomllib.loads((CONFIGS / config).read_text())
    for key, value in overrides.items():
        section, name = key.split(".")
        cfg.setdefault(section, {})[name] = value
    return cfg


NON_DATA_PARALLEL = ("tensor_parallel", "pipeline_parallel", "context_parallel")


def degrees(cfg: dict, *dims: str) -> int:
    """The product of the job config's ``[parallelism]`` degrees of ``dims`` (each set, none -1)."""
    return math.prod(cfg["parallelism"].get(f"{dim}_degree", 1) for dim in dims)


def world_size(cfg: dict) -> int:
    """The world the job config's degrees make."""
    return degrees(cfg, "data_parallel_replicate", "data_parallel_shard", *NON_DATA_PARALLEL)


def _flags(overrides: dict[str, object]) -> list[str]:
    """``overrides`` as torchtitan's command-line flags (a boolean: ``--a.b`` or ``--a.no-b``)."""
    flags = []
    for key, value in overrides.items():
        if isinstance(value, bool):
            section, name = key.split(".")
            flags.append(f"--{key}" if value else f"--{section}.no-{name.replace('_', '-')}")
        else:
            flags += [f"--{key}", str(value)]
    return flags


def run_case(name: str, config: str, overrides: dict[str, object], steps: int) -> dict:
    """One rank of ``config`` (with ``overrides``) at its world size: its figures (see the
    module docstring); its output to ``LOGS/{name}.log``."""
    cfg = job_config(config, overrides)
    world = world_size(cfg)
    training = cfg["training"]
    microbatches = cfg["acco"]["accumulation_steps"]
    argv = [sys.executable, str(harness.ROOT / "train_titan.py"),
            "--job.config_file", str(CONFIGS / config), *_flags(overrides),
            "--comm.mode", "fake_backend", "--job.dump_folder", str(LOGS / name),
            "--training.steps", str(steps), "--training.global_batch_size", "-1",
            "--metrics.log_freq", "1", "--metrics.disable_color_printing",
            "--metrics.no-enable-tensorboard", "--checkpoint.no-enable"]  # fmt: skip
    # one process, rank 0 of the fake world of NGPU ranks, as torchtitan's own dry run
    env = {"NGPU": str(world), "LOCAL_RANK": "0", "RANK": "0", "LOG_RANK": "0"}
    output = harness.run(argv, timeout_s=1200, env=env, log=LOGS / f"{name}.log")
    match = ENGINE_MEMORY.search(output)
    if match is None:
        raise RuntimeError(f"{name}: no engine memory line in the output:\n{output[-3000:]}")
    engine = {k: float(v) for k, v in (f.split("=") for f in match["figures"].split())}
    # torchtitan's tps is tokens per second over the ranks that share a batch (TP x PP x CP)
    tokens = training["local_batch_size"] * training["seq_len"] * microbatches
    timing = harness.parse_steps(output, tokens / degrees(cfg, *NON_DATA_PARALLEL))
    facts = memory_8b.model_facts(cfg["model"]["flavor"])
    predicted = memory_8b.per_gpu_bytes(cfg, world // memory_8b.GPUS_PER_NODE, facts, ndigits=None)
    predicted_mib = {k: predicted[k] * 1024 for k in (*PREDICTED_AS, "total")}
    return {
        "config": config, "overrides": overrides, "world_size": world,
        "microbatches_per_round": microbatches, "tokens_per_microbatch": tokens // microbatches,
        "engine_mib": engine, "predicted_mib": predicted_mib,
        "engine_over_predicted": {
            k: sum(engine[e] for e in parts) / predicted_mib[k]
            for k, parts in PREDICTED_AS.items() if predicted_mib[k] > 0
        },
        "peak_memory_gib": timing["peak_rss_gib"],
        "predicted_total_gib": predicted["total"],
        "microbatch_s": timing["round_s"] / microbatches,
        "step_s_all": timing["round_s_all"],
    }  # fmt: skip


def measure(cases: dict[str, tuple[str, dict[str, object]]], steps: int, out) -> dict:
    """Every case in turn; ``out`` is rewritten after each, so that a run cut short (a lent
    GPU's time limit) keeps the cases it finished."""
    import torch

    cuda = torch.cuda.is_available()
    results = {
        **harness.header(),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "python": platform.python_version(), "steps": steps, "complete": False, "cases": {},
    }  # fmt: skip
    for name, (config, overrides) in cases.items():
        case = results["cases"][name] = run_case(name, config, overrides, steps)
        ratios = " ".join(f"{k}={v:.3f}" for k, v in case["engine_over_predicted"].items())
        print(f"{name:22s} world {case['world_size']:3d}  K {case['microbatch_s'] * 1e3:9.2f} ms  "
              f"peak {case['peak_memory_gib']:6.2f} GiB (predicted {case['predicted_total_gib']:6.2f})"
              f"  engine/predicted: {ratios}", flush=True)  # fmt: skip
        harness.write_result(out, results)
    results["complete"] = True
    harness.write_result(out, results)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="the debug model in the 8B layouts, a world of 8 (any device)")
    parser.add_argument("--cases", default=None,
                        help="comma-separated case names (default: every case)")
    parser.add_argument("--steps", type=int, default=6, help="rounds per case (K: steps >= 3)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per sequence instead of the config's (a CPU run of the 8B "
                        "shapes; the activations are then not the config's)")
    parser.add_argument("--local-batch", type=int, default=None,
                        help="sequences per micro-batch instead of the config's")
    harness.add_out_option(parser, "fake_rank_8b", "outputs/results/fake_rank_8b.json, "
                           "--smoke: outputs/fake_rank_smoke.json")  # fmt: skip
    args = parser.parse_args()
    cases = SMOKE_CASES if args.smoke else CASES_8B
    if args.cases is not None:
        unknown = sorted(set(args.cases.split(",")) - set(cases))
        if unknown:
            parser.error(f"--cases: unknown {unknown}; the cases are {sorted(cases)}")
        cases = {name: cases[name] for name in args.cases.split(",")}
    shape = {key: value for key, value in (("training.seq_len", args.seq_len),
                                           ("training.local_batch_size", args.local_batch))
             if value is not None}  # fmt: skip
    cases = {name: (config, {**overrides, **shape}) for name, (config, overrides) in cases.items()}
    if args.steps < 4:
        parser.error(f"--steps {args.steps}: K is the median over steps >= 3; use at least 4")
    from acco_hooks.titan import TITAN_030

    if TITAN_030:
        parser.error("--comm.mode fake_backend is torchtitan 0.2.2's: run with the default "
                     "stack (bash scripts/setup.sh)")  # fmt: skip
    out = args.out or (SMOKE_RESULTS if args.smoke else harness.result_file("fake_rank_8b"))
    measure(cases, args.steps, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
