"""How long a surviving rank takes to fail after its peer is SIGKILLed (gloo processes).

    python -m benchmarks.peer_death                 # ~10 s on 2 cores: 3 runs of 2 processes
    python -m benchmarks.peer_death --kills 50      # the kill loop: ~8 min on 2 cores

The scenario of ``tests/engine/test_faults.py::test_killed_rank_makes_the_survivor_fail_clearly``
(:func:`killed_peer_run`); the detection time runs from the SIGKILL to ``ACCOCommunicationError``
in the survivor's loop, on the same clock, so it includes at most one micro-batch of compute
(docs/reliability.md). Writes ``outputs/results/peer_death.json`` (or ``--out``; the published
file: ``docs/results/peer_death.json``).

**The kill loop** (``--kills N``, :func:`kill_loop_rank`): 4 ranks train in ``mode="acco"`` on a
model large enough that a round's ring exchange takes a while; one rank, drawn at random,
SIGKILLs itself at a random moment (its compute, its communication thread's ring step, its
round-end wait, all equally likely to be hit). The survivors do not exit when they fail: each
notes the time and stays alive, its engine not closed, until every survivor has failed (or
``--hold`` seconds pass). A survivor is therefore told of the death only by the engine, never by
a fellow survivor's exit closing its sockets: a rank whose ring receive waits on a live peer
that has already failed is the case that used to wait out the group's whole timeout. Each
kill's survivors' times from the SIGKILL to their error go to ``peer_death_kill_loop.json``.
The ranks are forks of the benchmark's process (imported once), and the store is the
benchmark's own (port 0), so any rank may be the one killed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
import random
import signal
import statistics
import tempfile
import threading
import time

import torch

from benchmarks.harness import add_out_option, header, result_file, run_ranks, write_result

KILL_BEFORE_ROUND = 5


def killed_peer_run(rank: int, world_size: int, stamp_dir: str) -> dict:
    """One rank: a tiny model trains in ``mode="acco"``; rank 1 notes the time and SIGKILLs
    itself before round 5, with round 4's communication in flight; rank 0 returns when and how
    the error reached it (the engine's ``timeout=`` plays no part: the dead peer's sockets
    close). ``tests/engine/test_faults.py`` runs it too, for the error's message."""
    from acco_hooks import ACCOCommunicationError, ACCOOptimizer

    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="acco", lr=1e-2, timeout=30)
    try:
        for r in range(50):
            if rank == 1 and r == KILL_BEFORE_ROUND:
                pathlib.Path(stamp_dir, "killed_at").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            g = torch.Generator().manual_seed(10_007 * rank + 101 * r)
            x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    except ACCOCommunicationError as exc:
        return {"error_at": time.time(), "round": r, "message": str(exc)}
    return {"error_at": None, "round": r, "message": "no error"}


# ------------------------------------------------------------------------------- the kill loop

KILL_LOOP_WORLD = 4
KILL_WINDOW_S = (1.0, 4.0)  # when the victim dies, after its engine was built
ENGINE_TIMEOUT_S = 60.0  # the groups' own timeout: a survivor that waits it out is a miss


