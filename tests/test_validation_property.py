"""Property tests: every configuration value is validated up front, with a useful message.

What is validated, and the validity predicate each test uses (written here from the documented
meaning of each setting, independently of ``acco_hooks._config.validate_config`` and
``acco_hooks.titan.config.validate_acco_config``):

``ACCOOptimizer(params, torch.optim.AdamW, ..., lr=1e-3)`` (single local worker, no
``torch.distributed``):

* ``mode``: one of the strings ``"acco"``, ``"dpu"``, ``"ddp"``;
* ``accumulation_steps``: an ``int`` (not a ``bool``) ≥ 1: a number of micro-batches;
* ``accumulate_until_ready``: a ``bool``;
* ``reduce_dtype``: ``None`` (float32) or a floating dtype that can carry a sum:
  ``torch.float16``, ``bfloat16``, ``float32``, ``float64``;
* ``max_grad_norm``: ``None`` (no clipping) or a real number (``int``/``float``, not ``bool``)
  that is finite as a float and > 0;
* ``nonfinite``: ``"skip"`` or ``"raise"``;
* ``timeout``: ``None`` or a real number of seconds, finite as a float and > 0.

A configuration where every value is valid must construct (and is closed again). Any invalid
value must raise ``ValueError`` or ``TypeError`` -- never another exception -- and the message
must name at least one invalid setting and no valid one. With exactly one invalid setting the
message names exactly that setting.

``validate_acco_config(job_config, world_size=2)`` on ``acco_hooks.titan.config.JobConfig()``
with ``[acco] enable = true`` and a valid parallelism (data_parallel_replicate_degree = 2,
data_parallel_shard_degree = 1):

* ``mode``: ``"acco"``, ``"dpu"`` or ``"ddp"``;
* ``accumulation_steps``: an ``int`` (not a ``bool``) ≥ 0, 0 meaning "derive from torchtitan";
* ``accumulate_until_ready``: a ``bool`` (pure data parallelism here, so true is allowed);
* ``reduce_dtype``: one of the strings ``"float32"``, ``"bfloat16"``, ``"float16"``.

It must return ``None`` exactly when every value is valid, and otherwise raise ``ValueError``
whose message contains ``"[acco] <key>"`` for an invalid key and for no valid key.

Values drawn: the valid values above (including huge integers and tiny/huge floats) and wrong
types (strings, near-miss strings, ``None``, ``bool`` where an ``int`` is expected, ``int``
where a ``bool`` is expected, floats where an ``int`` is expected, lists), negative, zero, NaN
and ±inf numbers, non-floating and complex dtypes.

Values that this file found slipping through validation (product bugs, since fixed) have their
own tests at the end:
integers too large for a float as ``max_grad_norm``/``timeout`` (``OverflowError``), float8
dtypes as ``reduce_dtype`` (accepted, then the first round's communication fails), and an
unhashable ``[acco] reduce_dtype`` such as a TOML array (``TypeError: unhashable type``).

``timeout`` must also fit a process group's timeout: between 1 ms (gloo counts whole ms; a
smaller value became a 0 ms timeout) and 1e12 s (a larger ``datetime.timedelta`` overflows).
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from acco_hooks import ACCOOptimizer
from tests.scenario import make_model

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


VALID_MODES = ("acco", "dpu", "ddp")
VALID_REDUCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

OPTIMIZER_PREDICATES = {
    "mode": lambda v: isinstance(v, str) and v in VALID_MODES,
    "accumulation_steps": lambda v: _is_int(v) and v >= 1,
    "accumulate_until_ready": lambda v: isinstance(v, bool),
    "reduce_dtype": lambda v: v is None
    or (isinstance(v, torch.dtype) and v in VALID_REDUCE_DTYPES),
    "max_grad_norm": lambda v: v is None or _positive_finite(v),
    "nonfinite": lambda v: isinstance(v, str) and v in ("skip", "raise"),
    # Seconds a process group's timeout can hold: at least 1 ms (gloo counts in whole ms),
    # at most 1e12 (a timedelta of more than 999,999,999 days overflows).
    "timeout": lambda v: v is None or (_positive_finite(v) and 1e-3 <= float(v) <= 1e12),
}

TITAN_PREDICATES = {
    "mode": lambda v: isinstance(v, str) and v in VALID_MODES,
    "accumulation_steps": lambda v: _is_int(v) and v >= 0,
    "accumulate_until_ready": lambda v: isinstance(v, bool),
    "reduce_dtype": lambda v: isinstance(v, str) and v in ("float32", "bfloat16", "float16"),
}

# ----------------------------------------------------------------------------- strategies

# Junk strings never contain a setting name or "=", so a message quoting a bad value cannot be
# mistaken for one naming another setting.
junk_text = st.text(alphabet="XYZxyz0123456789 _.-", max_size=6)
near_miss = st.sampled_from(
    ["ACCO", "Acco", "acco ", " ddp", "sync", "zero1", "", "None", "true", "1", "float32",
     "bf16", "fp16", "Skip", "RAISE", "warn", "ignore", "inf", "nan"]
)  # fmt: skip
any_float = st.floats(allow_nan=True, allow_infinity=True)
wrong_container = st.sampled_from([[], [1], ("acco",), {}, {"a": 1}])
non_floating_dtype = st.sampled_from(
    [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
     torch.complex64, torch.complex128]
)  # fmt: skip


def valid_or_not(valid: st.SearchStrategy, invalid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly valid values (so that whole configurations are often valid), often invalid."""
    return st.one_of(valid, valid, valid, invalid)


