"""The DiLoCo comparison's arms run, and its launcher leaves nothing behind.

``benchmarks/diloco.py`` (the netbed part needs root: not run here): torchft's DiLoCo through
torchtitan's fault-tolerant trainer, lighthouse included, trains and is scored on the
synchronized model; a job whose process fails, or that is interrupted, leaves no process; the
time to a target loss is the updates to it (linear between held-out points) times the seconds
per update; with one replica slowed (each replica one rank, or two on its host's core), the
slow factor reaches that replica alone, for the whole run or a window of steps (a straggler
that recovers), and the heterogeneous table takes acco_until_ready's time from its own run
and a waiting arm's from its timings slowed and not.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from benchmarks import diloco
from benchmarks.harness import ROOT


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by a parent that is gone) counts as ended
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ", 1)[1][0] != "Z"


def _lighthouses() -> set[int]:
    found = subprocess.run(["pgrep", "-f", "torchft_lighthouse"], capture_output=True, text=True,
                           check=False)  # status 1: none
    return {int(pid) for pid in found.stdout.split()}


def test_the_diloco_arm_trains_and_is_scored_on_the_synchronized_model() -> None:
    before = _lighthouses()
    run = diloco.Run("diloco_h5", lr=8e-4, seed=0, outer_lr=0.4)
    record = diloco.train(run, argparse.Namespace(updates=10, heldout_every=5,
                                                  sequences_per_update=diloco.UPDATE_BATCH))
    assert record["returncode"] == 0 and record["complete"], record["log"]
    assert record["heldout_updates"] == [1, 5, 10]
    per_replica = record["heldout_loss_per_replica"]  # each group scores its half of the set
    assert len(per_replica) == 2 and all(len(losses) == 3 for losses in per_replica)
    assert record["heldout_loss"] == pytest.approx([sum(p) / 2 for p in zip(*per_replica)])
    assert record["heldout_loss"][-1] < record["heldout_loss"][0] - 0.25  # it learns
    log = pathlib.Path(record["log"]).read_text()
    assert "DiLoCo's outer lr 0.4 (torchtitan builds it at 0.7)" in log
    # the held-out points after the first are sync steps: both groups then hold one model
    assert "Syncing fragment=0 step=5" in log and log.count("should_commit=True") == 2
    assert _lighthouses() == before  # the lighthouse went with the job


@pytest.mark.parametrize(("sequences", "per_round"), [(16, 1), (32, 2)])
def test_an_acco_round_holds_the_micro_batches_its_window_needs(
    tmp_path, sequences: int, per_round: int
) -> None:  # fmt: skip
    """Every arm runs the same sequences per update; acco's update is two torchtitan steps, so
    at 32 sequences (ACCO's window) each of its rounds holds two micro-batches per replica."""
    for name, arm in diloco.ARMS.items():
        run = diloco.Run(name, 1e-3, 0)
        argv = diloco.job_argv(name, run, 4, tmp_path, sequences_per_update=sequences)
        per_step = int(argv[argv.index("--training.global_batch_size") + 1])
        assert per_step * arm.rounds_per_update == sequences, name
    acco = diloco.job_argv("acco", diloco.Run("acco", 1e-3, 0), 4, tmp_path,
                           sequences_per_update=sequences)  # fmt: skip
    per_step = int(acco[acco.index("--training.global_batch_size") + 1])
    assert per_step // (2 * diloco.LOCAL_BATCH) == per_round  # 2 replicas


def _job(tmp_path: pathlib.Path, code: str) -> list[str]:
    """A stand-in for a group's command: ``code`` runs with ``host`` (the replica id, the last
    argument the launcher adds) and writes its pid to ``tmp_path/pid<host>``."""
    pid_file = f"os.path.join({str(tmp_path)!r}, 'pid' + host)"
    prologue = (f"import os, sys, time; host = sys.argv[-1]; "
                f"open({pid_file}, 'w').write(str(os.getpid())); ")
    return [sys.executable, "-c", prologue + code]


def test_a_failed_group_ends_the_job_at_once_and_leaves_no_process(tmp_path) -> None:
    argv = _job(tmp_path, "time.sleep(0.5); sys.exit(3) if host == '0' else time.sleep(300)")
    before = _lighthouses()
    start = time.monotonic()
    status, _ = diloco.launch_job(diloco.ARMS["diloco_h5"], argv, {}, diloco.Place(), tmp_path,
                                  timeout_s=120)  # fmt: skip
    assert status == 3 and time.monotonic() - start < 30
    assert not _alive(int((tmp_path / "pid1").read_text()))  # its peer, killed
    assert _lighthouses() == before


@pytest.mark.parametrize("layout", ["rank", "fsdp"])
@pytest.mark.parametrize("arm", ["ddp", "streaming_diloco_h20"])
def test_the_slow_factor_reaches_replica_1_alone(tmp_path, arm: str, layout: str) -> None:
    """Replica 1 is host 1: rank 1 of the two-rank arms (ranks 2 and 3 with two ranks a
    replica) and its own torchft group (a world of its own, ranks 0 and 1). Each of its
    processes, and only they, get the slow_rank hook's factor and window, naming their own
    rank; a replica's ranks share its host's core and know each other as local ranks."""
    code = textwrap.dedent(f"""
        import os, sys
        torchft = sys.argv[-2:-1] == ["--fault_tolerance.replica_id"]
        seen = [os.environ.get(k, "-") for k in (
            "ACCO_BENCH_SLOW_FACTOR", "ACCO_BENCH_SLOW_RANK", "ACCO_BENCH_SLOW_STEPS")]
        name = f"rank{{os.environ['RANK']}}" + (f"_group{{sys.argv[-1]}}" if torchft else "")
        open(os.path.join({str(tmp_path)!r}, name), "w").write(" ".join(
            [*seen, os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"],
             os.environ["LOCAL_WORLD_SIZE"]]))
    """)
    status, _ = diloco.launch_job(diloco.ARMS[arm], [sys.executable, "-c", code], {},
                                  diloco.Place(layout=layout), tmp_path, timeout_s=60,
                                  slow_factor=4.0, slow_steps=(5, 9))  # fmt: skip
    assert status == 0
    written = {p.name: p.read_text() for p in tmp_path.glob("rank*")}
    per_host = 1 if layout == "rank" else 2
    expected = {}
    for host in (0, 1):
        for local in range(per_host):
            if diloco.ARMS[arm].diloco:  # a torchft group: a world of its own on its host
                name, rank, world = f"rank{local}_group{host}", local, per_host
            else:
                rank, world = host * per_host + local, 2 * per_host
                name = f"rank{rank}"
            slowed = f"4 {rank} 5:9" if host == 1 else "- - -"
            expected[name] = f"{slowed} {world} {local} {per_host}"
    assert written == expected


def test_the_slow_rank_sleeps_in_its_window_alone(tmp_path) -> None:
    """``ACCO_BENCH_SLOW_STEPS=3:5``: the slow rank's micro-batches of steps 3 and 4 sleep (3x
    its fastest compute), those before and after do not; the micro-batch log says so."""
    code = textwrap.dedent("""
        import time, torch
        from torchtitan.train import Trainer
        def forward_backward_step(self, **kwargs):  # torchtitan's, 20 ms of compute
            time.sleep(0.02)
            return torch.tensor(1.0)
        Trainer.forward_backward_step = forward_backward_step
        import benchmarks.convergence.slow_rank  # patches it, as custom_import does
        class Stub:
            step = 0
        trainer = Stub()
        for trainer.step in range(1, 7):
            Trainer.forward_backward_step(trainer, labels=torch.zeros(1, 8, dtype=torch.long))
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": "1", "ACCO_BENCH_SLOW_RANK": "1",
           "ACCO_BENCH_SLOW_FACTOR": "4", "ACCO_BENCH_SLOW_STEPS": "3:5",
           "ACCO_BENCH_STATS_DIR": str(tmp_path)}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "microbatches_rank1.jsonl").open()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    slept = {row["step"]: row["sleep_s"] for row in rows}
    assert all(slept[step] == 0 for step in (1, 2, 5, 6)), slept
    assert all(slept[step] >= 3 * 0.02 for step in (3, 4)), slept


def test_every_layout_scores_the_held_out_batches_of_one_rank_a_replica() -> None:
    """With ``ACCO_BENCH_HELDOUT_RANKS=2`` a run of 4 data-parallel ranks (two replicas of two
    FSDP ranks) builds each rank's validation data as rank 0 or 1 of 2 would: ranks 0 and 1
    the first block, 2 and 3 the second, so their mean is the 2-rank run's held-out loss; a
    world it does not divide is refused."""
    code = textwrap.dedent("""
        from torchtitan.components import validate
        seen = []
        validate.build_text_validation_dataloader = (
            lambda **kw: seen.append((kw["dp_rank"], kw["dp_world_size"])))
        import benchmarks.convergence.slow_rank  # patches it, as custom_import does
        for rank in range(4):
            validate.build_text_validation_dataloader(dp_world_size=4, dp_rank=rank, job_config=None)
        print(seen)
        validate.build_text_validation_dataloader(dp_world_size=3, dp_rank=0)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ACCO_BENCH_HELDOUT_RANKS": "2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.stdout.strip() == "[(0, 2), (0, 2), (1, 2), (1, 2)]", done.stderr[-3000:]
    assert "ACCO_BENCH_HELDOUT_RANKS=2 must divide the 3 data-parallel ranks" in done.stderr


def test_a_straggler_slows_the_waiting_arms_inside_its_window_alone() -> None:
    """A replica slowed for updates 40-80 of 120: an arm that waits for it takes its slowed
    seconds per update there and its unslowed ones elsewhere; the summary times such an arm
    from its two timing runs, and acco_until_ready from its own run."""
    assert diloco.straggler_seconds(30, (40, 80), 1.0, 3.0) == 30.0
    assert diloco.straggler_seconds(60, (40, 80), 1.0, 3.0) == 60.0 + 20 * 2.0
    assert diloco.straggler_seconds(100, (40, 80), 1.0, 3.0) == 100.0 + 40 * 2.0
    args = argparse.Namespace(updates=120, slow_factors=[2.0], straggler_factors=[4.0])
    assert diloco.slowdowns(args) == {"2x": (2.0, None), "4x_middle_third": (4.0, (40, 80))}
    updates, losses = [1, 30, 60, 90, 120], [8.0, 6.0, 5.0, 4.7, 4.6]
    results = {
        "settings": {"diloco_updates": 0},
        "convergence": {"sync": {"arm": "titan_ddp", "heldout_updates": updates,
                                 "heldout_loss": losses, "updates": 120, "complete": True}},
        "best": {"0": {"titan_ddp": "sync"}},
        "heterogeneous_fsdp": {
            "1x": {"650mbit": {"titan_ddp": {"update_s": 1.0}}},
            "4x": {"650mbit": {"titan_ddp": {"update_s": 3.0}}},
            "4x_middle_third": {"650mbit": {
                "titan_ddp": {"timings": ["1x", "4x"], "slow_updates": [40, 80]},
                "acco_until_ready": {"slow_updates": [40, 80], "runs": {"0": {
                    "heldout_updates": updates, "heldout_loss": [8.0, 5.8, 4.9, 4.65, 4.55],
                    "training_s": {"30": 40.0, "60": 100.0, "90": 120.0, "120": 140.0}}}},
            }},
        },
    }  # fmt: skip
    rows = diloco.heterogeneous_summary(results, [0], "heterogeneous_fsdp")["4x_middle_third"]
    rows = rows["650mbit"]
    # the targets: 4.7 at update 90 (¾ of the run) and 4.6 at 120, each after the whole window
    assert rows["titan_ddp"]["time_to_target_s"][0] == pytest.approx(120 + 40 * 2.0)
    assert rows["titan_ddp"]["time_to_target_3q_s"][0] == pytest.approx(90 + 40 * 2.0)
    assert rows["titan_ddp"]["update_s_unslowed_slowed"] == [1.0, 3.0]
    # 4.6 between 120 s (4.65) and 140 s (4.55); 4.7 between 100 s (4.9) and 120 s (4.65)
    assert rows["acco_until_ready"]["time_to_target_s"][0] == pytest.approx(130.0)
    assert rows["acco_until_ready"]["time_to_target_3q_s"][0] == pytest.approx(116.0)
    results["heterogeneous_fsdp_summary"] = {"4x_middle_third": {"650mbit": rows}}
    table = "\n".join(diloco.heterogeneous_markdown(results, "fsdp"))
    assert "each replica 2 ranks, FSDP inside" in table
    assert ("| 4x_middle_third | 650mbit | 170, 200 | 116, 130 | acco_until_ready, 1.47x before "
            "titan_ddp |") in table


def test_a_layout_is_timed_against_its_own_synchronous_run() -> None:
    """Where the layout's synchronous arm trained unslowed in full, its held-out curve gives
    the layout's targets and the synchronous arms' updates to them (the data-parallel ranks of
    a layout read other sequences than the convergence runs'); DiLoCo keeps its own curve."""
    updates = [1, 30, 60, 90, 120]
    record = lambda arm, losses: {"arm": arm, "heldout_updates": updates,  # noqa: E731
                                  "heldout_loss": losses, "updates": 120, "complete": True}
    results = {
        "settings": {"diloco_updates": 0},
        "convergence": {"sync": record("titan_ddp", [8.0, 6.0, 5.0, 4.7, 4.6]),
                        "ddp": record("ddp", [8.0, 6.0, 5.0, 4.7, 4.6]),
                        "sd": record("streaming_diloco_h20", [8.0, 6.5, 5.5, 4.9, 4.7])},
        "best": {"0": {"titan_ddp": "sync", "ddp": "ddp", "streaming_diloco_h20": "sd"}},
        "layout_runs": {"fsdp": {"0": record("titan_ddp", [8.0, 6.0, 5.0, 4.8, 4.5])}},
        "heterogeneous_fsdp": {"4x": {"650mbit": {
            "ddp": {"update_s": 2.0}, "streaming_diloco_h20": {"update_s": 1.0}}}},
    }  # fmt: skip
    rows = diloco.heterogeneous_summary(results, [0], "heterogeneous_fsdp")["4x"]["650mbit"]
    # the layout's targets: 4.8 at update 90, 4.5 at 120, both reached there by its own curve
    assert rows["ddp"]["time_to_target_3q_s"][0] == pytest.approx(90 * 2.0)
    assert rows["ddp"]["time_to_target_s"][0] == pytest.approx(120 * 2.0)
    assert rows["ddp"]["curve"] == "the layout's synchronous run"
    # DiLoCo's own curve: 4.8 between 4.9 (90) and 4.7 (120); 4.5 never
    assert rows["streaming_diloco_h20"]["time_to_target_3q_s"][0] == pytest.approx(105.0)
    assert rows["streaming_diloco_h20"]["time_to_target_s"][0] is None


def test_a_layouts_jobs_split_each_replica_and_start_from_the_unsharded_weights(
    monkeypatch,
) -> None:  # fmt: skip
    """torchtitan's DDP composes with no other parallelism: under TP the waiting arms are the
    engine's (ddp, auto). Every job splits each replica as its layout says, and a torchtitan
    job starts from the seed's weights as one unsharded process makes them (a DiLoCo group
    initializes itself: it is only timed in a layout)."""
    assert "titan_ddp" not in diloco.layout_arms("tp")
    assert diloco.layout_arms("fsdp") == diloco.HETEROGENEOUS_ARMS
    monkeypatch.setattr(diloco, "seed_checkpoint", lambda seed: pathlib.Path(f"/seed{seed}"))
    argv = diloco.job_argv("acco_until_ready", diloco.Run("acco_until_ready", 1e-3, 3), 4,
                           pathlib.Path("/tmp/x"), layout="tp")  # fmt: skip
    assert argv[-6:] == ["--parallelism.tensor_parallel_degree", "2", "--checkpoint.enable",
                         "--checkpoint.load_only", "--checkpoint.initial_load_path", "/seed3"]
    ft = diloco.job_argv("streaming_diloco_h20", diloco.Run("streaming_diloco_h20", 1e-3, 3), 4,
                         pathlib.Path("/tmp/x"), layout="fsdp")  # fmt: skip
    assert "--parallelism.data_parallel_shard_degree" in ft and "--checkpoint.enable" not in ft
    plain = diloco.job_argv("acco", diloco.Run("acco", 1e-3, 3), 4, pathlib.Path("/tmp/x"))
    assert "--checkpoint.enable" not in plain  # one rank a replica: as the convergence runs


def test_ctrl_c_ends_every_process_of_the_job(tmp_path) -> None:
    argv = _job(tmp_path, "time.sleep(300)")
    driver = textwrap.dedent(f"""
        import signal
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as the benchmark's main
        from benchmarks import diloco
        diloco.launch_job(diloco.ARMS["diloco_h5"], {argv!r}, {{}}, diloco.Place(),
                          __import__("pathlib").Path({str(tmp_path)!r}), timeout_s=300)
    """)
    before = _lighthouses()
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=ROOT)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"pid{h}").exists() for h in (0, 1)):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    assert len(_lighthouses() - before) == 1
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) != 0
    assert not any(_alive(int((tmp_path / f"pid{h}").read_text())) for h in (0, 1))
    assert _lighthouses() == before


