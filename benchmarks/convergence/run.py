"""Convergence of ACCO vs DPU vs DDP per token, and ACCO with one rank 4x slower (torchtitan, CPU).

Every run is ``train_titan.py`` on 2 gloo CPU ranks with
``torchtitan_configs/debug_cpu_<mode>.toml``, ``--updates`` real optimizer updates (``acco``:
two rounds of half the batch each, so the tokens per update match), validated on a fixed
held-out set every ``--heldout-every`` updates; ``--heterogeneous`` slows global rank 1 down
(``slow_rank.py``) and runs the arms of ``--arms``. The data: ``data.py``. What each
experiment runs, why, and what it found: ``docs/results.md`` sections 4 and 5.

Reproduce (from the repository root, nothing else running: wall times count)::

    python -m benchmarks.convergence.run --updates 200 --seeds 0 1 2 --corpus stdlib torch \
        --out docs/results/convergence_heldout.json -- --training.seq_len 64
    python -m benchmarks.convergence.run --heterogeneous --updates 150 --seeds 0 1 2 \
        --arms acco_until_ready ddp ddp_matched acco_capped \
        --out docs/results/heterogeneous.json -- --training.seq_len 64
    python -m benchmarks.convergence.plot

torchtitan overrides after ``--`` go to every run. Results go to
``outputs/results/convergence_heldout.json`` (``--heterogeneous``:
``outputs/results/heterogeneous.json``; ``--out``: elsewhere, the published files being
``docs/results/convergence_heldout.json`` and ``docs/results/heterogeneous.json``, which
``plot.py`` reads), rewritten after every run; a complete run already there with the same
settings is skipped unless ``--force``. Raw logs:
``outputs/convergence/<experiment>/<data>/<arm>/seed<N>/console.log``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from benchmarks.convergence import data, per_rank
from benchmarks.convergence.per_rank import RANK_ARGS_ENV
from benchmarks.harness import PREFIX, STEP, step_line, timestamp, torchrun, write_result

REPO = pathlib.Path(__file__).resolve().parents[2]
MODES = ("ddp", "acco", "dpu")
CONFIG_TEMPLATE = "torchtitan_configs/debug_cpu_{mode}.toml"
# under outputs/ (a run leaves the published files in docs/results/ alone unless --out names one)
DEFAULT_OUT = {"convergence": "outputs/results/convergence_heldout.json",
               "heterogeneous": "outputs/results/heterogeneous.json"}  # fmt: skip
DEFAULT_WORKDIR = "outputs/convergence"
HOOKS_MODULE = "benchmarks.convergence.slow_rank"  # slow rank, micro-batch logs, fixed held-out
SLOW_FACTOR_ENV, STATS_DIR_ENV = "ACCO_BENCH_SLOW_FACTOR", "ACCO_BENCH_STATS_DIR"
HELDOUT_DATASET = "stdlib_validation"
UNTIL_READY = ("--acco.accumulate_until_ready",)  # a tyro flag: no value
# arm -> (acco.mode, extra overrides) for --heterogeneous
ARMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "acco_until_ready": ("acco", UNTIL_READY),
    "acco_capped": ("acco", UNTIL_READY),  # + --acco.max_microbatches_per_round (--cap)
    "dpu_until_ready": ("dpu", UNTIL_READY),
    "acco": ("acco", ("--acco.no_accumulate_until_ready",)),
    "dpu": ("dpu", ("--acco.no_accumulate_until_ready",)),
    "ddp": ("ddp", ()),  # --ddp-microbatches-per-rank on every rank
    "ddp_matched": ("ddp", ()),  # --control-mix: each rank its own micro-batches per update
}
# arm -> (acco.mode, extra overrides) for the schedules mode="auto" may pick (the convergence
# gate): the estimate round in bfloat16 or float8, and the most uneven split auto tries, 3 + 1
# of an update's 4 micro-batches per rank (run the gate with --training.local_batch_size 2:
# 2 + 2 per round in "acco", 4 per update in "ddp").
SPLIT = ("--acco.estimate_microbatches", "3", "--acco.accumulation_steps", "1")
BF16 = ("--acco.estimate_dtype", "bfloat16")
FP8 = ("--acco.estimate_dtype", "float8_e4m3fn")
SCHEDULE_ARMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "acco_bf16": ("acco", BF16),
    "acco_fp8": ("acco", FP8),
    "acco_split": ("acco", SPLIT),
    "acco_split_bf16": ("acco", SPLIT + BF16),
    "acco_split_fp8": ("acco", SPLIT + FP8),
}
MANAGED = ("--training.dataset_path", "--acco.accumulation_steps", "--training.steps",
           "--debug.seed", "--job.dump_folder",
           "--job.config_file", "--metrics.disable_color_printing", "--experimental.custom_import",
           "--validation.enable", "--validation.freq", "--validation.steps")  # fmt: skip

# training lines: benchmarks.harness.STEP; validations, torchtitan's log_validation:
# "[default0]:[titan] 2026-11-21 10:41:09,120 - root - INFO - validate step: 50  loss:  5.1234
#  memory:  0.80GiB(3.39%)  tps: 9,120"
HELDOUT_RE = re.compile(
    PREFIX + r".*?validate step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>-?[\d.]+|nan|inf)"
)
START_RE = re.compile(PREFIX + r".*Training starts at step")


@dataclasses.dataclass(frozen=True)
class BatchSettings:
    """What one torchtitan step consumes: ``global_batch_size`` sequences of ``seq_len``."""

    global_batch_size: int
    local_batch_size: int
    seq_len: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run: an experiment, an arm (the mode, or a heterogeneous arm) and a seed.
    Its fields open the run's record in the results file."""

    experiment: str  # "convergence" or "heterogeneous"
    arm: str
    mode: str
    seed: int  # the model initialisation and the data order
    updates: int
    overrides: tuple[str, ...]
    corpus: str = "stdlib"
    data_order: str = "sequences"  # or "documents" (benchmarks/convergence/data.py)
    rank_args: tuple[tuple[str, ...], ...] = ()  # per global rank: arguments of that rank only
    data_seed: int | None = None  # the data order's seed where it is not ``seed`` (--data-seed)
    heldout_every: int = 0  # real updates between validations; 0: none
    heldout_steps: int = 0  # validation batches per rank
    slow_factor: float = 1.0  # heterogeneous: rank 1's time per micro-batch / its compute

    @property
    def data(self) -> str:
        return f"{self.corpus}-{self.data_order}"

    @property
    def key(self) -> str:
        fixed = "" if self.data_seed is None else f"-data{self.data_seed}"
        return f"{self.experiment}/{self.data}/{self.arm}/seed{self.seed}{fixed}"

    @property
    def steps(self) -> int:
        return steps_for(self.mode, self.updates)


