"""The ACCO engine: one class (``engine.ACCOEngine``), the settings every front-end takes from
(``settings``), and what it stands on: the rounds' bookkeeping (``rounds``), the buffers
(``buffers``) and where each group's parameters lie in them (``layout``), the communication
thread with its process groups and its per-round job (``communication``), the collectives
(``collectives``), the estimate step (``peek``), the optimizers the shards can step
(``shard_optimizer``), parameter ownership and what ``.grad`` holds meanwhile (``ownership``),
a rank's saved state and its checks (``state``), the shards as checkpoint DTensors
(``placement``) and the sum over torchft replica groups (``replicas``).

Read ``engine.py`` first: its docstring draws the round timeline and follows one gradient.
"""

from acco_hooks.engine.communication import ACCOCommunicationError
from acco_hooks.engine.engine import ACCOEngine
from acco_hooks.engine.ownership import GradientInEngine
from acco_hooks.engine.settings import (
    MODES,
    NONFINITE_POLICIES,
    REDUCE_DTYPES,
    ACCOSettings,
    EngineSettings,
    Mode,
    SettingError,
    real_updates,
)

__all__ = ["ACCOCommunicationError", "ACCOEngine", "ACCOSettings", "EngineSettings",
           "GradientInEngine", "MODES", "Mode", "NONFINITE_POLICIES", "REDUCE_DTYPES",
           "SettingError", "real_updates"]  # fmt: skip
