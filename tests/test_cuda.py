"""The engine and its front-ends on CUDA and NCCL: ``pytest -m cuda`` on a machine with a GPU.

Every test here is skipped, with the reason, where ``torch.cuda.is_available()`` is False (CI
and the project's CPU machines). One GPU is enough: NCCL runs with a world of 1, which still
puts a real NCCL communicator on the engine's background thread and its own CUDA stream.

What is checked, against the CPU reference of ``tests/scenario.py`` unless said otherwise:

- the engine in every mode, without a process group and on NCCL, with clipping, an LR
  scheduler, two parameter groups and foreach or fused AdamW; bf16 parameters and a bf16
  reduce dtype within stated tolerances;
- stream order: every all-gather is started late on the communication stream
  (``torch.cuda._sleep``) and the result does not change; the all-gathers run off the default
  stream;
- ``accumulate_until_ready`` decides from device completion: with the all-gather held on the
  device, rounds grow to many micro-batches (a future completed at enqueue time would end
  every round after one);
- the DDP hook on NCCL against the engine alone, with bucket rebuilds and
  ``gradient_as_bucket_view``; HSDP on a (1, 1) mesh against the reference;
- memory: ``torch.cuda.memory_allocated`` is the same after 100 more rounds;
- the CUDA sanitizer (``TORCH_CUDA_SANITIZER=1``) finds no unsynchronized stream access;
- torchtitan's debug model with ACCO on CUDA, eager and compiled, learns.

Every test passed on one H100 (torch 2.11, docs/cuda.md). The fp32 bar against the CPU reference
is 1e-5 relative where CPU measures ~1e-7 (bar 1e-6), since CUDA kernels sum in other orders;
the error CUDA lands at is not recorded. The bf16 bars are the CPU ones. The sanitizer follows
the training loop's thread only (a dispatch mode is per thread), not the engine's
communication thread.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.scenario import (
    Config,
    engine_run,
    expected_updates,
    make_model,
    microbatch_loss,
    reference_run,
    relative_error,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (torch.cuda.is_available() is False); run `pytest -m cuda` "
        "on a GPU machine",
    ),
]
ROOT = pathlib.Path(__file__).parents[1]
CUDA_FP32_TOLERANCE = 1e-5
# ~0.3 s at the H100's ~1.8 GHz: far longer than a micro-batch of the tiny model (~1 ms)
HOLD_CYCLES = 500_000_000


def full_config(mode: str, implementation: str, **changes) -> Config:
    """Clipping (active), an LR scheduler and two parameter groups, on this process's GPU."""
    fields = dict(mode=mode, world_size=1, micro=[2], rounds=12, max_grad_norm=0.05,
                  scheduler=True, device="cuda",
                  optimizer_kwargs={implementation: True})  # fmt: skip
    return Config(**{**fields, **changes})


def assert_close_to_reference(results: list[dict], cfg: Config, tolerance: float) -> None:
    reference = reference_run(cfg)["params"]
    assert expected_updates(cfg) >= 6
    for result in results:
        error = relative_error(result["params"], reference)
        assert error <= tolerance, f"relative error {error:.2e} > {tolerance:.0e}"
        assert result["num_updates"] == expected_updates(cfg)


# ------------------------------------------------------------------ numerics against the reference


@pytest.mark.parametrize("implementation", ["foreach", "fused"])
@pytest.mark.parametrize("mode", ["acco", "dpu", "ddp"])
def test_engine_on_one_gpu_without_process_group_matches_reference(
    mode: str, implementation: str
) -> None:
    cfg = full_config(mode, implementation)
    assert_close_to_reference([engine_run(0, 1, cfg)], cfg, CUDA_FP32_TOLERANCE)


@pytest.mark.parametrize("implementation", ["foreach", "fused"])
@pytest.mark.parametrize("mode", ["acco", "dpu", "ddp"])
def test_engine_on_nccl_matches_reference(mode: str, implementation: str) -> None:
    cfg = full_config(mode, implementation)
    results = run_distributed("tests.scenario:engine_run", 1, cfg, backend="nccl")
    assert_close_to_reference(results, cfg, CUDA_FP32_TOLERANCE)


