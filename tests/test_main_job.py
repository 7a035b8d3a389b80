"""The README's main job and the examples, run as a user runs them."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]


@pytest.mark.parametrize("mode", ["acco", "ddp"])
def test_main_job_trains_and_prints_rounds_and_summary(mode: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "examples.train_small_transformer", "--mode", mode, "--rounds", "24",
           "--warmup-updates", "2"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rounds = re.findall(r"^round +(\d+) \| updates +(\d+) \| loss ([\d.]+)", proc.stdout, re.M)
    assert [int(r) for r, _, _ in rounds] == list(range(1, 25))
    summary = re.search(
        r"^summary: mode=(\w+) world_size=2 rounds=24 updates=(\d+) .*"
        r"mean_loss_first_\d+_rounds=([\d.]+) mean_loss_last_\d+_rounds=([\d.]+)", proc.stdout, re.M,
    )  # fmt: skip
    assert summary, proc.stdout
    assert summary.group(1) == mode
    assert int(summary.group(2)) == (12 if mode == "acco" else 24)
    assert float(summary.group(4)) < float(summary.group(3)) - 0.5  # it learns


def test_ddp_llama_example_trains_with_the_acco_hook() -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "examples.ddp_llama_acco", "--rounds", "30"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = re.search(r"^summary: mode=acco world_size=2 rounds=30 updates=15 "
                        r"mean_loss_first_\d+_microbatches=([\d.]+) "
                        r"mean_loss_last_\d+_microbatches=([\d.]+)", proc.stdout, re.M)  # fmt: skip
    assert summary, proc.stdout
    assert float(summary.group(2)) < float(summary.group(1)) - 0.5


@pytest.mark.titan  # on both torchtitan releases (0.3.0: the TOML translated)
def test_readme_main_job_trains_with_acco_and_prints_a_summary(tmp_path: pathlib.Path) -> None:
    """The README's first command (after its setup part), shortened to 8 rounds.

    Its generated files go to a fresh folder, as on a first run: the embedded corpus and its
    tokenizer are built before torchtitan looks for them.
    """
    readme = (ROOT / "README.md").read_text()
    first_command = readme.split("```bash\n", 1)[1].splitlines()[0]
    setup, main_job = first_command.split(" && ", 1)
    assert setup == "bash scripts/setup.sh"
    assert "train_titan.py" in main_job and "debug_cpu_acco.toml" in main_job
    overrides = (f" --training.steps 8 --metrics.disable_color_printing "
                 f"--model.hf_assets_path {tmp_path}/stdlib/tokenizer "
                 f"--training.dataset_path {tmp_path}/stdlib/dataset --job.dump_folder {tmp_path}/job")  # fmt: skip
    proc = subprocess.run(main_job + overrides, shell=True, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    assert "terminate called" not in output
    assert "does not exist" not in output  # torchtitan found the tokenizer on the first run
    for cpu_only_noise in ("lspci", "Peak flops", "cpu device mesh", "CPU autocast",
                           "TORCH_NCCL_ASYNC_ERROR_HANDLING"):  # fmt: skip
        assert cpu_only_noise not in output
    assert (tmp_path / "stdlib" / "tokenizer" / "tokenizer.json").is_file()
    steps = re.findall(r"step:\s+(\d+)\s+loss:\s+([\d.]+)", output)
    assert [int(s) for s, _ in steps] == list(range(1, 9))  # one copy of each line: rank 0's
    assert output.count("Training starts at step 1") == 1
    summary = re.search(r"summary: mode=acco data_parallel=2 rounds=8 updates=4 .*"
                        r"first_loss=([\d.]+) last_loss=([\d.]+) "
                        r"mean_loss_last_1_steps=([\d.]+)", output)  # fmt: skip
    assert summary, output[-3000:]
    first, last, mean_last = map(float, summary.groups())
    assert first == pytest.approx(float(steps[0][1]), abs=1e-4)
    assert last == pytest.approx(float(steps[-1][1]), abs=1e-4) == mean_last
