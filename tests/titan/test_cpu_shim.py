"""scaffolding.cpu_shim: torchtitan's own Trainer on CPU with 2 gloo ranks (FSDP2 and DDP).

The fixtures build everything torchtitan needs and does not ship, in a temporary directory:
a byte-level BPE tokenizer with exactly 2048 tokens (llama3 ``debugmodel`` has vocab 2048)
trained on Python stdlib source, a local jsonl dataset ({"text": ...} per stdlib file), and a
tiny launcher that registers that dataset in torchtitan's DATASETS inside each spawned worker and
then runs ``torchtitan.train.main(Trainer)``. The shim is loaded only the torchtitan way, via
``--experimental.custom_import scaffolding.cpu_shim`` (the launcher does not import it).

On CPU, DTensor's random ops are not supported (``OffsetBasedRNGTracker`` refuses ``cpu``), so
FSDP's sharded ``init_weights`` and DDP's unsharded one draw different weights from the same
seed. To compare FSDP with DDP on equal footing, both runs start from one seed checkpoint made by
torchtitan itself (``--checkpoint.create_seed_checkpoint`` on 1 process) and load it with
``--checkpoint.initial_load_path`` (``--checkpoint.load_only``: they save nothing).

What holds, and is asserted: the same step-1 loss; FSDP's gradient is the SUM over ranks that
torchtitan wants (its loss is already divided by the global token count), while torchtitan's DDP
path averages on top of that, so DDP's grad norm is exactly half of FSDP's at every step; with
grad-norm clipping off, AdamW makes that constant factor invisible and the losses agree at every
step (with the default ``max_norm 1.0`` they drift apart by ~1e-3 relative after FSDP's larger
gradient is first clipped).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import subprocess
import sys
import sysconfig
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
DATASET_NAME = "acco_cpu_shim_test"
VOCAB = 2048
STEPS = 6
RUN_TIMEOUT_S = 170

LAUNCHER = textwrap.dedent(
    """
    # Spawned by torch.distributed.run, once per rank: register the test dataset, then run
    # torchtitan's own main(). The CPU shim comes in through --experimental.custom_import.
    import os

    import datasets
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    DATASETS[{name!r}] = DatasetConfig(
        path=os.environ["ACCO_TEST_JSONL"],
        loader=lambda p: datasets.load_dataset("json", data_files=p, split="train"),
        sample_processor=lambda s: s["text"],
    )

    from torchtitan.train import Trainer, main

    from scaffolding.process_exit import finish

    main(Trainer)
    finish()  # no abort at exit (scaffolding/process_exit.py)
    """
).format(name=DATASET_NAME)

STEP_RE = re.compile(
    r"step:\s*(\d+)\s+loss:\s*(\S+)\s+grad_norm:\s*(\S+)\s+memory:\s*([\d.]+)GiB"
)


def _stdlib_texts(max_bytes: int = 400_000) -> list[str]:
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if not 2_000 <= len(text) <= 60_000:
            continue
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("titan_cpu")
    texts = _stdlib_texts()
    assert sum(map(len, texts)) >= 300_000

    data = root / "data.jsonl"
    with data.open("w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")

    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    assert tok.get_vocab_size() == VOCAB
    tok_dir = root / "tokenizer"
    tok_dir.mkdir()
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": specials[0], "eos_token": specials[1]})
    )

    launcher = root / "launch_titan.py"
    launcher.write_text(LAUNCHER)
    return {"root": root, "data": data, "tokenizer": tok_dir, "launcher": launcher}


def _env(assets) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        # the repository first: an editable install of acco_hooks may point elsewhere
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        ACCO_TEST_JSONL=str(assets["data"]),
        HF_DATASETS_CACHE=str(assets["root"] / "hf_cache"),
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def _torchrun(assets, name: str, nproc: int, extra: list[str]) -> str:
    dump = assets["root"] / name
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nproc_per_node", str(nproc),
        str(assets["launcher"]),
        "--experimental.custom_import", "scaffolding.cpu_shim",
        "--job.dump_folder", str(dump),
        "--model.name", "llama3",
        "--model.flavor", "debugmodel",
        "--model.hf_assets_path", str(assets["tokenizer"]),
        "--training.dataset", DATASET_NAME,
        "--training.seq_len", "128",
        "--training.local_batch_size", "2",
        "--training.steps", str(STEPS),
        # fp32 everywhere: CPU bf16 is slow, and FSDP (param_dtype) vs DDP (autocast) would differ
        "--training.mixed_precision_param", "float32",
        "--activation_checkpoint.mode", "none",
        # a constant lr of 3e-3 (no warmup, no decay to 0), so a few steps visibly learn
        "--optimizer.lr", "3e-3",
        "--lr_scheduler.warmup_steps", "1",
        "--lr_scheduler.min_lr_factor", "1.0",
        "--metrics.log_freq", "1",
        "--metrics.disable_color_printing",
        "--debug.seed", "1234",
        "--comm.trace_buf_size", "0",
        *extra,
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env=_env(assets), capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    out = proc.stdout + proc.stderr
    (assets["root"] / f"{name}.log").write_text(out)
    assert proc.returncode == 0, f"{name} failed (rc={proc.returncode}):\n{out[-6000:]}"
    return out


def _steps(out: str) -> dict[int, tuple[float, float, float]]:
    """{step: (loss, grad_norm, memory GiB)} from torchtitan's step log. Every rank logs the
    global loss and grad norm (they must agree); memory is the rank's own peak RSS."""
    seen: dict[int, tuple[float, float, float]] = {}
    for m in STEP_RE.finditer(out):
        step, vals = int(m.group(1)), tuple(float(m.group(i)) for i in (2, 3, 4))
        prev = seen.setdefault(step, vals)
        assert prev[:2] == vals[:2], f"ranks disagree at step {step}: {prev} vs {vals}"
    return seen


