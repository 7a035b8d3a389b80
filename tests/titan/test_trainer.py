"""train_titan.py: ACCO in torchtitan on CPU/gloo, composed with TP and PP, checkpoints.

Every test runs on the installed torchtitan release: 0.2.2 reads the TOMLs itself, 0.3.0 gets
them translated (acco_hooks.titan.toml_compat). CI runs this module on both (``-m titan``).
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import pytest
import torch

from acco_hooks.titan import TITAN_030
from scaffolding import forked_ranks
from tests.titan.conftest import SMALL_MODEL, backend_overrides

pytestmark = pytest.mark.titan
ROOT = pathlib.Path(__file__).parents[2]
STEP_LOSS = re.compile(r"step:\s*(\d+)\s+loss:\s*(-?[\d.]+)\s+grad_norm:\s*(-?[\d.]+)")


def launch_titan(
    nproc: int, config: str, *overrides: str, dump: pathlib.Path, env: dict | None = None
) -> tuple[int, str]:
    """Run train_titan.py on ``nproc`` CPU processes; return its exit status and output.

    On a CPU the ranks are forked from a process that imported torchtitan once
    (``scaffolding.forked_ranks``), with the variables torchrun gives its workers: the tests
    whose subject is torchrun's launch itself (its agent, its output) run torchrun, as does
    every job on a GPU (``tests/test_cuda.py``).
    """
    argv = [str(ROOT / "train_titan.py"), "--job.config_file", str(ROOT / "torchtitan_configs" / config),
            "--job.dump_folder", str(dump), "--metrics.disable_color_printing",
            *backend_overrides(), *SMALL_MODEL, *overrides]  # fmt: skip
    if torch.cuda.is_available():  # a fork cannot use the CUDA its parent initialized
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", *argv]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})  # fmt: skip
        return proc.returncode, proc.stdout + proc.stderr
    dump.parent.mkdir(parents=True, exist_ok=True)
    fd, log = tempfile.mkstemp(prefix=f"{dump.name}.", suffix=".log", dir=dump.parent)
    os.close(fd)
    status = forked_ranks.run(nproc, argv, pathlib.Path(log), env={**os.environ, **(env or {})},
                              preload=forked_ranks.train_titan_preload())  # fmt: skip
    return status, pathlib.Path(log).read_text()


def run_titan(
    nproc: int, config: str, *overrides: str, dump: pathlib.Path, grad_norms: dict | None = None
) -> dict[int, str]:
    """Run train_titan.py on ``nproc`` CPU processes (:func:`launch_titan`); return
    {step: loss} as printed.

    Losses are compared as printed strings (torchtitan prints 5 decimals), from every rank
    that has one (with PP only the last stage has the loss). ``grad_norms``, if given, receives
    {step: grad_norm}.
    """
    status, output = launch_titan(nproc, config, *overrides, dump=dump,
                                  env={"LOG_RANK": "all"})  # every rank's losses  # fmt: skip
    assert status == 0, output[-6000:]
    losses: dict[int, str] = {}
    for step, loss, grad_norm in STEP_LOSS.findall(output):
        if float(loss) >= 0:
            assert losses.get(int(step), loss) == loss, f"ranks disagree at step {step}"
            losses[int(step)] = loss
            if grad_norms is not None:
                grad_norms[int(step)] = float(grad_norm)
    return losses


def assert_learns(losses: dict[int, str], steps: int) -> None:
    assert sorted(losses) == list(range(1, steps + 1)), losses
    values = [float(losses[s]) for s in sorted(losses)]
    assert all(v == v and v < 20 for v in values)  # finite
    assert sum(values[-3:]) / 3 < values[0] - 0.1, values  # the loss goes down


FAST = ("--optimizer.lr", "3e-3", "--training.seq_len", "64", "--training.local_batch_size", "2")


# 0.2.2 only: 0.3.0 composes TP with its FSDP replicas in test_hsdp_acco_composes_with_tp_and_pp
# and PP in the PP resume and non-finite tests (each launch costs CI tens of seconds)
@pytest.mark.spmd_backends()
def test_acco_composes_with_tp_and_pp(seed_checkpoint, tmp_path) -> None:
    """dp2, dp2 x tp2, dp2 x pp2 and the shipped 3-D debug config (dp2 x tp2 x pp2) from the
    same weights (the seed checkpoint docs/torchtitan.md describes): the same losses and
    gradient norms.

    The gradient norm checks that clipping sees the whole model: summed over the tp and pp
    ranks, with tp-replicated parameters counted once.
    """
    steps = 10
    common = ("--training.steps", str(steps), "--training.global_batch_size", "8", *FAST,
              "--checkpoint.enable", "--checkpoint.load_only",
              "--checkpoint.initial_load_path", str(seed_checkpoint))  # fmt: skip
    layouts = {
        "dp2": (2, "debug_cpu_acco.toml", ()),
        "dp2xtp2": (4, "debug_cpu_acco.toml", ("--parallelism.tensor_parallel_degree", "2")),
        "dp2xpp2": (4, "debug_cpu_acco.toml", ("--parallelism.pipeline_parallel_degree", "2",
                                               "--parallelism.pipeline_parallel_microbatch_size",
                                               "1")),
        "dp2xtp2xpp2": (8, "debug_cpu_acco_3d.toml", ()),
    }  # fmt: skip
    losses, norms = {}, {}
    for name, (nproc, config, layout) in layouts.items():
        norms[name] = {}
        losses[name] = run_titan(nproc, config, *common, *layout,
                                 dump=tmp_path / name, grad_norms=norms[name])  # fmt: skip
        assert_learns(losses[name], steps)
    for name in ("dp2xtp2", "dp2xpp2", "dp2xtp2xpp2"):
        for step in range(1, steps + 1):
            assert float(losses[name][step]) == pytest.approx(float(losses["dp2"][step]), abs=2e-3)
            if norms["dp2"][step] > 0:
                assert norms[name][step] == pytest.approx(norms["dp2"][step], rel=5e-3), (name, step)


@pytest.mark.spmd_backends()  # the trainer's loop, which both releases share: 0.2.2 only
def test_auto_mode_takes_one_step_per_update_and_starts_synchronous(tmp_path) -> None:
    """``[acco] mode = "auto"``: a torchtitan step is one real update of torchtitan's gradient
    accumulation steps, as in ``ddp``; while it measures (its first 5 updates) it runs the
    synchronous schedule, so its losses are the engine's ddp mode's."""
    common = ("--training.steps", "8", *FAST)
    auto = run_titan(2, "debug_cpu_ddp.toml", "--acco.mode", "auto", *common, dump=tmp_path / "auto")
    ddp = run_titan(2, "debug_cpu_ddp.toml", *common, dump=tmp_path / "ddp")
    assert sorted(auto) == sorted(ddp) == list(range(1, 9))
    assert [auto[s] for s in range(1, 6)] == [ddp[s] for s in range(1, 6)]
    assert float(auto[8]) < float(auto[1])


@pytest.mark.spmd_backends()  # the engine over one rank, which both releases build alike
def test_one_replica_ddp_mode_equals_torchtitan_without_acco(tmp_path) -> None:
    """``data_parallel_replicate_degree = 1`` (one GPU): the engine runs its rounds over the
    rank alone. Its synchronous mode trains as torchtitan's own single-process run, clipping
    included; acco mode runs too (what the one-GPU overhead benchmark compares)."""
    common = ("--training.steps", "4", *FAST, "--training.global_batch_size", "4",
              "--parallelism.data_parallel_replicate_degree", "1")  # fmt: skip
    our_norms, their_norms = {}, {}
    ours = run_titan(1, "debug_cpu_acco.toml", *common, "--acco.mode", "ddp",
                     dump=tmp_path / "engine", grad_norms=our_norms)  # fmt: skip
    theirs = run_titan(1, "debug_cpu_acco.toml", *common, "--acco.no-enable",
                       dump=tmp_path / "titan", grad_norms=their_norms)  # fmt: skip
    assert sorted(ours) == [1, 2, 3, 4]
    assert ours[1] == theirs[1]  # same initial weights and data
    for step in (2, 3, 4):  # the engine's clipping and flat-shard update round differently
        assert float(ours[step]) == pytest.approx(float(theirs[step]), abs=2e-5)
    for step in ours:  # the engine's norm sums in float64 over its flat shard
        assert our_norms[step] == pytest.approx(their_norms[step], rel=1e-3)
    acco = run_titan(1, "debug_cpu_acco.toml", *common, "--acco.mode", "acco",
                     dump=tmp_path / "acco")  # fmt: skip
    assert acco[1] == ours[1] and acco[4] != ours[4]  # same start, its own recursion


@pytest.mark.spmd_backends("spmd_types")  # both resume in test_hsdp_acco_equals_..._and_resumes
@pytest.mark.parametrize("mode, async_mode", [
    # a plain save: the mode is the engine's, not the release's: 0.2.2 only
    pytest.param("dpu", "disabled", marks=pytest.mark.spmd_backends()),
    ("acco", "async"),  # the save that races the next steps; acco's plain save: the next tests
])  # fmt: skip
def test_checkpoint_resume_continues_exactly_past_an_interrupted_save(
    mode: str, async_mode: str, tmp_path
) -> None:
    """Checkpoints at steps 3, 6 and 8; a crash while steps 6 and 8 were being saved leaves them
    without .metadata (DCP writes it last): the resumed run takes step 3, where acco has an
    estimate in flight and its gradient carried, and continues exactly as the straight run.
    With torchtitan's ``async_mode = "async"`` the save runs beside the next steps, which
    rewrite the engine's buffers: the checkpoint must still be the state of its step."""
    common = ("--acco.mode", mode, "--checkpoint.async_mode", async_mode,
              "--training.steps", "8", *FAST,
              "--training.global_batch_size", "8", "--checkpoint.enable",
              "--checkpoint.interval", "3", "--checkpoint.no-last-save-model-only",
              "--checkpoint.keep_latest_k", "0")  # fmt: skip
    straight = run_titan(2, "debug_cpu_acco.toml", *common, dump=tmp_path)
    for step in (6, 8):
        (tmp_path / "checkpoint" / f"step-{step}" / ".metadata").unlink()
    resumed = run_titan(2, "debug_cpu_acco.toml", *common, dump=tmp_path)
    assert sorted(resumed) == [4, 5, 6, 7, 8]
    assert {s: straight[s] for s in resumed} == resumed


