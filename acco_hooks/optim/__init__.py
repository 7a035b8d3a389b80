"""The engine as a ``torch.optim``-style optimizer for a plain training loop: over a
replicated model (:class:`ACCOOptimizer`), or across the replicas of an FSDP2 model on a 2-D
(HSDP) mesh (:class:`ACCOHSDPOptimizer`)."""

from acco_hooks.optim.acco_optimizer import ACCOOptimizer
from acco_hooks.optim.hsdp_optimizer import ACCOHSDPOptimizer

__all__ = ["ACCOHSDPOptimizer", "ACCOOptimizer"]
