"""Which optimizers the engine can step on its flat shard, and which of their state is per element.

The engine steps one flat 1-D vector per parameter group: the group's parameters laid end to
end, padded, cut into 1/N shards (``buffers``), one shard per rank, each stepped by an optimizer
instance of its own. An optimizer whose step is **per element** (element i of the update
depends only on element i of the parameter, its gradient and its state, and on per-parameter
values such as a step count, the same for every parameter of a group) computes on that shard
exactly what it computes on the parameters themselves, on any number of ranks. One that looks
at a parameter's shape, at a norm over it or over several parameters computes something else
there, and something that changes with N: Adafactor factors its second moment by rows and
columns; Muon orthogonalizes whole matrices; LAMB's trust ratio divides two norms; LARS and
muP-style steps treat 1-D and 2-D parameters apart; Lamb and Adan clip by a norm over all
their parameters inside ``step()``.

No test run on a few steps can prove a step per element (one may change after its warm-up), so
the engine runs only what is known to be:

* :data:`PER_ELEMENT`: the ``torch.optim`` classes whose step is per element, themselves, not
  a subclass (it may change ``step()``);
* classes their author declared per element with :func:`declare_per_element_optimizer`, the
  documented opt-in, which a probe then holds to the run's own parameter shapes (below).

Everything else is refused by name when the engine is built, before any process group exists:
``torch.optim``'s classes the flat shard cannot run with the reason (:data:`REFUSED`), any
other class with what to do.

**The probe** steps copies of the run's parameter groups (random values of their real shapes,
with the run's group options) for a few steps in two ways: whole, in one instance, as torch
would; and flat, each group's vector cut in two pieces of different lengths inside a parameter,
each piece stepped by an instance of its own, as two ranks' shards are. A per-element step
gives the same update (to float rounding) and per-parameter state equal in every piece; a
difference, or a step that fails on a flat piece, refuses the class naming what differed. Large
groups are probed at their shapes with every dimension capped (:data:`_PROBE_DIM_CAP`): the same
numbers of dimensions, small tensors.

The probe also tells how the state is checkpointed (:class:`ShardStateLayout`): a key whose
value has the piece's shape in every piece (whose lengths differ) is per element, and is
sharded and resharded like the master weights; every other key is one value per parameter,
equal on every rank (a step count), saved once.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["PER_ELEMENT", "REFUSED", "ShardStateLayout", "check_optimizer",
           "declare_per_element_optimizer", "first_step_state"]  # fmt: skip

# torch.optim classes whose step is per element: the engine runs them exactly (tests/engine/
# test_optimizers.py holds each one to torch's own step on 1 to 4 ranks). A class torch lacks
# is left out.
PER_ELEMENT: frozenset[type] = frozenset(
    cls for name in ("Adadelta", "Adagrad", "Adam", "AdamW", "Adamax", "ASGD", "NAdam", "RAdam",
                     "RMSprop", "Rprop", "SGD")
    if (cls := getattr(torch.optim, name, None)) is not None
)  # fmt: skip

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

# Classes their authors declared per element (declare_per_element_optimizer), probed at the
# run's shapes.
_DECLARED: set[type] = set()

_PROBE_STEPS = 4
_PROBE_NUMEL = 1 << 20  # a group of more elements is probed with every dimension capped
_PROBE_DIM_CAP = 16
_RTOL = 1e-4  # of the largest update element: float rounding, not an algorithm, differs below
_RUNNABLE = ("torch.optim.AdamW, Adam, SGD, RMSprop, Adagrad, Adadelta, Adamax, NAdam, RAdam, "
             "Rprop or ASGD")  # fmt: skip


class ShardStateLayout(NamedTuple):
    """How a shard optimizer's state is checkpointed, and how to build another instance."""

    per_element: frozenset[str]
    """Keys with one value per parameter element (moments, momentum): sharded like the master."""
    per_parameter: frozenset[str]
    """Keys with one value per parameter (a step count): the same on every rank."""
    optimizer_kwargs: dict[str, Any]
    """The keyword arguments the run's optimizer was built with (a class may require some)."""


