"""The data of the convergence runs: a corpus, in the order a seed draws, and a held-out set.

torchtitan streams a jsonl dataset document by document and packs consecutive tokens into
sequences, so with whole source files as documents a micro-batch is four chunks of one file and
the samples of an update are far from independent (``docs/results.md`` section 4, which this
module's data reproduces). By default (``order="sequences"``) the training set is the corpus cut
into chunks that encode to exactly one sequence (``seq_len - 1`` tokens, plus torchtitan's BOS
and EOS), shuffled by the run's seed; ``order="documents"`` shuffles whole documents, the
document stream as a control; ``order="parts<R>x<B>"`` (:func:`replica_parts`) is the non-i.i.d.
stream of R data-parallel replicas that each read their own part of the corpus, for one rank that
runs every replica's micro-batches. The held-out set is the validation documents cut the same way and
shuffled with a fixed seed: every run of a corpus and ``seq_len`` scores the same sequences.

Corpora, nothing downloaded: ``stdlib``, the Python standard library's sources
(``scaffolding.stdlib_data``, every 20th file held out); ``torch``, the installed torch
package's ``.py`` files in sorted order, every 20th held out (the build records the torch
version). Both use the stdlib corpus's tokenizer. A build goes to
``outputs/convergence_data/<corpus>/<order>-seed<S>-len<L>/`` (``train.jsonl``,
``validation.jsonl``, its parameters in ``build.json``), written atomically. A chunk cut at a
token boundary nearly always re-encodes to the same count: 5 of 1284 stdlib validation chunks
at 63 tokens do not, which shifts the packing after them by a token or two.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import random
import re
import shutil
import tempfile
from collections.abc import Iterable, Sequence

REPO = pathlib.Path(__file__).resolve().parents[2]
CORPORA = ("stdlib", "torch")
ORDERS = ("sequences", "documents")  # and replica_parts(R, B)
_PARTS = re.compile(r"parts(?P<replicas>[1-9]\d*)x(?P<block>[1-9]\d*)")
OUT_DIR = "outputs/convergence_data"
HELDOUT_SEED = 0
_VALIDATION_EVERY = 20
_BUILD = "build.json"


def corpus_documents(corpus: str) -> tuple[list[str], list[str]]:
    """``(training documents, validation documents)`` of ``corpus``, in their source order."""
    if corpus == "stdlib":
        from scaffolding import stdlib_data

        source = stdlib_data.build_stdlib_dataset(REPO / stdlib_data.DEFAULT_DATASET_DIR)
        return tuple(  # type: ignore[return-value]
            [json.loads(line)["text"] for line in (source / name).read_text("utf-8").splitlines()]
            for name in ("train.jsonl", "validation.jsonl")
        )
    if corpus == "torch":
        import torch

        root = pathlib.Path(torch.__file__).parent
        files = sorted(root.rglob("*.py"))
        texts = [p.read_bytes().decode("utf-8", errors="replace") for p in files]
        held_out = {i for i in range(len(texts)) if i % _VALIDATION_EVERY == _VALIDATION_EVERY - 1}
        return ([t for i, t in enumerate(texts) if i not in held_out],
                [t for i, t in enumerate(texts) if i in held_out])  # fmt: skip
    raise ValueError(f"corpus {corpus!r} is not one of {CORPORA}")


def _tokenizer():
    from tokenizers import Tokenizer

    from scaffolding import stdlib_data

    tokenizer_dir = REPO / stdlib_data.DEFAULT_TOKENIZER_DIR
    stdlib_data.ensure_stdlib_assets(REPO / stdlib_data.DEFAULT_DATASET_DIR, tokenizer_dir)
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


def document_chunks(texts: Iterable[str], text_tokens: int) -> list[list[str]]:
    """Each text cut at token boundaries into pieces of ``text_tokens`` tokens (a text's last,
    shorter piece is dropped): with torchtitan's BOS and EOS, one piece is one sequence."""
    texts = list(texts)
    chunks = []
    # One batch call: the tokenizer loops in Rust rather than once per text in Python.
    for text, encoding in zip(texts, _tokenizer().encode_batch(texts, add_special_tokens=False)):
        offsets = encoding.offsets
        starts = [offsets[i][0] for i in range(0, len(offsets), text_tokens)]
        pieces = []
        for i in range(len(offsets) // text_tokens):
            end = starts[i + 1] if i + 1 < len(starts) else len(text)
            pieces.append(text[starts[i]:end])
        chunks.append(pieces)
    return chunks


@functools.lru_cache(maxsize=4)
def _split_chunks(corpus: str, split: str, text_tokens: int) -> tuple[tuple[str, ...], ...]:
    """Each document of a split of ``corpus`` cut by :func:`document_chunks`, once per process:
    a sweep (or a test) prepares several seeds of one length, which differ only in the order."""
    train, validation = corpus_documents(corpus)
    pieces = document_chunks(train if split == "train" else validation, text_tokens)
    return tuple(tuple(p) for p in pieces)


def replica_parts(replicas: int, block: int) -> str:
    """The order in which ``replicas`` data-parallel replicas each read their own part of the
    corpus (non-i.i.d. replicas), as one rank that runs all their micro-batches reads it.

    The training documents, in the corpus's source order (sorted paths: a part is a range of
    packages), are cut into ``replicas`` contiguous parts of nearly equal sequence counts; each
    part's sequences are shuffled by the seed. The stream then takes ``block`` sequences from
    each part in turn, so one rank's micro-batch of ``replicas * block`` sequences holds what the
    replicas' micro-batches of ``block`` would hold in one round: the engine's updates depend on
    which micro-batches fall in which round, not on how many ranks run them
    (``tests/engine/test_engine_reference.py``), and a micro-batch's mean loss over equal
    sequence counts is the replicas' mean. Give ``block`` = the local batch / ``replicas``.
    """
    return f"parts{replicas}x{block}"


def replica_stream(documents: Sequence[Sequence[str]], seed: int, replicas: int,
                   block: int) -> list[str]:  # fmt: skip
    """:func:`replica_parts`' stream of ``documents`` (each a list of sequences)."""
    total = sum(map(len, documents))
    parts: list[list[str]] = [[] for _ in range(replicas)]
    before = 0
    for pieces in documents:  # a document goes whole to the part its middle falls in
        parts[min(replicas - 1, (2 * before + len(pieces)) * replicas // (2 * total))].extend(pieces)
        before += len(pieces)
    rng = random.Random(seed)
    for part in parts:
        rng.shuffle(part)
    blocks = min(map(len, parts)) // block
    return [s for k in range(blocks) for part in parts for s in part[k * block:(k + 1) * block]]


def prepare(corpus: str, order: str, seed: int, seq_len: int) -> pathlib.Path:
    """The dataset directory of a run (built on first use); see the module docstring."""
    parts = _PARTS.fullmatch(order)
    if order not in ORDERS and not parts:
        raise ValueError(f"order {order!r} is not one of {ORDERS} or parts<R>x<B> "
                         "(replica_parts)")  # fmt: skip
    if seq_len < 2:
        raise ValueError(f"seq_len {seq_len} must be >= 2")
    import torch

    params = {"corpus": corpus, "order": order, "seed": seed, "seq_len": seq_len,
              "heldout_seed": HELDOUT_SEED,
              "torch": torch.__version__ if corpus == "torch" else None}  # fmt: skip
    out = REPO / OUT_DIR / corpus / f"{order}-seed{seed}-len{seq_len}"
    built = out / _BUILD
    if built.is_file() and json.loads(built.read_text()) == params:
        return out
    if parts:
        train = replica_stream(_split_chunks(corpus, "train", seq_len - 1), seed,
                                int(parts["replicas"]), int(parts["block"]))  # fmt: skip
    else:
        if order == "sequences":
            train = [s for pieces in _split_chunks(corpus, "train", seq_len - 1) for s in pieces]
        else:
            train = corpus_documents(corpus)[0]
        random.Random(seed).shuffle(train)
    validation = [s for pieces in _split_chunks(corpus, "validation", seq_len - 1) for s in pieces]
    random.Random(HELDOUT_SEED).shuffle(validation)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        for name, texts in (("train.jsonl", train), ("validation.jsonl", validation)):
            with open(tmp / name, "w", encoding="utf-8") as f:
                f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
        (tmp / _BUILD).write_text(json.dumps(params, sort_keys=True))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def describe(path: pathlib.Path) -> dict:
    """The build parameters and sizes of a prepared directory, for a results file."""
    info = json.loads((path / _BUILD).read_text())
    for name in ("train.jsonl", "validation.jsonl"):
        with open(path / name, encoding="utf-8") as f:
            info[name.split(".")[0] + "_documents"] = sum(1 for _ in f)
    return info

