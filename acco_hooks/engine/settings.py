"""The engine's settings, each declared once: its default, its allowed values and its check.

Every front-end takes its ACCO settings from here. ``ACCOOptimizer``, ``ACCOState`` and
``ACCOHSDPOptimizer`` pass them as keyword arguments to :class:`~acco_hooks.engine.ACCOEngine`,
which gathers them into an :class:`EngineSettings`; the torchtitan ``[acco]`` section and the
Hugging Face ``ACCOArguments`` subclass :class:`ACCOSettings` and add only what is their own.
A value one front-end accepts, every front-end accepts, and each refusal names the setting in
the front-end's own spelling (``mode='x'``, ``[acco] mode = 'x'``, ``ACCOArguments.mode='x'``).

There are two classes because two of the engine's settings are ones a trainer already has a
word for:

* :class:`ACCOSettings` holds what only ACCO knows (``mode``, ``accumulate_until_ready``,
  ``reduce_dtype``, ``nonfinite``, ``timeout``, ``max_microbatches_per_round``, the estimate
  round's ``estimate_dtype`` and ``estimate_microbatches``), spelled alike
  in a Python call, a TOML section
  and a command-line flag;
* :class:`EngineSettings` adds the round size (``accumulation_steps``) and the clipping
  (``max_grad_norm``), which torchtitan and the Trainer take from their own configuration
  (gradient accumulation, ``max_norm``).

Each class's ``checks`` table, right under its fields, holds each field's check: a function of
the value that returns ``None`` for an allowed value, else what the value must be. The docstring
under each field is its ``--help`` text, for tyro (torchtitan) and, through
``metadata["help"]``, HfArgumentParser.

No ``from __future__ import annotations``: torchtitan's config parser and HfArgumentParser read
the field types of the front-end subclasses.
"""

import ast
import dataclasses
import enum
import inspect
import math
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

__all__ = ["ACCOSettings", "ESTIMATE_DTYPES", "EngineSettings", "MODES", "Mode",
           "NONFINITE_POLICIES", "REDUCE_DTYPES", "SettingError", "boolean",
           "check_accumulation_steps", "dtype_name", "real_updates", "with_own_fields"]  # fmt: skip



class Mode(enum.StrEnum):
    """The engine's modes (``EngineSettings.mode`` holds one; equal to its name as a string)."""

    ACCO = "acco"
    DPU = "dpu"
    DDP = "ddp"
    AUTO = "auto"

    def __repr__(self) -> str:  # refusals and the settings' repr spell it as it was given
        return repr(self.value)


MODES = tuple(mode.value for mode in Mode)
NONFINITE_POLICIES = ("skip", "raise")
# Dtypes the collectives can sum on every backend (float8 has no add on CPU, integers no mean).
REDUCE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float64": torch.float64,
}  # fmt: skip
# The estimate round's formats on the wire (acco_hooks.engine.wire): those, and float8 with a
# float32 scale per block of 128 values, sent as bytes and summed in float32 on arrival.
ESTIMATE_DTYPES: dict[str, torch.dtype] = {**REDUCE_DTYPES, "float8_e4m3fn": torch.float8_e4m3fn}
# Seconds a process group's timeout can hold: gloo counts whole milliseconds, and a
# ``datetime.timedelta`` of more than 999,999,999 days overflows.
TIMEOUT_RANGE_S = (1e-3, 1e12)

Check = Callable[[Any], str | None]
Spelling = Callable[[str, Any], str]


class SettingError(ValueError):
    """A setting outside its allowed values (``setting``: the field's name)."""

    def __init__(self, message: str, setting: str) -> None:
        super().__init__(message)
        self.setting = setting


def python_spelling(name: str, value: Any) -> str:
    """How a refusal names a setting passed as a keyword argument."""
    return f"acco_hooks: {name}={value!r}"


def real_updates(mode: str, steps: int) -> int:
    """Real optimizer updates in ``steps`` training steps (what a trainer counts: one round in
    ``acco``, ``dpu`` and ``ddp``; one update, of one or two rounds, in ``auto``): every other
    step in ``acco``, every step otherwise. Schedules counted in updates use it."""
    return steps // 2 if mode == Mode.ACCO else steps


# ------------------------------------------------------------------------------ the checks


