"""The embedded stdlib dataset and tokenizer, checked through torchtitan's own loaders."""

from __future__ import annotations

import inspect
import json
import multiprocessing
import pathlib
import sysconfig

import pytest
import torch

from scaffolding import stdlib_data
from scaffolding.stdlib_data import (
    BOS_TOKEN,
    EOS_TOKEN,
    build_stdlib_dataset,
    ensure_stdlib_assets,
    register_stdlib_datasets,
    train_stdlib_tokenizer,
)

# torchtitan and datasets are imported inside the tests: the spawned processes of
# test_concurrent_ensure import this module, and those imports would double their start-up time.

# Enough text (about 1 MB) for 2048 BPE tokens, small enough to train in well under a second.
SMALL = 60


@pytest.fixture(autouse=True)
def _hf_cache_in_tmp(tmp_path, monkeypatch):
    # datasets.load_dataset keeps an Arrow copy of the jsonl; keep it out of ~/.cache in tests.
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


@pytest.fixture(scope="session")
def small_assets(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    root = tmp_path_factory.mktemp("small")
    dataset = build_stdlib_dataset(root / "dataset", max_files=SMALL)
    return dataset, train_stdlib_tokenizer(dataset, root / "tokenizer")


def _files(directory: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_dataset_layout(small_assets):
    dataset, _ = small_assets
    train = [json.loads(line)["text"] for line in (dataset / "train.jsonl").open()]
    validation = [json.loads(line)["text"] for line in (dataset / "validation.jsonl").open()]
    assert (len(train), len(validation)) == (SMALL - SMALL // 20, SMALL // 20)
    # The first stdlib file in sorted order, verbatim; the 20th goes to validation.
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "site-packages"}
    first = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    assert train[0] == first[0].read_text(encoding="utf-8")
    assert validation[0] == first[19].read_text(encoding="utf-8")


def test_tokenizer_with_torchtitan(small_assets):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    _, tokenizer_dir = small_assets
    tok = HuggingFaceTokenizer(str(tokenizer_dir))
    assert tok.get_vocab_size() == stdlib_data.VOCAB_SIZE == 2048
    assert (tok.bos_id, tok.eos_id) == (tok.token_to_id(BOS_TOKEN), tok.token_to_id(EOS_TOKEN))
    assert None not in (tok.bos_id, tok.eos_id) and tok.bos_id != tok.eos_id

    # Real Python source (a file the small corpus never saw) plus bytes BPE rarely meets.
    text = inspect.getsource(json.decoder) + "\r\n\tnon-ASCII: héllo ✓ 𝔘 \x00\n"
    ids = tok.encode(text, add_bos=False, add_eos=False)
    assert tok.decode(ids) == text
    assert max(ids) < 2048 and min(ids) >= 0
    assert len(ids) < len(text) / 2  # it did learn merges

    both = tok.encode(text, add_bos=True, add_eos=True)
    assert both == [tok.bos_id, *ids, tok.eos_id]
    assert both.count(tok.bos_id) == 1 and both.count(tok.eos_id) == 1
    # The defaults from tokenizer_config.json: BOS only.
    assert tok.encode("x = 1") == [tok.bos_id, *tok.encode("x = 1", add_bos=False)]


def _job_config(dataset_dir: pathlib.Path, batch_size: int, seq_len: int):
    from torchtitan.config import JobConfig

    job_config = JobConfig()
    job_config.training.dataset = stdlib_data.DATASET_NAME
    job_config.training.dataset_path = str(dataset_dir)
    job_config.training.local_batch_size = batch_size
    job_config.training.seq_len = seq_len
    job_config.validation.dataset = stdlib_data.VALIDATION_DATASET_NAME
    job_config.validation.dataset_path = str(dataset_dir)
    job_config.validation.local_batch_size = batch_size
    job_config.validation.seq_len = seq_len
    return job_config


def test_torchtitan_dataloader(small_assets):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import (
        DATASETS,
        build_text_dataloader,
        build_text_validation_dataloader,
    )

    dataset_dir, tokenizer_dir = small_assets
    register_stdlib_datasets()
    register_stdlib_datasets()  # idempotent
    assert DATASETS["stdlib"].path == stdlib_data.DEFAULT_DATASET_DIR
    assert DATASETS["stdlib_validation"].path == stdlib_data.DEFAULT_DATASET_DIR

    tok = HuggingFaceTokenizer(str(tokenizer_dir))
    bs, seq_len = 3, 64
    job_config = _job_config(dataset_dir, bs, seq_len)
    batches = []
    for rank in (0, 1):
        loader = build_text_dataloader(2, rank, tok, job_config)
        inputs, labels = next(iter(loader))
        x = inputs["input"]
        assert x.shape == labels.shape == (bs, seq_len)
        assert x.dtype == labels.dtype == torch.int64
        assert torch.equal(x[:, 1:], labels[:, :-1])  # labels are the inputs shifted by one
        assert x[0, 0] == tok.bos_id  # each rank starts on a document
        assert int(x.max()) < 2048
        batches.append(x)
    assert not torch.equal(batches[0], batches[1])  # the two dp ranks read different files

    # The validation entry reads validation.jsonl: its first document is the 20th stdlib file.
    x, _ = next(iter(build_text_validation_dataloader(1, 0, tok, job_config)))
    first_validation = json.loads((dataset_dir / "validation.jsonl").open().readline())["text"]
    expected = tok.encode(first_validation, add_bos=True, add_eos=True)[:seq_len]
    assert x["input"][0].tolist() == expected


def test_loader_errors(tmp_path):
    from torchtitan.hf_datasets.text_datasets import DATASETS

    register_stdlib_datasets(tmp_path)
    with pytest.raises(FileNotFoundError, match="train.jsonl"):
        DATASETS["stdlib"].loader(DATASETS["stdlib"].path)
    with pytest.raises(FileNotFoundError, match="train.jsonl"):
        train_stdlib_tokenizer(tmp_path, tmp_path / "tokenizer")
    register_stdlib_datasets()


def test_no_stdlib_found(tmp_path, monkeypatch):
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path / "nowhere")})
    with pytest.raises(FileNotFoundError, match="nowhere"):
        build_stdlib_dataset(tmp_path / "dataset")
    assert not (tmp_path / "dataset").exists()  # nothing half-built is left behind
    assert list(tmp_path.iterdir()) == []