@pytest.mark.spmd_backends()  # 0.3.0's resharded resume: the next test (HSDP, more replicas)
def test_a_four_replica_checkpoint_resumes_on_two_and_the_loss_goes_on(tmp_path) -> None:
    """torchtitan's checkpointer, ``data_parallel_replicate_degree = -1`` and a fixed global
    batch: saved at step 4 by 4 replicas (1 micro-batch each per round), resumed on 2 (2 each).
    The engine's state reshards and the data loader goes on from what was read (a position
    re-derived, not the same samples: the losses follow the straight run, not equal it)."""
    common = ("--parallelism.data_parallel_replicate_degree", "-1", "--acco.mode", "acco",
              "--training.steps", "8", *FAST, "--training.global_batch_size", "8",
              "--checkpoint.enable", "--checkpoint.interval", "4",
              "--checkpoint.no-last-save-model-only", "--checkpoint.keep_latest_k", "0",
              "--model.flavor", "debugmodel")  # the margins below are the debug model's  # fmt: skip
    straight = run_titan(4, "debug_cpu_acco.toml", *common, dump=tmp_path)
    (tmp_path / "checkpoint" / "step-8" / ".metadata").unlink()
    resumed = run_titan(2, "debug_cpu_acco.toml", *common, dump=tmp_path)
    assert sorted(resumed) == [5, 6, 7, 8]
    after = [float(resumed[s]) for s in resumed]
    # a run that lost the state would start near a fresh model's loss again (8.17; step 4: 7.97)
    assert max(after) < float(straight[1]) - 0.4, (straight, resumed)
    # and it goes on as the straight run does, on other samples: the same mean over steps 5-8
    straight_mean = sum(float(straight[s]) for s in resumed) / len(resumed)
    assert abs(sum(after) / len(after) - straight_mean) < 0.15, (straight, resumed)