def one_of(choices: tuple[str, ...]) -> Check:
    """Allows exactly the strings ``choices``."""

    def check(value: Any) -> str | None:
        if isinstance(value, str) and value in choices:
            return None
        return f"is not one of {', '.join(map(repr, choices))}"

    return check


def boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else "must be True or False"


def _number_within(value: Any, low: float, high: float = math.inf) -> bool:
    """A real number (not a bool), finite as a float, > 0 and within [low, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        as_float = float(value)
    except OverflowError:  # an int beyond the float range
        return False
    return math.isfinite(as_float) and as_float > 0 and low <= as_float <= high


def check_accumulation_steps(value: Any) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return None
    return "must be an integer >= 1 (the number of micro-batches per round)"


def _check_reduce_dtype(value: Any) -> str | None:
    if value is None or (isinstance(value, str) and value in REDUCE_DTYPES):
        return None
    if isinstance(value, torch.dtype) and value in REDUCE_DTYPES.values():
        return None
    return (f"must be one of {', '.join(map(repr, REDUCE_DTYPES))} (the dtypes collectives can "
            "sum), as a name or a torch.dtype, or None for float32")  # fmt: skip


def _check_max_grad_norm(value: Any) -> str | None:
    if value is None or _number_within(value, 0.0):
        return None
    return "must be a finite number > 0, or None for no clipping"


def _check_max_microbatches(value: Any) -> str | None:
    if value is None or check_accumulation_steps(value) is None:
        return None
    return "must be an integer >= 1 (micro-batches per round), or None for no cap"


def _check_estimate_dtype(value: Any) -> str | None:
    if value is None or (isinstance(value, str) and value in ESTIMATE_DTYPES):
        return None
    if isinstance(value, torch.dtype) and value in ESTIMATE_DTYPES.values():
        return None
    return (f"must be one of {', '.join(map(repr, ESTIMATE_DTYPES))} (the estimate round's "
            "format on the wire), as a name or a torch.dtype, or None to send it as the update "
            "round's")  # fmt: skip


def _check_estimate_microbatches(value: Any) -> str | None:
    if value is None or check_accumulation_steps(value) is None:
        return None
    return "must be an integer >= 1 (micro-batches of the estimate round), or None"


def _check_timeout(value: Any) -> str | None:
    if value is None or _number_within(value, *TIMEOUT_RANGE_S):
        return None
    low, high = TIMEOUT_RANGE_S
    return f"must be a number of seconds between {low:g} and {high:g}, or None for the default"


def dtype_name(value: Any) -> str | None:
    """A dtype setting (a name, a ``torch.dtype`` or None) by its name, or None."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return value


def _as_dtype(value: Any) -> torch.dtype | None:
    """A dtype setting (a name, a ``torch.dtype`` or None) as a ``torch.dtype`` or None."""
    if value is None or isinstance(value, torch.dtype):
        return value
    return ESTIMATE_DTYPES[value]


# ---------------------------------------------------------------------------- the settings