def declare_per_element_optimizer(optimizer_class: type[torch.optim.Optimizer]) -> type:
    """Declare that ``optimizer_class``'s step is per element, so that the engine runs it.

    The engine steps each parameter group as a flat vector cut into one shard per rank, each
    shard by an optimizer instance of its own (module docstring): only a step in which element
    i of the update depends on element i alone (and on per-parameter values such as a step
    count) computes there what it computes on the parameters themselves. Declare a class only
    if that holds for every step, every parameter shape and every option you use: no branch on
    ``p.ndim`` or ``p.shape``, no norm over a parameter or over several, no behaviour that
    starts after a warm-up. The engine still probes it with the run's parameter shapes and one
    instance per piece, and refuses it where the probe sees a difference; a probe of a few
    steps cannot see everything, which is why the declaration is yours.

    Subclasses are not declared with their base: each class that changes ``step()`` must be
    declared itself. Usable as a class decorator.

    Args:
        optimizer_class: a ``torch.optim.Optimizer`` subclass.

    Returns:
        ``optimizer_class``.

    Example::

        >>> @acco_hooks.declare_per_element_optimizer
        ... class ClippedSGD(torch.optim.SGD):
        ...     def step(self, closure=None):   # clamps each gradient element, then SGD's step
        ...         ...
    """
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(
            "acco_hooks: declare_per_element_optimizer takes a torch.optim.Optimizer subclass, "
            f"got {optimizer_class!r}"
        )
    if optimizer_class in REFUSED:
        raise TypeError(f"acco_hooks: {_name(optimizer_class)} is not per element: it "
                        f"{REFUSED[optimizer_class]}")  # fmt: skip
    _DECLARED.add(optimizer_class)
    return optimizer_class


def check_optimizer(
    optimizer_class: Any, group_options: Iterable[dict[str, Any]],
    optimizer_kwargs: dict[str, Any], device: torch.device,
    group_shapes: Sequence[Sequence[tuple[int, ...]]] | None = None,
) -> ShardStateLayout:  # fmt: skip
    """Refuse an optimizer the flat shard cannot run exactly; return how its state is saved.

    Args:
        optimizer_class: what the user gave as the shard optimizer.
        group_options: each parameter group's options (its dict without ``params``).
        optimizer_kwargs: the optimizer's keyword arguments.
        device: where the shard lives (the probe runs there, with the run's own options).
        group_shapes: each group's parameter shapes, which a declared class is probed at
            (``None``: one 1-D vector per group, where no parameter is known yet).

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
            f"own: {_RUNNABLE}"
        )
    closure = inspect.signature(optimizer_class.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise TypeError(
            f"acco_hooks: {name}.step() needs a closure that re-evaluates the loss, which a "
            "sharded step on the communication thread cannot run; use a first-order optimizer "
            "such as torch.optim.AdamW or SGD"
        )
    known = optimizer_class in PER_ELEMENT
    if not known and optimizer_class not in _DECLARED:
        raise TypeError(
            f"acco_hooks: {name} is not known to step each parameter element on its own, and "
            "the engine steps each parameter group as a flat vector cut into one shard per "
            "rank: a step that looks at a parameter's shape (1-D biases apart, p.shape[1]), at "
            "a norm over a parameter or over all of them (a trust ratio, clipping inside "
            "step()), or that changes after a warm-up, would compute something else there, "
            "silently, and something that changes with the number of ranks. Use "
            f"{_RUNNABLE}; or, if every step of {optimizer_class.__qualname__} updates each "
            "element from that element alone, declare it with acco_hooks."
            f"declare_per_element_optimizer({optimizer_class.__qualname__})"
        )
    options = list(group_options)
    shapes = [[(11,)] for _ in options] if known or group_shapes is None else [
        _probe_shapes(group) for group in group_shapes
    ]  # fmt: skip
    return _probe(optimizer_class, options, optimizer_kwargs, device, shapes, known)


def _probe_shapes(shapes: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """A group's parameter shapes as probed: themselves, or capped when the group is large."""
    if sum(math.prod(s) for s in shapes) <= _PROBE_NUMEL:
        return [tuple(s) for s in shapes]
    return [tuple(min(d, _PROBE_DIM_CAP) for d in s) for s in shapes]


