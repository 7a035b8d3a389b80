"""torchrun's elastic agent with ACCO: two "nodes" (two agents × 2 gloo ranks on loopback, one
c10d rendezvous) running ``examples/elastic_train.py``. A node SIGKILLed mid-training: the
survivor's agent restarts its workers on the smaller world and they resume from the last
checkpoint, resharded 4 -> 2. A node that joins later: both resume resharded 2 -> 4. Either run
ends as the uninterrupted 4-rank run does (each micro-batch is one global batch split over the
ranks), and every agent exits 0. ``benchmarks/elastic_recovery.py`` repeats the first case and
times it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.elastic_recovery import (
    ELASTIC_ENV,
    ROOT,
    agent_command,
    attempts,
    free_port,
    kill_node,
    one_recovery,
    start_agent,
    training_command,
    wait_for_checkpoint,
)  # fmt: skip
from tests.scenario import relative_error

UPDATES = 24


def uninterrupted(tmp_path: Path) -> dict:
    out = tmp_path / "straight"
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         *training_command(out, UPDATES, 0.0)],
        cwd=ROOT, env={**os.environ, **ELASTIC_ENV, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return torch.load(out / "final.pt")


def tail(*logs: Path) -> str:
    return "\n".join(log.read_text()[-3000:] for log in logs)


def test_a_killed_node_resumes_on_the_survivor_and_ends_as_the_uninterrupted_run(tmp_path):
    expected = uninterrupted(tmp_path)
    recovery = one_recovery(tmp_path, UPDATES, 0.0, checkpoint=8)
    assert recovery["survivor_rc"] == 0, tail(tmp_path / "node0.log")
    first, *later = attempts(tmp_path / "ckpt")
    assert first["world_size"] == 4 and first["resumed_from_update"] is None
    assert later and later[-1]["world_size"] == 2, later
    assert recovery["resumed_from_update"] >= 8
    print(f"kill -> first resumed step: {recovery['kill_to_first_resumed_step_s']} s, resumed "
          f"from update {recovery['resumed_from_update']}, {len(later)} restart(s)")
    assert relative_error(torch.load(tmp_path / "ckpt" / "final.pt"), expected) <= 1e-5


def test_a_node_that_joins_later_is_taken_in_and_the_run_ends_as_the_uninterrupted_one(tmp_path):
    """One node trains on 2 ranks; a second one joins: the first agent restarts its workers,
    both nodes resume from the last checkpoint resharded 2 -> 4, and both agents exit 0."""
    expected = uninterrupted(tmp_path)
    ckpt, port = tmp_path / "ckpt", free_port()
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    command = agent_command(port, training_command(ckpt, UPDATES, 0.05))
    first_node, joining = start_agent(command, logs[0]), None
    try:
        wait_for_checkpoint(ckpt / "update_8", [first_node], logs[0])
        joining = start_agent(command, logs[1])
        rcs = [first_node.wait(timeout=300), joining.wait(timeout=300)]
    finally:
        for agent in (first_node, joining):
            if agent is not None and agent.poll() is None:
                kill_node(agent)
    assert rcs == [0, 0], tail(*logs)
    first, *later = attempts(ckpt)
    assert first["world_size"] == 2 and first["resumed_from_update"] is None
    assert later and later[-1]["world_size"] == 4 and later[-1]["resumed_from_update"] >= 8
    assert relative_error(torch.load(ckpt / "final.pt"), expected) <= 1e-5
