"""The schedules of an update: a split between the estimate and the update round, a narrower
estimate on the wire, and ``mode="auto"``, which switches between them and the synchronous one.

Three properties, on 2 gloo ranks:

* today's ``acco`` (float32 estimate, even split) is bit for bit what it was before the
  schedules existed: the engine of the commit before them, from the git history, trains the
  same scenario;
* every real update of every schedule is the float32 average of all its micro-batches'
  gradients, wherever they were computed: a single-process replay recomputes each gradient at
  the parameters the engine held when the micro-batch ran and steps its own AdamW with them;
* ``auto`` switches (synchronous → overlapped → synchronous) at update boundaries, every rank
  alike, and no gradient is lost across a switch (the same replay).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from acco_hooks import ACCOOptimizer, SettingError
from acco_hooks.engine.schedule import (
    AUTO_CONFIRM_UPDATES,
    AUTO_SETTLE_UPDATES,
    AUTO_TIMED_UPDATES,
    AutoSchedule,
    Schedule,
    best_schedule,
    candidate_schedules,
    schedule_seconds,
)
from tests.dist_utils import run_distributed
from tests.scenario import OPTIMIZERS, MatricesAndAdamW, make_model, microbatch_loss, param_groups

# The last commit before the schedules existed: its engine is today's ``acco`` as it was.
BEFORE_SCHEDULES = "567055e"
FINGERPRINTED = {
    "acco_2ranks": "Config(mode='acco', world_size=2, micro=[2, 2], rounds=13)",
    "acco_clip_sched": "Config(mode='acco', max_grad_norm=0.05, scheduler=True, rounds=12)",
    "acco_bf16_wire": "Config(mode='acco', reduce_dtype=torch.bfloat16, micro=[1, 3], rounds=12)",
    "dpu": "Config(mode='dpu', rounds=12)",
    "ddp": "Config(mode='ddp', rounds=12)",
}
# One rank's runs of FINGERPRINTED, hashed, with whichever acco_hooks the path gives. A module
# of its own (written next to the checkouts) so that both engines run every config in one pair
# of processes: a launch costs more than a run.
FINGERPRINT_MODULE = """
import hashlib
import torch
from tests.scenario import Config, engine_run


def fingerprints(rank, world_size, configs):
    hashes = {}
    for name, text in configs.items():
        params = engine_run(rank, world_size, eval(text))["params"]
        digest = hashlib.sha256()
        for key in sorted(params):
            digest.update(params[key].numpy().tobytes())
        hashes[name] = digest.hexdigest()
    return hashes