# 0.2.2 only: the resharding is the engine's (tests/engine/test_resharding.py); 0.3.0's HSDP
# checkpoint resumes in test_hsdp_acco_equals_acco_over_pure_data_parallelism_and_resumes
@pytest.mark.spmd_backends()
def test_an_hsdp_checkpoint_resumes_on_more_replicas_without_fsdp(tmp_path) -> None:
    """torchtitan's checkpointer, ``data_parallel_replicate_degree = -1`` and a fixed global
    batch: saved at step 4 by 2 replicas that FSDP shards 2 ways, resumed by 4 replicas without
    FSDP. Both have 4 data-parallel ranks, so each reads on from its own loader state, and the
    average over them is the same gradient: the engine's state, resharded from ranges of FSDP
    pieces onto replica shards, continues the saved run (to float order; another number of
    data-parallel ranks re-derives the loader positions: the elastic agent's test below)."""
    common = ("--acco.mode", "acco", "--training.steps", "8", *FAST,
              "--training.global_batch_size", "8", "--checkpoint.enable",
              "--checkpoint.interval", "4", "--checkpoint.no-last-save-model-only",
              "--checkpoint.keep_latest_k", "0")  # fmt: skip
    straight = run_titan(4, "debug_cpu_acco.toml", *common,
                         "--parallelism.data_parallel_replicate_degree", "2",
                         "--parallelism.data_parallel_shard_degree", "2", dump=tmp_path)
    (tmp_path / "checkpoint" / "step-8" / ".metadata").unlink()
    resumed = run_titan(4, "debug_cpu_acco.toml", *common,
                        "--parallelism.data_parallel_replicate_degree", "-1", dump=tmp_path)
    assert sorted(resumed) == [5, 6, 7, 8]
    for step, loss in resumed.items():
        assert abs(float(loss) - float(straight[step])) < 1e-3, (step, straight, resumed)
    # a run that lost the optimizer state would take other updates: its losses move by > 1e-2
    # (on the tests' model this run goes from 8.15 to 7.79)
    assert float(straight[8]) < float(straight[1]) - 0.25


# 0.2.2 only: the subject is train_titan.py's exit and torchrun's agent, not the release (each
# release's resume on another replica count: test_a_four_replica_checkpoint_resumes_on_two_...)
@pytest.mark.spmd_backends()
def test_under_the_elastic_agent_a_killed_node_leaves_a_job_that_finishes(tmp_path) -> None:
    """train_titan.py on two torchrun agents × 2 ranks (replicas = -1, a fixed global batch),
    one SIGKILLed after the checkpoint of step 4: the survivor's agent restarts its workers on 2
    replicas, they resume from the newest checkpoint and train to the last step (rc 0)."""
    from benchmarks.elastic_recovery import (
        agent_command,
        free_port,
        kill_node,
        start_agent,
        wait_for_checkpoint,
        wait_for_port,
    )  # fmt: skip

    dump, port = tmp_path / "dump", free_port()
    command = agent_command(port, [
        str(ROOT / "train_titan.py"), "--job.config_file",
        str(ROOT / "torchtitan_configs" / "debug_cpu_acco.toml"), "--job.dump_folder", str(dump),
        "--metrics.disable_color_printing", *backend_overrides(), *SMALL_MODEL,
        "--parallelism.data_parallel_replicate_degree", "-1", "--training.steps", "16", *FAST,
        "--training.global_batch_size", "8", "--checkpoint.enable", "--checkpoint.interval", "4",
    ])  # fmt: skip
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    survivor, doomed = start_agent(command, logs[0]), None
    try:
        wait_for_port(port, survivor)  # the first agent hosts the rendezvous store: it survives
        doomed = start_agent(command, logs[1])
        wait_for_checkpoint(dump / "checkpoint" / "step-4", [survivor, doomed], logs[0])
        kill_node(doomed)
        try:
            rc = survivor.wait(timeout=400)
        except subprocess.TimeoutExpired:
            rc = "still running after 400 s"
    finally:
        for agent in (survivor, doomed):
            if agent is not None and agent.poll() is None:
                kill_node(agent)
    output = logs[0].read_text()
    assert rc == 0, output[-5000:]
    # the engine was built twice: on 4 replicas, then on the 2 that were left
    assert re.findall(r"world_size=(\d+) fsdp_world_size", output) == ["4", "2"], output[-3000:]
    after_restart = output.rsplit("fsdp_world_size", 1)[1]  # the second engine's settings line
    resumed = [int(step) for step, _, _ in STEP_LOSS.findall(after_restart)]
    assert resumed[0] in (5, 9, 13) and resumed[-1] == 16, resumed  # from a checkpoint, to the end
    # each survivor rank that got to say it (the agent may stop one first): one line naming the
    # checkpoint the restarted workers did resume from, and no traceback
    lines = re.findall(r"acco_hooks: rank \d: lost a peer \(.+\); the elastic agent restarts the "
                       r"workers \(restart 1 of 3\), which resume from (\S+)\n", output)  # fmt: skip
    assert 1 <= len(lines) <= 2, output[-3000:]
    assert {pathlib.Path(line).name for line in lines} == {f"step-{resumed[0] - 1}"}, lines
    assert "Traceback" not in output, output[-5000:]


class LoaderOfSamples:
    """A torchtitan-shaped data loader (``dp_rank_N`` keyed state) over a dataset whose state
    is ``dataset_state`` as in ``StatefulDataLoader``."""

    def __init__(self, dp_rank: int, dp_world_size: int, dataset_state: dict) -> None:
        self.dp_rank, self.dp_world_size, self.dataset_state = dp_rank, dp_world_size, dataset_state
        self.loaded: dict | None = None

    def state_dict(self) -> dict:
        return {f"dp_rank_{self.dp_rank}": pickle.dumps({"_num_yielded": 0,
                                                         "dataset_state": self.dataset_state}),
                "world_size": self.dp_world_size}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        assert state["world_size"] == self.dp_world_size  # torchtitan's own check
        self.loaded = pickle.loads(state[f"dp_rank_{self.dp_rank}"])["dataset_state"]


