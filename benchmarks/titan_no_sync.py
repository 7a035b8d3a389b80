"""DDP with ``no_sync`` accumulation in torchtitan 0.2.2: the baseline users build by hand.

With ``--experimental.custom_import benchmarks.titan_no_sync``, torchtitan's DDP trainer
(which all-reduces every micro-batch) syncs only a step's last micro-batch: before each one, it
sets ``set_requires_gradient_sync`` (composable DDP's ``no_sync``) on every model part.
Everything else stays torchtitan's. Assumes no pipeline parallelism (``forward_backward_step``
runs ``gradient_accumulation_steps`` times per step). docs/results.md names it.
"""

from __future__ import annotations

import functools
from typing import Any

from torchtitan.tools.logging import logger

from acco_hooks.titan import TITAN_030

if TITAN_030:
    raise ImportError(
        "benchmarks.titan_no_sync patches torchtitan 0.2.2's DDP path; torchtitan 0.3.0 has no "
        "DDP (its data parallelism is FSDP2): run this benchmark with torchtitan 0.2.2"
    )

from torchtitan.train import Trainer

_PATCHED = "_acco_bench_no_sync_patched"


def install() -> None:
    """Patch ``Trainer.forward_backward_step`` once per process."""
    original = Trainer.forward_backward_step
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def forward_backward_step(self: Trainer, **kwargs: Any) -> Any:
        step, index = getattr(self, "_acco_bench_microbatch", (None, 0))
        index = index + 1 if step == self.step else 1
        self._acco_bench_microbatch = (self.step, index)
        sync = index == self.gradient_accumulation_steps  # the update's last micro-batch
        if self.step == 1 and index == 1:
            logger.info(f"no_sync accumulation: DDP syncs gradients on micro-batch "
                        f"{self.gradient_accumulation_steps} of each step only")  # fmt: skip
        for part in self.model_parts:
            part.set_requires_gradient_sync(sync)
        return original(self, **kwargs)

    setattr(forward_backward_step, _PATCHED, True)
    Trainer.forward_backward_step = forward_backward_step


install()
