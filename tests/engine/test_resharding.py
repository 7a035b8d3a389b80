"""The standard distributed checkpoint of an ACCO optimizer saves every rank's shard, and loads
into a run of another number of ranks.

Each micro-batch is one global batch split evenly over the ranks, so a run on N ranks and one
on N' ranks train on the same data: continued training from a checkpoint resharded N -> N'
must equal the uninterrupted N-rank run up to the order of float sums.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.engine.resume_cases import ResumeCase
from tests.scenario import make_model, make_scheduler, param_groups, relative_error

MICRO = 2  # micro-batches per round
ROUNDS = 14
GLOBAL_BATCH = 12  # samples per global micro-batch: splits evenly over 1, 2, 3 and 4 ranks
MODES = ("acco", "dpu", "ddp")
AT_UPDATE = 8 * MICRO  # acco: after its 4th update round; dpu, ddp: after 8 updates


def build(mode: str, estimate_dtype: str | None = None):
    from acco_hooks import ACCOOptimizer

    model = make_model()
    opt = ACCOOptimizer(param_groups(model, True), torch.optim.AdamW, mode=mode,
                        accumulation_steps=MICRO, lr_scheduler=make_scheduler, lr=3e-2,
                        weight_decay=0.1, estimate_dtype=estimate_dtype)  # fmt: skip
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


def save(model, opt, path: str) -> None:
    """The checkpoint pattern PyTorch documents: every rank saves its state dicts with DCP."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)


def load(model, opt, path: str) -> dict:
    """``dcp.load`` into the freshly built model's and optimizer's state dicts; the model's is
    loaded, the optimizer's returned."""
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    return state["optim"]


def final(model, opt) -> dict[str, torch.Tensor]:
    opt.flush()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    params["lr"] = torch.tensor(opt.lr_scheduler.get_last_lr())
    opt.close()
    return params


def save_and_go_on(rank: int, world_size: int, ckpt: str, save_at: int) -> dict:
    """Per mode: train, ``dcp.save`` model and optimizer state, train on to the end."""
    straight = {}
    for mode in MODES:
        model, opt = build(mode)
        train(model, opt, rank, world_size, 0, save_at)
        save(model, opt, f"{ckpt}/{mode}")
        train(model, opt, rank, world_size, save_at, ROUNDS * MICRO)
        straight[mode] = final(model, opt)
    return straight


def load_and_finish(rank: int, world_size: int, ckpt: str, save_at: int) -> dict:
    """Per mode: build anew on this world, ``dcp.load`` the checkpoint, train to the end."""
    resumed = {}
    for mode in MODES:
        model, opt = build(mode)
        opt.load_state_dict(load(model, opt, f"{ckpt}/{mode}"))
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


BETWEEN = 7 * MICRO  # acco: after an estimate round, its half-batch carried
MID_ROUND = 7 * MICRO + 1  # one micro-batch into the update round


def train_summed(model, opt, rank: int, world_size: int, first: int, last: int) -> None:
    """As :func:`train`, with the loss summed over this rank's samples and the micro-batch
    weighed by their number: the count is in samples, not in micro-batches."""
    share = GLOBAL_BATCH // world_size
    for i in range(first, last):
        g = torch.Generator().manual_seed(7919 * i)
        x, y = torch.randn(GLOBAL_BATCH, 5, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
        mine = slice(rank * share, (rank + 1) * share)
        loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine], reduction="sum") / 3
        loss.backward()
        opt.step(share)


LOSSES = {"mean": train, "summed": train_summed}
# (loss, estimate_dtype): the estimate in the reduce dtype carries ΣG̃ on the shard side; one
# sent narrower leaves it in each rank's accumulator, which a checkpoint reduce-scatters
INSIDE_AN_UPDATE = {"mean": ("mean", None), "summed": ("summed", None),
                    "mean-bfloat16": ("mean", "bfloat16")}  # fmt: skip


