"""torchtitan training with ACCO on the data-parallel dimension.

    torchrun --nproc_per_node=N train_titan.py --job.config_file torchtitan_configs/llama3_8b_acco.toml
    torchrun --nproc_per_node=N train_titan.py --module acco_hooks.titan --config llama3_8b_acco  # 0.3.0

Reads a torchtitan TOML job config extended with an ``[acco]`` section (no
``custom_config_module`` line needed); CLI overrides such as ``--acco.mode dpu`` work. The
installed torchtitan decides the path: 0.2.2 reads the TOML itself; 0.3.0 (which has no TOML
configs) gets it translated into a ``Trainer.Config`` by ``acco_hooks.titan.toml_compat``,
which refuses any key without a 0.3.0 meaning before anything is built, or reads a registered
config function with its own ``--module M --config NAME`` flags. With ``[acco] enable = true``
the run uses ``ACCOTrainer``; without it, torchtitan's own ``Trainer`` (the native DDP/FSDP
baselines).

What the library does not do, this launcher does for the checkout (``scaffolding/``): with no
CUDA device the run goes to the CPU with gloo (``scaffolding.cpu_shim``), and with the dataset
``stdlib`` the embedded corpus and its tokenizer are built on first use, under
``./outputs/stdlib/``, and registered with torchtitan.

One rank logs (rank 0, or with pipeline parallelism the first rank of the last stage, whose
step lines carry the loss); the others log errors only. ``LOG_RANK=0,3`` or ``LOG_RANK=all``
picks others, as in torchtitan's ``run_train.sh``.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
import warnings
from typing import NoReturn

import torch

# First: a Python, torch or torchtitan outside the tested versions fails here, with the fix.
from acco_hooks.titan import TITAN_030


def main() -> None:
    if not torch.cuda.is_available():
        import scaffolding.cpu_shim  # noqa: F401  (installs it, before torchtitan reads its device)
    from torchtitan.tools.logging import init_logger, logger

    from acco_hooks.elastic import exit_for_restart
    from acco_hooks.titan.titan_checkpoint import CheckpointRefusal
    from scaffolding.process_exit import finish

    init_logger()
    logger.addFilter(_without_default_noise)
    rank = int(os.environ.get("RANK", "0"))
    logger.setLevel(logging.INFO if rank == 0 else logging.ERROR)  # until the config is read
    try:
        config, build_trainer, acco = (_config_030 if TITAN_030 else _config_022)()
    except ValueError as error:  # a bad setting (SettingError, TomlConfigError): nothing built
        _refuse_config(error, rank)
    if rank in _logging_ranks(config):
        logger.setLevel(logging.INFO)
    else:
        # One copy of each line: the other ranks print the same info and warnings.
        logger.setLevel(logging.ERROR)
        warnings.simplefilter("ignore")

    trainer = None
    try:
        trainer = build_trainer()
        if config.checkpoint.create_seed_checkpoint:  # as torchtitan's own main does
            trainer.checkpointer.save(curr_step=0, last_step=True)
        else:
            trainer.train()
    except BaseException as error:
        # This rank failed, maybe alone: release what it holds without waiting for its peers
        # (they fail their next collective instead), and leave the default group to the exit,
        # as torchtitan's own main does: destroying it could wait on a peer mid-collective.
        if acco and trainer is not None:
            trainer.close(barrier=False)
        elif trainer is not None:
            trainer.close()
        if isinstance(error, CheckpointRefusal):  # every rank refuses it alike: one line
            _refuse_config(error, rank)
        if isinstance(error, Exception):  # a lost peer under torchrun's agent: one line
            exit_for_restart(error, resume_from=_newest_checkpoint(trainer))
        raise
    trainer.close()  # checkpoints written, metric writers closed
    # The trainer's reference cycles hold every process group (torchtitan turned automatic
    # garbage collection off): let them go, so that finish() can destroy the groups and join
    # their worker threads while the interpreter is alive. A group's worker thread left to
    # interpreter finalization can abort the process after a successful run
    # (scaffolding/process_exit.py).
    trainer = None
    logger.info("train_titan: done")
    # Nothing is left to finalize, but torchtitan's modules take 1.8 s per rank to tear down.
    finish(finalize=False)


def _without_default_noise(record: logging.LogRecord) -> bool:
    """Drop torchtitan's warning about an option nobody set: its checkpoint config defaults to
    ``initial_load_model_only = True`` and warns, in each of the 3 or 4 configs a run builds,
    that it has no effect without an ``initial_load_path`` (kept when the command sets it)."""
    return not (
        record.getMessage().startswith("initial_load_model_only=True has no effect")
        and not any("initial_load_model_only" in arg for arg in sys.argv)
    )


def _newest_checkpoint(trainer) -> str | None:
    """The newest step torchtitan will resume from (DCP writes its ``.metadata`` last)."""
    folder = getattr(getattr(trainer, "checkpointer", None), "folder", None)
    if not folder or not os.path.isdir(folder):
        return None
    steps = [int(name.split("-", 1)[1]) for name in os.listdir(folder)
             if re.fullmatch(r"step-\d+", name)
             and os.path.isfile(os.path.join(folder, name, ".metadata"))]  # fmt: skip
    return os.path.join(folder, f"step-{max(steps)}") if steps else None


def _refuse_config(error: ValueError, rank: int) -> NoReturn:
    """A bad configuration, or a checkpoint it cannot continue: one line per job, from rank 0
    (every rank reads the same config and fails alike), and exit status 2 on every rank, as a
    command-line error."""
    # An error raised through torchtitan's train() (a checkpoint refused as it loads) was
    # recorded by torchrun's @record for its summary: its traceback would repeat the line
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file and os.path.isfile(error_file):
        os.remove(error_file)
    if rank == 0:
        print(f"train_titan: {error}", file=sys.stderr, flush=True)
    else:
        # torchrun stops the other ranks once one has exited: leave rank 0 the time to print
        time.sleep(2)
    sys.exit(2)


def _config_022():
    """torchtitan 0.2.2: its ConfigManager reads the TOML into our JobConfig."""
    from torchtitan.config import ConfigManager
    from torchtitan.train import Trainer

    from acco_hooks.titan.v022 import ACCOTrainer, JobConfig, validate_acco_config
    from scaffolding import stdlib_data

    class _ConfigManager(ConfigManager):
        def _validate_config(self) -> None:
            # torchtitan warns about a missing hf_assets_path here: build the embedded corpus's
            # tokenizer first, so that a first run has it like any later one.
            config = self.config
            stdlib_data.prepare_if_stdlib(config.training.dataset, config.training.dataset_path,
                                          config.model.hf_assets_path)  # fmt: skip
            super()._validate_config()

    config = _ConfigManager(JobConfig).parse_args(sys.argv[1:])
    settings = validate_acco_config(config)  # a bad [acco] value fails here, before building
    if settings is None:
        return config, lambda: Trainer(config), False
    return config, lambda: ACCOTrainer(config, settings), True


def _config_030():
    """torchtitan 0.3.0: a TOML and its overrides, translated into a ``Trainer.Config``, or
    torchtitan's own ``--module M --config NAME`` and its overrides."""
    import importlib

    from torchtitan.config import ConfigManager

    from acco_hooks.titan.toml_compat import load_toml_config, parse_overrides, read_toml
    from acco_hooks.titan.v030 import validate_acco_config
    from scaffolding import stdlib_data

    args = sys.argv[1:]
    if "--module" in args or any(a.startswith("--module=") for a in args):
        # Registered configs name their dataset: the embedded one must resolve while they are
        # read, and its files must exist before the trainer builds its tokenizer.
        stdlib_data.register_stdlib_datasets()
        config = ConfigManager().parse_args(args)
        stdlib_data.prepare_if_stdlib(config.dataloader.dataset, config.dataloader.dataset_path,
                                      config.hf_assets_path)  # fmt: skip
    else:
        if "--job.config_file" not in args or args.index("--job.config_file") + 1 >= len(args):
            raise SystemExit(
                "train_titan.py: --job.config_file <file.toml> (or, on torchtitan 0.3.0, "
                "--module M --config NAME) is required"
            )
        at = args.index("--job.config_file")
        path, overrides = args[at + 1], args[:at] + args[at + 2:]
        settings = {**read_toml(path), **parse_overrides(overrides, strict=False)}
        if settings.get("experimental.custom_import"):
            # 0.2.2's hook for user code, imported before building (0.3.0 has no such option)
            importlib.import_module(settings["experimental.custom_import"])
        stdlib_data.prepare_if_stdlib(settings.get("training.dataset"),
                                      settings.get("training.dataset_path"),
                                      settings.get("model.hf_assets_path", "./tests/assets/tokenizer"))  # fmt: skip
        config = load_toml_config(path, overrides)
    settings = validate_acco_config(config)  # a bad acco value fails here, before building
    # config.build(): ACCOTrainer for an ACCOTrainer.Config, torchtitan's Trainer otherwise
    if settings is None:
        return config, config.build, getattr(config, "acco", None) is not None
    return config, lambda: config.build(settings=settings), True


def _logging_ranks(config) -> set[int] | range:
    """``LOG_RANK`` (global ranks, comma-separated, or ``all``); by default the one rank whose
    step lines carry the loss: rank 0, or with pipeline parallelism the first rank of the last
    stage (torchtitan's mesh puts ``pp`` outermost)."""
    from acco_hooks._frontend import launcher_world_size

    world_size = launcher_world_size()
    chosen = os.environ.get("LOG_RANK", "")
    if chosen == "all":
        return range(world_size)
    if chosen:
        return {int(r) for r in chosen.split(",")}
    return {world_size - world_size // max(config.parallelism.pipeline_parallel_degree, 1)}


if __name__ == "__main__":
    main()
