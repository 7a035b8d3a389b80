"""torchtitan's fault-tolerant trainer (torchft: DiLoCo) on CPU, for the DiLoCo arms of
``benchmarks/diloco.py``: one replica group per launch.

    torchrun --nproc_per_node 1 -m benchmarks.convergence.ft_train \\
        --job.config_file benchmarks/convergence/debug_cpu_diloco.toml \\
        --fault_tolerance.replica_id 0

It is torchtitan's own entry (``torchtitan.train.main(FTTrainer)``, as
``torchtitan/experiments/ft/train.py`` runs it) with what the checkout adds for a CPU run and
nothing else: the CPU scaffolding (``scaffolding.cpu_shim``), the embedded corpus registered as
``train_titan.py`` registers it, and the process's end through ``scaffolding.process_exit``.
Two settings torchtitan 0.2.2 does not expose, read from the environment:

* ``ACCO_BENCH_OUTER_LR``: DiLoCo's outer learning rate. torchtitan builds the outer optimizer
  as SGD, lr 0.7, momentum 0.9, Nesterov (``components/ft/manager.py``); this sets the lr of
  that optimizer once it is built, and keeps the rest.
* ``ACCO_BENCH_FT_HOSTNAME``: the address this group gives its peers, where torchft gives
  ``socket.gethostname()`` (the manager's address at the lighthouse, the HTTP server a joining
  group fetches the weights from): on the netbed the host's name resolves outside the network
  namespace the group runs in. Set, ``socket.gethostname`` returns it in this process.
"""

from __future__ import annotations

import functools
import os
import socket

import torch

OUTER_LR_ENV = "ACCO_BENCH_OUTER_LR"
HOSTNAME_ENV = "ACCO_BENCH_FT_HOSTNAME"


def _with_outer_lr(build, outer_lr: float):
    """``maybe_semi_sync_training`` whose DiLoCo outer optimizers step at ``outer_lr``."""

    @functools.wraps(build)
    def build_with_outer_lr(*args, **kwargs):
        from torchtitan.tools.logging import logger

        semi_sync = build(*args, **kwargs)
        fragments = getattr(semi_sync, "_fragments", None)
        if not fragments:  # not DiLoCo, or a torchft whose DiLoCo keeps them elsewhere
            raise RuntimeError(f"{OUTER_LR_ENV} is set, but {type(semi_sync).__name__} has no "
                               "DiLoCo fragments to set the outer learning rate of")
        for fragment in fragments:
            for group in fragment._outer_optimizer.param_groups:
                group["lr"] = outer_lr
        logger.info(f"ft_train: DiLoCo's outer lr {outer_lr:g} (torchtitan builds it at 0.7)")
        return semi_sync

    return build_with_outer_lr


def check_stack() -> None:
    """Refuse, with the fix, a stack this entry does not run on: no torchft, or torchtitan 0.3.0."""
    import importlib.util

    from acco_hooks.titan import TITAN_030

    if importlib.util.find_spec("torchft") is None:
        raise SystemExit("the DiLoCo arms need torchft: pip install -e '.[diloco]' (the "
                         "project's diloco extra; bash scripts/setup.sh installs it)")
    if TITAN_030:
        raise SystemExit("the DiLoCo arms run torchtitan 0.2.2's fault-tolerant trainer "
                         "(torchtitan.experiments.ft), which 0.3.0 moved and changed: run them "
                         "in the default stack (bash scripts/setup.sh, without ACCO_TITAN)")


def _install() -> None:
    if hostname := os.environ.get(HOSTNAME_ENV):
        # before torchft is imported (torchtitan imports it): Manager takes its default
        # hostname at import
        socket.gethostname = lambda: hostname
    check_stack()
    if not torch.cuda.is_available():
        import scaffolding.cpu_shim  # noqa: F401  (before torchtitan reads its device)
    import torchtitan.experiments.ft.train as ft_train
    import torchtitan.train as titan_train

    from scaffolding import stdlib_data

    class _ConfigManager(titan_train.ConfigManager):
        def _validate_config(self) -> None:  # as train_titan.py: the corpus before its checks
            config = self.config
            stdlib_data.prepare_if_stdlib(config.training.dataset, config.training.dataset_path,
                                          config.model.hf_assets_path)  # fmt: skip
            super()._validate_config()

    titan_train.ConfigManager = _ConfigManager
    if outer_lr := os.environ.get(OUTER_LR_ENV):
        ft_train.maybe_semi_sync_training = _with_outer_lr(ft_train.maybe_semi_sync_training,
                                                           float(outer_lr))  # fmt: skip


def main() -> None:
    _install()
    from torchtitan.experiments.ft.train import FTTrainer
    from torchtitan.train import main as titan_main

    from scaffolding.process_exit import finish

    titan_main(FTTrainer)
    finish()


if __name__ == "__main__":
    main()
