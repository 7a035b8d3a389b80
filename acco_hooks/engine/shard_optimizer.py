"""Which optimizers the engine can step on its flat shard, and which of their state is per element.

The engine steps one flat 1-D vector per parameter group: the group's parameters laid end to
end, padded, cut into 1/N shards (``buffers``). An optimizer whose step is **per element**
(element i of the update depends only on element i of the parameter, its gradient and its state,
and on per-parameter values such as a step count, the same for every parameter of a group)
computes on that shard exactly what it computes on the parameters themselves, on any number of
ranks. One that looks at a parameter's shape or at a norm over it computes something else there,
and something that changes with N: Adafactor factors its second moment by rows and columns and
scales its update by RMS values over the whole tensor; Muon orthogonalizes whole matrices; a
LAMB-style trust ratio divides two norms.

How it is decided, once, when the engine is built (before any process group exists):

* ``torch.optim``'s classes the flat shard cannot run are refused by name, with the reason
  (:data:`REFUSED`);
* every other class, torch's own per-element ones and any user or third-party class (a subclass
  of a torch optimizer too: it may change ``step()``), is **probed**: a copy built with the
  run's parameter-group options steps a random 1-D vector whole and, in another copy, cut in two
  pieces, for three steps. A per-element step gives the same update (to float rounding) and per-
  parameter state equal in both pieces; anything else is refused, naming what differed.

The probe also tells how the state is checkpointed (:class:`ShardStateLayout`): a key whose
value has the parameter's shape in every piece (whose lengths differ) is per element, and is
sharded and resharded like the master weights; every other key is one value per parameter,
equal on every rank (a step count), saved once.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["REFUSED", "ShardStateLayout", "check_optimizer", "first_step_state"]

# torch.optim classes the flat shard cannot run, and why (a class torch lacks is left out).
REFUSED: dict[type, str] = {
    cls: why
    for name, why in {
        "Adafactor": (
            "factors its second moment by a parameter's rows and columns and scales each "
            "update by RMS values over the whole parameter: on a flat 1-D shard it would run "
            "an unfactored variant whose update also changes with the number of ranks"
        ),
        "Muon": (
            "orthogonalizes each 2-D parameter's update as a whole matrix, which the flat "
            "shard cuts into pieces; it needs a layout that keeps whole matrices on a rank, "
            "which acco_hooks does not have"
        ),
        "LBFGS": (
            "needs a closure that re-evaluates the loss in step(), which a sharded step on "
            "the communication thread cannot run"
        ),
        "SparseAdam": (
            "steps sparse gradients, and the engine sums and shards dense ones (torch.optim."
            "Adam or AdamW step dense gradients)"
        ),
    }.items()
    if (cls := getattr(torch.optim, name, None)) is not None
}

_PROBE_STEPS = 3
_PIECES = (4, 7)  # the probe vector's two pieces: lengths that differ, so shapes tell keys apart
_RTOL = 1e-4  # of the largest update element: float rounding, not an algorithm, differs below


class ShardStateLayout(NamedTuple):
    """How a shard optimizer's state keys are checkpointed."""

    per_element: frozenset[str]
    """Keys with one value per parameter element (moments, momentum): sharded like the master."""
    per_parameter: frozenset[str]
    """Keys with one value per parameter (a step count): the same on every rank."""


