"""Embedded default training data: the Python standard library's own source, as bytes.

Every machine that runs Python has it, it is real text that nobody here wrote, and reading it
needs no download. Byte-level tokens (vocabulary 256) keep the default model tiny.
"""

from __future__ import annotations

import pathlib
import sysconfig
from collections.abc import Iterator

import torch

__all__ = ["stdlib_corpus", "random_windows"]


def stdlib_corpus(max_bytes: int = 8 << 20) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the stdlib's ``.py`` files, in sorted path order.

    Returns:
        A 1-D ``uint8`` tensor of byte tokens. The content depends only on the Python version.
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue  # installed packages differ between machines; tests hold odd encodings
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"no Python source files found under {root}")
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
