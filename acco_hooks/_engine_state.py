"""The engine's checkpoints: what a state holds, and what it must match before it is loaded.

A state is this rank's alone: its master shard, optimizer state, pending result shard and, in
``acco``, the carried half-batch shard, all 1/N of the model; the model-sized accumulator only
when saved in the middle of a round. So it can only resume the same rank of a run with the same
shape; anything else is refused by name.
Saving waits for the round in flight but keeps its result unapplied, so it never changes the
trajectory; loading gathers the saved pending shards again, rebuilding that result bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from acco_hooks._comm_job import Job, all_gather_shards

__all__ = ["STATE_VERSION", "EngineStateMixin", "check_compatible"]

# 2: the half-batch acco carries is a reduce-scattered shard; the accumulator is saved only
# mid-round. Version 1 carried it in the full accumulator.
STATE_VERSION = 2


def check_compatible(
    state: dict[str, Any], *, mode: str, world_size: int, fsdp_world_size: int,
    accumulation_steps: int, param_shapes: list[list[tuple[int, ...]]], has_lr_scheduler: bool,
) -> None:  # fmt: skip
    """Raise ``ValueError`` naming the first difference between ``state`` and this engine."""
    if state.get("version") != STATE_VERSION:
        raise ValueError(
            f"acco_hooks: load_state_dict: the checkpoint has engine state version "
            f"{state.get('version')!r}, this acco_hooks reads version {STATE_VERSION} (version "
            "1 kept acco's carried half-batch in the full accumulator, which this version no "
            "longer holds). Resume it with the acco_hooks that wrote it"
        )
    if state["world_size"] != world_size:
        raise ValueError(
            f"acco_hooks: load_state_dict: the checkpoint was saved with a data-parallel world "
            f"size of {state['world_size']}, this run has {world_size}. Resharding the "
            f"optimizer state is not supported yet: resume with {state['world_size']} "
            "data-parallel ranks"
        )
    saved_fsdp = state.get("fsdp_world_size", 1)
    if saved_fsdp != fsdp_world_size:
        raise ValueError(
            f"acco_hooks: load_state_dict: the checkpoint was saved with the model sharded "
            f"{saved_fsdp} ways by FSDP inside each replica, this run shards it "
            f"{fsdp_world_size} ways. Resharding the optimizer state is not supported "
            f"yet: resume with an FSDP (data_parallel_shard) degree of {saved_fsdp}"
        )
    if state["mode"] != mode:
        raise ValueError(
            f"acco_hooks: load_state_dict: the checkpoint was saved in mode={state['mode']!r}, "
            f"this engine has mode={mode!r}; build the optimizer with "
            f"mode={state['mode']!r} to resume"
        )
    if state["accumulation_steps"] != accumulation_steps:
        raise ValueError(
            f"acco_hooks: load_state_dict: the checkpoint was saved with accumulation_steps="
            f"{state['accumulation_steps']}, this optimizer has accumulation_steps="
            f"{accumulation_steps}: the resumed run would take another batch per update than "
            "the saved one. Build the optimizer with "
            f"accumulation_steps={state['accumulation_steps']} to resume"
        )
    if [[tuple(s) for s in g] for g in state["param_shapes"]] != param_shapes:
        raise ValueError(
            "acco_hooks: load_state_dict: the checkpoint's parameter groups and shapes differ "
            "from this optimizer's; build it over the same parameters in the same order"
        )
    if has_lr_scheduler != (state["lr_scheduler"] is not None):
        raise ValueError(
            "acco_hooks: load_state_dict: the checkpoint "
            + ("has no" if state["lr_scheduler"] is None else "has an")
            + " LR scheduler state but this optimizer "
            + ("has one" if has_lr_scheduler else "has none")
            + "; pass the same lr_scheduler argument as the saved run"
        )


class EngineStateMixin:
    """``state_dict`` / ``load_state_dict`` of :class:`acco_hooks.ACCOEngine`."""

    __slots__ = ()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-exactly, for this rank.

        In-flight communication is waited for first (its result is kept, not applied, so
        saving never changes the training trajectory). Save the model's ``state_dict()`` too:
        it holds the live parameters (in ``acco``, possibly the estimate θ̃).

        Like ``torch.optim.Optimizer.state_dict``, tensors are references: save the dict before
        the next ``step()``.
        """
        self._finish_in_flight(apply=False)
        return {
            "version": STATE_VERSION, "mode": self.mode, "world_size": self.world_size,
            "fsdp_world_size": self.fsdp_world_size, "param_shapes": self._param_shapes(),
            "accumulation_steps": self.accumulation_steps, "round_index": self.round_index, "num_updates": self.num_updates,
            "skipped_rounds": self.skipped_rounds,
            "round_microbatches": self._round_microbatches, "local_count": self._local_count,
            "grad_arrived": [list(a) for a in self._grad_arrived],
            # Zero at a round boundary: saved only mid-round, the one model-sized tensor.
            "accumulator": (
                [g.accumulator for g in self._buffers] if self._round_microbatches else None
            ),
            "carried": None if self.mode != "acco" else [g.carried for g in self._buffers],
            "master": [g.master for g in self._buffers],
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            "pending_job": None if self._in_flight_job is None else self._in_flight_job.value,
            "pending_shard": [g.gather_input for g in self._buffers],
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output saved by the same rank of a same-sized run."""
        check_compatible(
            state, mode=self.mode, world_size=self.world_size,
            fsdp_world_size=self.fsdp_world_size, accumulation_steps=self.accumulation_steps,
            param_shapes=self._param_shapes(), has_lr_scheduler=self.lr_scheduler is not None,
        )  # fmt: skip
        self._finish_in_flight(apply=False)
        accumulators = state["accumulator"] or [None] * len(self._buffers)
        carried = state["carried"] or [None] * len(self._buffers)
        with torch.no_grad():
            for g, acc, kept, master, shard in zip(
                self._buffers, accumulators, carried, state["master"], state["pending_shard"]
            ):
                if acc is None:
                    g.accumulator.zero_()
                else:
                    g.accumulator.copy_(acc)
                if kept is not None:
                    g.carried.copy_(kept)
                g.master.copy_(master)
                g.gather_input.copy_(shard)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.round_index, self.num_updates = state["round_index"], state["num_updates"]
        self.skipped_rounds = state.get("skipped_rounds", 0)
        self._round_microbatches = state["round_microbatches"]
        self._local_count = state["local_count"]
        self._grad_arrived = [list(a) for a in state["grad_arrived"]]
        self._in_flight = self._in_flight_job = None
        if state["pending_job"] is not None:
            # The saved run had a finished, not yet applied result: every rank kept its shard of
            # it; gathering the shards again rebuilds the full result bit for bit.
            self._in_flight = self._worker.submit(all_gather_shards, self._buffers, self._groups)
            self._in_flight_job = Job(state["pending_job"])

    def _param_shapes(self) -> list[list[tuple[int, ...]]]:
        return [[tuple(p.shape) for p in g.params] for g in self._buffers]

    def reset_master_from_params(self) -> None:
        """Take the fp32 master shard from the model's current parameters.

        The master shard is copied from the model when the engine is built. Call this after
        loading model weights that come without engine state (a pretrained or seed checkpoint),
        before the first round.
        """
        if self.round_index != 0 or self._in_flight is not None:
            raise RuntimeError(
                "acco_hooks: reset_master_from_params() after training started would drop the "
                "optimizer's progress; call it right after loading weights, before the first step"
            )
        for g in self._buffers:
            g.reset_master(self.rank)
