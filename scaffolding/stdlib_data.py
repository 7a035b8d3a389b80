"""The embedded data of the main job, the examples, tests and benchmarks: the Python standard
library's own source code.

torchtitan ships no tokenizer and no offline dataset, and its ``c4`` dataset needs a download.
Every machine that runs Python has its standard library: real text that nobody here wrote, read
with no download. It comes in two forms:

* as bytes (:func:`stdlib_corpus`, :func:`random_windows`): byte-level tokens (vocabulary 256)
  for the plain-loop examples, which keep their model tiny;
* for torchtitan and the Hugging Face example, built once, deterministically for a Python
  version:

  * a LOCAL dataset, one line ``{"text": <file content>}`` per stdlib ``.py`` file, in
    ``train.jsonl`` and ``validation.jsonl`` (every 20th file), cached in
    ``outputs/stdlib/dataset``;
  * a byte-level BPE tokenizer of exactly 2048 tokens (llama3 ``debugmodel``'s ``vocab_size``)
    trained on ``train.jsonl``, cached in ``outputs/stdlib/tokenizer`` (pass it as
    ``--model.hf_assets_path``).

``ensure_stdlib_assets()`` builds what is missing (under a file lock: all torchrun ranks may call
it); ``register_stdlib_datasets()`` adds ``--training.dataset stdlib`` and ``stdlib_validation``.
To train on your own data keep ``--training.dataset stdlib`` and point ``--training.dataset_path``
at a directory holding ``train.jsonl`` (and ``validation.jsonl``) of ``{"text": ...}`` lines;
where downloads are possible, torchtitan's ``c4`` works as usual with a matching tokenizer.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "DATASET_NAME", "VALIDATION_DATASET_NAME", "DEFAULT_DATASET_DIR", "DEFAULT_TOKENIZER_DIR",
    "VOCAB_SIZE", "BOS_TOKEN", "EOS_TOKEN", "build_stdlib_dataset", "train_stdlib_tokenizer",
    "ensure_stdlib_assets", "register_stdlib_datasets", "prepare_if_stdlib", "random_windows",
    "stdlib_corpus", "stdlib_sources",
]  # fmt: skip

DATASET_NAME = "stdlib"
VALIDATION_DATASET_NAME = "stdlib_validation"
DEFAULT_DATASET_DIR = "outputs/stdlib/dataset"
DEFAULT_TOKENIZER_DIR = "outputs/stdlib/tokenizer"
VOCAB_SIZE = 2048
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"

_TRAIN, _VALIDATION = "train.jsonl", "validation.jsonl"
_MARKER = ".complete"  # written last: its presence means the directory is a finished build
_VALIDATION_EVERY = 20


def stdlib_sources() -> list[pathlib.Path]:
    """The standard library's ``.py`` files that make the embedded data, in sorted path order.

    The one rule for every front-end's embedded data: ``site-packages`` (differs between
    machines) and test directories (odd encodings, huge) are skipped, judged by the parts of
    the path below the stdlib root (so that a root like ``/home/test/...`` still works).
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test"}
    files = [p for p in sorted(root.rglob("*.py")) if not skip & set(p.relative_to(root).parts)]
    if not files:
        raise FileNotFoundError(f"no Python standard library sources (*.py) found under {root}")
    return files


def stdlib_corpus(max_bytes: int = 8 << 20) -> torch.Tensor:
    """The first ``max_bytes`` bytes of :func:`stdlib_sources`, end to end.

    Returns:
        A 1-D ``uint8`` tensor of byte tokens. The content depends only on the Python version.
    """
    chunks, size = [], 0
    for path in stdlib_sources():
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)


