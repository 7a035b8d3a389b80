"""torchtitan 0.3.0: the registered configs, the TOML translation and the CPU attention shim.

The training proofs (TP, PP, HSDP, DCP resume, the torchtitan baselines) are in
``tests/titan/test_trainer.py``, which runs on both releases; CI runs this module in its
torchtitan 0.3.0 venv (``-m titan``).
"""

from __future__ import annotations

import math
import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Sequence

import pytest
import torch

from acco_hooks.titan import TITAN_030
from scaffolding import forked_ranks
from tests.titan.conftest import backend_overrides

if not TITAN_030:
    pytest.skip("torchtitan 0.3.0 only (CI runs it in its 0.3.0 venv)", allow_module_level=True)

from acco_hooks.titan.toml_compat import TomlConfigError, load_toml_config
from examples.titan_muon_recipe import MATRICES, MUON

pytestmark = pytest.mark.titan
ROOT = pathlib.Path(__file__).parents[2]
CONFIGS = ROOT / "torchtitan_configs"
STEP_LOSS = re.compile(r"step:\s*(\d+)\s+loss:\s*(-?[\d.]+)\s+grad_norm:\s*(-?[\d.]+)")


def _env(pythonpath: pathlib.Path | None = None) -> dict[str, str]:
    # the checkout first: a script outside it imports the scaffolding too
    paths = [str(ROOT), *([str(pythonpath)] if pythonpath else []), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(paths)}


def _parse(output: str) -> dict[int, tuple[str, str]]:
    return {int(step): (loss, norm) for step, loss, norm in STEP_LOSS.findall(output)}


def _losses(cmd: list[str]) -> dict[int, tuple[str, str]]:
    """A torchrun command's printed (loss, grad_norm) per step."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=_env())
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return _parse(output)


def _forked_losses(
    nproc: int, argv: list[str], log: pathlib.Path, pythonpath: pathlib.Path | None = None
) -> dict[int, tuple[str, str]]:  # fmt: skip
    """The same from ``nproc`` ranks forked from a process that imported torchtitan once
    (``scaffolding.forked_ranks``), where the launch is not the subject."""
    status = forked_ranks.run(nproc, argv, log, env=_env(pythonpath),
                              preload=forked_ranks.train_titan_preload())  # fmt: skip
    output = log.read_text()
    assert status == 0, output[-6000:]
    return _parse(output)


_RECIPES = '''
"""A user's recipe module: configs derived in Python from other configs, no flags."""
from acco_hooks.titan.config_registry import debug_cpu_acco, debug_cpu_titan_ddp
from acco_hooks.titan.v030 import with_acco


def shipped_config_changed():
    config = debug_cpu_acco()
    config.acco.mode = "dpu"
    config.training.steps = 4
    return config


def torchtitan_baseline_with_acco():
    config = with_acco(debug_cpu_titan_ddp(), mode="dpu")
    config.optimizer.implementation = "fused"  # as the ACCO configs
    config.training.global_batch_size, config.training.steps = 8, 4
    return config
