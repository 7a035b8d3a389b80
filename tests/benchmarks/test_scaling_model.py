"""The scaling model's arithmetic: the fit recovers known constants, the law's landmarks, k*."""

from __future__ import annotations

import pytest

from benchmarks.scaling_model import (
    TESTBED,
    best_k,
    fit,
    mixed_cluster,
    rate_bits,
    setup,
    speedup,
    wire_seconds,
)


def _sweep(eta: float, alpha: float, delta: float, compute: float) -> dict:
    rates = {}
    for rate in ("1400mbit", "670mbit", "340mbit", "170mbit", "85mbit"):
        line = wire_seconds(TESTBED["ranks"], TESTBED["params"], 8, rate_bits(rate))
        comm = alpha + line / eta
        acco = max(compute, comm) + delta * min(compute, comm)
        rates[rate] = {"comm_C_s": comm, "acco_round_s": [acco] * 3,
                       "ddp_round_s": [2 * compute + comm] * 3}  # fmt: skip
    return {"compute_K_s": compute, "k": 4, "rates": rates}


def test_the_fit_recovers_known_constants() -> None:
    fitted = fit(_sweep(eta=0.9, alpha=0.05, delta=0.2, compute=0.7))
    assert fitted["eta"] == pytest.approx(0.9)
    assert fitted["alpha_s"] == pytest.approx(0.05)
    assert fitted["delta"] == pytest.approx(0.2)
    assert fitted["comm_fit"]["residual_rms_s"] == pytest.approx(0.0, abs=1e-12)
    assert fitted["delta_fit"]["residual_max_abs_s"] == pytest.approx(0.0, abs=1e-12)
    assert fitted["delta_fit"]["runs"] == 15


def test_the_testbed_wire_time() -> None:
    # fp32 reduce + fp32 gather of 6,163,712 parameters, half of each per rank at N = 2.
    expected = 6_163_712 * 4 * 8 / 1e9
    assert wire_seconds(2, 6_163_712, 8, rate_bits("1gbit")) == pytest.approx(expected)


def test_the_law_landmarks() -> None:
    assert speedup(1.0, 0.0, 0.0) == 1.0
    assert speedup(1.0, 1.0, 0.0) == 1.5
    assert speedup(1.0, 2.0, 0.0) == 1.0
    assert speedup(1.0, 4.0, 0.0) < 1.0
    assert speedup(1.0, 1.0, 0.2) == pytest.approx(3 / 2.4)


@pytest.mark.parametrize("ratio", [0.1, 0.9, 1.0, 3.4, 17.1])
@pytest.mark.parametrize("delta", [0.0, 0.13])
def test_best_k_is_the_best_integer(ratio: float, delta: float) -> None:
    t = 0.6
    k = best_k(ratio * t, t, delta)
    assert speedup(k * t, ratio * t, delta) == max(
        speedup(j * t, ratio * t, delta) for j in range(1, 200)
    )


def test_the_8b_setup_follows_the_config() -> None:
    run = setup()
    assert run["k"] == 2 and run["tensor_parallel"] == 8
    assert run["tokens_per_microbatch_per_node"] == 4 * 8192
    assert run["reduce_bytes"] == 2 and run["gather_bytes"] == 2  # bf16 both ways
    assert run["flops_per_token"] == 57_914_449_920  # torchtitan's get_nparams_and_flops


def test_a_mixed_cluster_of_equal_nodes_is_the_law_and_unequal_ones_wait() -> None:
    """Nodes of one speed: every arm is synchronous ZeRO-1 or the law (until-ready adds the
    half micro-batch its round ends after). Slower nodes 2x: synchronous training runs at
    their speed, the balanced split (and the capped until-ready) at 4 + 2 x 4 = 12 micro-batches
    an update in the same time on a free link."""
    fitted = {"alpha_s": 0.0, "eta": 1.0, "delta": 0.0}
    run = {**setup(), "microbatch_s": 1.0, "k": 2}
    link = 8 * run["reduce_bytes"] * 8 * run["params_per_gpu"]  # bits/s per node: C ~ 1.75 s
    equal = mixed_cluster(fitted, run, 4, 4, 1.0, link / 1e9)
    comm = equal["comm_C_s"]
    assert comm == pytest.approx(7 / 8 * 2 * run["gather_bytes"] / run["reduce_bytes"])
    assert equal["over_sync"]["sync_balanced"] == pytest.approx(1.0)
    assert equal["over_sync"]["acco"] == pytest.approx(speedup(2.0, comm, 0.0))
    assert equal["tokens_per_update"]["acco_until_ready_capped"] == equal["tokens_per_update"]["sync"]
    free = mixed_cluster(fitted, run, 4, 4, 2.0, 1e9)  # a link so fast that C ~ 0
    assert free["update_s"]["sync"] == pytest.approx(8.0, abs=1e-3)  # 2k slow micro-batches
    assert free["tokens_per_update"]["sync_balanced"] == run["tokens_per_microbatch_per_node"] * (
        4 * 4 + 4 * 8)
    assert free["over_sync"]["sync_balanced"] == pytest.approx(1.5, abs=1e-3)
    assert free["over_sync"]["acco_until_ready_capped"] == pytest.approx(1.5, abs=1e-3)