def test_the_time_to_a_loss_is_the_updates_to_it_times_the_seconds_per_update() -> None:
    updates, losses = [1, 20, 40, 60, 80], [8.0, 6.0, 5.0, 4.7, 4.6]
    assert diloco.updates_to(updates, losses, 5.5) == pytest.approx(30.0)
    assert diloco.updates_to(updates, losses, 4.6) == 80.0
    assert diloco.updates_to(updates, losses, 4.5) is None

    def record(arm: str, curve: list[float], at: list[int] = updates) -> dict:
        return {"arm": arm, "lr": 1e-3, "outer_lr": None, "heldout_updates": at,
                "heldout_loss": curve, "updates": at[-1],
                "complete": True}

    results = {
        "settings": {"diloco_updates": 160},
        "convergence": {
            "sync": record("titan_ddp", losses),
            "local": record("diloco_h5", [8.0, 6.2, 5.2, 4.75, 4.55]),
            # H = 20 reaches neither target in the 80 updates; its long run reaches both
            "rare": record("diloco_h20", [8.0, 6.5, 5.6, 5.1, 4.9]),
            "rare/updates160": record("diloco_h20", [8.0, 5.0, 4.8, 4.7, 4.5],
                                      [1, 80, 100, 120, 160]),
        },
        "best": {"0": {"titan_ddp": "sync", "diloco_h5": "local", "diloco_h20": "rare"}},
        "timing": {"50mbit": {"titan_ddp": {"update_s": 4.0, "tokens_per_s": 256.0},
                              "diloco_h5": {"update_s": 1.0, "tokens_per_s": 1024.0},
                              "diloco_h20": {"update_s": 0.5, "tokens_per_s": 2048.0}}},
    }  # fmt: skip
    table = diloco.summary(results, seeds=[0])["50mbit"]
    # the targets: the synchronous arm's final loss (4.6, at 80) and at 3/4 of its run (4.7, at 60)
    assert table["titan_ddp"]["time_to_target_s"] == {0: 320.0}  # 80 updates x 4 s
    assert table["titan_ddp"]["time_to_target_3q_s"] == {0: 240.0}
    # 4.6 between update 60 (4.75) and 80 (4.55): 60 + 20 x 0.15/0.2; 4.7: 60 + 20 x 0.05/0.2
    assert table["diloco_h5"]["updates_to_target"][0] == pytest.approx(75.0)
    assert table["diloco_h5"]["time_to_target_s"][0] == pytest.approx(75.0)
    assert table["diloco_h5"]["updates_to_target_3q"][0] == pytest.approx(65.0)
    assert table["diloco_h20"]["updates_to_target"][0] == pytest.approx(140.0)
    assert table["diloco_h20"]["time_to_target_s"][0] == pytest.approx(70.0)
    assert table["diloco_h20"]["updates_to_target_3q"][0] == pytest.approx(120.0)
    assert table["diloco_h20"]["from_long_run"] == {0: 160}
    assert "diloco_h20, 1.07x before diloco_h5" in "\n".join(diloco.markdown(
        {**results, "summary": {"50mbit": table}}))


