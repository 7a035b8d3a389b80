"""Where a benchmark writes: under outputs/results/ by default, wherever ``--out`` says, and never
over the published files in docs/results/ unless ``--out`` names one."""

from __future__ import annotations

import importlib
import json
import pathlib

import pytest

from benchmarks import harness

ROOT = pathlib.Path(__file__).resolve().parents[2]
# benchmark module -> the name of its result file; each has parse_args(argv)
PARSERS = {"memory_8b": "memory_8b", "torchft_recovery": "torchft_recovery",
           "hsdp_sync": "hsdp_sync", "memory": "memory", "shard_step": "shard_step",
           "scaling_model": "scaling", "round_overhead": "round_overhead",
           "muon_step": "muon_step", "replica_agreement": "replica_agreement"}  # fmt: skip


def test_a_result_file_goes_under_outputs_not_docs() -> None:
    path = harness.result_file("torchft_recovery")
    assert path == ROOT / "outputs" / "results" / "torchft_recovery.json"
    assert harness.RESULTS not in path.parents


@pytest.mark.parametrize("module", sorted(PARSERS))
def test_the_default_is_under_outputs_and_out_is_honoured(module: str, tmp_path) -> None:
    parse_args = importlib.import_module(f"benchmarks.{module}").parse_args
    assert parse_args([]).out == ROOT / "outputs" / "results" / f"{PARSERS[module]}.json"
    assert parse_args(["--out", str(tmp_path / "r.json")]).out == tmp_path / "r.json"


def test_a_figure_goes_to_docs_figures_only_beside_the_published_file(tmp_path) -> None:
    published = ROOT / "docs" / "results" / "law_sweep.json"
    figures = ROOT / "docs" / "figures"
    assert harness.figure_file(published, "law_sweep") == figures / "law_sweep.png"
    assert harness.figure_file(tmp_path / "mine.json", "law_sweep") == tmp_path / "mine.png"
    default = harness.result_file("law_sweep")
    assert harness.figure_file(default, "law_sweep") == default.with_suffix(".png")


def test_memory_8b_writes_where_out_says_and_leaves_the_published_file(
    tmp_path, capsys, monkeypatch
) -> None:
    from benchmarks import memory_8b

    # the 8B model's figures without building it (test_memory_8b.py builds it)
    facts = {"params": 8_030_261_248, "layers": 32, "hidden": 4096, "largest": 525_336_576}
    monkeypatch.setattr(memory_8b, "model_facts", lambda: facts)
    published = ROOT / "docs" / "results" / "memory_8b.json"
    before = published.read_bytes()
    out = tmp_path / "sub" / "memory_8b.json"
    memory_8b.main(["--out", str(out)])
    assert f"wrote {out}" in capsys.readouterr().out
    assert set(json.loads(out.read_text())) == {"params", "gpus_per_node", "configs", "diloco"}
    assert published.read_bytes() == before
