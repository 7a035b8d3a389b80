"""torchtitan training with ACCO on the data-parallel dimension.

    torchrun --nproc_per_node=N train_titan.py --job.config_file torchtitan_configs/llama3_8b_acco.toml

Reads a torchtitan TOML job config extended with an ``[acco]`` section (no
``custom_config_module`` line needed); CLI overrides such as ``--acco.mode dpu`` work. With
``[acco] enable = true`` the run uses ``ACCOTrainer``; without it, torchtitan's own
``Trainer`` (the native DDP/FSDP baselines). With no CUDA device the run goes to the CPU with
gloo (``acco_hooks.titan.cpu_shim``). With ``--training.dataset stdlib`` the embedded corpus and
its tokenizer are built on first use.
"""

from __future__ import annotations

import os

import torch


def main() -> None:
    if not torch.cuda.is_available():
        import acco_hooks.titan.cpu_shim  # noqa: F401  (before torchtitan reads its device)

    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger, logger
    from torchtitan.train import Trainer

    from acco_hooks.titan import stdlib_data
    from acco_hooks.titan.config import JobConfig, validate_acco_config
    from acco_hooks.titan.trainer import ACCOTrainer

    init_logger()
    config = ConfigManager(JobConfig).parse_args()
    validate_acco_config(config)  # a bad [acco] value fails here, before anything is built
    if config.training.dataset in (stdlib_data.DATASET_NAME, stdlib_data.VALIDATION_DATASET_NAME):
        dataset_dir = config.training.dataset_path or stdlib_data.DEFAULT_DATASET_DIR
        stdlib_data.ensure_stdlib_assets(dataset_dir, config.model.hf_assets_path)
        stdlib_data.register_stdlib_datasets(dataset_dir)

    trainer_class = ACCOTrainer if config.acco.enable else Trainer
    trainer = None
    try:
        trainer = trainer_class(config)
        if config.checkpoint.create_seed_checkpoint:  # as torchtitan's own main does
            trainer.checkpointer.save(curr_step=0, last_step=True)
        else:
            trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    logger.info(f"train_titan: done ({os.environ.get('RANK', '0')})")


if __name__ == "__main__":
    main()
