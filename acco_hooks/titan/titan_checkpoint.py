"""A checkpoint written by torchtitan's own trainer, continued under ``[acco]``.

The path of a user who trained with FSDP (or DDP, TP, PP) and now wants ACCO across nodes:
the checkpoint is copied into the run's ``checkpoint.folder``, or given as
``checkpoint.initial_load_path`` with ``initial_load_model_only = false``. torchtitan saves
the same ``model``, ``lr_scheduler`` and ``train_state`` entries under ACCO as without it; two
entries differ:

- ``optimizer``: torchtitan's container saves each parameter's state by name
  (``state.<fqn>.exp_avg``, ``state.<fqn>.step``, ``param_groups.<fqn>.lr``, ...; both
  releases), the engine its flat shards (``optimizer.acco_engine``). :class:`TitanOptimizerState`
  asks DCP for torchtitan's keys, each moment as a tensor laid out as its parameter (a
  ``DTensor`` parameter's as the parameter, so DCP reads this rank's shard of it whatever
  layout saved it), and hands them to the engine by name
  (``ACCOEngine.load_optimizer_state_by_name``), with the saved hyperparameters (the learning
  rate at the saved step, as torchtitan's own resume takes them).
- ``dataloader``: torchtitan keeps each data-parallel rank's position under ``dp_rank_N``, ACCO
  every rank's under one key (:class:`~acco_hooks.titan.dataloader.ReshardableLoaderState`).
  :class:`TitanLoaderState` reads torchtitan's and loads it as ACCO's own, so a data position
  continues on the same number of data-parallel ranks as torchtitan's would, and is
  re-derived on another number as for ACCO's own checkpoints.

What a checkpoint holds is read from its DCP metadata before anything is loaded
(:func:`states_to_load`). ``[acco] mode = "acco"`` makes one update every two steps: a
torchtitan checkpoint's step count and LR schedule (one update a step) do not continue there,
and such a load is refused with the settings that continue it. So is an ACCO checkpoint whose
engine state this run cannot read (other parameter groups, another tensor or pipeline parallel
layout), naming what differs, and a finished run's model-only last step: each a
:class:`CheckpointRefusal`, which the launcher prints in one line, as a bad config.

The temporary moments are the rank's model parts at full size, in float32, for the time of the
load (as torchtitan's own optimizer holds them, unsharded where it does not shard).
"""

from __future__ import annotations

import math
import os
import pickle
import re
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from acco_hooks.engine import ACCOEngine
from acco_hooks.titan import flag
from acco_hooks.titan.dataloader import ReshardableLoaderState

__all__ = ["LIVE_KEY", "STATE_KEY", "CheckpointRefusal", "TitanLoaderState", "TitanOptimizerState",
           "states_to_load"]  # fmt: skip

# The engine's state in torchtitan's checkpoint, under its "optimizer" entry, and the live
# parameters (θ̃ where the model holds them; the checkpoint's "model" holds θ)
STATE_KEY = "acco_engine"
LIVE_KEY = "acco_live"

# torchtitan's per-parameter Adam state and the hyperparameters its resume takes from the
# checkpoint (torch's Optimizer.load_state_dict replaces a group's options with the saved ones);
# foreach / fused / capturable say how a step runs, not what it computes
_MOMENTS = ("exp_avg", "exp_avg_sq")
_HYPERPARAMETERS = ("lr", "initial_lr", "betas", "eps", "weight_decay")


class CheckpointRefusal(ValueError):
    """A checkpoint this run cannot continue, refused before any tensor is read from it, with
    what to run instead: every rank refuses it alike, and ``train_titan.py`` prints it in one
    line and exits with status 2, as a bad config."""


def start_from_weights(checkpoint_id: Any) -> str:
    """How to start a run from a checkpoint's weights alone."""
    return (f"start from its weights alone with {flag('checkpoint.initial_load_path')} "
            f"{checkpoint_id} and {flag('checkpoint.initial_load_model_only')}, in a new "
            f"{flag('job.dump_folder')}")  # fmt: skip