"""
FINGERPRINT_SCRIPT = """
import json, sys
from tests.dist_utils import run_distributed
ranks = run_distributed("acco_fingerprints:fingerprints", 2, json.loads(sys.argv[1]))
print(json.dumps({name: [hashes[name] for hashes in ranks] for name in ranks[0]}))
"""


def _fingerprints(
    acco_hooks_root: Path, scenario_root: Path, module_dir: Path
) -> dict[str, list[str]]:
    """Final parameters of every FINGERPRINTED run (2 ranks), hashed, with the ``acco_hooks``
    package under ``acco_hooks_root`` and the training scenario (``tests/``) under
    ``scenario_root``."""
    paths = (scenario_root, acco_hooks_root, module_dir)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, paths))}
    done = subprocess.run(
        [sys.executable, "-c", FINGERPRINT_SCRIPT, json.dumps(FINGERPRINTED)], env=env,
        cwd=scenario_root, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_existing_modes_are_bit_identical_to_before_the_schedules(tmp_path: Path) -> None:
    """``acco`` (float32 estimate, even split), ``dpu`` and ``ddp`` give the very bits they gave
    before the schedules: the engine of ``BEFORE_SCHEDULES`` is taken from the git history and
    both run its training scenario on this machine (hashes differ between CPUs, not runs)."""
    root = Path(__file__).resolve().parents[2]
    before, scenario = tmp_path / "before", tmp_path / "scenario"
    before.mkdir(), scenario.mkdir()
    archive = subprocess.run(["git", "-C", str(root), "archive", BEFORE_SCHEDULES, "acco_hooks",
                              "tests"], capture_output=True)  # fmt: skip
    if archive.returncode != 0:
        pytest.fail(f"this test needs the project's git history (commit {BEFORE_SCHEDULES}); "
                    f"run it in a git clone: {archive.stderr.decode()[-500:]}")  # fmt: skip
    for target in (before, scenario):
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    shutil.rmtree(scenario / "acco_hooks")  # the engine of this checkout, as installed
    (tmp_path / "acco_fingerprints.py").write_text(FINGERPRINT_MODULE)
    expected = _fingerprints(before, before, tmp_path)
    actual = _fingerprints(root, scenario, tmp_path)
    assert actual == expected
    assert len({hashes[0] for hashes in actual.values()}) == len(FINGERPRINTED)  # distinct runs


# ----------------------------------------------------------------- the replay of real updates


def recorded_run(rank: int, world_size: int, settings: dict, updates: int,
                 emulated: dict | None = None, save_to: str | None = None,
                 load_from: str | None = None, through_dcp: bool = False,
                 recipe: str = "adamw") -> dict:  # fmt: skip
    """Train with ``settings``; record where each micro-batch's gradient was computed.

    ``recipe``: ``"adamw"`` (the small model, AdamW) or ``"muon"`` (the deeper model, Muon on
    its matrices on whole parameters, AdamW on the rest).

    ``emulated``: per-update seconds the loop sleeps, by schedule kind (``"synchronous"``,
    ``"overlapped"``), as if it waited for a link or computed longer: it shapes what ``auto``
    measures, so that its choices are known in advance. ``load_from`` / ``save_to``: a folder
    to resume from first / to save into at the end (model and optimizer, per rank; with
    ``through_dcp``, one distributed checkpoint, loaded into a fresh optimizer's state dict).
    """
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = make_model(model="deep" if recipe == "muon" else "tiny")
    opt_class, kwargs = OPTIMIZERS[recipe]
    opt = ACCOOptimizer(param_groups(model, True, recipe), opt_class, **settings,
                        **kwargs)  # fmt: skip
    engine = opt.engine
    if load_from is not None and through_dcp:
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        dcp.load(state, checkpoint_id=load_from)
    elif load_from is not None:
        state = torch.load(os.path.join(load_from, f"rank{rank}.pt"), weights_only=False)
    if load_from is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    resumed_with = tuple(engine.schedule)
    points, schedules = [], []
    while engine.updates_launched < updates:
        update, position = engine.updates_launched, len(
            [p for p in points if p[0] == engine.updates_launched]
        )  # fmt: skip
        live = [p.detach().clone() for p in model.parameters()]
        microbatch_loss(model, rank, update, position).backward()
        if emulated:
            time.sleep(emulated["per_microbatch"])
        opt.step()
        points.append((update, position, live))
        if engine.step_boundary:
            kind = "synchronous" if engine.schedule.synchronous else "overlapped"
            schedules.append(tuple(engine.schedule))
            if emulated:
                time.sleep(emulated[kind])
    if save_to is not None:  # the update just launched is in flight: saved pending
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        if through_dcp:
            dcp.save(state, checkpoint_id=save_to)
        else:
            torch.save(state, os.path.join(save_to, f"rank{rank}.pt"))
    opt.flush()
    result = {
        "params": [p.detach().clone() for p in model.parameters()],
        "points": points, "schedules": schedules, "num_updates": opt.num_updates,
        "resumed_with": resumed_with, "recipe": recipe,
    }  # fmt: skip
    opt.close()
    return result


def replay(results: list[dict], updates: int) -> list[torch.Tensor]:
    """θ after ``updates`` real updates, each the recipe's step (AdamW; Muon and AdamW) of the
    float32 average of every micro-batch gradient of that update, on every rank, at the
    parameters it was computed at."""
    muon = results[0].get("recipe") == "muon"
    model = make_model(model="deep" if muon else "tiny")
    params = list(model.parameters())
    opt_class, kwargs = OPTIMIZERS["muon" if muon else "adamw"]
    groups = [{**g, "params": [p for _, p in g["params"]]}
              for g in param_groups(model, True, "muon" if muon else "adamw")]  # fmt: skip
    opt = MatricesAndAdamW(groups, **kwargs) if muon else opt_class(groups, **kwargs)
    theta = [p.detach().clone() for p in params]
    for update in range(updates):
        total, count = [torch.zeros_like(p) for p in params], 0
        for rank, result in enumerate(results):
            for u, position, live in result["points"]:
                if u != update:
                    continue
                with torch.no_grad():
                    for p, value in zip(params, live):
                        p.copy_(value)
                model.zero_grad()
                microbatch_loss(model, rank, u, position).backward()
                for t, p in zip(total, params):
                    t.add_(p.grad)
                count += 1
        with torch.no_grad():
            for p, value, g in zip(params, theta, total):
                p.copy_(value)
                p.grad = g / count
        opt.step()
        theta = [p.detach().clone() for p in params]
    return theta


def assert_every_update_is_the_average(results: list[dict], updates: int) -> None:
    expected = replay(results, updates)
    for result in results:
        assert result["num_updates"] == updates
        diff = sum(float((a - b).double().pow(2).sum()) for a, b in zip(result["params"], expected))
        norm = sum(float(b.double().pow(2).sum()) for b in expected)
        assert (diff / norm) ** 0.5 < 1e-6, (diff / norm) ** 0.5


@pytest.mark.parametrize("settings", [
    dict(mode="acco", accumulation_steps=2),
    dict(mode="acco", accumulation_steps=2, estimate_dtype="bfloat16"),
    dict(mode="acco", accumulation_steps=2, estimate_dtype="float8_e4m3fn"),
    dict(mode="acco", accumulation_steps=3, estimate_microbatches=1),
    dict(mode="acco", accumulation_steps=1, estimate_microbatches=3, estimate_dtype="float16"),
    dict(mode="acco", accumulation_steps=1, estimate_microbatches=3,
         estimate_dtype="float8_e4m3fn"),
], ids=["even", "bfloat16-estimate", "float8-estimate", "split-1-3", "split-3-1-float16",
        "split-3-1-float8"])  # fmt: skip
def test_every_real_update_averages_all_its_gradients_in_float32(settings: dict) -> None:
    results = run_distributed(f"{__name__}:recorded_run", 2, settings, 8)
    assert_every_update_is_the_average(results, 8)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_a_narrower_estimate_computes_near_the_float32_estimate(dtype: str) -> None:
    """The replay above can fail: a narrow estimate is another point than a float32 one; and
    it is near it: θ̃ − θ loses at most the format's rounding (θ itself travels exactly)."""
    even, narrow = (run_distributed(f"{__name__}:recorded_run", 2, dict(
        mode="acco", accumulation_steps=2, estimate_dtype=d), 2)[0] for d in (None, dtype))  # fmt: skip
    # micro-batches 0-3 (the estimate round, then the update round) at θ_0; 4-5 at θ̃_1, where
    # the two runs first differ
    assert all(torch.equal(a, b) for a, b in zip(even["points"][3][2], narrow["points"][3][2]))
    theta = even["points"][3][2]
    estimate, narrow_estimate = even["points"][4][2], narrow["points"][4][2]
    step = torch.cat([(e - t).flatten() for e, t in zip(estimate, theta)])
    error = torch.cat([(n - e).flatten() for n, e in zip(narrow_estimate, estimate)])
    assert 0 < float(error.norm()) < {"bfloat16": 2**-7, "float8_e4m3fn": 2**-3}[dtype] * float(step.norm())


# One process whose default backend is torch's "fake" one (it runs no collective for real):
# the engine's own groups take the default backend.
FAKE_BACKEND_SCRIPT = """
import json, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from acco_hooks import ACCOOptimizer, SettingError
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
model = torch.nn.Linear(4, 4)
try:
    ACCOOptimizer(model.parameters(), torch.optim.AdamW, estimate_dtype="float8_e4m3fn")
    refusal = None
except SettingError as exc:
    refusal = [str(exc), exc.setting]
auto = ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="auto", accumulation_steps=2)
formats = sorted({s.estimate_dtype for s in auto.engine.candidate_schedules})
auto.close()
print(json.dumps({"refusal": refusal, "formats": formats}))
"""


def test_a_float8_estimate_is_refused_where_the_backend_cannot_send_it() -> None:
    """``auto`` leaves float8 out of its candidates there instead."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", FAKE_BACKEND_SCRIPT], cwd=root, timeout=300,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    message, setting = result["refusal"]
    assert setting == "estimate_dtype"
    assert message.startswith("acco_hooks: estimate_dtype='float8_e4m3fn' sends bytes with "
                              "all_to_all_single, which the 'fake' backend")  # fmt: skip
    assert "use a gloo or NCCL process group, or estimate_dtype='bfloat16'" in message
    assert result["formats"] == ["", "bfloat16", "float32"]


# Per update of 4 micro-batches of 5 ms: synchronous updates wait 40 ms more (a link), the
# overlapped ones nothing; then overlapped ones slower than synchronous (a link that got worse
# while compute slowed down in the overlap).
LINK_HIDES = dict(per_microbatch=0.005, synchronous=0.040, overlapped=0.0)
OVERLAP_LOSES = dict(per_microbatch=0.005, synchronous=0.040, overlapped=0.100)


@pytest.mark.parametrize("emulated, keeps", [(LINK_HIDES, True), (OVERLAP_LOSES, False)],
                         ids=["keeps-overlapped", "back-to-synchronous"])  # fmt: skip
def test_auto_switches_at_update_boundaries_and_loses_no_gradient(emulated, keeps) -> None:
    updates = 30
    results = run_distributed(f"{__name__}:recorded_run", 2,
                              dict(mode="auto", accumulation_steps=4), updates, emulated)  # fmt: skip
    schedules = results[0]["schedules"]
    assert results[1]["schedules"] == schedules  # every rank ran the same schedule
    synchronous = Schedule(0, 4)
    timed_first = AUTO_SETTLE_UPDATES + AUTO_TIMED_UPDATES  # synchronous updates, at least
    assert schedules[:timed_first] == [synchronous] * timed_first
    overlapped = [s for s in schedules if s != synchronous]
    assert overlapped, schedules
    assert all(s.estimate_microbatches + s.update_microbatches == 4 for s in map(Schedule._make, overlapped))
    assert (schedules[-1] != synchronous) == keeps, schedules
    assert_every_update_is_the_average(results, updates)


@pytest.mark.parametrize("through_dcp", [False, True], ids=["per-rank", "dcp"])
def test_auto_resumes_its_schedule_from_a_checkpoint(through_dcp, tmp_path) -> None:
    """Saved after it chose an overlapped schedule, with that update in flight and the choice
    being confirmed: the resumed run goes on with the same schedule, every rank alike, confirms
    it from what the saved run timed (DCP loads it into a fresh optimizer's state dict, which
    times nothing yet), and every update of both halves is the float32 average of its
    gradients."""
    settings = dict(mode="auto", accumulation_steps=4)
    first, total = 14, 14 + AUTO_CONFIRM_UPDATES + AUTO_SETTLE_UPDATES
    before = run_distributed(f"{__name__}:recorded_run", 2, settings, first, LINK_HIDES,
                             str(tmp_path), None, through_dcp)  # fmt: skip
    after = run_distributed(f"{__name__}:recorded_run", 2, settings, total, LINK_HIDES, None,
                            str(tmp_path), through_dcp)  # fmt: skip
    saved = before[0]["schedules"][-1]
    assert not Schedule(*saved).synchronous, before[0]["schedules"]
    assert [r["resumed_with"] for r in after] == [saved, saved]
    assert after[0]["schedules"] == after[1]["schedules"]
    joined = [{**b, "points": b["points"] + a["points"], "num_updates": a["num_updates"],
               "params": a["params"]} for b, a in zip(before, after)]  # fmt: skip
    assert_every_update_is_the_average(joined, total)


# ------------------------------------------------------------------------ the law and choice


def test_the_generalized_law_at_its_landmarks() -> None:
    even = Schedule(2, 2, "float32")
    # c = 1, C = 2 = one round's compute: ACCO's 1.5
    assert schedule_seconds(1.0, 2.0, Schedule(0, 4), 2.0) / schedule_seconds(1.0, 2.0, even, 2.0) == 1.5
    # a bfloat16 estimate (αC = 1) with the split 3/1: 4 + 2 against max(3, 2) + max(1, 1)
    assert schedule_seconds(1.0, 2.0, Schedule(3, 1, "bfloat16"), 1.0) == 4.0
    candidates = candidate_schedules(6, ["float32", "bfloat16"])
    best, speedup = best_schedule(1.0, 4.0, candidates, {"bfloat16": 2.0})
    # C = 4, αC = 2: k1 = 4 hides C, k2 = 2 hides αC: 10 / 6 = 1 + 1/(1 + α)
    assert best == Schedule(4, 2, "bfloat16") and speedup == pytest.approx(10 / 6)
    best, speedup = best_schedule(1.0, 0.0, candidates, {"bfloat16": 0.0})
    assert best == Schedule(0, 6) and speedup == 1.0  # nothing to hide: synchronous


def test_auto_keeps_synchronous_when_no_trial_is_faster() -> None:
    auto = AutoSchedule(candidate_schedules(4, ["float32", "bfloat16"]), "float32",
                        {"float32": 1.0, "bfloat16": 0.5}, report=False)  # fmt: skip
    synchronous = auto.candidates[0]
    for _ in range(AUTO_SETTLE_UPDATES + AUTO_TIMED_UPDATES):
        for _ in range(4):
            auto.record_microbatch(0.01, communicating=False)
        auto.record_comm("float32", 0.03)
        auto.record_update(synchronous, 0.07)
    trial = auto.target
    assert trial != synchronous  # the law prices an overlapped schedule below 0.07
    for _ in range(AUTO_SETTLE_UPDATES + AUTO_TIMED_UPDATES):
        auto.record_comm(trial.estimate_dtype, 0.03)
        auto.record_update(trial, 0.09)  # but it is timed slower
    while auto.target != auto.chosen:  # further trials, all slower
        trial = auto.target
        for _ in range(AUTO_SETTLE_UPDATES + AUTO_TIMED_UPDATES):
            auto.record_update(trial, 0.09)
    assert auto.chosen == synchronous and auto.figures["measured_speedup"] == 1.0


def _chose_an_overlapped_schedule() -> AutoSchedule:
    """An AutoSchedule whose trial was timed faster than the synchronous schedule."""
    auto = AutoSchedule(candidate_schedules(4, ["float32", "bfloat16"]), "float32",
                        {"float32": 1.0, "bfloat16": 0.5}, report=False)  # fmt: skip
    synchronous = auto.candidates[0]
    for _ in range(AUTO_SETTLE_UPDATES + AUTO_TIMED_UPDATES):
        for _ in range(4):
            auto.record_microbatch(0.01, communicating=False)
        auto.record_comm("float32", 0.03)
        auto.record_update(synchronous, 0.07)
    while auto.chosen is None:  # every trial timed at 0.05: faster
        trial = auto.target
        for _ in range(AUTO_SETTLE_UPDATES + AUTO_TIMED_UPDATES):
            auto.record_update(trial, 0.05)
    assert not auto.chosen.synchronous
    return auto


@pytest.mark.parametrize("confirmed_s, keeps", [(0.05, True), (0.0695, False), (0.09, False)])
def test_auto_drops_an_overlapped_schedule_that_does_not_stay_faster(confirmed_s, keeps) -> None:
    """A trial of a few updates can be lucky: the chosen schedule is timed again, and must
    still beat the synchronous one by 2 % (0.0686 s here)."""
    auto = _chose_an_overlapped_schedule()
    chosen = auto.chosen
    for _ in range(AUTO_SETTLE_UPDATES + AUTO_CONFIRM_UPDATES):
        auto.record_update(chosen, confirmed_s)
    assert (auto.chosen == chosen) == keeps and auto.target == auto.chosen
    assert auto.chosen.synchronous != keeps
    if not keeps:
        assert auto.figures["measured_speedup"] == 1.0


def test_auto_refuses_what_it_cannot_honour() -> None:
    model = make_model()
    with pytest.raises(SettingError, match="accumulate_until_ready=True: mode 'auto' times"):
        ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="auto", accumulation_steps=4,
                      accumulate_until_ready=True)  # fmt: skip
    with pytest.raises(SettingError, match="mode='auto' splits .* needs at least 2"):
        ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="auto", accumulation_steps=1)
    with pytest.raises(SettingError, match="estimate_microbatches=4 leaves no micro-batch"):
        ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="auto", accumulation_steps=4,
                      estimate_microbatches=4)  # fmt: skip
    with pytest.raises(SettingError, match="estimate_dtype='float32' is wider than"):
        ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="acco",
                      reduce_dtype="bfloat16", estimate_dtype="float32")  # fmt: skip
    with pytest.raises(SettingError, match="estimate_microbatches=2 shapes the estimate round, "
                                           "which mode 'ddp' does not have"):
        ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="ddp", estimate_microbatches=2)
