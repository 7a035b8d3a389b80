"""What the engine refuses (a sparse gradient, a missing one, a moved model), and how it reports
a non-finite gradient."""

from __future__ import annotations

import warnings

import torch

from acco_hooks._buffers import GroupBuffers

__all__ = ["check_round_inputs", "nonfinite_error", "sparse_gradient_error", "warn_skipped_round"]


def check_round_inputs(
    buffers: list[GroupBuffers], grad_arrived: list[list[bool]], round_index: int,
    frozen: list[tuple[str, torch.Tensor]],
) -> None:  # fmt: skip
    """Every parameter got a gradient, none was moved since the engine was built, and none of
    those frozen then was unfrozen since (a torch optimizer would train it now)."""
    unfrozen = [name for name, p in frozen if p.requires_grad]
    if unfrozen:
        raise RuntimeError(
            f"acco_hooks: {_some(unfrozen)} had requires_grad=False when the optimizer was "
            "built and requires grad now: the engine left it out and would never train it "
            "(a torch optimizer given it would). Build the optimizer after unfreezing, or "
            "give the unfrozen parameters to a new one"
        )
    moved = [name for g in buffers for name in g.moved_params()]
    if moved:
        raise RuntimeError(
            f"acco_hooks: {_some(moved)} moved or changed dtype after the optimizer was "
            "built (model.to(), a dtype cast, param.data = ...): the engine holds views of "
            "the old memory and would train parameters the model no longer uses. Move or "
            "cast the model first, then build the optimizer"
        )
    missing = [
        g.names[pi]
        for g, arrived in zip(buffers, grad_arrived)
        for pi, ok in enumerate(arrived)
        if not ok
    ]
    if missing and len(missing) == sum(len(g.params) for g in buffers):
        raise RuntimeError(
            f"acco_hooks: no gradient reached any parameter during round {round_index}: "
            "call loss.backward() before each step()"
        )
    if missing:
        raise RuntimeError(
            f"acco_hooks: no gradient reached {_some(missing)} during round "
            f"{round_index}. Every trained parameter must get a gradient in every "
            "round: run backward() before step(), and set requires_grad=False on parameters "
            "that are not trained (or leave them out of the optimizer's params)"
        )


def sparse_gradient_error(name: str, layout: torch.layout) -> RuntimeError:
    """A sparse gradient: a dense step on it is not the step torch's optimizers take."""
    return RuntimeError(
        f"acco_hooks: {name} got a {layout} gradient; the engine sums and shards dense "
        "gradients only, and a dense step is not the step torch's optimizers take on a sparse "
        "gradient. Use nn.Embedding(..., sparse=False) (the default)"
    )


def nonfinite_error(round_index: int, what: str) -> FloatingPointError:
    """``nonfinite='raise'``: the error the training loop sees."""
    return FloatingPointError(
        f"acco_hooks: the averaged gradient of round {round_index} has NaN/Inf values "
        f"(nonfinite='raise'); the {what} was not applied and the optimizer state is unchanged"
    )


def warn_skipped_round(round_index: int, what: str, skipped_rounds: int) -> None:
    """``nonfinite='skip'``: every rank skipped the round; say so where the loop called from."""
    warnings.warn(
        f"acco_hooks: non-finite gradient (NaN/Inf) in round {round_index}: every rank skipped "
        f"this {what}; the optimizer state and learning rate are unchanged ({skipped_rounds} "
        "rounds skipped so far)",
        RuntimeWarning,
        stacklevel=5,
    )


def _some(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
