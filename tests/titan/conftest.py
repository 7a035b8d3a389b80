"""On torchtitan 0.3.0 every test in this directory runs once per ``parallelism.spmd_backend``
ACCO supports: ``spmd_types`` (torchtitan's default) and ``partial_dtensor``.

The backend reaches the runs through ``--parallelism.spmd_backend``, which the test helpers
(``backend_overrides``) add to every command line they build; the config translation tests
take it from the same fixture. torchtitan 0.2.2 has no backends: its tests run once.
"""

from __future__ import annotations

import pytest

from acco_hooks.titan import TITAN_030

SPMD_BACKENDS: tuple[str | None, ...] = ("spmd_types", "partial_dtensor") if TITAN_030 else (None,)

_current: list[str | None] = [None]


@pytest.fixture(autouse=True, scope="module", params=SPMD_BACKENDS,
                ids=lambda b: b or "titan022")  # fmt: skip
def spmd_backend(request) -> str | None:
    """The backend this module's runs use (None on torchtitan 0.2.2)."""
    _current[0] = request.param
    yield request.param
    _current[0] = None


def backend_overrides(spelling: str = "_") -> tuple[str, ...]:
    """The command-line override that selects the current backend (none on 0.2.2).

    Args:
        spelling: ``"_"`` for the TOML path's ``--section.key``, ``"-"`` for 0.3.0's own
            ``--module/--config`` parser (tyro).
    """
    backend = _current[0]
    if backend is None:
        return ()
    return (f"--parallelism.spmd{spelling}backend", backend)