def _probe(
    optimizer_class: type[torch.optim.Optimizer], options: list[dict[str, Any]],
    optimizer_kwargs: dict[str, Any], device: torch.device,
    shapes: list[list[tuple[int, ...]]], known: bool,
) -> ShardStateLayout:  # fmt: skip
    """Step the groups whole and cut in two pieces (module docstring); refuse what differs."""
    name = _name(optimizer_class)
    generator = torch.Generator().manual_seed(0)

    def random(shape: tuple[int, ...]) -> Tensor:
        return torch.randn(shape, generator=generator).to(device)

    wholes = [[random(s) for s in group] for group in shapes]
    starts = [[w.detach().clone() for w in group] for group in wholes]
    # each group's flat vector cut inside a parameter, into pieces of different lengths
    cuts = [max(1, sum(math.prod(s) for s in group) * 4 // 11) for group in shapes]
    flats = [torch.cat([w.reshape(-1) for w in group]) for group in wholes]
    pieces = [[f[:c].clone(), f[c:].clone()] for f, c in zip(flats, cuts)]
    # The group options as the user gave them: only the tensors differ. A bad keyword argument
    # fails here as it would in the engine's own optimizer, in torch's words.
    whole_opt = optimizer_class([{**o, "params": ws} for o, ws in zip(options, wholes)],
                                **optimizer_kwargs)  # fmt: skip
    # one instance per piece, as one per rank's shard
    piece_opts = [optimizer_class([{**o, "params": [ps[i]]} for o, ps in zip(options, pieces)],
                                  **optimizer_kwargs) for i in range(2)]  # fmt: skip
    try:
        for _ in range(_PROBE_STEPS):
            for group, parts, cut in zip(wholes, pieces, cuts):
                for w in group:
                    w.grad = random(w.shape)
                flat = torch.cat([w.grad.reshape(-1) for w in group])
                parts[0].grad, parts[1].grad = flat[:cut].clone(), flat[cut:].clone()
            whole_opt.step()
            for opt in piece_opts:
                opt.step()
    except Exception as error:  # reported as the reason it is refused
        raise TypeError(
            f"acco_hooks: {name} failed to step a flat 1-D piece of a parameter group "
            f"({type(error).__name__}: {error}). The engine steps each parameter group as one "
            "flat vector cut into one shard per rank, so the optimizer must update each element "
            f"on its own: use {_RUNNABLE}"
        ) from error

    per_element, per_parameter, differs = set(), set(), []
    for group, start, parts in zip(wholes, starts, pieces):
        update = torch.cat([(w.detach() - s).reshape(-1) for w, s in zip(group, start)])
        joined = torch.cat([p.detach() for p in parts]) - torch.cat([s.reshape(-1) for s in start])
        if not _close(joined, update):
            differs.append(f"its update ({_gap(joined, update):.1e} of the largest element)")
        whole_states = [whole_opt.state.get(w, {}) for w in group]
        part_states = [opt.state.get(p, {}) for opt, p in zip(piece_opts, parts)]
        for key in sorted(set().union(*whole_states, *part_states)):
            values = [s.get(key) for s in part_states]
            if all(isinstance(v, Tensor) and v.shape == p.shape for v, p in zip(values, parts)):
                per_element.add(key)
                whole_values = [s.get(key) for s in whole_states]
                if not (all(isinstance(v, Tensor) and v.shape == w.shape
                            for v, w in zip(whole_values, group))
                        and _close(torch.cat(values),
                                   torch.cat([v.reshape(-1) for v in whole_values]))):
                    differs.append(f"its per-element state {key!r}")
            else:
                per_parameter.add(key)
                if not all(_same(v, s.get(key)) for v in values for s in whole_states):
                    differs.append(f"its per-parameter state {key!r}")
    if differs:
        raise TypeError(
            f"acco_hooks: {name} was "
            + ("expected to step each element on its own" if known
               else "declared per element (declare_per_element_optimizer)")
            + f", but stepping this run's parameter groups whole and cut in two pieces, each "
            f"stepped by an instance of its own as ranks' shards are, gave a different "
            f"{differs[0]}: its step looks at a parameter's shape or at a norm over a parameter "
            "or over several, and on the engine's shards it would compute something else, and "
            f"something that changes with the number of ranks. Use {_RUNNABLE}"
        )
    return ShardStateLayout(frozenset(per_element), frozenset(per_parameter - per_element),
                            dict(optimizer_kwargs))


def first_step_state(
    optimizer: torch.optim.Optimizer, shards: list[Tensor], optimizer_kwargs: dict[str, Any]
) -> dict[int, dict[str, Any]]:
    """The state ``optimizer`` has after one step, from a copy of it over zero tensors shaped
    like ``shards`` (one per parameter group that has parameters): what a checkpoint of a run that never stepped
    holds, so that DCP has tensors to load into. ``optimizer_kwargs``: what it was built with
    (its class may require arguments; the groups' own options override them)."""
    zeros = iter(torch.zeros_like(shard) for shard in shards)  # an empty group has no shard
    groups = [{**{k: v for k, v in group.items() if k != "params"},
               "params": [next(zeros)] if group["params"] else []}
              for group in optimizer.param_groups]  # fmt: skip
    probe = type(optimizer)(groups, **optimizer_kwargs)
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
