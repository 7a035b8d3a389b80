"""Generated resumes: every checkpoint the engine writes through DCP resumes exactly, on the
same number of ranks or another, once or twice in a row, or its load is refused by name.

Hypothesis draws the parameters (their count and shapes, one-element ones included, so that
some ranks hold an empty shard, and which are frozen: a group of frozen ones only keeps its
index), their split into groups with differing options, the optimizer (among them one a user
declared per element, whose constructor requires its arguments), the mode and its schedule (an
uneven split, a narrow estimate), the weighting of the micro-batches (a mean loss, or a
token-summed one with batches of varying size), names or bare parameters, the ranks that save
and those that load, and the save points (before the first step too). The oracle is the
uninterrupted run (``tests/engine/resume_cases.py``): bit for bit on the same ranks, to 1e-5
elsewhere, or, with a narrow estimate, to what its rounding alone moves two uninterrupted runs
on the two worlds apart (each rank rounds its own part of the estimate's gradient). A save in
the middle of a round must be refused naming it, and nothing else may be.

CI runs a fixed budget with a fixed seed (``derandomize``). More on demand, and other ones
(``ACCO_RESUME_SEED``), from the checkout's root::

    ACCO_RESUME_EXAMPLES=300 python -m pytest tests/engine/test_resume_generated.py
    ACCO_RESUME_SEED=7 ACCO_RESUME_EXAMPLES=100 \
        python -m pytest tests/engine/test_resume_generated.py
"""

from __future__ import annotations

import dataclasses
import itertools
import os

from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st

from tests.engine.resume_cases import OPTIMIZERS, ResumeCase, relative_error

EXAMPLES = int(os.environ.get("ACCO_RESUME_EXAMPLES", "24"))
SEED = os.environ.get("ACCO_RESUME_SEED")
RUN = "tests.engine.resume_cases:run"
SHAPES = [(1,), (2,), (3,), (5,), (2, 3), (3, 4), (4, 1)]


@dataclasses.dataclass(frozen=True)
class Plan:
    """A case, how long it trains, and who saves and loads where."""

    case: ResumeCase
    total: int  # micro-batches of the whole run
    saved_by: int
    at: int  # micro-batches done at the first save
    resumed_on: int
    again: tuple[int, int] | None  # (micro-batches done, ranks) of a second save and resume

    def round_boundaries(self) -> set[int]:
        """Micro-batch counts at which a round ends: a save there is not mid-round."""
        case, steps = self.case, self.case.accumulation_steps
        sizes = [steps]
        if case.mode == "acco":  # an estimate round, then an update round
            sizes = [case.estimate_microbatches or steps, steps]
        ends = itertools.accumulate(itertools.islice(itertools.cycle(sizes), self.total))
        return {0, *ends}  # before the first step too


@st.composite
def plans(draw) -> Plan:
    count = draw(st.integers(1, 4))
    shapes = tuple(draw(st.sampled_from(SHAPES)) for _ in range(count))
    drawn = [draw(st.integers(0, 2)) for _ in range(count)]
    group_of = tuple(sorted(set(drawn)).index(g) for g in drawn)  # every group non-empty
    # frozen parameters: a group of them only keeps its index; one parameter at least trains
    frozen = tuple(draw(st.booleans()) if count > 1 else False for _ in range(count))
    if all(frozen):
        frozen = (False, *frozen[1:])
    optimizer = draw(st.sampled_from(sorted(OPTIMIZERS)))
    base = OPTIMIZERS[optimizer][1]

    def options() -> tuple[tuple[str, float], ...]:
        chosen = {"lr": base["lr"] * draw(st.sampled_from([1.0, 0.5]))}
        chosen["weight_decay"] = draw(st.sampled_from([0.0, 0.1]))
        if optimizer == "SGD":
            chosen["momentum"] = draw(st.sampled_from([0.0, 0.9]))
        return tuple(sorted(chosen.items()))

    mode = draw(st.sampled_from(["acco", "dpu", "ddp", "auto"]))
    steps = draw(st.integers(2 if mode == "auto" else 1, 3))
    split = dtype = None
    if mode == "acco":
        split = draw(st.one_of(st.none(), st.integers(1, 3)))
    if mode == "auto" and steps > 2:
        split = draw(st.one_of(st.none(), st.integers(1, steps - 1)))
    if mode in ("acco", "auto"):
        dtype = draw(st.sampled_from([None, "bfloat16", "float8_e4m3fn"]))
    case = ResumeCase(
        shapes=shapes, group_of=group_of,
        group_options=tuple(options() for _ in range(max(group_of) + 1)),
        optimizer=optimizer, mode=mode, accumulation_steps=steps, estimate_microbatches=split,
        estimate_dtype=dtype, weights=draw(st.sampled_from(["mean", "tokens"])),
        named=draw(st.booleans()), frozen=frozen,
    )  # fmt: skip
    # three updates: auto stays on its synchronous schedule while it times its first five
    total = 3 * (steps + (split or steps) if mode == "acco" else steps)
    at = draw(st.integers(0, total - 2))  # 0: saved before the first step
    again = None
    if draw(st.booleans()):
        again = (draw(st.integers(at + 1, total - 1)), draw(st.integers(1, 4)))
    return Plan(case, total, draw(st.integers(1, 4)), at, draw(st.integers(1, 4)), again)