@pytest.mark.parametrize("mode", ["acco", "ddp"])
def test_bf16_parameters_on_gpu_stay_close_to_reference(mode: str) -> None:
    cfg = full_config(mode, "fused", dtype=torch.bfloat16)
    result = engine_run(0, 1, cfg)
    assert result["master_dtypes"] == [torch.float32, torch.float32]
    assert_close_to_reference([result], cfg, 2e-2)  # the CPU bar (tests/test_engine_reference.py)


def test_bf16_reduce_dtype_on_nccl_stays_close_to_reference() -> None:
    cfg = full_config("acco", "fused", reduce_dtype=torch.bfloat16)
    results = run_distributed("tests.scenario:engine_run", 1, cfg, backend="nccl")
    assert_close_to_reference(results, cfg, 1e-2)
    assert relative_error(results[0]["params"], reference_run(cfg)["params"]) > 0  # it rounds


# ------------------------------------------------------------------ streams


def _hold_all_gathers(cycles: int) -> list[int]:
    """Make every NCCL all-gather start ``cycles`` late on the stream it is issued on.

    Returns the list that receives, per all-gather, the id of the stream it was issued on.
    """
    import torch.distributed as dist

    # torch 2.13's name; acco_hooks.engine.collectives falls back to all_gather_into_tensor before it
    issue = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    streams: list[int] = []

    def late_all_gather(output, input, *args, **kwargs):
        streams.append(torch.cuda.current_stream().stream_id)
        torch.cuda._sleep(cycles)  # the host goes on; the device holds this stream
        return issue(output, input, *args, **kwargs)

    dist.all_gather_single = late_all_gather
    return streams


def held_all_gather_run(rank: int, world_size: int, cfg: Config) -> dict:
    """``engine_run`` with every all-gather held on the device (spawned: the patch dies with it)."""
    streams = _hold_all_gathers(HOLD_CYCLES // 10)
    result = engine_run(rank, world_size, cfg)
    result["gather_streams"] = streams
    result["default_stream"] = torch.cuda.default_stream().stream_id
    return result


@pytest.mark.parametrize("mode", ["acco", "ddp"])
def test_compute_stream_waits_for_the_held_all_gather(mode: str) -> None:
    """Reading the gather buffer early would copy the round's gradient sum into the weights
    (the two share memory): the result would be far from the reference, not 1e-5 close."""
    cfg = full_config(mode, "fused")
    (result,) = run_distributed("tests.test_cuda:held_all_gather_run", 1, cfg, backend="nccl")
    assert_close_to_reference([result], cfg, CUDA_FP32_TOLERANCE)
    assert len(result["gather_streams"]) >= cfg.rounds  # every round's all-gather was held
    assert result["default_stream"] not in result["gather_streams"]  # a stream of its own


def until_ready_run(rank: int, world_size: int, rounds: int) -> list[int]:
    """Micro-batches per round with ``accumulate_until_ready`` while all-gathers are held."""
    from acco_hooks import ACCOOptimizer

    _hold_all_gathers(HOLD_CYCLES)
    model = make_model().to("cuda")
    opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="acco", accumulation_steps=1,
                        accumulate_until_ready=True, lr=1e-2, fused=True)  # fmt: skip
    per_round, micro = [], 0
    while len(per_round) < rounds:
        microbatch_loss(model, rank, 0, micro).backward()
        micro += 1
        if opt.step():
            per_round.append(opt.engine.last_round_microbatches)
    opt.close()
    return per_round


def test_accumulate_until_ready_waits_for_device_completion() -> None:
    (per_round,) = run_distributed("tests.test_cuda:until_ready_run", 1, 6, backend="nccl")
    assert per_round[0] == 1  # nothing was in flight yet
    # Each later round ran while the previous all-gather was held ~0.3 s on the device.
    assert min(per_round[1:]) >= 5, per_round


# ------------------------------------------------------------------ front-ends on NCCL


