"""What every benchmark shares: how it launches ranks, how a rank reports, what a result file holds.

Launching: :func:`run_ranks` (gloo processes on loopback, each calling a function),
:func:`torchrun`, :func:`launch` and :func:`run` (a command and its output), :func:`run_on_link`
(two ranks on ``benchmarks/netbed.py``'s link, which needs root). Reporting: a worker prints
``RESULT <json>`` (:func:`emit`, read back by :func:`result_lines`); torchtitan's ``step:`` lines
are read by :func:`step_lines` and :func:`parse_steps`. Result files: :func:`header` (date and
machine), :func:`write_result` (atomic: a kill while writing leaves the previous file),
:func:`save_figure`; where they go: :func:`add_out_option` (``--out``, by default
:func:`result_file`, under ``outputs/results/``: a run leaves the published files in
``docs/results/`` alone unless ``--out`` names one) and :func:`figure_file`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import pickle
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"  # the published result files: written only through --out
FIGURES = ROOT / "docs" / "figures"  # the published figures, drawn from those files
OUTPUTS = ROOT / "outputs" / "results"  # where a run writes (README, "Generated files")
LOCAL_BATCH, SEQ_LEN = 4, 128  # the timing runs' micro-batch: 4 sequences of 128 tokens


# ----------------------------------------------------------------------------- result files


def machine() -> str:
    """The CPU, its core count, its widest vector instructions and the kernel: what a timing
    depends on. The vector width matters most to bfloat16 matrix products (Muon's
    Newton–Schulz): a CPU without AVX-512 computes them about 40-100 times slower."""
    lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
               platform.processor())  # fmt: skip
    flags = set(next((line.split(":", 1)[1].split() for line in lines
                      if line.startswith("flags")), []))  # fmt: skip
    vector = ("AVX-512 with bfloat16" if "avx512_bf16" in flags else "AVX-512"
              if "avx512f" in flags else "AVX2, no AVX-512" if "avx2" in flags else "no AVX2")
    return f"{os.cpu_count()} cores ({cpu}, {vector}), {platform.system()} {platform.release()}"


def header() -> dict[str, str]:
    """The first keys of a result file: when and where it was measured."""
    return {"date": datetime.date.today().isoformat(), "machine": machine()}


def result_file(name: str) -> pathlib.Path:
    """Where a benchmark writes its result file ``<name>.json`` unless ``--out`` names another:
    under ``outputs/results/``, never over the published one in ``docs/results/`` (publishing
    it is ``--out docs/results/<name>.json``)."""
    return OUTPUTS / f"{name}.json"


def add_out_option(parser: argparse.ArgumentParser, name: str, default: str = "") -> None:
    """The ``--out PATH`` every benchmark takes: its result file, by default :func:`result_file`
    of ``name``, or, where ``default`` says how the benchmark picks it, None unless given."""
    shown = default or f"outputs/results/{name}.json"
    parser.add_argument("--out", type=pathlib.Path, default=None if default else result_file(name),
                        help=f"the result file (default: {shown}; --out docs/results/{name}.json "
                        "rewrites the published one)")  # fmt: skip


def figure_file(out: str | os.PathLike, name: str) -> pathlib.Path:
    """Where the figure drawn from the result file ``out`` goes: the published
    ``docs/figures/<name>.png`` when ``out`` is the published ``docs/results/<name>.json``,
    otherwise beside ``out``, as ``.png``."""
    out = pathlib.Path(out)
    if out.resolve() == (RESULTS / f"{name}.json").resolve():
        return FIGURES / f"{name}.png"
    return out.with_suffix(".png")


def write_result(path: str | os.PathLike, results: dict) -> pathlib.Path:
    """``results`` as indented JSON at ``path``, atomically; a benchmark rewrites it after every
    run, so that a later failure keeps what was measured."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def pyplot():
    """matplotlib's pyplot drawing to files only (no display on the benchmark machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: pathlib.Path, dpi: int = 110) -> None:
    """Lay out, write and close a figure."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    print(f"wrote {path}")


