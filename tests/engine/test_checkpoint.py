"""state_dict / load_state_dict resume bit-exactly, and refuse what they cannot resume."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from acco_hooks import checkpoint
from tests.dist_utils import run_distributed
from tests.scenario import Config, make_model, make_scheduler, microbatch_loss, param_groups

MICRO = 2  # micro-batches per round on every rank
TOTAL_ROUNDS = 16


def build(cfg: Config):
    from acco_hooks import ACCOOptimizer

    model = make_model()
    opt = ACCOOptimizer(param_groups(model, True), torch.optim.AdamW, mode=cfg.mode,
                        accumulation_steps=MICRO, estimate_dtype=cfg.estimate_dtype,
                        lr_scheduler=make_scheduler, lr=3e-2, weight_decay=0.1)  # fmt: skip
    return model, opt


def train(model, opt, rank: int, first: int, last: int) -> None:
    """Run micro-batches number ``first`` .. ``last - 1`` of the schedule."""
    for i in range(first, last):
        microbatch_loss(model, rank, i // MICRO, i % MICRO).backward()
        opt.step()


def first_half(rank: int, world_size: int, cfg: Config, save_at: int, ckpt_dir: str) -> dict:
    model, opt = build(cfg)
    train(model, opt, rank, 0, TOTAL_ROUNDS * MICRO)
    opt.flush()
    straight = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.close()

    model, opt = build(cfg)
    train(model, opt, rank, 0, save_at)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    checkpoint.save(state, os.path.join(ckpt_dir, f"rank{rank}.pt"))
    opt.close()
    return straight


def second_half(rank: int, world_size: int, cfg: Config, save_at: int, ckpt_dir: str) -> dict:
    model, opt = build(cfg)
    state = checkpoint.load(os.path.join(ckpt_dir, f"rank{rank}.pt"))
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    train(model, opt, rank, save_at, TOTAL_ROUNDS * MICRO)
    opt.flush()
    result = {n: p.detach().clone() for n, p in model.named_parameters()}
    result["lr_epoch"] = opt.lr_scheduler.last_epoch
    opt.close()
    return result


@pytest.mark.parametrize(
    "mode, save_at, estimate_dtype",
    [
        ("acco", 8 * MICRO, None),  # after 8 rounds: a real update in flight
        ("acco", 7 * MICRO, None),  # after 7 rounds: an estimate in flight, its gradient carried
        ("acco", 5 * MICRO + 1, None),  # in the middle of a round
        # a float8 estimate in flight (its decoded θ̃ − θ is gathered again at the load) and
        # the accumulator kept for the update round, one micro-batch into it (the estimate's
        # gradients at a round end: tests/engine/test_resharding.py, exact to float order)
        ("acco", 7 * MICRO + 1, "float8_e4m3fn"),
        ("acco", 8 * MICRO, "bfloat16"),
        ("dpu", 8 * MICRO, None),
        ("ddp", 8 * MICRO, None),
    ],
)
def test_resume_in_fresh_processes_is_bit_exact(
    mode: str, save_at: int, estimate_dtype: str | None, tmp_path
) -> None:
    cfg = Config(mode=mode, estimate_dtype=estimate_dtype)
    # each half in processes of its own: nothing the first half left in memory can help
    straight = run_distributed("tests.engine.test_checkpoint:first_half", 2, cfg, save_at,
                               str(tmp_path), fresh_processes=True)  # fmt: skip
    resumed = run_distributed("tests.engine.test_checkpoint:second_half", 2, cfg, save_at,
                              str(tmp_path), fresh_processes=True)  # fmt: skip
    for rank in range(2):
        assert resumed[rank].pop("lr_epoch") == (TOTAL_ROUNDS // 2 if mode == "acco" else TOTAL_ROUNDS)
        assert resumed[rank].keys() == straight[rank].keys()
        for name, value in straight[rank].items():
            assert torch.equal(resumed[rank][name], value), f"rank {rank}: {name} differs"


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory) -> str:
    ckpt_dir = str(tmp_path_factory.mktemp("ckpt"))
    run_distributed("tests.engine.test_checkpoint:first_half", 2, Config(mode="acco"), 4, ckpt_dir)
    return os.path.join(ckpt_dir, "rank0.pt")


def test_resuming_with_another_world_size_is_refused(two_rank_checkpoint: str) -> None:
    model, opt = build(Config(mode="acco"))  # one local worker: world size 1
    state = torch.load(two_rank_checkpoint, weights_only=False)["optimizer"]
    with pytest.raises(ValueError, match=r"another rank's part .* saved by 2 data-parallel "
                                         r"ranks; this is rank 0 of 1.*dcp.save"):
        opt.load_state_dict(state)
    opt.close()


def test_resuming_with_another_optimizer_class_is_refused(two_rank_checkpoint: str) -> None:
    """Adam's state has AdamW's keys and shapes: only the class name tells them apart."""
    from acco_hooks import ACCOOptimizer

    state = torch.load(two_rank_checkpoint, weights_only=False)["optimizer"]
    model = make_model()
    opt = ACCOOptimizer(param_groups(model, True), torch.optim.Adam, accumulation_steps=MICRO,
                        lr_scheduler=make_scheduler, lr=3e-2)  # fmt: skip
    before = {n: t.clone() for n, t in opt.state_dict()["master"].items()}
    with pytest.raises(ValueError, match=r"shard optimizer is torch.optim.adamw.AdamW, this "
                                         r"engine steps torch.optim.adam.Adam.*"
                                         r"optimizer_class=torch.optim.adamw.AdamW"):
        opt.load_state_dict(state)
    after = opt.state_dict()["master"]
    assert all(torch.equal(after[n], t) for n, t in before.items())  # nothing was loaded
    opt.close()


def test_resuming_in_another_mode_is_refused(two_rank_checkpoint: str) -> None:
    state = torch.load(two_rank_checkpoint, weights_only=False)["optimizer"]
    state["world_size"] = 1
    model, opt = build(Config(mode="ddp"))
    with pytest.raises(ValueError, match=r"mode='acco'.*mode='ddp'"):
        opt.load_state_dict(state)
    opt.close()


def test_resuming_with_another_estimate_format_is_refused(tmp_path) -> None:
    """A float8 estimate pending in the checkpoint cannot resume in a run without one."""
    cfg = Config(mode="acco", estimate_dtype="float8_e4m3fn")
    run_distributed("tests.engine.test_checkpoint:first_half", 2, cfg, 7 * MICRO, str(tmp_path))
    state = torch.load(tmp_path / "rank0.pt", weights_only=False)["optimizer"]
    state["world_size"] = 1
    model, opt = build(Config(mode="acco"))
    with pytest.raises(ValueError, match=r"saved running acco \(estimate round 2 micro-batches in "
                                         r"float8_e4m3fn.*estimate_dtype=None do not run"):
        opt.load_state_dict(state)
    opt.close()


def test_resuming_with_other_accumulation_steps_or_groups_is_refused(
    two_rank_checkpoint: str,
) -> None:
    from acco_hooks import ACCOOptimizer

    state = torch.load(two_rank_checkpoint, weights_only=False)["optimizer"]
    state["world_size"] = 1
    model = make_model()
    opt = ACCOOptimizer(param_groups(model, True), torch.optim.AdamW, mode="acco",
                        accumulation_steps=MICRO + 1, lr_scheduler=make_scheduler, lr=3e-2)
    with pytest.raises(ValueError, match=rf"accumulation_steps={MICRO}, this optimizer has "
                       rf"accumulation_steps={MICRO + 1}.*accumulation_steps={MICRO} to resume"):
        opt.load_state_dict(state)
    opt.close()
    opt = ACCOOptimizer(param_groups(model, False), torch.optim.AdamW, mode="acco",
                        accumulation_steps=MICRO, lr_scheduler=make_scheduler, lr=3e-2)
    with pytest.raises(ValueError, match=r"parameter groups, names or shapes differ"):
        opt.load_state_dict(state)  # one group where the checkpoint has two
    opt.close()


def test_master_shard_follows_weights_loaded_after_construction() -> None:
    """Loading pretrained weights after building the optimizer, then resetting the master."""
    from acco_hooks import ACCOOptimizer

    model = make_model()
    opt = ACCOOptimizer(model.parameters(), torch.optim.AdamW, mode="ddp", lr=1e-2)
    pretrained = {n: torch.randn_like(p) for n, p in model.state_dict().items()}
    model.load_state_dict(pretrained)
    opt.engine.reset_master_from_params()
    microbatch_loss(model, 0, 0, 0).backward()
    opt.step()

    reference = make_model()
    reference.load_state_dict(pretrained)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    microbatch_loss(reference, 0, 0, 0).backward()
    ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="after training started would drop"):
        opt.engine.reset_master_from_params()
    opt.close()


def _payload(step: int) -> torch.Tensor:
    return torch.randn(2_000_000, generator=torch.Generator().manual_seed(0)) * step


def _save_forever(path: str) -> None:
    from acco_hooks import checkpoint

    step = 0
    while True:  # 8 MB per save: long enough to be interrupted mid-write
        step += 1
        checkpoint.save({"step": step, "payload": _payload(step)}, path)


@pytest.mark.parametrize("delay_s", [0.05, 0.2, 0.5])
def test_sigkill_during_saving_leaves_a_complete_checkpoint(delay_s: float, tmp_path) -> None:
    import multiprocessing
    import signal
    import time

    from acco_hooks import checkpoint

    path = tmp_path / "rank0.pt"
    checkpoint.save({"step": 0, "payload": _payload(0)}, path)
    proc = multiprocessing.get_context("spawn").Process(target=_save_forever, args=(str(path),))
    proc.start()
    first = os.stat(path).st_ino
    deadline = time.monotonic() + 120
    while os.stat(path).st_ino == first:  # the child's first save replaced the file
        assert time.monotonic() < deadline and proc.is_alive(), "the saving child never saved"
        time.sleep(0.01)
    time.sleep(delay_s)  # now kill it somewhere in a later save
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    state = checkpoint.load(path)  # a complete file, never a truncated one
    assert state["step"] > 0  # the child did overwrite it, possibly many times
    assert torch.equal(state["payload"], _payload(state["step"]))
    leftovers = [f for f in os.listdir(tmp_path) if f != "rank0.pt"]
    assert all(f.endswith(".tmp") for f in leftovers)  # at most the interrupted temporary


def state_sizes(rank: int, world_size: int) -> dict:
    """The largest tensor of the engine state at round boundaries, and the accumulator saved
    mid-round, in acco."""
    model, opt = build(Config(mode="acco"))
    sizes = {"model_numel": sum(p.numel() for p in model.parameters())}
    for i in range(3 * MICRO):  # rounds 0 (estimate), 1 (update), 2 (estimate)
        microbatch_loss(model, rank, i // MICRO, i % MICRO).backward()
        opt.step()
        if opt.engine.microbatches_in_round == 0:
            state = opt.state_dict()
            assert not state["partial_round"] and state["rank_state"] == {}
            sizes[f"after_round_{opt.round_index - 1}"] = max(t.numel() for t in _tensors(state))
    microbatch_loss(model, rank, 3, 0).backward()
    opt.step()
    own = opt.state_dict()["rank_state"][f"rank{rank}"]
    sizes["mid_round_accumulator"] = sum(t.numel() for t in own["accumulator"])
    opt.close()
    return sizes


def _tensors(value):
    """Every tensor in ``value``; of a ``DTensor``, this rank's local part."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        yield value.to_local()
    elif isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def test_a_checkpoint_at_a_round_boundary_holds_only_shards() -> None:
    for sizes in run_distributed("tests.engine.test_checkpoint:state_sizes", 2):
        shard = -(-sizes["model_numel"] // 2)
        assert sizes["after_round_0"] <= shard  # estimate in flight, half-batch carried
        assert sizes["after_round_1"] <= shard
        assert sizes["after_round_2"] <= shard
        assert sizes["mid_round_accumulator"] >= sizes["model_numel"]  # mid-round only


def async_saved_while_training(rank: int, world_size: int, ckpt_dir: str) -> dict:
    """``dcp.async_save`` of the engine state, then four more rounds at once; what it wrote must
    be the state at the call, not what the next rounds made of it."""
    import torch.distributed.checkpoint as dcp

    model, opt = build(Config(mode="acco"))
    train(model, opt, rank, 0, 3 * MICRO)  # an estimate in flight, its half-batch carried
    state = {"optim": opt.state_dict()}
    at_save = [t.clone() for t in _tensors(state)]
    response = dcp.async_save(state, checkpoint_id=ckpt_dir)
    train(model, opt, rank, 3 * MICRO, 7 * MICRO)  # the engine rewrites its shard buffers
    (response.upload_completion if hasattr(response, "upload_completion") else response).result()
    changed = any(not torch.equal(a, b) for a, b in zip(at_save, _tensors(state)))
    opt.close()
    model, opt = build(Config(mode="acco"))  # a fresh optimizer loads what was written
    loaded = {"optim": opt.state_dict()}
    dcp.load(loaded, checkpoint_id=ckpt_dir)
    mismatches = [i for i, (a, b) in enumerate(zip(at_save, _tensors(loaded)))
                  if not torch.equal(a, b)]  # fmt: skip
    opt.close()
    return {"live_buffers_changed": changed, "mismatches": mismatches, "tensors": len(at_save)}


def test_async_save_while_training_goes_on_is_consistent(tmp_path) -> None:
    for rank in run_distributed("tests.engine.test_checkpoint:async_saved_while_training", 2,
                                str(tmp_path)):  # fmt: skip
        assert rank["live_buffers_changed"]  # the state_dict's tensors are live buffers ...
        assert rank["mismatches"] == [] and rank["tensors"] > 5  # ... yet the checkpoint is not


@pytest.mark.parametrize("estimate_dtype", [None, "bfloat16"])
def test_a_save_between_backward_and_step_is_refused(estimate_dtype) -> None:
    """The gradient of that backward is accumulated, its micro-batch not counted: a resumed
    run that replays the micro-batch would count it twice (with a narrow estimate pending, the
    checkpoint folded it into the carried half-batch without its weight)."""
    model, opt = build(Config(mode="acco", estimate_dtype=estimate_dtype))
    train(model, opt, 0, 0, 3 * MICRO)  # an estimate in flight
    microbatch_loss(model, 0, 3, 0).backward()
    with pytest.raises(RuntimeError, match=r"state_dict\(\) between backward\(\) and step\(\): "
                                           r"\d+ parameter gradients are accumulated"):
        opt.state_dict()
    opt.step()
    assert opt.state_dict()["round_microbatches"] == 1  # after step(): saved mid-round
    opt.close()


def test_parameters_given_without_names_warn_that_they_load_by_position() -> None:
    """Two parameters of one shape, given bare: a run that listed them in the other order would
    load each other's master weights and moments, unseen (the model loads by name). Named, the
    optimizer's checkpoint matches by name and says nothing."""
    from acco_hooks import ACCOOptimizer

    def loaded(params) -> list[str]:
        opt = ACCOOptimizer(params, torch.optim.AdamW, mode="ddp", lr=1e-2)
        nn_loss = sum(p.sum() for p in model.parameters())
        nn_loss.backward()
        opt.step()
        state = opt.state_dict()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.load_state_dict(state)
        opt.close()
        return [str(w.message) for w in caught]

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    (message,) = loaded(model.parameters())
    assert "given without names, so the checkpoint's optimizer state is matched to them by " \
           "position, and some of them share a shape" in message
    assert "model.named_parameters()" in message
    assert loaded(model.named_parameters()) == []
    assert loaded([model[0].weight, model[1].bias]) == []  # shapes differ: position is enough
