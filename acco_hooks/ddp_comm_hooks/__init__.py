"""DDP communication hooks: ``acco_hook`` (the ACCO engine) and ``delayed_allreduce_hook``."""

from acco_hooks.ddp_comm_hooks.acco_hook import ACCOState, acco_hook
from acco_hooks.ddp_comm_hooks.delayed_allreduce_hook import (
    DelayedAllReduceState,
    delayed_allreduce_hook,
)

__all__ = ["ACCOState", "acco_hook", "DelayedAllReduceState", "delayed_allreduce_hook"]