# ----------------------------------------------------------------------------- RESULT lines


def emit(result: dict) -> None:
    """A worker's report: one ``RESULT <json>`` line on stdout, among whatever else it logs."""
    print("RESULT " + json.dumps(result), flush=True)


def result_lines(output: str) -> list[dict]:
    """Every ``RESULT`` line of ``output``, in order."""
    return [json.loads(line[len("RESULT "):]) for line in output.splitlines()
            if line.startswith("RESULT ")]  # fmt: skip


# ----------------------------------------------------------------------------- torchtitan's log

# "[default1]:[titan] 2026-11-21 10:41:02,903 - root - INFO - step:  1  loss:  8.13211
#  grad_norm:  1.0413  memory:  0.80GiB(3.39%)  tps: 1,044  tflops: ..." (the torchrun prefix
# "[default<rank>]:" with --tee; not a "validate step:" line)
PREFIX = r"^(?:\[default(?P<rank>\d+)\]:)?(?:.*?(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}))?"
STEP = re.compile(
    PREFIX + r".*?(?<!validate )step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>-?[\d.]+|nan|inf)"
    r"(?:\s+grad_norm:\s*(?P<grad_norm>-?[\d.]+|nan|inf))?"
    r".*?memory:\s*(?P<memory>[\d.]+)GiB.*?tps:\s*(?P<tps>[\d,]+)",
    re.MULTILINE,
)


def timestamp(text: str) -> float:
    """The UNIX time of a log line's ``2026-11-21 10:41:02,903``."""
    return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def step_line(match: re.Match) -> dict:
    """One match of :data:`STEP` as numbers (``ts``: UNIX time, or None without a stamp)."""
    grad_norm = match["grad_norm"]
    return {"rank": int(match["rank"] or 0), "step": int(match["step"]),
            "ts": timestamp(match["ts"]) if match["ts"] else None,
            "loss": float(match["loss"]),
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "memory_gib": float(match["memory"]),
            "tps": float(match["tps"].replace(",", ""))}  # fmt: skip


def step_lines(output: str) -> list[dict]:
    """Every training step line of ``output`` (:func:`step_line`)."""
    return [step_line(match) for match in STEP.finditer(output)]


def parse_steps(output: str, tokens_per_rank: int) -> dict:
    """Median step time (s) over steps >= 3, every such time, and the peak memory (GiB) of the
    steps, from torchtitan's per-step ``tps`` (tokens per rank and second)."""
    rows = step_lines(output)
    times = [tokens_per_rank / row["tps"] for row in rows if row["step"] >= 3]
    if not times:
        raise RuntimeError(f"no step lines in the output:\n{output[-3000:]}")
    return {"round_s": statistics.median(times), "round_s_all": times,
            "peak_rss_gib": max(row["memory_gib"] for row in rows)}  # fmt: skip


def titan_args(config: str, extra: Sequence[str], steps: int, microbatches: int, dp: int,
               dump: str, root: pathlib.Path = ROOT, local_batch: int = LOCAL_BATCH,
               seq_len: int = SEQ_LEN) -> list[str]:  # fmt: skip
    """One rank's command: ``root``'s (a checkout's) train_titan.py and job config,
    ``microbatches`` micro-batches per rank and step."""
    return [sys.executable, str(root / "train_titan.py"),
            "--job.config_file", str(root / "torchtitan_configs" / config),
            "--job.dump_folder", dump, "--metrics.disable_color_printing",
            "--training.steps", str(steps), "--training.local_batch_size", str(local_batch),
            "--training.seq_len", str(seq_len),
            "--training.global_batch_size", str(local_batch * dp * microbatches),
            *extra]  # fmt: skip


# ----------------------------------------------------------------------------- launching


