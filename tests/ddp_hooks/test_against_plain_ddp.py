"""``acco_hook`` in ``mode="ddp"`` is synchronous ZeRO-1: over the DDP options users set, it must
train as plain DDP with the same torch optimizer (its oracle), or refuse the run by name.

Each case runs both on 2 gloo ranks from the same weights and data for a few steps: plain DDP
(no hook, the loss of a step's micro-batches divided by their number, ``optimizer.step()``;
``zero_grad()``), and the same loop with ``ACCOState.step()`` after each micro-batch.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import pytest
import torch
from torch import nn

from tests.scenario import relative_error

STEPS = 6
OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "SGD": (torch.optim.SGD, dict(lr=5e-2, momentum=0.9, nesterov=True, weight_decay=1e-2)),
}


@dataclasses.dataclass(frozen=True)
class Case:
    """The DDP options and the model's features of one comparison."""

    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    bucket_cap_mb: float = 1e-4  # every parameter in a bucket of its own (after the rebuild)
    microbatches: int = 1  # per step; all but the last under no_sync()
    find_unused_parameters: bool = False  # and a branch rank 1 leaves unused every other step
    tied: bool = False  # the output layer shares the embedding's weight
    buffers: bool = False  # BatchNorm: running statistics DDP broadcasts from rank 0


CASES = {
    "default": Case(),
    "gradient_as_bucket_view": Case(gradient_as_bucket_view=True),
    "static_graph": Case(static_graph=True),
    "one_bucket": Case(bucket_cap_mb=25),
    "no_sync": Case(microbatches=2),
    "no_sync_bucket_view": Case(microbatches=2, gradient_as_bucket_view=True),
    "find_unused_on_one_rank": Case(find_unused_parameters=True),
    "tied_weights": Case(tied=True),
    "buffers": Case(buffers=True),
    "everything": Case(gradient_as_bucket_view=True, microbatches=3, find_unused_parameters=True,
                       tied=True, buffers=True, bucket_cap_mb=25),
}  # fmt: skip


class Model(nn.Module):
    def __init__(self, case: Case) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.body = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6) if case.buffers else nn.Identity()
        self.branch = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        if case.tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, use_branch: bool) -> torch.Tensor:
        x = torch.tanh(self.body(self.embed(tokens)))
        x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        if use_branch:
            x = x + self.branch(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), tokens.flatten())


def both(rank: int, world_size: int, case: Case, optimizer: str) -> dict:
    """The final parameters (and buffers) of plain DDP and of the hook; or the hook's refusal."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from acco_hooks import ACCOState, acco_hook

    torch.manual_seed(0)
    model = Model(case)
    plain_model = copy.deepcopy(model)
    options = dict(gradient_as_bucket_view=case.gradient_as_bucket_view,
                   static_graph=case.static_graph, bucket_cap_mb=case.bucket_cap_mb,
                   find_unused_parameters=case.find_unused_parameters)  # fmt: skip
    cls, kwargs = OPTIMIZERS[optimizer]
    plain = DDP(plain_model, **options)
    plain_opt = cls(plain_model.parameters(), **kwargs)
    ddp = DDP(model, **options)
    state = ACCOState(ddp, cls, mode="ddp", accumulation_steps=case.microbatches, **kwargs)
    ddp.register_comm_hook(state, acco_hook)

    def loss(net: nn.Module, step: int, micro: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
        use = not case.find_unused_parameters or rank == 0 or step % 2 == 0
        return net(torch.randint(0, 11, (3, 4), generator=g), use)

    for step in range(STEPS):
        for micro in range(case.microbatches):
            accumulating = micro < case.microbatches - 1
            with plain.no_sync() if accumulating else contextlib.nullcontext():
                (loss(plain, step, micro) / case.microbatches).backward()
            with ddp.no_sync() if accumulating else contextlib.nullcontext():
                loss(ddp, step, micro).backward()
            state.step()
        plain_opt.step()
        plain_opt.zero_grad()
    state.close()

    def everything(net: nn.Module) -> dict[str, torch.Tensor]:
        return {n: t.detach().clone() for n, t in net.state_dict().items()
                if t.is_floating_point()}  # fmt: skip

    return {"hook": everything(model), "plain": everything(plain_model)}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_hook_in_ddp_mode_trains_as_plain_ddp(name: str, optimizer: str, rank_pool) -> None:
    for result in rank_pool.run(f"{__name__}:both", 2, CASES[name], optimizer):
        error = relative_error(result["hook"], result["plain"])
        assert error <= 1e-5, f"{name}, {optimizer}: {error:.2e}"