@pytest.mark.parametrize(
    "mode, bucket_view, no_sync",
    [("acco", False, False), ("dpu", False, False), ("ddp", False, False),
     ("acco", True, False), ("dpu", True, True)],
)  # fmt: skip
def test_ddp_hook_on_nccl_equals_the_engine(mode: str, bucket_view: bool, no_sync: bool) -> None:
    from tests.ddp_hooks.test_ddp_hooks import DDPVariant, assert_hook_equals_optimizer

    variant = DDPVariant(gradient_as_bucket_view=bucket_view, no_sync=no_sync, device="cuda")
    results = run_distributed(
        "tests.ddp_hooks.test_ddp_hooks:hook_vs_optimizer", 1, mode, variant, backend="nccl"
    )
    assert_hook_equals_optimizer(results, variant)  # incl. several buckets, rebuilt after step 1


@pytest.mark.parametrize("mode", ["acco", "ddp"])
def test_hsdp_on_a_1x1_mesh_matches_reference(mode: str) -> None:
    cfg = full_config(mode, "fused")
    results = run_distributed("tests.engine.hsdp_workers:hsdp_run", 1, cfg, 1, backend="nccl")
    assert_close_to_reference(results, cfg, CUDA_FP32_TOLERANCE)


# ------------------------------------------------------------------ memory and the sanitizer


def test_memory_allocated_is_flat_across_100_rounds() -> None:
    from acco_hooks import ACCOOptimizer

    model = make_model().to("cuda")
    opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="acco", accumulation_steps=2,
                        lr=1e-3, fused=True)  # fmt: skip

    def rounds(first: int, count: int) -> int:
        for r in range(first, first + count):
            for micro in range(2):
                microbatch_loss(model, 0, r, micro).backward()
                opt.step()
        while opt.engine.communication_in_flight:  # the same point of the round each time
            time.sleep(0.001)
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    warm = rounds(0, 10)  # optimizer state, carry and buffers exist by now
    after = rounds(10, 100)
    opt.close()
    assert after == warm, f"{after - warm} bytes more after 100 rounds"


def sanitized_runs() -> None:
    """What the sanitizer test runs: every mode, no process group (an NCCL world too, below)."""
    for mode in ("acco", "dpu", "ddp"):
        engine_run(0, 1, full_config(mode, "fused", rounds=4))


def test_cuda_sanitizer_finds_no_unsynchronized_access() -> None:
    """torch.cuda._sanitizer raises at the first kernel that races another stream's access."""
    code = ("from tests.test_cuda import sanitized_runs, full_config\n"
            "from tests.dist_utils import run_distributed\n"
            "sanitized_runs()\n"
            "cfg = full_config('acco', 'fused', rounds=4)\n"
            "run_distributed('tests.test_cuda:held_all_gather_run', 1, cfg,\n"
            "                backend='nccl')\n")  # fmt: skip
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=600)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "CSAN" not in output, output[-6000:]


# ------------------------------------------------------------------ examples and torchtitan


def test_plain_loop_example_trains_on_nccl() -> None:
    """examples.train_small_transformer as the README runs it, on this machine's GPUs."""
    nproc = min(2, torch.cuda.device_count())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "examples.train_small_transformer",
           "--mode", "acco", "--rounds", "40", "--accumulate-until-ready"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "device=cuda" in output, output[-3000:]



@pytest.mark.titan
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile"])
def test_torchtitan_debug_model_with_acco_learns_on_cuda(compile: bool, tmp_path) -> None:
    from tests.titan.test_trainer import assert_learns, run_titan

    nproc = min(2, torch.cuda.device_count())  # 2 ranks on NCCL where the machine has them
    steps = 12
    losses = run_titan(
        nproc, "debug_cpu_acco.toml", "--parallelism.data_parallel_replicate_degree", str(nproc),
        "--training.global_batch_size", str(8 * nproc), "--training.steps", str(steps),
        *(("--compile.enable",) if compile else ()), dump=tmp_path,
    )  # fmt: skip
    assert_learns(losses, steps)