def saved_by_four(dataset_states: list[dict]) -> dict:
    return {"world_size": 4, "states": pickle.dumps([pickle.dumps({"dataset_state": d})
                                                     for d in dataset_states])}  # fmt: skip


@pytest.mark.spmd_backends("spmd_types")  # no launch: backend-free
def test_the_loader_position_is_what_the_saved_ranks_read_split_over_the_new_ones() -> None:
    from acco_hooks.titan.dataloader import ReshardableLoaderState

    saved = saved_by_four([{"sample_idx": n, "token_buffer": [7] * n} for n in (3, 5, 4, 4)])
    for rank in (0, 1):  # 16 samples read: each of 2 ranks starts 8 into its block
        loader = LoaderOfSamples(rank, 2, {"sample_idx": 0, "token_buffer": []})
        ReshardableLoaderState(loader).load_state_dict(saved)
        assert loader.loaded == {"sample_idx": 8, "token_buffer": []}
    same = LoaderOfSamples(2, 4, {"sample_idx": 0, "token_buffer": []})
    ReshardableLoaderState(same).load_state_dict(saved)  # the same world: its own state, as is
    assert same.loaded == {"sample_idx": 4, "token_buffer": [7] * 4}


@pytest.mark.spmd_backends("spmd_types")  # no launch: backend-free
def test_a_streamed_dataset_on_another_replica_count_is_refused_by_name() -> None:
    from acco_hooks.titan.dataloader import ReshardableLoaderState

    loader = LoaderOfSamples(0, 2, {"data": {"shard": 0}, "token_buffer": []})
    with pytest.raises(ValueError, match=r"saved by 4 data-parallel ranks, this run has 2, and "
                                         r"the loader's state holds no sample position .* "
                                         r"Resume with 4 data-parallel ranks"):  # fmt: skip
        ReshardableLoaderState(loader).load_state_dict(
            saved_by_four([{"data": {"shard": r}, "token_buffer": []} for r in range(4)])
        )
    assert loader.loaded is None  # nothing loaded


HSDP = ("--training.global_batch_size", "16", *FAST, "--checkpoint.enable")  # 2 micro-batches


@pytest.fixture(scope="module")
def hsdp_acco(seed_checkpoint, spmd_backend, tmp_path_factory) -> tuple[tuple[str, ...], pathlib.Path, dict, dict]:
    """ACCO on 2 replicas x 2 FSDP shards, 6 steps, checkpoints every 3: (args, dump, losses, norms)."""
    common = (*HSDP, "--training.steps", "6", "--checkpoint.interval", "3",
              "--checkpoint.no-last-save-model-only", "--checkpoint.keep_latest_k", "0",
              "--checkpoint.initial_load_path", str(seed_checkpoint))  # fmt: skip
    dump, norms = tmp_path_factory.mktemp("hsdp"), {}
    losses = run_titan(4, "debug_cpu_hsdp_acco.toml", *common, dump=dump, grad_norms=norms)
    assert sorted(losses) == list(range(1, 7))
    return common, dump, losses, norms


def assert_same_run(losses: dict, norms: dict, expected_losses: dict, expected_norms: dict) -> None:
    """Same losses at every step; same gradient norms but at the last step of ``losses``, whose
    norm is that of the round the final flush() waited for (a run's end changes it)."""
    for step in losses:
        assert float(losses[step]) == pytest.approx(float(expected_losses[step]), abs=2e-4), step
        if step < max(losses):
            assert norms[step] == pytest.approx(expected_norms[step], rel=1e-3, abs=1e-6), step


def test_hsdp_acco_equals_acco_over_pure_data_parallelism_and_resumes(hsdp_acco, tmp_path) -> None:
    """The spec's averaged gradient over 4 workers does not depend on how they are grouped:
    ACCO over 2 FSDP-sharded replicas equals ACCO over 4 plain replicas, step for step (same
    weights, same data per rank). A DCP checkpoint of the HSDP run resumes exactly."""
    common, dump, hsdp, norms_hsdp = hsdp_acco
    norms_dp = {}
    pure_dp = run_titan(4, "debug_cpu_acco.toml", *common,
                        "--parallelism.data_parallel_replicate_degree", "4",
                        dump=tmp_path / "dp4", grad_norms=norms_dp)  # fmt: skip
    assert sorted(pure_dp) == list(range(1, 7))
    assert_same_run(hsdp, norms_hsdp, pure_dp, norms_dp)
    # Resume from step 3 (an estimate in flight, its gradient carried).
    resumed = run_titan(4, "debug_cpu_hsdp_acco.toml", *common, "--checkpoint.load_step", "3",
                        dump=dump)  # fmt: skip
    assert resumed == {s: hsdp[s] for s in (4, 5, 6)}


@pytest.mark.spmd_backends("spmd_types")  # the default backend: TP's composition with FSDP
@pytest.mark.parametrize("layout", [
    ("--parallelism.tensor_parallel_degree", "2"),
    # PP with HSDP on 0.2.2; 0.3.0's PP: the PP resume and the non-finite gradient tests
    pytest.param(("--parallelism.pipeline_parallel_degree", "2",
                  "--parallelism.pipeline_parallel_microbatch_size", "1"),
                 marks=pytest.mark.spmd_backends()),
], ids=["dp_replicate2xfsdp2xtp2", "pp2xdp_replicate2xfsdp2"])  # fmt: skip
def test_hsdp_acco_composes_with_tp_and_pp(hsdp_acco, seed_checkpoint, layout, tmp_path) -> None:
    """8 processes: adding TP or PP to the 2 x 2 HSDP run changes nothing in the first steps."""
    _, _, hsdp, norms_hsdp = hsdp_acco
    norms = {}
    losses = run_titan(8, "debug_cpu_hsdp_acco.toml", *HSDP, "--training.steps", "4",
                       "--checkpoint.load_only", "--checkpoint.initial_load_path",
                       str(seed_checkpoint), *layout, dump=tmp_path, grad_norms=norms)  # fmt: skip
    assert sorted(losses) == [1, 2, 3, 4]
    assert_same_run(losses, norms, hsdp, norms_hsdp)