@dataclass
class ACCOSettings:
    """What only ACCO has a word for: every front-end takes these settings as they are.

    Tuning:

    1. ``mode="acco"`` for training; ``"ddp"`` (synchronous ZeRO-1) is the baseline ACCO should
       match per token; ``"dpu"`` (delayed update without the estimate) only reproduces the
       paper's comparison.
    2. ``accumulate_until_ready=True`` on heterogeneous hardware (replicas of unequal speed,
       one rank or several each).
    3. ``reduce_dtype="bfloat16"`` halves the bytes on the wire; accumulation stays in float32.
    """

    mode: str = "acco"
    """'acco' (overlapped, with the estimate step), 'dpu' (overlapped, one-round-delayed update
    without estimate), 'ddp' (synchronous ZeRO-1, the baseline) or 'auto' (measures compute and
    communication and runs, per update, whichever of 'ddp' and the 'acco' schedules is fastest
    per token). A round is one training step of the torchtitan and Hugging Face trainers; in
    'acco' a real optimizer update happens every other round, on both rounds' gradients, in
    'dpu' and 'ddp' every round. In 'auto' accumulation_steps counts the micro-batches of an
    update, as in 'ddp', and a training step is one update."""

    accumulate_until_ready: bool = False
    """Keep running micro-batches past the round's size while the previous round still
    communicates, instead of waiting (heterogeneous hardware: a fast rank contributes more
    micro-batches, each counted by its weight). Where a model replica spans several ranks
    (FSDP, tensor or pipeline parallelism inside it), its ranks agree after each micro-batch
    whether to run another, over the replica's own ranks, and run the same micro-batches; the
    replicas run different numbers. Runs are then no longer bit-reproducible."""

    reduce_dtype: str = "float32"
    """Dtype of the gradients on the wire: 'float32', 'bfloat16', 'float16' or 'float64' (a
    torch.dtype works too, and None means float32). Accumulation and the optimizer's master
    weights stay float32."""

    nonfinite: str = "skip"
    """What a round whose averaged gradient has NaN/Inf does: 'skip' (every rank skips that
    update and warns) or 'raise' (FloatingPointError)."""

    timeout: float | None = None
    """Seconds after which a collective of the engine fails when a peer hangs (a dead peer fails
    it at once, mostly: docs/reliability.md). None: the default of the process group (the
    Hugging Face Trainer passes its ddp_timeout, the torchtitan trainer its [comm]
    train_timeout_seconds)."""

    max_microbatches_per_round: int | None = None
    """With accumulate_until_ready: the most micro-batches one rank runs in a round (at least
    the round's size); a rank that reaches it waits for the communication. It bounds the share
    of every update that the fastest rank's samples make (one rank N times faster than another
    otherwise runs about N micro-batches per round to the slow rank's one). Every round then
    takes this many data positions (microbatches_scheduled), which a torchft replica group that
    joins reads on from: required with a torchft manager. None: no cap."""

    estimate_dtype: str | None = None
    """'acco' and 'auto': the estimate round's format on the wire, both ways (its gradients,
    and θ̃ − θ), no wider than reduce_dtype: 'bfloat16' halves its bytes, 'float8_e4m3fn' (a
    float32 scale per 128 values, gloo and NCCL) quarters them. The real update still averages
    every micro-batch's gradient in reduce_dtype (its round then sends both rounds' sum).
    None: reduce_dtype ('auto' then tries the narrower formats itself)."""

    estimate_microbatches: int | None = None
    """'acco' and 'auto': micro-batches of the estimate round. In 'acco' the update round runs
    accumulation_steps (None: as many, an even split); in 'auto' the two rounds share the
    accumulation_steps of an update, so 1 to accumulation_steps - 1 (None: 'auto' picks)."""

    checks: ClassVar[dict[str, Check]] = {
        "mode": one_of(MODES),
        "accumulate_until_ready": boolean,
        "reduce_dtype": _check_reduce_dtype,
        "nonfinite": one_of(NONFINITE_POLICIES),
        "timeout": _check_timeout,
        "max_microbatches_per_round": _check_max_microbatches,
        "estimate_dtype": _check_estimate_dtype,
        "estimate_microbatches": _check_estimate_microbatches,
    }
    """What each field allows (a subclass extends it with its own fields)."""

    def check(
        self, spell: Spelling = python_spelling, names: tuple[str, ...] | None = None
    ) -> None:
        """Raise :class:`SettingError` for the first field outside its allowed values.

        Args:
            spell: how the front-end names a setting and its value, e.g.
                ``lambda name, value: f"[acco] {name} = {value!r}"``.
            names: check only these fields (default: every one).
        """
        for field in dataclasses.fields(self):
            if names is not None and field.name not in names:
                continue
            value = getattr(self, field.name)
            requirement = self.checks[field.name](value)
            if requirement is not None:
                raise SettingError(f"{spell(field.name, value)} {requirement}", field.name)
        if names is None:
            self._check_combination(spell)

    def _check_combination(self, spell: Spelling) -> None:
        """The rules between fields, each refusal naming the field that goes against another."""
        cap = self.max_microbatches_per_round
        if cap is not None and not self.accumulate_until_ready:
            raise SettingError(
                f"{spell('max_microbatches_per_round', cap)} caps the extra micro-batches of "
                "accumulate_until_ready, which is off: turn accumulate_until_ready on, or leave "
                "max_microbatches_per_round unset (None)",
                "max_microbatches_per_round",
            )
        if self.mode == Mode.AUTO and self.accumulate_until_ready:
            raise SettingError(
                f"{spell('accumulate_until_ready', True)}: mode 'auto' times updates of a fixed "
                "number of micro-batches to choose its schedule, which uneven rounds would "
                "defeat: set accumulate_until_ready to false, or choose mode 'acco'",
                "accumulate_until_ready",
            )
        for name in ("estimate_dtype", "estimate_microbatches"):
            value = getattr(self, name)
            if value is not None and not self.has_estimate_round:
                raise SettingError(
                    f"{spell(name, value)} shapes the estimate round, which mode "
                    f"{self.mode!r} does not have: choose mode 'acco' or 'auto', or leave "
                    f"{name} unset (None)",
                    name,
                )
        estimate = self.estimate_torch_dtype
        if estimate.itemsize > self.reduce_torch_dtype.itemsize:
            raise SettingError(
                f"{spell('estimate_dtype', self.estimate_dtype)} is wider than "
                f"reduce_dtype {self.reduce_dtype!r}: the estimate round sends at most the bytes "
                "of the update round. Leave it unset (None), or raise reduce_dtype",
                "estimate_dtype",
            )

    def check_round_size(
        self, accumulation_steps: int, spell: Spelling = python_spelling,
        set_steps: Callable[[int], str] | None = None,
    ) -> None:  # fmt: skip
        """Refuse what does not fit the round's size (``accumulation_steps``, micro-batches
        per round; per update in ``auto``): what a front-end that resolves the size checks.
        ``set_steps(n)``: how a user of that front-end sets the size to ``n`` (the setting
        the size comes from, such as a global batch size), named in the error."""
        cap = self.max_microbatches_per_round
        if cap is not None and cap < accumulation_steps:
            raise SettingError(
                f"{spell('max_microbatches_per_round', cap)} is below the {accumulation_steps} "
                "micro-batches every round runs (accumulation steps): set it to at least that, "
                "or None",
                "max_microbatches_per_round",
            )
        if self.mode == Mode.AUTO and accumulation_steps < 2:
            raise SettingError(
                f"{spell('mode', 'auto')} splits each update's micro-batches (accumulation "
                f"steps, here {accumulation_steps}) between an estimate round and an update "
                "round, so it needs at least 2: "
                + (set_steps(2) if set_steps else "raise the accumulation steps to 2")
                + ", or choose mode 'ddp'",
                "mode",
            )
        split = self.estimate_microbatches
        if self.mode == Mode.AUTO and split is not None and split >= accumulation_steps:
            raise SettingError(
                f"{spell('estimate_microbatches', split)} leaves no micro-batch of an update's "
                f"{accumulation_steps} (accumulation steps) to the update round: set it between "
                f"1 and {accumulation_steps - 1}, or None to let mode 'auto' choose",
                "estimate_microbatches",
            )

    def to_engine_settings(self, **more: Any) -> "EngineSettings":
        """These settings, with the engine's others (``accumulation_steps``, ``max_grad_norm``)
        from ``more``: what a trainer front-end hands the engine. ``more`` may hold
        ``spell`` and ``set_steps``, how the refusals name the front-end's settings."""
        own = {field.name: getattr(self, field.name) for field in dataclasses.fields(ACCOSettings)}
        return EngineSettings(**{**own, **more})

    @property
    def has_estimate_round(self) -> bool:
        """Whether an update may run as an estimate round and an update round ('acco', and
        'auto' when it picks an overlapped schedule)."""
        return self.mode in (Mode.ACCO, Mode.AUTO)

    @property
    def overlaps_every_update(self) -> bool:
        """Whether every update's communication overlaps the next round ('acco', 'dpu')."""
        return self.mode in (Mode.ACCO, Mode.DPU)

    @property
    def reduce_torch_dtype(self) -> torch.dtype:
        """``reduce_dtype`` as a ``torch.dtype``."""
        return _as_dtype(self.reduce_dtype) or torch.float32

    @property
    def estimate_torch_dtype(self) -> torch.dtype:
        """``estimate_dtype`` as a ``torch.dtype`` (``reduce_dtype``'s when unset)."""
        return _as_dtype(self.estimate_dtype) or self.reduce_torch_dtype


