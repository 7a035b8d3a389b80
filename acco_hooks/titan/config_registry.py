"""Config functions for torchtitan 0.3.0: ``-m torchtitan.train --module acco_hooks.titan
--config <name>``, one per TOML the project ships (``torchtitan_configs/<name>.toml``).

Each function translates its TOML with :mod:`acco_hooks.titan.toml_compat`, so the TOML stays
the one source of truth and both torchtitan releases train the same job. ACCO configs return
an ``ACCOTrainer.Config`` (``--acco.mode dpu`` etc. on the command line), the baselines a plain
``Trainer.Config``. Other overrides take 0.3.0's spelling (``--training.steps 4``,
``--dataloader.dataset stdlib``); the optimizer's hyperparameters live in its parameter group
and are set in the TOML.

Importing this module on a machine without an accelerator installs
:mod:`acco_hooks.titan.cpu_shim` (torchtitan imports it before building the trainer) and
registers the embedded ``stdlib`` datasets.
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch

from acco_hooks.titan import require_release

require_release("0.3.0", __name__)  # torchtitan 0.2.2: train_titan.py --job.config_file X.toml
if not torch.cuda.is_available():
    import acco_hooks.titan.cpu_shim  # noqa: F401, E402

from acco_hooks.titan import stdlib_data  # noqa: E402
from acco_hooks.titan.toml_compat import load_toml_config, read_toml  # noqa: E402

__all__ = ["CONFIG_DIR", "debug_cpu_acco", "debug_cpu_ddp", "debug_cpu_dpu",
           "debug_cpu_hsdp_acco", "debug_cpu_titan_ddp", "debug_cpu_titan_fsdp",
           "llama3_8b_acco", "llama3_8b_acco_3d", "llama3_8b_hsdp_acco", "llama3_8b_zero1",
           "llama3_8b_zero1_3d"]  # fmt: skip

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "torchtitan_configs"
"""The project's TOMLs (a checkout's ``torchtitan_configs/``)."""


def _from_toml(name: str) -> Any:
    path = CONFIG_DIR / f"{name}.toml"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: the acco_hooks.titan configs are the TOMLs of a checkout of "
            "the project; install it from one (pip install -e .)"
        )
    settings = read_toml(path)
    stdlib_data.prepare_if_stdlib(settings.get("training.dataset"),
                                  settings.get("training.dataset_path"),
                                  settings["model.hf_assets_path"])  # fmt: skip
    return load_toml_config(path)


def debug_cpu_acco() -> Any:
    """ACCO, 2 CPU ranks: the README's main job."""
    return _from_toml("debug_cpu_acco")


def debug_cpu_dpu() -> Any:
    """DPU (delayed update, no estimate), 2 CPU ranks."""
    return _from_toml("debug_cpu_dpu")


def debug_cpu_ddp() -> Any:
    """The engine's synchronous ZeRO-1 (``acco.mode = "ddp"``), 2 CPU ranks."""
    return _from_toml("debug_cpu_ddp")


def debug_cpu_hsdp_acco() -> Any:
    """HSDP + ACCO, 4 CPU ranks: 2 replicas x 2 FSDP shards."""
    return _from_toml("debug_cpu_hsdp_acco")


def debug_cpu_titan_ddp() -> Any:
    """torchtitan's own data parallelism over 2 replicas (in 0.3.0: FSDP2 with a replicate
    dimension and 1-rank shards), the baseline."""
    return _from_toml("debug_cpu_titan_ddp")


def debug_cpu_titan_fsdp() -> Any:
    """torchtitan's own FSDP2 over 2 CPU ranks, the baseline."""
    return _from_toml("debug_cpu_titan_fsdp")


def llama3_8b_acco() -> Any:
    """Llama 3 8B, ACCO over every GPU."""
    return _from_toml("llama3_8b_acco")


def llama3_8b_acco_3d() -> Any:
    """Llama 3 8B, TP x PP inside a node, ACCO across nodes."""
    return _from_toml("llama3_8b_acco_3d")


def llama3_8b_hsdp_acco() -> Any:
    """Llama 3 8B, FSDP2 over 8 GPUs per node x ACCO across nodes (HSDP)."""
    return _from_toml("llama3_8b_hsdp_acco")


def llama3_8b_zero1() -> Any:
    """Llama 3 8B, the engine's synchronous ZeRO-1 baseline."""
    return _from_toml("llama3_8b_zero1")


def llama3_8b_zero1_3d() -> Any:
    """Llama 3 8B, TP x PP x the engine's synchronous ZeRO-1 baseline."""
    return _from_toml("llama3_8b_zero1_3d")