class TitanOptimizerState:
    """torchtitan's optimizer entry (flat, by parameter name), loaded into the engine.

    Args:
        engine: the engine whose shards receive the state.
        named: the engine's parameters by name (the model parts' trainable parameters).
        saved: the checkpoint's keys under ``optimizer.`` (without that prefix).
    """

    __slots__ = ("engine", "hyperparameters", "named")

    def __init__(self, engine: ACCOEngine, named: list[tuple[str, nn.Parameter]],
                 saved: set[str]) -> None:  # fmt: skip
        self.engine, self.named = engine, named
        self.hyperparameters = [h for h in _HYPERPARAMETERS
                                if all(f"param_groups.{n}.{h}" in saved for n, _ in named)]  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """What DCP loads into: every moment laid out as its parameter, the step count, and
        placeholders for the saved hyperparameters (DCP replaces them)."""
        state: dict[str, Any] = {}
        with torch.no_grad():
            for name, param in self.named:
                for moment in _MOMENTS:
                    state[f"state.{name}.{moment}"] = torch.zeros_like(param, dtype=torch.float32)
                state[f"state.{name}.step"] = torch.zeros(())
                for option in self.hyperparameters:
                    state[f"param_groups.{name}.{option}"] = None
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        options = {}
        for option in self.hyperparameters:
            values = {name: state[f"param_groups.{name}.{option}"] for name, _ in self.named}
            distinct = {repr(v) for v in values.values()}
            if len(distinct) > 1:  # parameter groups of their own (0.3.0's param_groups)
                raise ValueError(
                    f"ACCO: this checkpoint of torchtitan's own trainer has parameters with "
                    f"different {option} ({', '.join(sorted(distinct))}): several optimizer "
                    "parameter groups, and the ACCO engine runs one. Continue it from its "
                    f"weights alone ({flag('checkpoint.initial_load_path')} with "
                    f"{flag('checkpoint.initial_load_model_only')})"
                )
            options[option] = next(iter(values.values()))
        self.engine.load_optimizer_state_by_name({
            name: {**{m: state[f"state.{name}.{m}"] for m in _MOMENTS},
                   "step": state[f"state.{name}.step"]}
            for name, _ in self.named
        })  # fmt: skip
        for group in self.engine.optimizer.param_groups:
            group.update(options)