def check(result, plan: Plan, at: int, same_ranks: bool, straight: dict, noise: float) -> bool:
    """The resumed run's end is the uninterrupted one's (within ``noise`` on other ranks), or a
    mid-round save was refused. Returns whether it resumed."""
    if isinstance(result, str):
        assert at not in plan.round_boundaries(), f"refused at a round end: {result}"
        assert "saved in the middle of a round" in result, result
        return False
    assert at in plan.round_boundaries(), "a mid-round save loaded through DCP"
    assert all("matched to them by position" in w for w in result["warnings"]), result["warnings"]
    error = relative_error(result["params"], straight)
    if same_ranks and plan.case.exact_on_the_same_ranks:
        assert error == 0.0, error
    else:
        assert error <= max(1e-5, 4 * noise), (error, noise)
    return True


def estimate_noise(pool, plan: Plan, straight: dict, worlds: set[int]) -> float:
    """How far a narrow estimate's rounding alone moves the end between the saving world and
    ``worlds``: each rank rounds its own part of the estimate's gradient, so two uninterrupted
    runs on different worlds differ by it (0 without a narrow estimate, or on the same world)."""
    worlds = worlds - {plan.saved_by}
    if plan.case.estimate_dtype is None or not worlds:
        return 0.0
    return max(relative_error(pool.run(RUN, w, plan.case, 0, plan.total)[0]["params"], straight)
               for w in worlds)  # fmt: skip


def generated(test):
    test = settings(max_examples=EXAMPLES, deadline=None, derandomize=SEED is None,
                    database=None, suppress_health_check=[HealthCheck.too_slow,
                                                          HealthCheck.function_scoped_fixture],
                    )(test)  # fmt: skip
    return test if SEED is None else seed(int(SEED))(test)


# Always run, besides the drawn ones: a first group of frozen parameters only, a declared
# optimizer whose constructor requires its arguments, saved before the first step on 2 ranks,
# resumed on 3, saved again between an estimate and its update and resumed on 1.
FROZEN_GROUP_SAVED_BEFORE_THE_FIRST_STEP = Plan(
    ResumeCase(frozen=(True, True, False), optimizer="RequiredArgsSGD", mode="acco"),
    total=12, saved_by=2, at=0, resumed_on=3, again=(4, 1),
)


# Whole parameters, besides the drawn ones: Muon on a group of three matrices (two ranks own
# one, a third none on 3 ranks) and AdamW on the rest, saved between an estimate and its update
# on 2 ranks, resumed on 3 and again on 4; Adafactor in dpu, saved by 3 ranks, resumed on 2.
MUON_BETWEEN_ESTIMATE_AND_UPDATE = Plan(
    ResumeCase(shapes=((3, 4), (2, 3), (4, 1), (5,)), group_of=(0, 0, 0, 1),
               group_options=((("lr", 1e-2),), (("lr", 5e-3),)), optimizer="Muon+AdamW"),
    total=12, saved_by=2, at=2, resumed_on=3, again=(8, 4),
)
ADAFACTOR_IN_DPU = Plan(
    ResumeCase(shapes=((3, 4), (5,), (2, 3)), group_of=(0, 1, 0), optimizer="Adafactor",
               group_options=((("lr", 1e-2),), (("lr", 5e-3),)), mode="dpu"),
    total=6, saved_by=3, at=2, resumed_on=2, again=None,
)


@generated
@example(plan=FROZEN_GROUP_SAVED_BEFORE_THE_FIRST_STEP)
@example(plan=MUON_BETWEEN_ESTIMATE_AND_UPDATE)
@example(plan=ADAFACTOR_IN_DPU)
@given(plan=plans())
def test_every_checkpoint_resumes_exactly_or_is_refused_by_name(plan, rank_pool, tmp_path_factory):
    folder = tmp_path_factory.mktemp("resume")
    first, second = str(folder / "first"), str(folder / "second")
    straight = rank_pool.run(RUN, plan.saved_by, plan.case, 0, plan.total, None,
                             ((plan.at, first),))[0]["params"]  # fmt: skip
    worlds = {plan.resumed_on} | ({plan.again[1]} if plan.again else set())
    noise = estimate_noise(rank_pool, plan, straight, worlds)
    saves = () if plan.again is None else ((plan.again[0], second),)
    resumed = rank_pool.run(RUN, plan.resumed_on, plan.case, plan.at, plan.total, first, saves)[0]
    went_on = check(resumed, plan, plan.at, plan.resumed_on == plan.saved_by, straight, noise)
    if plan.again is not None and went_on:
        at, world_size = plan.again
        again = rank_pool.run(RUN, world_size, plan.case, at, plan.total, second)[0]
        same = world_size == plan.resumed_on == plan.saved_by
        check(again, plan, at, same, straight, noise)
