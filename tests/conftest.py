"""Fixtures every test directory may use."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.dist_utils import RankPool, shared_pool


@pytest.fixture(scope="session")
def rank_pool() -> Iterator[RankPool]:
    """The session's gloo processes (``tests.dist_utils.shared_pool``, up to 4 ranks), the
    ones ``run_distributed`` uses: for tests that run many small distributed examples."""
    pool = shared_pool()
    yield pool
    pool.close()
