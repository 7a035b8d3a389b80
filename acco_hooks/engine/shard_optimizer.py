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

import copy
import inspect
import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["PER_ELEMENT", "PER_PARAMETER", "REFUSED", "GroupedOptimizer", "ShardStateLayout",
           "build_shard_optimizer", "check_optimizer", "check_optimizers",
           "constructor_kwargs", "declare_per_element_optimizer", "declare_per_parameter_optimizer",
           "first_step_state", "state_index", "step_and_restore"]  # fmt: skip

# torch.optim classes whose step is per element: the engine runs them exactly (tests/engine/
# test_optimizers.py holds each one to torch's own step on 1 to 4 ranks). A class torch lacks
# is left out.
PER_ELEMENT: frozenset[type] = frozenset(
    cls for name in ("Adadelta", "Adagrad", "Adam", "AdamW", "Adamax", "ASGD", "NAdam", "RAdam",
                     "RMSprop", "Rprop", "SGD")
    if (cls := getattr(torch.optim, name, None)) is not None
)  # fmt: skip

# torch.optim classes whose step looks at each parameter whole (its shape, a norm over it) and
# at no other parameter: they run on the whole-parameter layout (``layout``), each parameter in
# its real shape on the rank that owns it, and why the flat shard cannot run them.
PER_PARAMETER: dict[type, str] = {
    cls: why
    for name, why in {
        "Adafactor": (
            "factors its second moment by a parameter's rows and columns and scales each "
            "update by RMS values over the whole parameter"
        ),
        "Muon": "orthogonalizes each 2-D parameter's update as a whole matrix (Newton-Schulz)",
    }.items()
    if (cls := getattr(torch.optim, name, None)) is not None
}

