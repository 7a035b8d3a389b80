"""torchtitan's data-loader state, loadable on another number of data-parallel ranks.

torchtitan's ``ParallelAwareDataloader`` checkpoints one state per data-parallel rank
(``dataloader.dp_rank_N``) and stops a load on another number of ranks ("dataloader resharding
is not supported yet", 0.2.2 and 0.3.0). An ACCO job that restarts on fewer or more nodes
(``data_parallel_replicate_degree = -1``, ``docs/multinode.md``) must go on reading its data.

:class:`ReshardableLoaderState` stands in for the loader in the checkpointer. It saves every
data-parallel rank's loader state under one key, the same on every rank. On the same number of
ranks each rank loads its own state, exactly as torchtitan would. On another number, each rank's
position is derived from what the saved ranks consumed, for a map-style dataset (a local one,
such as the embedded ``stdlib`` corpus) split into contiguous blocks per rank by
``datasets.distributed.split_dataset_by_node``: the saved ranks had read ``s_0 … s_{N-1}``
samples of their blocks; each of the N' new ranks starts ``Σ s / N'`` samples into its own block.
So the run reads as many samples per epoch as before, but not the same ones: in the epoch in
progress, up to ``Σ s`` samples can be read a second time and as many skipped, and each saved
rank's partly packed sequence (its token buffer, under one sequence) is dropped. A streamed
dataset keeps an opaque position per rank and is refused by name.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch.distributed as dist
from torchtitan.tools.logging import logger

from acco_hooks.titan import flag

__all__ = ["ReshardableLoaderState"]


class ReshardableLoaderState:
    """The checkpointer's view of a torchtitan ``ParallelAwareDataloader``.

    Args:
        loader: the trainer's data loader (``dp_rank``, ``dp_world_size``, and torchtitan's
            ``state_dict``/``load_state_dict`` keyed by ``dp_rank_N``).

    Example::

        >>> checkpointer.states["dataloader"] = ReshardableLoaderState(trainer.dataloader)
    """

    __slots__ = ("loader",)

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    @property
    def _rank_key(self) -> str:
        return f"dp_rank_{self.loader.dp_rank}"

    def state_dict(self) -> dict[str, Any]:
        """Every data-parallel rank's loader state (gathered: a collective over the world,
        which every rank's checkpoint save and load runs). Across torchft replica groups the
        world is one group's, which saves its own ranks' states only."""
        own = self.loader.state_dict()[self._rank_key]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.loader.dp_rank, own))
        by_rank = dict(sorted(gathered))  # tensor and pipeline peers of a rank hold the same state
        return {"world_size": self.loader.dp_world_size, "states": pickle.dumps(by_rank)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:  # nothing saved (a model-only checkpoint)
            return
        saved_world, states = state["world_size"], pickle.loads(state["states"])
        if isinstance(states, list):  # saved by an acco_hooks before torchft groups: every rank's
            states = dict(enumerate(states))
        world = self.loader.dp_world_size
        if saved_world == world and self.loader.dp_rank in states:
            self.loader.load_state_dict({self._rank_key: states[self.loader.dp_rank],
                                         "world_size": world})  # fmt: skip
            return
        if len(states) != saved_world:
            raise ValueError(
                f"ACCO: this checkpoint is one torchft replica group's: it holds the data "
                f"positions of data-parallel ranks {sorted(states)} of {saved_world}, not of this "
                f"rank ({self.loader.dp_rank} of {world}). Resume every group from its own "
                "folder with the same number of groups and ranks"
            )
        states = [states[r] for r in range(saved_world)]
        fresh = pickle.loads(self.loader.state_dict()[self._rank_key])
        positions = [pickle.loads(s).get("dataset_state") or {} for s in states]
        if not all("sample_idx" in p for p in positions) or "dataset_state" not in fresh:
            raise ValueError(
                f"ACCO: the checkpoint's data loader was saved by {saved_world} data-parallel "
                f"ranks, this run has {world}, and the loader's state holds no sample position (a "
                "streamed dataset keeps an opaque one per rank; loader workers, num_workers > 0, "
                "keep theirs apart), so where each rank goes on cannot be derived. Resume with "
                f"{saved_world} data-parallel ranks, or train on a local (map-style) dataset "
                f"({flag('training.dataset_path')}) with num_workers = 0"
            )
        consumed = sum(p["sample_idx"] for p in positions)
        fresh["dataset_state"] = {**fresh["dataset_state"], "sample_idx": consumed // world,
                                  "token_buffer": []}  # fmt: skip
        self.loader.load_state_dict({self._rank_key: pickle.dumps(fresh), "world_size": world})
        if self.loader.dp_rank == 0:
            logger.warning(
                f"ACCO: the data loader was saved by {saved_world} data-parallel ranks and "
                f"resumes on {world}: {consumed} samples of this epoch were read, each rank "
                f"starts {consumed // world} samples into its part of the dataset; in this "
                f"epoch up to {consumed} samples may be read twice and as many skipped "
                "(acco_hooks/titan/dataloader.py)"
            )