def test_deterministic(small_assets, tmp_path):
    dataset, tokenizer = small_assets
    again = build_stdlib_dataset(tmp_path / "dataset", max_files=SMALL)
    tokenizer_again = train_stdlib_tokenizer(again, tmp_path / "tokenizer")
    assert _files(again) == _files(dataset)
    assert _files(tokenizer_again) == _files(tokenizer)


def test_idempotent(small_assets):
    dataset, tokenizer = small_assets
    paths = [p for d in small_assets for p in d.iterdir()]
    before = {p: p.stat().st_mtime_ns for p in paths}
    assert build_stdlib_dataset(dataset, max_files=SMALL) == dataset
    assert train_stdlib_tokenizer(dataset, tokenizer) == tokenizer
    assert {p: p.stat().st_mtime_ns for p in paths} == before
    assert sorted(p.name for p in dataset.parent.iterdir()) == ["dataset", "tokenizer"]
    # A cache built with other settings is an error, not a silent mismatch.
    with pytest.raises(ValueError, match="max_files"):
        build_stdlib_dataset(dataset, max_files=SMALL + 1)
    with pytest.raises(ValueError, match="vocab_size"):
        train_stdlib_tokenizer(dataset, tokenizer, vocab_size=1024)


def test_refuses_to_replace_foreign_directory(tmp_path):
    (tmp_path / "dataset").mkdir()
    (tmp_path / "dataset" / "mine.txt").write_text("not a build")
    with pytest.raises(FileExistsError, match="not a complete build"):
        build_stdlib_dataset(tmp_path / "dataset", max_files=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset"]  # temp dir cleaned up


def _ensure_in_child(root: str, barrier, results) -> None:
    """Runs ensure_stdlib_assets (full corpus) and reports how many dataset builds it ran."""
    builds = []
    sources = stdlib_data.stdlib_sources

    def counting_sources():
        builds.append(1)  # only called when this process actually writes a dataset
        return sources()

    stdlib_data.stdlib_sources = counting_sources
    barrier.wait(timeout=60)  # both start together, so that they do contend for the lock
    ensure_stdlib_assets(f"{root}/dataset", f"{root}/tokenizer")
    results.put(len(builds))


def test_concurrent_ensure(tmp_path):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_ensure_in_child, args=(str(tmp_path), barrier, results))
             for _ in range(2)]  # fmt: skip
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert sorted(results.get(timeout=5) for _ in procs) == [0, 1]  # one built, one waited
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset", "dataset.lock", "tokenizer"]
    assert HuggingFaceTokenizer(str(tmp_path / "tokenizer")).get_vocab_size() == 2048
    lines = (tmp_path / "dataset" / "train.jsonl").read_text().splitlines()
    assert len(lines) > 500  # the full stdlib

    before = {p: p.stat().st_mtime_ns for d in ("dataset", "tokenizer") for p in
              (tmp_path / d).iterdir()}  # fmt: skip
    ensure_stdlib_assets(tmp_path / "dataset", tmp_path / "tokenizer")  # no rebuild
    assert {p: p.stat().st_mtime_ns for p in before} == before