# ----------------------------------------------------------------------------- log parsing


def parse_log(text: str) -> dict[int, dict[str, list[float]]]:
    """Per rank (``[default<rank>]:`` of ``torchrun --tee 3``; no prefix: rank 0), the lines
    of the training steps (``step``, ``loss``, ``grad_norm``, ``tps``, ``ts``: UNIX time; a step
    logged twice keeps its last line), of the validations (``heldout_step``, ``heldout_loss``,
    already averaged over the ranks, ``heldout_ts``) and ``start``, the time of "Training
    starts" (a one-element list, if logged)."""
    steps: dict[int, dict[int, dict]] = {}
    heldout: dict[int, dict[int, tuple[float, float]]] = {}
    starts: dict[int, float] = {}
    for line in text.splitlines():
        if (match := STEP.search(line)) and match["ts"]:
            row = step_line(match)
            steps.setdefault(row["rank"], {})[row["step"]] = row
        elif (match := HELDOUT_RE.search(line)) and match["ts"]:
            validation = (float(match["loss"]), timestamp(match["ts"]))
            heldout.setdefault(int(match["rank"] or 0), {})[int(match["step"])] = validation
        elif (match := START_RE.search(line)) and match["ts"]:
            starts.setdefault(int(match["rank"] or 0), timestamp(match["ts"]))
    parsed: dict[int, dict[str, list[float]]] = {}
    for rank in sorted(set(steps) | set(heldout)):
        rows = [row for _, row in sorted(steps.get(rank, {}).items())]
        validations = sorted(heldout.get(rank, {}).items())
        parsed[rank] = {key: [row[key] for row in rows]
                        for key in ("step", "loss", "grad_norm", "tps", "ts")}  # fmt: skip
        parsed[rank]["heldout_step"] = [step for step, _ in validations]
        parsed[rank]["heldout_loss"] = [loss for _, (loss, _) in validations]
        parsed[rank]["heldout_ts"] = [ts for _, (_, ts) in validations]
        if rank in starts:
            parsed[rank]["start"] = [starts[rank]]
    return parsed