'''


@pytest.mark.spmd_backends("spmd_types")  # the entry point, not the layout, is tested
def test_native_entry_point_and_recipe_modules_train_as_the_toml_command(tmp_path) -> None:
    """``--module acco_hooks.titan --config debug_cpu_acco`` with 0.3.0's overrides, the TOML
    with 0.2.2's, and a user's recipe module that derives the same run in Python (from the
    shipped ACCO config, and with :func:`with_acco` from torchtitan's DDP baseline config): the
    same run, loss and norm for loss and norm.
    """
    (tmp_path / "my_recipes.py").write_text(_RECIPES)
    native = _forked_losses(2, ["train_titan.py", "--module", "acco_hooks.titan",
                                "--config", "debug_cpu_acco", "--training.steps", "4",
                                "--acco.mode", "dpu", "--dump-folder", str(tmp_path / "native"),
                                "--metrics.disable-color-printing", *backend_overrides("-")],
                            tmp_path / "native.log")  # fmt: skip
    # the TOML command as a user types it, through torchrun
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2"]  # fmt: skip
    toml = _losses([*torchrun, "train_titan.py", "--job.config_file",
                    str(CONFIGS / "debug_cpu_acco.toml"), "--training.steps", "4",
                    "--acco.mode", "dpu", "--job.dump_folder", str(tmp_path / "toml"),
                    "--metrics.disable_color_printing", *backend_overrides()])  # fmt: skip
    assert sorted(native) == sorted(toml) == [1, 2, 3, 4]
    assert native == toml
    assert float(native[4][0]) < float(native[1][0])
    # torchtitan's default initial_load_model_only warns in every config it builds, and the CPU
    # shim's removed sleep would still be announced: neither reaches the user
    output = (tmp_path / "native.log").read_text()
    assert "Training completed" in output
    assert "has no effect without an initial_load_path" not in output, output[-3000:]
    assert "Sleeping 2 seconds" not in output, output[-3000:]
    for recipe in ("shipped_config_changed", "torchtitan_baseline_with_acco"):
        losses = _forked_losses(2, ["train_titan.py", "--module", "my_recipes", "--config",
                                    recipe, "--dump-folder", str(tmp_path / recipe),
                                    "--metrics.disable-color-printing", *backend_overrides("-")],
                                tmp_path / f"{recipe}.log", pythonpath=tmp_path)  # fmt: skip
        assert losses == native, recipe


def test_with_acco_refuses_what_is_not_an_acco_setting_and_leaves_its_input_alone() -> None:
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from acco_hooks.titan.v030 import ACCOTrainer, with_acco

    baseline = llama3_debugmodel()
    config = with_acco(baseline, mode="auto", accumulation_steps=4)
    assert isinstance(config, ACCOTrainer.Config) and not isinstance(baseline, ACCOTrainer.Config)
    assert (config.acco.enable, config.acco.mode, config.acco.accumulation_steps) == (True, "auto", 4)
    config.training.steps = 99
    assert baseline.training.steps != 99
    again = with_acco(config, mode="dpu")  # an ACCO config keeps its other acco settings
    assert (again.acco.mode, again.acco.accumulation_steps) == ("dpu", 4)
    with pytest.raises(ValueError, match=r"with_acco: mdoe is not an acco setting; the settings "
                       r"are .*mode"):
        with_acco(baseline, mdoe="acco")
    with pytest.raises(ValueError, match=r"\[acco\] mode = 'sync'"):
        with_acco(baseline, mode="sync")


@pytest.mark.spmd_backends("spmd_types")  # the type checking exists only there
def test_activation_checkpointing_and_compile_stay_torchtitans(tmp_path) -> None:
    """ACCO with torchtitan's full activation checkpointing and spmd_types' type checking
    (``debug.spmd_typechecking``; only effective under that backend) in one run, and with
    torch.compile of the model and loss in another: the same run as without them, to the
    printed digits."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2", "train_titan.py", "--job.config_file",
                str(CONFIGS / "debug_cpu_acco.toml"), "--training.steps", "4",
                "--training.seq_len", "64", "--training.local_batch_size", "2",
                "--metrics.disable_color_printing", *backend_overrides()]  # fmt: skip
    plain = _losses([*torchrun, "--job.dump_folder", str(tmp_path / "plain")])
    assert sorted(plain) == [1, 2, 3, 4]
    for name, flags in (("ac_typechecking", ["--activation_checkpoint.mode", "full",
                                             "--debug.spmd_typechecking"]),
                        ("compile", ["--compile.enable"])):  # fmt: skip
        assert _losses([*torchrun, *flags, "--job.dump_folder", str(tmp_path / name)]) == plain


_CONFIG_BUILD_SCRIPT = """
import sys
import torch
import scaffolding.cpu_shim  # this machine has no accelerator
from scaffolding import stdlib_data
from scaffolding.process_exit import finish
from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.tools.logging import init_logger
import acco_hooks.titan.config_registry as registry
init_logger()
stdlib_data.prepare_if_stdlib("stdlib", None, "outputs/stdlib/tokenizer")
config = registry.debug_cpu_hsdp_acco()
config.training.steps, config.training.seq_len, config.training.local_batch_size = 4, 64, 2
config.training.global_batch_size = 16  # 2 micro-batches per round on 4 ranks
config.metrics.disable_color_printing = True
config.dump_folder = sys.argv[2]
config.parallelism.spmd_backend = sys.argv[3]
if sys.argv[1] == "chunked":
    config.loss = ChunkedLossWrapper.Config(loss_fn=config.loss)
trainer = config.build()
trainer.train()
trainer.close()
del trainer
finish()
"""


@pytest.mark.spmd_backends("spmd_types")  # the loss wrapper's sync, not the layout
def test_chunked_loss_under_hsdp_acco_trains_as_plain_cross_entropy(spmd_backend, tmp_path) -> None:
    """torchtitan 0.3.0's ChunkedLossWrapper (the default loss of its llama3 configs) turns
    FSDP gradient sync on for the lm_head unit at every micro-batch, undoing ACCO's choice to
    reduce-scatter only at a round's last one: the engine takes the early gradients, and the
    run equals the plain cross-entropy one (2 replicas x 2 FSDP shards, config built in Python
    as a 0.3.0 user does)."""
    script = tmp_path / "run.py"
    script.write_text(_CONFIG_BUILD_SCRIPT)
    plain = _forked_losses(4, [str(script), "plain", str(tmp_path / "plain"), spmd_backend],
                           tmp_path / "plain.log")  # fmt: skip
    chunked = _forked_losses(4, [str(script), "chunked", str(tmp_path / "chunked"), spmd_backend],
                             tmp_path / "chunked.log")  # fmt: skip
    assert sorted(plain) == [1, 2, 3, 4]
    assert chunked == plain


def test_the_registry_serves_every_shipped_config() -> None:
    import acco_hooks.titan.config_registry as registry
    from acco_hooks.titan.v030 import ACCOTrainer

    names = sorted(p.stem for p in CONFIGS.glob("*.toml"))
    assert list(registry.CONFIG_NAMES) == names and set(names) <= set(dir(registry))
    config = registry.llama3_8b_hsdp_acco()
    assert isinstance(config, ACCOTrainer.Config) and config.acco.enable
    assert registry.llama3_8b_acco.__doc__.startswith("Llama 3 8B")
    with pytest.raises(AttributeError):
        registry.llama3_8b_nothing  # noqa: B018


@pytest.mark.spmd_backends("spmd_types")  # no run: backend-free
def test_a_debug_config_without_its_corpus_says_how_to_launch_it() -> None:
    """Outside the checkout's launcher nothing registers the embedded corpus with torchtitan."""
    code = ("import acco_hooks.titan.config_registry as r\n"
            "try:\n    r.debug_cpu_acco()\nexcept ValueError as e:\n    print(e)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "train_titan.py --module acco_hooks.titan --config debug_cpu_acco" in proc.stdout


def test_the_translation_keeps_every_setting_of_a_toml() -> None:
    config = load_toml_config(CONFIGS / "debug_cpu_hsdp_acco.toml",
                              ["--optimizer.lr", "1e-3", "--acco.mode=dpu",
                               "--checkpoint.no-enable", "--training.steps", "7",
                               "--checkpoint.exclude_from_loading", "lr_scheduler,dataloader",
                               "--parallelism.fsdp_reshard_after_forward", "never"])  # fmt: skip
    (group,) = config.optimizer.param_groups
    assert group.optimizer_name == "AdamW" and group.pattern == ".*"
    assert group.optimizer_kwargs == {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8,
                                      "weight_decay": 0.1}  # fmt: skip
    assert config.optimizer.implementation == "fused"
    assert (config.acco.mode, config.acco.enable) == ("dpu", True)
    assert config.training.steps == 7 and config.training.disable_cuda_graphs
    assert config.checkpoint.enable is False
    assert config.checkpoint.exclude_from_loading == ["lr_scheduler", "dataloader"]
    par = config.parallelism
    assert (par.data_parallel_replicate_degree, par.data_parallel_shard_degree) == (2, 2)
    assert par.spmd_backend == "spmd_types"  # torchtitan's default: no flag to set
    assert par.fsdp_reshard_after_forward == "never"
    assert config.dataloader.dataset == "stdlib" and config.activation_checkpoint is None
    assert (config.lr_scheduler.warmup_steps, config.lr_scheduler.decay_type) == (2, "cosine")


def test_a_key_without_a_030_meaning_is_refused_with_every_other_one(tmp_path) -> None:
    toml = tmp_path / "job.toml"
    toml.write_text((CONFIGS / "debug_cpu_acco.toml").read_text() + "\n[float8]\nenable = true\n")
    with pytest.raises(TomlConfigError) as error:
        load_toml_config(toml, ["--optimizer.early_step_in_backward", "--validation.seq_len",
                                "99", "--training.nonsense", "1"])  # fmt: skip
    message = str(error.value)
    for key in ("float8.enable", "optimizer.early_step_in_backward", "validation.seq_len",
                "training.nonsense"):  # fmt: skip
        assert key in message, message
    assert "pip install 'torchtitan==0.2.2'" in message


def test_fault_tolerance_is_acco_trainers_and_refused_without_acco() -> None:
    """ACCO's 0.3.0 trainer has ``experiments.torchft``'s section (tests/titan/test_torchft.py
    runs it); without [acco] the key belongs to torchtitan's own torchft trainer, which this
    launcher does not run: refused, naming it."""
    config = load_toml_config(CONFIGS / "debug_cpu_acco.toml",
                              ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2",
                               "--fault_tolerance.replica_id", "1"])  # fmt: skip
    assert (config.fault_tolerance.enable, config.fault_tolerance.group_size,
            config.fault_tolerance.replica_id) == (True, 2, 1)  # fmt: skip
    with pytest.raises(TomlConfigError) as error:
        load_toml_config(CONFIGS / "debug_cpu_acco.toml",
                         ["--acco.no-enable", "--fault_tolerance.enable"])  # fmt: skip
    message = str(error.value)
    assert "fault_tolerance.enable without [acco] enable" in message
    assert "experiments.torchft" in message


def test_a_bad_value_type_is_refused() -> None:
    with pytest.raises(TomlConfigError, match=r"--training.steps 'many': expected int"):
        load_toml_config(CONFIGS / "debug_cpu_acco.toml", ["--training.steps", "many"])
    with pytest.raises(TomlConfigError, match=r"selective_ac_option = '2'"):
        load_toml_config(CONFIGS / "debug_cpu_acco.toml",
                         ["--activation_checkpoint.mode", "selective"])  # fmt: skip


@pytest.mark.spmd_backends("spmd_types")  # refused before any layout is built
def test_train_titan_refuses_a_meaningless_key_before_any_step(tmp_path) -> None:
    cmd = [sys.executable, "train_titan.py", "--job.config_file",
           str(CONFIGS / "debug_cpu_acco.toml"), "--job.dump_folder", str(tmp_path),
           "--optimizer.early_step_in_backward"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "WORLD_SIZE": "2"})  # fmt: skip
    assert proc.returncode != 0
    assert "optimizer.early_step_in_backward: 0.3.0 has no early step in backward" in proc.stderr
    assert "step:" not in proc.stdout + proc.stderr


def test_acco_runs_on_spmd_types_and_partial_dtensor_and_refuses_full_dtensor() -> None:
    from acco_hooks.titan.v030 import validate_acco_config

    config = load_toml_config(CONFIGS / "debug_cpu_acco.toml")
    for backend in ("spmd_types", "partial_dtensor"):
        config.parallelism.spmd_backend = backend
        validate_acco_config(config, world_size=2)
    config.parallelism.spmd_backend = "full_dtensor"
    with pytest.raises(ValueError, match=r"parallelism.spmd_backend = 'full_dtensor'.*"
                       r"set --parallelism.spmd-backend spmd_types"):
        validate_acco_config(config, world_size=2)


def test_acco_takes_param_groups_each_with_its_optimizer_and_refuses_what_it_cannot() -> None:
    """Several groups, each its class (Muon by torchtitan's name DistMuon, or Muon, for the
    matrices; Adam or AdamW for the rest), ending with the catch-all; Muon beside FSDP or tensor
    parallelism (each matrix brought together on its owner). Beside both at once (FSDP over
    TP-split matrices), an optimizer torchtitan or the engine does not have, and groups that
    leave parameters out: refused by name before anything is built."""
    from torchtitan.components.optimizer import ParamGroupConfig

    from acco_hooks.titan.v030 import validate_acco_config

    config = load_toml_config(CONFIGS / "debug_cpu_acco.toml")
    (rest,) = config.optimizer.param_groups
    for name in ("DistMuon", "Muon"):
        config.optimizer.param_groups = [ParamGroupConfig(pattern=MATRICES, optimizer_name=name,
                                                          optimizer_kwargs=MUON), rest]  # fmt: skip
        validate_acco_config(config, world_size=2)
    config.optimizer.param_groups = [ParamGroupConfig(pattern=r"\.bias$", optimizer_name="Adam"),
                                     rest]  # fmt: skip
    validate_acco_config(config, world_size=2)
    config.optimizer.param_groups = [ParamGroupConfig(pattern=r"\.bias$", optimizer_name="Lion"),
                                     rest]  # fmt: skip
    with pytest.raises(ValueError, match=r"\['Lion', 'AdamW'\].*each stepped by one of "
                                         r"\['Adam', 'AdamW', 'DistMuon', 'Muon'\]"):
        validate_acco_config(config, world_size=2)
    config.optimizer.param_groups = [ParamGroupConfig(pattern=MATRICES, optimizer_name="DistMuon",
                                                      optimizer_kwargs=MUON), rest]  # fmt: skip
    config.parallelism.data_parallel_shard_degree = 2
    config.training.global_batch_size = 16  # 2 replicas of 2 FSDP ranks: each matrix brought
    validate_acco_config(config, world_size=4)  # together on its owner (whole_pieces)
    config.parallelism.tensor_parallel_degree = 2  # and over the TP ranks of a replica
    with pytest.raises(ValueError, match=r"DistMuon steps each matrix whole on the rank that owns "
                                         r"it, which the ACCO engine does not run beside "
                                         r"data_parallel_shard_degree = 2 with "
                                         r"tensor_parallel_degree = 2 \(FSDP over tensor-parallel"):
        validate_acco_config(config, world_size=8)
    config.parallelism.data_parallel_shard_degree = 1
    config.training.global_batch_size = 8
    validate_acco_config(config, world_size=4)  # TP alone: brought together over its ranks
    config.parallelism.tensor_parallel_degree = 1
    rest.pattern = r"layers\."
    config.optimizer.param_groups = [rest]
    with pytest.raises(ValueError, match=r"end the groups with the catch-all pattern '\.\*'"):
        validate_acco_config(config, world_size=2)


# The shipped Muon recipe module (examples/titan_muon_recipe.py: Muon on the transformer blocks'
# matrices, AdamW on the rest) as the tests run it. torch's Newton–Schulz runs in bfloat16, which
# a CPU without AVX-512 computes ~16x slower than float32: its 5 iterations were most of every
# Muon test's time. One iteration steps each matrix whole on its owner all the same, which is
# what the engine does and these tests hold; both sides of every comparison run it.
_MUON_RECIPE = '''
"""The shipped Muon recipe's configs, resized for the tests."""
from acco_hooks.titan.config_registry import debug_cpu_ddp
from examples import titan_muon_recipe as shipped


