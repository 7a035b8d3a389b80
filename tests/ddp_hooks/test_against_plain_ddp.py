"""``acco_hook`` in ``mode="ddp"`` is synchronous ZeRO-1: over the DDP options users set, it must
train as plain DDP with the same torch optimizer (its oracle), or refuse the run by name.

Each case runs both on 2 gloo ranks from the same weights and data for a few steps: plain DDP
(no hook, the loss of a step's micro-batches divided by their number, ``optimizer.step()``;
``zero_grad()``), and the same loop with ``ACCOState.step()`` after each micro-batch. What the
plain loop does in the loop itself, the hook's run says in its settings: clipping with
``clip_grad_norm_`` is ``max_grad_norm``; a warm-up sets a group's ``lr`` by index on both;
rank-local parameters DDP ignores are stepped by an optimizer of the loop's own, on both.
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
    """The DDP options, the model's features and the loop's habits of one comparison."""

    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    bucket_cap_mb: float = 1e-4  # every parameter in a bucket of its own (after the rebuild)
    microbatches: int = 1  # per step; all but the last under no_sync()
    find_unused_parameters: bool = False  # and a branch rank 1 leaves unused every other step
    tied: bool = False  # the output layer shares the embedding's weight
    buffers: bool = False  # BatchNorm: running statistics DDP broadcasts from rank 0
    # the plain loop clips with clip_grad_norm_ before optimizer.step(); the hook's run sets
    # max_grad_norm to the same bound
    clip_norm: float | None = None
    # a rank-local embedding table DDP ignores (its values differ by rank): plain DDP's
    # optimizer steps it locally, the hook's run with a torch optimizer of the loop's own
    rank_local: bool = False
    # the body is frozen and is the first parameter group; a warm-up sets each group's lr by
    # index every step
    frozen_first_group: bool = False
    # rank 1 runs out of data after half the steps, under Join(divide_by_initial_world_size=...)
    join: bool | None = None


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
    "clip_grad_norm": Case(clip_norm=0.05),
    "clip_grad_norm_no_sync": Case(clip_norm=0.05, microbatches=2),
    "rank_local_table": Case(rank_local=True),
    "frozen_first_group_warmup": Case(frozen_first_group=True),
    "join_divides_by_initial_world_size": Case(join=True),
    "join_divides_by_effective_world_size": Case(join=False),
    "everything": Case(gradient_as_bucket_view=True, microbatches=3, find_unused_parameters=True,
                       tied=True, buffers=True, bucket_cap_mb=25, clip_norm=0.05,
                       frozen_first_group=True),
}  # fmt: skip


class Model(nn.Module):
    def __init__(self, case: Case) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.body = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6) if case.buffers else nn.Identity()
        self.branch = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.local = nn.Embedding(11, 6) if case.rank_local else None
        if case.tied:
            self.head.weight = self.embed.weight
        if case.frozen_first_group:
            self.body.requires_grad_(False)

    def forward(self, tokens: torch.Tensor, use_branch: bool) -> torch.Tensor:
        x = self.embed(tokens)
        if self.local is not None:
            x = x + self.local(tokens)
        x = torch.tanh(self.body(x))
        x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        if use_branch:
            x = x + self.branch(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), tokens.flatten())


def _groups(model: Model, case: Case) -> list[dict] | None:
    """The parameter groups both runs build: the frozen body first; None for the default."""
    if not case.frozen_first_group:
        return None
    body = {id(p) for p in model.body.parameters()}
    trained = [(n, p) for n, p in model.named_parameters()
               if id(p) not in body and not n.startswith("local.")]  # fmt: skip
    return [{"params": list(model.body.named_parameters())}, {"params": trained}]


def both(rank: int, world_size: int, case: Case, optimizer: str) -> dict:
    """The final parameters (and buffers) of plain DDP and of the hook; or the hook's refusal."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    from acco_hooks import ACCOState, acco_hook

    torch.manual_seed(0)
    model = Model(case)
    if case.rank_local:
        with torch.no_grad():
            model.local.weight.mul_(rank + 1)  # each rank's own table
        DDP._set_params_and_buffers_to_ignore_for_model(model, ["local.weight"])
    plain_model = copy.deepcopy(model)
    options = dict(gradient_as_bucket_view=case.gradient_as_bucket_view,
                   static_graph=case.static_graph, bucket_cap_mb=case.bucket_cap_mb,
                   find_unused_parameters=case.find_unused_parameters)  # fmt: skip
    cls, kwargs = OPTIMIZERS[optimizer]
    plain = DDP(plain_model, **options)
    plain_groups = _groups(plain_model, case)
    plain_opt = cls(plain_model.parameters() if plain_groups is None
                    else [{"params": [p for _, p in g["params"]]} for g in plain_groups]
                    + ([{"params": [plain_model.local.weight]}] if case.rank_local else []),
                    **kwargs)  # fmt: skip
    ddp = DDP(model, **options)
    groups = _groups(model, case)
    local_opt = None
    if case.rank_local:  # the engine leaves them to the loop (it refuses them by default)
        groups = groups or [(n, p) for n, p in model.named_parameters() if n != "local.weight"]
        local_opt = cls([model.local.weight], **kwargs)
    state = ACCOState(ddp, cls, mode="ddp", accumulation_steps=case.microbatches,
                      param_groups=groups, max_grad_norm=case.clip_norm, **kwargs)  # fmt: skip
    ddp.register_comm_hook(state, acco_hook)
    steps = [STEPS, STEPS if case.join is None else STEPS // 2][rank]

    def loss(net: nn.Module, step: int, micro: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
        use = not case.find_unused_parameters or rank == 0 or step % 2 == 0
        return net(torch.randint(0, 11, (3, 4), generator=g), use)

    def warm_up(groups: list[dict], step: int) -> None:
        if case.frozen_first_group:
            groups[0]["lr"] = 0.0  # the frozen body's group: nothing to train there
            groups[1]["lr"] = kwargs["lr"] * (step + 1) / STEPS

    def joined(net: DDP, *joinables) -> contextlib.AbstractContextManager:
        if case.join is None:
            return contextlib.nullcontext()
        return Join([net, *joinables], divide_by_initial_world_size=case.join)

    with joined(plain):
        for step in range(steps):
            warm_up(plain_opt.param_groups, step)
            for micro in range(case.microbatches):
                accumulating = micro < case.microbatches - 1
                with plain.no_sync() if accumulating else contextlib.nullcontext():
                    (loss(plain, step, micro) / case.microbatches).backward()
            if case.clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(plain_model.parameters(), case.clip_norm)
            plain_opt.step()
            plain_opt.zero_grad()
    with joined(ddp, state):
        for step in range(steps):
            warm_up(state.param_groups, step)
            for micro in range(case.microbatches):
                accumulating = micro < case.microbatches - 1
                with ddp.no_sync() if accumulating else contextlib.nullcontext():
                    loss(ddp, step, micro).backward()
                state.step()
            if local_opt is not None:
                local_opt.step()
                local_opt.zero_grad()
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


def ignored_by_default(rank: int, world_size: int) -> str:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from acco_hooks import ACCOState

    model = Model(Case(rank_local=True))
    DDP._set_params_and_buffers_to_ignore_for_model(model, ["local.weight"])
    ddp = DDP(model)
    for groups in (None, list(model.named_parameters())):
        with pytest.raises(ValueError, match=r"DDP ignores local\.weight \(its "
                                             r"parameters_to_ignore\).*Leave them out"):
            ACCOState(ddp, torch.optim.AdamW, param_groups=groups, lr=1e-2)
    return "refused"


def test_parameters_ddp_ignores_are_refused_by_name_unless_left_out(rank_pool) -> None:
    assert rank_pool.run(f"{__name__}:ignored_by_default", 2) == ["refused", "refused"]
