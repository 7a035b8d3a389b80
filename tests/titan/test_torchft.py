"""train_titan.py with ``[acco]`` and ``[fault_tolerance]``: ACCO across torchft replica groups,
each group its own ``torchrun`` under one lighthouse, as torchtitan launches its own torchft
trainer. On torchtitan 0.3.0 (ACCO's trainer has ``experiments.torchft``'s section) the restart
test and the refusals run too, on one SPMD backend (the groups do not depend on it).

The oracle is the same job as one ``torchrun`` of every rank without torchft: the groups read
the data the reference's ranks read (torchtitan's split over groups x ranks), so with every
group alive each step's gradient norm (of the average over every rank, clipped against
``max_norm``) is the reference's, and the groups' losses average to its loss. When a group is
SIGKILLed mid-round and restarted, every group's norms are those of a reference whose ranks of
that group contribute nothing in the rounds it was away, the one it joined in included
(``tests/titan/torchft_hooks.py``); after it joined, the two groups' losses average to the
reference's again. With checkpoints on, each group saves into a folder of its own: the
restarted group leaves its own (from before the loss) unread, and the whole job started again
from every group's checkpoint goes on with the straight run's printed losses and norms. The
plain loop's torchft suite (``tests/engine/test_torchft.py``) holds the engine itself to the
kill points and group counts.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torchft", reason="the ft extra: pip install -e '.[ft]'")

from scaffolding.torchft_job import ROOT, run_groups, run_reference
from tests.titan.conftest import SMALL_FLAVOR, backend_overrides

# torchtitan 0.2.2 unless a test says otherwise (a torchtitan launch costs CI tens of seconds)
pytestmark = [pytest.mark.titan, pytest.mark.spmd_backends()]
ON_030 = pytest.mark.spmd_backends("spmd_types")
STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*(-?[\d.]+)\s+grad_norm:\s*(-?[\d.]+)")
ROUNDS = 10
HOLD_ROUND = 6  # a restarted group's first step (comparing settings) meets that round's sum
TITAN = ("train_titan.py",)


# How a group's ranks split the model, beside its replicas (each group and the reference alike)
HSDP = {"data_parallel_shard_degree": 2}
TP = {"tensor_parallel_degree": 2}
PP = {"pipeline_parallel_degree": 2, "pipeline_parallel_microbatch_size": 1}


def _replicas(ranks: int, split: dict[str, int]) -> int:
    degrees = [v for k, v in split.items() if k.endswith("_degree")]
    return ranks // math.prod(degrees)


def _args(mode: str, split: dict[str, int]) -> list[str]:
    return ["--job.config_file", str(ROOT / "torchtitan_configs" / "debug_cpu_acco.toml"),
            "--metrics.disable_color_printing", "--acco.mode", mode,
            "--acco.accumulation_steps", "2", "--training.global_batch_size", "-1",
            "--training.steps", str(ROUNDS), "--training.seq_len", "64",
            "--training.local_batch_size", "2", "--optimizer.lr", "3e-3",
            *[arg for k, v in split.items() for arg in (f"--parallelism.{k}", str(v))],
            "--experimental.custom_import", "tests.titan.torchft_hooks", *SMALL_FLAVOR,
            *backend_overrides()]  # fmt: skip


def _ft(groups: int, i: int, dump: Path) -> list[str]:
    return ["--fault_tolerance.enable", "--fault_tolerance.replica_id", str(i),
            "--fault_tolerance.group_size", str(groups),
            "--fault_tolerance.process_group_timeout_ms", "10000",
            "--job.dump_folder", str(dump / f"g{i}")]  # fmt: skip


def _steps(log: Path) -> dict[int, tuple[float, float]]:
    return {int(s): (float(loss), float(norm)) for s, loss, norm in STEP.findall(log.read_text())}


def _run(tmp_path: Path, monkeypatch, groups: int, group_size: int, mode: str,
         kill: tuple[int, int] | None = None, restart: bool = False,
         split: dict[str, int] | None = None, extra: tuple[str, ...] = (),
         reference: bool = True, reference_extra: tuple[str, ...] = (),
         ) -> tuple[list[int], dict, dict]:  # fmt: skip
    """Run the job (``kill``: group, round) and its reference; return the groups' exit
    statuses, each group's {step: (loss, grad_norm)} (a restarted group's: ``g{i}r``) and the
    reference's. ``split``: how each group's ranks (and the reference's) split the model
    beside their replicas (HSDP, TP, PP); ``extra``: more arguments for the groups,
    ``reference_extra`` for the reference."""
    monkeypatch.setenv("ACCO_TEST_FT_OUT", str(tmp_path))
    monkeypatch.setenv("ACCO_TEST_FT_GROUPS", str(groups))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    if kill is not None:
        monkeypatch.setenv("ACCO_TEST_FT_KILL", f"{kill[0]}:{kill[1]}")
    if restart:
        monkeypatch.setenv("ACCO_TEST_FT_HOLD", str(HOLD_ROUND))
    split = split or {}
    args = _args(mode, split)
    replicas = ["--parallelism.data_parallel_replicate_degree", str(_replicas(group_size, split))]
    ft = {i: [*_ft(groups, i, tmp_path), *replicas, *extra] for i in range(groups)}
    status = run_groups(groups, group_size, args, tmp_path, program=TITAN, replica_args=ft,
                        restart={kill[0]: ft[kill[0]]} if restart else None)  # fmt: skip
    for name in ("ACCO_TEST_FT_KILL", "ACCO_TEST_FT_HOLD"):
        monkeypatch.delenv(name, raising=False)
    runs = {i: _steps(tmp_path / f"g{i}.log") for i in range(groups)}
    if kill is not None:
        away = f"{kill[0]}:{group_size}:{kill[1]}"
        if restart:
            log = (tmp_path / f"g{kill[0]}_restart.log").read_text()
            joined = re.search(r"joined the job at round (\d+)", log)
            assert joined is not None, (f"exit statuses {status}; the restarted group never "
                                        f"joined:\n{log[-4000:]}")  # fmt: skip
            joined = int(joined.group(1))
            runs[f"g{kill[0]}r"] = _steps(tmp_path / f"g{kill[0]}_restart.log")
            away += f":{joined + 1}"
        monkeypatch.setenv("ACCO_TEST_FT_STOP", away)
    if not reference:
        return status, runs, {}
    reference_args = [*args, "--job.dump_folder", str(tmp_path / "ref"),
                      "--parallelism.data_parallel_replicate_degree",
                      str(_replicas(groups * group_size, split)), *reference_extra]  # fmt: skip
    assert run_reference(groups, group_size, reference_args, tmp_path, program=TITAN) == 0, (
        (tmp_path / "reference.log").read_text()[-4000:]
    )
    return status, runs, _steps(tmp_path / "reference.log")


@pytest.mark.parametrize("split", [HSDP, TP], ids=["hsdp", "tp"])
def test_every_group_alive_equals_one_run_over_every_rank(
    tmp_path: Path, monkeypatch, split: dict[str, int]
) -> None:  # fmt: skip
    """2 groups of one replica over 2 ranks, FSDP-sharded (HSDP; the data split over groups x
    ranks) or tensor parallel, against one torchrun of 2 replicas of the same 2-rank layout:
    the groups are the replicas. (ZeRO-1 inside a group: the restart test below and the plain
    loop's suite; pipeline parallel: the resume test.)"""
    groups, group_size = 2, 2
    status, runs, reference = _run(tmp_path, monkeypatch, groups, group_size, "acco", split=split)
    assert status == [0] * groups, (tmp_path / "g0.log").read_text()[-4000:]
    assert sorted(reference) == list(range(1, ROUNDS + 1))
    for i in range(groups):
        assert sorted(runs[i]) == sorted(reference), i
        for step, (_, norm) in reference.items():
            assert runs[i][step][1] == pytest.approx(norm, rel=1e-4, abs=1e-4), (i, step)
    for step, (loss, _) in reference.items():  # equal tokens per group: the mean of the means
        mean = sum(runs[i][step][0] for i in range(groups)) / groups
        assert mean == pytest.approx(loss, abs=5e-5), step
    assert reference[ROUNDS][0] < reference[1][0] - 0.1  # it learns


UNEQUAL = re.compile(r"unequal replicas: rank (\d+) replica (\d+) counts \[([\d, ]*)\]")
UNTIL_READY = ("--acco.accumulate_until_ready", "--acco.max_microbatches_per_round", "4",
               "--experimental.custom_import", "tests.titan.unequal_replicas")  # fmt: skip


def _ran(log: Path) -> dict[int, list[int]]:
    """{the job's replica: the micro-batches it ran per step} from a log of
    tests/titan/unequal_replicas.py's lines, its ranks checked to agree."""
    ran: dict[int, list[int]] = {}
    for _, replica, counts in UNEQUAL.findall(log.read_text()):
        counts = [int(n) for n in counts.split(", ")]
        assert ran.setdefault(int(replica), counts) == counts, (replica, ran, counts)
    return ran


def test_groups_of_unequal_speed_accumulate_until_ready_exactly(tmp_path: Path, monkeypatch) -> None:
    """2 groups of one replica over 2 FSDP ranks, the second group computing slower
    (tests/titan/unequal_replicas.py), accumulate_until_ready with a cap of 4: the fast group
    runs more micro-batches while the sum over the groups waits for the slow one, both ranks of
    a group the same ones. Replayed by one torchrun of every rank without torchft (each replica
    running what its group ran), every step's gradient norm is the job's."""
    groups, group_size = 2, 2
    # slower than the metrics' and the sums' waits for the slow group let the fast one lead
    monkeypatch.setenv("ACCO_TEST_SLOW_S", "0.5")
    status, runs, _ = _run(tmp_path, monkeypatch, groups, group_size, "acco", split=HSDP,
                           extra=UNTIL_READY, reference=False)  # fmt: skip
    assert status == [0] * groups, (tmp_path / "g1.log").read_text()[-4000:]
    ran = {**_ran(tmp_path / "g0.log"), **_ran(tmp_path / "g1.log")}
    assert sorted(ran) == [0, 1]
    assert all(len(c) == ROUNDS and all(2 <= n <= 4 for n in c) for c in ran.values()), ran
    assert max(ran[0]) > 2, ran  # the fast group filled a wait with micro-batches
    monkeypatch.setenv("ACCO_TEST_REPLAY", json.dumps({"counts": [ran[0], ran[1]],
                                                       "ranks_per_replica": 1}))  # fmt: skip
    reference_args = [*_args("acco", HSDP), "--job.dump_folder", str(tmp_path / "ref"),
                      "--parallelism.data_parallel_replicate_degree", "2", *UNTIL_READY]  # fmt: skip
    assert run_reference(groups, group_size, reference_args, tmp_path, program=TITAN) == 0, (
        (tmp_path / "reference.log").read_text()[-4000:]
    )
    assert _ran(tmp_path / "reference.log") == ran
    reference = _steps(tmp_path / "reference.log")
    for i in range(groups):
        assert sorted(runs[i]) == sorted(reference) == list(range(1, ROUNDS + 1)), i
        for step, (_, norm) in reference.items():
            assert runs[i][step][1] == pytest.approx(norm, rel=1e-4, abs=1e-4), (i, step)


# each group checkpoints every 2 steps into its own folder (replica_<id> under it)
CHECKPOINTS = ("--checkpoint.enable", "--checkpoint.interval", "2",
               "--checkpoint.no-last-save-model-only", "--checkpoint.keep_latest_k", "0")  # fmt: skip


@ON_030
def test_a_lost_group_restarted_heals_and_trains_on_exactly(tmp_path: Path, monkeypatch) -> None:
    """A group SIGKILLed mid-round 3: the survivor keeps its processes and steps on alone, as
    a reference whose ranks of that group contribute nothing from round 3 on. The group comes
    back (its torchrun started again): it takes the live group's state in the round it joins,
    sits that round out, reads its data on to the same position (its own checkpoint from before
    the loss is not loaded over that state), and from then on both groups step as the
    reference's two do. The estimate rounds run 3 micro-batches and the update rounds 2: the
    position is not a round count times a round size (nor in mode auto)."""
    uneven = ("--acco.estimate_microbatches", "3")
    status, runs, reference = _run(tmp_path, monkeypatch, 2, 1, "acco", kill=(1, 3),
                                   restart=True, extra=(*CHECKPOINTS, *uneven),
                                   reference_extra=uneven)  # fmt: skip
    assert status == [0, 0], (tmp_path / "g1_restart.log").read_text()[-4000:]
    # its own checkpoint of step 2, from before it was lost, stays unread
    assert (tmp_path / "g1" / "checkpoint" / "replica_1" / "step-2").is_dir()
    assert "its own checkpoint is not loaded" in (tmp_path / "g1_restart.log").read_text()
    # killed in round 3 (the group's processes, all at once): no step of it logged after that
    assert (tmp_path / "killed_at").read_text() == "3"
    assert runs[1] and max(runs[1]) == 3, runs[1]
    back = runs["g1r"]
    joined = min(back) - 2  # the round it joined in; its first step is the next round's
    assert 4 <= joined <= HOLD_ROUND + 1, back  # it joins the round after its first step's
    assert sorted(back) == list(range(joined + 2, ROUNDS + 1))
    for step, (loss, norm) in reference.items():
        assert runs[0][step][1] == pytest.approx(norm, rel=1e-4, abs=1e-4), step
        if step in back:  # the same update on both groups, and the same data as the reference
            assert back[step][1] == runs[0][step][1], step
            mean = (back[step][0] + runs[0][step][0]) / 2
            assert mean == pytest.approx(loss, abs=5e-5), step


# 2 groups of 2 ranks: the global batch spans the groups (8 sequences per group and round)
FT = ("--fault_tolerance.enable", "--fault_tolerance.group_size", "2",
      "--fault_tolerance.replica_id", "1", "--training.global_batch_size", "16")  # fmt: skip
BAD_FT_CONFIGS = [
    (("--fault_tolerance.semi_sync_method", "diloco"),
     "semi_sync_method = 'diloco' with [acco] enable: that is torchtitan's own training method"),
    (("--fault_tolerance.process_group", "mpi"),
     "[fault_tolerance] process_group = 'mpi': use 'gloo' or 'nccl'"),
    (("--fault_tolerance.replica_id", "2"),
     "[fault_tolerance] replica_id = 2, group_size = 2: set group_size to the number of"),
    (("--acco.accumulate_until_ready",),
     "[acco] accumulate_until_ready = true with [fault_tolerance] enable needs [acco] "
     "max_microbatches_per_round"),
]  # fmt: skip


@ON_030
@pytest.mark.parametrize("override, message", BAD_FT_CONFIGS)
def test_a_bad_fault_tolerance_config_is_refused_by_name(override, message, monkeypatch) -> None:
    from tests.titan.test_trainer import read_and_validate

    monkeypatch.setenv("WORLD_SIZE", "2")
    job = read_and_validate("debug_cpu_acco.toml", *FT)  # accepted as shipped, and in auto
    assert job.fault_tolerance.enable and job.fault_tolerance.replica_id == 1
    auto = ("--acco.mode", "auto", "--training.global_batch_size", "32")  # 2 per update
    assert read_and_validate("debug_cpu_acco.toml", *FT, *auto).acco.mode == "auto"
    with pytest.raises(ValueError) as refusal:
        read_and_validate("debug_cpu_acco.toml", *FT, *override)
    assert message in str(refusal.value)


@ON_030
def test_without_torchft_the_refusal_names_the_extra(monkeypatch) -> None:
    """torchft is an extra: a job that enables [fault_tolerance] without it is refused before
    anything is built, naming what to install."""
    import sys

    from tests.titan.test_trainer import read_and_validate

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setitem(sys.modules, "torchft", None)  # as if not installed
    with pytest.raises(ValueError, match=r"needs torchft: pip install 'acco_hooks\[ft\]'"):
        read_and_validate("debug_cpu_acco.toml", *FT)


def test_the_whole_job_resumes_from_each_groups_checkpoint_exactly(
    tmp_path: Path, monkeypatch
) -> None:  # fmt: skip
    """Every group (2 pipeline stages) checkpoints into its own folder; the whole job started
    again from step 4 (the later checkpoints removed) goes on as the straight run: each group
    loads its own, and torchft's step follows the loaded round, so the groups meet in the same
    round."""
    straight = _run(tmp_path / "straight", monkeypatch, 2, 2, "acco", split=PP,
                    extra=CHECKPOINTS, reference=False)[1]  # fmt: skip
    for i in range(2):
        folder = tmp_path / "straight" / f"g{i}" / "checkpoint" / f"replica_{i}"
        assert sorted(p.name for p in folder.iterdir()) == [f"step-{s}" for s in (10, 2, 4, 6, 8)]
        for step in (6, 8, 10):
            shutil.rmtree(folder / f"step-{step}")
        shutil.copytree(tmp_path / "straight" / f"g{i}", tmp_path / "resumed" / f"g{i}")
    status, resumed, _ = _run(tmp_path / "resumed", monkeypatch, 2, 2, "acco", split=PP,
                              extra=CHECKPOINTS, reference=False)  # fmt: skip
    assert status == [0, 0], (tmp_path / "resumed" / "g0.log").read_text()[-4000:]
    for i in range(2):
        assert sorted(resumed[i]) == list(range(5, ROUNDS + 1)), i
        for step, (loss, norm) in resumed[i].items():
            assert loss == straight[i][step][0], (i, step)
            if step > 5:  # a resumed run's first step prints no norm yet (-1)
                assert norm == straight[i][step][1], (i, step)
    log = (tmp_path / "resumed" / "g0.log").read_text()
    assert re.search(r"step: 5, world_size: \d", log)  # torchft's step: the loaded round's