# Boundary values, drawn often by the strategies and also checked one by one below.
OPTIMIZER_EDGE_GOOD = {
    "mode": list(VALID_MODES),
    "accumulation_steps": [1, 2, 10**18],
    "accumulate_until_ready": [True, False],
    "reduce_dtype": [None, *VALID_REDUCE_DTYPES],
    "max_grad_norm": [None, 5e-324, 1e-12, 1, 1e308, 10**300],
    "nonfinite": ["skip", "raise"],
    "timeout": [None, 1e-3, 0.5, 1, 1e12],
}
OPTIMIZER_EDGE_BAD = {
    "mode": ["ACCO", "sync", "", None, 0, True, ["acco"]],
    "accumulation_steps": [0, -1, True, False, 1.0, 2.0, math.nan, math.inf, None, "2"],
    "accumulate_until_ready": [0, 1, "true", None, 1.0],
    "reduce_dtype": [torch.int32, torch.int64, torch.bool, torch.complex64, "float32",
                     "bfloat16", 32, True, torch.float8_e4m3fn, torch.float8_e5m2],
    "max_grad_norm": [0, 0.0, -0.0, -1.0, -5e-324, math.nan, math.inf, -math.inf, True, False,
                      "1.0"],
    "nonfinite": ["Skip", "warn", "ignore", "", None, True, 0],
    "timeout": [0, 0.0, -1, math.nan, math.inf, -math.inf, True, False, "30", 1e-4, 5e-324,
                1e13, 10**400],
}  # fmt: skip

OPTIMIZER_VALID = {
    "mode": st.sampled_from(VALID_MODES),
    "accumulation_steps": st.one_of(
        st.sampled_from(OPTIMIZER_EDGE_GOOD["accumulation_steps"]), st.integers(1, 64),
        st.integers(1, 10**30),
    ),
    "accumulate_until_ready": st.booleans(),
    "reduce_dtype": st.sampled_from(OPTIMIZER_EDGE_GOOD["reduce_dtype"]),
    "max_grad_norm": st.one_of(
        st.sampled_from(OPTIMIZER_EDGE_GOOD["max_grad_norm"]),
        st.floats(min_value=5e-324, max_value=1e308, allow_nan=False, allow_infinity=False),
        st.integers(1, 10**300),
    ),
    "nonfinite": st.sampled_from(["skip", "raise"]),
    "timeout": st.one_of(
        st.sampled_from(OPTIMIZER_EDGE_GOOD["timeout"]),
        st.floats(min_value=1e-3, max_value=1e12, allow_nan=False, allow_infinity=False),
        st.integers(1, 10**6),
    ),
}

OPTIMIZER_INVALID = {
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
        non_floating_dtype, st.sampled_from(["float32", "bfloat16", "torch.float16"]),
        st.integers(), any_float, st.booleans(), wrong_container,
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
}  # fmt: skip
# The boundary values get as much weight as every other kind of bad value together.
OPTIMIZER_INVALID = {
    k: st.one_of(st.sampled_from(OPTIMIZER_EDGE_BAD[k]), v) for k, v in OPTIMIZER_INVALID.items()
}

