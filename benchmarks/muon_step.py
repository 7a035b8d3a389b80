"""What Muon costs on a CPU, with and without AVX-512: one step, and the CPU Muon recipe.

    python -m benchmarks.muon_step                      # ~3 min on 2 cores
    python -m benchmarks.muon_step --out docs/results/muon_step.json   # the published

torch's Muon orthogonalizes each matrix's update with a Newton–Schulz iteration in bfloat16,
whose matrix products oneDNN computes with AVX-512's bfloat16 instructions where the CPU has
them, and far slower without. Each setting runs in a fresh process:

- ``native``: this CPU's own kernels;
- ``avx2``: oneDNN and ATen limited to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``,
  ``ATEN_CPU_CAPABILITY=avx2``), what a CPU without AVX-512 runs.

Per setting: one ``torch.optim.Muon`` step over the llama3 debug model's 42 hidden matrices
(6 layers of 4 256x256 attention and 3 256x768 feed-forward matrices), on one thread as a
training rank runs (OMP_NUM_THREADS=1), ``--repeats`` times; and, where torchtitan 0.3.0 is
installed, the CPU Muon recipe (``train_titan.py --module examples.titan_muon_recipe --config
debug_cpu_acco_muon``, 2 ranks, 8 steps): its wall time and the training time of its summary
line. Writes ``outputs/results/muon_step.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import harness

# The llama3 debug model's hidden matrices (torchtitan's debugmodel: dim 256, ffn 768, 6 layers)
DEBUG_MATRICES = ([(256, 256)] * 4 + [(768, 256), (256, 768), (768, 256)]) * 6
SETTINGS = {
    "native": {},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}
RECIPE = ["train_titan.py", "--module", "examples.titan_muon_recipe", "--config",
          "debug_cpu_acco_muon"]  # fmt: skip
_SUMMARY_TIME = re.compile(r"summary: .* time=([\d.]+)s")


def step_seconds(shapes: list[tuple[int, int]], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` Muon steps over matrices of ``shapes``, in this process."""
    import torch

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape) * 0.02) for shape in shapes]
    optimizer = torch.optim.Muon(params, lr=0.02, momentum=0.95, weight_decay=0.1,
                                 adjust_lr_fn="match_rms_adamw")  # fmt: skip
    times = []
    for _ in range(repeats):
        for p in params:
            p.grad = torch.randn_like(p)
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times


def _env(setting: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **SETTINGS[setting]}


def measure_step(setting: str, repeats: int) -> dict:
    """:func:`step_seconds` of the debug model's matrices in a fresh process under ``setting``."""
    code = ("import json, torch; from benchmarks.muon_step import DEBUG_MATRICES, step_seconds; "
            f"print(json.dumps({{'capability': torch.backends.cpu.get_cpu_capability(), "
            f"'step_s': step_seconds(DEBUG_MATRICES, {repeats})}}))")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], env=_env(setting), cwd=harness.ROOT,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_recipe(setting: str) -> dict:
    """The CPU Muon recipe on 2 ranks under ``setting``: wall seconds, training seconds."""
    with tempfile.TemporaryDirectory() as dump:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", "2", *RECIPE, "--dump-folder", dump]  # fmt: skip
        start = time.perf_counter()
        proc = subprocess.run(command, env=_env(setting), cwd=harness.ROOT, capture_output=True,
                              text=True)  # fmt: skip
        wall = time.perf_counter() - start
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"the Muon recipe failed under {setting}:\n{output[-3000:]}")
    return {"wall_s": round(wall, 1),
            "training_s": float(_SUMMARY_TIME.search(output).group(1))}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=4, help="Muon steps timed per setting")
    parser.add_argument("--no-recipe", action="store_true",
                        help="time the step alone (the recipe needs torchtitan 0.3.0)")  # fmt: skip
    harness.add_out_option(parser, "muon_step")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from acco_hooks.titan import TITAN_030

    results = {**harness.header(), "matrices": "llama3 debugmodel, 42 hidden matrices",
               "threads": 1, "settings": {}}  # fmt: skip
    for setting in SETTINGS:
        step = measure_step(setting, args.repeats)
        entry = {**step, "median_step_s": round(statistics.median(step["step_s"]), 3)}
        if TITAN_030 and not args.no_recipe:
            entry["recipe"] = measure_recipe(setting)
        results["settings"][setting] = entry
        print(f"{setting}: {entry}")
    harness.write_result(args.out, results)
    return results


if __name__ == "__main__":
    main()
