"""Fixtures every test directory may use."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.dist_utils import RankPool


@pytest.fixture(scope="session")
def rank_pool() -> Iterator[RankPool]:
    """Up to 4 gloo processes kept for the whole session (``RankPool``): for tests that run
    many small distributed examples."""
    pool = RankPool(4)
    yield pool
    pool.close()
