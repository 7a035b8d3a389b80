"""benchmarks/convergence: log parsing, step -> tokens, final-loss statistic, plots, smoke runs."""

from __future__ import annotations

import json
import math
import pathlib

import pytest

from benchmarks.convergence import plot, run

LOG = """\
[default0]:[titan] 2026-11-21 10:41:01,500 - root - INFO - Training starts at step 1
[default1]:[titan] 2026-11-21 10:41:01,501 - root - INFO - Training starts at step 1
[default0]:[titan] 2026-11-21 10:41:02,903 - root - INFO - step:  1  loss:  8.13211  \
grad_norm: -1.0000  memory:  0.80GiB(3.39%)  tps: 611  tflops: 0.02  mfu: 0.01%
[default1]:[titan] 2026-11-21 10:41:02,902 - root - INFO - step:  1  loss:  8.13211  \
grad_norm: -1.0000  memory:  0.80GiB(3.39%)  tps: 610  tflops: 0.02  mfu: 0.01%
[default0]:some other line with step: in it
[default0]:[titan] 2026-11-21 10:41:03,148 - root - INFO - step:  2  loss:  8.14143  \
grad_norm:  1.0760  memory:  0.85GiB(3.62%)  tps: 1,044  tflops: 0.04  mfu: 0.01%
[default1]:[titan] 2026-11-21 10:41:03,150 - root - INFO - step:  2  loss:  8.14143  \
grad_norm:  1.0760  memory:  0.86GiB(3.67%)  tps: 12,041  tflops: 0.04  mfu: 0.01%
"""


def test_parse_log_splits_ranks_and_reads_thousands() -> None:
    parsed = run.parse_log(LOG)
    assert sorted(parsed) == [0, 1]
    assert parsed[0]["step"] == [1, 2]
    assert parsed[0]["loss"] == [8.13211, 8.14143]
    assert parsed[0]["grad_norm"] == [-1.0, 1.076]
    assert parsed[0]["tps"] == [611.0, 1044.0]
    assert parsed[1]["tps"] == [610.0, 12041.0]
    assert parsed[0]["ts"][1] - parsed[0]["ts"][0] == pytest.approx(0.245, abs=1e-6)
    assert parsed[0]["start"][0] == pytest.approx(parsed[0]["ts"][0] - 1.403, abs=1e-6)


def test_parse_log_without_torchrun_prefix() -> None:
    plain = "\n".join(line.split("]:", 1)[1] for line in LOG.splitlines() if "default0" in line)
    parsed = run.parse_log(plain)
    assert list(parsed) == [0] and parsed[0]["step"] == [1, 2]


def test_steps_and_tokens_per_mode() -> None:
    assert run.steps_for("acco", 300) == 600
    assert run.steps_for("ddp", 300) == run.steps_for("dpu", 300) == 300
    with pytest.raises(ValueError):
        run.steps_for("zero", 1)
    per_update = {}
    for mode in run.MODES:
        _, config = run.load_config(mode)
        settings = run.batch_settings(config, (), dp=2)
        steps = run.steps_for(mode, 10)
        per_update[mode] = run.tokens_per_step_list([steps], settings)[0] / 10
    assert per_update == {"ddp": 16 * 128, "acco": 16 * 128, "dpu": 16 * 128}
    _, config = run.load_config("acco")
    settings = run.batch_settings(config, ("--training.seq_len=64", "--training.local_batch_size",
                                           "2"), dp=2)  # fmt: skip
    assert (settings.global_batch_size, settings.local_batch_size, settings.seq_len) == (8, 2, 64)
    assert run.tokens_per_step_list([1, 2, 3], settings) == [512, 1024, 1536]
    implicit = run.batch_settings({"training": {"local_batch_size": 4}}, (), dp=2)
    assert implicit.global_batch_size == 8  # torchtitan's -1: local x data-parallel degree
    assert run.mode_overrides("acco", 32) == ("--training.global_batch_size", "16")
    assert run.mode_overrides("ddp", 32) == ("--training.global_batch_size", "32")


