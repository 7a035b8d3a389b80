"""benchmarks/convergence: log parsing (training and held-out lines), step -> tokens, the runs'
settings (batch per arm, validation frequency), final-loss and held-out statistics, plots,
smoke runs."""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np
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
[default0]:[titan] 2026-11-21 10:41:03,400 - root - INFO - validate step:  2  loss:  7.9876  \
memory:  0.85GiB(3.62%)  tps: 9,120
[default1]:[titan] 2026-11-21 10:41:03,401 - root - INFO - validate step:  2  loss:  7.9876  \
memory:  0.85GiB(3.62%)  tps: 9,100
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
    # held-out lines are kept apart from the training steps
    assert parsed[0]["heldout_step"] == [2] and parsed[0]["heldout_loss"] == [7.9876]
    assert parsed[0]["heldout_ts"][0] - parsed[0]["ts"][1] == pytest.approx(0.252, abs=1e-6)
    assert parsed[1]["heldout_step"] == [2]


def test_parse_log_without_torchrun_prefix() -> None:
    plain = "\n".join(line.split("]:", 1)[1] for line in LOG.splitlines() if "default0" in line)
    parsed = run.parse_log(plain)
    assert list(parsed) == [0] and parsed[0]["step"] == [1, 2]
    assert parsed[0]["heldout_step"] == [2]


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
    for managed in ("--training.steps=5", "--validation.freq", "--experimental.custom_import"):
        with pytest.raises(SystemExit):
            run.split_overrides(["--", managed, "1"])


def _planned(*argv: str) -> dict[str, run.RunSpec]:
    args, overrides = run.parse_args(list(argv))
    return {spec.arm: spec for spec in run.plan(args, overrides)}


def test_plan_validates_every_n_updates_on_the_training_batch_shape() -> None:
    specs = _planned("--updates", "50", "--seeds", "0", "--heldout-every", "25",
                     "--", "--training.seq_len", "64")  # fmt: skip
    for mode, freq in (("ddp", "25"), ("acco", "50"), ("dpu", "25")):
        overrides = specs[mode].overrides
        assert "--validation.enable" in overrides
        assert run.override_value(overrides, "--validation.freq") == freq  # acco: 2 rounds/update
        assert run.override_value(overrides, "--validation.steps") == "64"
        assert run.override_value(overrides, "--validation.dataset") == "stdlib_validation"
        assert run.override_value(overrides, "--validation.seq_len") == "64"
        assert run.override_value(overrides, "--validation.local_batch_size") == "4"
    assert run.updates_after("acco", 50) == 25 and run.updates_after("ddp", 50) == 50
    assert "--validation.enable" not in _planned("--updates", "2", "--heldout-every", "0")[
        "ddp"].overrides  # fmt: skip
    with pytest.raises(SystemExit):  # the last update would not be validated
        run.parse_args(["--updates", "30", "--heldout-every", "25"])


def test_plan_heterogeneous_equal_tokens_per_update() -> None:
    specs = _planned("--heterogeneous", "--updates", "4", "--heldout-every", "2")
    ddp, acco = specs["ddp"], specs["acco_until_ready"]
    # ddp: 5 micro-batches of 4 sequences per rank per update; acco: 1 per rank per round
    assert run.override_value(ddp.overrides, "--training.global_batch_size") == "40"
    assert run.override_value(acco.overrides, "--training.global_batch_size") == "8"
    assert "--acco.accumulate_until_ready" in acco.overrides
    assert ddp.slow_factor == acco.slow_factor == 4.0
    specs = _planned("--heterogeneous", "--updates", "4", "--heldout-every", "2",
                     "--ddp-microbatches-per-rank", "3", "--slow-factor", "2")  # fmt: skip
    assert run.override_value(specs["ddp"].overrides, "--training.global_batch_size") == "24"
    assert specs["ddp"].slow_factor == 2.0
    env = run.run_env(specs["ddp"], pathlib.Path("/tmp/x"), 1)
    assert env[run.SLOW_FACTOR_ENV] == "2" and env[run.STATS_DIR_ENV] == "/tmp/x/stats"
    assert run.RANK_ARGS_ENV not in env
    args, _ = run.parse_args(["--heterogeneous"])
    assert args.out == run.DEFAULT_OUT["heterogeneous"]
    assert run.parse_args([])[0].out == run.DEFAULT_OUT["convergence"]