def test_with_a_slow_replica_until_ready_is_timed_by_its_own_run() -> None:
    """acco_until_ready's seconds to a target come from its run on the link (training seconds
    per held-out point, linear between them); a synchronous arm's from its unslowed curve
    times its slowed seconds per update."""
    updates, losses = [1, 20, 40, 60, 80], [8.0, 6.0, 5.0, 4.7, 4.6]
    results = {
        "settings": {"diloco_updates": 0},
        "convergence": {"sync": {"arm": "titan_ddp", "heldout_updates": updates,
                                 "heldout_loss": losses, "updates": 80, "complete": True}},
        "best": {"0": {"titan_ddp": "sync"}},
        "heterogeneous": {"4x": {"none": {
            "titan_ddp": {"update_s": 2.0},
            "acco_until_ready": {"runs": {"0": {
                "heldout_updates": updates, "heldout_loss": [8.0, 5.8, 4.9, 4.65, 4.55],
                # JSON keys: the seconds of training to each held-out point after the first
                "training_s": {"20": 10.0, "40": 20.0, "60": 30.0, "80": 40.0}}}},
        }}},
    }  # fmt: skip
    rows = diloco.heterogeneous_summary(results, seeds=[0])["4x"]["none"]
    assert rows["titan_ddp"]["time_to_target_s"] == {0: 160.0}  # 80 updates x 2 s
    assert rows["titan_ddp"]["time_to_target_3q_s"] == {0: 120.0}
    # 4.6 between 30 s (4.65) and 40 s (4.55); 4.7 between 20 s (4.9) and 30 s (4.65)
    assert rows["acco_until_ready"]["time_to_target_s"][0] == pytest.approx(35.0)
    assert rows["acco_until_ready"]["time_to_target_3q_s"][0] == pytest.approx(28.0)
    results["heterogeneous_summary"] = {"4x": {"none": rows}}
    table = "\n".join(diloco.heterogeneous_markdown(results))
    assert "| 4x | none | 120, 160 | 28, 35 | acco_until_ready, 4.29x before titan_ddp |" in table


