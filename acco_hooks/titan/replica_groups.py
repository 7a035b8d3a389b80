"""torchtitan across torchft replica groups, for both releases' trainers: the group's
``torchft.Manager`` from the ``[fault_tolerance]`` section, the group's part of the data, and
its own checkpoint folder (docs/multinode.md, "In torchtitan").

torchtitan 0.2.2 has the section in its ``JobConfig``; on 0.3.0 ACCO's trainer config has the
one of torchtitan's ``experiments.torchft`` trainer, with the same fields. torchft is the
``ft`` extra, imported only when a manager is built (``acco_hooks.titan.config`` refuses the
section without it, naming the extra).
"""

from __future__ import annotations

import datetime
import os
from typing import Any

__all__ = [
    "build_torchft_manager",
    "replica_group_folder",
    "replica_group_name",
    "split_data_over_replica_groups",
]


def build_torchft_manager(fault_tolerance: Any, timeout: float | None) -> Any:
    """This replica group's ``torchft.Manager``, from torchtitan's ``[fault_tolerance]``
    section (0.2.2's, or 0.3.0's ``experiments.torchft`` one: the same fields).

    As torchtitan's own ``FTManager`` builds it (the lighthouse from ``$TORCHFT_LIGHTHOUSE``,
    ``process_group_timeout_ms`` for the cross-group process group), with the engine's
    ``timeout`` for the quorum and no state dict functions: the engine registers its own, what
    a joining group takes (``acco_hooks.engine.replicas``). The engine's first round waits
    for the ``group_size`` groups (``replica_groups``): groups launched together train
    together from the first round, however long each takes to build its model.
    """
    from torchft import Manager
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    from acco_hooks.engine.replicas import check_lighthouse_address

    check_lighthouse_address()  # before torchft's connect timeout hides an unset variable
    pg_timeout = datetime.timedelta(milliseconds=fault_tolerance.process_group_timeout_ms)
    pg = (ProcessGroupGloo if fault_tolerance.process_group == "gloo" else ProcessGroupNCCL)(
        timeout=pg_timeout
    )
    quorum_timeout = datetime.timedelta(seconds=timeout) if timeout is not None else pg_timeout
    return Manager(
        pg=pg, min_replica_size=fault_tolerance.min_replica_size, load_state_dict=None,
        state_dict=None, replica_id=replica_group_name(fault_tolerance.replica_id),
        timeout=quorum_timeout, connect_timeout=quorum_timeout,
    )  # fmt: skip


def replica_group_name(replica_id: int) -> str:
    """The name group ``replica_id``'s ``Manager`` gives the lighthouse, which shows it (with
    a uuid each start of the group draws) in its log and on its status page."""
    return f"torchtitan_acco_{replica_id}"


def split_data_over_replica_groups(
    fault_tolerance: Any, dp_world_size: int, dp_rank: int
) -> tuple[int, int]:
    """The data loader's ``(dp_world_size, dp_rank)`` with ``[fault_tolerance] enable``: the
    replica groups split the data too, as torchtitan's own torchft trainer splits it (group i
    reads the shards after groups 0..i-1's). Unchanged without it."""
    if fault_tolerance is None or not fault_tolerance.enable:
        return dp_world_size, dp_rank
    return dp_world_size * fault_tolerance.group_size, (
        fault_tolerance.replica_id * dp_world_size + dp_rank
    )


def replica_group_folder(fault_tolerance: Any, checkpoint: Any) -> str:
    """``checkpoint.folder``, or with ``[fault_tolerance] enable`` and checkpoints on, the
    group's own under it, ``replica_<replica_id>``: every torchft replica group holds the whole
    state and saves it, and resumes from its own (a group that comes back to a running job
    takes a live group's state instead: ``acco_hooks.titan.base.ACCOTrainerBase``)."""
    if fault_tolerance is None or not fault_tolerance.enable or not checkpoint.enable:
        return checkpoint.folder
    return os.path.join(checkpoint.folder, f"replica_{fault_tolerance.replica_id}")