def _one_newton_schulz_step(config):
    for group in config.optimizer.param_groups:
        if group.optimizer_name in ("DistMuon", "Muon"):
            group.optimizer_kwargs = {**group.optimizer_kwargs, "ns_steps": 1}
    return config


def debug_cpu_acco_muon():
    return _one_newton_schulz_step(shipped.debug_cpu_acco_muon())


def debug_cpu_ddp_muon():
    return _one_newton_schulz_step(shipped.debug_cpu_ddp_muon())


def debug_cpu_titan_ddp_muon():
    return _one_newton_schulz_step(shipped.debug_cpu_titan_ddp_muon())


def debug_cpu_acco_muon_checkpointed():  # saved whole every 3 steps, on any number of replicas
    config = debug_cpu_acco_muon()
    config.training.steps = 6
    config.parallelism.data_parallel_replicate_degree = -1
    checkpoint = config.checkpoint
    checkpoint.enable, checkpoint.interval, checkpoint.keep_latest_k = True, 3, 0
    checkpoint.last_save_model_only = False
    return config


def debug_cpu_ddp_adamw():  # the shipped recipe, AdamW on every parameter
    return debug_cpu_ddp()
'''


def _recipe_losses(tmp_path: pathlib.Path, nproc: int, config: str,
                   extra: Sequence[str] = ()) -> tuple[dict[int, tuple[str, str]], str]:  # fmt: skip
    """4 steps of the tests' Muon recipe's ``config`` on ``nproc`` ranks (``extra``: more
    overrides): the losses and norms per step, and the log."""
    (tmp_path / "muon_recipe.py").write_text(_MUON_RECIPE)
    log = tmp_path / f"{config}.log"
    losses = _forked_losses(nproc, ["train_titan.py", "--module", "muon_recipe", "--config", config,
                                    "--training.steps", "4", "--dump-folder",
                                    str(tmp_path / config), "--metrics.disable-color-printing",
                                    *extra, *backend_overrides("-")], log,
                            pythonpath=tmp_path)  # fmt: skip
    return losses, log.read_text()


@pytest.mark.spmd_backends("spmd_types")  # the optimizer's groups, not the layout
def test_the_muon_recipe_steps_as_torchtitans_own_ddp_with_torchs_muon(tmp_path) -> None:
    """The debug model with DistMuon on its 42 matrices and AdamW on the rest, under [acco]:
    the engine runs torch's Muon on whole matrices, each on the replica that owns it. In ``ddp``
    mode on 2 replicas it prints the losses of torchtitan's own DDP trainer stepping torch's
    Muon and AdamW over the same groups; ``acco`` trains."""
    def run(config: str) -> tuple[dict, str]:
        return _recipe_losses(tmp_path, 2, config)

    ours, output = run("debug_cpu_ddp_muon")
    assert "Muon+AdamW" in output and "whole parameters in 1 group(s)" in output
    theirs, _ = run("debug_cpu_titan_ddp_muon")
    assert sorted(ours) == sorted(theirs) == [1, 2, 3, 4]
    assert ours[1][0] == theirs[1][0]  # same initial weights and data
    # Newton-Schulz in bfloat16 amplifies the float rounding of another order of sums: measured
    # up to 5e-5 with one iteration (1.4e-4 with torch's 5 on CI's machine); AdamW instead of
    # Muon moves step 4 by 4.4e-2 with one iteration (0.37 with 5)
    for step in (2, 3, 4):
        assert float(ours[step][0]) == pytest.approx(float(theirs[step][0]), abs=1e-3), step
    for step in ours:  # the engine sums the squared norm in float64
        assert float(ours[step][1]) == pytest.approx(float(theirs[step][1]), rel=1e-3), step
    adamw, _ = run("debug_cpu_ddp_adamw")  # the comparison can fail: Muon changes the run
    assert abs(float(adamw[4][0]) - float(ours[4][0])) > 1e-2
    acco, _ = run("debug_cpu_acco_muon")
    assert float(acco[4][0]) < float(acco[1][0])


# 2 replicas of several ranks: (ranks, overrides)
_TP, _PP = (("--parallelism.tensor_parallel_degree", "2"),
            ("--parallelism.pipeline_parallel_degree", "2",
             "--parallelism.pipeline_parallel_microbatch_size", "1"))  # fmt: skip
# TP and PP alone (measured at steps 2-4 against torchtitan's own with torch's 5 Newton-Schulz
# iterations: 1e-5 to 6e-5 and 0 to 1e-4) are each a part of 3-D, which holds both in 8
# processes; the engine's TP numerics against the spec: tests/engine/test_tensor_parallel.py
_SPLIT_REPLICAS = {
    "hsdp": (4, ("--parallelism.data_parallel_shard_degree", "2")),
    "3d": (8, (*_TP, *_PP, "--training.global_batch_size", "8")),  # 4 micro-batches a stage
}


@pytest.mark.spmd_backends("spmd_types")  # the optimizer's groups, not the layout
@pytest.mark.parametrize("layout", sorted(_SPLIT_REPLICAS))
def test_the_muon_recipe_on_replicas_of_several_ranks_steps_as_torchtitans_own(
    tmp_path, layout
) -> None:  # fmt: skip
    """2 replicas of several ranks: FSDP (2 replicas × 2 shards, data_parallel_shard_degree = 2)
    and, in 3-D (2 replicas × 2 TP ranks × 2 pipeline stages), tensor parallelism (each matrix
    split by rows or columns) leave no rank a whole matrix: the engine brings each one's pieces
    together on the rank of the replicas × pieces grid that owns it, steps it with torch's Muon
    there and sends the pieces back; each pipeline stage's engine steps its own matrices. In
    ``ddp`` mode it prints the losses and gradient norms of torchtitan's own trainer stepping
    torch's Muon on the same layout (there DTensor runs Newton–Schulz's products on the split
    matrices, with their collectives: the whole matrix, in another order of bfloat16 sums)."""
    nproc, split = _SPLIT_REPLICAS[layout]
    extra = ["--parallelism.data_parallel_replicate_degree", "2", *split]
    ours, output = _recipe_losses(tmp_path, nproc, "debug_cpu_ddp_muon", extra=extra)
    if layout == "hsdp":  # under PP the log is the last stage's, not rank 0's report
        assert "whole parameters in 1 group(s)" in output and "fsdp_world_size=2" in output
    theirs, _ = _recipe_losses(tmp_path, nproc, "debug_cpu_titan_ddp_muon", extra=extra)
    assert sorted(ours) == sorted(theirs) == [1, 2, 3, 4]
    assert ours[1] == theirs[1]  # same initial weights and data
    # measured at steps 2-4 with one Newton-Schulz iteration: HSDP 1e-5, 6e-5, 1.6e-4; 3-D 2e-5,
    # 7e-5, 1.7e-4 (with torch's 5: HSDP up to 3.9e-4, 3-D 3.1e-4; Newton–Schulz in bfloat16,
    # summed in another order, amplifies float rounding); AdamW instead of Muon moves step 4 of
    # the 2-replica run by 4.4e-2
    for step in (2, 3, 4):
        assert float(ours[step][0]) == pytest.approx(float(theirs[step][0]), abs=1e-3), step
        assert float(ours[step][1]) == pytest.approx(float(theirs[step][1]), rel=1e-3), step


# Each case on one backend: the Muon state is the engine's, saved by name; what the backends
# change (how FSDP spans replicas, the model's saved layout) both AdamW resumes cover
# (tests/titan/test_trainer.py)
@pytest.mark.parametrize("tp", [
    pytest.param(1, id="replicas", marks=pytest.mark.spmd_backends("spmd_types")),
    pytest.param(2, id="replicas_of_2_tp_ranks", marks=pytest.mark.spmd_backends("partial_dtensor")),
])  # fmt: skip
def test_the_muon_recipe_resumes_exactly_and_on_another_number_of_replicas(tmp_path, tp) -> None:
    """acco with Muon on 2 replicas, saved by torchtitan's checkpointer at step 3 (an estimate
    in flight, its ΣG̃ carried, each matrix's momentum on the rank that owns it): resumed on
    2 replicas, steps 4-6 print the straight run's losses and norms; resumed on 1 replica (the
    same global batch in 2 micro-batches a round), the one replica takes every matrix and its
    momentum, and the loss goes on from where it was (the data loader re-derives its position:
    other samples, so near the straight run, not equal to it). With ``tp`` = 2 each replica is
    2 tensor-parallel ranks: the matrices' pieces saved as the TP ranks hold them, each
    matrix's momentum whole by its name, read by whichever rank of the grid owns it then
    (resumed on one replica, it trains on)."""
    (tmp_path / "muon_recipe.py").write_text(_MUON_RECIPE)
    dump = tmp_path / "run"

    def run(replicas: int, name: str) -> dict[int, tuple[str, str]]:
        return _forked_losses(replicas * tp, ["train_titan.py", "--module", "muon_recipe",
                                              "--config", "debug_cpu_acco_muon_checkpointed",
                                              "--dump-folder", str(dump),
                                              "--metrics.disable-color-printing",
                                              "--parallelism.tensor_parallel_degree", str(tp),
                                              *backend_overrides("-")],
                              tmp_path / f"{name}.log", pythonpath=tmp_path)  # fmt: skip

    straight = run(2, "straight")
    assert sorted(straight) == [1, 2, 3, 4, 5, 6]
    last = dump / "checkpoint" / "step-6" / ".metadata"  # DCP writes it last: a crash mid-save
    last.unlink()
    resumed = run(2, "resumed")
    assert {step: loss for step, (loss, _) in resumed.items()} == {
        step: straight[step][0] for step in (4, 5, 6)}
    # the first step after a load has no norm to print yet (-1): the ones after are the same
    assert [resumed[step][1] for step in (5, 6)] == [straight[step][1] for step in (5, 6)]
    last.unlink()
    on_one = run(1, "on_one")
    assert sorted(on_one) == [4, 5, 6]
    if tp == 2:
        # Under TP six steps move the loss too little to tell a resumed state from a lost one
        # (measured: 8.14, 8.08, 8.14 for steps 1-3, 8.10, 7.98, 8.05 resumed on one replica):
        # tests/engine/test_resharding.py::test_tensor_parallel_matrices_resume_on_other_replicas
        # holds this resharding (each matrix brought together from its TP pieces, its
        # momentum read by name on the new owner) to the straight run to 1e-5
        assert all(math.isfinite(float(loss)) for loss, _ in on_one.values()), on_one
        return
    # A run that lost its state would start again from the first steps' losses (8.16, 8.20,
    # 8.15 for steps 1-3): three steps in, it would not be below 8.01; this one is near where
    # the straight run is at steps 4-6 (measured: 8.09, 8.00, 7.98 against 8.12, 7.97, 8.03),
    # on other samples
    assert float(on_one[6][0]) < float(straight[1][0]) - 0.15, (straight, on_one)
    after = [float(on_one[step][0]) for step in on_one]
    straight_after = [float(straight[step][0]) for step in on_one]
    assert abs(sum(after) - sum(straight_after)) / len(after) < 0.05, (straight, on_one)


@pytest.mark.spmd_backends("spmd_types")  # a refusal before any tensor is read
def test_a_checkpoint_of_the_muon_recipe_is_refused_by_the_adamw_one_in_one_line(tmp_path) -> None:
    """The Muon recipe's checkpoint, resumed by the shipped AdamW config in the same dump folder,
    through torchrun as a user runs it: one line, from rank 0, that names the groups each run
    has (not a tensor or pipeline parallel layout, which are the same), with the flags spelled
    as --module takes them; no traceback of it, no step."""
    (tmp_path / "muon_recipe.py").write_text(_MUON_RECIPE)
    dump = tmp_path / "run"
    _forked_losses(2, ["train_titan.py", "--module", "muon_recipe", "--config",
                       "debug_cpu_acco_muon_checkpointed", "--training.steps", "3",
                       "--dump-folder", str(dump), *backend_overrides("-")],
                   tmp_path / "muon.log", pythonpath=tmp_path)  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "train_titan.py", "--module", "acco_hooks.titan", "--config", "debug_cpu_acco",
           "--training.steps", "4", "--checkpoint.enable", "--dump-folder", str(dump),
           *backend_overrides("-")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env())
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    refusal = [line for line in output.splitlines() if "was saved with" in line]
    assert len(refusal) == 1 and refusal[0].startswith("train_titan: ACCO: "), output[-4000:]
    assert re.search(r"saved with other parameter groups than this run's: its engine state "
                     r"holds the groups beginning with layers\..*, tok_embeddings\.weight .*this "
                     r"run's begin with tok_embeddings\.weight \(6,163,712 elements\)", refusal[0])
    assert "--checkpoint.initial-load-path" in refusal[0] and "--dump-folder" in refusal[0]
    assert "CheckpointRefusal" not in output and "step:" not in output, output[-4000:]


@pytest.mark.spmd_backends("spmd_types")  # the command line, not the layout
def test_a_refusal_spells_each_flag_as_the_command_it_refuses_takes_it(monkeypatch) -> None:
    """What a refusal tells the user to pass: the TOML's ``--section.option`` with a TOML
    config, 0.3.0's own field under ``--module``; each spelling is one torchtitan's parser
    takes there (tyro refuses ``--job.dump_folder`` under ``--module``)."""
    from torchtitan.config import ConfigManager

    from acco_hooks.titan import flag
    from scaffolding import stdlib_data

    keys = {"job.dump_folder": "/tmp/x", "training.dataset_path": "/tmp/x",
            "checkpoint.load_step": "3", "checkpoint.initial_load_path": "/tmp/x",
            "checkpoint.initial_load_model_only": None}  # fmt: skip
    assert [flag(key) for key in keys] == [f"--{key}" for key in keys]
    entry = ["train_titan.py", "--module", "acco_hooks.titan", "--config", "debug_cpu_acco"]
    monkeypatch.setattr(sys, "argv", entry)
    spelled = [flag(key) for key in keys]
    assert spelled == ["--dump-folder", "--dataloader.dataset-path", "--checkpoint.load-step",
                       "--checkpoint.initial-load-path",
                       "--checkpoint.initial-load-model-only"]  # fmt: skip
    stdlib_data.register_stdlib_datasets()
    for spelling, value in zip(spelled, keys.values()):
        ConfigManager().parse_args([*entry[1:], spelling, *([value] if value else [])])
    with pytest.raises(SystemExit):  # what the refusals said before
        ConfigManager().parse_args([*entry[1:], "--job.dump_folder", "/tmp/x"])


def _document_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """Independent reference: token q sees token k iff k <= q in the same packed document
    (a document starts where positions restart at 0)."""
    document = (positions == 0).cumsum(dim=1)  # (B, L)
    q = torch.arange(positions.shape[1])
    causal = q[None, :] <= q[:, None]  # [q, k]
    same = document[:, :, None] == document[:, None, :]
    return (causal[None] & same)[:, None]  # (B, 1, L, L)


def test_cpu_attention_equals_flex_attention_and_a_float64_reference() -> None:
    """The shim's attention (SDPA over the block mask's mask_mod) against eager FlexAttention
    (forward: torch has no CPU backward for it) and float64 math with an independent mask."""
    from torch.nn.attention.flex_attention import AuxRequest, and_masks, flex_attention
    from torchtitan.models.common.attention import (
        create_attention_mask,
        get_causal_mask_mod,
        get_efficient_causal_mask_mod_for_packed_document,
    )

    import scaffolding.cpu_shim as shim

    torch.manual_seed(0)
    batch, heads, length, dim = 2, 4, 64, 16
    positions = torch.cat([torch.arange(40), torch.arange(24)]).repeat(batch, 1)
    positions[1] = torch.cat([torch.arange(10), torch.arange(54)])
    block_mask = create_attention_mask(
        and_masks(get_causal_mask_mod(),
                  get_efficient_causal_mask_mod_for_packed_document(positions)),
        batch, None, length, length, device="cpu",
    )  # fmt: skip
    q, k, v = (torch.randn(batch, heads, length, dim, requires_grad=True) for _ in range(3))
    out, aux = shim.dense_mask_attention(
        q, k, v, score_mod=None, block_mask=block_mask, scale=None, enable_gqa=False,
        return_aux=AuxRequest(), kernel_options={},
    )  # fmt: skip
    assert aux.lse is None
    flex = flex_attention(q.detach(), k.detach(), v.detach(), block_mask=block_mask)
    torch.testing.assert_close(out.detach(), flex, atol=2e-6, rtol=1e-5)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = (q64 @ k64.transpose(-1, -2)) / dim**0.5
    scores = scores.masked_fill(~_document_causal_mask(positions), float("-inf"))
    reference = scores.softmax(-1) @ v64
    torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(out)
    out.backward(grad)
    reference.backward(grad.double())
    for ours, ref in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        torch.testing.assert_close(ours.double(), ref, atol=1e-5, rtol=1e-4)


def test_cpu_attention_refuses_what_it_cannot_compute() -> None:
    from torch.nn.attention.flex_attention import AuxRequest

    import scaffolding.cpu_shim as shim

    q = torch.zeros(1, 1, 4, 8)
    with pytest.raises(NotImplementedError, match="mask_mod only"):
        shim.dense_mask_attention(q, q, q, score_mod=lambda s, *_: s, block_mask=None,
                                  scale=None, enable_gqa=False, return_aux=AuxRequest(),
                                  kernel_options={})  # fmt: skip