@dataclasses.dataclass
class StepStats:
    """One rank's micro-batches of one step, from the slow_rank module's log."""

    microbatches: int = 0
    tokens: int = 0
    valid: int = 0
    loss_sum: float = 0.0
    has_loss: bool = False
    t_end: float = 0.0

    def add(self, row: dict[str, Any]) -> None:
        self.microbatches += 1
        self.tokens += int(row["tokens"])
        self.valid += int(row.get("valid", row["tokens"]))
        if row.get("loss_sum") is not None:
            self.loss_sum += float(row["loss_sum"])
            self.has_loss = True
        self.t_end = max(self.t_end, float(row["t"]))


def read_stats(stats_dir: pathlib.Path) -> dict[int, dict[int, StepStats]]:
    """The slow_rank module's logs: {rank: {step: StepStats}}."""
    stats: dict[int, dict[int, StepStats]] = {}
    for path in sorted(stats_dir.glob("microbatches_rank*.jsonl")):
        per_step = stats[int(path.stem.removeprefix("microbatches_rank"))] = {}
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
            per_step.setdefault(int(row["step"]), StepStats()).add(row)
    return stats


def curves_from_stats(stats: dict[int, dict[int, StepStats]], t0: float | None) -> dict[str, Any]:
    """Per step (every rank's): global loss, cumulative tokens, time, per-rank micro-batches.

    The loss of a step is Σ token-summed losses / Σ valid tokens over all ranks: what
    torchtitan/ACCOTrainer log as the global average loss. ``time_s`` is when the last rank
    finished the step's last backward, from ``t0`` (default: the first backward's end).
    """
    ranks = sorted(stats)
    steps = sorted(set().union(*(stats[r].keys() for r in ranks))) if ranks else []
    complete = [s for s in steps if all(s in stats[r] for r in ranks)]
    if t0 is None:
        t0 = min((st.t_end for r in ranks for st in stats[r].values()), default=0.0)
    loss, tokens, time_s, total = [], [], [], 0
    for step in complete:
        rows = [stats[r][step] for r in ranks]
        valid = sum(st.valid for st in rows if st.has_loss)
        loss.append(sum(st.loss_sum for st in rows) / valid if valid else math.nan)
        total += sum(st.tokens for st in rows)
        tokens.append(total)
        time_s.append(round(max(st.t_end for st in rows) - t0, 3))
    return {
        "step": complete, "loss": loss, "tokens": tokens, "time_s": time_s,
        "microbatches": {str(r): [stats[r][s].microbatches for s in complete] for r in ranks},
        "rank_tokens": {str(r): [stats[r][s].tokens for s in complete] for r in ranks},
    }  # fmt: skip


# ----------------------------------------------------------------------------- settings


