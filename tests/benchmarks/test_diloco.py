"""The DiLoCo comparison's arms run, and its launcher leaves nothing behind.

``benchmarks/diloco.py`` (the netbed part needs root: not run here): torchft's DiLoCo through
torchtitan's fault-tolerant trainer, lighthouse included, trains and is scored on the
synchronized model; a job whose process fails, or that is interrupted, leaves no process; the
time to a target loss is the updates to it (linear between held-out points) times the seconds
per update; with one replica slowed, the slow factor reaches that replica alone, and the
heterogeneous table takes acco_until_ready's time from its own run.
"""

from __future__ import annotations

import argparse
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


@pytest.mark.parametrize("arm", ["ddp", "streaming_diloco_h20"])
def test_the_slow_factor_reaches_replica_1_alone(tmp_path, arm: str) -> None:
    """Replica 1 is rank 1 of the two-rank arms and rank 0 of its own torchft group: either way
    its process, and only it, gets the slow_rank hook's factor, naming its own rank."""
    code = textwrap.dedent(f"""
        import os, sys
        torchft = sys.argv[-2:-1] == ["--fault_tolerance.replica_id"]
        replica = sys.argv[-1] if torchft else os.environ["RANK"]
        seen = [os.environ.get(k, "-") for k in ("ACCO_BENCH_SLOW_FACTOR", "ACCO_BENCH_SLOW_RANK")]
        open(os.path.join({str(tmp_path)!r}, "replica" + replica), "w").write(
            " ".join([*seen, os.environ["RANK"]]))
    """)
    status, _ = diloco.launch_job(diloco.ARMS[arm], [sys.executable, "-c", code], {},
                                  diloco.Place(), tmp_path, timeout_s=60, slow_factor=4.0)  # fmt: skip
    assert status == 0
    written = {p.name: p.read_text() for p in tmp_path.glob("replica*")}
    rank1 = "0" if diloco.ARMS[arm].diloco else "1"  # a torchft group is a world of its own
    assert written == {"replica0": "- - 0", "replica1": f"4 {rank1} {rank1}"}


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