# torch.optim classes the engine cannot run, and why (a class torch lacks is left out).
REFUSED: dict[type, str] = {
    cls: why
    for name, why in {
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
# Classes their authors declared per parameter (declare_per_parameter_optimizer), probed at the
# run's shapes on whole parameters.
_DECLARED_WHOLE: set[type] = set()

_PROBE_STEPS = 4
_PROBE_NUMEL = 1 << 20  # a group of more elements is probed with every dimension capped
_PROBE_DIM_CAP = 16
_RTOL = 1e-4  # of the largest update element: float rounding, not an algorithm, differs below
_RUNNABLE = ("torch.optim.AdamW, Adam, SGD, RMSprop, Adagrad, Adadelta, Adamax, NAdam, RAdam, "
             "Rprop or ASGD")  # fmt: skip
_WHOLE = ("on whole parameters in their real shapes: "
          + ", ".join(f"torch.optim.{cls.__name__}" for cls in PER_PARAMETER))  # fmt: skip


class ShardStateLayout(NamedTuple):
    """How a shard optimizer's state is checkpointed, and how to build another instance."""

    layout: str
    """``"flat"``: the class steps each element on its own, and runs on a flat shard;
    ``"whole"``: it looks at each parameter whole, and runs on whole parameters (``layout``)."""
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
    for known in (REFUSED, PER_PARAMETER):
        if optimizer_class in known:
            raise TypeError(f"acco_hooks: {_name(optimizer_class)} is not per element: it "
                            f"{known[optimizer_class]}")  # fmt: skip
    _DECLARED.add(optimizer_class)
    return optimizer_class


def declare_per_parameter_optimizer(optimizer_class: type[torch.optim.Optimizer]) -> type:
    """Declare that ``optimizer_class`` steps each parameter from that parameter alone, so that
    the engine runs it on whole parameters.

    On the whole-parameter layout (``layout``) each parameter lies in one rank's shard, whole,
    and that rank steps it in its real shape: a step may look at the parameter's shape (1-D
    biases apart, muP's fan-in), at norms over it (LARS's and LAMB's trust ratios) or factor it
    (Adafactor), and computes there what it computes on the parameters themselves, on any
    number of ranks. It must not look at another parameter: a norm over all of them (clipping
    inside ``step()``, as timm's Lamb or Adan do) would see only the parameters one rank owns.
    The engine probes the class with the run's parameter shapes, dealt to two instances as two
    ranks own them, and refuses it where the probe sees a difference; a probe of a few steps
    cannot see everything, which is why the declaration is yours.

    Subclasses are not declared with their base. Usable as a class decorator.

    Args:
        optimizer_class: a ``torch.optim.Optimizer`` subclass.

    Returns:
        ``optimizer_class``.

    Example::

        >>> @acco_hooks.declare_per_parameter_optimizer
        ... class LARS(torch.optim.SGD):
        ...     def step(self, closure=None):   # scales each matrix's step by a trust ratio
        ...         ...
    """
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(
            "acco_hooks: declare_per_parameter_optimizer takes a torch.optim.Optimizer "
            f"subclass, got {optimizer_class!r}"
        )
    if optimizer_class in REFUSED:
        raise TypeError(f"acco_hooks: {_name(optimizer_class)} cannot run on whole parameters "
                        f"either: it {REFUSED[optimizer_class]}")  # fmt: skip
    _DECLARED_WHOLE.add(optimizer_class)
    return optimizer_class


def check_optimizer(
    optimizer_class: Any, group_options: Iterable[dict[str, Any]],
    optimizer_kwargs: dict[str, Any], device: torch.device,
    group_shapes: Sequence[Sequence[tuple[int, ...]]] | None = None,
    estimate_mode: str | None = None,
) -> ShardStateLayout:  # fmt: skip
    """Refuse an optimizer the flat shard cannot run exactly; return how its state is saved.

    Args:
        optimizer_class: what the user gave as the shard optimizer.
        group_options: each parameter group's options (its dict without ``params``).
        optimizer_kwargs: the keyword arguments the class is built with
            (:func:`constructor_kwargs`).
        device: where the shard lives (the probe runs there, with the run's own options).
        group_shapes: each group's parameter shapes, which a declared class is probed at
            (``None``: one 1-D vector per group, where no parameter is known yet).
        estimate_mode: the run's mode when it has estimate rounds (``"acco"``, ``"auto"``):
            the probe then also steps the estimate's way (:func:`step_and_restore`) and
            refuses a class whose step leaves a trace that cannot be put back.

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
            f"acco_hooks: {name} cannot step the engine's shard: it "
            f"{REFUSED[optimizer_class]}. Use {_RUNNABLE}, or {_WHOLE}"
        )
    closure = inspect.signature(optimizer_class.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise TypeError(
            f"acco_hooks: {name}.step() needs a closure that re-evaluates the loss, which a "
            "sharded step on the communication thread cannot run; use a first-order optimizer "
            "such as torch.optim.AdamW or SGD"
        )
    options = list(group_options)
    known = optimizer_class in PER_PARAMETER
    if known or optimizer_class in _DECLARED_WHOLE:  # whole parameters, in their real shapes
        shapes = [[(11, 7), (5, 13), (6, 6)] for _ in options] if group_shapes is None else [
            _probe_shapes(group) for group in group_shapes
        ]  # fmt: skip
        return _probe(optimizer_class, options, optimizer_kwargs, device, shapes, known,
                      estimate_mode, whole=True)  # fmt: skip
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
            f"declare_per_element_optimizer({optimizer_class.__qualname__}); if it looks at "
            "each parameter whole but never at another one (a trust ratio, a shape), declare "
            f"it with acco_hooks.declare_per_parameter_optimizer("
            f"{optimizer_class.__qualname__}) and it runs on whole parameters"
        )
    shapes = [[(11,)] for _ in options] if known or group_shapes is None else [
        _probe_shapes(group) for group in group_shapes
    ]  # fmt: skip
    return _probe(optimizer_class, options, optimizer_kwargs, device, shapes, known,
                  estimate_mode)


def constructor_kwargs(
    optimizer_class: Any, optimizer_kwargs: dict[str, Any], classes: Sequence[Any],
    group_options: Sequence[dict[str, Any]], group_names: Sequence[str],
) -> dict[Any, dict[str, Any]]:  # fmt: skip
    """The keyword arguments each class of a run is built with: torch's own rule.

    In torch a parameter group takes, for every option it does not set, the defaults of the
    optimizer that steps it, which are that optimizer's keyword arguments. So the keyword
    arguments given beside ``optimizer_class`` are ``optimizer_class``'s: every group it steps,
    naming it or naming no class, inherits them. A group that names another class is stepped by
    an instance of that class built with none, and takes that class's own defaults. A class
    whose ``__init__`` requires an argument (many LARS ports require ``lr``) is built with the
    value of its first group, which every group stepped by it must then set (each group keeps
    its own value, as in torch).

    Args:
        optimizer_class, optimizer_kwargs: the run's optimizer and its keyword arguments.
        classes, group_options, group_names: each group's class, options (without ``params``)
            and first parameter's name (what a refusal names).

    Returns:
        Per class, in the groups' order, its keyword arguments.

    Raises:
        TypeError: a required argument that neither the keyword arguments nor every group of
            the class give.
    """
    out: dict[Any, dict[str, Any]] = {}
    for cls in dict.fromkeys(classes):
        kwargs = dict(optimizer_kwargs) if cls is optimizer_class else {}
        stepped = [gi for gi, c in enumerate(classes) if c is cls]
        for argument in _required_arguments(cls):
            if argument in kwargs:
                continue
            without = [gi for gi in stepped if argument not in group_options[gi]]
            if without:
                name = _name(cls)
                raise TypeError(
                    f"acco_hooks: {name}.__init__ requires {argument!r}, and the group of "
                    f"{group_names[without[0]]} is stepped by {name} without one: "
                    + (f"pass {argument}= beside the optimizer class (the keyword arguments are "
                       f"{name}'s defaults, which every group it steps inherits), or set "
                       f"{argument!r} in every group it steps" if cls is optimizer_class else
                       f"set {argument!r} in every group that names optimizer_class={name} (a "
                       "group that names another class than the optimizer's takes that class's "
                       "own defaults, not the keyword arguments)")
                )  # fmt: skip
            kwargs[argument] = group_options[stepped[0]][argument]
        out[cls] = kwargs
    return out


def _required_arguments(cls: Any) -> list[str]:
    """The arguments of ``cls.__init__`` after ``params`` that have no default."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        return []  # check_optimizer refuses it
    try:
        parameters = list(inspect.signature(cls.__init__).parameters.values())[2:]
    except (TypeError, ValueError):  # no signature to read: torch's own error then
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in parameters
            if p.kind in kinds and p.default is inspect.Parameter.empty]  # fmt: skip


def check_optimizers(
    classes: Sequence[Any], group_options: Sequence[dict[str, Any]],
    class_kwargs: dict[Any, dict[str, Any]], device: torch.device,
    group_shapes: Sequence[Sequence[tuple[int, ...]]], estimate_mode: str | None = None,
) -> list[ShardStateLayout]:  # fmt: skip
    """:func:`check_optimizer` for parameter groups that may name their own class.

    Args:
        classes: each group's class (the run's optimizer class where it names none).
        group_options, group_shapes: each group's options and parameter shapes.
        class_kwargs: each class's keyword arguments (:func:`constructor_kwargs`).
        device, estimate_mode: as :func:`check_optimizer`'s.

    Returns:
        Each group's :class:`ShardStateLayout`, at its index.
    """
    out: list[ShardStateLayout | None] = [None] * len(classes)
    for cls in dict.fromkeys(classes):
        indices = [i for i, c in enumerate(classes) if c is cls]
        layout = check_optimizer(
            cls, [group_options[i] for i in indices], class_kwargs[cls], device,
            [group_shapes[i] for i in indices], estimate_mode,
        )  # fmt: skip
        for i in indices:
            out[i] = layout
    return out


class GroupedOptimizer(torch.optim.Optimizer):
    """Several torch optimizers stepped as one: the shard optimizer of a run whose parameter
    groups name different classes (Muon for the matrices, AdamW for the rest).

    Its ``param_groups`` are the classes' own group dicts, in the run's group order, so that an
    LR scheduler built over it (``lr_scheduler=``) sets each class's learning rate; its
    ``state`` is the one dict every class keeps its state in; :meth:`step` steps each class.
    Its ``defaults`` are the options every class has (values of the first class): a scheduler
    that looks for one there (OneCycleLR's and CyclicLR's ``momentum`` or ``betas``) finds it
    only where every group keeps it.

    Args:
        optimizers: one instance per class, over the groups that name it.
        order: per group of the run, ``(optimizer index, its group index)``.
        part_kwargs: each instance's keyword arguments (what another instance is built with).
    """

    def __init__(
        self, optimizers: list[torch.optim.Optimizer], order: list[tuple[int, int]],
        part_kwargs: list[dict[str, Any]],
    ) -> None:  # fmt: skip
        self.optimizers, self.part_kwargs = optimizers, part_kwargs
        self.order = order
        shared = {key: value for key, value in optimizers[0].defaults.items()
                  if all(key in other.defaults for other in optimizers[1:])}  # fmt: skip
        super().__init__([optimizers[o].param_groups[i] for o, i in order], shared)
        self._share()

    def _share(self) -> None:
        """Every class reads the group dicts and the state this optimizer holds."""
        for o, optimizer in enumerate(self.optimizers):
            optimizer.param_groups = [self.param_groups[k] for k, (owner, _) in
                                      enumerate(self.order) if owner == o]  # fmt: skip
            optimizer.state = self.state

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """Step every class's groups."""
        if closure is not None:
            raise TypeError("acco_hooks: the shard optimizer takes no closure")
        for optimizer in self.optimizers:
            optimizer.step()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # new group dicts and state: share them again
        self._share()

    def __repr__(self) -> str:
        return "GroupedOptimizer(" + ", ".join(type(o).__name__ for o in self.optimizers) + ")"


def build_shard_optimizer(
    classes: Sequence[type], shard_groups: list[dict[str, Any]],
    class_kwargs: dict[type, dict[str, Any]],
) -> torch.optim.Optimizer:  # fmt: skip
    """The shard optimizer over ``shard_groups`` (every group, at its index, stepped by its
    class in ``classes``, built with ``class_kwargs``, :func:`constructor_kwargs`): one
    instance when one class steps every group, else a :class:`GroupedOptimizer`."""
    kinds = list(dict.fromkeys(classes))
    if len(kinds) == 1:
        return kinds[0](shard_groups, **class_kwargs[kinds[0]])
    order = [(kinds.index(cls), sum(c is cls for c in classes[:k]))
             for k, cls in enumerate(classes)]  # fmt: skip
    part_kwargs = [class_kwargs[cls] for cls in kinds]
    optimizers = [cls([g for g, c in zip(shard_groups, classes) if c is cls], **kwargs)
                  for cls, kwargs in zip(kinds, part_kwargs)]  # fmt: skip
    return GroupedOptimizer(optimizers, order, part_kwargs)


def _probe_shapes(shapes: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """A group's parameter shapes as probed: themselves, or capped when the group is large."""
    if sum(math.prod(s) for s in shapes) <= _PROBE_NUMEL:
        return [tuple(s) for s in shapes]
    return [tuple(min(d, _PROBE_DIM_CAP) for d in s) for s in shapes]


def _probe(
    optimizer_class: type[torch.optim.Optimizer], options: list[dict[str, Any]],
    optimizer_kwargs: dict[str, Any], device: torch.device,
    shapes: list[list[tuple[int, ...]]], known: bool, estimate_mode: str | None = None,
    whole: bool = False,
) -> ShardStateLayout:  # fmt: skip
    """Step the groups whole and in two pieces (module docstring); refuse what differs.

    Flat: each group's vector cut inside a parameter, into pieces of different lengths, as two
    ranks' flat shards. ``whole``: each group's parameters dealt to the two pieces in turn, in
    their shapes, as two ranks own them on the whole-parameter layout. With ``estimate_mode``
    the pieces also take an estimate step before each real one, as the engine's estimate rounds
    do (:func:`step_and_restore`): it must leave the instance as it found it and equal the real
    step that follows on the same gradient."""
    name = _name(optimizer_class)
    generator = torch.Generator().manual_seed(0)

    def random(shape: tuple[int, ...]) -> Tensor:
        return torch.randn(shape, generator=generator).to(device)

    wholes = [[random(s) for s in group] for group in shapes]
    starts = [[w.detach().clone() for w in group] for group in wholes]
    # per group, the two pieces: lists of tensors, and their order against the whole's elements
    if whole:  # dealt in turn over every group's parameters: a coupling across groups shows
        first = [0, *itertools.accumulate(len(group) for group in wholes)]
        orders = [[[i for i in range(len(group)) if (first[gi] + i) % 2 == k] for k in range(2)]
                  for gi, group in enumerate(wholes)]  # fmt: skip
        pieces = [[[group[i].detach().clone() for i in order] for order in two]
                  for group, two in zip(wholes, orders)]  # fmt: skip
    else:
        cuts = [max(1, sum(math.prod(s) for s in group) * 4 // 11) for group in shapes]
        flats = [torch.cat([w.reshape(-1) for w in group]) for group in wholes]
        pieces = [[[f[:c].clone()], [f[c:].clone()]] for f, c in zip(flats, cuts)]
    # The group options as the user gave them: only the tensors differ. A bad keyword argument
    # fails here as it would in the engine's own optimizer, in torch's words.
    try:
        whole_opt = optimizer_class([{**o, "params": ws} for o, ws in zip(options, wholes)],
                                    **optimizer_kwargs)  # fmt: skip
    except ValueError as error:
        if not whole:
            raise
        shapes_seen = sorted({tuple(s) for group in shapes for s in group})
        raise TypeError(
            f"acco_hooks: {name} refused the parameters of its group(s), shaped "
            f"{shapes_seen} ({error}). Put in a group that names optimizer_class={name} only "
            "what it steps (torch.optim.Muon: 2-D matrices), and the rest (biases, norms) in "
            "groups stepped by the default optimizer"
        ) from error
    # one instance per piece, as one per rank's shard
    piece_opts = [optimizer_class([{**o, "params": two[i]} for o, two in zip(options, pieces)],
                                  **optimizer_kwargs) for i in range(2)]  # fmt: skip

    def joined(tensors: list[Tensor], two: list[list[Tensor]], group: int) -> list[Tensor]:
        """The whole's tensors in the pieces' order, flattened: what the pieces hold."""
        if not whole:
            return [torch.cat([t.reshape(-1) for t in tensors])]
        return [tensors[i] for order in orders[group] for i in order]

    try:
        for _ in range(_PROBE_STEPS):
            for gi, (group, two) in enumerate(zip(wholes, pieces)):
                for w in group:
                    w.grad = random(w.shape)
                if whole:
                    for order, part in zip(orders[gi], two):
                        for i, p in zip(order, part):
                            p.grad = group[i].grad.clone()
                else:
                    (flat,) = joined([w.grad for w in group], two, gi)
                    two[0][0].grad = flat[: two[0][0].numel()].clone()
                    two[1][0].grad = flat[two[0][0].numel() :].clone()
            estimates = [] if estimate_mode is None else [_estimate(opt) for opt in piece_opts]
            whole_opt.step()
            for opt in piece_opts:
                opt.step()
            for opt, (estimated, began, changed) in zip(piece_opts, estimates):
                if changed:
                    raise _EstimateRefusal(
                        f"its step changes {', '.join(map(repr, changed))} of the optimizer "
                        "in place, outside optimizer.state and its groups' options, which the "
                        "estimate step does not put back"
                    )  # fmt: skip
                params = [p for group in opt.param_groups for p in group["params"]]
                if not all(_close(e, p.detach() - b) for e, p, b in zip(estimated, params, began)):
                    raise _EstimateRefusal(
                        "its estimate step gave another update than the real step that followed "
                        "on the same gradient: the step reads something it changes outside "
                        "optimizer.state, its groups' options and its own attributes (a global, "
                        "a closure's variable), which the estimate step does not put back"
                    )  # fmt: skip
    except _EstimateRefusal as refusal:
        raise TypeError(
            f"acco_hooks: {name} cannot take the estimate step of mode {estimate_mode!r}: {refusal}. "
            "That mode steps the optimizer once more for each estimate θ̃ (a real step on a "
            "snapshot, whose every trace is then put back: the parameters, optimizer.state, the "
            "groups' options and the attributes a step rebinds, such as self.calls += 1), and "
            "a trace left behind would count every estimate as a step. Keep what a step "
            "counts or accumulates in optimizer.state[p] (as torch's step counts) or rebind "
            "the attribute instead of changing it in place; or choose mode 'dpu' or 'ddp', "
            "which have no estimate step"
        ) from None
    except Exception as error:  # reported as the reason it is refused
        what = "its parameters dealt to two instances" if whole else "a flat 1-D piece of"
        raise TypeError(
            f"acco_hooks: {name} failed to step {what} a parameter group "
            f"({type(error).__name__}: {error}). "
            + ("" if whole else "The engine steps each parameter group as one flat vector cut "
               "into one shard per rank, so the optimizer must update each element on its own: "
               f"use {_RUNNABLE}")
        ) from error

    per_element, per_parameter, differs = set(), set(), []
    for gi, (group, start, two) in enumerate(zip(wholes, starts, pieces)):
        held = [p for part in two for p in part]  # the pieces' tensors, in the pieces' order
        update = joined([w.detach() - s for w, s in zip(group, start)], two, gi)
        now = [p.detach() for p in held] if whole else [torch.cat([p.detach() for p in held])]
        moved = [p - s for p, s in zip(now, joined(start, two, gi))]
        if not all(_close(m, u) for m, u in zip(moved, update)):
            gap = max(_gap(m, u) for m, u in zip(moved, update))
            differs.append(f"its update ({gap:.1e} of the largest element)")
        whole_states = [whole_opt.state.get(w, {}) for w in group]
        part_states = [opt.state.get(p, {}) for opt, part in zip(piece_opts, two) for p in part]
        for key in sorted(set().union(*whole_states, *part_states)):
            values = [s.get(key) for s in part_states]
            if all(isinstance(v, Tensor) and v.shape == p.shape for v, p in zip(values, held)):
                per_element.add(key)
                whole_values = [s.get(key) for s in whole_states]
                same = all(isinstance(v, Tensor) and v.shape == w.shape
                           for v, w in zip(whole_values, group))  # fmt: skip
                if same:
                    got = values if whole else [torch.cat([v.reshape(-1) for v in values])]
                    same = all(_close(a.reshape(-1), b.reshape(-1))
                               for a, b in zip(got, joined(whole_values, two, gi)))  # fmt: skip
                if not same:
                    differs.append(f"its per-element state {key!r}")
            else:
                per_parameter.add(key)
                # whole: each parameter's own (Adafactor's row and column variances); flat:
                # one value for every parameter of the group (a step count)
                pairs = (zip(values, joined(whole_states, two, gi)) if whole
                         else ((v, s) for v in values for s in whole_states))  # fmt: skip
                if not all(_same(v, s.get(key)) for v, s in pairs):
                    differs.append(f"its per-parameter state {key!r}")
    if differs:
        raise TypeError(
            f"acco_hooks: {name} was "
            + ("expected to step each " + ("parameter" if whole else "element") + " on its own"
               if known else "declared per parameter (declare_per_parameter_optimizer)"
               if whole else "declared per element (declare_per_element_optimizer)")
            + ", but stepping this run's parameter groups whole and in two pieces, each "
            "stepped by an instance of its own as ranks' shards are, gave a different "
            f"{differs[0]}: its step looks at "
            + ("several parameters at once (a norm over all of them)" if whole else
               "a parameter's shape or at a norm over a parameter or over several")
            + ", and on the engine's shards it would compute something else, and something "
            f"that changes with the number of ranks. Use {_RUNNABLE}"
        )
    return ShardStateLayout("whole" if whole else "flat", frozenset(per_element),
                            frozenset(per_parameter - per_element),
                            dict(optimizer_kwargs))  # fmt: skip


class _EstimateRefusal(Exception):
    """What the probe's estimate steps found (:func:`_probe`)."""


def _estimate(optimizer: torch.optim.Optimizer) -> tuple[list[Tensor], list[Tensor], list[str]]:
    """One estimate step of the probe: the update it estimated, the parameters it started from,
    and the attributes of the optimizer it left changed (the gradients are put back too: a
    step may clip them in place)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    starts = [p.detach().clone() for p in params]
    grads = [None if p.grad is None else p.grad.clone() for p in params]
    before = {key: _copy(value) for key, value in _own_attributes(optimizer).items()}
    outputs = [torch.empty_like(p) for p in params]
    step_and_restore(optimizer, outputs)
    for p, grad in zip(params, grads):
        p.grad = grad
    after = _own_attributes(optimizer)
    changed = sorted(key for key in before.keys() | after.keys()
                     if key not in before or key not in after
                     or not _equal(before[key], after[key]))  # fmt: skip
    return [o - s for o, s in zip(outputs, starts)], starts, changed


def step_and_restore(optimizer: torch.optim.Optimizer, outputs: Sequence[Tensor]) -> None:
    """Write the parameters ``optimizer.step()`` would make into ``outputs`` and leave no trace:
    ACCO's estimate θ̃ for a class whose step the engine does not recompute (``peek``).

    Steps for real, then puts back the parameters, ``state`` (its tensors in place; what the
    step created, dropped), the groups' options, and the optimizer's own attributes that the
    step bound anew or created (a count kept as ``self.calls += 1``). An attribute the step
    changes in place (a list it appends to, a tensor it adds to) cannot be put back so: the
    probe refuses that class by name where a run has estimate rounds (:func:`check_optimizer`).

    Args:
        optimizer: its params hold θ and their ``.grad`` holds g.
        outputs: one tensor per parameter, in ``param_groups`` order: receives ``Opt(θ, g)``.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved_params = [p.detach().clone() for p in params]
    saved_state = {
        p: {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in optimizer.state[p].items()}
        for p in params
        if p in optimizer.state
    }
    saved_groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    saved_attributes = _own_attributes(optimizer)
    optimizer.step()
    with torch.no_grad():
        for p, out, saved in zip(params, outputs, saved_params):
            out.copy_(p)
            p.copy_(saved)
    for p in params:
        if p not in saved_state:
            optimizer.state.pop(p, None)  # state created lazily by this step: drop it
            continue
        state = optimizer.state[p]
        for key in list(state):
            if key not in saved_state[p]:
                del state[key]
        for key, value in saved_state[p].items():
            if isinstance(value, Tensor) and isinstance(state.get(key), Tensor):
                state[key].copy_(value)
            else:
                state[key] = value
    for group, saved in zip(optimizer.param_groups, saved_groups):
        for key in [k for k in group if k != "params" and k not in saved]:
            del group[key]
        group.update(saved)
    now = _own_attributes(optimizer)
    for key in now.keys() - saved_attributes.keys():
        delattr(optimizer, key)
    for key, value in saved_attributes.items():
        if now.get(key) is not value:
            setattr(optimizer, key, value)


def _own_attributes(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The instance's attributes but its state and groups (which the estimate puts back by
    their contents)."""
    return {k: v for k, v in vars(optimizer).items() if k not in ("state", "param_groups")}


def _copy(value: Any) -> Any:
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - compared by identity then: an in-place change is unseen
        return _Uncopyable(value)


class _Uncopyable(NamedTuple):
    value: Any


def _equal(before: Any, after: Any) -> bool:
    """Whether ``after`` holds what ``before`` (a deep copy) held; one that could not be copied
    is not known to, and counts as changed."""
    if isinstance(before, _Uncopyable):
        return False
    if isinstance(before, Tensor) or isinstance(after, Tensor):
        return (isinstance(before, Tensor) and isinstance(after, Tensor)
                and before.shape == after.shape and before.dtype == after.dtype
                and bool(torch.equal(before.cpu(), after.detach().cpu())))  # fmt: skip
    if isinstance(before, dict) and isinstance(after, dict):
        return before.keys() == after.keys() and all(_equal(before[k], after[k]) for k in before)
    if isinstance(before, (list, tuple)) and isinstance(after, (list, tuple)):
        return (type(before) is type(after) and len(before) == len(after)
                and all(_equal(a, b) for a, b in zip(before, after)))  # fmt: skip
    try:
        return bool(before == after)
    except Exception:  # noqa: BLE001 - no equality to ask: not known to be equal
        return False


def state_index(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """``id(tensor)`` -> the tensor's index in ``optimizer.state_dict()["state"]`` (torch
    numbers the parameters over the groups, in order)."""
    params = (p for group in optimizer.param_groups for p in group["params"])
    return {id(p): i for i, p in enumerate(params)}


def first_step_state(
    optimizer: torch.optim.Optimizer, optimizer_kwargs: dict[str, Any]
) -> dict[int, dict[str, Any]]:
    """The state ``optimizer`` has after one step, from a copy of it over zero tensors shaped
    like its own: what a checkpoint of a run that never stepped holds, so that DCP has tensors
    to load into. ``optimizer_kwargs``: what it was built with (its class may require
    arguments; the groups' own options override them); a :class:`GroupedOptimizer` knows each
    class's."""
    index = state_index(optimizer)
    grouped = isinstance(optimizer, GroupedOptimizer)
    parts = zip(optimizer.optimizers, optimizer.part_kwargs) if grouped else [
        (optimizer, optimizer_kwargs)]  # fmt: skip
    out = {}
    for part, kwargs in parts:
        zeros = [[torch.zeros_like(p) for p in group["params"]] for group in part.param_groups]
        probe = type(part)([{**{k: v for k, v in group.items() if k != "params"}, "params": z}
                            for group, z in zip(part.param_groups, zeros)], **kwargs)  # fmt: skip
        for z in (z for group in zeros for z in group):
            z.grad = torch.zeros_like(z)
        probe.step()
        for group, z_group in zip(part.param_groups, zeros):
            for p, z in zip(group["params"], z_group):
                if z in probe.state:
                    out[index[id(p)]] = probe.state[z]
    return out


def _close(actual: Tensor, expected: Tensor) -> bool:
    return actual.shape == expected.shape and _gap(actual, expected) <= _RTOL


def _gap(actual: Tensor, expected: Tensor) -> float:
    """The largest difference, relative to the largest magnitude of ``expected``."""
    if not expected.numel():
        return 0.0
    scale = float(expected.detach().abs().max())
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