TITAN_EDGE_GOOD = {
    "mode": list(VALID_MODES),
    "accumulation_steps": [0, 1, 8, 10**18],
    "accumulate_until_ready": [True, False],
    "reduce_dtype": ["float32", "bfloat16", "float16"],
}
TITAN_EDGE_BAD = {
    "mode": ["ACCO", "sync", "", None, 0, True],
    "accumulation_steps": [-1, True, False, 0.0, 2.0, math.nan, None, "4"],
    "accumulate_until_ready": [0, 1, "true", "false", None],
    "reduce_dtype": ["float64", "fp32", "bf16", "Float32", "", None, 32, torch.float32],
}

TITAN_VALID = {
    "mode": st.sampled_from(VALID_MODES),
    "accumulation_steps": st.one_of(
        st.sampled_from(TITAN_EDGE_GOOD["accumulation_steps"]), st.integers(0, 64),
        st.integers(0, 10**30),
    ),
    "accumulate_until_ready": st.booleans(),
    "reduce_dtype": st.sampled_from(TITAN_EDGE_GOOD["reduce_dtype"]),
}

TITAN_INVALID = {
    "mode": st.one_of(junk_text, near_miss, st.none(), st.integers(), st.booleans()),
    "accumulation_steps": st.one_of(
        st.integers(max_value=-1), st.booleans(), any_float, st.none(),
        st.sampled_from(["4", "auto", ""]),
    ),
    "accumulate_until_ready": st.one_of(
        st.integers(0, 1), any_float, st.none(), st.sampled_from(["true", "false", "yes", ""])
    ),
    # Hashable wrong values only: a TOML array has its own test below.
    "reduce_dtype": st.one_of(
        st.sampled_from(["float8", "int8", "torch.float16"]), junk_text, st.none(),
        st.integers(), any_float, st.booleans(), st.sampled_from([torch.float32, torch.bfloat16]),
    ),
}
TITAN_INVALID = {
    k: st.one_of(st.sampled_from(TITAN_EDGE_BAD[k]), v) for k, v in TITAN_INVALID.items()
}


def mixed(valid: dict, invalid: dict) -> st.SearchStrategy:
    return st.fixed_dictionaries({k: valid_or_not(valid[k], invalid[k]) for k in valid})


@st.composite
def one_bad(draw, valid: dict, invalid: dict) -> tuple[str, dict]:
    """Every setting valid but one."""
    key = draw(st.sampled_from(sorted(valid)))
    values = {k: draw(invalid[k] if k == key else valid[k]) for k in valid}
    return key, values


# ------------------------------------------------------------------------------- helpers


def named_settings(message: str, names) -> set[str]:
    return {name for name in names if re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", message)}


def check_optimizer(values: dict[str, Any]) -> tuple[bool, Exception | None]:
    """Build the optimizer; return (constructed, the ValueError/TypeError raised)."""
    model = make_model()
    try:
        opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, **values)
    except (ValueError, TypeError) as exc:
        return False, exc
    except Exception as exc:  # noqa: BLE001 - any other type is a failure of the property
        pytest.fail(f"{values!r}: raised {type(exc).__name__} (not ValueError/TypeError): {exc}")
    try:
        engine = opt.engine
        assert engine.mode == values["mode"]
        assert engine.accumulation_steps == values["accumulation_steps"]
        assert engine.accumulate_until_ready is values["accumulate_until_ready"]
        assert engine.reduce_dtype == (values["reduce_dtype"] or torch.float32)
        assert engine.max_grad_norm == values["max_grad_norm"]
    finally:
        opt.close()
    return True, None


def assert_optimizer_property(values: dict[str, Any]) -> tuple[set[str], set[str]]:
    """Check the property for ``values``; return (invalid settings, settings the error names)."""
    invalid = {k for k, pred in OPTIMIZER_PREDICATES.items() if not pred(values[k])}
    constructed, exc = check_optimizer(values)
    if not invalid:
        assert constructed, f"valid configuration {values!r} was refused: {exc!r}"
        return invalid, set()
    assert not constructed, f"invalid settings {sorted(invalid)} accepted: {values!r}"
    named = named_settings(str(exc), OPTIMIZER_PREDICATES)
    assert named, f"{type(exc).__name__} names no setting: {exc} (invalid: {sorted(invalid)})"
    assert named <= invalid, f"message blames valid settings {sorted(named - invalid)}: {exc}"
    return invalid, named


def titan_job_config(values: dict[str, Any]):
    from acco_hooks.titan.config import JobConfig

    job = JobConfig()
    job.acco.enable = True
    for key, value in values.items():
        setattr(job.acco, key, value)
    job.parallelism.data_parallel_replicate_degree = 2
    job.parallelism.data_parallel_shard_degree = 1
    return job