UNEQUAL = re.compile(r"unequal replicas: rank (\d+) replica (\d+) counts \[([\d, ]*)\]")


def run_unequal_replicas(nproc: int, *overrides: str, dump: pathlib.Path,
                         replay: dict | None = None) -> tuple[dict[int, list[int]], dict, dict]:  # fmt: skip
    """A run with tests/titan/unequal_replicas.py imported: ({replica: its micro-batches per
    step}, {step: loss}, {step: grad_norm}), the ranks of each replica checked to agree."""
    status, output = launch_titan(
        nproc, "debug_cpu_acco.toml", *overrides,
        "--experimental.custom_import", "tests.titan.unequal_replicas", dump=dump,
        env={"LOG_RANK": "all", **({"ACCO_TEST_REPLAY": json.dumps(replay)} if replay else {})},
    )  # fmt: skip
    assert status == 0, output[-6000:]
    reports = UNEQUAL.findall(output)
    assert sorted(int(rank) for rank, *_ in reports) == list(range(nproc)), output[-3000:]
    by_replica: dict[int, set[tuple[int, ...]]] = {}
    for _, replica, counts in reports:
        by_replica.setdefault(int(replica), set()).add(tuple(map(int, counts.split(", "))))
    assert all(len(seen) == 1 for seen in by_replica.values()), by_replica  # its ranks agree
    losses, norms = {}, {}
    for step, loss, norm in STEP_LOSS.findall(output):
        if float(loss) >= 0:  # under PP the last stage's
            assert losses.setdefault(int(step), loss) == loss, f"ranks disagree at step {step}"
            norms[int(step)] = float(norm)
    return {r: list(next(iter(seen))) for r, seen in by_replica.items()}, losses, norms


@pytest.mark.spmd_backends("spmd_types")  # the trainer's loop and the engine's groups
@pytest.mark.parametrize(("ranks", "shards", "layout"), [
    (4, 2, ("--parallelism.data_parallel_shard_degree", "2")),
    # TP on 0.2.2 only: both releases split a replica's matrices alike (3-D below runs TP on both)
    pytest.param(4, 1, ("--parallelism.tensor_parallel_degree", "2"),
                 marks=pytest.mark.spmd_backends()),
    # a zero-bubble schedule: two stages a rank, the weight pass writing .grad itself (3-D
    # below runs Interleaved1F1B, the schedule of llama3_8b_acco_3d.toml)
    (4, 1, ("--parallelism.pipeline_parallel_degree", "2",
            "--parallelism.pipeline_parallel_microbatch_size", "1",
            "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble")),
    (8, 1, ("--parallelism.tensor_parallel_degree", "2", "--parallelism.pipeline_parallel_degree",
            "2", "--parallelism.pipeline_parallel_microbatch_size", "1",
            "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B")),
], ids=["dp_replicate2xfsdp2", "dp_replicate2xtp2", "pp2_zbv_xdp_replicate2",
       "pp2_interleaved_xdp_replicate2xtp2"])  # fmt: skip
