"""Imported into a torchtitan run by the torchft tests (``--experimental.custom_import``); what
it does is set by environment variables, the same for every group of a job:

- ``ACCO_TEST_FT_OUT`` (a folder) and ``ACCO_TEST_FT_GROUPS`` (how many): each rank writes a
  file there once its replica group's ``torchft.Manager`` is built, and waits for every rank of
  every group, so that no group starts a job the others would have to join;
- ``ACCO_TEST_FT_KILL = "group:round"``: that group's rank 0 SIGKILLs its whole ``torchrun``
  session (the node is lost) as that round's second micro-batch starts, once the previous
  round was summed over the groups: mid-round (a group restarted after it joins later, and
  never meets that round; nor is it killed again);
- ``ACCO_TEST_FT_HOLD = "round"``: once a group was killed, the live groups wait at that
  round's start until the lighthouse has the restarted group's first quorum request
  (``scaffolding.torchft_job.announce_first_quorum_request``), so that its first step (which
  compares settings) meets that round's sum, and it joins by the next round's;
- ``ACCO_TEST_FT_STOP = "group:ranks_per_group:stop[:resume]"`` (the reference, one job of
  every rank without torchft): the ranks of that group contribute nothing in rounds
  [stop, resume) (their micro-batches' labels are all ignored, so the engine skips them).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torchtitan.components.loss import IGNORE_INDEX

from acco_hooks.titan import TITAN_030
from acco_hooks.titan.base import ACCOTrainerBase
from acco_hooks.titan.replica_groups import replica_group_name
from scaffolding.torchft_job import announce_first_quorum_request
from tests.titan import small_model  # noqa: F401  (the tests' model: a job has one custom_import)

if TITAN_030:
    from acco_hooks.titan import v030 as release
else:
    from acco_hooks.titan import v022 as release

_build_manager = release.build_torchft_manager
_next_microbatch = ACCOTrainerBase._next_microbatch


def _build_manager_then_wait(fault_tolerance: Any, timeout: float | None) -> Any:
    manager = _build_manager(fault_tolerance, timeout)
    out, groups = Path(os.environ["ACCO_TEST_FT_OUT"]), int(os.environ["ACCO_TEST_FT_GROUPS"])
    rank, size = dist.get_rank(), dist.get_world_size()
    (out / f"manager_up_g{fault_tolerance.replica_id}_r{rank}").write_text("")
    if (out / "killed_at").exists():  # restarted: the live groups may hold for it
        name = replica_group_name(fault_tolerance.replica_id)
        announce_first_quorum_request(manager, name, out, out / f"rejoining_r{rank}")
    _wait_for(out, [f"manager_up_g{g}_r{r}" for g in range(groups) for r in range(size)])
    return manager


def _wait_for(out: Path, names: list[str]) -> None:
    deadline = time.monotonic() + 120
    while not all((out / name).exists() for name in names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited 120 s for {names} in {out}")
        time.sleep(0.05)


def _next_microbatch_or_die_or_nothing(trainer: ACCOTrainerBase, data_iterator: Any) -> Any:
    engine = trainer.optimizers.engine
    seen = getattr(trainer, "_test_seen", {})  # round -> its micro-batches started here
    trainer._test_seen = seen
    seen[engine.round_index] = seen.get(engine.round_index, 0) + 1
    kill, out = os.environ.get("ACCO_TEST_FT_KILL"), Path(os.environ.get("ACCO_TEST_FT_OUT", "."))
    if kill is not None and not (out / "killed_at").exists():  # its restart is not killed again
        group, round_index = map(int, kill.split(":"))
        if (trainer.titan_config.fault_tolerance.replica_id, dist.get_rank(), engine.round_index,
                seen[engine.round_index]) == (group, 0, round_index, 2):  # fmt: skip
            while engine.communication_in_flight:  # the previous round was summed (committed)
                time.sleep(0.01)
            (out / "killed_at").write_text(str(round_index))
            os.killpg(os.getpgid(0), signal.SIGKILL)
    hold = os.environ.get("ACCO_TEST_FT_HOLD")
    if (hold is not None and (engine.round_index, seen[engine.round_index]) == (int(hold), 1)
            and (out / "killed_at").exists()):  # fmt: skip
        # its quorum request is at the lighthouse: this group's next quorum takes it in
        _wait_for(out, [f"rejoining_r{r}" for r in range(dist.get_world_size())])
    input_dict, labels, valid = _next_microbatch(trainer, data_iterator)
    stop = os.environ.get("ACCO_TEST_FT_STOP")
    if stop is not None:
        group, ranks_per_group, start, *end = map(int, stop.split(":"))
        end = end[0] if end else float("inf")
        if dist.get_rank() // ranks_per_group == group and start <= engine.round_index < end:
            labels = labels.clone().fill_(IGNORE_INDEX)
            valid = valid * 0
    return input_dict, labels, valid


release.build_torchft_manager = _build_manager_then_wait
ACCOTrainerBase._next_microbatch = _next_microbatch_or_die_or_nothing