def save_between_and_mid_round(rank: int, world_size: int, ckpt: str, case: str) -> dict:
    loss, estimate_dtype = INSIDE_AN_UPDATE[case]
    model, opt = build("acco", estimate_dtype)
    LOSSES[loss](model, opt, rank, world_size, 0, BETWEEN)
    save(model, opt, f"{ckpt}/between")
    LOSSES[loss](model, opt, rank, world_size, BETWEEN, MID_ROUND)
    save(model, opt, f"{ckpt}/mid")
    LOSSES[loss](model, opt, rank, world_size, MID_ROUND, ROUNDS * MICRO)
    return final(model, opt)


def resume_or_refusal(rank: int, world_size: int, ckpt: str, point: str, save_at: int,
                      case: str = "mean"):  # fmt: skip
    """The final parameters of a run resumed with DCP, or the message that refused the load."""
    loss, estimate_dtype = INSIDE_AN_UPDATE[case]
    model, opt = build("acco", estimate_dtype)
    state = load(model, opt, f"{ckpt}/{point}")
    try:
        opt.load_state_dict(state)
    except ValueError as refusal:
        opt.close()
        return str(refusal)
    LOSSES[loss](model, opt, rank, world_size, save_at, ROUNDS * MICRO)
    return final(model, opt)


@pytest.fixture(scope="module", params=list(INSIDE_AN_UPDATE))
def acco_inside_an_update(request, tmp_path_factory) -> tuple[str, dict, str]:
    """2 ranks of acco saved between an estimate round and its update, and one micro-batch
    into the update round; with a mean loss (weight 1) and a summed one (weight = samples),
    and with the estimate sent in bfloat16."""
    ckpt = str(tmp_path_factory.mktemp(f"inside-{request.param}"))
    straight = run_distributed("tests.engine.test_resharding:save_between_and_mid_round", 2,
                               ckpt, request.param)  # fmt: skip
    return ckpt, straight[0], request.param


def test_carried_half_batch_resumes_on_any_number_of_ranks(acco_inside_an_update) -> None:
    """Between acco's estimate round and its update the half-batch ΣG̃ is carried: on another
    world it is weighed as the same data split anew (mean losses) or kept (summed ones). Sent
    in bfloat16, the estimate's gradients wait in the accumulators, which the checkpoint
    reduce-scatters into that half-batch: exact to the order of float sums on any world."""
    ckpt, straight, case = acco_inside_an_update
    # the saved world, fewer and more ranks; the other weighings on one other world each
    others = {"mean": (1, 3, 4), "summed": (3,), "mean-bfloat16": (4,)}[case]
    for world_size in (2, *others):
        resumed = run_distributed("tests.engine.test_resharding:resume_or_refusal", world_size,
                                  ckpt, "between", BETWEEN, case)[0]  # fmt: skip
        error = relative_error(resumed, straight)
        exact = world_size == 2 and INSIDE_AN_UPDATE[case][1] is None
        assert error == 0.0 if exact else error <= 1e-5, f"2->{world_size}: {error:.2e}"


def test_mid_round_state_is_not_lost_silently(acco_inside_an_update):
    """DCP loads only the keys of the state it loads into; a fresh optimizer's has no
    accumulated gradients, so a mid-round checkpoint is refused, not half-resumed."""
    ckpt, _, case = acco_inside_an_update
    for world_size in (2, 3):
        refused = run_distributed("tests.engine.test_resharding:resume_or_refusal", world_size,
                                  ckpt, "mid", MID_ROUND, case)  # fmt: skip
        for message in refused:
            assert "saved in the middle of a round (round 7, 1 micro-batches in)" in message
            assert "from per-rank files (acco_hooks.checkpoint)" in message
            assert "or save when step() ends a round" in message


LOCAL_BATCH = 6  # samples per rank micro-batch, fixed: fewer ranks run more micro-batches


def train_fixed_local_batch(model, opt, rank: int, world_size: int, first: int, last: int) -> None:
    """Rounds ``first`` .. ``last - 1`` of a global batch of 4 blocks of LOCAL_BATCH samples per
    round: on N ranks each runs 4/N micro-batches (torchtitan's split of a global batch)."""
    steps = 4 // world_size
    for round_index in range(first, last):
        for micro in range(steps):
            block = micro * world_size + rank
            g = torch.Generator().manual_seed(7919 * round_index + block)
            x = torch.randn(LOCAL_BATCH, 5, generator=g)
            y = torch.randn(LOCAL_BATCH, 3, generator=g)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()