def test_overrides_after_double_dash_and_managed_ones_refused() -> None:
    own, overrides = run.split_overrides(["--updates", "2", "--", "--training.seq_len", "64"])
    assert own == ["--updates", "2"] and overrides == ("--training.seq_len", "64")
    with pytest.raises(SystemExit):
        run.split_overrides(["--", "--training.steps=5"])


def test_curves_from_stats_weights_by_tokens() -> None:
    def rows(*items: tuple[int, int, float, float]) -> dict[int, run.StepStats]:
        out: dict[int, run.StepStats] = {}
        for step, valid, loss_sum, t in items:
            out.setdefault(step, run.StepStats()).add(
                {"step": step, "tokens": valid, "valid": valid, "loss_sum": loss_sum, "t": t})
        return out

    stats = {0: rows((1, 10, 20.0, 1.0), (1, 10, 40.0, 2.0), (2, 10, 10.0, 3.0)),
             1: rows((1, 10, 30.0, 2.5), (2, 10, 30.0, 4.0))}  # fmt: skip
    curves = run.curves_from_stats(stats, t0=0.5)
    assert curves["step"] == [1, 2]
    assert curves["loss"] == pytest.approx([90.0 / 30, 40.0 / 20])
    assert curves["tokens"] == [30, 50]
    assert curves["time_s"] == [2.0, 3.5]
    assert curves["microbatches"] == {"0": [2, 1], "1": [1, 1]}


def test_final_loss_statistic() -> None:
    assert plot.final_loss([10.0] * 95 + [1.0] * 5) == 1.0  # last 5 % of 100 steps
    assert plot.final_loss([3.0] * 28 + [1.0, 2.0]) == 1.5  # ceil(1.5) = 2 steps
    assert plot.final_loss([4.0]) == 4.0
    assert math.isnan(plot.final_loss([]))
    grouped = {
        "ddp": [{"seed": s, "loss": [9.0] * 19 + [v], "updates": 20, "tokens": [1]}
                for s, v in enumerate([2.0, 2.2])],
        "acco": [{"seed": s, "loss": [9.0] * 19 + [v], "updates": 20, "tokens": [1]}
                 for s, v in enumerate([2.2, 2.4])],
    }  # fmt: skip
    rows = {row["arm"]: row for row in plot.final_table(grouped, tail=0.05)}
    assert rows["ddp"]["mean"] == pytest.approx(2.1) and rows["ddp"]["gap_pct"] == 0.0
    assert rows["acco"]["std"] == pytest.approx(math.sqrt(0.02))  # sample std
    assert rows["acco"]["gap_pct"] == pytest.approx(100 * 0.2 / 2.1)


def test_smooth_and_band() -> None:
    assert plot.smooth([1.0, 3.0, 5.0, 7.0], 2).tolist() == [1.0, 2.0, 4.0, 6.0]
    assert plot.smooth([1.0, 2.0], 1).tolist() == [1.0, 2.0]
    records = [{"loss": [4.0, 2.0, 0.0], "tokens": [10, 20, 30]},
               {"loss": [6.0, 4.0, 2.0, 0.0], "tokens": [10, 20, 30, 40]}]  # fmt: skip
    x, mean, lo, hi = plot.band(records, "tokens", smooth_tokens=0)
    assert x.tolist() == [10, 20, 30]
    assert mean.tolist() == [5.0, 3.0, 1.0] and lo.tolist() == [4.0, 2.0, 0.0]
    assert hi.tolist() == [6.0, 4.0, 2.0]


