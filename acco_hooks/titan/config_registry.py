"""Config functions for torchtitan 0.3.0: ``-m torchtitan.train --module acco_hooks.titan
--config <name>``, one per job config the project ships (``acco_hooks/titan/configs/<name>.toml``,
package data, so they work from an installed wheel).

Each function translates its TOML with :mod:`acco_hooks.titan.toml_compat`, so the TOML stays
the one source of truth and both torchtitan releases train the same job. ACCO configs return
an ``ACCOTrainer.Config`` (``--acco.mode dpu`` etc. on the command line), the baselines a plain
``Trainer.Config``. Other overrides take 0.3.0's spelling (``--training.steps 4``,
``--dataloader.dataset stdlib``); the optimizer's hyperparameters live in its parameter group
and are set in the TOML. :data:`CONFIG_NAMES` lists them; each TOML's ``[job] description``
says what it trains.

The ``debug_cpu_*`` configs train on the embedded ``stdlib`` corpus on a machine without an
accelerator, which this library does not ship: a checkout's launcher prepares both (``python -m
torch.distributed.run ... train_titan.py --module acco_hooks.titan --config debug_cpu_acco``).
Importing this module changes nothing in torchtitan.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Callable
from typing import Any

from acco_hooks.titan import require_release

require_release("0.3.0", __name__)  # torchtitan 0.2.2: train_titan.py --job.config_file X.toml

from acco_hooks.titan.toml_compat import load_toml_config, read_toml  # noqa: E402

__all__ = ["CONFIG_DIR", "CONFIG_NAMES", "config_path"]

CONFIG_DIR = importlib.resources.files("acco_hooks.titan") / "configs"
"""The job configs the project ships (package data)."""

CONFIG_NAMES: tuple[str, ...] = tuple(
    sorted(p.name.removesuffix(".toml") for p in CONFIG_DIR.iterdir() if p.name.endswith(".toml"))
)


def config_path(name: str) -> Any:
    """The shipped TOML of config ``name`` (a ``Traversable``; ``str()`` of it is a path)."""
    return CONFIG_DIR / f"{name}.toml"


def _from_toml(name: str) -> Any:
    settings = read_toml(config_path(name))
    if settings.get("training.dataset") == "stdlib":
        from torchtitan.hf_datasets.text_datasets import DATASETS

        if "stdlib" not in DATASETS:
            raise ValueError(
                f"--config {name} trains on the embedded stdlib corpus, which nothing has "
                "registered with torchtitan in this process. From a checkout, launch it with "
                f"train_titan.py (python -m torch.distributed.run ... train_titan.py --module "
                f"acco_hooks.titan --config {name}), which builds and registers it, or override "
                "--dataloader.dataset and --hf-assets-path with your own data"
            )
    return load_toml_config(config_path(name))


def __getattr__(name: str) -> Callable[[], Any]:
    """``acco_hooks.titan.config_registry.<name>``: the config function of a shipped TOML."""
    if name not in CONFIG_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def config() -> Any:
        return _from_toml(name)

    config.__name__ = config.__qualname__ = name
    config.__doc__ = read_toml(config_path(name)).get("job.description")
    return config


def __dir__() -> list[str]:
    return sorted([*globals(), *CONFIG_NAMES])
