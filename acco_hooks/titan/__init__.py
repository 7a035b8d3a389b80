"""torchtitan integration: the ACCO trainer, its ``[acco]`` config section and its configs.

Two torchtitan releases are supported, and the installed one decides the adapter at import:

- 0.2.2 (TOML job configs, ``JobConfig``, train specs): ``v022``;
- 0.3.0 (Python config functions, ``Trainer.Config``, model specs): ``v030``, with
  ``config_registry`` for ``-m torchtitan.train --module acco_hooks.titan --config <name>``
  and ``toml_compat``, which translates the TOMLs for ``train_titan.py``.

What is the same in both releases is written once: the ``[acco]`` section and its checks
(``config``), the optimizer container that holds the engine and the trainer whose step is one
round (``base``). The job configs the project ships are package data (``configs/*.toml``).
Importing this package checks the installed torchtitan (and torch) against the tested pairs,
before torchtitan is asked to build anything; it imports nothing heavy and changes nothing in
torchtitan.
"""

import sys

import torch

try:
    import torchtitan
except ImportError as exc:  # a lean install: pip install acco_hooks
    raise ImportError(
        "acco_hooks.titan needs torchtitan: pip install 'acco_hooks[titan]' (or "
        "scripts/setup.sh in a checkout)"
    ) from exc

from acco_hooks import check_supported_versions

TITAN_VERSION: str = getattr(torchtitan, "__version__", "0.0.0")
check_supported_versions(torch=torch.__version__, torchtitan=TITAN_VERSION)

TITAN_030: bool = TITAN_VERSION.startswith("0.3.")
"""True when the installed torchtitan is 0.3.0 (the ``v030`` adapter), False for 0.2.2."""


def require_release(release: str, module: str) -> None:
    """Refuse to import ``module``, an adapter for torchtitan ``release``, under the other one.

    Raises:
        ImportError: naming the installed release and what to use instead.
    """
    if TITAN_VERSION.startswith(release[:4]):
        return
    use = ("acco_hooks.titan.v030 (ACCOTrainer), acco_hooks.titan.config_registry" if TITAN_030
           else "acco_hooks.titan.v022 (ACCOTrainer, JobConfig)")  # fmt: skip
    raise ImportError(
        f"{module} is the torchtitan {release} adapter, but torchtitan {TITAN_VERSION} is "
        f"installed: use {use}, or train_titan.py (any release)"
    )


def flag(key: str) -> str:
    """The command-line flag that sets torchtitan option ``key`` (its TOML name,
    ``section.option``, as the shipped configs and 0.2.2 spell it) in this process's command.

    With a TOML config (``--job.config_file``, either release) it is ``--section.option``. Under
    torchtitan 0.3.0's own ``--module M --config NAME`` it is 0.3.0's field, in tyro's spelling:
    ``job.dump_folder`` -> ``--dump-folder``, ``training.dataset_path`` ->
    ``--dataloader.dataset-path``, ``checkpoint.load_step`` -> ``--checkpoint.load-step``. What
    a refusal tells the user to pass is spelled so, and works where they type it.
    """
    if not (TITAN_030 and any(a == "--module" or a.startswith("--module=") for a in sys.argv)):
        return f"--{key}"
    from acco_hooks.titan.toml_compat import KEYS

    known = KEYS.get(key)
    target = known.target if known is not None and known.target is not None else key
    return "--" + target.replace("_", "-")