def test_plan_control_and_capped_arms_and_the_seeded_data() -> None:
    specs = _planned("--heterogeneous", "--updates", "4", "--heldout-every", "2", "--arms",
                     "ddp_matched", "acco_capped", "--control-mix", "6", "3", "--cap", "3",
                     "--seeds", "1", "--", "--training.seq_len", "32")  # fmt: skip
    matched, capped = specs["ddp_matched"], specs["acco_capped"]
    assert matched.mode == "ddp" and capped.mode == "acco"
    assert matched.rank_args == (("--acco.accumulation_steps", "6"),
                                 ("--acco.accumulation_steps", "3"))  # fmt: skip
    env = run.run_env(matched, pathlib.Path("/tmp/x"), 1)
    assert json.loads(env[run.RANK_ARGS_ENV]) == {"0": ["--acco.accumulation_steps", "6"],
                                                  "1": ["--acco.accumulation_steps", "3"]}
    command = run.build_command(matched, pathlib.Path("c.toml"), pathlib.Path("/tmp/x"), 2)
    assert command[command.index("--tee") + 2].endswith("benchmarks/convergence/per_rank.py")
    assert run.override_value(capped.overrides, "--acco.max_microbatches_per_round") == "3"
    assert "--acco.accumulate_until_ready" in capped.overrides
    for spec in specs.values():  # the seed picks the data order; sequences by default
        assert spec.key.startswith(f"heterogeneous/stdlib-sequences/{spec.arm}/seed1")
        assert run.override_value(spec.overrides, "--training.dataset_path") == (
            "outputs/convergence_data/stdlib/sequences-seed1-len32")
    with pytest.raises(SystemExit):  # one count per rank
        run.parse_args(["--heterogeneous", "--control-mix", "8"])
    with pytest.raises(SystemExit):  # set by the arm, per rank
        run.split_overrides(["--", "--acco.accumulation_steps", "2"])