def _synthetic_results() -> dict:
    runs = {}
    for mode, offset in (("ddp", 0.0), ("acco", 0.02), ("dpu", 0.05)):
        steps = 2 * 40 if mode == "acco" else 40
        per_step = 1024 if mode == "acco" else 2048
        for seed in range(3):
            loss = [8.0 * math.exp(-s / steps) + offset + 0.01 * seed for s in range(1, steps + 1)]
            runs[f"convergence/{mode}/seed{seed}"] = {
                "experiment": "convergence", "arm": mode, "mode": mode, "seed": seed,
                "updates": 40, "complete": True, "step": list(range(1, steps + 1)),
                "loss": loss, "tokens": [s * per_step for s in range(1, steps + 1)],
                "time_s": [0.5 * s for s in range(1, steps + 1)],
            }  # fmt: skip
    for arm, fast in (("acco_until_ready", 5), ("ddp", 4)):
        steps = 80 if arm != "ddp" else 40
        mbs = {"0": [fast] * steps, "1": [2 if arm != "ddp" else 4] * steps}
        tokens = [s * 512 * (fast + int(mbs["1"][0])) for s in range(1, steps + 1)]
        runs[f"heterogeneous/{arm}/seed0"] = {
            "experiment": "heterogeneous", "arm": arm, "mode": arm[:4], "seed": 0, "updates": 40,
            "complete": True, "slow_seconds": 0.3, "step": list(range(1, steps + 1)),
            "loss": [8.0 - 0.01 * s for s in range(steps)], "tokens": tokens,
            "time_s": [1.0 * s for s in range(1, steps + 1)], "microbatches": mbs,
            "rank_tokens": {r: [512 * m for m in v] for r, v in mbs.items()},
        }  # fmt: skip
        runs[f"heterogeneous/{arm}/seed0"]["summary"] = run.summarize(
            runs[f"heterogeneous/{arm}/seed0"])
    runs["convergence/ddp/seed9"] = {"experiment": "convergence", "complete": False, "loss": []}
    return {"version": 1, "runs": runs}


def test_plot_on_synthetic_json(tmp_path: pathlib.Path, capsys) -> None:
    results = tmp_path / "results.json"
    results.write_text(json.dumps(_synthetic_results()))
    assert plot.main(["--results", str(results), "--out-dir", str(tmp_path / "fig")]) == 0
    out = capsys.readouterr().out
    for name in ("convergence.png", "heterogeneous.png"):
        assert (tmp_path / "fig" / name).stat().st_size > 10_000
    assert "acco" in out and "dpu" in out and "+0.00%" in out
    assert "rank0: 400 (5.00/step" in out and "rank1: 160 (2.00/step" in out
    grouped = plot.load_runs(results, "convergence")
    assert list(grouped) == ["ddp", "acco", "dpu"] and len(grouped["ddp"]) == 3  # seed9 left out


def _run_args(tmp_path: pathlib.Path, *extra: str) -> list[str]:
    return ["--updates", "2", "--seeds", "0", "--print-every", "0",
            "--out", str(tmp_path / "r.json"), "--workdir", str(tmp_path / "work"), *extra,
            "--", "--training.seq_len", "64", "--training.local_batch_size", "2"]  # fmt: skip


def test_smoke_run_one_mode_one_seed(tmp_path: pathlib.Path, capsys) -> None:
    assert run.main(_run_args(tmp_path, "--modes", "ddp")) == 0
    record = json.loads((tmp_path / "r.json").read_text())["runs"]["convergence/ddp/seed0"]
    assert record["complete"] and record["step"] == [1, 2] and record["steps"] == 2
    assert record["tokens"] == [16 * 64, 2 * 16 * 64]
    assert all(0 < v < 20 for v in record["loss"])
    assert sorted(record["tps"]) == ["0", "1"] and record["wall_s"] > 0
    assert record["time_s"][0] > 0 and record["summary"]["tokens_per_s"] > 0
    capsys.readouterr()
    assert run.main(_run_args(tmp_path, "--modes", "ddp")) == 0  # already there: skipped
    assert "skipped" in capsys.readouterr().out


def test_smoke_heterogeneous_counts_microbatches(tmp_path: pathlib.Path) -> None:
    args = _run_args(tmp_path, "--heterogeneous", "--arms", "acco_until_ready",
                     "--slow-seconds", "0.05", "--log-freq", "1")  # fmt: skip
    args[1] = "1"  # one update: two rounds
    assert run.main(args) == 0
    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    record = runs["heterogeneous/acco_until_ready/seed0"]
    assert record["complete"] and record["step"] == [1, 2]
    assert sorted(record["microbatches"]) == ["0", "1"]
    assert all(m >= 2 for counts in record["microbatches"].values() for m in counts)
    # the loss rebuilt from the per-micro-batch logs is what torchtitan logged
    assert record["step_logged"] == [1, 2]
    assert record["loss"] == pytest.approx(record["loss_logged"], abs=1e-4)
    assert record["tokens"][-1] == sum(sum(v) for v in record["rank_tokens"].values())
