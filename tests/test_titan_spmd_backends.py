"""torchtitan 0.3.0's two backends train ACCO identically.

``tests/titan/`` runs every torchtitan test once per ``parallelism.spmd_backend``, each against
its own references (torchtitan's DDP and HSDP, pure data parallelism). This compares the
backends with each other: the same HSDP run (2 replicas x 2 FSDP shards, from one seed
checkpoint) on ``spmd_types``, where FSDP is applied as HSDP and stopped after its
reduce-scatter, and on ``partial_dtensor``, where FSDP never sees the replicas. A gradient
reduced across replicas twice, or not at all, shows in the losses and the gradient norms.
"""

from __future__ import annotations

import pytest

from acco_hooks.titan import TITAN_030

if not TITAN_030:
    pytest.skip("torchtitan 0.3.0 only: 0.2.2 has no spmd_backend", allow_module_level=True)

from tests.titan.test_trainer import HSDP, assert_same_run, run_titan, seed_checkpoint  # noqa: E402, F401

pytestmark = pytest.mark.titan


def test_hsdp_acco_is_the_same_run_on_both_backends(seed_checkpoint, tmp_path) -> None:  # noqa: F811
    common = (*HSDP, "--training.steps", "6", "--checkpoint.load_only",
              "--checkpoint.initial_load_path", str(seed_checkpoint))  # fmt: skip
    losses, norms = {}, {}
    for backend in ("spmd_types", "partial_dtensor"):
        norms[backend] = {}
        losses[backend] = run_titan(4, "debug_cpu_hsdp_acco.toml", *common,
                                    "--parallelism.spmd_backend", backend,
                                    dump=tmp_path / backend, grad_norms=norms[backend])  # fmt: skip
    assert sorted(losses["spmd_types"]) == sorted(losses["partial_dtensor"]) == list(range(1, 7))
    assert_same_run(losses["spmd_types"], norms["spmd_types"], losses["partial_dtensor"],
                    norms["partial_dtensor"])  # fmt: skip
    assert float(losses["spmd_types"][6]) < float(losses["spmd_types"][1]) - 0.1