@dataclass
class EngineSettings(ACCOSettings):
    """Every setting of :class:`~acco_hooks.engine.ACCOEngine`; checked at construction.

    Tuning ``accumulation_steps``: a real update in ``acco`` uses two rounds of gradients, so
    ``k`` in ``acco`` matches ``2k`` in ``ddp`` per update. Raise it until the compute of one
    round hides its communication (the advisor's log line says where that is).
    """

    accumulation_steps: int = 1
    """Micro-batches per round (the minimum with accumulate_until_ready); per update in
    'auto'."""

    max_grad_norm: float | None = None
    """Clip the averaged gradient to this global L2 norm before each step or estimate; None:
    no clipping."""

    spell: dataclasses.InitVar[Spelling | None] = None
    """How refusals name a setting: the front-end's spelling (default: as a keyword argument)."""

    set_steps: dataclasses.InitVar[Callable[[int], str] | None] = None
    """How a user of the front-end sets accumulation_steps to n, for the round-size refusals
    (:meth:`ACCOSettings.check_round_size`)."""

    checks: ClassVar[dict[str, Check]] = {
        **ACCOSettings.checks,
        "accumulation_steps": check_accumulation_steps,
        "max_grad_norm": _check_max_grad_norm,
    }

    def __post_init__(
        self, spell: Spelling | None, set_steps: Callable[[int], str] | None
    ) -> None:
        # Every setting is checked here, once, whichever front-end built them.
        self.check(spell or python_spelling)
        self.check_round_size(self.accumulation_steps, spell or python_spelling, set_steps)
        # Converted once, here, to the forms the engine reads; nothing converts them again.
        self.mode = Mode(self.mode)
        self.reduce_format: str = dtype_name(self.reduce_dtype) or "float32"
        """reduce_dtype by its name (float32 for None): the update round's format."""
        self.estimate_format: str = dtype_name(self.estimate_dtype) or self.reduce_format
        """estimate_dtype by its name (reduce_format for None): the estimate round's format
        in 'acco', and the widest 'auto' tries."""

    @classmethod
    def from_keywords(
        cls, settings: "EngineSettings | None", keywords: dict[str, Any]
    ) -> tuple["EngineSettings", dict[str, Any]]:
        """Split keyword arguments into the engine's settings and the rest.

        Args:
            settings: settings built beforehand, or ``None`` to take them from ``keywords``.
            keywords: keyword arguments, some of which may name settings.

        Returns:
            ``(settings, the keywords that are no setting)``.
        """
        names = {field.name for field in dataclasses.fields(cls)}
        given = {name: value for name, value in keywords.items() if name in names}
        rest = {name: value for name, value in keywords.items() if name not in names}
        if settings is None:
            return cls(**given), rest
        if not isinstance(settings, cls):
            raise TypeError(f"acco_hooks: settings must be an EngineSettings, got {settings!r}")
        if given:
            raise TypeError(
                f"acco_hooks: {', '.join(sorted(given))} given both in settings= and as keyword "
                "arguments; pass each setting once"
            )
        return settings, rest


