"""The standard distributed checkpoint of an ACCO optimizer saves every rank's shard, and loads
into a run of another number of ranks.

Each micro-batch is one global batch split evenly over the ranks, so a run on N ranks and one
on N' ranks train on the same data: continued training from a checkpoint resharded N -> N'
must equal the uninterrupted N-rank run up to the order of float sums.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.scenario import make_model, make_scheduler, param_groups, relative_error

MICRO = 2  # micro-batches per round
ROUNDS = 14
GLOBAL_BATCH = 12  # samples per global micro-batch: splits evenly over 1, 2, 3 and 4 ranks
MODES = ("acco", "dpu", "ddp")
AT_UPDATE = 8 * MICRO  # acco: after its 4th update round; dpu, ddp: after 8 updates


def build(mode: str):
    from acco_hooks import ACCOOptimizer

    model = make_model()
    opt = ACCOOptimizer(param_groups(model, True), torch.optim.AdamW, mode=mode,
                        accumulation_steps=MICRO, lr_scheduler=make_scheduler, lr=3e-2,
                        weight_decay=0.1)  # fmt: skip
    return model, opt


def train(model, opt, rank: int, world_size: int, first: int, last: int) -> None:
    """Micro-batches ``first`` .. ``last - 1``; this rank's share of each global batch."""
    share = GLOBAL_BATCH // world_size
    for i in range(first, last):
        g = torch.Generator().manual_seed(7919 * i)
        x, y = torch.randn(GLOBAL_BATCH, 5, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
        mine = slice(rank * share, (rank + 1) * share)
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()


def final(model, opt) -> dict[str, torch.Tensor]:
    opt.flush()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    params["lr"] = torch.tensor(opt.lr_scheduler.get_last_lr())
    opt.close()
    return params


def save_and_go_on(rank: int, world_size: int, ckpt: str, save_at: int) -> dict:
    """Per mode: train, ``dcp.save`` model and optimizer state, train on to the end."""
    import torch.distributed.checkpoint as dcp

    straight = {}
    for mode in MODES:
        model, opt = build(mode)
        train(model, opt, rank, world_size, 0, save_at)
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
                 checkpoint_id=f"{ckpt}/{mode}")  # fmt: skip
        train(model, opt, rank, world_size, save_at, ROUNDS * MICRO)
        straight[mode] = final(model, opt)
    return straight


def load_and_finish(rank: int, world_size: int, ckpt: str, save_at: int) -> dict:
    """Per mode: build anew on this world, ``dcp.load`` the checkpoint, train to the end."""
    import torch.distributed.checkpoint as dcp

    resumed = {}
    for mode in MODES:
        model, opt = build(mode)
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.load(state, checkpoint_id=f"{ckpt}/{mode}")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        train(model, opt, rank, world_size, save_at, ROUNDS * MICRO)
        resumed[mode] = final(model, opt)
    return resumed


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[int, tuple[str, dict]]:
    """Checkpoints at an update boundary, saved by 2 and by 4 ranks, and the runs that went on."""
    out = {}
    for n in (2, 4):
        ckpt = str(tmp_path_factory.mktemp(f"world{n}"))
        straight = run_distributed("tests.engine.test_resharding:save_and_go_on", n, ckpt,
                                   AT_UPDATE)  # fmt: skip
        assert all(torch.equal(straight[0][m][k], s[m][k]) for s in straight for m in MODES
                   for k in straight[0][m])  # every rank ends at the same parameters
        out[n] = (ckpt, straight[0])
    return out


@pytest.mark.parametrize("saved_by, resumed_on", [(2, 1), (2, 3), (2, 4), (4, 2), (2, 2)])
def test_resharded_resume_equals_the_uninterrupted_run(checkpoints, saved_by, resumed_on) -> None:
    ckpt, straight = checkpoints[saved_by]
    resumed = run_distributed("tests.engine.test_resharding:load_and_finish", resumed_on, ckpt,
                              AT_UPDATE)[0]  # fmt: skip
    for mode in MODES:
        error = relative_error(resumed[mode], straight[mode])
        if saved_by == resumed_on:  # the same shape: bit for bit
            assert error == 0.0, f"{mode}: {error:.2e}"
        else:
            assert error <= 1e-5, f"{mode} {saved_by}->{resumed_on}: {error:.2e}"
        assert torch.equal(resumed[mode]["lr"], straight[mode]["lr"])