def build_fixed_local(mode: str, world_size: int):
    from acco_hooks import ACCOOptimizer

    model = make_model()
    opt = ACCOOptimizer(param_groups(model, True), torch.optim.AdamW, mode=mode,
                        accumulation_steps=4 // world_size, lr_scheduler=make_scheduler, lr=3e-2,
                        weight_decay=0.1)  # fmt: skip
    return model, opt


def fixed_local_batch_run(rank: int, world_size: int, ckpt: str, phase: str, at: int,
                          modes: tuple[str, ...]) -> dict:  # fmt: skip
    out = {}
    for mode in modes:
        model, opt = build_fixed_local(mode, world_size)
        if phase == "save":
            train_fixed_local_batch(model, opt, rank, world_size, 0, at)
            save(model, opt, f"{ckpt}/{mode}")
        else:
            opt.load_state_dict(load(model, opt, f"{ckpt}/{mode}"))
        train_fixed_local_batch(model, opt, rank, world_size, at, ROUNDS)
        out[mode] = final(model, opt)
    return out


@pytest.mark.parametrize("at, modes", [(8, MODES), (7, ("acco",))], ids=["update", "between"])
def test_the_same_global_batch_on_fewer_ranks_is_more_microbatches_per_rank(
    tmp_path, at, modes
) -> None:
    """Saved by 2 ranks running 2 micro-batches per round, resumed on 1 running 4: the global
    batch is what must match, and the update goes on as in the uninterrupted run (also from
    between acco's estimate round and its update: the micro-batches keep their size)."""
    straight = run_distributed("tests.engine.test_resharding:fixed_local_batch_run", 2,
                               str(tmp_path), "save", at, modes)[0]  # fmt: skip
    resumed = run_distributed("tests.engine.test_resharding:fixed_local_batch_run", 1,
                              str(tmp_path), "load", at, modes)[0]  # fmt: skip
    for mode in modes:
        assert relative_error(resumed[mode], straight[mode]) <= 1e-5, mode
        assert torch.equal(resumed[mode]["lr"], straight[mode]["lr"])


def hsdp_split_run(rank: int, world_size: int, ckpt: str, replicas: int, phase: str,
                   recipe: str = "adamw", saves: tuple[tuple[str, int], ...] = tuple(
                       (mode, AT_UPDATE) for mode in MODES)) -> dict:  # fmt: skip
    """ACCOHSDPOptimizer over ``replicas`` × (world_size / replicas) FSDP shards: train and save
    after the micro-batch of each of ``saves`` (mode, micro-batches), or load it; then train to
    the end. ``recipe`` "muon": DeepNet, Muon on its matrices (stepped whole), AdamW on the
    rest."""
    from acco_hooks import ACCOHSDPOptimizer
    from tests.engine.hsdp_workers import sharded_tiny_net

    out = {}
    for mode, at in saves:
        model, _ = sharded_tiny_net(replicas, world_size // replicas,
                                    model="deep" if recipe == "muon" else "tiny")  # fmt: skip
        opt = ACCOHSDPOptimizer(model, torch.optim.AdamW, params=param_groups(model, True, recipe),
                                mode=mode, accumulation_steps=MICRO, lr_scheduler=make_scheduler,
                                lr=3e-2, weight_decay=0.1)  # fmt: skip
        if phase == "save":
            train(model, opt, rank, world_size, 0, at)
            save(model, opt, f"{ckpt}/hsdp-{recipe}-{mode}-{at}")
        else:
            opt.load_state_dict(load(model, opt, f"{ckpt}/hsdp-{recipe}-{mode}-{at}"))
        train(model, opt, rank, world_size, at, ROUNDS * MICRO)
        opt.flush()
        params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        params["lr"] = torch.tensor(opt.engine.lr_scheduler.get_last_lr())
        opt.close()
        out[f"{mode}-{at}"] = params
    return out


