"""Every setting is checked up front, and every front-end accepts and refuses exactly what the
engine does, naming the setting in its own spelling.

What is valid is written here from the documented meaning of each setting (the docstrings of
``acco_hooks.engine.EngineSettings``), independently of the checks in the code:

* ``mode``: one of the strings ``"acco"``, ``"dpu"``, ``"ddp"``, ``"auto"``;
* ``accumulation_steps``: an ``int`` (not a ``bool``) ≥ 1: a number of micro-batches;
* ``accumulate_until_ready``: a ``bool``;
* ``reduce_dtype``: ``None`` (float32), or a floating dtype that can carry a sum, as a
  ``torch.dtype`` or by name: float16, bfloat16, float32, float64;
* ``max_grad_norm``: ``None`` (no clipping) or a real number (``int``/``float``, not ``bool``)
  that is finite as a float and > 0;
* ``nonfinite``: ``"skip"`` or ``"raise"``;
* ``timeout``: ``None`` or a real number of seconds that a process group's timeout can hold:
  between 1 ms (gloo counts whole ms) and 1e12 s (a larger ``timedelta`` overflows);
* ``max_microbatches_per_round``: ``None`` (no cap) or an ``int`` ≥ 1: a number of micro-batches;
* ``estimate_dtype``: ``None`` (the reduce dtype), a dtype as ``reduce_dtype`` takes, or
  float8_e4m3fn (sent with block scales), as a ``torch.dtype`` or by name;
* ``estimate_microbatches``: ``None`` or an ``int`` ≥ 1: a number of micro-batches.

The front-ends and the settings each takes (the others come from the front-end's host):

* ``ACCOEngine``, ``ACCOOptimizer``, ``ACCOState``, ``ACCOHSDPOptimizer``: every setting, as a
  keyword argument; refusals say ``<setting>=<value>``;
* torchtitan's ``[acco]`` section (0.2.2 ``JobConfig``, 0.3.0 ``ACCOTrainer.Config``): all but
  ``max_grad_norm`` (``training.max_norm``), and ``accumulation_steps`` may also be 0
  (torchtitan's gradient accumulation steps); refusals say ``[acco] <setting> = <value>``;
* Hugging Face ``ACCOArguments``: all but ``accumulation_steps`` and ``max_grad_norm`` (the
  ``TrainingArguments``' own); refusals say ``ACCOArguments.<setting>=<value>``.

Rules of composition (each value valid alone, the combination not):

* ``max_microbatches_per_round`` caps what ``accumulate_until_ready`` adds: set while that is
  off, or below the round's size (``accumulation_steps``; torchtitan's 0 resolves to 1 micro-batch
  in the configs used here), it is refused, naming ``max_microbatches_per_round``;
* ``mode="auto"`` times updates of a fixed size: with ``accumulate_until_ready=True`` it is
  refused, naming ``accumulate_until_ready``; it splits an update's ``accumulation_steps``
  micro-batches into two rounds, so fewer than 2 are refused (naming ``mode``), and an
  ``estimate_microbatches`` that leaves the update round none is refused, naming it;
* the two ``estimate_*`` settings shape the estimate round, which only ``"acco"`` and ``"auto"``
  have: set with another mode, they are refused, naming the setting; an
  ``estimate_dtype`` with more bytes per element than ``reduce_dtype`` (float32 when
  ``None``) is refused, naming ``estimate_dtype``.

A valid configuration must construct; an invalid value must raise ``ValueError`` or
``TypeError`` (never another exception) whose message names at least one invalid setting and no
valid one, and exactly that setting when only one is invalid. Values drawn: the valid values
above (huge integers, tiny and huge floats included) and wrong types (strings, near-miss strings,
``None``, ``bool`` where an ``int`` is expected and the reverse, floats for ints, lists), negative,
zero, NaN and ±inf numbers, non-floating, complex and float8 dtypes.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import pathlib
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from acco_hooks import ACCOOptimizer, EngineSettings
from tests.dist_utils import run_distributed
from tests.scenario import make_model

ROOT = pathlib.Path(__file__).parents[1]

# ----------------------------------------------------------------------------- predicates


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive_finite(value: Any) -> bool:
    if not _is_real(value):
        return False
    try:
        as_float = float(value)
    except OverflowError:  # an int beyond the float range: not a usable threshold/duration
        return False
    return math.isfinite(as_float) and as_float > 0


VALID_MODES = ("acco", "dpu", "ddp", "auto")
VALID_REDUCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
VALID_REDUCE_NAMES = ("float16", "bfloat16", "float32", "float64")

PREDICATES: dict[str, Callable[[Any], bool]] = {
    "mode": lambda v: isinstance(v, str) and v in VALID_MODES,
    "accumulation_steps": lambda v: _is_int(v) and v >= 1,
    "accumulate_until_ready": lambda v: isinstance(v, bool),
    "reduce_dtype": lambda v: v is None
    or (isinstance(v, torch.dtype) and v in VALID_REDUCE_DTYPES)
    or (isinstance(v, str) and v in VALID_REDUCE_NAMES),
    "max_grad_norm": lambda v: v is None or _positive_finite(v),
    "nonfinite": lambda v: isinstance(v, str) and v in ("skip", "raise"),
    "timeout": lambda v: v is None or (_positive_finite(v) and 1e-3 <= float(v) <= 1e12),
    "max_microbatches_per_round": lambda v: v is None or (_is_int(v) and v >= 1),
    "estimate_dtype": lambda v: v is None
    or (isinstance(v, torch.dtype) and v in (*VALID_REDUCE_DTYPES, torch.float8_e4m3fn))
    or (isinstance(v, str) and v in (*VALID_REDUCE_NAMES, "float8_e4m3fn")),
    "estimate_microbatches": lambda v: v is None or (_is_int(v) and v >= 1),
}
TITAN_SETTINGS = ("mode", "accumulation_steps", "accumulate_until_ready", "reduce_dtype",
                  "nonfinite", "timeout", "max_microbatches_per_round", "estimate_dtype",
                  "estimate_microbatches")  # fmt: skip
HF_SETTINGS = ("mode", "accumulate_until_ready", "reduce_dtype", "nonfinite", "timeout",
               "max_microbatches_per_round", "estimate_dtype",
               "estimate_microbatches")  # fmt: skip
CAP = "max_microbatches_per_round"
ESTIMATE_SETTINGS = ("estimate_dtype", "estimate_microbatches")
BYTES = {None: 4, **{d: d.itemsize for d in (*VALID_REDUCE_DTYPES, torch.float8_e4m3fn)},
         **{n: getattr(torch, n).itemsize for n in (*VALID_REDUCE_NAMES, "float8_e4m3fn")}}  # fmt: skip


def conflicting(
    values: dict[str, Any], valid: Callable[[str, Any], bool], round_size_rules: bool = True
) -> set[str]:
    """The settings of every rule of composition the combination breaks, each valid alone;
    empty if none. ``round_size_rules=False``: the front-end does not know the round's size
    (the Hugging Face arguments: the Trainer's), its rules wait for the engine."""
    if any(not valid(k, v) for k, v in values.items()):
        return set()
    broken: set[str] = set()
    mode, until, cap = values.get("mode", "acco"), values.get("accumulate_until_ready"), values.get(CAP)
    if cap is not None and until is not True:
        broken |= {CAP, "accumulate_until_ready"}
    if mode == "auto" and until is True:
        broken |= {"mode", "accumulate_until_ready"}
    for name in ESTIMATE_SETTINGS:
        if values.get(name) is not None and mode not in ("acco", "auto"):
            broken |= {name, "mode"}
    if BYTES[values.get("estimate_dtype")] > BYTES[values.get("reduce_dtype")] and (
        values.get("estimate_dtype") is not None
    ):
        broken |= {"estimate_dtype", "reduce_dtype"}
    if round_size_rules:
        steps = values.get("accumulation_steps", 1) or 1  # torchtitan's 0: one micro-batch here
        if cap is not None and cap < steps:
            broken |= {CAP, "accumulation_steps"}
        if mode == "auto" and steps < 2:
            broken |= {"mode", "accumulation_steps"}
        split = values.get("estimate_microbatches")
        if mode == "auto" and split is not None and split >= steps:
            broken |= {"estimate_microbatches", "accumulation_steps"}
    return broken


def titan_valid(name: str, value: Any) -> bool:
    """The [acco] section: as the engine, and 0 micro-batches per round means torchtitan's."""
    if name == "accumulation_steps" and _is_int(value) and value == 0:
        return True
    return PREDICATES[name](value)


# ----------------------------------------------------------------------------- strategies

# Junk strings never contain a setting name or "=", so a message quoting a bad value cannot be
# mistaken for one naming another setting.
junk_text = st.text(alphabet="XYZxyz0123456789 _.-", max_size=6)
near_miss = st.sampled_from(
    ["ACCO", "Acco", "acco ", " ddp", "sync", "zero1", "", "None", "true", "1", "Float32",
     "bf16", "fp16", "Skip", "RAISE", "warn", "ignore", "inf", "nan", "torch.float16"]
)  # fmt: skip
any_float = st.floats(allow_nan=True, allow_infinity=True)
wrong_container = st.sampled_from([[], [1], ("acco",), {}, {"a": 1}])
non_floating_dtype = st.sampled_from(
    [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
     torch.complex64, torch.complex128]
)  # fmt: skip

# Boundary values, drawn often by the strategies and checked one by one for every front-end.
EDGE_GOOD = {
    "mode": list(VALID_MODES),
    "accumulation_steps": [1, 2, 10**18],
    "accumulate_until_ready": [False, True],
    "reduce_dtype": [None, *VALID_REDUCE_DTYPES, *VALID_REDUCE_NAMES],
    "max_grad_norm": [None, 5e-324, 1e-12, 1, 1e308, 10**300],
    "nonfinite": ["skip", "raise"],
    "timeout": [None, 1e-3, 0.5, 1, 1e12],
    CAP: [None, 1, 2, 10**18],
    "estimate_dtype": [None, *VALID_REDUCE_DTYPES, *VALID_REDUCE_NAMES, torch.float8_e4m3fn,
                       "float8_e4m3fn"],
    "estimate_microbatches": [None, 1, 2, 10**18],
}
EDGE_BAD = {
    "mode": ["ACCO", "sync", "", None, 0, True, ["acco"]],
    "accumulation_steps": [0, -1, True, False, 1.0, 2.0, math.nan, math.inf, None, "2", [4]],
    "accumulate_until_ready": [0, 1, "true", None, 1.0],
    "reduce_dtype": [torch.int32, torch.int64, torch.bool, torch.complex64, "fp32", "Float32",
                     "int8", 32, True, torch.float8_e4m3fn, torch.float8_e5m2, ["bfloat16"]],
    "max_grad_norm": [0, 0.0, -0.0, -1.0, -5e-324, math.nan, math.inf, -math.inf, True, False,
                      "1.0"],
    "nonfinite": ["Skip", "warn", "ignore", "", None, True, 0],
    "timeout": [0, 0.0, -1, math.nan, math.inf, -math.inf, True, False, "30", 1e-4, 5e-324,
                1e13, 10**400],
    CAP: [0, -1, True, False, 1.0, 2.0, math.nan, math.inf, "2", [4]],
    "estimate_dtype": [torch.int32, torch.bool, "fp32", "bf16", 16, True, torch.float8_e5m2,
                       "float8_e5m2", "fp8", ["bfloat16"]],
    "estimate_microbatches": [0, -1, True, False, 1.0, math.nan, "2", [4]],
}  # fmt: skip

VALID = {
    "mode": st.sampled_from(VALID_MODES),
    "accumulation_steps": st.one_of(
        st.sampled_from(EDGE_GOOD["accumulation_steps"]), st.integers(1, 64),
        st.integers(1, 10**30),
    ),
    "accumulate_until_ready": st.booleans(),
    "reduce_dtype": st.sampled_from(EDGE_GOOD["reduce_dtype"]),
    "max_grad_norm": st.one_of(
        st.sampled_from(EDGE_GOOD["max_grad_norm"]),
        st.floats(min_value=5e-324, max_value=1e308, allow_nan=False, allow_infinity=False),
        st.integers(1, 10**300),
    ),
    "nonfinite": st.sampled_from(["skip", "raise"]),
    "timeout": st.one_of(
        st.sampled_from(EDGE_GOOD["timeout"]),
        st.floats(min_value=1e-3, max_value=1e12, allow_nan=False, allow_infinity=False),
        st.integers(1, 10**6),
    ),
    CAP: st.one_of(st.none(), st.sampled_from(EDGE_GOOD[CAP]), st.integers(1, 64)),
    "estimate_dtype": st.sampled_from(EDGE_GOOD["estimate_dtype"]),
    "estimate_microbatches": st.one_of(st.none(), st.sampled_from(EDGE_GOOD["estimate_microbatches"]),
                                       st.integers(1, 64)),
}  # fmt: skip

INVALID = {
    "mode": st.one_of(junk_text, near_miss, st.none(), st.integers(), st.booleans(),
                      wrong_container),
    "accumulation_steps": st.one_of(
        st.integers(max_value=0), st.booleans(), any_float, st.sampled_from([1.0, 2.0, 4.0]),
        st.none(), near_miss, wrong_container,
    ),
    "accumulate_until_ready": st.one_of(
        st.integers(0, 1), st.integers(), any_float, st.none(), near_miss, wrong_container
    ),
    "reduce_dtype": st.one_of(
        non_floating_dtype, near_miss, junk_text, st.integers(), any_float, st.booleans(),
        wrong_container,
    ),
    "max_grad_norm": st.one_of(
        st.floats(max_value=0.0), st.integers(max_value=0), st.booleans(), near_miss,
        wrong_container,
    ),
    "nonfinite": st.one_of(junk_text, near_miss, st.none(), st.integers(), st.booleans(),
                           wrong_container),
    "timeout": st.one_of(
        st.floats(max_value=0.0), st.integers(max_value=0), st.booleans(), near_miss,
        wrong_container,
    ),
    CAP: st.one_of(st.integers(max_value=0), st.booleans(), any_float, near_miss,
                   wrong_container),
    "estimate_dtype": st.one_of(
        non_floating_dtype, near_miss, junk_text, st.integers(), any_float, st.booleans(),
        wrong_container,
    ),
    "estimate_microbatches": st.one_of(st.integers(max_value=0), st.booleans(), any_float,
                                       near_miss, wrong_container),
}  # fmt: skip
# The boundary values get as much weight as every other kind of bad value together.
INVALID = {k: st.one_of(st.sampled_from(EDGE_BAD[k]), v) for k, v in INVALID.items()}


def valid_or_not(valid: st.SearchStrategy, invalid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly valid values (so that whole configurations are often valid), often invalid."""
    return st.one_of(valid, valid, valid, invalid)


def mixed(names: tuple[str, ...]) -> st.SearchStrategy:
    return st.fixed_dictionaries({k: valid_or_not(VALID[k], INVALID[k]) for k in names})


@st.composite
def one_bad(draw, names: tuple[str, ...], valid: Callable[[str, Any], bool]) -> tuple[str, dict]:
    """Every setting valid but one (``valid``: the front-end's own validity)."""
    key = draw(st.sampled_from(names))
    bad = INVALID[key].filter(lambda value: not valid(key, value))
    return key, {k: draw(bad if k == key else VALID[k]) for k in names}


def edge_cases(names: tuple[str, ...]) -> list:
    """``(setting, value)`` for each boundary value of ``names``, good and bad."""
    cases = []
    for table, verdict in ((EDGE_GOOD, "ok"), (EDGE_BAD, "bad")):
        for key in names:
            for value in table[key]:
                cases.append(pytest.param(key, value, id=f"{verdict}-{key}={value!r}"[:60]))
    return cases


# ------------------------------------------------------------------------------ front-ends


def named_settings(message: str, names) -> set[str]:
    return {name for name in names if re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", message)}


def build_optimizer(values: dict[str, Any]) -> Exception | None:
    """ACCOOptimizer with ``values`` on one local worker; None if it was built (and closed)."""
    try:
        opt = ACCOOptimizer(make_model().parameters(), torch.optim.AdamW, lr=1e-3, **values)
    except (ValueError, TypeError) as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 - any other type is a failure of the property
        pytest.fail(f"{values!r}: raised {type(exc).__name__} (not ValueError/TypeError): {exc}")
    try:
        taken = opt.engine.settings
        for name, value in values.items():
            assert getattr(taken, name) is value or getattr(taken, name) == value, name
    finally:
        opt.close()
    return None


def titan_config(values: dict[str, Any]) -> Any:
    """The installed torchtitan release's config of an ACCO run with ``[acco]`` = ``values``
    (2 replicas, no FSDP: pure data parallelism)."""
    from acco_hooks.titan import TITAN_030

    if TITAN_030:
        from acco_hooks.titan.config_registry import config_path
        from acco_hooks.titan.toml_compat import load_toml_config

        config = load_toml_config(config_path("debug_cpu_acco"))
    else:
        from acco_hooks.titan.v022 import JobConfig

        config = JobConfig()
        config.acco.enable = True
        config.parallelism.data_parallel_replicate_degree = 2
        config.parallelism.data_parallel_shard_degree = 1
    for name, value in values.items():
        setattr(config.acco, name, value)
    return config


def validate_titan(values: dict[str, Any]) -> Exception | None:
    from acco_hooks.titan import TITAN_030

    if TITAN_030:
        from acco_hooks.titan.v030 import validate_acco_config
    else:
        from acco_hooks.titan.v022 import validate_acco_config
    try:
        validate_acco_config(titan_config(values), world_size=2)
    except ValueError as exc:
        return exc
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"{values!r}: raised {type(exc).__name__} (not ValueError): {exc}")
    return None


def build_hf_arguments(values: dict[str, Any]) -> Exception | None:
    from acco_hooks.hf import ACCOArguments

    try:
        ACCOArguments(**values)
    except ValueError as exc:
        return exc
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"{values!r}: raised {type(exc).__name__} (not ValueError): {exc}")
    return None


def assert_verdict(values: dict[str, Any], error: Exception | None, valid: Callable,
                   spelled: Callable[[str], str],
                   round_size_rules: bool = True) -> tuple[set[str], set[str]]:  # fmt: skip
    """Built exactly when every value is valid and the combination too; a refusal names invalid
    (or conflicting) settings only, in the front-end's spelling. Returns (invalid settings,
    settings the refusal names)."""
    invalid = {k for k, v in values.items() if not valid(k, v)} or conflicting(
        values, valid, round_size_rules
    )
    if not invalid:
        assert error is None, f"valid configuration {values!r} was refused: {error!r}"
        return invalid, set()
    assert error is not None, f"invalid settings {sorted(invalid)} accepted: {values!r}"
    named = {k for k in values if re.search(rf"(?<![\w.]){re.escape(spelled(k))}", str(error))}
    assert named, f"{type(error).__name__} names no setting: {error} (invalid: {sorted(invalid)})"
    assert named <= invalid, f"message blames valid settings {sorted(named - invalid)}: {error}"
    return invalid, named


def engine_valid(name: str, value: Any) -> bool:
    return PREDICATES[name](value)


FRONT_ENDS = {  # name: (its settings, builder, validity, how it spells a setting)
    "ACCOOptimizer": (tuple(PREDICATES), build_optimizer, engine_valid, lambda k: f"{k}="),
    "titan": (TITAN_SETTINGS, validate_titan, titan_valid, lambda k: f"[acco] {k} ="),
    "hf": (HF_SETTINGS, build_hf_arguments, engine_valid, lambda k: f"ACCOArguments.{k}="),
}


def check(front_end: str, values: dict[str, Any]) -> tuple[set[str], set[str]]:
    names, build, valid, spelled = FRONT_ENDS[front_end]
    return assert_verdict(values, build(values), valid, spelled, front_end != "hf")


def with_companions(key: str, value: Any) -> dict[str, Any]:
    """``{key: value}`` and the other settings its rules of composition need to let it by."""
    values = {key: value}
    if key == CAP:
        values["accumulate_until_ready"] = True
    if key in ESTIMATE_SETTINGS:
        values["mode"] = "acco"
    if key == "estimate_dtype":
        values["reduce_dtype"] = "float64"
    if key == "mode" and value == "auto":
        values["accumulation_steps"] = 2
    return values


# --------------------------------------------------------------------------------- tests

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FRONT_END_PARAMS = [pytest.param("ACCOOptimizer"), pytest.param("titan", marks=pytest.mark.titan),
                    pytest.param("hf")]  # fmt: skip


@FAST
@given(mixed(tuple(PREDICATES)))
def test_engine_settings_construct_exactly_when_every_value_is_valid(values: dict) -> None:
    try:
        error = None
        EngineSettings(**values)
    except ValueError as exc:
        error = exc
    assert_verdict(values, error, engine_valid, lambda k: f"{k}=")


@pytest.mark.parametrize("front_end", FRONT_END_PARAMS)
@FAST
@given(data=st.data())
def test_front_end_builds_exactly_when_every_value_is_valid(front_end: str, data) -> None:
    check(front_end, data.draw(mixed(FRONT_ENDS[front_end][0])))


@pytest.mark.parametrize("front_end", FRONT_END_PARAMS)
@FAST
@given(data=st.data())
def test_front_end_names_the_one_bad_setting(front_end: str, data) -> None:
    names, _, valid, _ = FRONT_ENDS[front_end]
    key, values = data.draw(one_bad(names, valid))
    assert check(front_end, values) == ({key}, {key})


@pytest.mark.parametrize("front_end", FRONT_END_PARAMS)
@FAST
@given(data=st.data())
def test_front_end_names_the_cap_where_the_combination_conflicts(front_end: str, data) -> None:
    """Every value valid alone; the cap set without accumulate_until_ready, or below the
    round's size, is refused by naming the cap only."""
    names, _, valid, _ = FRONT_ENDS[front_end]
    values = {k: data.draw(VALID[k]) for k in names}
    values.update(mode="acco", estimate_dtype=None, estimate_microbatches=None)  # no other rule
    values[CAP] = data.draw(st.integers(1, 64))
    if "accumulation_steps" not in names or data.draw(st.booleans()):
        values["accumulate_until_ready"] = False
    else:  # until-ready on, the cap below the round's size
        values["accumulate_until_ready"] = True
        values["accumulation_steps"] = values[CAP] + data.draw(st.integers(1, 10**6))
    assert check(front_end, values)[1] == {CAP}


@pytest.mark.parametrize("key, value", edge_cases(tuple(PREDICATES)))
def test_every_front_end_agrees_with_the_engine_on_each_boundary_value(key: str, value) -> None:
    """The engine's verdict on one value, and each front-end that takes the setting: the same."""
    engine_ok = PREDICATES[key](value)
    values = with_companions(key, value)
    with_engine = check("ACCOOptimizer", values)
    assert with_engine == (set(), set()) if engine_ok else with_engine == ({key}, {key})
    if key in HF_SETTINGS:
        assert check("hf", {k: v for k, v in values.items() if k in HF_SETTINGS}) == with_engine


@pytest.mark.titan
@pytest.mark.parametrize("key, value", edge_cases(TITAN_SETTINGS))
def test_the_acco_section_agrees_with_the_engine_on_each_boundary_value(key: str, value) -> None:
    expected = (set(), set()) if titan_valid(key, value) else ({key}, {key})
    assert check("titan", with_companions(key, value)) == expected


def ddp_and_hsdp_verdicts(rank: int, world_size: int, cases: list[tuple[str, Any]]) -> dict:
    """ACCOState on a DDP model and ACCOHSDPOptimizer on a (1, 1) mesh, for each (setting, value):
    None if built (then closed), else the refusal's type and message."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from acco_hooks import ACCOHSDPOptimizer, ACCOState

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_replicate", "dp_shard"))

    def ddp(values):
        return ACCOState(DDP(make_model()), torch.optim.AdamW, lr=1e-3, **values)

    def hsdp(values):
        model = make_model()
        fully_shard(model, mesh=mesh)
        return ACCOHSDPOptimizer(model, torch.optim.AdamW, lr=1e-3, **values)

    verdicts = {}
    for name, build in (("ACCOState", ddp), ("ACCOHSDPOptimizer", hsdp)):
        for key, value in cases:
            values = with_companions(key, value)
            try:
                build(values).close()
                verdicts[name, key, repr(value)] = None
            except Exception as exc:  # noqa: BLE001 - the test asserts on the type
                verdicts[name, key, repr(value)] = (type(exc).__name__, str(exc))
    return verdicts


def test_acco_state_and_hsdp_optimizer_agree_with_the_engine() -> None:
    """Every boundary value of every setting (with its companions): the DDP hook's state and
    HSDP take what the engine takes (accumulate_until_ready too: the ranks of a replica agree
    on each round's end) and refuse the rest, naming the setting."""
    cases = [(key, value) for key in PREDICATES for table in (EDGE_GOOD, EDGE_BAD)
             for value in table[key]]  # fmt: skip
    (verdicts,) = run_distributed("tests.test_settings:ddp_and_hsdp_verdicts", 1, cases)
    for front_end in ("ACCOState", "ACCOHSDPOptimizer"):
        for key, value in cases:
            verdict = verdicts[front_end, key, repr(value)]
            if PREDICATES[key](value):
                assert verdict is None, (front_end, key, value, verdict)
                continue
            assert verdict is not None, (front_end, key, value)
            kind, message = verdict
            assert kind in ("ValueError", "SettingError", "TypeError"), verdict
            assert named_settings(message, PREDICATES) == {key}, (front_end, message)


def test_settings_given_as_an_object_or_as_keywords_are_the_same() -> None:
    settings_ = EngineSettings(mode="dpu", accumulation_steps=3, reduce_dtype="bfloat16")
    opt = ACCOOptimizer(make_model().parameters(), torch.optim.AdamW, settings=settings_, lr=1e-3)
    assert opt.engine.settings == settings_
    assert opt.engine.settings.reduce_torch_dtype is torch.bfloat16
    opt.close()
    with pytest.raises(TypeError, match="mode given both in settings= and as keyword"):
        ACCOOptimizer(make_model().parameters(), torch.optim.AdamW, settings=settings_, mode="ddp")


def test_each_setting_is_declared_once() -> None:
    """The front-ends' fields are the engine's: same default, same check (not copies), every
    field has a check, and no literal in the package lists two allowed values of a setting
    outside its declaration."""
    from acco_hooks.engine import ACCOSettings
    from acco_hooks.hf import ACCOArguments

    engine_fields = {f.name: f for f in dataclasses.fields(ACCOSettings)}
    front_ends = [ACCOArguments, EngineSettings]
    try:
        from acco_hooks.titan.config import ACCO

        front_ends.append(ACCO)
    except ImportError:  # no torchtitan installed: the others still count
        pass
    for front_end in front_ends:
        names = {field.name for field in dataclasses.fields(front_end)}
        assert names == set(front_end.checks), front_end
        for name in names & set(engine_fields):
            field = next(f for f in dataclasses.fields(front_end) if f.name == name)
            assert field.default == engine_fields[name].default, name
            assert front_end.checks[name] is ACCOSettings.checks[name], name
    allowed = [set(VALID_MODES), {"skip", "raise"}, set(VALID_REDUCE_NAMES)]
    declared_in = []
    for path in sorted((ROOT / "acco_hooks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict):
                elements = node.keys
            elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                elements = node.elts
            elif isinstance(node, ast.ClassDef):  # an enum's members: NAME = "value"
                elements = [n.value for n in node.body if isinstance(n, ast.Assign)]
            else:
                continue
            strings = {e.value for e in elements if isinstance(e, ast.Constant)}
            where = path.relative_to(ROOT).as_posix()
            declared_in += [(where, sorted(strings & values)) for values in allowed
                            if len(strings & values) >= 2]  # fmt: skip
    assert {path for path, _ in declared_in} == {"acco_hooks/engine/settings.py"}, declared_in
    assert len(declared_in) == len(allowed), declared_in


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"mode": "sync"}, ValueError, r"mode='sync' is not one of 'acco', 'dpu', 'ddp'"),
        ({"accumulation_steps": 0}, ValueError, r"accumulation_steps=0 must be an integer >= 1"),
        ({"accumulation_steps": 2.5}, ValueError, r"accumulation_steps=2.5 must be an integer"),
        ({"accumulation_steps": True}, ValueError, r"accumulation_steps=True"),
        ({"accumulate_until_ready": "yes"}, ValueError,
         r"accumulate_until_ready='yes' must be True or False"),
        ({"reduce_dtype": torch.int32}, ValueError,
         r"reduce_dtype=torch.int32 must be one of 'float32'"),
        ({"max_grad_norm": -1.0}, ValueError, r"max_grad_norm=-1.0 must be a finite number > 0"),
        ({"max_grad_norm": float("nan")}, ValueError, r"max_grad_norm=nan"),
        ({"lr_scheduler": 5}, TypeError, r"lr_scheduler must be a callable"),
    ],
)
def test_a_refusal_names_the_setting_and_the_fix(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        ACCOOptimizer(make_model().named_parameters(), torch.optim.AdamW, lr=1e-2, **kwargs)


# --------------------------------------------- values that once slipped through validation


@pytest.mark.parametrize("key", ["max_grad_norm", "timeout"])
def test_integer_beyond_float_range_is_a_value_error(key: str) -> None:
    with pytest.raises(ValueError, match=key):
        ACCOOptimizer(make_model().parameters(), torch.optim.AdamW, lr=1e-3, **{key: 10**400})


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_reduce_dtype_is_refused_up_front(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match="reduce_dtype"):
        opt = ACCOOptimizer(make_model().parameters(), torch.optim.AdamW, reduce_dtype=dtype)
        opt.close()


@pytest.mark.titan
def test_titan_unhashable_reduce_dtype_is_a_value_error() -> None:
    """A TOML array as [acco] reduce_dtype."""
    assert isinstance(validate_titan({"reduce_dtype": ["bfloat16"]}), ValueError)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_the_strategies_agree_with_the_predicates(data: st.DataObject) -> None:
    """Guard against a vacuous property: "valid" draws pass the predicate, "bad" ones fail."""
    key = data.draw(st.sampled_from(sorted(PREDICATES)))
    good, bad = data.draw(VALID[key]), data.draw(INVALID[key])
    assert PREDICATES[key](good), (key, good)
    assert not PREDICATES[key](bad), (key, bad)