def steps_for(mode: str, updates: int) -> int:
    """torchtitan steps (rounds) for ``updates`` real updates: an ACCO update takes two."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; one of {MODES}")
    return 2 * updates if mode == "acco" else updates


def updates_after(mode: str, step: int) -> int:
    """Real updates in the real parameters θ after ``step`` steps (``acco_hooks.real_updates``)."""
    return step // 2 if mode == "acco" else step


def override_value(overrides: Sequence[str], name: str) -> str | None:
    """The last value given to ``--name`` in ``overrides`` (``--name V`` or ``--name=V``)."""
    value = None
    for i, arg in enumerate(overrides):
        if arg == name and i + 1 < len(overrides):
            value = overrides[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def batch_settings(config: dict[str, Any], overrides: Sequence[str], dp: int) -> BatchSettings:
    """Global/local batch and seq_len from a parsed TOML, overridden by ``overrides``."""
    training = config.get("training", {})

    def pick(name: str, default: int) -> int:
        given = override_value(overrides, f"--training.{name}")
        return int(given) if given is not None else int(training.get(name, default))

    local = pick("local_batch_size", 8)
    global_ = pick("global_batch_size", -1)
    if global_ <= 0:  # torchtitan: local_batch_size x data-parallel degree
        global_ = local * dp
    return BatchSettings(global_, local, pick("seq_len", 2048))


def load_config(mode: str) -> tuple[pathlib.Path, dict]:
    path = REPO / CONFIG_TEMPLATE.format(mode=mode)
    with open(path, "rb") as f:
        return path, tomllib.load(f)


def tokens_per_step_list(steps: Iterable[int], settings: BatchSettings) -> list[int]:
    """Cumulative tokens seen by all ranks after each of ``steps`` (a fixed batch per step)."""
    return [int(s) * settings.tokens_per_step for s in steps]


def mode_overrides(mode: str, batch_per_update: int | None) -> tuple[str, ...]:
    """``--training.global_batch_size`` for ``--batch-per-update``: acco gets half per round."""
    if batch_per_update is None:
        return ()
    if mode == "acco" and batch_per_update % 2:
        raise ValueError(f"--batch-per-update {batch_per_update} must be even for acco")
    size = batch_per_update // 2 if mode == "acco" else batch_per_update
    return ("--training.global_batch_size", str(size))


def plan(args: argparse.Namespace, overrides: tuple[str, ...]) -> list[RunSpec]:
    """The runs asked for, in the order they run (corpus, data order, seed, then arm: a partial
    result holds whole comparisons)."""
    arms = args.arms if args.heterogeneous else args.modes
    runs = itertools.product(args.corpus, args.data_order, args.seeds, arms)
    return [plan_one(args, overrides, *run) for run in runs]


def plan_one(args: argparse.Namespace, overrides: tuple[str, ...], corpus: str, order: str,
             seed: int, arm: str) -> RunSpec:  # fmt: skip
    """One run's settings: its arm's overrides, its batch, its validations and its data.

    Convergence: each mode's TOML batch (or ``--batch-per-update``). Heterogeneous: ``ddp``
    runs ``--ddp-microbatches-per-rank`` micro-batches per rank per update, ``ddp_matched``
    each rank's count of ``--control-mix``, every other arm the minimum of one per rank per
    round (``accumulate_until_ready`` adds the fast rank's extra ones, ``acco_capped`` at most
    ``--cap`` per round).
    """
    mode, extra = ARMS[arm] if args.heterogeneous else SCHEDULE_ARMS.get(arm, (arm, ()))
    _, config = load_config(mode)
    rank_args: tuple[tuple[str, ...], ...] = ()
    if args.heterogeneous:
        # Each logged step all-reduces the loss and puts the ranks back in step: by default only
        # the first and the last; the per-step curves come from slow_rank's micro-batch logs.
        log_freq = args.log_freq or steps_for(mode, args.updates)
        per_rank = args.ddp_microbatches_per_rank if arm == "ddp" else 1
        local = batch_settings(config, overrides, args.nproc).local_batch_size
        extra += ("--metrics.log_freq", str(log_freq),
                  "--training.global_batch_size", str(per_rank * local * args.nproc))  # fmt: skip
        if arm == "acco_capped":
            extra += ("--acco.max_microbatches_per_round", str(args.cap))
        if arm == "ddp_matched":
            rank_args = tuple(("--acco.accumulation_steps", str(n)) for n in args.control_mix)
    else:
        extra += mode_overrides(mode, args.batch_per_update)
    settings = batch_settings(config, extra + overrides, args.nproc)
    heldout: tuple[str, ...] = ()
    if args.heldout_every:
        # validation.freq counts steps (two per acco update); the validation batches have the
        # training shape; torchtitan validates at step 1 and at every multiple of freq
        heldout = ("--validation.enable", "--validation.dataset", HELDOUT_DATASET,
                   "--validation.freq", str(steps_for(mode, args.heldout_every)),
                   "--validation.steps", str(args.heldout_steps),
                   "--validation.local_batch_size", str(settings.local_batch_size),
                   "--validation.seq_len", str(settings.seq_len))  # fmt: skip
    data_seed = seed if args.data_seed is None else args.data_seed
    dataset = data.prepare(corpus, order, data_seed, settings.seq_len)
    return RunSpec(
        "heterogeneous" if args.heterogeneous else "convergence", arm, mode, seed, args.updates,
        extra + heldout + ("--training.dataset_path", str(dataset.relative_to(REPO))) + overrides,
        corpus=corpus, data_order=order, rank_args=rank_args, data_seed=args.data_seed,
        heldout_every=args.heldout_every, heldout_steps=args.heldout_steps,
        slow_factor=args.slow_factor if args.heterogeneous else 1.0,
    )  # fmt: skip


# ----------------------------------------------------------------------------- running


def build_command(spec: RunSpec, config_path: pathlib.Path, run_dir: pathlib.Path,
                  nproc: int) -> list[str]:  # fmt: skip
    """torchrun + train_titan.py for ``spec`` (through ``per_rank.py`` where ranks differ);
    every run imports the slow_rank hooks."""
    script = pathlib.Path(per_rank.__file__) if spec.rank_args else per_rank.TRAIN_TITAN
    return torchrun(
        nproc, "--log-dir", str(run_dir / "torchrun"), "--tee", "3",
        str(script), "--job.config_file", str(config_path),
        "--job.dump_folder", str(run_dir / "dump"), "--metrics.disable_color_printing",
        "--training.steps", str(spec.steps),
        "--debug.seed", str(spec.seed), "--experimental.custom_import", HOOKS_MODULE,
        *spec.overrides,
    )  # fmt: skip


def run_env(spec: RunSpec, run_dir: pathlib.Path, omp_threads: int = 1) -> dict[str, str]:
    """The variables this script sets for a run (on top of the current environment)."""
    env = {"OMP_NUM_THREADS": str(omp_threads), "LOG_RANK": "all"}  # each rank's tps
    if spec.experiment == "heterogeneous":
        env[SLOW_FACTOR_ENV] = f"{spec.slow_factor:g}"
        env[STATS_DIR_ENV] = str(run_dir / "stats")
    if spec.rank_args:
        env[RANK_ARGS_ENV] = json.dumps({str(r): list(a) for r, a in enumerate(spec.rank_args)})
    return env


def _stream(cmd: list[str], env: dict[str, str], log_path: pathlib.Path, print_every: int) -> int:
    """Run ``cmd``, copying its output to ``log_path``; echo rank 0's every Nth step line and
    its validations. Interrupted, it stops torchrun and its ranks (their own process group)."""
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1,
                                start_new_session=True)  # fmt: skip
        try:
            for line in proc.stdout:
                log.write(line)
                step, held_out = STEP.search(line), HELDOUT_RE.search(line)
                shown = step or held_out
                if print_every <= 0 or not shown or int(shown["rank"] or 0):
                    continue
                if step and int(step["step"]) % print_every == 0:
                    text = line[line.index("step:") :].split("memory:")[0]
                    print(f"    {text.strip()}  tps: {step['tps']}", flush=True)
                elif held_out:
                    print(f"    held-out after step {held_out['step']}: loss {held_out['loss']}",
                          flush=True)  # fmt: skip
            return proc.wait()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def summarize(record: dict[str, Any]) -> dict[str, float]:
    """Throughput of a run: global tokens/s over the training time (from training start), which
    includes the validations. ``heldout_loss_final``: the held-out loss after the last update."""
    tokens, time_s = record["tokens"], record["time_s"]
    if not tokens or not time_s or time_s[-1] <= 0:
        return {}
    summary = {"tokens": float(tokens[-1]), "train_s": float(time_s[-1]),
               "tokens_per_s": tokens[-1] / time_s[-1]}  # fmt: skip
    if len(tokens) > 2 and time_s[-1] > time_s[0]:  # without step 1 (warm-up)
        summary["tokens_per_s_after_step1"] = (tokens[-1] - tokens[0]) / (time_s[-1] - time_s[0])
    if len(tokens) > 2:
        summary["tokens_per_s_training"] = training_tokens_per_s(record)
    if record.get("heldout_loss"):
        summary["heldout_loss_final"] = float(record["heldout_loss"][-1])
        summary["heldout_tokens_final"] = float(record["heldout_tokens"][-1] or 0)
    for rank, tps in record.get("tps", {}).items():
        # a training line logged right after a validation reads 0: the validator resets
        # torchtitan's token counter
        tps = [v for v in tps[1:] or tps if v > 0]
        if tps:
            summary[f"mean_logged_tps_rank{rank}"] = sum(tps) / len(tps)
    for rank, counts in record.get("microbatches", {}).items():
        rank_tokens = sum(record["rank_tokens"][rank])
        summary[f"microbatches_rank{rank}"] = float(sum(counts))
        summary[f"microbatches_per_step_rank{rank}"] = sum(counts) / max(len(counts), 1)
        summary[f"tokens_rank{rank}"] = float(rank_tokens)
        summary[f"tokens_per_s_rank{rank}"] = rank_tokens / time_s[-1]
    return summary


def training_tokens_per_s(record: dict[str, Any]) -> float:
    """Tokens/s of the training steps alone: the step after each validation is left out (its
    time holds the validation and, in ACCO, the wait for the update in flight that a
    validation forces): the validations are the benchmark's instrument, not the training."""
    steps, time_s, tokens = record["step"], record["time_s"], record["tokens"]
    after = {s + 1 for s in record.get("heldout_step", [])}
    seconds = sum(time_s[i] - time_s[i - 1] for i in range(1, len(steps)) if steps[i] not in after)
    counted = sum(tokens[i] - tokens[i - 1] for i in range(1, len(steps)) if steps[i] not in after)
    return counted / seconds if seconds > 0 else math.nan


