"""HSDP: FSDP2 shards each replica, ACCO runs across replicas (``ACCOHSDPOptimizer``).

Four gloo processes on a (replicate=2, shard=2) mesh. Each rank runs the micro-batches of one
worker of the scenario, so the averaged gradient of a round is that of pure data parallelism
over four workers: the HSDP run must equal the independent reference with ``world_size=4``.
That fails if FSDP's cross-replica all-reduce still ran (gradients twice too large), if the
weights were counted over the replicas only, or if clipping counted the replicate dimension.

Replicas of unequal speed under ``accumulate_until_ready``: split by FSDP, and by tensor
parallelism (the engine as torchtitan builds it, each replica one worker of the reference).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.scenario import Config, reference_run, relative_error

WORLD, REPLICAS = 4, 2

RUNS = [  # (config, FSDP reduce-scatter every micro-batch)
    (Config(mode="acco", world_size=WORLD, rounds=6, micro=[2] * WORLD), False),
    (Config(mode="dpu", world_size=WORLD, rounds=5, micro=[2] * WORLD), False),
    (Config(mode="ddp", world_size=WORLD, rounds=4, micro=[3] * WORLD), False),
    # clipping over every shard of the model, and the scheduler stepped once per real update
    (Config(mode="acco", world_size=WORLD, rounds=6, micro=[2] * WORLD, max_grad_norm=0.05,
            scheduler=True), False),  # fmt: skip
    # token-weighted micro-batches that differ inside a replica
    (Config(mode="ddp", world_size=WORLD, rounds=4, micro=[3] * WORLD,
            weights=[1.0, 2.0, 3.0, 5.0]), False),  # fmt: skip
    (Config(mode="acco", world_size=WORLD, rounds=6, micro=[3] * WORLD), True),
]


@pytest.fixture(scope="module")
def hsdp_results():
    return run_distributed("tests.engine.hsdp_workers:hsdp_runs", WORLD, RUNS, REPLICAS)


@pytest.mark.parametrize("index", range(len(RUNS)),
                         ids=[f"{c.mode}-{i}{'-sync_every' if s else ''}" for i, (c, s) in enumerate(RUNS)])  # fmt: skip
def test_hsdp_equals_the_reference(hsdp_results, index: int) -> None:
    cfg, _ = RUNS[index]
    ref = reference_run(cfg)
    for rank, results in enumerate(hsdp_results):
        out = results[index]
        for name, expected in ref["params"].items():
            torch.testing.assert_close(out["params"][name], expected, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")  # noqa: B023  # fmt: skip
        assert out["lr"] == pytest.approx(ref["lr"])
        assert out["num_updates"] == (cfg.rounds // 2 if cfg.mode == "acco" else cfg.rounds)


def test_hsdp_master_and_optimizer_state_are_sharded_over_every_rank(hsdp_results) -> None:
    """The 67 parameters end up in 1/(S·R) fp32 master shards: fewer per rank than the 67/R
    of ACCO over the replicas alone, and together every parameter (plus padding)."""
    elements = [results[0]["memory"]["master_shard"] // 4 for results in hsdp_results]
    assert sum(elements) >= 67
    for rank, (count, results) in enumerate(zip(elements, hsdp_results)):
        assert count < 67 / REPLICAS / 1.5, f"rank {rank}: {count} master elements"
        assert results[0]["memory"]["optimizer_state"] >= 2 * 4 * count  # AdamW's two moments


# Muon on DeepNet's four matrices, each whole on one rank of the 2 × 2 grid (AdamW on the rest,
# in the FSDP pieces): its gradients on a grid, so that the pieces brought together hand Muon the
# bits the reference's whole matrices hold (tests/scenario.py, DeepNet)
MUON_RUNS = [
    Config(mode=mode, world_size=WORLD, rounds=rounds, micro=[2] * WORLD, optimizer="muon",
           model="deep_on_grid", **extra)
    for mode, rounds, extra in (("acco", 6, {}), ("dpu", 5, {}), ("ddp", 4, {}),
                                ("acco", 6, dict(max_grad_norm=0.05)))
]  # fmt: skip
# acco's estimate sent in bfloat16 (θ̃ − θ, scattered from the owners, then encoded)
MUON_NARROW = Config(mode="acco", world_size=WORLD, rounds=6, micro=[2] * WORLD,
                     optimizer="muon", model="deep_on_grid", estimate_dtype="bfloat16")  # fmt: skip


@pytest.fixture(scope="module")
def muon_results():
    runs = [(cfg, False) for cfg in [*MUON_RUNS, MUON_NARROW]]
    return run_distributed("tests.engine.hsdp_workers:hsdp_runs", WORLD, runs, REPLICAS)


@pytest.mark.parametrize("index", range(len(MUON_RUNS)),
                         ids=[f"{c.mode}-{i}" for i, c in enumerate(MUON_RUNS)])  # fmt: skip
def test_muon_on_whole_matrices_under_hsdp_equals_the_reference(muon_results, index) -> None:
    """Each matrix's FSDP pieces brought to its owner, stepped whole by torch's Muon, sent back:
    in ddp, torch's Muon and AdamW on the full matrices over the same micro-batches; in dpu and
    acco, the spec's recursion with them (also clipping, by the norm over the pieces)."""
    cfg = MUON_RUNS[index]
    ref = reference_run(cfg)
    for rank, results in enumerate(muon_results):
        out = results[index]
        error = relative_error(out["params"], ref["params"])
        assert error <= 1e-6, (rank, error)
        assert out["num_updates"] == (cfg.rounds // 2 if cfg.mode == "acco" else cfg.rounds)
    # the four matrices, one on each rank of the 2 × 2 grid, held whole there
    owned = [results[index]["owned_whole"] for results in muon_results]
    assert sorted(name for names in owned for name in names) == [
        f"layers.{i}.weight" for i in range(4)], owned
    assert all(len(names) == 1 for names in owned), owned
    for results in muon_results:
        assert results[index]["memory"]["whole_on_owner"] > 0


def test_a_narrow_estimate_of_whole_matrices_under_hsdp_equals_replicas_without_fsdp(
    muon_results,
) -> None:
    """acco's estimate round in bfloat16: each replica encodes its FSDP-summed gradient, and
    each matrix's θ̃ − θ, computed on its owner and scattered back, is encoded element by
    element. The 2 × 2 grid then trains as 2 plain ranks that each run a replica's micro-batches
    and own the matrices whole (4 plain ranks would round each rank's gradient on its own: a
    legitimately other run, 3e-3 apart after 6 rounds through Muon's Newton–Schulz)."""
    plain = run_distributed("tests.scenario:fewer_ranks_run", REPLICAS, MUON_NARROW,
                            WORLD // REPLICAS)[0]  # fmt: skip
    for rank, results in enumerate(muon_results):
        error = relative_error(results[-1]["params"], plain["params"])
        assert error <= 1e-6, (rank, error)


RESUMES = [  # (config, save after this many micro-batches, sync_every_microbatch)
    (Config(mode="acco", rounds=10), 7 * 2, False),  # an estimate in flight, its gradient carried
    (Config(mode="ddp", rounds=10), 6 * 2, False),
    (Config(mode="acco", rounds=10), 5 * 2 + 1, True),  # mid-round: the engine holds the shards
    (Config(mode="acco", rounds=10), 5 * 2 + 1, False),  # mid-round: refused, saved at round end
]


@pytest.fixture(scope="module")
def resume_results():
    return run_distributed("tests.engine.hsdp_workers:hsdp_resumes", WORLD, RESUMES, REPLICAS)


@pytest.mark.parametrize("index", range(len(RESUMES)),
                         ids=[f"{c.mode}-at{a}{'-sync_every' if s else ''}" for c, a, s in RESUMES])  # fmt: skip
def test_hsdp_resume_is_exact(resume_results, index: int) -> None:
    _, save_at, sync_every = RESUMES[index]
    for rank, results in enumerate(resume_results):
        out = results[index]
        for name, value in out["straight"].items():
            assert torch.equal(out["resumed"][name], value), f"rank {rank}: {name} differs"
        if save_at % 2 and not sync_every:
            assert "in the middle of a round" in out["mid_round"]
            assert "sync_every_microbatch=True" in out["mid_round"]


def test_hsdp_bad_inputs_are_refused() -> None:
    errors = run_distributed("tests.engine.hsdp_workers:hsdp_bad_inputs", 2)[0]
    assert "2-D DeviceMesh (replicate, shard)" in errors["1d_mesh"]
    assert "use ACCOOptimizer" in errors["1d_mesh"]
    assert "no parameters managed by fully_shard" in errors["not_sharded"]


UNTIL_READY_MODES, UNTIL_READY_ROUNDS, CAP = ["acco", "dpu", "ddp"], 8, 6


LAYOUTS = ["fsdp", "tp"]


@pytest.fixture(scope="module", params=LAYOUTS)
def until_ready_results(request):
    return request.param, run_distributed(
        "tests.engine.hsdp_workers:until_ready_runs", WORLD, request.param, UNTIL_READY_MODES,
        REPLICAS, UNTIL_READY_ROUNDS, CAP,
    )  # fmt: skip


@pytest.mark.parametrize("index", range(len(UNTIL_READY_MODES)), ids=UNTIL_READY_MODES)
def test_replicas_of_unequal_speed_run_until_ready_exactly(until_ready_results, index) -> None:
    """accumulate_until_ready across replicas of 2 ranks each, split by FSDP or by tensor
    parallelism: the second rank of each replica keeps its update in flight longer (its
    scheduler step holds its communication thread) and the second replica computes slower. The
    ranks of a replica agree after each micro-batch whether to run another, so they run the
    same micro-batches though only one of them waits; the replicas run different numbers. The
    result is the spec's recursion over the micro-batches each replica ran (recorded, then
    replayed by the independent reference): under FSDP each rank is a worker with its own
    data, under TP each replica is one, its ranks computing one model's pieces."""
    layout, results = until_ready_results
    mode = UNTIL_READY_MODES[index]
    runs = [per_rank[index] for per_rank in results]
    per_replica = WORLD // REPLICAS
    counts = [run["counts"] for run in runs]
    for replica in range(REPLICAS):  # the ranks of a replica ran the same micro-batches
        first = replica * per_replica
        assert all(counts[r] == counts[first] for r in range(first, first + per_replica)), counts
    assert all(len(c) == UNTIL_READY_ROUNDS for c in counts)
    assert all(2 <= n <= CAP for c in counts for n in c), counts
    if mode != "ddp":  # ddp waits for each round at its end: nothing is in flight to fill
        assert any(n > 2 for c in counts for n in c), counts
    workers = counts if layout == "fsdp" else counts[::per_replica]
    cfg = Config(mode=mode, world_size=len(workers), rounds=UNTIL_READY_ROUNDS,
                 micro=[2] * len(workers), counts=[list(per_round) for per_round in zip(*workers)],
                 scheduler=True)  # fmt: skip
    reference = reference_run(cfg)
    for rank, run in enumerate(runs):
        for name, expected in reference["params"].items():
            torch.testing.assert_close(run["params"][name], expected, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")  # noqa: B023  # fmt: skip
        assert run["num_updates"] == (UNTIL_READY_ROUNDS // 2 if mode == "acco"
                                      else UNTIL_READY_ROUNDS)  # fmt: skip