def kill_loop_rank(rank: int, world_size: int, ports: multiprocessing.SimpleQueue, stamp_dir: str,
                   victim: int, delay_s: float, hold_s: float) -> None:  # fmt: skip
    """One rank of one kill: train until the engine fails (the victim: until it kills itself
    ``delay_s`` after its engine was built), write when and how, hold until the others have."""
    import torch.distributed as dist

    from acco_hooks import ACCOOptimizer

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", ports.get(), world_size + 1, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    torch.manual_seed(0)
    width = 384  # 3 x 384^2 parameters: a 1.8 MB gradient, a ring step of a few ms
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(3)))
    opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="acco", lr=1e-3,
                        timeout=ENGINE_TIMEOUT_S)  # fmt: skip
    if rank == victim:
        def die() -> None:
            pathlib.Path(stamp_dir, "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Timer(delay_s, die).start()
    outcome: dict = {"rank": rank}
    r = 0
    try:
        for r in range(1_000_000):
            g = torch.Generator().manual_seed(10_007 * rank + 101 * r)
            x = torch.randn(16, width, generator=g)
            model(x).square().mean().backward()
            opt.step()
    except Exception as exc:  # noqa: BLE001 - what reached the loop, whatever it is
        outcome.update(error_at=time.time(), round=r, error=type(exc).__name__,
                       message=str(exc).splitlines()[0][:300],
                       groups_left=len(opt.engine.process_groups))  # fmt: skip
    pathlib.Path(stamp_dir, f"rank{rank}.json").write_text(json.dumps(outcome))
    deadline = time.monotonic() + hold_s
    while (time.monotonic() < deadline
           and len(list(pathlib.Path(stamp_dir).glob("rank*.json"))) < world_size - 1):
        time.sleep(0.05)
    os._exit(0)  # the engine is left as the failure left it: nothing here closes it


def kill_loop(kills: int, hold_s: float, seed: int) -> list[dict]:
    """``kills`` runs of :func:`kill_loop_rank` on forked ranks; each run's survivors' times."""
    draw = random.Random(seed)
    fork = multiprocessing.get_context("fork")
    runs = []
    for kill in range(kills):
        victim, delay = draw.randrange(KILL_LOOP_WORLD), draw.uniform(*KILL_WINDOW_S)
        with tempfile.TemporaryDirectory() as stamp_dir:
            import torch.distributed as dist

            ports = fork.SimpleQueue()
            procs = [fork.Process(target=kill_loop_rank,
                                  args=(rank, KILL_LOOP_WORLD, ports, stamp_dir, victim, delay,
                                        hold_s))
                     for rank in range(KILL_LOOP_WORLD)]  # fmt: skip
            for proc in procs:
                proc.start()
            # the store (its server thread) starts after the forks: a fork copies no thread
            store = dist.TCPStore("127.0.0.1", 0, KILL_LOOP_WORLD + 1, is_master=True,
                                  wait_for_workers=False)  # fmt: skip
            for _ in procs:
                ports.put(store.port)
            for proc in procs:
                proc.join(ENGINE_TIMEOUT_S + hold_s + 60)
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
            del store
            killed_at = float(pathlib.Path(stamp_dir, "killed_at").read_text())
            survivors = []
            for rank in range(KILL_LOOP_WORLD):
                if rank == victim:
                    continue
                path = pathlib.Path(stamp_dir, f"rank{rank}.json")
                out = json.loads(path.read_text()) if path.exists() else {"rank": rank}
                if "error_at" in out:
                    out["detection_s"] = out["error_at"] - killed_at
                survivors.append(out)
        times = [s.get("detection_s") for s in survivors]
        print(f"kill {kill + 1}/{kills}: rank {victim} at {delay:.2f} s; survivors out after "
              + ", ".join("never" if t is None else f"{t:.2f} s" for t in times), flush=True)
        runs.append({"victim": victim, "delay_s": delay, "survivors": survivors})
    return runs


def kill_loop_main(args: argparse.Namespace) -> None:
    import acco_hooks  # noqa: F401 - imported once here, in every fork

    runs = kill_loop(args.kills, args.hold, args.seed)
    times = [s.get("detection_s") for run in runs for s in run["survivors"]]
    out_in_time = sum(t is not None and t <= 10.0 for t in times)
    results = {
        **header(), "torch": torch.__version__, "backend": "gloo (loopback)",
        "world_size": KILL_LOOP_WORLD, "mode": "acco", "engine_timeout_s": ENGINE_TIMEOUT_S,
        "ring": os.environ.get("ACCO_HOOKS_GLOO_RING", "1") != "0", "kills": args.kills,
        "seed": args.seed, "survivors": len(times), "survivors_out_within_10s": out_in_time,
        "detection_s_max": max((t for t in times if t is not None), default=None),
        "detection_s_median": statistics.median(t for t in times if t is not None)
        if any(t is not None for t in times) else None,
        "runs": runs,
    }  # fmt: skip
    path = write_result(args.out, results)
    print(f"{out_in_time} of {len(times)} survivors out within 10 s of the kill "
          f"({args.kills} kills); slowest {results['detection_s_max']}; wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kills", type=int, default=0,
                   help="run the kill loop: this many kills of a random rank of 4 (0: the 2-rank runs)")
    p.add_argument("--hold", type=float, default=15.0,
                   help="kill loop: how long a failed survivor stays alive for the others (s)")
    p.add_argument("--seed", type=int, default=0, help="kill loop: the draw of victims and moments")
    add_out_option(p, "peer_death", default="peer_death.json, or peer_death_kill_loop.json with --kills")
    args = p.parse_args()
    if args.kills:
        args.out = args.out or result_file("peer_death_kill_loop")
        kill_loop_main(args)
        return
    args.out = args.out or result_file("peer_death")
    runs = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as stamp_dir:
            survivor, dead = run_ranks("benchmarks.peer_death:killed_peer_run", 2, stamp_dir,
                                       may_die=(1,))  # fmt: skip
            killed_at = float(pathlib.Path(stamp_dir, "killed_at").read_text())
        assert dead is None and survivor["error_at"] is not None, survivor
        runs.append({**survivor, "killed_at": killed_at,
                     "detection_s": survivor["error_at"] - killed_at})  # fmt: skip
    detection = [run["detection_s"] for run in runs]
    results = {
        **header(), "torch": torch.__version__, "backend": "gloo (loopback)", "world_size": 2,
        "mode": "acco", "engine_timeout_s": 30, "killed_before_round": KILL_BEFORE_ROUND,
        "detection_s": detection, "detection_s_median": statistics.median(detection),
        "runs": runs,
    }  # fmt: skip
    out = write_result(args.out, results)
    print(f"SIGKILL of rank 1 -> ACCOCommunicationError on rank 0, {args.repeats} runs (gloo):")
    for run in runs:
        print(f"  {run['detection_s'] * 1e3:7.1f} ms (raised in round {run['round']}): "
              f"{run['message'].splitlines()[0][:90]}")  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