@pytest.fixture(scope="module")
def runs(assets):
    _torchrun(
        assets, "seed", 1,
        ["--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
         "--parallelism.data_parallel_shard_degree", "1"],
    )  # fmt: skip
    seed = assets["root"] / "seed" / "checkpoint" / "step-0"
    assert seed.is_dir()
    load = ["--checkpoint.enable", "--checkpoint.load_only",
            "--checkpoint.initial_load_path", str(seed),
            # No grad-norm clipping (default max_norm 1.0): DDP's gradients are 1/2 of FSDP's (see
            # the test), so clipping would fire on different steps in the two runs and, through
            # AdamW's moment estimates, make the trajectories drift apart after the first clip.
            "--training.max_norm", "1e6"]  # fmt: skip
    fsdp = _torchrun(
        assets, "fsdp", 2,
        ["--parallelism.data_parallel_shard_degree", "2",
         "--parallelism.data_parallel_replicate_degree", "1", *load],
    )  # fmt: skip
    ddp = _torchrun(
        assets, "ddp", 2,
        ["--parallelism.data_parallel_shard_degree", "1",
         "--parallelism.data_parallel_replicate_degree", "2", *load],
    )  # fmt: skip
    return {"fsdp": fsdp, "ddp": ddp}


def test_shim_patches_device_and_memory_monitor():
    # in a fresh interpreter, so this test does not patch torchtitan for the rest of the session
    code = textwrap.dedent(
        """
        import torch
        import torchtitan.components.metrics as metrics          # copies taken before the shim
        import torchtitan.distributed.utils as dist_utils
        import torchtitan.distributed.parallel_dims as parallel_dims
        import torchtitan.tools.utils as utils
        assert not torch.cuda.is_available()
        import scaffolding.cpu_shim as shim
        shim.install(); shim.install()                         # idempotent
        assert utils.device_type == "cpu", utils.device_type
        for mod in (metrics, dist_utils, parallel_dims):
            assert mod.device_type == "cpu", mod
        assert metrics.device_module is utils.device_module is dist_utils.device_module
        assert utils.get_device_info() == ("cpu", utils.device_module)
        assert isinstance(utils.device_module.current_device(), int)
        mon = metrics.build_device_memory_monitor()
        assert mon.device.type == "cpu" and mon.device_capacity > 0
        stats = mon.get_peak_stats()
        assert 0 < stats.max_reserved_gib < mon.device_capacity_gib
        assert stats.num_alloc_retries == 0 and stats.num_ooms == 0
        assert metrics.DeviceMemoryMonitor().device == torch.device("cpu:0")
        import torch.distributed as dist
        assert dist.Backend.default_device_backend_map["cpu"] == "gloo"
        import torchtitan.models.llama3.infra.parallelize as par
        import torchtitan.protocols.train_spec as ts
        wrapped = par.apply_fsdp
        shim.install()
        assert par.apply_fsdp is wrapped                     # not wrapped twice
        spec = ts.get_train_spec("llama3")
        assert getattr(spec.parallelize_fn, "_acco_cpu_shim", False)
        # the trainer module's one sleep (rank 0's 2 s at the end of train()) returns at once
        import importlib, inspect, time
        trainer = importlib.import_module(
            "torchtitan.trainer" if shim.TITAN_030 else "torchtitan.train")
        assert inspect.getsource(trainer).count("time.sleep(") == 1
        start = time.perf_counter()
        trainer.time.sleep(2)
        assert time.perf_counter() - start < 0.5
        assert trainer.time.perf_counter is time.perf_counter
        assert time.sleep is not trainer.time.sleep                   # the real one untouched

        # That the wrapped apply_fsdp makes FSDP2 sum on gloo (no PREMUL_SUM) is shown by what
        # it computes: test_fsdp_and_ddp_train_on_cpu_gloo (FSDP's grad norm is 2x DDP's).
        print("OK", stats.max_reserved_gib)
        """
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout


def test_shim_is_a_noop_with_an_accelerator():
    # pretend CUDA exists (torch._utils._get_available_device_type is what torchtitan and the shim
    # ask): the shim must leave torchtitan alone and say so in the log
    code = textwrap.dedent(
        """
        import logging, sys
        logging.basicConfig(level=logging.INFO, stream=sys.stdout)
        import torch, torch._utils
        torch._utils._get_available_device_type = lambda: "cuda"
        import torchtitan.tools.utils as utils
        import torchtitan.distributed.utils as dist_utils
        import torchtitan.models.llama3.infra.parallelize as par
        apply_fsdp = par.apply_fsdp
        import scaffolding.cpu_shim as shim
        shim.install()
        assert utils.device_type == dist_utils.device_type == "cuda"
        assert utils.device_module is dist_utils.device_module is torch.cuda
        assert par.apply_fsdp is apply_fsdp and not shim.is_installed()
        print("NOOP-OK")
        """
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "NOOP-OK" in proc.stdout
    assert proc.stdout.count("cuda is available: torchtitan runs on it unchanged") == 1


def test_fsdp_and_ddp_train_on_cpu_gloo(runs):
    fsdp, ddp = _steps(runs["fsdp"]), _steps(runs["ddp"])
    for name, out, steps in (("fsdp", runs["fsdp"], fsdp), ("ddp", runs["ddp"], ddp)):
        assert sorted(steps) == list(range(1, STEPS + 1)), (name, steps)
        losses = [steps[s][0] for s in range(1, STEPS + 1)]
        assert all(math.isfinite(x) for x in losses), (name, losses)
        assert losses[-1] < losses[0], (name, losses)
        assert all(steps[s][2] > 0 for s in steps), (name, "memory column should be peak RSS")
        assert "[acco cpu_shim] no accelerator" in out
        assert "Training completed" in out
    assert "Applied FSDP to the model" in runs["fsdp"]
    assert "Applied DDP to the model" in runs["ddp"]

    # same seed checkpoint, same data (the dp mesh is the batch mesh in both): same first loss
    assert fsdp[1][0] == pytest.approx(ddp[1][0], rel=1e-5, abs=1e-5)
    # torchtitan divides each rank's loss sum by the GLOBAL token count, so the wanted gradient is
    # the SUM over ranks. FSDP (divide factor 1.0, forced to ReduceOp.SUM by the shim) gives that,
    # exactly like PREMUL_SUM(1.0) on NCCL; DDP (torch replicate) still averages, so its gradients
    # (and the pre-clip grad norm) are 1/dp = 1/2 of FSDP's.
    # (grad norms are logged with 4 decimals, hence abs=2e-4)
    assert fsdp[1][1] == pytest.approx(2 * ddp[1][1], rel=1e-3, abs=2e-4)
    # AdamW is invariant to a constant gradient scale (up to its eps), so without clipping the
    # two runs follow the same trajectory, with DDP's grad norm half of FSDP's at every step.
    for s in range(2, STEPS + 1):
        assert fsdp[s][0] == pytest.approx(ddp[s][0], rel=1e-4), (s, fsdp[s], ddp[s])
        assert fsdp[s][1] == pytest.approx(2 * ddp[s][1], rel=1e-3, abs=2e-4), (s, fsdp[s], ddp[s])