def assert_titan_property(values: dict[str, Any]) -> tuple[set[str], set[str]]:
    """Check the property for ``values``; return (invalid keys, keys the error names)."""
    from acco_hooks.titan.config import validate_acco_config

    invalid = {k for k, pred in TITAN_PREDICATES.items() if not pred(values[k])}
    job = titan_job_config(values)
    try:
        validate_acco_config(job, world_size=2)
    except ValueError as exc:
        assert invalid, f"valid [acco] section {values!r} was refused: {exc}"
        named = {k for k in TITAN_PREDICATES if f"[acco] {k}" in str(exc)}
        assert named, f"ValueError names no [acco] key: {exc} (invalid: {sorted(invalid)})"
        assert named <= invalid, f"message blames valid keys {sorted(named - invalid)}: {exc}"
        return invalid, named
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"{values!r}: raised {type(exc).__name__} (not ValueError): {exc}")
    assert not invalid, f"invalid [acco] keys {sorted(invalid)} accepted: {values!r}"
    return invalid, set()


# --------------------------------------------------------------------------------- tests

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(mixed(OPTIMIZER_VALID, OPTIMIZER_INVALID))
def test_optimizer_constructs_exactly_when_every_setting_is_valid(values: dict) -> None:
    assert_optimizer_property(values)


@FAST
@given(one_bad(OPTIMIZER_VALID, OPTIMIZER_INVALID))
def test_optimizer_names_the_one_bad_setting(case: tuple[str, dict]) -> None:
    key, values = case
    assert assert_optimizer_property(values) == ({key}, {key})


@settings(max_examples=100, deadline=None)
@given(st.fixed_dictionaries(OPTIMIZER_VALID))
def test_optimizer_accepts_every_valid_configuration(values: dict) -> None:
    assert assert_optimizer_property(values) == (set(), set())


@FAST
@given(mixed(TITAN_VALID, TITAN_INVALID))
def test_titan_acco_section_is_refused_exactly_when_invalid(values: dict) -> None:
    assert_titan_property(values)


@FAST
@given(one_bad(TITAN_VALID, TITAN_INVALID))
def test_titan_names_the_one_bad_key(case: tuple[str, dict]) -> None:
    key, values = case
    assert assert_titan_property(values) == ({key}, {key})


def _edge_cases(good: dict, bad: dict) -> list:
    """Each boundary value alone, every other setting at its first good value."""
    base = {k: v[0] for k, v in good.items()}
    cases = []
    for table, verdict in ((good, "ok"), (bad, "bad")):
        for key, values in table.items():
            for value in values:
                expected = set() if verdict == "ok" else {key}
                label = f"{verdict}-{key}={value!r}"[:60]
                cases.append(pytest.param({**base, key: value}, expected, id=label))
    return cases


@pytest.mark.parametrize(
    "values, expected", _edge_cases(OPTIMIZER_EDGE_GOOD, OPTIMIZER_EDGE_BAD)
)
def test_optimizer_boundary_values_one_by_one(values: dict, expected: set) -> None:
    assert assert_optimizer_property(values) == (expected, expected)


@pytest.mark.parametrize("values, expected", _edge_cases(TITAN_EDGE_GOOD, TITAN_EDGE_BAD))
def test_titan_boundary_values_one_by_one(values: dict, expected: set) -> None:
    assert assert_titan_property(values) == (expected, expected)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_the_strategies_agree_with_the_predicates(data: st.DataObject) -> None:
    """Guard against a vacuous property: "valid" draws pass the predicate, "bad" ones fail."""
    for predicates, valid, invalid in (
        (OPTIMIZER_PREDICATES, OPTIMIZER_VALID, OPTIMIZER_INVALID),
        (TITAN_PREDICATES, TITAN_VALID, TITAN_INVALID),
    ):
        key = data.draw(st.sampled_from(sorted(predicates)))
        good, bad = data.draw(valid[key]), data.draw(invalid[key])
        assert predicates[key](good), (key, good)
        assert not predicates[key](bad), (key, bad)


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


def test_titan_unhashable_reduce_dtype_is_a_value_error() -> None:
    from acco_hooks.titan.config import validate_acco_config

    values = {"mode": "acco", "accumulation_steps": 0, "accumulate_until_ready": False,
              "reduce_dtype": ["bfloat16"]}  # fmt: skip
    with pytest.raises(ValueError, match=r"\[acco\] reduce_dtype"):
        validate_acco_config(titan_job_config(values), world_size=2)
