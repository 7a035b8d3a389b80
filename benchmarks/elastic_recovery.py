"""How long torchrun's elastic agent takes to bring ACCO back after a node is lost, and how many
updates are trained twice.

    python -m benchmarks.elastic_recovery            # ~5 min on 2 cores: 5 repeats

Two agents × 2 gloo ranks on loopback run ``examples/elastic_train.py``; at a random moment after
the first checkpoint one agent and its workers are SIGKILLed, and the survivor resumes on 2 ranks
(docs/multinode.md, "Measured recovery"). Writes ``outputs/results/elastic_recovery.json``
(``--out``; the published file: ``docs/results/elastic_recovery.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import ROOT, add_out_option, free_port, machine, write_result

# torchrun shares its rendezvous TCPStore with the workers by default; a node that joins a later
# rendezvous round then waits forever for bootstrap keys the store's owner wrote only in its
# first round (torch's dynamic_rendezvous.next_rendezvous). Building them every round works.
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}


def training_command(checkpoint_dir: Path, updates: int, microbatch_seconds: float,
                     *extra: str) -> list[str]:  # fmt: skip
    return ["-m", "examples.elastic_train", "--checkpoint-dir", str(checkpoint_dir),
            "--updates", str(updates), "--checkpoint-every", "4", "--timeout", "20",
            "--microbatch-seconds", str(microbatch_seconds), *extra]  # fmt: skip


def agent_command(port: int, training: list[str]) -> list[str]:
    """One node's torchrun: 1 to 2 nodes of 2 ranks, c10d rendezvous, 3 restarts."""
    return [sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "3",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "elastic", "--rdzv-conf", "last_call_timeout=10,join_timeout=120",
            "--monitor-interval", "0.5", *training]  # fmt: skip


def start_agent(command: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, **ELASTIC_ENV, "PYTHONPATH": str(ROOT)}
    with open(log, "w") as out:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_for_port(port: int, agent: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until the agent hosts the rendezvous store (the first agent on the endpoint does)."""
    deadline = time.time() + timeout_s
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if agent.poll() is not None or time.time() > deadline:
            raise RuntimeError("the first agent did not start its rendezvous store")
        time.sleep(0.1)


def wait_for_checkpoint(checkpoint: Path, agents: list[subprocess.Popen], log: Path,
                        timeout_s: float = 300) -> None:  # fmt: skip
    """Until DCP finished ``checkpoint`` (its ``.metadata`` is written last); raises with the
    end of ``log`` if an agent exits first or the time is up."""
    deadline = time.time() + timeout_s
    while not (checkpoint / ".metadata").exists():
        if any(a.poll() is not None for a in agents) or time.time() > deadline:
            raise RuntimeError(f"no checkpoint {checkpoint}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL an agent and every worker below it, as a node that loses power (torchrun starts
    each worker in a session of its own: killing the agent alone kills no worker)."""
    for pid in [agent.pid, *descendants(agent.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def attempts(checkpoint_dir: Path) -> list[dict]:
    """What ``examples/elastic_train.py`` logged of each start of its workers."""
    log = checkpoint_dir / "attempts.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def last_update(log: Path) -> int:
    found = re.findall(r"^update (\d+) on", log.read_text(), flags=re.MULTILINE)
    return int(found[-1]) if found else 0


def one_recovery(workdir: Path, updates: int, kill_after_s: float, checkpoint: int = 4) -> dict:
    """Two nodes start, one is killed ``kill_after_s`` after the checkpoint of update
    ``checkpoint`` (the first, every 4 updates); the survivor trains to the end."""
    checkpoint_dir, port = workdir / "ckpt", free_port()
    command = agent_command(port, training_command(checkpoint_dir, updates, 0.05))
    survivor = start_agent(command, workdir / "node0.log")
    doomed = None
    try:
        wait_for_port(port, survivor)  # the first agent hosts the rendezvous store: it survives
        doomed = start_agent(command, workdir / "node1.log")
        wait_for_checkpoint(checkpoint_dir / f"update_{checkpoint}", [survivor, doomed],
                            workdir / "node0.log")  # fmt: skip
        time.sleep(kill_after_s)
        reached = last_update(workdir / "node0.log")
        kill_node(doomed)
        killed_at = time.time()
        rc = survivor.wait(timeout=300)
    finally:
        for agent in (survivor, doomed):
            if agent is not None and agent.poll() is None:
                kill_node(agent)
    resumed = attempts(checkpoint_dir)[-1]
    return {
        "survivor_rc": rc, "kill_after_first_checkpoint_s": round(kill_after_s, 2),
        "update_reached": reached, "resumed_from_update": resumed["resumed_from_update"],
        "updates_redone": reached - (resumed["resumed_from_update"] or 0),
        "resumed_world_size": resumed["world_size"],
        "kill_to_first_resumed_step_s": round(resumed["first_step_done"] - killed_at, 2),
        "restarts": resumed["restart"],
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--updates", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    add_out_option(p, "elastic_recovery")
    args = p.parse_args()
    rng = random.Random(args.seed)
    runs = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            runs.append(one_recovery(Path(tmp), args.updates, rng.uniform(0.0, 6.0)))
        print(f"repeat {repeat}: {json.dumps(runs[-1])}", flush=True)
    times = [r["kill_to_first_resumed_step_s"] for r in runs]
    summary = {
        "all_survivors_rc_0": all(r["survivor_rc"] == 0 for r in runs),
        "kill_to_first_resumed_step_s": {"min": min(times), "median": statistics.median(times),
                                         "max": max(times)},
        "updates_redone": [r["updates_redone"] for r in runs],
    }  # fmt: skip
    print(json.dumps(summary))
    out = write_result(args.out, {
        "what": "2 torchrun agents x 2 gloo ranks on loopback, c10d rendezvous "
                "(last_call_timeout 10 s, monitor interval 0.5 s); one agent and its workers "
                "SIGKILLed; the survivor resumes on 2 ranks from the newest checkpoint "
                "(every 4 updates, ~0.2 s of compute per update)",
        "command": "python -m benchmarks.elastic_recovery", "machine": machine(),
        "summary": summary, "runs": runs,
    })  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
