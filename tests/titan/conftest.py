"""On torchtitan 0.3.0 the tests in this directory run per ``parallelism.spmd_backend`` ACCO
supports: ``spmd_types`` (torchtitan's default) and ``partial_dtensor``.

The backend reaches the runs through ``--parallelism.spmd_backend``, which the test helpers
(``backend_overrides``) add to every command line they build; the config translation tests
take it from the same fixture. torchtitan 0.2.2 has no backends: its tests run once.

Where the backends differ is how FSDP is applied across replicas (``acco_hooks.titan.v030``):
ACCO over HSDP against ACCO over pure data parallelism, and resumed, runs on both. A test whose
subject does not depend on the backend (an entry point, a schedule, the validator, activation
checkpointing and compile, TP and PP composed with FSDP, ...) says which backend it runs on
with ``@pytest.mark.spmd_backends(...)``; the others are deselected, not skipped. A marker on
one ``pytest.param`` case takes precedence over the test's, and ``spmd_backends()`` with no
backend runs a case on 0.2.2 only: its subject is what both releases share (the engine, the
trainer's step loop in ``acco_hooks/titan/base.py``), not the release.
Each torchtitan launch costs CI seconds on 2 cores, more through torchrun (``scaffolding/forked_ranks.py``;
CI is kept under 60 minutes).
"""

from __future__ import annotations

import pathlib

import pytest

from acco_hooks.titan import TITAN_030
from scaffolding import forked_ranks

ROOT = pathlib.Path(__file__).parents[2]

SPMD_BACKENDS: tuple[str | None, ...] = ("spmd_types", "partial_dtensor") if TITAN_030 else (None,)

_current: list[str | None] = [None]

# The model every torchtitan job of the tests trains on 0.2.2 (tests/titan/small_model.py);
# on 0.3.0 the debug model. A job with a hook of its own (its one custom_import, which imports
# small_model) names the flavor alone
SMALL_FLAVOR: tuple[str, ...] = () if TITAN_030 else ("--model.flavor", "debugmodel_w128")
SMALL_MODEL: tuple[str, ...] = () if TITAN_030 else (
    *SMALL_FLAVOR, "--experimental.custom_import", "tests.titan.small_model")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the backends a test's ``spmd_backends`` marker leaves out."""
    if not TITAN_030:
        return
    kept, deselected = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        marker = next((m for m in getattr(callspec, "marks", ()) if m.name == "spmd_backends"),
                      item.get_closest_marker("spmd_backends"))  # fmt: skip
        backend = callspec.params.get("spmd_backend") if callspec else None
        if marker is None or backend is None:
            kept.append(item)
            continue
        unknown = set(marker.args) - set(SPMD_BACKENDS)
        if unknown:
            raise pytest.UsageError(f"{item.nodeid}: spmd_backends names {sorted(unknown)}; "
                                    f"ACCO's backends are {SPMD_BACKENDS}")  # fmt: skip
        (kept if backend in marker.args else deselected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


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


@pytest.fixture(scope="session")
def seed_checkpoint(tmp_path_factory) -> pathlib.Path:
    """Initial weights made once by one process, so every layout (and every test module)
    starts from the same model."""
    dump = tmp_path_factory.mktemp("seed")
    argv = [str(ROOT / "train_titan.py"), "--job.config_file",
            str(ROOT / "torchtitan_configs" / "debug_cpu_acco.toml"), "--job.dump_folder",
            str(dump), "--acco.no-enable", "--parallelism.data_parallel_replicate_degree", "1",
            "--parallelism.data_parallel_shard_degree", "1", "--checkpoint.enable",
            "--checkpoint.create_seed_checkpoint", *SMALL_MODEL]  # fmt: skip
    log = dump / "seed.log"
    status = forked_ranks.run(1, argv, log, preload=forked_ranks.train_titan_preload())
    assert status == 0, log.read_text()[-4000:]
    return dump / "checkpoint" / "step-0"