@pytest.fixture(scope="module")
def hsdp_checkpoint(tmp_path_factory) -> tuple[str, dict]:
    """2 replicas × 2 FSDP shards: the uninterrupted run and its checkpoint at an update."""
    ckpt = str(tmp_path_factory.mktemp("hsdp"))
    straight = run_distributed("tests.engine.test_resharding:hsdp_split_run", 4, ckpt, 2,
                               "save")[0]  # fmt: skip
    return ckpt, straight


@pytest.mark.parametrize("replicas, shards", [(1, 2), (2, 1), (1, 1)])
def test_hsdp_resumes_on_other_replicas_and_fsdp_degrees(hsdp_checkpoint, replicas, shards):
    """Saved by 2 replicas × 2 FSDP shards, resumed by ``replicas`` × ``shards``: DCP reads
    each rank's new ranges of the parameters from the saved ones (the engine's state) and
    reshards FSDP2's model state."""
    ckpt, straight = hsdp_checkpoint
    resumed = run_distributed("tests.engine.test_resharding:hsdp_split_run", replicas * shards,
                              ckpt, replicas, "load")[0]  # fmt: skip
    for case in straight:
        assert relative_error(resumed[case], straight[case]) <= 1e-5, case
        assert torch.equal(resumed[case]["lr"], straight[case]["lr"])


# Muon's matrices stepped whole under FSDP: saved between acco's estimate and its update (the
# carried half-batch, the update in flight) and at a ddp update
WHOLE_SAVES = (("acco", 7 * MICRO), ("ddp", AT_UPDATE))


@pytest.fixture(scope="module")
def hsdp_muon_checkpoint(tmp_path_factory) -> tuple[str, dict]:
    ckpt = str(tmp_path_factory.mktemp("hsdp_muon"))
    straight = run_distributed("tests.engine.test_resharding:hsdp_split_run", 4, ckpt, 2,
                               "save", "muon", WHOLE_SAVES)[0]  # fmt: skip
    return ckpt, straight


@pytest.mark.parametrize("replicas, shards", [(2, 2), (1, 2), (2, 1), (1, 1)])
def test_whole_matrices_under_hsdp_resume_on_other_replicas_and_fsdp_degrees(
    hsdp_muon_checkpoint, replicas, shards
) -> None:
    """Muon's matrices owned on the 2 × 2 grid, each whole on one rank: the same grid resumes
    bit for bit; fewer replicas, another FSDP degree (1: no rank brings pieces together) and one
    process own them elsewhere and read each one's state by name, its master from the pieces."""
    ckpt, straight = hsdp_muon_checkpoint
    resumed = run_distributed("tests.engine.test_resharding:hsdp_split_run", replicas * shards,
                              ckpt, replicas, "load", "muon", WHOLE_SAVES)[0]  # fmt: skip
    for case in straight:
        error = relative_error(resumed[case], straight[case])
        print(case, replicas, shards, f"{error:.2e}")
        assert error == 0.0 if (replicas, shards) == (2, 2) else error <= 1e-5, (case, error)
        assert torch.equal(resumed[case]["lr"], straight[case]["lr"])


# Muon's matrices under tensor parallelism: each split by rows or columns over a replica's TP
# ranks and whole on its owner of the replicas × TP grid (tests/engine/test_tensor_parallel.py)


