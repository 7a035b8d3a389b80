"""The one-machine torchft commands of docs/multinode.md, run as the docs print them.

Each block is read from the doc and run by ``bash`` in a folder of its own that holds what the
commands name from the checkout (``examples``, ``scaffolding``, ``train_titan.py``,
``torchtitan_configs``), so that their ``outputs/`` is the test's. What the docs say follows
the block is then checked: the groups' exit, the lines they print, their parameters.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft")  # the ft extra, which the README's setup installs

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "multinode.md"
# Every process a block starts carries this variable (torchrun starts each worker in a session
# of its own: a kill of the block's session misses them), so that what it leaves behind on a
# failure is found, and no other job's processes on the machine
BLOCK_MARK = "ACCO_DOCS_COMMANDS_BLOCK"


def doc_block(heading: str, after: str | None = None) -> str:
    """The first ``bash`` block under ``heading`` (after the line holding ``after``)."""
    section = DOC.read_text().split(heading, 1)[1]
    if after is not None:
        section = section.split(after, 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)


def run_block(block: str, workdir: Path, timeout_s: float) -> subprocess.CompletedProcess:
    """Run ``block`` with bash in ``workdir`` (as a script a user saved it to), with this
    Python's scripts first on the PATH
    (torchrun, torchft_lighthouse); whatever it started is killed at the end."""
    for name in ("examples", "scaffolding", "torchtitan_configs", "train_titan.py"):
        (workdir / name).symlink_to(ROOT / name)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           BLOCK_MARK: str(workdir)}  # fmt: skip
    env.pop("PYTHONPATH", None)  # the block runs what a user's shell runs: the installed project
    # from a file: a pattern the block kills by (pkill -f) must not match the shell running it
    (workdir / "block.sh").write_text(block)
    proc = subprocess.Popen(["bash", "block.sh"], cwd=workdir, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out)
    finally:
        _kill_what_is_left(proc, workdir)


def _kill_what_is_left(proc: subprocess.Popen, workdir: Path) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    mark = f"{BLOCK_MARK}={workdir}".encode()
    for entry in Path("/proc").iterdir():  # the workers, each in a session of its own
        try:
            marked = mark in (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue  # not a process, or gone, or not ours to read
        if marked:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
    time.sleep(0.5)


def test_the_one_machine_torchft_demo_runs_as_printed(tmp_path) -> None:
    """"Try it on one machine": 2 groups launched, group 1 killed by hand (every process of
    it), checked gone, started again with the same command. The survivor says what happened
    in one line per event, without a traceback, and both groups end with the same parameters."""
    block = doc_block("### Try it on one machine")
    result = run_block(block, tmp_path, timeout_s=300)
    out = tmp_path / "outputs" / "torchft"
    logs = {name: (out / f"{name}.log").read_text() for name in ("g0", "g1", "g1_back")}
    assert result.returncode == 0, result.stdout + logs["g0"][-3000:] + logs["g1_back"][-3000:]
    assert "group 1 is gone" in result.stdout, result.stdout
    survivor = logs["g0"]
    assert "Traceback" not in survivor, survivor[-3000:]
    lines = [line for line in survivor.splitlines() if line.startswith("acco_hooks:")]
    left = [line for line in lines if "acco_1 left the job" in line]
    assert len(left) == 1, lines  # one line for the loss, from the group's first rank
    assert any("joined the quorum" in line for line in lines), lines
    assert re.search(r"^acco_0 round 400: loss", survivor, re.MULTILINE), survivor[-2000:]
    back = logs["g1_back"]
    joined = re.search(r"joined the job at round (\d+)", back)
    assert joined and 0 < int(joined.group(1)) < 400, back[-3000:]
    assert "Traceback" not in back, back[-3000:]
    params = [torch.load(out / f"params_g{g}_r{r}.pt")["params"] for g in (0, 1) for r in (0, 1)]
    for other in params[1:]:
        for name, value in params[0].items():
            assert torch.equal(value, other[name]), name


def test_the_one_machine_torchtitan_torchft_command_runs_as_printed(tmp_path) -> None:
    """"In torchtitan", on one machine: 2 groups of 2 ranks with the debug config. Both exit
    0 and train from the first step together (neither joins a running job), which the
    engine's first round waiting for ``group_size`` groups makes so, however far apart the
    groups come up."""
    block = doc_block("### In torchtitan", after="On one machine")
    result = run_block(block, tmp_path, timeout_s=420)
    logs = [(tmp_path / "outputs" / f"torchft_titan_g{i}.log").read_text() for i in (0, 1)]
    assert result.returncode == 0, result.stdout + logs[0][-3000:] + logs[1][-3000:]
    for log in logs:
        assert "summary:" in log, log[-3000:]
        assert "joined the job" not in log, log[-3000:]
        assert re.search(r"step:\s*20\b", log), log[-3000:]
