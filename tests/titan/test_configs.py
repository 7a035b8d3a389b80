"""Every shipped torchtitan config parses with the [acco] section and passes validation at the
world size its parallelism asks for (no training: this is what fails first on a cluster)."""

from __future__ import annotations

import math
import pathlib

import pytest

from acco_hooks.titan import TITAN_030

pytestmark = pytest.mark.titan
ROOT = pathlib.Path(__file__).parents[2]
CONFIGS = sorted((ROOT / "torchtitan_configs").glob("*.toml"))


def _load(path: pathlib.Path, *overrides: str):
    """The installed torchtitan's config of ``path`` with command-line ``overrides``, its
    ``[acco]`` section (None when disabled) and the validation of the installed release."""
    if TITAN_030:  # translated from the TOML, every key of it
        from acco_hooks.titan.toml_compat import load_toml_config
        from acco_hooks.titan.v030 import validate_acco_config

        config = load_toml_config(path, overrides)
        acco = getattr(config, "acco", None)
    else:
        from torchtitan.config import ConfigManager

        from acco_hooks.titan.v022 import JobConfig, validate_acco_config

        config = ConfigManager(JobConfig).parse_args(["--job.config_file", str(path), *overrides])
        acco = config.acco if config.acco.enable else None
    return config, acco, validate_acco_config


def _world(config) -> int:
    par = config.parallelism
    return math.prod((par.data_parallel_replicate_degree, par.data_parallel_shard_degree,
                      par.tensor_parallel_degree, par.pipeline_parallel_degree))  # fmt: skip


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_is_valid(path: pathlib.Path) -> None:
    config, acco, validate_acco_config = _load(path)
    par = config.parallelism
    assert par.data_parallel_shard_degree >= 1, "give the shard degree explicitly"
    world = _world(config)
    validate_acco_config(config, world_size=world)
    batch = config.training.local_batch_size * par.data_parallel_replicate_degree * par.data_parallel_shard_degree
    if config.training.global_batch_size > 0:
        assert config.training.global_batch_size % batch == 0, "global batch: a whole number of micro-batches"
    else:  # -1: one micro-batch per rank and torchtitan step; the engine's round size is explicit
        assert acco is not None and acco.accumulation_steps >= 1
    if "8b" in path.name:  # the batch scales with the nodes: valid at 2 to 64 replicas
        assert config.training.global_batch_size == -1
        per_replica = world // par.data_parallel_replicate_degree
        for replicas in (2, 8, 64):
            par.data_parallel_replicate_degree = replicas
            validate_acco_config(config, world_size=per_replica * replicas)
    if "hsdp" in path.name:
        assert acco is not None and acco.enable and par.data_parallel_shard_degree > 1
        assert par.data_parallel_replicate_degree > 1


ACCO_CONFIGS = [p for p in CONFIGS if _load(p)[1] is not None]


@pytest.mark.parametrize("path", ACCO_CONFIGS, ids=[p.name for p in ACCO_CONFIGS])
def test_every_shipped_acco_config_runs_auto_or_names_the_flag(path: pathlib.Path) -> None:
    """``--acco.mode auto`` on a shipped config is accepted, or refused before anything is built
    with the exact flag that makes it acceptable."""
    import re

    config, _, validate_acco_config = _load(path, "--acco.mode", "auto")
    try:
        validate_acco_config(config, world_size=_world(config))
        return
    except ValueError as error:
        message = str(error)
    flag = re.search(r"\((--[\w.]+) (\d+)", message)
    assert flag and "mode = 'auto'" in message, message
    config, _, validate_acco_config = _load(path, "--acco.mode", "auto", *flag.groups())
    validate_acco_config(config, world_size=_world(config))


DEBUG_ACCO = ROOT / "torchtitan_configs" / "debug_cpu_acco.toml"


@pytest.mark.parametrize("overrides, expected", [
    ((), 100.0),  # torchtitan's default train_timeout_seconds
    (("--comm.train_timeout_seconds", "30"), 30.0),
    (("--comm.train_timeout_seconds", "30", "--acco.timeout", "7"), 7.0),  # [acco]'s own wins
])  # fmt: skip
def test_the_engine_times_out_with_torchtitan_unless_acco_sets_its_own(overrides, expected) -> None:
    """The engine's collectives fail after torchtitan's [comm] train_timeout_seconds, not the
    process group's 30-minute default: a survivor of a lost node must fail within it for the
    elastic agent to restart it."""
    config, _, validate_acco_config = _load(DEBUG_ACCO, *overrides)
    assert validate_acco_config(config, world_size=2).timeout == expected