def test_an_auto_that_chose_another_schedule_on_the_link_is_timed_by_its_run_there() -> None:
    """Where auto's timing run chose another schedule than its loopback runs, its seconds to a
    target and its final loss come from its run on that link; elsewhere from its loopback curve
    times its seconds per update."""
    updates, losses = [1, 20, 40, 60, 80], [8.0, 6.0, 5.0, 4.7, 4.6]
    results = {
        "settings": {"diloco_updates": 0},
        "convergence": {
            "sync": {"arm": "titan_ddp", "heldout_updates": updates, "heldout_loss": losses,
                     "updates": 80, "complete": True},
            "auto": {"arm": "auto", "heldout_updates": updates, "heldout_loss": losses,
                     "updates": 80, "complete": True, "auto_schedule": "synchronous"},
        },
        "best": {"0": {"titan_ddp": "sync", "auto": "auto"}},
        "timing": {
            "none": {"auto": {"update_s": 1.0, "tokens_per_s": 1.0, "auto_schedule": "synchronous"}},
            "650mbit": {"auto": {"update_s": 0.5, "tokens_per_s": 2.0, "auto_schedule": "acco", "runs": {"0": {
                "heldout_updates": updates, "heldout_loss": [8.0, 5.9, 4.9, 4.65, 4.58],
                "training_s": {"20": 10.0, "40": 20.0, "60": 30.0, "80": 40.0}}}}},
        },
    }  # fmt: skip
    table = diloco.summary(results, seeds=[0])
    assert table["none"]["auto"]["time_to_target_s"] == {0: 80.0}  # 80 updates x 1 s
    assert "trained_on_link" not in table["none"]["auto"]
    on_link = table["650mbit"]["auto"]
    assert on_link["trained_on_link"] is True
    assert on_link["heldout_loss_final"] == {0: 4.58}
    # 4.6 between 30 s (4.65) and 40 s (4.58); 4.7 between 20 s (4.9) and 30 s (4.65)
    assert on_link["time_to_target_s"][0] == pytest.approx(30 + 10 * 0.05 / 0.07)
    assert on_link["time_to_target_3q_s"][0] == pytest.approx(28.0)
    assert on_link["updates_to_target_3q"][0] == pytest.approx(56.0)


def test_a_runs_training_seconds_leave_out_its_validations_from_its_logged_steps() -> None:
    """acco logs every 10 steps on a link and is scored after steps 1, 40 and 80 (updates 0,
    20 and 40): a second per step, 5 s per validation. Each held-out point's training time
    counts the steps from the run's start, its validations left out."""
    ts = {1: 0.0, 10: 14.0, 20: 24.0, 30: 34.0, 40: 44.0, 50: 59.0, 60: 69.0, 70: 79.0, 80: 89.0}
    record = {"step": list(ts), "step_ts": list(ts.values()), "heldout_updates": [0, 20, 40],
              "heldout_steps": [1, 40, 80], "heldout_ts": [5.0, 49.0, 94.0]}  # fmt: skip
    assert diloco.training_seconds(record, rounds_per_update=2, from_zero=True) == {
        20: pytest.approx(40.0), 40: pytest.approx(80.0)}
    assert diloco.training_seconds(record, rounds_per_update=2) == {
        20: pytest.approx(39.0), 40: pytest.approx(79.0)}
