"""The compute side keeps going while a round's communication is in flight (no timing used).

A job that blocks on an event is queued on the communication thread before a round ends, so
that round's reduce-scatter/step/all-gather is held back until the test releases it.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tests.dist_utils import run_distributed


def held_communication_run(rank: int, world_size: int, accumulate_until_ready: bool) -> dict:
    from acco_hooks import ACCOOptimizer
    from tests.scenario import make_model, microbatch_loss

    model = make_model()
    opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="acco", accumulation_steps=2,
                        accumulate_until_ready=accumulate_until_ready, lr=1e-2)  # fmt: skip
    engine = opt.engine
    batches = iter(range(1000))

    def micro_batch() -> bool:
        microbatch_loss(model, rank, 0, next(batches)).backward()
        return opt.step()

    gate = threading.Event()
    assert not micro_batch()
    engine._worker.submit(gate.wait)  # round 0's communication queues behind this
    assert micro_batch()  # round 0 ends: nothing was in flight, so no wait
    round0_comm = engine._in_flight
    extra = 5 if accumulate_until_ready else 0
    completed_while_held = 0
    for _ in range(1 + extra):
        assert not micro_batch()  # returns at once although the communication cannot finish
        completed_while_held += 1
        assert not round0_comm.done()
    if accumulate_until_ready:
        # The round's minimum is reached but its predecessor is held: step() declined to wait.
        assert engine.round_index == 1 and engine._round_microbatches == 2 + extra - 1
    gate.set()
    if accumulate_until_ready:
        engine._worker.wait(round0_comm)
    assert micro_batch()  # the round ends once the released communication finished
    opt.flush()
    result = {
        "completed_while_held": completed_while_held,
        "round1_microbatches": engine.last_round_microbatches,
        "global_count": engine.last_global_count,
        "params": [p.detach().clone() for p in model.parameters()],
    }
    opt.close()
    return result


@pytest.mark.parametrize("accumulate_until_ready", [False, True])
def test_compute_continues_while_communication_is_held(accumulate_until_ready: bool) -> None:
    results = run_distributed(
        "tests.test_overlap:held_communication_run", 2, accumulate_until_ready
    )
    for result in results:
        if accumulate_until_ready:
            # Round 1 took 7 micro-batches instead of 2: 5 more while the network was busy.
            assert result["completed_while_held"] == 6
            assert result["round1_microbatches"] == 7
            # Its payload (the estimate round's carry + round 1) counted 2 + 7 on each rank.
            assert result["global_count"] == 2 * (2 + 7)
        else:
            assert result["completed_while_held"] == 1
            assert result["round1_microbatches"] == 2
            assert result["global_count"] == 2 * (2 + 2)
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)
