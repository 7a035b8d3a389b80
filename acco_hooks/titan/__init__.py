"""torchtitan integration: the ACCO trainer, its ``[acco]`` config section and helpers.

Importing it checks the installed torchtitan against the tested release, before torchtitan is
asked to build anything.
"""

import torchtitan

from acco_hooks import check_supported_versions

check_supported_versions(torchtitan=getattr(torchtitan, "__version__", None))