def torchrun(nproc: int, *argv: str) -> list[str]:
    """``torchrun --standalone`` with ``nproc`` ranks on this machine, running ``argv``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", *argv]  # fmt: skip


def launch(cmd: Sequence[str], timeout_s: float = 900, env: dict | None = None,
           **popen) -> tuple[int | str, str]:  # fmt: skip
    """Run ``cmd`` in the checkout with ``env`` added: its exit status (``"timeout"`` if it ran
    past ``timeout_s``) and its output, whatever the status."""
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, cwd=ROOT,
                              timeout=timeout_s, env={**os.environ, **(env or {})}, check=False,
                              **popen)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        return "timeout", f"{exc.stdout or ''}{exc.stderr or ''}"
    return proc.returncode, proc.stdout + proc.stderr


def run(cmd: Sequence[str], timeout_s: float = 900, env: dict | None = None,
        log: pathlib.Path | None = None) -> str:  # fmt: skip
    """:func:`launch`'s output (also written to ``log``); a failure raises with its end."""
    status, output = launch(cmd, timeout_s, env)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(output)
    if status != 0:
        raise RuntimeError(f"{' '.join(cmd)[:300]} failed ({status}):\n{output[-3000:]}")
    return output


def run_on_link(link, argv: Sequence[str], env: dict | None = None, timeout_s: float = 1800,
                ranks_per_host: int = 1) -> str:  # fmt: skip
    """Rank 0's output of ``argv`` run as two ranks on the netbed ``link`` (or two hosts of
    ``ranks_per_host`` ranks each); a failure of any rank raises with two outputs' ends."""
    from benchmarks.netbed import run_two_ranks

    status, out0, out1 = run_two_ranks(link, argv, env=env, timeout_s=timeout_s,
                                       ranks_per_host=ranks_per_host)  # fmt: skip
    if status:
        raise RuntimeError(f"{' '.join(argv)[:300]} at {link.rate} failed ({status}):\n"
                           f"{out0[-3000:]}\n{out1[-2000:]}")  # fmt: skip
    return out0


def free_port() -> int:
    """:func:`scaffolding.ports.free_port`, imported when called: a worker script loads this
    file by its path (``round_overhead.this_checkout``), without the checkout on ``sys.path``."""
    from scaffolding.ports import free_port as pick

    return pick()


def _rank(rank: int, world_size: int, port: int, fn_path: str, args: tuple, outdir: str,
          orderly: bool) -> None:  # fmt: skip
    import importlib

    import torch
    import torch.distributed as dist

    from scaffolding.process_exit import finish

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    try:
        module, name = fn_path.rsplit(":", 1)
        result = getattr(importlib.import_module(module), name)(rank, world_size, *args)
        pathlib.Path(outdir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
        if orderly:  # nobody tears the group down while a peer's collectives may still drain
            dist.barrier()
    except BaseException:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        raise
    finish()  # scaffolding/process_exit.py: no abort at exit


def run_ranks(fn_path: str, world_size: int, *args, may_die: tuple[int, ...] = (),
              timeout_s: float = 900) -> list:  # fmt: skip
    """``module:function(rank, world_size, *args)`` on ``world_size`` gloo processes over
    loopback (the group is set up before the call); what each rank returned, ``None`` for a
    rank of ``may_die`` that ended without a result (one that killed itself)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as outdir:
        procs = [context.Process(target=_rank, args=(rank, world_size, port, fn_path, args,
                                                     outdir, not may_die))
                 for rank in range(world_size)]  # fmt: skip
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        if any(proc.is_alive() for proc in procs):
            for proc in procs:
                proc.kill()
            raise TimeoutError(f"{fn_path} on {world_size} ranks ran past {timeout_s:.0f} s")
        returned = []
        for rank, proc in enumerate(procs):
            path = pathlib.Path(outdir, f"rank{rank}.pkl")
            if not path.exists() and rank not in may_die:
                raise RuntimeError(f"{fn_path}: rank {rank} exited with {proc.exitcode}, no result")
            returned.append(pickle.loads(path.read_bytes()) if path.exists() else None)
        return returned
