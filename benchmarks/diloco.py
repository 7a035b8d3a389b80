"""ACCO beside torchft's DiLoCo and synchronous training: which reaches a held-out loss first on
a slow link.

    sudo python -m benchmarks.diloco                  # everything below, ~95 min here
    python -m benchmarks.diloco --phase convergence   # the lr sweep and the seeds (no root)
    sudo python -m benchmarks.diloco --phase timing   # seconds per step on every link
    sudo python -m benchmarks.diloco --phase check    # one full run on a capped link
    sudo python -m benchmarks.diloco --phase heterogeneous   # replica 1 2x and 4x slower
    sudo python -m benchmarks.diloco --phase heterogeneous --replica-layouts fsdp tp \
        --straggler-factors 4                         # replicas of 2 ranks; a straggler
    python -m benchmarks.diloco --phase report        # the table and the figure, from the JSON

Every arm trains torchtitan's Llama-3 debug model on the benchmark corpus
(``benchmarks/convergence/data.py``: sequences of 64 tokens shuffled by the seed) with two
data-parallel replicas, one process each, the same 16 sequences per optimizer update (a DiLoCo
inner step: 8 per replica), the same AdamW and warm-up/cosine schedule (``--updates`` updates),
and is scored on the same held-out set (32 batches of 4 sequences per replica, 64 in all),
every ``--heldout-every`` updates:

* synchronous: torchtitan's own DDP (``titan_ddp``) and the engine's ``ddp`` (ZeRO-1);
* ACCO: ``auto`` and the paper's ``acco`` (two rounds of 8 sequences per update);
* torchft DiLoCo through torchtitan's fault-tolerant trainer
  (``benchmarks/convergence/ft_train.py``), one replica group per process and a lighthouse: H = 5 and 20 inner steps between syncs, and
  streaming DiLoCo (2 fragments, each synced every 20 steps, the sync one step late).

The held-out loss per token does not depend on the link, so the runs that score it (each arm's
learning rate sweep, then a second seed at the best) run once, on loopback; short runs of each arm
on each capped link (``benchmarks/netbed.py``, two network namespaces, one core each) give its
seconds per update, over whole DiLoCo sync periods. An arm's wall time to a loss is then its
updates to that loss (linear between held-out points) times its seconds per update on the link;
``auto`` times its schedules on each link and may choose another there than on loopback: then
its loopback curve is not its curve on the link, and it trains in full there, on every seed,
and counts from that run. ``--phase check`` runs one arm in full on a capped link to test
the product. The target is
the final held-out loss of the synchronous arm (torchtitan's DDP), seed by seed, and its loss at
¾ of its run (:func:`summary` says why); where DiLoCo's runs fall short of it, its long runs
(``--diloco-updates``) count the updates it needs.

``--phase heterogeneous`` slows replica 1's compute ``--slow-factors`` times (the hooks of
``benchmarks/convergence/slow_rank.py``), or ``--straggler-factors`` times in the middle third
of the run only (a node that recovers), with no cap and on ``--heterogeneous-rates``: the
synchronous arms, ``auto`` and streaming DiLoCo are timed so (their updates do not change: each
waits for the slow replica, at its sum or its sync), and ``acco_until_ready`` (acco with
``accumulate_until_ready``: the fast replica runs micro-batches while the round communicates)
trains in full on the link, each seed, since what its updates hold depends on the timing.
``--replica-layouts fsdp tp`` gives each replica two ranks on its host's core, split by FSDP
(torchtitan's HSDP; DiLoCo groups of two FSDP ranks) or by TP (torchtitan's DDP does not
compose with TP: the engine's ``ddp`` is the synchronous arm there); each layout's runs go
to the result file's ``heterogeneous_<layout>``. A layout's torchtitan jobs start from the
weights one unsharded process makes (:func:`seed_checkpoint`) and score the held-out batches of
one rank a replica; its synchronous arm trains unslowed in full once per seed
(``layout_runs``), which gives the layout's targets (:func:`layout_curve`).

DiLoCo's score is the synchronized model's: every held-out point is a multiple of H, right after
a sync, when both replicas hold the same parameters, and each replica scores half of the held-out
set, as each rank of the two-rank arms does (streaming DiLoCo has no such moment: one fragment is
10 local steps past its sync; its score is the two replicas' mean). Results:
``outputs/results/diloco_vs_acco.json`` (``--out``; rewritten after every run; a run already
there is kept), figure ``diloco_vs_acco.png`` beside it (``--figure``); the published ones,
``docs/results/diloco_vs_acco.json`` and ``docs/figures/diloco_vs_acco.png``, come from ``--out
docs/results/diloco_vs_acco.json``; what they show: ``docs/when_acco_helps.md``.
Needs torchft, the ``diloco`` extra (``pip install -e '.[diloco]'``; ``scripts/setup.sh``
installs it with the rest) and torchtitan 0.2.2 (0.3.0 moved the fault-tolerant trainer).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence

from benchmarks import harness
from benchmarks.convergence import data
from benchmarks.convergence.ft_train import HOSTNAME_ENV, OUTER_LR_ENV
from benchmarks.convergence.run import HELDOUT_DATASET, parse_log
from benchmarks.convergence.slow_rank import (
    HELDOUT_RANKS_ENV,
    SLOW_FACTOR_ENV,
    SLOW_RANK_ENV,
    SLOW_STEPS_ENV,
)
from benchmarks.harness import ROOT, header, step_lines, write_result

WORKDIR = ROOT / "outputs" / "diloco"
# no cap (the veth pair runs at ~9 Gbit/s here, CPU-bound: the 10 Gbit point), then the caps
RATES = ("none", "1gbit", "200mbit", "100mbit", "50mbit")
SEQ_LEN, LOCAL_BATCH = 64, 4
UPDATE_BATCH = 16  # sequences per optimizer update, both replicas (--sequences-per-update)
HELDOUT_BATCHES = 32  # per replica: 64 batches of 4 sequences in all
# the sweep's middle: DDP's held-out loss fell from 8e-4 (the debug configs' lr) to 3.2e-3
BASE_LR = 3.2e-3
INNER_LR_FACTORS = (0.5, 1.0, 2.0)
OUTER_LRS = (0.7, 0.4)  # torchtitan's, and one below it
HOOKS_MODULE = "benchmarks.convergence.slow_rank"  # its fixed held-out batches
LINK_LOG_UPDATES = 5  # a run on a link logs every 5 updates (held-out points: every 20)
AUTO_RUNS = re.compile(r"acco auto: runs (?P<schedule>.*?): (?P<speedup>[\d.]+)x")
# the engine's measurement of one round: K (compute) and C (communication)
ADVISOR = re.compile(
    r"acco advisor: compute_per_round=(?P<K>[\d.]+)s comm_per_round=(?P<C>[\d.]+)s")


@dataclasses.dataclass(frozen=True)
class Arm:
    """One method: how it launches, its job config and overrides, and its rounds per update."""

    kind: str  # "titan": train_titan.py on 2 ranks; "ft": 2 torchft replica groups
    config: str  # relative to the checkout's root
    overrides: tuple[str, ...] = ()
    rounds_per_update: int = 1  # acco: an update takes two torchtitan steps
    sync_steps: int = 1  # DiLoCo's H: timing covers whole periods, held-out points are multiples

    @property
    def diloco(self) -> bool:
        return self.kind == "ft"


def _diloco(h: int, *extra: str) -> Arm:
    return Arm("ft", "benchmarks/convergence/debug_cpu_diloco.toml",
               ("--fault_tolerance.sync_steps", str(h), *extra),
               sync_steps=h)  # fmt: skip


ARMS: dict[str, Arm] = {
    "titan_ddp": Arm("titan", "torchtitan_configs/debug_cpu_titan_ddp.toml"),
    "ddp": Arm("titan", "torchtitan_configs/debug_cpu_ddp.toml"),
    "auto": Arm("titan", "torchtitan_configs/debug_cpu_ddp.toml", ("--acco.mode", "auto")),
    "acco": Arm("titan", "torchtitan_configs/debug_cpu_acco.toml", rounds_per_update=2),
    "diloco_h5": _diloco(5),
    "diloco_h20": _diloco(20),
    "streaming_diloco_h20": _diloco(20, "--fault_tolerance.num_fragments", "2",
                                    "--fault_tolerance.fragment_sync_delay", "1"),
}
# replica 1 slowed: acco whose fast replica accumulates while the round communicates
ARMS["acco_until_ready"] = dataclasses.replace(
    ARMS["acco"], overrides=("--acco.accumulate_until_ready",))
SWEPT_ARMS = tuple(name for name in ARMS if name != "acco_until_ready")  # the default --arms
HETEROGENEOUS_ARMS = ("titan_ddp", "ddp", "auto", "acco_until_ready", "streaming_diloco_h20")
TARGET_ARM = "titan_ddp"
# --replica-layouts: what splits each replica (a node) over its ranks, as the job's settings.
# "rank" is one rank a replica; the others give each replica two ranks on its host's core.
REPLICA_LAYOUTS: dict[str, tuple[str, ...]] = {
    "rank": (),
    "fsdp": ("--parallelism.data_parallel_shard_degree", "2"),
    "tp": ("--parallelism.tensor_parallel_degree", "2"),
}
# DiLoCo's long runs; H = 5 only runs --updates (it trained worst per token)
LONG_ARMS = ("diloco_h20", "streaming_diloco_h20")


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run: an arm at a learning rate (and DiLoCo's outer one) and a seed."""

    arm: str
    lr: float
    seed: int
    outer_lr: float | None = None
    updates: int | None = None  # None: --updates; more for a DiLoCo arm's long run

    @property
    def key(self) -> str:
        outer = "" if self.outer_lr is None else f"/outer{self.outer_lr:g}"
        longer = "" if self.updates is None else f"/updates{self.updates}"
        return f"{self.arm}/lr{self.lr:g}{outer}/seed{self.seed}{longer}"