def random_windows(
    tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless ``(inputs, targets)`` micro-batches of random windows, reproducible from ``seed``.

    Give each data-parallel rank its own seed so that ranks see different data.
    """
    generator = torch.Generator().manual_seed(seed)
    high = tokens.numel() - seq_len - 1
    while True:
        starts = torch.randint(0, high, (batch_size,), generator=generator)
        window = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()]).long()
        yield window[:, :-1], window[:, 1:]


def _build_atomically(out_dir: str | os.PathLike, params: dict, write: Callable) -> pathlib.Path:
    """Runs ``write(tmp_dir)`` and renames ``tmp_dir`` to ``out_dir``, unless already built."""
    out = pathlib.Path(out_dir)
    marker = out / _MARKER
    if marker.is_file():
        built = json.loads(marker.read_text())
        if built != params:  # a cache built with other settings must not be used silently
            raise ValueError(f"{out} was built with {built}, not {params}; delete it to rebuild")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # The temporary directory sits next to out_dir so that the rename stays on one file system.
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
        write(tmp)
        (tmp / _MARKER).write_text(json.dumps(params, sort_keys=True))
        try:
            os.rename(tmp, out)  # atomic; replaces out_dir only if it is an empty directory
        except OSError as error:
            if not marker.is_file():  # not another process finishing first: a real conflict
                raise FileExistsError(f"{out} exists and is not a complete build") from error
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _build_atomically(out, params, write)  # checks the parameters of whoever won


def build_stdlib_dataset(out_dir: str | os.PathLike, max_files: int | None = None) -> pathlib.Path:
    """Writes the stdlib sources as ``train.jsonl`` and ``validation.jsonl`` under ``out_dir``.

    One line ``{"text": <file content>}`` per file, in sorted path order; every 20th file goes to
    validation. Deterministic, returns at once if ``out_dir`` is already a complete build, and
    atomic (built in a temporary directory that is then renamed).

    Args:
        out_dir: The directory to create (it may exist if empty).
        max_files: Use only the first ``max_files`` files (small builds for tests).

    Returns:
        ``out_dir`` as a path.

    Raises:
        FileNotFoundError: No stdlib sources found.
        ValueError: ``out_dir`` holds a build made with another ``max_files``.
        FileExistsError: ``out_dir`` is a non-empty directory that is not a build.
    """

    def write(tmp: pathlib.Path) -> None:
        files = stdlib_sources()[:max_files]
        with open(tmp / _TRAIN, "wb") as train, open(tmp / _VALIDATION, "wb") as validation:
            for index, path in enumerate(files):
                # stdlib sources are UTF-8 (PEP 3120); "replace" only guards against a stray byte.
                line = json.dumps({"text": path.read_bytes().decode("utf-8", errors="replace")})
                dest = validation if index % _VALIDATION_EVERY == _VALIDATION_EVERY - 1 else train
                dest.write(line.encode("utf-8") + b"\n")

    return _build_atomically(out_dir, {"max_files": max_files}, write)


def _texts(path: pathlib.Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as lines:
        yield from (json.loads(line)["text"] for line in lines)


def train_stdlib_tokenizer(
    dataset_dir: str | os.PathLike, out_dir: str | os.PathLike, vocab_size: int = VOCAB_SIZE
) -> pathlib.Path:
    """Trains a byte-level BPE tokenizer on ``dataset_dir/train.jsonl`` and saves it in ``out_dir``.

    Exactly ``vocab_size`` tokens, counting ``BOS_TOKEN`` (id 0) and ``EOS_TOKEN`` (id 1), which
    ``tokenizer_config.json`` names for torchtitan's ``HuggingFaceTokenizer``. The tokenizer adds
    neither itself, so ``encode(text, add_bos=True, add_eos=True)`` adds exactly one of each.
    Deterministic, idempotent and atomic like :func:`build_stdlib_dataset`.

    Args:
        dataset_dir: A directory holding ``train.jsonl`` of ``{"text": ...}`` lines.
        out_dir: The directory to create (it may exist if empty).
        vocab_size: The total vocabulary size.

    Returns:
        ``out_dir`` as a path.

    Raises:
        FileNotFoundError: ``dataset_dir/train.jsonl`` does not exist.
        ValueError: The corpus is too small for ``vocab_size``, or ``out_dir`` holds a build
            with another ``vocab_size``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    train_file = pathlib.Path(dataset_dir) / _TRAIN
    if not train_file.is_file():
        raise FileNotFoundError(f"no {_TRAIN} in {dataset_dir}; run build_stdlib_dataset first")

    def write(tmp: pathlib.Path) -> None:
        tokenizer = Tokenizer(models.BPE())
        # No prefix space and no normalizer: decode(encode(text)) == text for any text.
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[BOS_TOKEN, EOS_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: no unknowns
            show_progress=False,
        )
        tokenizer.train_from_iterator(_texts(train_file), trainer=trainer)
        if tokenizer.get_vocab_size() != vocab_size:
            raise ValueError(f"{train_file} is too small to learn {vocab_size} tokens")
        tokenizer.save(str(tmp / "tokenizer.json"))

        # torchtitan's HuggingFaceTokenizer finds BOS/EOS by the bos_token/eos_token strings (the
        # tokens are in tokenizer.json already); add_*_token set the defaults of encode(text).
        config = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "add_bos_token": True,
                  "add_eos_token": False, "tokenizer_class": "PreTrainedTokenizerFast"}  # fmt: skip
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    return _build_atomically(out_dir, {"vocab_size": vocab_size}, write)


