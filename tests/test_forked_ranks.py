"""scaffolding.forked_ranks, which launches most of the suite's torchtitan jobs: each rank runs
its program as ``__main__`` with torchrun's variables, the caller's environment and argv, and
one failed rank ends the job with its status, as torchrun's agent does."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from scaffolding import forked_ranks

PROGRAM = '''
import json, os, sys, time
import helper_on_pythonpath
rank = int(os.environ["RANK"])
if sys.argv[1] == "report":
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "FROM_CALLER")
    # the job's store listens at MASTER_PORT before any rank runs (the launcher hosts it)
    import datetime, torch.distributed as dist
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=datetime.timedelta(seconds=30))
    store.add("ranks_reached", 1)
    # one write: print() writes its pieces one by one where stdout writes through
    # (PYTHONUNBUFFERED), and three ranks appending to one log would interleave them
    report = {"argv": sys.argv[1:], "main": __name__, "cwd": os.getcwd(),
              "env": {n: os.environ.get(n) for n in names}}
    sys.stdout.write("REPORT " + json.dumps(report) + "\\n")
    sys.stdout.flush()
elif sys.argv[1] == "sleep":
    time.sleep(600)  # killed by the test
elif rank == 1:
    sys.exit(3)
else:
    time.sleep(600)  # killed when rank 1 fails
'''


def _program(tmp_path: Path) -> Path:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "helper_on_pythonpath.py").write_text("")
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    return script


def test_each_rank_runs_the_program_as_torchruns_workers_do(tmp_path: Path) -> None:
    script, log = _program(tmp_path), tmp_path / "job.log"
    env = {"FROM_CALLER": "yes", "PYTHONPATH": str(tmp_path / "lib")}
    status = forked_ranks.run(3, [str(script), "report", "x"], log,
                              preload=("json", "torch.distributed"), env=env, cwd=tmp_path)  # fmt: skip
    assert status == 0, log.read_text()
    reports = [json.loads(line.split(" ", 1)[1]) for line in log.read_text().splitlines()
               if line.startswith("REPORT ")]  # fmt: skip
    assert sorted(int(r["env"]["RANK"]) for r in reports) == [0, 1, 2]
    for report in reports:
        assert report["argv"] == ["report", "x"] and report["main"] == "__main__"
        assert report["cwd"] == str(tmp_path)
        env = report["env"]
        assert env["LOCAL_RANK"] == env["RANK"] and env["WORLD_SIZE"] == "3"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert env["FROM_CALLER"] == "yes"
    assert len({r["env"]["MASTER_PORT"] for r in reports}) == 1


def test_a_failed_rank_ends_the_job_with_its_status(tmp_path: Path) -> None:
    script, log = _program(tmp_path), tmp_path / "job.log"
    started = time.monotonic()
    status = forked_ranks.run(2, [str(script), "fail"], log, preload=("json",),
                              env={"PYTHONPATH": str(tmp_path / "lib")})  # fmt: skip
    assert status == 3, log.read_text()
    assert time.monotonic() - started < 60, "rank 0 was not ended with the job"


def test_a_started_job_is_a_session_of_its_own_that_one_kill_ends(tmp_path: Path) -> None:
    """``start``: the launcher's pid is its session's and process group's, holding every rank
    (a kill of it takes the whole job, as losing a node does); a job whose rank fails ends
    with torchrun's status 1, the others ended with it."""
    script, lib = _program(tmp_path), {"PYTHONPATH": str(tmp_path / "lib")}
    failing = forked_ranks.start(2, [str(script), "fail"], tmp_path / "fail.log",
                                 preload=("json",), env=lib)  # fmt: skip
    assert failing.wait(timeout=60) == 1, (tmp_path / "fail.log").read_text()
    running = forked_ranks.start(2, [str(script), "report", "x"], tmp_path / "report.log",
                                 preload=("json",), env=lib)  # fmt: skip
    assert running.wait(timeout=60) == 0, (tmp_path / "report.log").read_text()
    assert (tmp_path / "report.log").read_text().count("REPORT ") == 2
    sleeping = forked_ranks.start(2, [str(script), "sleep"], tmp_path / "sleep.log",
                                  preload=("json",), env=lib)  # fmt: skip
    assert os.getsid(sleeping.pid) == os.getpgid(sleeping.pid) == sleeping.pid
    time.sleep(1.0)
    assert sleeping.poll() is None
    ranks = _children(sleeping.pid)
    assert len(ranks) == 2 and all(os.getpgid(pid) == sleeping.pid for pid in ranks)
    os.killpg(sleeping.pid, signal.SIGKILL)
    assert sleeping.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 10  # the kill reached them with their launcher
    while any(_running(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_running(pid) for pid in ranks), ranks


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
