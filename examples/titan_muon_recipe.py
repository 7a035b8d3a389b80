"""A torchtitan 0.3.0 recipe module: the debug model with Muon on its matrices, under ACCO.

    python3 -m torch.distributed.run --standalone --nproc_per_node 2 train_titan.py \\
        --module examples.titan_muon_recipe --config debug_cpu_acco_muon

Muon steps the 42 matrices of the transformer blocks (``DistMuon`` by torchtitan's name; the
engine runs ``torch.optim.Muon`` on whole matrices, each on the replica that owns it) and the
shipped config's AdamW the embeddings, the output projection and the norms, as torchtitan's
Kimi recipe writes it. Run from the checkout's root, with ``ACCO_TITAN=0.3.0`` installed.

Sized for a CPU: 8 steps. torch's Newton–Schulz runs in bfloat16, which a CPU without AVX-512
computes about 100 times slower than one with it (docs/torchtitan.md, "Parameter groups and
Muon", gives the times). Each config writes its own dump folder, ``outputs/<config>``.

``debug_cpu_ddp_muon`` is the same run in the engine's ``ddp`` mode, and
``debug_cpu_titan_ddp_muon`` torchtitan's own DDP trainer stepping torch's Muon and AdamW over
the same groups: the two print the same losses (``tests/titan/test_titan_030.py`` compares
them), which is how the engine's Muon is held to torchtitan's.
"""

from __future__ import annotations

from typing import Any

import torch
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

from acco_hooks.titan.config_registry import debug_cpu_acco, debug_cpu_ddp, debug_cpu_titan_ddp

# The transformer blocks' matrices; everything else stays in the shipped config's AdamW group
MATRICES = r"layers\.\d+\.(attention\.w[qkvo]|feed_forward\.w[123])\.weight$"
MUON = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
STEPS = 8


def with_muon(config: Any, optimizer_name: str, name: str) -> Any:
    """``config`` with Muon (``optimizer_name``) on :data:`MATRICES`, :data:`STEPS` steps, and
    the dump folder ``outputs/<name>``."""
    (adamw,) = config.optimizer.param_groups  # embeddings, output, norms
    config.optimizer.param_groups = [
        ParamGroupConfig(pattern=MATRICES, optimizer_name=optimizer_name,
                         optimizer_kwargs=dict(MUON)),
        adamw,
    ]  # fmt: skip
    config.training.steps = STEPS
    config.dump_folder = f"./outputs/{name}"
    return config


def debug_cpu_acco_muon() -> Any:
    """ACCO with Muon on the matrices, 2 CPU replicas."""
    return with_muon(debug_cpu_acco(), "DistMuon", "debug_cpu_acco_muon")


def debug_cpu_ddp_muon() -> Any:
    """The engine's ddp mode (synchronous ZeRO-1) with Muon on the matrices, 2 CPU replicas."""
    return with_muon(debug_cpu_ddp(), "DistMuon", "debug_cpu_ddp_muon")


def debug_cpu_titan_ddp_muon() -> Any:
    """torchtitan's own DDP trainer stepping torch's Muon and AdamW over the same groups: the
    reference the engine's ``ddp`` mode prints the losses of.

    torchtitan's optimizer resolver knows ``DistMuon``, whose FlexShard layout does not run on a
    CPU, and not ``torch.optim.Muon``: this config teaches it ``"Muon"`` (the one change to
    torchtitan this module makes, when the config is built)."""
    resolve = OptimizersContainer._resolve_optimizer_factory
    if not getattr(resolve, "knows_torch_muon", False):

        def resolve_with_torch_muon(name: str) -> Any:
            return torch.optim.Muon if name == "Muon" else resolve(name)

        resolve_with_torch_muon.knows_torch_muon = True
        OptimizersContainer._resolve_optimizer_factory = staticmethod(resolve_with_torch_muon)
    return with_muon(debug_cpu_titan_ddp(), "Muon", "debug_cpu_titan_ddp_muon")