def ensure_stdlib_assets(
    dataset_dir: str | os.PathLike = DEFAULT_DATASET_DIR,
    tokenizer_dir: str | os.PathLike = DEFAULT_TOKENIZER_DIR,
    vocab_size: int = VOCAB_SIZE,
) -> None:
    """Builds the stdlib dataset and tokenizer where missing; safe to call from many processes.

    A file lock (``<dataset_dir>.lock``) lets exactly one process build while the others wait;
    all return once both directories are complete.

    Args:
        dataset_dir: Where the dataset is (or goes).
        tokenizer_dir: Where the tokenizer is (or goes).
        vocab_size: The tokenizer's total vocabulary size.
    """
    dataset, tokenizer = pathlib.Path(dataset_dir), pathlib.Path(tokenizer_dir)
    if (dataset / _MARKER).is_file() and (tokenizer / _MARKER).is_file():
        build_stdlib_dataset(dataset)  # cheap: only checks the build parameters
        train_stdlib_tokenizer(dataset, tokenizer, vocab_size)
        return
    from filelock import FileLock

    dataset.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dataset.with_name(dataset.name + ".lock"))):
        building = not ((dataset / _MARKER).is_file() and (tokenizer / _MARKER).is_file())
        if building:  # once per checkout: a first run would otherwise sit silent for a minute
            start = time.perf_counter()
            print(f"stdlib_data: building the embedded corpus (the standard library's source) "
                  f"and its tokenizer in {dataset.parent}/, once for every later run",
                  file=sys.stderr, flush=True)  # fmt: skip
        build_stdlib_dataset(dataset)
        train_stdlib_tokenizer(dataset, tokenizer, vocab_size)
        if building:
            print(f"stdlib_data: built in {time.perf_counter() - start:.0f} s", file=sys.stderr,
                  flush=True)  # fmt: skip


def prepare_if_stdlib(
    dataset: str | None, dataset_path: str | None, tokenizer_dir: str | os.PathLike
) -> None:
    """If a job trains on ``stdlib`` (or validates on ``stdlib_validation``): build the corpus
    and its tokenizer where missing and register the datasets, before torchtitan looks for
    them (so that a first run finds its tokenizer like any later one). A ``dataset_path`` that
    holds a ``train.jsonl`` this module did not build is your own data, read as it is."""
    if dataset in (DATASET_NAME, VALIDATION_DATASET_NAME):
        dataset_dir = pathlib.Path(dataset_path or DEFAULT_DATASET_DIR)
        if (dataset_dir / _TRAIN).is_file() and not (dataset_dir / _MARKER).is_file():
            # Your own jsonl files, read as they are (no build to check): the tokenizer is
            # the embedded corpus's, trained where it is built by default.
            ensure_stdlib_assets(DEFAULT_DATASET_DIR, tokenizer_dir)
        else:
            ensure_stdlib_assets(dataset_dir, tokenizer_dir)
        register_stdlib_datasets(dataset_dir)


def _load_jsonl(path: str | os.PathLike, file_name: str) -> Any:
    """Loads ``path/file_name`` (or ``path`` itself if it is a file) as a local datasets.Dataset."""
    from datasets import load_dataset

    data_file = pathlib.Path(path)
    if data_file.is_dir():
        data_file = data_file / file_name
    if not data_file.is_file():
        raise FileNotFoundError(f"no {file_name} in {path} (expected lines of {{\"text\": ...}})")
    # A local file with the packaged "json" builder: no network. datasets caches an Arrow copy
    # under HF_DATASETS_CACHE (default ~/.cache/huggingface/datasets).
    return load_dataset("json", data_files=str(data_file), split="train")


def _sample_text(sample: dict[str, Any]) -> str:
    return sample["text"]  # a named function, not a lambda: dataloader workers may pickle it


def register_stdlib_datasets(dataset_dir: str | os.PathLike = DEFAULT_DATASET_DIR) -> None:
    """Adds ``stdlib`` and ``stdlib_validation`` to torchtitan's dataset registry (idempotent).

    ``--training.dataset_path`` (or ``--validation.dataset_path``) replaces ``dataset_dir``: any
    directory holding ``train.jsonl`` / ``validation.jsonl`` of ``{"text": ...}`` lines works.

    Args:
        dataset_dir: The default directory of the two jsonl files.
    """
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    for name, file_name in ((DATASET_NAME, _TRAIN), (VALIDATION_DATASET_NAME, _VALIDATION)):
        DATASETS[name] = DatasetConfig(
            path=os.fspath(dataset_dir),
            loader=functools.partial(_load_jsonl, file_name=file_name),
            sample_processor=_sample_text,
        )
