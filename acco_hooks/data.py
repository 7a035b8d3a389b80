"""Embedded default training data: the Python standard library's own source, as bytes.

Every machine that runs Python has it, it is real text that nobody here wrote, and reading it
needs no download. Byte-level tokens (vocabulary 256) keep the default model tiny.
"""

from __future__ import annotations

import pathlib
import sysconfig
from collections.abc import Iterator

import torch

__all__ = ["random_windows", "stdlib_corpus", "stdlib_sources"]


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