def test_replicas_of_several_ranks_and_unequal_speed_accumulate_until_ready_exactly(
    ranks: int, shards: int, layout: tuple[str, ...], seed_checkpoint, tmp_path
) -> None:  # fmt: skip
    """accumulate_until_ready where FSDP, tensor or pipeline parallelism, or both of the last
    (3-D), split each of 2 replicas over 2 or 4 ranks, the second replica computing slower
    (tests/titan/unequal_replicas.py): while the slow replica's round keeps the fast one's
    communication in flight, the fast replica runs more micro-batches (2 a round, up to 4),
    every rank of a replica the same ones in every round. Replayed in plain data parallelism
    (one rank per data-parallel rank, each running the micro-batches its replica ran) from the
    same weights, the run gives the same losses and gradient norms. Without the replica's
    agreement its ranks part ways at the first extra micro-batch and the run hangs."""
    steps = 8
    common = (*FAST, "--training.global_batch_size", str(2 * 2 * 2 * shards),
              "--training.steps", str(steps), "--acco.accumulation_steps", "2",
              "--acco.accumulate_until_ready", "--acco.max_microbatches_per_round", "4",
              # a logged step all-reduces the loss over the replicas, putting them back in step
              "--metrics.log_freq", str(steps), "--checkpoint.enable", "--checkpoint.load_only",
              "--checkpoint.initial_load_path", str(seed_checkpoint))  # fmt: skip
    counts, losses, norms = run_unequal_replicas(ranks, *common, *layout, dump=tmp_path / "run")
    assert sorted(counts) == [0, 1]
    assert all(len(c) == steps and all(2 <= n <= 4 for n in c) for c in counts.values()), counts
    assert sum(counts[0]) > 2 * steps, counts  # the fast replica filled waits with micro-batches
    assert sorted(losses) == [1, steps], losses
    replayed, replay_losses, replay_norms = run_unequal_replicas(
        2 * shards, *common, "--parallelism.data_parallel_replicate_degree", str(2 * shards),
        dump=tmp_path / "replay", replay={"counts": [counts[0], counts[1]], "ranks_per_replica": shards},
    )  # fmt: skip
    assert [replayed[d] for d in range(2 * shards)] == [counts[d // shards] for d in range(2 * shards)]
    for step in losses:
        assert float(losses[step]) == pytest.approx(float(replay_losses[step]), abs=2e-3), step
        assert norms[step] == pytest.approx(replay_norms[step], rel=5e-3), step


@pytest.mark.spmd_backends("spmd_types")  # the trainer's checkpoint of both releases
def test_unequal_replicas_resume_exactly_from_a_mid_run_checkpoint(seed_checkpoint, tmp_path) -> None:
    """2 replicas of 2 FSDP ranks, the second slower, accumulate_until_ready: the checkpoint of
    step 4 holds each rank's data position after the micro-batches its replica ran, whatever
    their number. Resumed from it, replaying what each replica ran after it, the run ends as the
    uninterrupted one: the same loss and gradient norm at its last step."""
    steps = 8
    common = (*FAST, "--parallelism.data_parallel_shard_degree", "2",
              "--training.global_batch_size", "16", "--training.steps", str(steps),
              "--acco.accumulation_steps", "2", "--acco.accumulate_until_ready",
              "--acco.max_microbatches_per_round", "4", "--metrics.log_freq", str(steps),
              "--checkpoint.enable", "--checkpoint.initial_load_path", str(seed_checkpoint),
              "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0",
              "--checkpoint.no-last-save-model-only")  # fmt: skip
    counts, losses, norms = run_unequal_replicas(4, *common, dump=tmp_path)
    assert sum(counts[0][4:]) > 8, counts  # the fast replica ran more after the checkpoint too
    (tmp_path / "checkpoint" / f"step-{steps}" / ".metadata").unlink()
    resumed, resumed_losses, resumed_norms = run_unequal_replicas(
        4, *common, dump=tmp_path, replay={"counts": [counts[0], counts[1]], "ranks_per_replica": 1},
    )  # fmt: skip
    assert resumed == {r: c[4:] for r, c in counts.items()}
    assert resumed_losses[steps] == losses[steps]
    assert resumed_norms[steps] == norms[steps]


BAD_ACCO_CONFIGS = [
    (("--acco.mode", "sync"), "[acco] mode = 'sync' is not one of 'acco', 'dpu', 'ddp'"),
    (("--acco.reduce_dtype", "int8"), "[acco] reduce_dtype = 'int8' must be one of"),
    (("--acco.accumulation_steps", "-2"), "[acco] accumulation_steps = -2"),
    (("--parallelism.data_parallel_shard_degree", "2",
      "--parallelism.data_parallel_replicate_degree", "1"),
     "data_parallel_replicate_degree = 1: [acco] enable runs across model replicas; with "
     "data_parallel_shard_degree = 2 set data_parallel_replicate_degree >= 2"),
    (("--training.global_batch_size", "12"),
     "[training] global_batch_size = 12 is not a multiple of local_batch_size × data-parallel "
     "ranks = 4 × 2: set global_batch_size to a multiple of 8, or run 1 or 3 replicas"),
    (("--parallelism.data_parallel_replicate_degree", "-1",
      "--parallelism.data_parallel_shard_degree", "-1"),
     "data_parallel_replicate_degree = -1 and data_parallel_shard_degree = -1: at most one"),
]  # fmt: skip


def read_and_validate(config: str, *overrides: str) -> Any:
    """What train_titan.py does with a TOML job config and its overrides before it builds
    anything: read them (0.3.0: translate them) and validate the ``[acco]`` section. Returns
    the validated config."""
    path = str(ROOT / "torchtitan_configs" / config)
    if TITAN_030:
        from acco_hooks.titan.toml_compat import load_toml_config
        from acco_hooks.titan.v030 import validate_acco_config

        job = load_toml_config(path, [*overrides, *backend_overrides()])
    else:
        from torchtitan.config import ConfigManager

        from acco_hooks.titan.v022 import JobConfig, validate_acco_config

        job = ConfigManager(JobConfig).parse_args(["--job.config_file", path, *overrides])
    validate_acco_config(job)
    return job


@pytest.mark.parametrize("override, message", BAD_ACCO_CONFIGS)
def test_a_bad_acco_config_is_refused_by_name(override, message, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    read_and_validate("debug_cpu_acco.toml")  # the shipped config passes
    with pytest.raises(ValueError) as refusal:
        read_and_validate("debug_cpu_acco.toml", *override)
    assert message in str(refusal.value)


@pytest.mark.parametrize("world_size, shard, replicas", [(4, 1, 4), (4, 2, 2), (6, 2, 3)])
def test_replicate_degree_minus_one_is_what_the_world_size_leaves(
    world_size, shard, replicas, monkeypatch
) -> None:
    """A job that may restart on another number of nodes says -1 replicas; the global batch
    stays, and each round takes what the new world leaves of it."""
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    job = read_and_validate("debug_cpu_acco.toml", "--parallelism.data_parallel_replicate_degree",
                            "-1", "--parallelism.data_parallel_shard_degree", str(shard),
                            "--training.global_batch_size", "48")  # fmt: skip
    assert job.parallelism.data_parallel_replicate_degree == replicas
    with pytest.raises(ValueError, match=r"world size 5 is not a multiple of .* = 2; run on a "
                                         r"multiple of 2 ranks"):
        monkeypatch.setenv("WORLD_SIZE", "5")
        read_and_validate("debug_cpu_acco.toml", "--parallelism.data_parallel_replicate_degree",
                          "-1", "--parallelism.data_parallel_shard_degree", "2")  # fmt: skip


@pytest.mark.spmd_backends("spmd_types")  # a refusal before any layout is built
def test_bad_acco_config_fails_before_the_first_step(tmp_path) -> None:
    """The refusal above, through torchrun and train_titan.py on 2 ranks: one line for the
    job (rank 0's) with the setting, no traceback of the error, a non-zero exit, no step."""
    override, message = BAD_ACCO_CONFIGS[0]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train_titan.py"),
           "--job.config_file", str(ROOT / "torchtitan_configs" / "debug_cpu_acco.toml"),
           "--job.dump_folder", str(tmp_path), *override]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    lines = [line for line in output.splitlines() if message in line]
    assert lines == [f"train_titan: {message}, 'auto'"], output[-3000:]
    assert "SettingError" not in output and "step:" not in output, output[-3000:]


@pytest.mark.spmd_backends()  # the engine's check before any tensor is read: 0.2.2 only
def test_a_checkpoint_of_another_tensor_parallel_degree_is_refused_by_acco(tmp_path) -> None:
    """Saved with tensor parallelism over 2 ranks, resumed on 2 replicas without it: ACCO's own
    error with the fix, not DCP's raw missing key (the data-parallel degrees may change)."""
    common = (*FAST, "--checkpoint.enable", "--checkpoint.interval", "2")
    run_titan(2, "debug_cpu_acco.toml", *common, "--parallelism.data_parallel_replicate_degree",
              "1", "--parallelism.tensor_parallel_degree", "2", "--training.steps", "3",
              "--training.global_batch_size", "4", dump=tmp_path)  # fmt: skip
    shutil.rmtree(tmp_path / "checkpoint" / "step-3")  # the last one holds the model only
    status, output = launch_titan(2, "debug_cpu_acco.toml", *common,
                                  "--parallelism.data_parallel_replicate_degree", "2",
                                  "--training.steps", "4", "--training.global_batch_size", "8",
                                  dump=tmp_path)  # fmt: skip
    assert status != 0
    refusal = [line for line in output.splitlines() if line.startswith("train_titan: ACCO:")]
    assert len(refusal) == 1, output[-3000:]  # one line for the job, from rank 0
    assert "was saved with another tensor or pipeline parallel layout than this run's" in refusal[0]
    assert "resume with the tensor_parallel_degree and pipeline_parallel_degree" in refusal[0]
    assert "Missing key" not in output and "step:" not in output, output[-3000:]
    assert "CheckpointRefusal" not in output, output[-3000:]  # no traceback of it


VALIDATING = ("--validation.enable", "--validation.freq", "2", "--validation.steps", "2",
              "--validation.dataset", "stdlib_validation", "--validation.local_batch_size", "2",
              "--validation.seq_len", "64")  # fmt: skip


@pytest.mark.spmd_backends()  # 0.3.0's validator: the HSDP test below
def test_validation_leaves_the_training_losses_unchanged(tmp_path) -> None:
    """The validator evaluates the real θ (engine.real_weights) without applying the update in
    flight early: a run that validates every 2 steps trains exactly as one that never does."""
    common = (*FAST, "--training.steps", "6", "--acco.mode", "acco",
              "--training.global_batch_size", "8")  # fmt: skip
    plain = run_titan(2, "debug_cpu_acco.toml", *common, dump=tmp_path / "plain")
    validating = run_titan(2, "debug_cpu_acco.toml", *common, *VALIDATING,
                           dump=tmp_path / "validating")  # fmt: skip
    assert sorted(plain) == list(range(1, 7))
    assert validating == plain


@pytest.mark.spmd_backends("partial_dtensor")  # the validator, not the layout: one backend
def test_validation_under_hsdp_leaves_the_training_losses_unchanged(hsdp_acco, tmp_path) -> None:
    """As above on 2 replicas x 2 FSDP shards (every 0.3.0 run is FSDP): the eval forward must
    not leave θ gathered either. Compared with the HSDP run of the fixture."""
    common, _, hsdp, _ = hsdp_acco
    validating = run_titan(4, "debug_cpu_hsdp_acco.toml", *common, *VALIDATING,
                           dump=tmp_path)  # fmt: skip
    assert validating == hsdp


@pytest.mark.skipif(TITAN_030, reason="torchtitan 0.3.0 has no DDP path; benchmarks/"
                    "titan_no_sync.py patches 0.2.2's trainer (its DDP + no_sync arm)")
def test_the_no_sync_baseline_trains_exactly_as_torchtitan_ddp(tmp_path) -> None:
    """benchmarks/titan_no_sync.py (the per-token benchmark's DDP + no_sync arm) changes only
    when gradients are synchronised: the losses and gradient norms are torchtitan DDP's."""
    # the benchmark's hook is the job's one custom_import: the debug model as it ships
    common = ("--training.steps", "3", "--training.global_batch_size", "8", *FAST,
              "--model.flavor", "debugmodel")  # fmt: skip
    plain_norms: dict = {}
    no_sync_norms: dict = {}
    plain = run_titan(2, "debug_cpu_titan_ddp.toml", *common, dump=tmp_path / "plain",
                      grad_norms=plain_norms)  # fmt: skip
    no_sync = run_titan(2, "debug_cpu_titan_ddp.toml", *common, "--experimental.custom_import",
                        "benchmarks.titan_no_sync", dump=tmp_path / "no_sync",
                        grad_norms=no_sync_norms)  # fmt: skip
    assert no_sync == plain and no_sync_norms == plain_norms
    assert sorted(plain) == [1, 2, 3]


SLOW_LINK = re.compile(r"slow link: rank (\d) compute ([\d.]+) advisor ([\d.]+) comm ([\d.]+)")
IN_FLIGHT = re.compile(r"slow link: rank (\d) in flight at (\d+) of (\d+) step starts")


# 0.2.2 only: the advisor is the engine's, fed by the trainer's step loop both releases share
@pytest.mark.spmd_backends()
@pytest.mark.parametrize("mode", ["acco", "ddp"])
def test_the_advisors_compute_leaves_out_the_step_ends_wait_on_a_slow_link(
    tmp_path, mode: str
) -> None:  # fmt: skip
    """One micro-batch per round on a link whose communication takes about twice the compute,
    and a step end whose metrics wait on that link (tests/titan/slow_link.py): the advisor's
    compute per micro-batch is the data, forward and backward's time within 10 %. Timed from one
    micro-batch's end to the next, as it was before the trainer marked each forward, acco's K
    held that wait (2.8x the compute here); ddp's round waits inside microbatch_done."""
    status, output = launch_titan(
        2, f"debug_cpu_{mode}.toml", "--training.steps", "9", "--training.global_batch_size", "8",
        "--training.seq_len", "64", "--experimental.custom_import", "tests.titan.slow_link",
        dump=tmp_path, env={"LOG_RANK": "all"},
    )  # fmt: skip
    assert status == 0, output[-6000:]
    reports = SLOW_LINK.findall(output)
    assert sorted(int(rank) for rank, *_ in reports) == [0, 1], output[-3000:]
    for _, compute, advisor, comm in reports:
        compute, advisor, comm = float(compute), float(advisor), float(comm)
        assert comm >= 0.3, comm  # the link's wait is in C
        assert abs(advisor - compute) <= 0.1 * compute, (advisor, compute)
    # Between two steps nothing waits for the round: in acco each step starts while the
    # round it launched (an estimate or an update, 0.3 s on the link) communicates; in ddp the
    # round ended inside its step
    in_flight = IN_FLIGHT.findall(output)
    assert len(in_flight) == 2, output[-3000:]
    for _, counted, steps in in_flight:
        assert int(steps) == 8, output[-3000:]
        assert int(counted) == (8 if mode == "acco" else 0), output[-3000:]


@pytest.mark.spmd_backends("spmd_types")  # the pipeline's stages, not how replicas shard
@pytest.mark.skipif(not TITAN_030, reason="0.2.2's PP checkpoint resume: tests/titan/"
                    "test_torchft.py resumes 2 groups of 2 pipeline stages exactly")  # fmt: skip
def test_a_pipeline_parallel_checkpoint_resumes_exactly(tmp_path) -> None:
    """dp2 × pp2, checkpoints at steps 3 and 6, the one of step 6 lost: each stage's engine
    state is saved under keys of its own (its parameters' names and shapes too), and the run
    resumed from step 3, where acco has an estimate in flight, goes on as the straight one."""
    common = ("--parallelism.pipeline_parallel_degree", "2",
              "--parallelism.pipeline_parallel_microbatch_size", "1", "--training.steps", "6",
              *FAST, "--training.global_batch_size", "8", "--checkpoint.enable",
              "--checkpoint.interval", "3", "--checkpoint.no-last-save-model-only",
              "--checkpoint.keep_latest_k", "0")  # fmt: skip
    straight = run_titan(4, "debug_cpu_acco.toml", *common, dump=tmp_path)
    (tmp_path / "checkpoint" / "step-6" / ".metadata").unlink()
    resumed = run_titan(4, "debug_cpu_acco.toml", *common, dump=tmp_path)
    assert sorted(resumed) == [4, 5, 6]
    assert {s: straight[s] for s in resumed} == resumed


POISONED = re.compile(r"poisoned run: rank (\d+) updates (\d+) skipped (\d+)")


@pytest.mark.spmd_backends("spmd_types")  # the model's parts, not how replicas shard
@pytest.mark.parametrize("layout", [
    # the skip is the engine's, over its norm group: TP on 0.2.2 only, PP (whose schedule is
    # each release's) on both
    pytest.param(("--parallelism.tensor_parallel_degree", "2"), marks=pytest.mark.spmd_backends()),
    ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1"),
], ids=["dp2xtp2", "dp2xpp2"])  # fmt: skip
def test_a_non_finite_gradient_in_one_part_of_the_model_is_skipped_by_every_part(
    layout, tmp_path
) -> None:
    """dpu with clipping: every gradient of round 2 is +inf on global rank 0 alone (one TP rank,
    or one pipeline stage, of one replica). Every rank of every part skips that update: the
    same updates everywhere, and the clipping norm's all-reduce stays paired (it hung)."""
    common = ("--training.steps", "6", *FAST, "--training.global_batch_size", "8",
              "--experimental.custom_import", "tests.titan.poison_one_gradient")  # fmt: skip
    status, output = launch_titan(4, "debug_cpu_dpu.toml", *common, *layout, dump=tmp_path)
    assert status == 0, output[-6000:]
    reports = {int(rank): (int(updates), int(skipped))
               for rank, updates, skipped in POISONED.findall(output)}  # fmt: skip
    assert sorted(reports) == [0, 1, 2, 3], output[-3000:]
    assert set(reports.values()) == {(5, 1)}, reports


def checkpoint_model(step_dir: pathlib.Path, out: pathlib.Path) -> dict:
    """The model of a torchtitan DCP checkpoint (its parameters are the top-level tensors), as
    plain tensors."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(step_dir), str(out))
    state = torch.load(out, weights_only=False)
    return {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}


@pytest.mark.spmd_backends("spmd_types")  # what is saved, not how replicas shard
def test_a_mid_run_checkpoint_holds_the_real_weights_and_resumes_exactly(tmp_path) -> None:
    """acco, a checkpoint every 2 steps: after step 2 the model computes at the estimate θ̃
    while the update θ is in flight. The checkpoint's model is θ all the same, the model of a
    run that ends at step 2, for whatever reads it (an initial_load_path, an export); and the
    run resumed from it puts θ̃ back and goes on as the straight one."""
    import torch

    # no warm-up: the first update's learning rate is the same in a run of 2 steps and of 4
    common = (*FAST, "--training.global_batch_size", "8", "--lr_scheduler.warmup_steps", "0",
              "--checkpoint.enable", "--checkpoint.interval", "2",
              "--checkpoint.no-last-save-model-only", "--checkpoint.keep_latest_k", "0")  # fmt: skip
    straight = run_titan(2, "debug_cpu_acco.toml", "--training.steps", "4", *common,
                         dump=tmp_path / "four")  # fmt: skip
    run_titan(2, "debug_cpu_acco.toml", "--training.steps", "2", *common, dump=tmp_path / "two")
    mid_run = checkpoint_model(tmp_path / "four" / "checkpoint" / "step-2", tmp_path / "mid.pt")
    ended = checkpoint_model(tmp_path / "two" / "checkpoint" / "step-2", tmp_path / "end.pt")
    assert mid_run.keys() == ended.keys()
    assert all(torch.equal(mid_run[key], ended[key]) for key in ended)
    (tmp_path / "four" / "checkpoint" / "step-4" / ".metadata").unlink()
    resumed = run_titan(2, "debug_cpu_acco.toml", "--training.steps", "4", *common,
                        dump=tmp_path / "four")  # fmt: skip
    assert sorted(resumed) == [3, 4]
    assert {s: straight[s] for s in resumed} == resumed