# ----------------------------------------------------------------------------- launching


@dataclasses.dataclass
class Place:
    """Where a job's two processes run: loopback, or the two hosts of a netbed link."""

    link: object | None = None  # benchmarks.netbed.Link
    layout: str = "rank"  # REPLICA_LAYOUTS: each host runs one replica of 1 or 2 ranks

    @property
    def ranks_per_host(self) -> int:
        return 1 if self.layout == "rank" else 2

    def ip(self, host: int) -> str:
        return self.link.ip[host] if self.link else "127.0.0.1"

    def prefix(self, host: int) -> list[str]:
        netns = ["ip", "netns", "exec", self.link.ns[host]] if self.link else []
        return [*netns, "taskset", "-c", str(host)]

    def env(self, host: int) -> dict[str, str]:
        env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        if self.link:
            env["GLOO_SOCKET_IFNAME"] = self.link.ifname[host]
        return env


@contextlib.contextmanager
def _processes() -> Iterator[list[subprocess.Popen]]:
    """Processes started into the yielded list, each in its own session: whatever happens
    (an error, Ctrl-C, SIGTERM through netbed's handler), every one of them and what it started
    is killed on the way out."""
    procs: list[subprocess.Popen] = []
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in procs:
            proc.wait()


def _start(procs: list, cmd: list[str], env: dict[str, str], log: pathlib.Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w", encoding="utf-8") as out:
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=out,
                                      stderr=subprocess.STDOUT, start_new_session=True))


def _wait(procs: list[subprocess.Popen], timeout_s: float) -> int:
    """Wait for ``procs``: the first non-zero status, or 124 on timeout. A failed process ends
    the job at once (its peer would wait out a collective's timeout)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = [p.poll() for p in procs]
        if any(s not in (None, 0) for s in status):
            return next(s for s in status if s not in (None, 0))
        if all(s == 0 for s in status):
            return 0
        time.sleep(0.5)
    return 124


def launch_job(arm: Arm, argv: list[str], env: dict[str, str], place: Place,
               run_dir: pathlib.Path, timeout_s: float, slow_factor: float = 1.0,
               slow_steps: tuple[int, int] | None = None) -> tuple[int, list[str]]:  # fmt: skip
    """The processes of one job (and DiLoCo's lighthouse): the exit status, and the log of each
    host's first process (``host0.log``, ``host1.log``; a second rank on a host logs to
    ``host<h>_rank1.log``).

    Each host runs one replica: ``place.ranks_per_host`` processes on its core. ``titan``:
    ``train_titan.py``, every process a rank of one job (host 1's ranks after host 0's).
    ``ft``: two groups, each its own world on its host (torchft's cross-group gloo group joins
    them), and a lighthouse on host 0 that forms a quorum only with both groups in it.
    ``slow_factor``: host 1's processes (replica 1) compute that many times slower
    (``slow_rank``), in torchtitan steps ``slow_steps`` (first, end) only if given."""
    per_host = place.ranks_per_host
    logs = [[run_dir / (f"host{host}.log" if local == 0 else f"host{host}_rank{local}.log")
             for local in range(per_host)] for host in (0, 1)]  # fmt: skip
    port = harness.free_port()
    group_ports = [harness.free_port(), harness.free_port()]  # ft: each group's own store
    with _processes() as procs:
        if arm.diloco:
            lighthouse_port = harness.free_port()
            lighthouse = shutil.which("torchft_lighthouse", path=os.path.dirname(sys.executable))
            if lighthouse is None:
                raise SystemExit("benchmarks.diloco: torchft_lighthouse not found: install the "
                                 "extra, pip install -e '.[diloco]'")  # fmt: skip
            _start(procs, [*place.prefix(0), lighthouse, "--min_replicas", "2",
                           "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
                           "--bind", f"[::]:{lighthouse_port}"],
                   {}, run_dir / "lighthouse.log")  # fmt: skip
        for host, local in ((h, i) for h in (0, 1) for i in range(per_host)):
            host_env = {**place.env(host), **env, "LOCAL_RANK": str(local),
                        "LOCAL_WORLD_SIZE": str(per_host)}  # fmt: skip
            if arm.diloco:
                host_env.update({
                    "RANK": str(local), "WORLD_SIZE": str(per_host),
                    "MASTER_ADDR": place.ip(host), "MASTER_PORT": str(group_ports[host]),
                    HOSTNAME_ENV: place.ip(host),
                    "TORCHFT_LIGHTHOUSE": f"http://{place.ip(0)}:{lighthouse_port}",
                })  # fmt: skip
                cmd = [*argv, "--fault_tolerance.replica_id", str(host)]
            else:
                host_env.update({"RANK": str(host * per_host + local),
                                 "WORLD_SIZE": str(2 * per_host),
                                 "MASTER_ADDR": place.ip(0), "MASTER_PORT": str(port),
                                 # the held-out batches of one rank a replica, in every layout
                                 HELDOUT_RANKS_ENV: "2"})  # fmt: skip
                cmd = argv
            if host == 1 and slow_factor != 1.0:
                host_env.update({SLOW_RANK_ENV: host_env["RANK"],
                                 SLOW_FACTOR_ENV: f"{slow_factor:g}"})  # fmt: skip
                if slow_steps is not None:
                    host_env[SLOW_STEPS_ENV] = f"{slow_steps[0]}:{slow_steps[1]}"
            _start(procs, [*place.prefix(host), *cmd], host_env, logs[host][local])
        # the lighthouse runs until it is killed
        status = _wait(procs[-2 * per_host:], timeout_s)
    return status, [host_logs[0].read_text(encoding="utf-8", errors="replace")
                    for host_logs in logs]  # fmt: skip


def seed_checkpoint(seed: int) -> pathlib.Path:
    """The initial weights of ``seed`` as one unsharded process makes them (torchtitan's
    ``--checkpoint.create_seed_checkpoint``; made once, then kept under the work folder).

    A run whose replicas are split by FSDP or TP starts from them: torchtitan initializes a
    sharded model with other random values than a whole one (the engine's ddp under TP, whose
    ranks read the data of one rank a replica, scored 7.940 after its first update against
    7.902 whole; started from this checkpoint, 7.902 and after 5 updates the same 6.591), so
    a layout's runs would not start where the convergence runs of one rank a replica did."""
    dump = WORKDIR / "seed_checkpoints" / f"seed{seed}"
    path = dump / "checkpoint" / "step-0"
    if path.is_dir():
        return path
    shutil.rmtree(dump, ignore_errors=True)
    argv = [sys.executable, "train_titan.py", "--job.config_file", ARMS["titan_ddp"].config,
            "--job.dump_folder", str(dump), "--debug.seed", str(seed), "--acco.no-enable",
            "--parallelism.data_parallel_replicate_degree", "1", "--checkpoint.enable",
            "--checkpoint.create_seed_checkpoint"]  # fmt: skip
    env = {**os.environ, **Place().env(0), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(harness.free_port())}  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode or not path.is_dir():
        raise SystemExit(f"benchmarks.diloco: the seed checkpoint of seed {seed} failed:\n"
                         f"{done.stdout[-3000:]}{done.stderr[-3000:]}")  # fmt: skip
    return path