def with_own_fields(cls: type) -> type:
    """Redeclare the fields ``cls`` inherits as its own (fresh ``dataclasses.Field`` objects with
    the same type, default and help); apply it under ``@dataclass``.

    HfArgumentParser rewrites the fields it is given (an ``Optional``'s type becomes the inner
    type): on inherited fields that would change the engine's own classes for every front-end.
    """
    annotations = {}
    for field in dataclasses.fields(cls):
        annotations[field.name] = field.type
        setattr(cls, field.name, dataclasses.field(default=field.default,
                                                   metadata=dict(field.metadata)))  # fmt: skip
    cls.__annotations__ = {**annotations, **cls.__dict__.get("__annotations__", {})}
    return cls


def _docstrings_as_help(cls: type) -> None:
    """Copy the docstring under each field of ``cls`` into its ``metadata["help"]``.

    One source of truth: the docstrings read in the code are the ``--help`` of the flags
    HfArgumentParser makes (tyro reads the docstrings itself).
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (a frozen application): flags without help
        return
    body = tree.body[0].body
    docs = {
        node.target.id: " ".join(after.value.value.split())
        for node, after in zip(body, body[1:])
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        and isinstance(after.value.value, str)
    }  # fmt: skip
    for field in dataclasses.fields(cls):
        if field.name in docs:
            field.metadata = types.MappingProxyType({**field.metadata, "help": docs[field.name]})


_docstrings_as_help(ACCOSettings)
_docstrings_as_help(EngineSettings)