def tp_split_run(rank: int, world_size: int, ckpt: str, replicas: int, phase: str) -> dict:
    """The engine as torchtitan builds it over ``replicas`` × (world_size / replicas) TP ranks,
    SplitNet with Muon on its matrices: train and save after each of :data:`WHOLE_SAVES`, or
    load it; then train to the end. Each global micro-batch is cut in the saving run's 2
    shares, and a replica runs its shares as micro-batches of its own: the same micro-batches
    in the same rounds on any number of replicas (SplitNet rounds each micro-batch's gradient
    to its grid: a batch cut otherwise would be another run)."""
    import torch.distributed as dist

    from acco_hooks import ACCOEngine
    from tests.engine.hsdp_workers import tensor_parallel_split_net

    tp, shares = world_size // replicas, 2 // replicas
    replica = rank // tp
    out = {}

    def train_tp(engine, first: int, last: int) -> None:
        size = GLOBAL_BATCH // 2
        for i in range(first, last):
            g = torch.Generator().manual_seed(7919 * i)
            x, y = torch.randn(GLOBAL_BATCH, 5, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
            for share in range(replica * shares, (replica + 1) * shares):
                mine = slice(share * size, (share + 1) * size)
                torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
                engine.microbatch_done()

    for mode, at in WHOLE_SAVES:
        model, mesh = tensor_parallel_split_net(replicas, tp)
        engine = ACCOEngine(param_groups(model, True, "muon"), torch.optim.AdamW,
                            process_group=mesh["dp_replicate"],
                            norm_process_group=dist.group.WORLD, mode=mode,
                            accumulation_steps=MICRO * shares, lr_scheduler=make_scheduler,
                            lr=3e-2, weight_decay=0.1)  # fmt: skip
        engine.hook_param_grads(placeholders=False)
        path = f"{ckpt}/tp-{mode}-{at}"
        if phase == "save":
            train_tp(engine, 0, at)
            save(model, engine, path)
        else:
            engine.load_state_dict(load(model, engine, path))
        train_tp(engine, at, ROUNDS * MICRO)
        engine.flush()
        params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        params["lr"] = torch.tensor(engine.lr_scheduler.get_last_lr())
        engine.close()
        out[f"{mode}-{at}"] = params
    return out


@pytest.fixture(scope="module")
def tp_muon_checkpoint(tmp_path_factory) -> tuple[str, dict]:
    ckpt = str(tmp_path_factory.mktemp("tp_muon"))
    straight = run_distributed("tests.engine.test_resharding:tp_split_run", 4, ckpt, 2,
                               "save")[0]  # fmt: skip
    return ckpt, straight


@pytest.mark.parametrize("replicas", [2, 1])
def test_tensor_parallel_matrices_resume_on_other_replicas(tp_muon_checkpoint, replicas) -> None:
    """Saved by 2 replicas × 2 TP ranks (between acco's estimate and its update, and at a ddp
    update), each matrix's pieces in the TP ranks' master shards and its momentum whole by name
    on its owner: the same grid resumes bit for bit; one replica of 2 TP ranks owns every
    matrix on its two ranks, reads each one's momentum by name and brings its master together
    from the pieces, and goes on as the straight run."""
    ckpt, straight = tp_muon_checkpoint
    resumed = run_distributed("tests.engine.test_resharding:tp_split_run", replicas * 2, ckpt,
                              replicas, "load")[0]  # fmt: skip
    for case in straight:
        error = relative_error(resumed[case], straight[case])
        print(case, replicas, f"{error:.2e}")
        assert error == 0.0 if replicas == 2 else error <= 1e-5, (case, error)
        assert torch.equal(resumed[case]["lr"], straight[case]["lr"])


# ------------------------------------------------- the carried half-batch's weight, resharded

RUN = "tests.engine.resume_cases:run"


def resumed_errors(pool, case, saved_by: int, at: int, total: int, resumed_on, tmp_path) -> dict:
    """Relative error against the uninterrupted run of a resume at ``at`` on each world."""
    ckpt = str(tmp_path / f"at{at}")
    straight = pool.run(RUN, saved_by, case, 0, total, None, ((at, ckpt),))[0]["params"]
    errors = {}
    for world_size in resumed_on:
        resumed = pool.run(RUN, world_size, case, at, total, ckpt)[0]
        assert isinstance(resumed, dict), resumed  # not refused
        errors[world_size] = relative_error(resumed["params"], straight)
    return errors


@pytest.mark.parametrize("at", [14, 2], ids=["after-updates", "before-any-update"])
def test_a_narrow_estimates_half_batch_weighs_its_share_on_another_world(rank_pool, at, tmp_path):
    """acco with 4 micro-batches per update round, 2 per estimate round, sent in bfloat16: saved
    between an estimate and its update (after 2 updates, and before the first), the resumed
    update weighs the estimate's half 2/6 on any world, as the saving run would (the update's
    weight was never measured with a narrow estimate, and the half weighed 1/2 elsewhere)."""
    case = ResumeCase(accumulation_steps=4, estimate_microbatches=2, estimate_dtype="bfloat16")
    errors = resumed_errors(rank_pool, case, 2, at, 24, (2, 1, 3, 4), tmp_path)
    assert all(error <= 1e-5 for error in errors.values()), errors


@pytest.mark.parametrize("estimate_dtype", [None, "bfloat16"])
def test_token_weighed_micro_batches_resume_their_half_batch_on_another_world(
    rank_pool, estimate_dtype, tmp_path
) -> None:
    """``step(weight=tokens)`` with global batches of 12, 24 and 36 samples: the weights are data
    units, the half-batch is kept as it is, on any world."""
    case = ResumeCase(weights="tokens", estimate_dtype=estimate_dtype)
    errors = resumed_errors(rank_pool, case, 2, 10, 24, (2, 1, 3, 4), tmp_path)
    assert all(error <= 1e-5 for error in errors.values()), errors


@pytest.mark.parametrize("estimate_dtype", [None, "bfloat16"])
def test_two_reshards_in_a_row_keep_the_half_batch_weight(rank_pool, estimate_dtype, tmp_path):
    """Saved between an estimate and its update on 2 ranks; resumed on 4, saved there between
    again, resumed on 1: the end is the uninterrupted run's. And a checkpoint saved right after
    the resharded load, before its first update (the half-batch still in the 2 ranks' units),
    resumes on the same 4 ranks and on 1."""
    case = ResumeCase(estimate_dtype=estimate_dtype)
    first, again, total = str(tmp_path / "on2"), str(tmp_path / "on4"), 24
    straight = rank_pool.run(RUN, 2, case, 0, total, None, ((10, first),))[0]["params"]
    at_once = str(tmp_path / "on4-at-once")
    on4 = rank_pool.run(RUN, 4, case, 10, total, first, ((10, at_once), (18, again)))[0]
    on1 = rank_pool.run(RUN, 1, case, 18, total, again)[0]
    errors = {"2->4": relative_error(on4["params"], straight),
              "2->4->1": relative_error(on1["params"], straight)}  # fmt: skip
    for world_size in (4, 1):
        resumed = rank_pool.run(RUN, world_size, case, 10, total, at_once)[0]
        errors[f"2->4 at once->{world_size}"] = relative_error(resumed["params"], straight)
    assert all(error <= 1e-5 for error in errors.values()), errors


@pytest.mark.parametrize("mode", ["acco", "dpu"])
def test_a_checkpoint_may_hold_theta_in_its_model_and_the_live_parameters_beside_it(
    rank_pool, mode, tmp_path
) -> None:
    """Saved with an update in flight, where the model computes at θ̃ (acco) or one update
    behind (dpu): saved inside real_weights(), the checkpoint's model is θ, the model of a run
    flushed there; with live_state_dict() beside it, the resume on 2, 1 and 3 ranks puts the
    live parameters back and goes on as the uninterrupted run."""
    case, at, total = ResumeCase(mode=mode), 8, 20  # acco: 4 rounds in, its 2nd update in flight
    ckpt = str(tmp_path / "theta")
    straight = rank_pool.run(RUN, 2, case, 0, total, None, ((at, ckpt),), True)[0]["params"]
    flushed_there = rank_pool.run(RUN, 2, case, 0, at)[0]["params"]
    in_checkpoint = rank_pool.run("tests.engine.resume_cases:saved_model", 1, case, ckpt)[0]
    assert relative_error(in_checkpoint, flushed_there) == 0.0
    live = str(tmp_path / "live")  # saved as usual, the model entry holds the live parameters
    rank_pool.run(RUN, 2, case, 0, at, None, ((at, live),))
    held = rank_pool.run("tests.engine.resume_cases:saved_model", 1, case, live)[0]
    assert relative_error(held, flushed_there) > 1e-4
    for world_size in (2, 1, 3):
        resumed = rank_pool.run(RUN, world_size, case, at, total, ckpt, (), True)[0]["params"]
        error = relative_error(resumed, straight)
        assert error == 0.0 if world_size == 2 else error <= 1e-5, (world_size, error)


def until_ready_segment(rank: int, world_size: int, mode: str, rounds: int, ckpt: str,
                        resume: bool) -> dict:  # fmt: skip
    """acco or dpu with ``accumulate_until_ready``: the last rank holds each update's
    communication 0.4 s and rank 1 computes slower, so the ranks run unequal micro-batches a
    round. Built on this world, loaded from ``ckpt`` if ``resume``, trained to round
    ``rounds`` and saved to ``ckpt`` (a round end) or, resumed, flushed: this rank's count per
    round, and the parameters when resumed."""
    from acco_hooks import ACCOOptimizer
    from tests.engine.hsdp_workers import HeldLambdaLR
    from tests.scenario import OPTIMIZERS, microbatch_loss

    model = make_model()
    opt_class, kwargs = OPTIMIZERS["adamw"]
    hold_s = 0.4 if rank == world_size - 1 else 0.0
    opt = ACCOOptimizer(param_groups(model, True), opt_class, mode=mode, accumulation_steps=2,
                        accumulate_until_ready=True, max_microbatches_per_round=4,
                        lr_scheduler=lambda o: HeldLambdaLR(o, hold_s), **kwargs)  # fmt: skip
    if resume:
        opt.load_state_dict(load(model, opt, ckpt))
    counts = []
    while opt.engine.round_index < rounds:
        loss = microbatch_loss(model, rank, opt.engine.round_index, opt.engine.microbatches_in_round)
        (SAMPLES * loss).backward()  # summed over its samples, as torchtitan sums tokens
        time.sleep(0.05 if rank == 1 else 0.0)
        if opt.step(weight=SAMPLES):
            counts.append(opt.engine.last_round_microbatches)
    if not resume:
        save(model, opt, ckpt)
        opt.close()
        return {"counts": counts}
    opt.flush()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.close()
    return {"counts": counts, "params": params}


SAMPLES = 4.0  # what each micro-batch's loss sums over (microbatch_loss: 4 samples)


@pytest.mark.parametrize("mode", ["acco", "dpu"])
@pytest.mark.parametrize("resumed_on", [1, 3])
def test_an_until_ready_run_reshards_at_a_round_end(rank_pool, mode, resumed_on, tmp_path):
    """accumulate_until_ready on 2 ranks, each running its own number of micro-batches a round,
    saved at the end of round 5 (acco: between an estimate and its update, the estimate's
    half-batch weighing what the ranks ran), resumed on 1 or 3 ranks until round 10: the end
    is the spec's recursion over the micro-batches every rank ran, the 2 ranks' counts before
    the reshard and the new world's after it (recorded, replayed by the reference). Each
    micro-batch weighs what its loss sums over (its samples, as torchtitan weighs tokens):
    data units, which a reshard keeps. With unit weights (a mean loss) the carried half-batch
    is reweighed to the resumed world's update round instead, as without until-ready
    (``engine.state``): a micro-batch then counts 1/N of a global batch."""
    from tests.scenario import Config, reference_run

    ckpt = str(tmp_path / "ckpt")
    before = rank_pool.run("tests.engine.test_resharding:until_ready_segment", 2, mode, 5, ckpt,
                           False)  # fmt: skip
    after = rank_pool.run("tests.engine.test_resharding:until_ready_segment", resumed_on, mode,
                          10, ckpt, True)  # fmt: skip
    counts = [list(c) for c in zip(*(r["counts"] for r in before))]
    counts += [list(c) for c in zip(*(r["counts"] for r in after))]
    assert len(counts) == 10 and any(n > 2 for c in counts for n in c), counts
    reference = reference_run(Config(mode=mode, world_size=2, rounds=10, counts=counts,
                                     weights=[SAMPLES] * 3, scheduler=True))  # fmt: skip
    for rank, run in enumerate(after):
        for name, expected in reference["params"].items():
            torch.testing.assert_close(run["params"][name], expected, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")  # noqa: B023  # fmt: skip