def job_argv(name: str, run: Run, steps: int, run_dir: pathlib.Path, heldout_every: int = 0,
             sequences_per_update: int = UPDATE_BATCH, log_every: int = 1,
             layout: str = "rank") -> list[str]:  # fmt: skip
    """The command line of one process of ``run`` for ``steps`` torchtitan steps, logging every
    ``log_every`` steps (and the first and last), each replica split as ``layout`` says."""
    arm = ARMS[name]
    script = ["-m", "benchmarks.convergence.ft_train"] if arm.diloco else ["train_titan.py"]
    dataset = data.prepare("stdlib", "sequences", run.seed, SEQ_LEN)
    argv = [sys.executable, *script,
            "--job.config_file", arm.config,
            "--job.dump_folder", str(run_dir / "dump"), "--metrics.disable_color_printing",
            "--training.steps", str(steps), "--debug.seed", str(run.seed),
            "--training.dataset_path", str(dataset.relative_to(ROOT)),
            "--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", str(LOCAL_BATCH),
            "--training.global_batch_size", str(sequences_per_update // arm.rounds_per_update),
            "--optimizer.lr", f"{run.lr:g}", "--experimental.custom_import", HOOKS_MODULE,
            "--metrics.log_freq", str(log_every), *arm.overrides,
            *REPLICA_LAYOUTS[layout]]  # fmt: skip
    if layout != "rank" and not arm.diloco:  # the weights one rank a replica starts from
        argv += ["--checkpoint.enable", "--checkpoint.load_only",
                 "--checkpoint.initial_load_path", str(seed_checkpoint(run.seed))]  # fmt: skip
    if arm.diloco:
        argv += ["--fault_tolerance.min_replica_size", "2"]
    if heldout_every:
        argv += ["--validation.enable", "--validation.dataset", HELDOUT_DATASET,
                 "--validation.freq", str(heldout_every * arm.rounds_per_update),
                 "--validation.steps", str(HELDOUT_BATCHES),
                 "--validation.local_batch_size", str(LOCAL_BATCH),
                 "--validation.seq_len", str(SEQ_LEN)]  # fmt: skip
    return argv


def job_env(run: Run) -> dict[str, str]:
    return {"LOG_RANK": "0"} | ({OUTER_LR_ENV: f"{run.outer_lr:g}"} if run.outer_lr else {})


# ----------------------------------------------------------------------------- convergence


def train(run: Run, args: argparse.Namespace, place: Place | None = None,
          where: str | None = None, slow_factor: float = 1.0,
          slow_updates: tuple[int, int] | None = None) -> dict:  # fmt: skip
    """One run with held-out points: its held-out curve (per update), its step times, and
    ``auto``'s schedule. ``where``: its folder under the work folder (by default
    ``convergence``, or ``check`` on a link). ``slow_updates``: replica 1 is slowed in these
    updates (first, end) only."""
    arm = ARMS[run.arm]
    place = place or Place()
    where = where or ("check" if place.link else "convergence")
    run_dir = WORKDIR / where / run.key
    shutil.rmtree(run_dir, ignore_errors=True)
    updates = run.updates or args.updates
    steps = updates * arm.rounds_per_update
    # On a link a step's logged loss is an all-reduce that waits behind an overlapped round's
    # traffic (up to the tbf queue's 50 ms each way): logged every step, it would cost the
    # overlapped arms what a run at torchtitan's default (every 10 steps) does not pay
    log_every = LINK_LOG_UPDATES * arm.rounds_per_update if place.link else 1
    argv = job_argv(run.arm, run, steps, run_dir, args.heldout_every, args.sequences_per_update,
                    log_every, place.layout)  # fmt: skip
    # torchtitan counts steps from 1: update u is steps u * rounds + 1 to (u + 1) * rounds
    slow_steps = slow_updates and tuple(u * arm.rounds_per_update + 1 for u in slow_updates)
    start = time.time()
    status, outputs = launch_job(arm, argv, job_env(run), place, run_dir, 3600, slow_factor,
                                 slow_steps)  # fmt: skip
    parsed = [parse_log(text).get(0, {}) for text in outputs]
    # two-rank arms: rank 0 logs the mean over the ranks; DiLoCo: each group its own half
    scored = parsed if arm.diloco else parsed[:1]
    points = [dict(zip(p.get("heldout_step", []), p.get("heldout_loss", []))) for p in scored]
    common = sorted(set.intersection(*(set(p) for p in points))) if points else []
    main = parsed[0]
    record = {
        **dataclasses.asdict(run), "returncode": status, "wall_s": round(time.time() - start, 1),
        "updates": updates, "heldout_every": args.heldout_every,
        "heldout_updates": [s // arm.rounds_per_update for s in common],
        "heldout_steps": common,  # acco's first is step 1, in update 0
        "heldout_loss": [statistics.fmean(p[s] for p in points) for s in common],
        "heldout_loss_per_replica": [[p[s] for s in common] for p in points],
        "step_ts": main.get("ts", []), "step": main.get("step", []),
        "heldout_ts": main.get("heldout_ts", []), "start_ts": start,
        "log": str(run_dir / "host0.log"),
    }  # fmt: skip
    if match := list(AUTO_RUNS.finditer(outputs[0])):
        record["auto_schedule"] = match[-1]["schedule"]
    record["complete"] = status == 0 and record["heldout_updates"][-1:] == [updates]
    record["long"] = run.updates is not None
    return record


def sweep_runs(stage: str, arms: Sequence[str], args: argparse.Namespace,
               best: dict[str, Run]) -> list[Run]:  # fmt: skip
    """The runs of one stage of the sweep (the seed of the sweep is ``args.seeds[0]``):

    * ``inner``: every arm at the inner lr x0.5, x1, x2 of :data:`BASE_LR` (DiLoCo at
      torchtitan's outer lr, 0.7);
    * ``edge``: an arm whose best is at an end of that range, one step further (x0.25 or x4),
      so that no arm is compared at an lr its sweep did not bracket;
    * ``outer``: DiLoCo's other outer lr at its best inner lr; ``outer_edge``: where that one
      is the better, half of it;
    * ``seeds``: each arm's best on the other seeds;
    * ``long``: DiLoCo's best (H = 20, plain and streaming) on every seed for
      ``args.diloco_updates`` updates, its schedule stretched over them: how many updates it
      needs where ``--updates`` do not reach the synchronous arm's loss (on a slow link it
      spends them faster).
    """
    seed = args.seeds[0]
    factors = (INNER_LR_FACTORS[0] / 2, *INNER_LR_FACTORS, INNER_LR_FACTORS[-1] * 2)
    if stage == "inner":
        return [Run(name, BASE_LR * f, seed, OUTER_LRS[0] if ARMS[name].diloco else None)
                for name in arms for f in INNER_LR_FACTORS]  # fmt: skip
    if stage == "edge":
        runs = []
        for name in arms:
            at = round(best[name].lr / BASE_LR, 6)
            if at in (INNER_LR_FACTORS[0], INNER_LR_FACTORS[-1]):
                further = factors[0] if at == INNER_LR_FACTORS[0] else factors[-1]
                runs.append(dataclasses.replace(best[name], lr=BASE_LR * further))
        return runs
    if stage == "outer":
        return [dataclasses.replace(best[name], outer_lr=outer)
                for name in arms if ARMS[name].diloco for outer in OUTER_LRS[1:]]  # fmt: skip
    if stage == "outer_edge":  # the lower outer lr won: one step further down
        return [dataclasses.replace(best[name], outer_lr=OUTER_LRS[-1] / 2) for name in arms
                if ARMS[name].diloco and best[name].outer_lr == OUTER_LRS[-1]]  # fmt: skip
    if stage == "seeds":
        return [dataclasses.replace(best[name], seed=s) for s in args.seeds[1:] for name in arms]
    return [dataclasses.replace(best[name], seed=s, updates=args.diloco_updates)
            for name in arms if name in LONG_ARMS and args.diloco_updates for s in args.seeds]


def best_runs(results: dict, seed: int) -> dict[str, Run]:
    """Each arm's run with the lowest final held-out loss on ``seed`` (long runs left out)."""
    best: dict[str, tuple[float, Run]] = {}
    for record in results["convergence"].values():
        if record["seed"] != seed or not record["complete"] or record.get("long"):
            continue
        loss = record["heldout_loss"][-1]
        run = Run(record["arm"], record["lr"], seed, record["outer_lr"])
        if record["arm"] not in best or loss < best[record["arm"]][0]:
            best[record["arm"]] = (loss if math.isfinite(loss) else math.inf, run)
    return {name: run for name, (_, run) in best.items()}


def convergence(results: dict, args: argparse.Namespace) -> None:
    for stage in ("inner", "edge", "outer", "outer_edge", "seeds", "long"):
        best = best_runs(results, args.seeds[0])
        if stage != "inner" and not set(args.arms) <= set(best):
            raise SystemExit(f"benchmarks.diloco: no complete run of {set(args.arms) - set(best)}")
        for run in sweep_runs(stage, args.arms, args, best):
            old = results["convergence"].get(run.key)
            if old and old["complete"] and old["updates"] == (run.updates or args.updates):
                continue
            print(f"convergence {run.key}", flush=True)
            record = results["convergence"][run.key] = train(run, args)
            write_result(args.out, results)
            print(f"    rc={record['returncode']} wall={record['wall_s']}s held-out "
                  f"{[round(v, 4) for v in record['heldout_loss']]}", flush=True)  # fmt: skip
            if not record["complete"]:
                raise SystemExit(f"benchmarks.diloco: {run.key} failed, see {record['log']}")
    results["best"] = {str(seed): {name: run.key for name, run in best_runs(results, seed).items()}
                       for seed in args.seeds}  # fmt: skip


# ----------------------------------------------------------------------------- timing


def timed_steps(name: str) -> tuple[int, int]:
    """(first, last) torchtitan step of a timing run's window: past the warm-up and, for
    ``auto``, past its decision (5 synchronous + up to 15 trial + 10 confirming updates); for
    DiLoCo, two whole sync periods, from just after one sync to just after another."""
    arm = ARMS[name]
    if arm.diloco:
        return arm.sync_steps, 3 * arm.sync_steps
    if name == "auto":
        return 32, 40
    return 4 * arm.rounds_per_update, 12 * arm.rounds_per_update  # logged at 4, 8 and 12


def time_arm(name: str, run: Run, place: Place, sequences_per_update: int = UPDATE_BATCH,
             slow_factor: float = 1.0) -> dict:  # fmt: skip
    """Seconds per optimizer update of ``run`` on ``place``'s link, over :func:`timed_steps`
    (replica 1 ``slow_factor`` times slower)."""
    arm = ARMS[name]
    first, last = timed_steps(name)
    slowed = "" if slow_factor == 1.0 else f"slow{slow_factor:g}x"
    layout = "" if place.layout == "rank" else f"replicas_{place.layout}"
    run_dir = WORKDIR / "timing" / layout / slowed / place.link.rate / name
    shutil.rmtree(run_dir, ignore_errors=True)
    # the window's ends alone (see train(): a logged loss waits behind the round's traffic)
    argv = job_argv(name, run, last, run_dir, sequences_per_update=sequences_per_update,
                    log_every=math.gcd(first, last), layout=place.layout)  # fmt: skip
    status, outputs = launch_job(arm, argv, job_env(run), place, run_dir, 1800, slow_factor)
    ts = {row["step"]: row["ts"] for row in step_lines(outputs[0])}
    if status or first not in ts or last not in ts:
        raise SystemExit(f"benchmarks.diloco: timing {name} at {place.link.rate} failed "
                         f"(status {status}), see {run_dir}")  # fmt: skip
    update_s = (ts[last] - ts[first]) / (last - first) * arm.rounds_per_update
    result = {"update_s": update_s, "tokens_per_s": sequences_per_update * SEQ_LEN / update_s,
              "window": [first, last]}  # fmt: skip
    if match := list(AUTO_RUNS.finditer(outputs[0])):
        result["auto_schedule"] = match[-1]["schedule"]
    if match := ADVISOR.search(outputs[0]):  # the engine's arms: K and C of their rounds
        result["advisor"] = {"compute_per_round_s": float(match["K"]),
                             "comm_per_round_s": float(match["C"])}  # fmt: skip
    return result


def timing(results: dict, args: argparse.Namespace) -> None:
    from benchmarks.netbed import two_host_link

    best = best_runs(results, args.seeds[0])
    with two_host_link() as link:
        for rate in args.rates:
            link.set_rate(rate)
            for name in args.arms:
                if name in results["timing"].get(rate, {}):
                    continue
                run = best.get(name, Run(name, BASE_LR, args.seeds[0], OUTER_LRS[0] if
                                         ARMS[name].diloco else None))  # fmt: skip
                result = time_arm(name, run, Place(link), args.sequences_per_update)
                ran = results["convergence"].get(run.key, {}).get("auto_schedule")
                if name == "auto" and ran is not None and ran != result.get("auto_schedule"):
                    # its loopback runs' updates are not the ones it makes here: their
                    # held-out curve says nothing of this link's, which it trains in full
                    result["runs"] = train_on_link(name, run.lr, args, Place(link),
                                                   f"timing/{rate}")  # fmt: skip
                results["timing"].setdefault(rate, {})[name] = result
                write_result(args.out, results)
                print(f"timing {rate:>8} {name:>22}: {result['update_s']:.3f} s/update "
                      f"{result.get('auto_schedule', '')}", flush=True)  # fmt: skip


def train_on_link(name: str, lr: float, args: argparse.Namespace, place: Place, where: str,
                  slow_factor: float = 1.0,
                  slow_updates: tuple[int, int] | None = None) -> dict[str, dict]:  # fmt: skip
    """``name`` at ``lr`` in full on ``place``'s link, each seed: for an arm whose updates
    depend on the link (``acco_until_ready``; ``auto`` where it chose another schedule than on
    loopback), whose held-out curve the loopback runs cannot give. Per seed: its held-out curve
    and its training seconds to each point (:func:`training_seconds`, from the start)."""
    runs = {}
    for seed in args.seeds:
        run = Run(name, lr, seed)
        record = train(run, args, place, where=where, slow_factor=slow_factor,
                       slow_updates=slow_updates)  # fmt: skip
        if not record["complete"]:
            raise SystemExit(f"benchmarks.diloco: {run.key} in {where} failed, see {record['log']}")
        runs[str(seed)] = {key: record[key] for key in (
            "lr", "seed", "heldout_updates", "heldout_loss", "wall_s", "log")}  # fmt: skip
        if "auto_schedule" in record:
            runs[str(seed)]["auto_schedule"] = record["auto_schedule"]
        runs[str(seed)]["training_s"] = training_seconds(
            record, ARMS[name].rounds_per_update, from_zero=True)
        print(f"{where} {name} seed {seed}: held-out "
              f"{[round(v, 4) for v in record['heldout_loss']]}", flush=True)  # fmt: skip
    return runs


# ----------------------------------------------------------------------------- heterogeneous


def same_schedule(ran: str | None, chosen: str | None) -> bool:
    """Whether ``auto`` ran the same updates under two schedules it printed: the same, or
    synchronous both times (its micro-batches per update per rank follow the number of
    data-parallel ranks, which a layout changes: 4 on 2 ranks, 2 on 4 FSDP ranks)."""
    return ran == chosen or all(str(s).startswith("synchronous") for s in (ran, chosen))


def layout_arms(layout: str) -> tuple[str, ...]:
    """The arms of :data:`HETEROGENEOUS_ARMS` that run with replicas split as ``layout`` says:
    torchtitan's DDP composes with no other parallelism (its llama3 ``parallelize`` refuses DDP
    beside TP), so under TP the synchronous arm is the engine's ``ddp`` alone."""
    return tuple(n for n in HETEROGENEOUS_ARMS if not (layout == "tp" and n == "titan_ddp"))


def heterogeneous_key(layout: str) -> str:
    """The result file's key of ``layout``'s slowed runs: ``heterogeneous`` for one rank a
    replica (the runs before replicas of two ranks existed), ``heterogeneous_<layout>`` else."""
    return "heterogeneous" if layout == "rank" else f"heterogeneous_{layout}"


def slowdowns(args: argparse.Namespace) -> dict[str, tuple[float, tuple[int, int] | None]]:
    """Each slowdown of replica 1 by its name in the result file: its factor, and the updates
    (first, end) it lasts, None for the whole run. ``--straggler-factors``: slowed for the
    middle third of the run only (a node that recovers)."""
    third = args.updates // 3
    return {**{f"{f:g}x": (f, None) for f in args.slow_factors},
            **{f"{f:g}x_middle_third": (f, (third, 2 * third)) for f in args.straggler_factors}}


def heterogeneous(results: dict, args: argparse.Namespace) -> None:
    """Replica 1 slowed (:func:`slowdowns`), on each of ``args.heterogeneous_rates``, with each
    replica split as each of ``args.replica_layouts`` says: each arm of :func:`layout_arms` at
    its best learning rate (``acco_until_ready`` at acco's).

    The others' updates are what they were (each waits for the slow replica), so their
    convergence runs stand and a timing run gives their seconds per update: slowed, and, for a
    straggler that recovers, unslowed too (its run is slowed in the middle third only);
    acco_until_ready's updates hold what the fast replica ran while the round communicated,
    which depends on the link and the slowdown: it trains in full there, on every seed, and so
    does an ``auto`` that chose another schedule slowed than on loopback. A replica of two
    ranks computes as one: its updates are the same sequences per update, read by 4 data ranks
    under FSDP (2 under TP), so the convergence runs of one rank a replica stand for it."""
    from benchmarks.netbed import two_host_link

    best = best_runs(results, args.seeds[0])
    missing = {"acco", *HETEROGENEOUS_ARMS} - {"acco_until_ready"} - set(best)
    if missing:
        raise SystemExit(f"benchmarks.diloco: --phase heterogeneous needs the convergence runs "
                         f"of {sorted(missing)} first (--phase convergence)")  # fmt: skip

    def time_slowed(cells: dict, place: Place, rate: str, name: str, factor: float,
                    train_where: str | None) -> dict:  # fmt: skip
        """``name``'s timing at ``factor`` (kept in ``cells``; trained in full at
        ``train_where`` if it is an ``auto`` that chose another schedule than on loopback)."""
        cell = cells.setdefault(f"{factor:g}x", {}).setdefault(rate, {})
        if name not in cell:
            timed = time_arm(name, best[name], place, args.sequences_per_update, factor)
            ran = results["convergence"][best[name].key].get("auto_schedule")
            if train_where and ran is not None and not same_schedule(ran, timed.get("auto_schedule")):
                timed["runs"] = train_on_link(  # as in timing(): its own curve
                    name, best[name].lr, args, place, train_where, factor)  # fmt: skip
            cell[name] = timed
            write_result(args.out, results)
            print(f"heterogeneous {place.layout} {factor:g}x {rate:>8} {name:>22}: "
                  f"{timed['update_s']:.3f} s/update {timed.get('auto_schedule', '')}",
                  flush=True)  # fmt: skip
        return cell[name]

    with two_host_link() as link:
        for layout in args.replica_layouts:
            cells = results.setdefault(heterogeneous_key(layout), {})
            place = Place(link, layout)
            sync = layout_arms(layout)[0]  # titan_ddp, or under TP the engine's ddp
            runs = results.setdefault("layout_runs", {}).setdefault(layout, {})
            for seed in [] if layout == "rank" else args.seeds:
                if str(seed) in runs:
                    continue
                # the synchronous arm, unslowed, in full as the layout splits it: the layout's
                # targets and the synchronous arms' curve (:func:`layout_curve`)
                run = best_runs(results, seed)[sync]
                record = train(run, args, place, where=f"replicas_{layout}/synchronous")
                if not record["complete"]:
                    raise SystemExit(f"benchmarks.diloco: {run.key} in the {layout} layout "
                                     f"failed, see {record['log']}")  # fmt: skip
                runs[str(seed)] = {k: record[k] for k in (
                    "arm", "seed", "updates", "heldout_updates", "heldout_loss", "wall_s", "log")}
                write_result(args.out, results)
                print(f"{layout} layout, {sync} seed {seed}: held-out "
                      f"{[round(v, 4) for v in record['heldout_loss']]}", flush=True)  # fmt: skip
            for rate in args.heterogeneous_rates:
                link.set_rate(rate)
                for slowdown, (factor, window) in slowdowns(args).items():
                    where = ("" if layout == "rank" else f"replicas_{layout}/") + \
                        f"slow{slowdown}/{rate}"
                    for name in layout_arms(layout):
                        cell = cells.setdefault(slowdown, {}).setdefault(rate, {})
                        if name in cell:
                            continue
                        if name == "acco_until_ready":
                            cell[name] = {"runs": train_on_link(
                                name, best["acco"].lr, args, place, where, factor, window)}
                        elif window is None:
                            time_slowed(cells, place, rate, name, factor, where)
                        else:  # waits for replica 1 in the window only: timed both ways
                            time_slowed(cells, place, rate, name, 1.0, None)
                            time_slowed(cells, place, rate, name, factor, None)
                            cell[name] = {"timings": ["1x", f"{factor:g}x"]}
                        if window is not None:
                            cell[name]["slow_updates"] = list(window)
                        write_result(args.out, results)


def straggler_seconds(updates: float, window: Sequence[int], fast_s: float,
                      slow_s: float) -> float:  # fmt: skip
    """Seconds to ``updates`` updates of an arm that waits for a replica slowed in updates
    ``window`` (first, end) only: ``slow_s`` per update inside the window, ``fast_s`` outside."""
    first, end = window
    inside = max(0.0, min(updates, end) - first)
    return updates * fast_s + inside * (slow_s - fast_s)


def heterogeneous_summary(results: dict, seeds: Sequence[int],
                          key: str = "heterogeneous") -> dict:  # fmt: skip
    """Per slowdown, link and arm of ``results[key]`` (:func:`heterogeneous_key`), per seed:
    seconds to the synchronous arm's final held-out loss and to its loss at ¾ of its run
    (:func:`targets`); acco_until_ready's from its own run on the link (and an ``auto``'s that
    trained there), the others' updates to the target times their slowed seconds per update
    (for a straggler that recovers, :func:`straggler_seconds` from their unslowed and slowed
    timings). An ``auto`` whose slowed timing run chose another schedule than its convergence
    run, and that has no run of its own there (a file from before, or a straggler, whose
    timings cannot say which schedule it would keep), is not timed (``schedule_differs``): its
    updates would not be the ones counted."""
    table: dict = {}
    cells_by_slowdown = results.get(key, {})
    layout = next(name for name in REPLICA_LAYOUTS if heterogeneous_key(name) == key)
    for slowdown, by_rate in cells_by_slowdown.items():
        for rate, cell in by_rate.items():
            rows = table.setdefault(slowdown, {}).setdefault(rate, {})
            for name, measured in cell.items():
                row: dict = {"time_to_target_s": {}, "time_to_target_3q_s": {}}
                timings = [cells_by_slowdown[k][rate][name] for k in measured.get("timings", ())]
                if "update_s" in measured:
                    row["update_s"] = measured["update_s"]
                elif timings:
                    row["update_s_unslowed_slowed"] = [t["update_s"] for t in timings]
                for seed in seeds:
                    goals = targets(results, seed, layout)
                    if goals is None:
                        continue
                    best = results["best"][str(seed)]
                    ran = None
                    if name == "auto" and name in best and "runs" not in measured:
                        ran = results["convergence"][best[name]].get("auto_schedule")
                        chosen = [t.get("auto_schedule") for t in timings or [measured]]
                        if not all(same_schedule(ran, c) for c in chosen):
                            row["schedule_differs"] = [ran, *chosen]
                    # the layout's synchronous curve for the arms that make its updates
                    curve = layout_curve(results, layout, seed)
                    synchronous = str(ran).startswith("synchronous")  # auto stayed so
                    if curve is None or not (name in ("titan_ddp", "ddp") or synchronous):
                        curve = None
                    for suffix, target in goals.items():
                        reached = None
                        if "runs" in measured and str(seed) in measured["runs"]:
                            run = measured["runs"][str(seed)]
                            reached = seconds_to(run, target)
                        elif name in best and "schedule_differs" not in row:
                            if curve is not None:
                                row["curve"] = "the layout's synchronous run"
                                updates = updates_to(curve["heldout_updates"],
                                                     curve["heldout_loss"], target)  # fmt: skip
                            else:
                                updates, _ = updates_to_target(results, name, seed, target)
                            if updates is not None and timings:
                                reached = straggler_seconds(updates, measured["slow_updates"],
                                                            *row["update_s_unslowed_slowed"])
                            elif updates is not None:
                                reached = updates * measured["update_s"]
                        row[f"time_to_target{suffix}_s"][seed] = reached
                rows[name] = row
    return table


def heterogeneous_markdown(results: dict, layout: str = "rank") -> list[str]:
    """The table of docs/when_acco_helps.md: per slowdown and link, each arm's seconds to the
    synchronous arm's ¾ and final held-out loss per seed, and which arm gets there first."""
    table = results.get(f"{heterogeneous_key(layout)}_summary", {})
    if not table:
        return []
    names = [n for n in HETEROGENEOUS_ARMS if any(n in rows for by_rate in table.values()
                                                  for rows in by_rate.values())]  # fmt: skip
    split = {"rank": "one rank a replica", "fsdp": "each replica 2 ranks, FSDP inside",
             "tp": "each replica 2 ranks, TP inside"}[layout]  # fmt: skip
    lines = ["", f"Replica 1 slowed ({split}): seconds to the synchronous arm's loss at ¾ of its "
             "run, and to its final loss, per seed (n/r: not reached; n/c: not comparable):", "",
             f"| slowdown | link | {' | '.join(names)} | first to the ¾ loss, per seed |",
             "|---" * (len(names) + 3) + "|"]
    for factor, by_rate in table.items():
        for rate, rows in by_rate.items():
            cells, firsts = [], []
            for name in names:
                row = rows.get(name, {"time_to_target_3q_s": {}, "time_to_target_s": {}})
                if "schedule_differs" in row:  # auto chose otherwise when slowed
                    cells.append("n/c: ran {} slowed, {} in its convergence run".format(
                        "/".join(map(str, row["schedule_differs"][1:])),
                        row["schedule_differs"][0]))
                    continue
                pairs = [f"{'n/r' if a is None else f'{a:.0f}'}, "
                         f"{'n/r' if b is None else f'{b:.0f}'}"
                         for a, b in zip(row["time_to_target_3q_s"].values(),
                                         row["time_to_target_s"].values())]  # fmt: skip
                cells.append(" / ".join(pairs) or "not run")
            seeds = sorted({seed for row in rows.values() for seed in row["time_to_target_3q_s"]})
            for seed in seeds:
                firsts.append(_first({n: rows[n]["time_to_target_3q_s"].get(seed)
                                      for n in names if n in rows}))  # fmt: skip
            lines.append(f"| {factor} | {rate} | " + " | ".join(cells) + f" | {'; '.join(firsts)} |")
    return lines


# ----------------------------------------------------------------------------- the answer


def updates_to(updates: Sequence[int], losses: Sequence[float], target: float) -> float | None:
    """The first update at which the held-out curve reaches ``target`` (linear between points)."""
    for i, (u, loss) in enumerate(zip(updates, losses)):
        if loss <= target:
            if i == 0:
                return float(u)
            u0, l0 = updates[i - 1], losses[i - 1]
            return u0 + (u - u0) * (l0 - target) / (l0 - loss)
    return None


def args_long(results: dict) -> int:
    return results["settings"].get("diloco_updates", 0)


def layout_curve(results: dict, layout: str, seed: int) -> dict | None:
    """The held-out curve of the synchronous arm trained unslowed with replicas split as
    ``layout`` says, on ``seed`` (``--phase heterogeneous`` runs it); None for one rank a
    replica (the convergence runs are that) or where it is missing. Every synchronous arm
    (torchtitan's DDP or HSDP, the engine's ddp, ``auto`` where it stays synchronous) averages
    the same sequences per update, so this is their curve in the layout: under FSDP its 4
    data-parallel ranks read other sequences of the seed's stream than the convergence runs' 2,
    which moves the held-out curve by a few percent (the result file holds both)."""
    return results.get("layout_runs", {}).get(layout, {}).get(str(seed))


def targets(results: dict, seed: int, layout: str = "rank") -> dict[str, float] | None:
    """The synchronous arm's held-out losses an arm is timed to on ``seed``: at the end of its
    run (``""``) and at ¾ of it (``"_3q"``), its run in ``layout`` where there is one
    (:func:`layout_curve`); None where its run is missing."""
    keys = results.get("best", {}).get(str(seed), {})
    if TARGET_ARM not in keys:
        return None
    sync = layout_curve(results, layout, seed) or results["convergence"][keys[TARGET_ARM]]
    three_quarters = sync["heldout_updates"].index(3 * sync["updates"] // 4)
    return {"": sync["heldout_loss"][-1], "_3q": sync["heldout_loss"][three_quarters]}


def updates_to_target(results: dict, name: str, seed: int,
                      target: float) -> tuple[float | None, int | None]:  # fmt: skip
    """The updates ``name``'s best run on ``seed`` takes to ``target``, from its long run where
    its run falls short (and that run's length, else None)."""
    key = results["best"][str(seed)][name]
    record = results["convergence"][key]
    reached = updates_to(record["heldout_updates"], record["heldout_loss"], target)
    longer = results["convergence"].get(f"{key}/updates{args_long(results)}")
    if reached is None and longer and longer["complete"]:
        return updates_to(longer["heldout_updates"], longer["heldout_loss"], target), longer["updates"]
    return reached, None


def summary(results: dict, seeds: Sequence[int]) -> dict:
    """Per link and arm (each at its best learning rate): seconds per update, tokens/s, the
    held-out loss at the end (equal tokens), and, per seed, the updates and wall time to two
    targets of the synchronous arm's: its final held-out loss (``target``), and its loss at
    three quarters of its run (``target_3q``), which arms as exact per token as it reach within
    the same run despite a trajectory that ends a percent apart (two implementations of
    synchronous training do). DiLoCo takes its long run where ``--updates`` fall short; an arm
    trained in full on a link (``auto`` where it chose another schedule there than on loopback)
    its own run there (``trained_on_link``)."""
    table: dict = {}
    for rate, timings in results["timing"].items():
        for name, timed in timings.items():
            row: dict = {"update_s": timed["update_s"], "tokens_per_s": timed["tokens_per_s"],
                         "heldout_loss_final": {}}
            for suffix in ("", "_3q"):
                row[f"updates_to_target{suffix}"], row[f"time_to_target{suffix}_s"] = {}, {}
            for seed in seeds:
                goals = targets(results, seed)
                if goals is None or name not in results["best"][str(seed)]:
                    continue
                on_link = timed.get("runs", {}).get(str(seed))  # trained in full on this link
                if on_link is not None:
                    row["trained_on_link"] = True
                    row["heldout_loss_final"][seed] = on_link["heldout_loss"][-1]
                    for suffix, target in goals.items():
                        row[f"updates_to_target{suffix}"][seed] = updates_to(
                            on_link["heldout_updates"], on_link["heldout_loss"], target)
                        row[f"time_to_target{suffix}_s"][seed] = seconds_to(on_link, target)
                    continue
                record = results["convergence"][results["best"][str(seed)][name]]
                row["heldout_loss_final"][seed] = record["heldout_loss"][-1]
                for suffix, target in goals.items():
                    reached, longer = updates_to_target(results, name, seed, target)
                    if longer is not None:
                        row.setdefault(f"from_long_run{suffix}", {})[seed] = longer
                    row[f"updates_to_target{suffix}"][seed] = reached
                    row[f"time_to_target{suffix}_s"][seed] = (
                        None if reached is None else reached * timed["update_s"])
            table.setdefault(rate, {})[name] = row
    return table


def report(results: dict, args: argparse.Namespace) -> None:
    """The summary into the result file, the two tables docs/when_acco_helps.md shows (markdown,
    printed), and the figure."""
    results["summary"] = summary(results, args.seeds)
    tables = markdown(results)
    for layout in REPLICA_LAYOUTS:
        key = heterogeneous_key(layout)
        if key in results:
            results[f"{key}_summary"] = heterogeneous_summary(results, args.seeds, key)
            tables += heterogeneous_markdown(results, layout)
    write_result(args.out, results)
    print("\n".join(tables))
    plot(results, args.figure)


def comm_over_compute(results: dict, rate: str) -> float | None:
    """C/K on ``rate``, K one ACCO round's compute (half an update), from the ``ddp`` arm's
    advisor, whose micro-batches never overlap a communication (the ``acco`` arm's run one per
    round, all of them overlapped, which makes its K an upper bound); None if not timed."""
    figures = results["timing"][rate].get("ddp", {}).get("advisor")
    return figures and figures["comm_per_round_s"] / (figures["compute_per_round_s"] / 2)


def _first(times: dict[str, float | None]) -> str:
    ranked = sorted((t, name) for name, t in times.items() if t is not None)
    if len(ranked) < 2:
        return ranked[0][1] if ranked else "none"
    return f"{ranked[0][1]}, {ranked[1][0] / ranked[0][0]:.2f}x before {ranked[1][1]}"


def fastest_first(rates: Iterable[str]) -> list[str]:
    """Links from no cap down to the slowest (a result file keeps the order they were run in)."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}

    def bits(rate: str) -> float:
        unit = next((u for u in units if rate.endswith(u)), None)
        return math.inf if unit is None else float(rate[: -len(unit)]) * units[unit]

    return sorted(rates, key=bits, reverse=True)


def markdown(results: dict) -> list[str]:
    """The tables of docs/when_acco_helps.md: per target (the synchronous arm's final loss, and
    its loss at ¾ of its run) and link, C/K (:func:`comm_over_compute`), each arm's time to the
    target per seed, and which arm gets there first on each seed; per link, each arm's seconds
    per update; per arm, its learning rates, its final held-out loss per seed and the gap to
    the synchronous arm, paired by seed."""
    names = [n for n in ARMS if any(n in rows for rows in results["summary"].values())]
    head = " | ".join(names)
    lines: list[str] = []
    for suffix, what in (("", "final held-out loss"),
                         ("_3q", "held-out loss at ¾ of its run")):
        lines += ["", f"Seconds to the synchronous arm's {what}, per seed (n/r: not reached; "
                  "*: from its own run on that link):", "",
                  f"| link | C/K | {head} | first, per seed |", "|---" * (len(names) + 3) + "|"]
        for rate in fastest_first(results["summary"]):
            rows = results["summary"][rate]
            ratio = comm_over_compute(results, rate)
            ratio = "?" if ratio is None else f"{ratio:.1f}"
            times = {n: rows[n][f"time_to_target{suffix}_s"] for n in names if n in rows}
            cells = [" / ".join("n/r" if t is None else f"{t:.0f}" for t in times[n].values())
                     + ("*" if rows[n].get("trained_on_link") else "")
                     if n in rows else "not timed" for n in names]  # fmt: skip
            seeds = list(times[TARGET_ARM] if TARGET_ARM in times else next(iter(times.values())))
            firsts = [_first({n: t.get(seed) for n, t in times.items()}) for seed in seeds]
            first = firsts[0] if len(set(firsts)) == 1 else "; ".join(firsts)
            lines.append(f"| {rate} | {ratio} | " + " | ".join(cells) + f" | {first} |")
    lines += ["", "Seconds per update:", "", f"| link | {head} |", "|---" * (len(names) + 1) + "|"]
    for rate in fastest_first(results["summary"]):
        rows = results["summary"][rate]
        lines.append(f"| {rate} | " + " | ".join(
            f"{rows[n]['update_s']:.3f}" if n in rows else "not timed" for n in names) + " |")
    lines += ["", ("| arm | inner lr (outer lr) | final held-out loss per seed | "
                   "gap to the synchronous arm per seed | updates to its final loss per seed |"),
              "|---|---|---|---|---|"]
    rate = next(iter(fastest_first(results["summary"])), None)  # the loopback runs' own
    for name in names:
        keys = {seed: by_arm[name] for seed, by_arm in results.get("best", {}).items()}
        records = {seed: results["convergence"][key] for seed, key in keys.items()}
        lrs = sorted({(r["lr"], r["outer_lr"]) for r in records.values()})
        target = {seed: results["convergence"][results["best"][seed][TARGET_ARM]]
                  ["heldout_loss"][-1] for seed in records}  # fmt: skip
        final = {seed: r["heldout_loss"][-1] for seed, r in records.items()}
        gaps = ", ".join(f"{100 * (final[s] / target[s] - 1):+.2f} %" for s in records)
        reached = results["summary"][rate][name]["updates_to_target"] if rate else {}
        to = ", ".join("n/r" if u is None else f"{u:.0f}" for u in reached.values())
        shown_lr = ", ".join(f"{lr:g}" + (f" ({outer:g})" if outer else "") for lr, outer in lrs)
        lines.append(f"| {name} | {shown_lr} | {' / '.join(f'{v:.4f}' for v in final.values())} "
                     f"| {gaps} | {to} |")
    return lines


def plot(results: dict, path: pathlib.Path) -> None:
    """Held-out loss against wall time, one panel per link: every seed of each arm at its best
    learning rate (the time axis: updates x the arm's seconds per update on that link, or an
    arm's own run on the link where it trained there)."""
    plt = harness.pyplot()
    rates = fastest_first(results["timing"])
    if not rates or not results.get("best"):
        return
    fig, axes = plt.subplots(1, len(rates), figsize=(4.2 * len(rates), 3.8), sharey=True)
    colors = dict(zip(ARMS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for ax, rate in zip(axes if len(rates) > 1 else [axes], rates):
        for seed, keys in results["best"].items():
            target = results["convergence"][keys[TARGET_ARM]]["heldout_loss"][-1]
            ax.axhline(target, color="grey", lw=0.6, ls=":")
            for name, key in keys.items():
                if name not in results["timing"][rate]:
                    continue
                timed = results["timing"][rate][name]
                update_s = timed["update_s"]
                on_link = timed.get("runs", {}).get(seed)
                if on_link is not None:
                    ax.plot(*zip(*timed_curve(on_link)), color=colors[name], lw=1, ls="-.")
                    continue
                longer = results["convergence"].get(f"{key}/updates{args_long(results)}")
                for record, style in ((results["convergence"][key], "-"), (longer, "--")):
                    if record is None:
                        continue
                    x = [u * update_s for u in record["heldout_updates"][1:]]
                    first = seed == next(iter(results["best"])) and style == "-"
                    ax.plot(x, record["heldout_loss"][1:], color=colors[name], lw=1, ls=style,
                            label=name if first else None)  # fmt: skip
        ax.set_title(f"link: {'no cap' if rate == 'none' else rate}")
        ax.set_xlabel("wall time (s), training only")
        ax.set_xscale("log")
    (axes[0] if len(rates) > 1 else axes).set_ylabel("held-out loss")
    (axes[0] if len(rates) > 1 else axes).legend(fontsize=7)
    sequences = results["settings"]["sequences_per_update"]
    fig.suptitle(f"ACCO, DiLoCo and synchronous DDP, 2 replicas, {sequences} x 64 tokens per update, each "
                 "arm at its best lr, 2 seeds (dotted: the synchronous final loss per seed; "
                 "dashed: DiLoCo's long runs; dash-dot: a run on the link itself)", fontsize=9)
    harness.save_figure(fig, path)


def training_seconds(record: dict, rounds_per_update: int,
                     from_zero: bool = False) -> dict[int, float]:  # fmt: skip
    """Seconds of training from a run's first logged step to each held-out point after it
    (per update), the validations' own time left out. ``from_zero``: from the start of
    training instead, the steps up to the first logged one counted at the run's median step
    time (as a timed arm's updates are: its update time from update 0)."""
    ts = dict(zip(record["step"], record["step_ts"]))
    points = record.get("heldout_steps") or [  # validated after these steps
        u * rounds_per_update for u in record["heldout_updates"]]  # (a record from before)
    validation_s = {s: h - ts[s] for s, h in zip(points, record["heldout_ts"])}
    first = min(ts)
    logged = sorted(ts)
    step_s = statistics.median(
        (ts[b] - ts[a]) / (b - a) for a, b in zip(logged, logged[1:])
        if not any(a <= p < b for p in validation_s))  # fmt: skip
    offset = first * step_s if from_zero else 0.0
    return {u: offset + ts[s] - ts[first] - sum(v for p, v in validation_s.items() if p < s)
            for u, s in zip(record["heldout_updates"], points) if s > first}  # fmt: skip


def timed_curve(run: dict) -> list[tuple[float, float]]:
    """A run on a link (:func:`train_on_link`): its training seconds and held-out loss at each
    held-out point that :func:`training_seconds` timed (JSON keeps its keys as strings)."""
    seconds = {int(u): t for u, t in run["training_s"].items()}
    return [(seconds[u], loss) for u, loss in zip(run["heldout_updates"], run["heldout_loss"])
            if u in seconds]  # fmt: skip


def seconds_to(run: dict, target: float) -> float | None:
    """The training seconds at which a run on a link reaches ``target``, linear between its
    held-out points; None if it does not."""
    points = timed_curve(run)
    return updates_to([t for t, _ in points], [loss for _, loss in points], target)


def check(results: dict, args: argparse.Namespace) -> None:
    """``args.check_arm`` in full on ``args.check_rate``, held-out points included: the
    training time it took to each held-out point (from its first update, validations left out)
    against the model the summary uses, updates x the timing run's seconds per update; and its
    held-out losses against the same run's on loopback (the link changes no number)."""
    from benchmarks.netbed import two_host_link

    run = best_runs(results, args.seeds[0])[args.check_arm]
    with two_host_link(args.check_rate) as link:
        record = train(run, args, Place(link))
    if not record["complete"]:
        raise SystemExit(f"benchmarks.diloco: the check run failed, see {record['log']}")
    rounds = ARMS[args.check_arm].rounds_per_update
    measured = training_seconds(record, rounds)
    first = min(record["step"])
    timed = results["timing"][args.check_rate][args.check_arm]["update_s"]
    predicted = {u: (u * rounds - first) / rounds * timed for u in measured}
    results["check"] = {
        "arm": args.check_arm, "rate": args.check_rate, "run": run.key,
        "timed_update_s": timed, "measured_s": measured, "predicted_s": predicted,
        "measured_over_predicted": {u: measured[u] / predicted[u] for u in measured},
        "heldout_loss": record["heldout_loss"],
        "loopback_heldout_loss": results["convergence"][run.key]["heldout_loss"],
    }  # fmt: skip
    write_result(args.out, results)
    print("check:", json.dumps(results["check"], indent=1), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.diloco",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--phase", choices=("all", "convergence", "timing", "check", "heterogeneous", "report"),
        default="all")
    add("--updates", type=int, default=160, help="optimizer updates per convergence run")
    add("--heldout-every", type=int, default=20, help="updates between held-out points "
        "(a multiple of every DiLoCo H)")
    add("--diloco-updates", type=int, default=640,
        help="DiLoCo's long runs (0: none): updates to the synchronous loss past --updates")
    add("--seeds", type=int, nargs="+", default=[0, 1],
        help="the first sweeps the learning rates; the others repeat each arm's best")
    add("--arms", nargs="+", choices=list(SWEPT_ARMS), default=list(SWEPT_ARMS))
    add("--rates", nargs="+", default=list(RATES), help="links to time (tc rates, or none)")
    add("--sequences-per-update", type=int, default=None,
        help="sequences per optimizer update over both replicas, a multiple of "
        f"{4 * LOCAL_BATCH} (acco's two rounds, each a whole micro-batch per replica); "
        f"{8 * LOCAL_BATCH} gives an ACCO round two micro-batches, ACCO's window (keep each "
        f"batch in a result file of its own: --out; default: the file's, else {UPDATE_BATCH})")
    add("--check-arm", default="diloco_h20", choices=sorted(SWEPT_ARMS))
    add("--slow-factors", type=float, nargs="+", default=[2.0, 4.0],
        help="--phase heterogeneous: how many times slower replica 1 computes")
    add("--straggler-factors", type=float, nargs="+", default=[],
        help="--phase heterogeneous: replica 1 this many times slower in the middle third of "
        "the run only (a straggler that recovers)")
    add("--heterogeneous-rates", nargs="+", default=["none"],
        help="--phase heterogeneous: the links (tc rates, or none)")
    add("--replica-layouts", nargs="+", choices=list(REPLICA_LAYOUTS), default=["rank"],
        help="--phase heterogeneous: one rank a replica, or two ranks split by FSDP or by TP "
        "(each host's core runs its replica's ranks)")
    add("--check-rate", default="200mbit")
    harness.add_out_option(parser, "diloco_vs_acco")
    add("--figure", type=pathlib.Path, default=None,
        help="default: beside --out (docs/figures/ for the published result file)")  # fmt: skip
    args = parser.parse_args(argv)
    # a published result file's figure is docs/figures/<its name>.png (diloco_window too)
    args.figure = args.figure or harness.figure_file(args.out, args.out.stem)
    # Ctrl-C, and a kill, end the benchmark through its cleanup (every process it started),
    # also when it was started in the background, where a shell ignores SIGINT
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    from benchmarks.convergence.ft_train import check_stack

    check_stack()  # before anything runs
    if args.updates % args.heldout_every or any(
            args.heldout_every % a.sync_steps for a in ARMS.values()):  # fmt: skip
        parser.error("--heldout-every must divide --updates and be a multiple of every H")
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    kept = results.get("settings", {}).get("sequences_per_update")
    if args.sequences_per_update is None:
        args.sequences_per_update = kept or UPDATE_BATCH
    if args.sequences_per_update % (4 * LOCAL_BATCH):
        parser.error(f"--sequences-per-update must be a multiple of {4 * LOCAL_BATCH}")
    if kept not in (None, args.sequences_per_update):
        parser.error(f"{args.out} holds runs of --sequences-per-update {kept}, not "
                     f"{args.sequences_per_update}: give another --out")  # fmt: skip
    results = {"convergence": {}, "timing": {}, "heterogeneous": {}, **results, **header(),
               "settings": {"seq_len": SEQ_LEN, "local_batch": LOCAL_BATCH,
                            "sequences_per_update": args.sequences_per_update,
                            "updates": args.updates,
                            "diloco_updates": args.diloco_updates,
                            "heldout_every": args.heldout_every,
                            "heldout_batches_per_replica": HELDOUT_BATCHES, "base_lr": BASE_LR,
                            "inner_lr_factors": INNER_LR_FACTORS, "outer_lrs": OUTER_LRS,
                            "arms": {n: dataclasses.asdict(a) for n, a in ARMS.items()}}}
    if args.phase in ("all", "convergence"):
        convergence(results, args)
        write_result(args.out, results)
    if args.phase in ("all", "timing"):
        timing(results, args)
    if args.phase in ("all", "check"):
        check(results, args)
    if args.phase == "heterogeneous":
        heterogeneous(results, args)
    report(results, args)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
