"""``ACCOArguments``: the ACCO settings of a Hugging Face ``Trainer`` run, next to its
``TrainingArguments``.

Everything the ``TrainingArguments`` already say keeps its meaning there (micro-batches per
round = ``gradient_accumulation_steps``, learning rate and schedule, ``max_grad_norm``, ...);
``ACCOArguments`` holds only what a plain ``Trainer`` has no word for. It is a dataclass, so
``transformers.HfArgumentParser((ACCOArguments, TrainingArguments))`` turns it into command-line
flags (``--mode acco``); the docstring under each field is its ``--help`` text.
"""

import ast
import dataclasses
import inspect
import math
import textwrap
import types
from dataclasses import dataclass
from typing import Any, Optional

import torch

from acco_hooks.engine import MODES, NONFINITE_POLICIES

__all__ = ["ACCOArguments", "REDUCE_DTYPES"]

REDUCE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


# Real (not string) annotations: HfArgumentParser builds the flags from the field types, and
# ``Optional[float]`` keeps ``--timeout`` a float flag.
@dataclass
class ACCOArguments:
    """How the ACCO engine replaces DDP and the optimizer in ``ACCOTrainer``.

    Tuning, in the manner of the engine's docstring:

    1. ``mode="acco"`` for training; ``"ddp"`` (synchronous ZeRO-1) is the baseline that ACCO
       should match per token, and equals a plain ``Trainer`` with DDP; ``"dpu"`` (delayed
       update without the estimate) only reproduces the paper's comparison.
    2. ``TrainingArguments.gradient_accumulation_steps`` is the number of micro-batches per
       round. In ``acco`` a real update uses two rounds, so ``k`` here matches ``2k`` in ``ddp``
       per update. Raise it until one round's compute hides its communication.
    3. ``reduce_dtype="bfloat16"`` halves the bytes on the wire; accumulation stays in fp32.

    Raises:
        ValueError: at construction, for a value outside the allowed set (naming the field).
    """

    mode: str = "acco"
    """'acco' (overlapped, with the estimate step), 'dpu' (overlapped, one-round-delayed update
    without estimate) or 'ddp' (synchronous ZeRO-1, equal to the plain Trainer with DDP). One
    Trainer step is one round; in 'acco' a real optimizer update happens every other round."""

    accumulate_until_ready: bool = False
    """Keep accumulating micro-batches past gradient_accumulation_steps while the previous round
    still communicates (heterogeneous hardware). ACCOTrainer refuses True: the Trainer runs a
    fixed number of micro-batches per step and epoch on every rank. Use ACCOOptimizer in a
    custom loop or the torchtitan trainer for it."""

    reduce_dtype: str = "float32"
    """Dtype of the gradients on the wire: 'float32', 'bfloat16', 'float16' or 'float64'.
    Accumulation and the optimizer's master weights stay float32."""

    nonfinite: str = "skip"
    """What a round whose averaged gradient has NaN/Inf does: 'skip' (every rank skips that
    update and warns) or 'raise' (FloatingPointError)."""

    timeout: Optional[float] = None
    """Seconds after which a collective of the engine fails when a peer hangs. Default:
    TrainingArguments.ddp_timeout, the timeout of the Trainer's own process group."""

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str) or self.mode not in MODES:
            raise ValueError(
                f"ACCOArguments.mode={self.mode!r} is not one of {', '.join(map(repr, MODES))}"
            )
        if not isinstance(self.accumulate_until_ready, bool):
            raise ValueError(
                f"ACCOArguments.accumulate_until_ready={self.accumulate_until_ready!r} must be "
                "True or False"
            )
        if not isinstance(self.reduce_dtype, str) or self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(
                f"ACCOArguments.reduce_dtype={self.reduce_dtype!r} is not one of "
                f"{', '.join(map(repr, REDUCE_DTYPES))}"
            )
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(
                f"ACCOArguments.nonfinite={self.nonfinite!r} is not one of "
                f"{', '.join(map(repr, NONFINITE_POLICIES))}"
            )
        if self.timeout is not None and not _seconds(self.timeout):
            raise ValueError(
                f"ACCOArguments.timeout={self.timeout!r} must be a number of seconds between "
                "0.001 and 1e12, or None for the process group's timeout"
            )

    def engine_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :class:`~acco_hooks.engine.ACCOEngine` these fields set."""
        return {
            "mode": self.mode,
            "accumulate_until_ready": self.accumulate_until_ready,
            "reduce_dtype": REDUCE_DTYPES[self.reduce_dtype],
            "nonfinite": self.nonfinite,
            "timeout": None if self.timeout is None else float(self.timeout),
        }


def _seconds(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(float(value)) and 1e-3 <= float(value) <= 1e12


def _help_from_field_docstrings(cls: type) -> type:
    """Copy the docstring under each field into ``metadata["help"]`` (HfArgumentParser's help).

    One source of truth: the docstrings read in the code are the ``--help`` of the flags.
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):  # no source (frozen app): flags without help
        return cls
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    for f in dataclasses.fields(cls):
        if f.name in docs:
            f.metadata = types.MappingProxyType({**f.metadata, "help": docs[f.name]})
    return cls


_help_from_field_docstrings(ACCOArguments)