def make_record(spec: RunSpec, settings: BatchSettings, parsed: dict, stats: dict,
                returncode: int, wall_s: float) -> dict[str, Any]:  # fmt: skip
    """The JSON record of one run, from its parsed log (and slow_rank stats, if any).

    Without stats: the logged steps, tokens = step x global batch x seq_len. With stats
    (heterogeneous): every step, from the per-micro-batch logs of all ranks; the logged
    loss/steps stay as ``loss_logged``/``step_logged``. Held-out loss (rank 0's "validate step"
    lines): ``heldout_step``, ``heldout_updates`` (real updates in θ at that step),
    ``heldout_tokens`` (tokens seen by all ranks by then: from the stats where there are some),
    ``heldout_loss`` and ``heldout_time_s`` (when the validation was logged).
    """
    ranks = sorted(parsed)
    main = parsed[ranks[0]] if ranks else {"step": [], "loss": [], "ts": []}
    t0 = main.get("start", main["ts"][:1] or [None])[0]
    record: dict[str, Any] = {
        **dataclasses.asdict(spec), "overrides": list(spec.overrides),
        "steps": spec.steps, "global_batch_size": settings.global_batch_size,
        "local_batch_size": settings.local_batch_size, "seq_len": settings.seq_len,
        "tokens_per_step": settings.tokens_per_step, "returncode": returncode,
        "wall_s": wall_s, "step": main["step"], "loss": main["loss"],
        "tokens": tokens_per_step_list(main["step"], settings),
        "time_s": [round(t - (t0 or 0.0), 3) for t in main["ts"]],
        "tps": {str(r): parsed[r]["tps"] for r in ranks},
        "finished_at": datetime.now().isoformat(timespec="seconds"),
    }  # fmt: skip
    if stats:
        record["step_logged"], record["loss_logged"] = record["step"], record["loss"]
        record.update(curves_from_stats(stats, t0))
        record["tokens_nominal"] = tokens_per_step_list(record["step"], settings)
    heldout_steps = main.get("heldout_step", [])
    tokens_at = dict(zip(record["step"], record["tokens"]))
    record.update({
        "heldout_step": heldout_steps,
        "heldout_updates": [updates_after(spec.mode, s) for s in heldout_steps],
        "heldout_tokens": [tokens_at.get(s) for s in heldout_steps] if stats
        else tokens_per_step_list(heldout_steps, settings),
        "heldout_loss": main.get("heldout_loss", []),
        "heldout_time_s": [round(t - (t0 or 0.0), 3) for t in main.get("heldout_ts", [])],
    })  # fmt: skip
    record["complete"] = (returncode == 0 and record["step"][-1:] == [spec.steps]
                          and (spec.heldout_every <= 0 or heldout_steps[-1:] == [spec.steps]))
    record["summary"] = summarize(record)
    return record


