"""torchtitan 0.2.2: the job config with the ``[acco]`` section, and its validation.

No ``from __future__ import annotations`` here: torchtitan's ConfigManager reads the field types
of the dataclasses (``dataclasses.fields(...).type``) to build nested sections from TOML.
"""

from dataclasses import dataclass, field

from acco_hooks.titan import require_release

require_release("0.2.2", __name__)  # before any torchtitan import: a clear error on 0.3.0

from torchtitan.config import JobConfig as TitanJobConfig

from acco_hooks.titan.settings import ACCO, REDUCE_DTYPES, validate_acco_settings

__all__ = ["ACCO", "JobConfig", "validate_acco_config", "REDUCE_DTYPES"]


@dataclass
class JobConfig(TitanJobConfig):
    """torchtitan's JobConfig with the ``[acco]`` section."""

    acco: ACCO = field(default_factory=ACCO)


def validate_acco_config(job_config: JobConfig, world_size: int | None = None) -> None:
    """Refuse a bad ``[acco]`` section or an unsupported parallelism before anything is built.

    Raises:
        ValueError: naming the setting and the fix.
    """
    validate_acco_settings(
        job_config.acco, job_config.parallelism, [job_config.optimizer.name],
        early_step_in_backward=job_config.optimizer.early_step_in_backward,
        world_size=world_size,
    )  # fmt: skip
