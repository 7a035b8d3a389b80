"""torchft's lighthouse, started without importing torch.

``torchft_lighthouse`` (torchft's console script) imports the ``torchft`` package for the
lighthouse's Rust entry point, and with it torch: 2-3 s of CPU for a server that uses none of
it, paid by every torchft job the tests start (``scaffolding.torchft_job``). This runs the same
entry point, ``torchft._torchft.lighthouse_main``, from torchft's extension module loaded on its
own, with the same command-line flags, run by its path (the entry point parses the process's
own argv past the interpreter's name, as it does under the console script's shebang: the
script's path is its program name; ``-m`` would be a flag to it)::

    python scaffolding/lighthouse.py --min_replicas 1 --quorum_tick_ms 100 --bind [::]:0
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def lighthouse_main() -> int:
    """Load ``torchft._torchft`` from the installed torchft's folder, without running the
    package's ``__init__``, and run its lighthouse."""
    package = importlib.util.find_spec("torchft")  # finds the folder, imports nothing
    if package is None or not package.submodule_search_locations:
        raise SystemExit("scaffolding.lighthouse: torchft is not installed: "
                         "pip install 'acco_hooks[ft]'")  # fmt: skip
    folder = package.submodule_search_locations[0]
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(folder, "_torchft" + suffix)
        if os.path.exists(path):
            spec = importlib.util.spec_from_file_location("torchft._torchft", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module.lighthouse_main()
    raise SystemExit(f"scaffolding.lighthouse: no torchft._torchft extension in {folder}")


if __name__ == "__main__":
    sys.exit(lighthouse_main())