def run_one(spec: RunSpec, args: argparse.Namespace) -> dict[str, Any]:
    """Launch one run, parse it, return its record."""
    config_path, config = load_config(spec.mode)
    settings = batch_settings(config, spec.overrides, args.nproc)
    run_dir = pathlib.Path(args.workdir).resolve() / spec.key
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    cmd = build_command(spec, config_path, run_dir, args.nproc)
    own_env = run_env(spec, run_dir)
    env = {k: v for k, v in os.environ.items()
           if k not in (SLOW_FACTOR_ENV, STATS_DIR_ENV, RANK_ARGS_ENV)}  # fmt: skip
    env.update(own_env)
    shown = " ".join(f"{k}={v}" for k, v in own_env.items())
    (run_dir / "command.txt").write_text(f"{shown} {' '.join(cmd)}\n", encoding="utf-8")
    start = time.perf_counter()
    returncode = _stream(cmd, env, run_dir / "console.log", args.print_every)
    wall_s = time.perf_counter() - start
    parsed = parse_log((run_dir / "console.log").read_text(encoding="utf-8", errors="replace"))
    stats = read_stats(run_dir / "stats") if spec.experiment == "heterogeneous" else {}
    record = make_record(spec, settings, parsed, stats, returncode, round(wall_s, 2))
    record["microbatches_per_round_nominal"] = settings.global_batch_size // (
        settings.local_batch_size * args.nproc)
    record["command"] = cmd
    record["log"] = str(run_dir / "console.log")
    dataset = override_value(spec.overrides, "--training.dataset_path")
    record["dataset"] = data.describe(REPO / dataset)
    return record


