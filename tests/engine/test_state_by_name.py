"""``ACCOEngine.load_optimizer_state_by_name``: a torch optimizer's state, keyed by parameter
name, continues in the engine's shards (what continuing torchtitan's own checkpoints needs)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.scenario import make_model, microbatch_loss

ROUNDS_BEFORE, ROUNDS_AFTER = 3, 3


def torch_adamw_then_engine(rank: int, world_size: int, load: bool) -> tuple[dict, dict]:
    """torch's AdamW on the averaged gradient for a few rounds, then the engine (``ddp``) from
    its weights and, by name, its state (or not), beside torch's AdamW going on."""
    from acco_hooks import ACCOOptimizer

    reference = make_model()
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=3e-2, weight_decay=0.1)

    def torch_round(round_index: int) -> None:  # every rank's micro-batch, averaged
        torch_opt.zero_grad()
        losses = [microbatch_loss(reference, r, round_index, 0) for r in range(world_size)]
        (sum(losses) / world_size).backward()
        torch_opt.step()

    for round_index in range(ROUNDS_BEFORE):
        torch_round(round_index)
    model = copy.deepcopy(reference)
    opt = ACCOOptimizer(model.named_parameters(), torch.optim.AdamW, mode="ddp",
                        accumulation_steps=1, lr=3e-2, weight_decay=0.1)  # fmt: skip
    if load:
        opt.engine.load_optimizer_state_by_name(
            {name: torch_opt.state[p] for name, p in reference.named_parameters()}
        )
    for round_index in range(ROUNDS_BEFORE, ROUNDS_BEFORE + ROUNDS_AFTER):
        microbatch_loss(model, rank, round_index, 0).backward()
        opt.step()
        torch_round(round_index)
    opt.close()
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: p.detach().clone() for n, p in reference.named_parameters()})  # fmt: skip


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_torch_optimizers_state_by_name_continues_in_the_shards(world_size: int) -> None:
    for ours, torchs in run_distributed(
        "tests.engine.test_state_by_name:torch_adamw_then_engine", world_size, True
    ):
        torch.testing.assert_close(ours, torchs, rtol=1e-5, atol=1e-6)
    # Without the state the engine's moments start at zero: another trajectory
    ours, torchs = run_distributed(
        "tests.engine.test_state_by_name:torch_adamw_then_engine", world_size, False
    )[0]
    assert max((ours[n] - torchs[n]).abs().max().item() for n in ours) > 1e-3


def test_a_missing_parameter_is_named() -> None:
    from acco_hooks import ACCOOptimizer

    model = make_model()
    with (
        ACCOOptimizer(model.named_parameters(), torch.optim.AdamW, mode="ddp", lr=1e-2) as opt,
        pytest.raises(KeyError, match=r"no \w+(\.weight|\.bias)?\.exp_avg \(and 14 more\)"),
    ):
        opt.engine.load_optimizer_state_by_name({})
