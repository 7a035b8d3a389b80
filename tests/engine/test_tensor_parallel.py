"""Whole-parameter optimizers under tensor parallelism: Muon on matrices that no rank holds whole.

Four gloo processes on a (replicate=2, tp=2) mesh, the engine built as torchtitan builds it.
SplitNet's four matrices are split by rows or by columns over a replica's two TP ranks (7 of
them unevenly, 4 + 3); Newton–Schulz of a piece is not Newton–Schulz of the matrix, so each
matrix is brought together on one rank of the 2 × 2 grid, stepped whole there and sent back
(``acco_hooks.engine.whole_pieces``). Each replica is one worker of the reference: ``ddp`` must
equal torch's Muon and AdamW on the full matrices over the same micro-batches, ``dpu`` and
``acco`` the spec's recursion with them.

SplitNet's gradients lie on a grid (float32 sums exact in any order). What the grid cannot make
exact is the forward: a row-wise layer's output is its TP ranks' partial products summed, an
ulp away from one process's matrix product, so now and then a gradient element rounds to the
neighbouring grid point, and Muon's bfloat16 Newton–Schulz turns that into ~3e-4 on one
matrix (measured: acco and ddp equal to 1e-8 and 8e-7, matrices bit for bit; dpu 7.3e-4
relative, from one such element at its third round; with AdamW everywhere, all four within
5e-7). The bound, 1e-3, is that; a matrix stepped as its pieces (Newton–Schulz of each) or
not at all would be off by the step itself.
"""

from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed
from tests.scenario import Config, make_model, reference_run, relative_error

WORLD, REPLICAS = 4, 2

RUNS = [
    Config(mode=mode, world_size=REPLICAS, rounds=rounds, micro=[2] * REPLICAS, optimizer="muon",
           model="split", **extra)
    for mode, rounds, extra in (("acco", 6, {}), ("dpu", 5, {}), ("ddp", 4, {}),
                                ("acco", 6, dict(max_grad_norm=0.05)))
]  # fmt: skip


@pytest.fixture(scope="module")
def tp_results():
    return run_distributed("tests.engine.hsdp_workers:tensor_parallel_runs", WORLD, RUNS, REPLICAS)


@pytest.mark.parametrize("index", range(len(RUNS)), ids=[f"{c.mode}-{i}" for i, c in enumerate(RUNS)])
def test_muon_on_tensor_parallel_matrices_equals_the_reference(tp_results, index) -> None:
    """Each matrix's TP pieces (rows of a column-wise layer, columns of a row-wise one) brought
    to its owner, stepped whole by torch's Muon, sent back; clipping by the norm over the
    pieces, the scheduler once per real update."""
    cfg = RUNS[index]
    ref = reference_run(cfg)
    initial = {n: p.detach() for n, p in make_model(model="split").named_parameters()}
    assert relative_error(initial, ref["params"]) > 50 * 1e-3  # what the training moved
    for rank, results in enumerate(tp_results):
        out = results[index]
        error = relative_error(out["params"], ref["params"])
        assert error <= 1e-3, (rank, error)
        assert out["num_updates"] == (cfg.rounds // 2 if cfg.mode == "acco" else cfg.rounds)
    # the four matrices, one on each rank of the 2 × 2 grid, held whole there
    owned = [results[index]["owned_whole"] for results in tp_results]
    assert sorted(name for names in owned for name in names) == [
        f"layers.{i}.weight" for i in range(4)], owned
    assert all(len(names) == 1 for names in owned), owned
    for results in tp_results:
        assert results[index]["memory"]["whole_on_owner"] > 0