# ----------------------------------------------------------------------------- main


def same_settings(record: dict[str, Any], spec: RunSpec) -> bool:
    """Whether ``record`` was run as ``spec`` would run (the overrides hold the batch sizes)."""
    return (record.get("updates") == spec.updates
            and record.get("overrides") == list(spec.overrides)
            and [list(a) for a in record.get("rank_args", [])] == [list(a) for a in spec.rank_args]
            and float(record.get("slow_factor", 1.0)) == spec.slow_factor)  # fmt: skip


def split_overrides(argv: Sequence[str]) -> tuple[list[str], tuple[str, ...]]:
    """``argv`` before ``--`` for this script; after it, torchtitan overrides for every run."""
    argv = list(argv)
    if "--" not in argv:
        return argv, ()
    cut = argv.index("--")
    overrides = tuple(argv[cut + 1 :])
    for arg in overrides:
        if arg.split("=", 1)[0] in MANAGED:
            raise SystemExit(f"{arg.split('=', 1)[0]} is set by this script; see --help")
    return argv[:cut], overrides


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, tuple[str, ...]]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.convergence.run",
                                     description=__doc__.split("\n\n")[0] + " torchtitan "
                                     "overrides for every run go after '--'.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--updates", type=int, default=300, help="real updates per run (acco: 2x the rounds)")
    add("--modes", nargs="+", choices=[*MODES, *SCHEDULE_ARMS], default=list(MODES),
        help="convergence: acco.mode values, or the schedule arms of mode auto")
    add("--seeds", nargs="+", type=int, default=[0, 1, 2],
        help="--debug.seed (model initialisation) and the data order")
    add("--data-seed", type=int, default=None,
        help="one data order for every seed: the two sources of spread apart (plot.py)")
    add("--heterogeneous", action="store_true", help="rank 1 slowed, the arms of --arms")
    add("--arms", nargs="+", choices=sorted(ARMS), default=["acco_until_ready", "ddp"])
    add("--slow-factor", type=float, default=4.0,
        help="rank 1's time per micro-batch / its own compute")
    add("--ddp-microbatches-per-rank", type=int, default=5,
        help="ddp arm, per rank and update: 5 = acco_until_ready's 1 slow + 4 fast per round")
    add("--heldout-every", type=int, default=25,
        help="validate every N real updates (a multiple of --updates) and at step 1; 0: never")
    add("--corpus", nargs="+", choices=data.CORPORA, default=["stdlib"])
    add("--data-order", nargs="+", choices=data.ORDERS, default=["sequences"])
    add("--heldout-steps", type=int, default=64, help="validation batches per rank")
    add("--control-mix", nargs="+", type=int, default=[8, 2],
        help="ddp_matched: micro-batches per update of each rank")
    add("--cap", type=int, default=2, help="acco_capped: [acco] max_microbatches_per_round")
    add("--log-freq", type=int, default=0,
        help="heterogeneous: metrics.log_freq; 0: first and last step only")
    add("--batch-per-update", type=int, default=None,
        help="sequences per real update (acco: half per round); default: the TOMLs'")
    add("--out", default=None, help=f"results JSON; default: {DEFAULT_OUT}")
    add("--workdir", default=DEFAULT_WORKDIR, help="logs and dump folders")
    add("--nproc", type=int, default=2, help="processes (data-parallel ranks)")
    add("--print-every", type=int, default=25, help="echo every Nth step line")
    add("--force", action="store_true", help="rerun runs already in --out")
    own, overrides = split_overrides(argv)
    args = parser.parse_args(own)
    if args.updates < 1:
        parser.error("--updates must be >= 1")
    if args.heldout_every < 0 or args.heldout_steps < 1:
        parser.error("--heldout-every must be >= 0 and --heldout-steps >= 1")
    if args.heldout_every and args.updates % args.heldout_every:
        parser.error(f"--updates {args.updates} must be a multiple of --heldout-every "
                     f"{args.heldout_every}: torchtitan validates every freq steps, not at the "
                     "last one")  # fmt: skip
    if len(args.control_mix) != args.nproc or min(args.control_mix) < 1 or args.cap < 1:
        parser.error(f"--control-mix needs {args.nproc} counts >= 1 (one per rank), --cap >= 1")
    if args.slow_factor < 1 or args.ddp_microbatches_per_rank < 1:
        parser.error("--slow-factor and --ddp-microbatches-per-rank must be >= 1")
    if args.heterogeneous and args.batch_per_update is not None:
        parser.error("--batch-per-update is for convergence runs; --heterogeneous sets the "
                     "batch per arm (see --ddp-microbatches-per-rank)")  # fmt: skip
    if args.out is None:
        args.out = DEFAULT_OUT["heterogeneous" if args.heterogeneous else "convergence"]
    return args, overrides