def test_sequence_data_is_one_sequence_per_line_in_a_seeded_order() -> None:
    """Each training line of the sequence order encodes to seq_len - 1 tokens (torchtitan adds
    BOS and EOS: one sequence); seeds shuffle the same lines differently; the held-out lines are
    the same for every seed and order; the document order keeps whole documents."""
    from tokenizers import Tokenizer

    from benchmarks.convergence import data

    def lines(path: pathlib.Path, name: str) -> list[str]:
        return [json.loads(line)["text"] for line in (path / name).read_text().splitlines()]

    seq_len = 24
    tokenizer = Tokenizer.from_file(str(run.REPO / "outputs/stdlib/tokenizer/tokenizer.json"))
    a, b = data.prepare("stdlib", "sequences", 0, seq_len), data.prepare("stdlib", "sequences",
                                                                          1, seq_len)
    docs = data.prepare("stdlib", "documents", 1, seq_len)
    train_a, train_b = lines(a, "train.jsonl"), lines(b, "train.jsonl")
    assert sorted(train_a) == sorted(train_b) and train_a[:50] != train_b[:50]
    sample = train_a[:: max(1, len(train_a) // 500)]
    lengths = [len(tokenizer.encode(t, add_special_tokens=False).ids) for t in sample]
    assert sum(n == seq_len - 1 for n in lengths) >= 0.98 * len(lengths)
    assert lines(a, "validation.jsonl") == lines(b, "validation.jsonl") == lines(
        docs, "validation.jsonl")
    source = run.REPO / "outputs/stdlib/dataset/train.jsonl"
    originals = [json.loads(line)["text"] for line in source.read_text().splitlines()]
    assert sorted(lines(docs, "train.jsonl")) == sorted(originals)
    assert data.describe(a)["train_documents"] == len(train_a)

    # 2 replicas each on its own half of the files, blocks of 3 sequences in turn: every line
    # is a sequence of the corpus, the even blocks from the first half of the files (by their
    # sequence counts, counted here from the tokenizer), the odd ones from the second
    parts = lines(data.prepare("stdlib", data.replica_parts(2, 3), 0, seq_len), "train.jsonl")
    assert len(parts) % 6 == 0 and len(parts) >= 0.95 * len(train_a)
    assert not set(parts) - set(train_a)
    counts = [len(e.ids) // (seq_len - 1)
              for e in tokenizer.encode_batch(originals, add_special_tokens=False)]
    half = next(i for i in range(len(counts)) if 2 * sum(counts[:i]) + counts[i] >= sum(counts))
    for block in (0, 1, 2, 3, len(parts) // 3 - 2, len(parts) // 3 - 1):
        for line in parts[3 * block : 3 * block + 3]:
            homes = [i for i, doc in enumerate(originals) if line in doc]
            assert homes and (min(homes) <= half if block % 2 == 0 else max(homes) >= half)


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


def _heldout(record: dict, mode: str, every_steps: int, loss_of_tokens) -> None:
    """Held-out fields as run.make_record writes them: step 1 and every ``every_steps``."""
    steps = [1] + [s for s in record["step"] if s % every_steps == 0]
    tokens_at = dict(zip(record["step"], record["tokens"]))
    record.update({
        "heldout_step": steps, "heldout_updates": [run.updates_after(mode, s) for s in steps],
        "heldout_tokens": [tokens_at[s] for s in steps],
        "heldout_loss": [loss_of_tokens(tokens_at[s]) for s in steps],
        "heldout_time_s": [record["time_s"][s - 1] for s in steps],
    })  # fmt: skip


def _synthetic_results(seeds: int = 3) -> dict:
    """Held-out loss = f(tokens) + a per-mode offset + a per-seed offset: the paired gap to ddp
    is the mode's offset exactly. Heterogeneous: acco_until_ready 0.1 below ddp per token."""
    runs = {}
    for mode, offset in (("ddp", 0.0), ("acco", 0.02), ("dpu", 0.05)):
        steps = 2 * 40 if mode == "acco" else 40
        per_step = 1024 if mode == "acco" else 2048
        for seed in range(seeds):
            loss = [8.0 * math.exp(-s / steps) + offset + 0.01 * seed for s in range(1, steps + 1)]
            record = runs[f"convergence/stdlib-sequences/{mode}/seed{seed}"] = {
                "experiment": "convergence", "arm": mode, "mode": mode, "seed": seed,
                "corpus": "stdlib", "data_order": "sequences",
                "updates": 40, "complete": True, "step": list(range(1, steps + 1)),
                "loss": loss, "tokens": [s * per_step for s in range(1, steps + 1)],
                "time_s": [0.5 * s for s in range(1, steps + 1)],
            }  # fmt: skip
            _heldout(record, mode, run.steps_for(mode, 10),
                     lambda t, c=offset + 0.01 * seed: 7.0 * math.exp(-t / 81920) + c)
    for seed in range(seeds):
        for arm, fast in (("acco_until_ready", 5), ("ddp", 4)):
            steps = 80 if arm != "ddp" else 40
            mbs = {"0": [fast] * steps, "1": [2 if arm != "ddp" else 4] * steps}
            tokens = [s * 512 * (fast + int(mbs["1"][0])) for s in range(1, steps + 1)]
            record = runs[f"heterogeneous/stdlib-sequences/{arm}/seed{seed}"] = {
                "experiment": "heterogeneous", "arm": arm, "mode": arm[:4], "seed": seed,
                "corpus": "stdlib", "data_order": "sequences",
                "updates": 40, "complete": True, "slow_factor": 4.0,
                "microbatches_per_round_nominal": 1 if arm != "ddp" else 4,
                "step": list(range(1, steps + 1)), "loss": [8.0 - 0.01 * s for s in range(steps)],
                "tokens": tokens, "time_s": [(1.0 + 0.1 * seed) * s for s in range(1, steps + 1)],
                "microbatches": mbs,
                "rank_tokens": {r: [512 * m for m in v] for r, v in mbs.items()},
            }  # fmt: skip
            _heldout(record, record["mode"], 20 if arm != "ddp" else 10,
                     lambda t, c=0.0 if arm == "ddp" else -0.1: 8.0 - t / 1e5 + c)
            record["summary"] = run.summarize(record)
    runs["convergence/ddp/seed9"] = {"experiment": "convergence", "complete": False, "loss": []}
    return {"version": 1, "runs": runs}


def test_heldout_statistics() -> None:
    grouped = plot.group_runs(_synthetic_results()["runs"], "convergence")
    rows = {row["arm"]: row for row in plot.heldout_table(grouped)}
    assert rows["ddp"]["seeds"] == [0, 1, 2] and rows["ddp"]["updates"] == 40
    assert rows["acco"]["tokens"] == rows["ddp"]["tokens"] == 40 * 2048
    assert rows["acco"]["std"] == pytest.approx(0.01)  # the seeds' offsets 0, .01, .02
    assert rows["acco"]["paired_gap_mean"] == pytest.approx(0.02)
    assert rows["acco"]["paired_gap_std"] == pytest.approx(0.0, abs=1e-12)  # paired: no seed noise
    assert rows["dpu"]["paired_gap_to_ddp"]["2"] == pytest.approx(0.05)
    tokens, mean, std = plot.heldout_mean(grouped["acco"])
    assert tokens.tolist() == [1024, 20480, 40960, 61440, 81920] and len(mean) == len(std) == 5
    # gaps at the token counts both have; acco's step-1 point (half an update) has no partner
    ddp_x, ddp_y = plot.heldout_curve(grouped["ddp"][0])
    x, gap = plot.gap_at(ddp_x, ddp_y, *plot.heldout_curve(grouped["acco"][0]), exact=True)
    assert x.tolist() == [20480, 40960, 61440, 81920] and gap == pytest.approx([0.02] * 4)
    comparison = plot.hetero_comparison(plot.group_runs(_synthetic_results()["runs"],
                                                        "heterogeneous"))  # fmt: skip
    seed0 = comparison["per_seed"]["0"]
    assert seed0["equal_tokens"] == 40 * 4096  # ddp's last: acco ran further
    assert seed0["gap_at_equal_tokens"] == pytest.approx(-0.1)
    assert seed0["tokens_per_s_ratio"] == pytest.approx(3584 / 4096)
    assert comparison["tokens_per_s_ratio_std"] == pytest.approx(0.0, abs=1e-12)


def test_plot_on_synthetic_json(tmp_path: pathlib.Path, capsys) -> None:
    results = tmp_path / "results.json"
    results.write_text(json.dumps(_synthetic_results()))
    missing = str(tmp_path / "missing.json")
    assert plot.main(["--results", str(results), missing, "--out-dir", str(tmp_path / "fig")]) == 0
    out = capsys.readouterr().out
    for name in ("convergence_iid.png", "heterogeneous_iid.png"):
        assert (tmp_path / "fig" / name).stat().st_size > 10_000
    assert "acco" in out and "dpu" in out and "+0.00%" in out
    assert "+0.0200 ± 0.0000" in out  # acco's paired held-out gap to ddp
    assert "rank0: 400 (5.00/step" in out and "rank1: 160 (2.00/step" in out
    assert "tokens/s acco_until_ready / ddp: 0.88 ± 0.00" in out
    summary = json.loads(results.read_text())["summary"]
    acco = next(r for r in summary["convergence/iid"]["heldout_final_update"]
                if r["arm"] == "acco")  # fmt: skip
    assert acco["paired_gap_mean"] == pytest.approx(0.02)
    hetero = summary["heterogeneous/iid"]
    assert hetero["vs_ddp"]["gap_at_equal_tokens_mean"] == pytest.approx(-0.1)
    # in % of ddp's held-out loss at the equal token count (ddp's last: 40 updates x 4096)
    assert hetero["heldout_gap_pct"]["mean"] == pytest.approx(-10 / (8.0 - 40 * 4096 / 1e5))
    assert hetero["heldout_gap_pct"]["std"] == pytest.approx(0.0, abs=1e-9)
    grouped = plot.load_runs(results, "convergence")
    assert list(grouped) == ["ddp", "acco", "dpu"] and len(grouped["ddp"]) == 3  # seed9 left out


def test_plot_without_heldout_data(tmp_path: pathlib.Path) -> None:
    """A results file from before the held-out loss (docs/results/convergence.json) still plots."""
    results = _synthetic_results(seeds=1)
    for record in results["runs"].values():
        for key in [k for k in record if k.startswith("heldout_")]:
            del record[key]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(results))
    argv = ["--results", str(path), "--out-dir", str(tmp_path), "--no-write-summary"]
    assert plot.main(argv) == 0
    assert (tmp_path / "convergence_iid.png").exists()
    assert "summary" not in json.loads(path.read_text())


def _run_args(tmp_path: pathlib.Path, *extra: str) -> list[str]:
    return ["--updates", "2", "--seeds", "0", "--print-every", "0", "--heldout-every", "1",
            "--heldout-steps", "2",
            "--out", str(tmp_path / "r.json"), "--workdir", str(tmp_path / "work"), *extra,
            "--", "--training.seq_len", "64", "--training.local_batch_size", "2"]  # fmt: skip


def test_smoke_run_one_mode_one_seed(tmp_path: pathlib.Path, capsys) -> None:
    assert run.main(_run_args(tmp_path, "--modes", "ddp")) == 0
    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    record = runs["convergence/stdlib-sequences/ddp/seed0"]
    assert record["complete"] and record["step"] == [1, 2] and record["steps"] == 2
    assert record["tokens"] == [16 * 64, 2 * 16 * 64]
    assert all(0 < v < 20 for v in record["loss"])
    assert record["heldout_step"] == record["heldout_updates"] == [1, 2]
    assert record["heldout_tokens"] == record["tokens"]
    assert all(0 < v < 20 for v in record["heldout_loss"])
    assert sorted(record["tps"]) == ["0", "1"] and record["wall_s"] > 0
    assert record["time_s"][0] > 0 and record["summary"]["tokens_per_s"] > 0
    capsys.readouterr()
    assert run.main(_run_args(tmp_path, "--modes", "ddp")) == 0  # already there: skipped
    assert "skipped" in capsys.readouterr().out


def test_smoke_heterogeneous_counts_microbatches(tmp_path: pathlib.Path) -> None:
    args = _run_args(tmp_path, "--heterogeneous", "--arms", "acco_until_ready",
                     "--slow-factor", "2", "--log-freq", "1")  # fmt: skip
    args[1] = "1"  # one update: two rounds
    assert run.main(args) == 0
    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    record = runs["heterogeneous/stdlib-sequences/acco_until_ready/seed0"]
    assert record["complete"] and record["step"] == [1, 2]
    assert sorted(record["microbatches"]) == ["0", "1"]
    assert record["microbatches_per_round_nominal"] == 1  # the rest is accumulate_until_ready's
    assert all(m >= 1 for counts in record["microbatches"].values() for m in counts)
    # validated after round 1 and after the update (round 2), at the tokens actually processed
    assert record["heldout_step"] == [1, 2] and record["heldout_updates"] == [0, 1]
    assert record["heldout_tokens"] == record["tokens"]
    assert record["slow_factor"] == 2.0
    # the loss rebuilt from the per-micro-batch logs is what torchtitan logged
    assert record["step_logged"] == [1, 2]
    assert record["loss"] == pytest.approx(record["loss_logged"], abs=1e-4)
    assert record["tokens"][-1] == sum(sum(v) for v in record["rank_tokens"].values())


def test_first_crossing_interpolates_between_validations() -> None:
    x, loss = np.array([0.0, 10.0, 20.0]), np.array([8.0, 6.0, 5.0])
    assert plot.first_crossing(x, loss, 7.0) == pytest.approx(5.0)
    assert plot.first_crossing(x, loss, 5.5) == pytest.approx(15.0)
    assert math.isnan(plot.first_crossing(x, loss, 4.0))  # never reached


def test_smoke_control_arm_runs_each_ranks_own_microbatches(tmp_path: pathlib.Path) -> None:
    """ddp_matched: 3 micro-batches on rank 0 and 1 on rank 1 in every update (per_rank.py);
    acco_capped with a cap of 1: never more than one micro-batch per round on either rank."""
    args = _run_args(tmp_path, "--heterogeneous", "--arms", "ddp_matched", "acco_capped",
                     "--control-mix", "3", "1", "--cap", "1", "--slow-factor", "2")  # fmt: skip
    assert run.main(args) == 0
    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    matched = runs["heterogeneous/stdlib-sequences/ddp_matched/seed0"]
    assert matched["complete"] and matched["microbatches"] == {"0": [3, 3], "1": [1, 1]}
    capped = runs["heterogeneous/stdlib-sequences/acco_capped/seed0"]
    assert capped["complete"] and capped["microbatches"] == {"0": [1] * 4, "1": [1] * 4}


def test_training_tokens_per_s_leaves_out_the_step_after_each_validation() -> None:
    record = {"step": [1, 2, 3, 4, 5], "time_s": [1.0, 2.0, 7.0, 8.0, 9.0],
              "tokens": [10, 20, 30, 40, 50], "heldout_step": [1, 2]}  # fmt: skip
    # steps 2 and 3 follow validations; steps 4 and 5: 20 tokens in 2 s
    assert run.training_tokens_per_s(record) == pytest.approx(10.0)
    assert run.summarize(record)["tokens_per_s"] == pytest.approx(50 / 9)
