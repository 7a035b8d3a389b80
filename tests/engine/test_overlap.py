"""The compute side keeps going while a round's communication is in flight (no timing used).

Rank 1 holds back its end of round 0 until rank 0 has run its next micro-batches: rank 0's
round-0 reduce-scatter cannot complete without rank 1, so everything rank 0 computes meanwhile
overlaps communication. Seen through the public ``engine.communication_in_flight``.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed


def held_communication_run(rank: int, world_size: int, accumulate_until_ready: bool,
                           cap: int | None = None) -> dict:  # fmt: skip
    from acco_hooks import ACCOOptimizer
    from tests.scenario import make_model, microbatch_loss

    model = make_model()
    # Rank 1 always ends its rounds after 2 micro-batches: its round sizes stay known.
    until_ready = accumulate_until_ready and rank == 0
    opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="acco", accumulation_steps=2,
                        accumulate_until_ready=until_ready, lr=1e-2,
                        max_microbatches_per_round=cap if until_ready else None)  # fmt: skip
    engine = opt.engine
    batches = iter(range(1000))

    def micro_batch() -> bool:
        microbatch_loss(model, rank, 0, next(batches)).backward()
        return opt.step()

    assert not micro_batch()
    completed_while_held = 0
    if rank == 1:
        dist.barrier()  # the default group: released by rank 0 once it has computed
        assert micro_batch()  # round 0 ends; its communication can complete now
        assert not micro_batch()
    elif cap is not None:
        assert micro_batch()  # round 0 ends: nothing was in flight, so no wait
        for _ in range(cap - 1):
            assert not micro_batch()
            completed_while_held += 1
        # The cap-th micro-batch ends the round although its predecessor is still held: it
        # waits for it. Rank 1 is released only once that call has started.
        assert engine.communication_in_flight
        calling = threading.Event()
        releaser = threading.Thread(target=lambda: (calling.wait(), dist.barrier()))
        releaser.start()
        calling.set()
        assert micro_batch()
        releaser.join()
        assert engine.last_round_microbatches == cap
        opt.flush()
        result = {"completed_while_held": completed_while_held,
                  "round1_microbatches": engine.last_round_microbatches,
                  "global_count": engine.last_global_count}  # fmt: skip
        opt.close()
        return result
    else:
        assert micro_batch()  # round 0 ends: nothing was in flight, so no wait
        extra = 5 if accumulate_until_ready else 0
        for _ in range(1 + extra):
            assert not micro_batch()  # returns at once although the communication cannot finish
            completed_while_held += 1
            assert engine.communication_in_flight
        if accumulate_until_ready:
            # The round's minimum is reached but its predecessor is held: step() declined to wait.
            assert engine.round_index == 1 and engine.microbatches_in_round == 2 + extra - 1
        dist.barrier()  # release rank 1
        while accumulate_until_ready and engine.communication_in_flight:
            time.sleep(0.01)
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
    held, releasing = run_distributed(
        "tests.engine.test_overlap:held_communication_run", 2, accumulate_until_ready
    )
    assert releasing["round1_microbatches"] == 2
    if accumulate_until_ready:
        # Round 1 took 7 micro-batches instead of 2: 5 more while the network was busy.
        assert held["completed_while_held"] == 6
        assert held["round1_microbatches"] == 7
        # Its payload (the estimate round's carry + round 1) counted 2 + 7 and 2 + 2.
        assert held["global_count"] == (2 + 7) + (2 + 2)
    else:
        assert held["completed_while_held"] == 1
        assert held["round1_microbatches"] == 2
        assert held["global_count"] == 2 * (2 + 2)
    assert releasing["global_count"] == held["global_count"]
    for a, b in zip(held["params"], releasing["params"]):
        assert torch.equal(a, b)


def test_a_rank_stops_at_max_microbatches_per_round_and_waits() -> None:
    """With a cap of 4 the until-ready rank runs 4 micro-batches while the communication is
    held (not 7, nor as many as it could), and its 4th ends the round by waiting."""
    held, releasing = run_distributed(
        "tests.engine.test_overlap:held_communication_run", 2, True, 4
    )
    assert held["completed_while_held"] == 3
    assert held["round1_microbatches"] == 4
    assert releasing["round1_microbatches"] == 2
    assert held["global_count"] == releasing["global_count"] == (2 + 4) + (2 + 2)


PHASES = ("acco::round_end", "acco::wait", "acco::apply", "acco::reduce_scatter",
          "acco::shard_step", "acco::estimate_step", "acco::all_gather")  # fmt: skip


def profiled_run(rank: int, world_size: int) -> dict[str, list[int]]:
    """Six acco rounds under ``torch.profiler``: each phase label and the threads it ran on."""
    from torch.profiler import ProfilerActivity, profile

    from acco_hooks import ACCOOptimizer
    from tests.scenario import make_model, microbatch_loss

    model = make_model()
    opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="acco", accumulation_steps=2,
                        lr=1e-2)  # fmt: skip
    # The communication thread's labels need the profiler on every thread, not only this one.
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as trace:
        for round_ in range(6):
            for micro in range(2):
                microbatch_loss(model, rank, round_, micro).backward()
                opt.step()
        opt.flush()
    opt.close()
    threads: dict[str, set[int]] = {}
    for event in trace.events():
        if event.name.startswith("acco::"):
            threads.setdefault(event.name, set()).add(event.thread)
    return {name: sorted(ids) for name, ids in threads.items()}


def test_a_profiler_trace_shows_the_round_phases_on_both_threads() -> None:
    for labels in run_distributed("tests.engine.test_overlap:profiled_run", 2):
        assert set(PHASES) <= set(labels), labels
        loop = set(labels["acco::round_end"]) & set(labels["acco::apply"])
        worker = set(labels["acco::reduce_scatter"]) & set(labels["acco::all_gather"])
        assert loop and worker and not loop & worker, labels  # two threads, each its phases


def doc_snippet_run(rank: int, world_size: int, workdir: str) -> dict[str, list[int]]:
    """docs/engine.md's profiler snippet, as written, around 6 acco rounds of a small loop."""
    import json
    import os
    import pathlib
    import re

    from acco_hooks import ACCOOptimizer

    doc = (pathlib.Path(__file__).parents[2] / "docs" / "engine.md").read_text()
    section = doc.split("## Seeing the rounds in a profiler", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="acco", accumulation_steps=2,
                        lr=1e-2)  # fmt: skip
    batches = [(torch.randn(4, 8), torch.randn(4, 4)) for _ in range(12)]
    os.chdir(workdir)
    exec(snippet, {"model": model, "opt": opt, "batches": batches,
                   "loss_fn": torch.nn.functional.mse_loss})  # fmt: skip
    assert opt.engine.closed
    events = json.loads(pathlib.Path(f"acco_trace_rank{rank}.json").read_text())["traceEvents"]
    threads: dict[str, set[int]] = {}
    for event in events:
        if event.get("name", "").startswith("acco::"):
            threads.setdefault(event["name"], set()).add(event["tid"])
    return {name: sorted(ids) for name, ids in threads.items()}


def test_the_profiler_snippet_of_the_docs_writes_each_rank_its_own_trace(tmp_path) -> None:
    for labels in run_distributed("tests.engine.test_overlap:doc_snippet_run", 2, str(tmp_path)):
        assert set(PHASES) <= set(labels), labels
        loop = set(labels["acco::round_end"]) & set(labels["acco::apply"])
        worker = set(labels["acco::reduce_scatter"]) & set(labels["acco::all_gather"])
        assert loop and worker and not loop & worker, labels
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acco_trace_rank0.json",
                                                          "acco_trace_rank1.json"]  # fmt: skip