def check_optimizer(
    optimizer_class: Any, group_options: Iterable[dict[str, Any]],
    optimizer_kwargs: dict[str, Any], device: torch.device,
) -> ShardStateLayout:  # fmt: skip
    """Refuse an optimizer the flat shard cannot run; return how its state is checkpointed.

    Args:
        optimizer_class: what the user gave as the shard optimizer.
        group_options: each parameter group's options (its dict without ``params``).
        optimizer_kwargs: the optimizer's keyword arguments.
        device: where the shard lives (the probe runs there, with the run's own options).

    Raises:
        TypeError: not a torch optimizer class, or one the flat shard cannot run, with why.
    """
    name = _name(optimizer_class)
    is_class = isinstance(optimizer_class, type)
    if not (is_class and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(
            f"acco_hooks: optimizer_class must be a torch.optim.Optimizer subclass such as "
            f"torch.optim.AdamW (the class, not an instance), got {optimizer_class!r}"
        )
    if optimizer_class in REFUSED:
        raise TypeError(
            f"acco_hooks: {name} cannot step the engine's flat shard: it "
            f"{REFUSED[optimizer_class]}. Use an optimizer that updates each element on its "
            "own: torch.optim.AdamW, Adam, SGD, RMSprop, Adagrad, Adadelta, Adamax, NAdam, "
            "RAdam, Rprop or ASGD"
        )
    closure = inspect.signature(optimizer_class.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise TypeError(
            f"acco_hooks: {name}.step() needs a closure that re-evaluates the loss, which a "
            "sharded step on the communication thread cannot run; use a first-order optimizer "
            "such as torch.optim.AdamW or SGD"
        )
    return _probe(optimizer_class, list(group_options), optimizer_kwargs, device)


def _probe(
    optimizer_class: type[torch.optim.Optimizer], options: list[dict[str, Any]],
    optimizer_kwargs: dict[str, Any], device: torch.device,
) -> ShardStateLayout:  # fmt: skip
    """Step a vector whole and in pieces (module docstring); refuse what is not per element."""
    name = _name(optimizer_class)
    generator = torch.Generator().manual_seed(0)
    numel = sum(_PIECES)
    starts = [sum(_PIECES[:i]) for i in range(len(_PIECES))]

    def vector() -> Tensor:
        return torch.randn(numel, generator=generator).to(device)

    start_values = [vector() for _ in options]
    wholes = [v.clone() for v in start_values]
    pieces = [[v[s : s + n].clone() for s, n in zip(starts, _PIECES)] for v in start_values]
    # The group options as the user gave them: only the tensors differ. A bad keyword argument
    # fails here as it would in the engine's own optimizer, in torch's words.
    whole_opt = optimizer_class([{**o, "params": [w]} for o, w in zip(options, wholes)],
                                **optimizer_kwargs)  # fmt: skip
    piece_opt = optimizer_class([{**o, "params": ps} for o, ps in zip(options, pieces)],
                                **optimizer_kwargs)  # fmt: skip
    try:
        for _ in range(_PROBE_STEPS):
            for whole, parts in zip(wholes, pieces):
                whole.grad = vector()
                for part, start, n in zip(parts, starts, _PIECES):
                    part.grad = whole.grad[start : start + n].clone()
            whole_opt.step()
            piece_opt.step()
    except Exception as error:  # noqa: BLE001 - reported as the reason it is refused
        raise TypeError(
            f"acco_hooks: {name} failed to step a flat 1-D parameter ({type(error).__name__}: "
            f"{error}). The engine steps each parameter group as one flat vector cut into 1/N "
            "shards, so the optimizer must update each element on its own: use torch.optim."
            "AdamW, Adam, SGD or another per-element optimizer"
        ) from error

    per_element, per_parameter, differs = set(), set(), []
    for start_value, whole, parts in zip(start_values, wholes, pieces):
        update = whole.detach() - start_value
        joined = torch.cat([p.detach() for p in parts]) - start_value
        if not _close(joined, update):
            differs.append(f"its update ({_gap(joined, update):.1e} of the largest element)")
        whole_state = whole_opt.state.get(whole, {})
        part_states = [piece_opt.state.get(p, {}) for p in parts]
        for key in sorted(set(whole_state).union(*part_states)):
            values = [s.get(key) for s in part_states]
            if all(isinstance(v, Tensor) and v.shape == p.shape for v, p in zip(values, parts)):
                per_element.add(key)
                whole_value = whole_state.get(key)
                if not (isinstance(whole_value, Tensor) and _close(torch.cat(values), whole_value)):
                    differs.append(f"its per-element state {key!r}")
            else:
                per_parameter.add(key)
                if not all(_same(v, whole_state.get(key)) for v in values):
                    differs.append(f"its per-parameter state {key!r}")
    if differs:
        raise TypeError(
            f"acco_hooks: {name}'s step is not per element: stepping a vector whole and cut in "
            f"two pieces gave a different {differs[0]}. The engine steps each parameter group "
            "as one flat vector cut into 1/N shards, so this optimizer would compute something "
            "else than on the parameters themselves, and something that changes with the "
            "number of ranks (it looks at a parameter's shape or at a norm over it). Use an "
            "optimizer that updates each element on its own: torch.optim.AdamW, Adam, SGD, "
            "RMSprop, Adagrad, Adadelta, Adamax, NAdam, RAdam, Rprop or ASGD"
        )
    return ShardStateLayout(frozenset(per_element), frozenset(per_parameter - per_element))


def first_step_state(
    optimizer: torch.optim.Optimizer, shards: list[Tensor]
) -> dict[int, dict[str, Any]]:
    """The state ``optimizer`` has after one step, from a copy of it over zero tensors shaped
    like ``shards`` (one per parameter group): what a checkpoint of a run that never stepped
    holds, so that DCP has tensors to load into."""
    groups = [{**{k: v for k, v in group.items() if k != "params"},
               "params": [torch.zeros_like(shard)]}
              for group, shard in zip(optimizer.param_groups, shards)]  # fmt: skip
    probe = type(optimizer)(groups)
    for group in probe.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    probe.step()
    return probe.state_dict()["state"]


def _close(actual: Tensor, expected: Tensor) -> bool:
    return actual.shape == expected.shape and _gap(actual, expected) <= _RTOL


def _gap(actual: Tensor, expected: Tensor) -> float:
    """The largest difference, relative to the largest magnitude of ``expected``."""
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    gap = float((actual.detach().double() - expected.detach().double()).abs().max())
    return gap / scale if scale > 0 else gap


def _same(value: Any, other: Any) -> bool:
    if not (isinstance(value, Tensor) or isinstance(other, Tensor)):
        return value == other
    if not (isinstance(value, Tensor) and isinstance(other, Tensor)):
        return False
    return value.shape == other.shape and _close(value.float(), other.float())


def _name(optimizer_class: Any) -> str:
    if not isinstance(optimizer_class, type):
        return repr(optimizer_class)
    module = optimizer_class.__module__
    if module.startswith("torch.optim"):  # torch.optim.adafactor.Adafactor -> torch.optim.Adafactor
        module = "torch.optim"
    return f"{module}.{optimizer_class.__qualname__}"
