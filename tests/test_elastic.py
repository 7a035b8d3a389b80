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
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from acco_hooks import ACCOCommunicationError
from acco_hooks.elastic import exit_for_restart, lost_peer
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


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The uninterrupted 4-rank run both cases end as (one run for the module)."""
    out = tmp_path_factory.mktemp("straight")
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


def test_a_killed_node_resumes_on_the_survivor_and_ends_as_the_uninterrupted_run(
    tmp_path, uninterrupted
):
    expected = uninterrupted
    recovery = one_recovery(tmp_path, UPDATES, 0.0, checkpoint=8)
    assert recovery["survivor_rc"] == 0, tail(tmp_path / "node0.log")
    first, *later = attempts(tmp_path / "ckpt")
    assert first["world_size"] == 4 and first["resumed_from_update"] is None
    assert later and later[-1]["world_size"] == 2, later
    assert recovery["resumed_from_update"] >= 8
    print(f"kill -> first resumed step: {recovery['kill_to_first_resumed_step_s']} s, resumed "
          f"from update {recovery['resumed_from_update']}, {len(later)} restart(s)")
    assert relative_error(torch.load(tmp_path / "ckpt" / "final.pt"), expected) <= 1e-5
    # the survivor says what happened in a line per rank (the agent may stop a rank before it
    # prints), naming the checkpoint its restarted workers did resume from; no traceback
    survivor = (tmp_path / "node0.log").read_text()
    lines = re.findall(r"acco_hooks: rank \d: lost a peer \(.+\); the elastic agent restarts the "
                       r"workers \(restart 1 of 3\), which resume from (\S+)\n", survivor)  # fmt: skip
    assert 1 <= len(lines) <= 2, survivor[-3000:]
    assert {Path(line).name for line in lines} == {f"update_{recovery['resumed_from_update']}"}
    assert "Traceback" not in survivor, survivor[-3000:]


def test_a_node_that_joins_later_is_taken_in_and_the_run_ends_as_the_uninterrupted_one(
    tmp_path, uninterrupted
):
    """One node trains on 2 ranks; a second one joins: the first agent restarts its workers,
    both nodes resume from the last checkpoint resharded 2 -> 4, and both agents exit 0. The
    first node's workers wait after their first checkpoint until the join restarts them: a
    joiner that comes up slowly (a loaded machine) cannot find the run already ended."""
    expected = uninterrupted
    ckpt, port = tmp_path / "ckpt", free_port()
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    command = agent_command(port, training_command(ckpt, UPDATES, 0.05, "--hold-for-ranks", "4"))
    first_node, joining = start_agent(command, logs[0]), None
    try:
        wait_for_checkpoint(ckpt / "update_4", [first_node], logs[0])
        joining = start_agent(command, logs[1])
        rcs = [first_node.wait(timeout=300), joining.wait(timeout=300)]
    finally:
        for agent in (first_node, joining):
            if agent is not None and agent.poll() is None:
                kill_node(agent)
    assert rcs == [0, 0], tail(*logs)
    first, *later = attempts(ckpt)
    assert first["world_size"] == 2 and first["resumed_from_update"] is None
    assert later and later[-1]["world_size"] == 4 and later[-1]["resumed_from_update"] == 4
    assert relative_error(torch.load(ckpt / "final.pt"), expected) <= 1e-5


LOST = ACCOCommunicationError(
    "acco_hooks: the communication of round 8 failed on rank 0: [../gloo/transport/tcp/pair.cc"
    ":553] Connection closed by peer [127.0.0.1]:23957"
)


def test_a_lost_peer_under_the_agent_is_one_line_and_exit_status_1(monkeypatch, capsys) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    with pytest.raises(SystemExit) as exited:
        exit_for_restart(LOST, resume_from="/ckpt/update_8")
    assert exited.value.code == 1
    assert capsys.readouterr().err == (
        "acco_hooks: rank 3: lost a peer (Connection closed by peer [127.0.0.1]:23957); the "
        "elastic agent restarts the workers (restart 2 of 3), "
        "which resume from /ckpt/update_8\n"
    )
    with pytest.raises(SystemExit):  # the cause may sit in the chain (DCP wraps it, say)
        try:
            raise LOST
        except ACCOCommunicationError as error:
            try:
                raise RuntimeError("dcp.save failed") from error
            except RuntimeError as outer:
                exit_for_restart(outer, resume_from=None)
    assert "resume from the start (no complete checkpoint yet)" in capsys.readouterr().err


@pytest.mark.parametrize("env, error", [
    ({}, LOST),  # no elastic agent: the traceback is the report
    ({"TORCHELASTIC_RESTART_COUNT": "3", "TORCHELASTIC_MAX_RESTARTS": "3"}, LOST),  # none left
    ({"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "3"},
     ValueError("lr must be positive")),  # not a lost peer: a bug to see whole
])  # fmt: skip
def test_anything_else_is_left_to_the_caller_to_raise(monkeypatch, capsys, env, error) -> None:
    for name in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert exit_for_restart(error, resume_from="/ckpt/update_8") is None
    assert capsys.readouterr().err == ""
    assert (lost_peer(error) is None) == isinstance(error, ValueError)


def test_the_example_says_how_to_launch_it_elastically() -> None:
    """``--help`` gives the launch docs/multinode.md calls necessary, and what it needs."""
    shown = subprocess.run([sys.executable, "-m", "examples.elastic_train", "--help"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120, check=True).stdout  # fmt: skip
    for needed in ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", "--rdzv-conf last_call_timeout=",
                   "--max-restarts", "from a checkout of this", "exit_for_restart"):  # fmt: skip
        assert needed in shown, needed
