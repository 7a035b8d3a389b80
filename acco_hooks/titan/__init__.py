"""torchtitan integration: the ACCO trainer, its ``[acco]`` config section and helpers.

Two torchtitan releases are supported, and the installed one decides the adapter at import:

- 0.2.2 (TOML job configs, ``JobConfig``, train specs): ``config``, ``components``,
  ``train_spec`` and ``trainer``;
- 0.3.0 (Python config functions, ``Trainer.Config``, model specs): ``v030``, with
  ``config_registry`` for ``-m torchtitan.train --module acco_hooks.titan --config <name>``
  and ``toml_compat``, which translates the TOMLs for ``train_titan.py``.

What does not touch torchtitan's API is shared: the ``[acco]`` settings and their validation
(``settings``), the trainer's round loop (``_round_loop``), the optimizer container's engine
plumbing (``_container``), the embedded corpus (``stdlib_data``) and the CPU shim.
Importing this package checks the installed torchtitan (and torch) against the tested pairs,
before torchtitan is asked to build anything; it imports nothing heavy.
"""

import torch
import torchtitan

from acco_hooks import check_supported_versions

TITAN_VERSION: str = getattr(torchtitan, "__version__", "0.0.0")
check_supported_versions(torch=torch.__version__, torchtitan=TITAN_VERSION)

TITAN_030: bool = TITAN_VERSION.startswith("0.3.")
"""True when the installed torchtitan is 0.3.0 (the ``v030`` adapter), False for 0.2.2."""