def main(argv: Sequence[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    # relative to the checkout (an absolute path replaces REPO in the join)
    out = REPO / args.out
    args.workdir = str(REPO / args.workdir)
    results = json.loads(out.read_text()) if out.exists() else {"version": 1, "runs": {}}
    specs = plan(args, overrides)
    failed = 0
    for i, spec in enumerate(specs, 1):
        old = results["runs"].get(spec.key)
        if old and old.get("complete") and not args.force:
            if same_settings(old, spec):
                print(f"[{i}/{len(specs)}] {spec.key}: in {out.name}, skipped", flush=True)
                continue
            raise SystemExit(f"{spec.key} is in {out} with other settings (updates/overrides/"
                             "slow factor): pass --force to replace it, or another --out")
        print(f"[{i}/{len(specs)}] {spec.key}: {spec.steps} steps", flush=True)
        record = run_one(spec, args)
        results["runs"][spec.key] = record
        write_result(out, results)
        s = record["summary"]
        last = record["loss"][-1] if record["loss"] else math.nan
        print(f"    rc={record['returncode']} complete={record['complete']} "
              f"wall={record['wall_s']:.1f}s train={s.get('train_s', math.nan):.1f}s "
              f"tokens={s.get('tokens', 0):.0f} tokens/s={s.get('tokens_per_s', math.nan):.0f} "
              f"last loss={last:.4f} "
              f"held-out={s.get('heldout_loss_final', math.nan):.4f}", flush=True)  # fmt: skip
        if not record["complete"]:
            failed += 1
            print(f"    FAILED: see {record['log']}", flush=True)
    print(f"results: {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