class TitanLoaderState:
    """torchtitan's data loader entry (``dp_rank_N`` per data-parallel rank, ``world_size``),
    loaded as ACCO's :class:`ReshardableLoaderState` (the same data positions).

    Args:
        loader: the run's loader state.
        saved_ranks: the data-parallel ranks the checkpoint holds a position of.
    """

    __slots__ = ("loader", "saved_ranks")

    def __init__(self, loader: ReshardableLoaderState, saved_ranks: list[int]) -> None:
        self.loader, self.saved_ranks = loader, saved_ranks

    def state_dict(self) -> dict[str, Any]:
        return {"world_size": None, **{f"dp_rank_{r}": None for r in self.saved_ranks}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        by_rank = {r: state[f"dp_rank_{r}"] for r in self.saved_ranks}
        self.loader.load_state_dict({"world_size": state["world_size"],
                                     "states": pickle.dumps(by_rank)})  # fmt: skip


def _refuse_other_groups(metadata: dict[str, Any], engine: ACCOEngine, checkpoint_id: Any) -> None:
    """Refuse, naming what differs, an ACCO checkpoint that lacks the engine state of one of
    this rank's parameter groups or holds it in another size, before DCP refuses it with a raw
    missing key or size mismatch.

    The engine keys each group's state by the group's first parameter and, under tensor or
    pipeline parallelism, the coordinates of this rank's part (``@tp=1``). Without those
    coordinates on either side the layouts are the same (one part), so other keys or sizes
    mean other parameter groups: another optimizer recipe (a Muon group) or another model.
    The same groups in other coordinates mean another layout. Under pipeline parallelism a
    checkpoint holds every stage's groups; this rank needs its own."""
    prefix = f"optimizer.{STATE_KEY}.master."
    theirs = {key[len(prefix):]: tuple(getattr(value, "size", ()))
              for key, value in metadata.items() if key.startswith(prefix)}  # fmt: skip
    mine = {key: tuple(_global_size(chunk)) for key, chunk in engine.state_dict()["master"].items()}
    differ = sorted(key for key, size in mine.items() if theirs.get(key) != size)
    if not differ:
        return

    def groups(sizes: dict[str, tuple]) -> str:
        return ", ".join(f"{key} ({math.prod(size):,} elements)" for key, size in sorted(sizes.items()))

    def names(keys: Any) -> set[str]:  # without the tensor and pipeline coordinates
        return {key.split("@")[0] for key in keys}

    if not names(mine) <= names(theirs) or not any("@" in key for key in [*theirs, *mine]):
        what = (
            "other parameter groups than this run's: its engine state holds the groups "
            f"beginning with {groups(theirs)}, this run's begin with {groups(mine)} (each "
            "group's state is keyed by its first parameter). Another optimizer recipe "
            "(optimizer.param_groups, a Muon group) or another model saved it: resume it with "
            "the recipe it was saved with"
        )
    else:
        what = (
            f"another tensor or pipeline parallel layout than this run's: this rank's part "
            f"{differ[0]} ({math.prod(mine[differ[0]]):,} elements) is not among its parts "
            f"({groups(theirs)}). The engine state reshards across data-parallel replicas and "
            "FSDP degrees only: resume with the tensor_parallel_degree and "
            "pipeline_parallel_degree it was saved with"
        )
    raise CheckpointRefusal(
        f"ACCO: {checkpoint_id} was saved with {what}, or {start_from_weights(checkpoint_id)}"
    )


def _global_size(chunk: Any) -> Any:
    """The size of the whole vector a rank's chunk of engine state is part of."""
    metadata = getattr(chunk, "metadata", None)  # a ShardedTensor's, without its deprecated ops
    return metadata().size if callable(metadata) else chunk.shape


def _earlier_steps(checkpoint_id: str) -> list[int]:
    """The steps before ``checkpoint_id``'s (``…/step-N``) that torchtitan saved completely
    (``.metadata`` written) in the same folder, in order."""
    folder, name = os.path.split(os.path.normpath(checkpoint_id))
    match = re.fullmatch(r"step-(\d+)", name)
    if match is None:
        return []
    steps = []
    for entry in os.listdir(folder):
        other = re.fullmatch(r"step-(\d+)", entry)
        if other and int(other.group(1)) < int(match.group(1)) and os.path.isfile(
            os.path.join(folder, entry, ".metadata")
        ):
            steps.append(int(other.group(1)))
    return sorted(steps)


def states_to_load(
    states: dict[str, Any], checkpoint_id: Any, engine: ACCOEngine,
    named: list[tuple[str, nn.Parameter]], mode: str,
) -> dict[str, Any]:  # fmt: skip
    """``states`` (what torchtitan's checkpointer is about to hand ``dcp.load``), with the
    entries of a checkpoint of torchtitan's own trainer read as ACCO's own.

    Args:
        states: the checkpointer's flattened states; ``optimizer`` is the engine's container,
            ``dataloader`` a :class:`ReshardableLoaderState`, where they are loaded.
        checkpoint_id: the checkpoint's folder.
        engine, named: the engine and its parameters by name.
        mode: ``[acco] mode``.

    Raises:
        ValueError: in one line, what the checkpoint is and the settings that load it, where
            it cannot continue this run.
    """
    optimizer, loader = states.get("optimizer"), states.get("dataloader")
    translatable = optimizer is not None or isinstance(loader, ReshardableLoaderState)
    if not translatable or not os.path.isdir(str(checkpoint_id)):
        return states
    metadata = FileSystemReader(str(checkpoint_id)).read_metadata().state_dict_metadata
    saved = set(metadata)
    if any(key.startswith(f"optimizer.{STATE_KEY}.") for key in saved):
        if optimizer is not None:
            _refuse_other_groups(metadata, engine, checkpoint_id)
        return states  # ACCO's own
    if not any(key.startswith("train_state.") for key in saved):
        if optimizer is None:
            return states
        earlier = _earlier_steps(str(checkpoint_id))
        raise CheckpointRefusal(
            f"ACCO: {checkpoint_id} holds a model only (no optimizer, data position or step)"
            + (", the last step of a finished run (torchtitan saves it model only: "
               "checkpoint.last_save_model_only)" if earlier else "")
            + f": train again in a new {flag('job.dump_folder')}"
            + (f", resume from the run's last full checkpoint with "
               f"{flag('checkpoint.load_step')} {earlier[-1]}" if earlier else "")
            + f", or {start_from_weights(checkpoint_id)}"
        )
    if mode == "acco":
        raise CheckpointRefusal(
            f"ACCO: {checkpoint_id} is a checkpoint of torchtitan's own trainer, which counts "
            "one optimizer update per step; [acco] mode = 'acco' makes one every two steps, "
            "so its step count and LR schedule do not continue there. Continue it with "
            f"--acco.mode ddp or auto (one update per step), or {start_from_weights(checkpoint_id)}"
        )
    states = dict(states)
    if optimizer is not None:
        prefix = "optimizer."
        states["optimizer"] = TitanOptimizerState(
            engine, named, {k[len(prefix):] for k in saved if k.startswith(prefix)}
        )  # fmt: skip
    ranks = sorted(int(k.rsplit("_", 1)[1]) for k in saved if k.startswith("dataloader.dp_rank_"))
    if isinstance(loader, ReshardableLoaderState) and ranks and "dataloader.states" not in saved:
        states["dataloader"] = TitanLoaderState(loader, ranks)
    return states
