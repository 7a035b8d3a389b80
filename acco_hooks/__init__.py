"""acco_hooks: ACCO (Accumulate While You Communicate) for PyTorch data-parallel training.

While one round's gradients are reduce-scattered, a sharded (ZeRO-1) optimizer steps its 1/N
shard and the new parameters are all-gathered, every worker keeps accumulating the next
micro-batches; an estimate of the next weights removes the damage of the one-step delay
(Nabli et al., arXiv 2406.02613).
"""

from acco_hooks._versions import (
    SUPPORTED_VERSIONS,
    UnsupportedVersionError,
    UntestedVersionWarning,
    check_python_and_torch,
    check_supported_versions,
)

check_python_and_torch()  # before anything could form a process group

from acco_hooks._frontend import label_tokens  # noqa: E402
from acco_hooks.ddp_comm_hooks import (  # noqa: E402
    ACCOState,
    DelayedAllReduceState,
    acco_hook,
    delayed_allreduce_hook,
)
from acco_hooks.engine import (  # noqa: E402
    MODES,
    ACCOCommunicationError,
    ACCOEngine,
    ACCOSettings,
    EngineSettings,
    SettingError,
)
from acco_hooks.engine.shard_optimizer import (  # noqa: E402
    declare_per_element_optimizer,
    declare_per_parameter_optimizer,
)
from acco_hooks.optim import ACCOHSDPOptimizer, ACCOOptimizer  # noqa: E402

__all__ = [
    "ACCOCommunicationError",
    "ACCOEngine",
    "ACCOHSDPOptimizer",
    "ACCOOptimizer",
    "ACCOSettings",
    "ACCOState",
    "DelayedAllReduceState",
    "EngineSettings",
    "MODES",
    "SUPPORTED_VERSIONS",
    "SettingError",
    "UnsupportedVersionError",
    "UntestedVersionWarning",
    "acco_hook",
    "check_supported_versions",
    "declare_per_element_optimizer",
    "declare_per_parameter_optimizer",
    "delayed_allreduce_hook",
    "label_tokens",
]
__version__ = "0.1.0"
