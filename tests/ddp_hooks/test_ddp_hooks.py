"""The DDP communication hooks on real gloo process groups."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from acco_hooks.engine import GradientInEngine
from tests.dist_utils import run_distributed
from tests.scenario import OPTIMIZERS, Config, reference_run, relative_error

MICRO = 2
ROUNDS = 12
TOLERANCE = 1e-6


@dataclass(frozen=True)
class DDPVariant:
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    find_unused_parameters: bool = False
    no_sync: bool = False  # the first micro-batch of each round runs under ddp.no_sync()
    frozen_param: bool = False  # the model has a parameter that is not trained
    device: str = "cpu"  # "cuda": the model on this rank's GPU (tests/test_cuda.py, on NCCL)


def train_with_acco_optimizer(
    rank: int, mode: str, device: str = "cpu", rounds: int = ROUNDS
) -> dict[str, torch.Tensor]:
    from acco_hooks import ACCOOptimizer
    from tests.scenario import make_model, microbatch_loss, param_groups

    model = make_model().to(device)
    opt_class, kwargs = OPTIMIZERS["adamw"]
    opt = ACCOOptimizer(param_groups(model, True), opt_class, mode=mode,
                        accumulation_steps=MICRO, **kwargs)  # fmt: skip
    for r in range(rounds):
        for m in range(MICRO):
            microbatch_loss(model, rank, r, m).backward()
            opt.step()
    opt.flush()
    opt.close()
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}


def hook_vs_optimizer(rank: int, world_size: int, mode: str, variant: DDPVariant,
                      rounds: int = ROUNDS, optimizer_mode: str | None = None) -> dict:  # fmt: skip
    from torch.nn.parallel import DistributedDataParallel as DDP

    from acco_hooks import ACCOState, acco_hook
    from tests.scenario import make_model, microbatch_loss, param_groups

    expected = train_with_acco_optimizer(rank, optimizer_mode or mode, variant.device, rounds)

    model = make_model()
    if variant.frozen_param:
        model.unused = nn.Linear(2, 2).requires_grad_(False)
    model.to(variant.device)
    # A tiny bucket cap: every parameter lands in a bucket of its own after the rebuild.
    ddp = DDP(model, bucket_cap_mb=1e-4, gradient_as_bucket_view=variant.gradient_as_bucket_view,
              static_graph=variant.static_graph,
              find_unused_parameters=variant.find_unused_parameters)  # fmt: skip
    opt_class, kwargs = OPTIMIZERS["adamw"]
    groups = param_groups(model, True)
    state = ACCOState(ddp, opt_class, mode=mode, accumulation_steps=MICRO,
                      param_groups=groups, **kwargs)  # fmt: skip
    buckets_per_backward: list[list[int]] = []

    def counting_acco_hook(state, bucket):
        buckets_per_backward[-1].append(len(bucket.parameters()))
        return acco_hook(state, bucket)

    ddp.register_comm_hook(state, counting_acco_hook)
    for r in range(rounds):
        for m in range(MICRO):
            skip_sync = variant.no_sync and m == 0
            buckets_per_backward.append([])
            with ddp.no_sync() if skip_sync else contextlib.nullcontext():
                microbatch_loss(ddp, rank, r, m).backward()
            # the gradient went to the engine (under no_sync too); .grad holds its placeholder
            assert all(isinstance(p.grad, GradientInEngine) for p in state.engine.params)
            state.step()
    state.flush()
    state.close()
    actual = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
    return {"expected": expected, "actual": actual, "buckets": [b for b in buckets_per_backward if b]}


@pytest.mark.parametrize(
    "mode, variant",
    [
        ("acco", DDPVariant()),
        ("dpu", DDPVariant()),
        ("ddp", DDPVariant()),
        ("acco", DDPVariant(gradient_as_bucket_view=True)),
        ("acco", DDPVariant(static_graph=True)),
        ("acco", DDPVariant(no_sync=True)),
        ("dpu", DDPVariant(no_sync=True, gradient_as_bucket_view=True)),
        ("acco", DDPVariant(find_unused_parameters=True, frozen_param=True)),
    ],
    ids=lambda v: v if isinstance(v, str) else ",".join(
        k for k, on in vars(v).items() if on is True) or "default",
)
def test_acco_hook_equals_acco_optimizer(mode: str, variant: DDPVariant) -> None:
    results = run_distributed("tests.ddp_hooks.test_ddp_hooks:hook_vs_optimizer", 2, mode, variant)
    assert_hook_equals_optimizer(results, variant)


def test_acco_hook_in_auto_mode_starts_as_synchronous_training() -> None:
    """``mode="auto"`` through the hook: its first 5 updates, while it measures, are the
    synchronous schedule: ``ddp`` mode of ACCOOptimizer, to float noise."""
    results = run_distributed("tests.ddp_hooks.test_ddp_hooks:hook_vs_optimizer", 2, "auto",
                              DDPVariant(), 5, "ddp")  # fmt: skip
    assert_hook_equals_optimizer(results, DDPVariant())


def assert_hook_equals_optimizer(results: list[dict], variant: DDPVariant) -> None:
    for rank, result in enumerate(results):
        actual = {n: v for n, v in result["actual"].items() if not n.startswith("unused")}
        error = relative_error(actual, result["expected"])
        assert error <= TOLERANCE, f"rank {rank}: relative error {error:.2e}"
        buckets = result["buckets"]
        assert max(len(b) for b in buckets) > 1  # several buckets per backward
        if not variant.find_unused_parameters:  # DDP only rebuilds without unused detection
            assert buckets[0] != buckets[-1]  # it rebuilt them after the first iteration
    for result in results[1:]:  # the replicas agree, unused param too
        for name, value in results[0]["actual"].items():
            assert torch.equal(value, result["actual"][name]), name


def delayed_allreduce_run(rank: int, world_size: int, rounds: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from acco_hooks import DelayedAllReduceState, delayed_allreduce_hook
    from tests.scenario import make_model, microbatch_loss

    model = make_model()
    initial = [p.detach().clone() for p in model.parameters()]
    ddp = DDP(model, bucket_cap_mb=1e-4)
    state = DelayedAllReduceState()
    ddp.register_comm_hook(state, delayed_allreduce_hook)
    opt_class, kwargs = OPTIMIZERS["adamw"]
    opt = opt_class(model.parameters(), **kwargs)
    first_round = {}
    for r in range(rounds):
        microbatch_loss(ddp, rank, r, 0).backward()
        if r == 0:
            first_round["grads_are_none"] = all(p.grad is None for p in model.parameters())
        opt.step()
        opt.zero_grad()
        if r == 0:
            first_round["params_unchanged"] = all(
                torch.equal(p, q) for p, q in zip(model.parameters(), initial)
            )
            first_round["adam_state_empty"] = len(opt.state) == 0
    state.flush()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, **first_round}


def test_delayed_allreduce_hook_equals_the_dpu_recursion() -> None:
    rounds = 13
    results = run_distributed("tests.ddp_hooks.test_ddp_hooks:delayed_allreduce_run", 2, rounds)
    # After R backward passes, R-1 updates have been applied (the last gradient is in flight).
    reference = reference_run(Config(mode="dpu", rounds=rounds - 1, micro=[1, 1], two_groups=False))
    for result in results:
        assert relative_error(result["params"], reference["params"]) <= TOLERANCE


def test_delayed_allreduce_hook_applies_no_update_in_the_first_round() -> None:
    for result in run_distributed("tests.ddp_hooks.test_ddp_hooks:delayed_allreduce_run", 2, 1):
        assert result["grads_are_none"]
        assert result["params_unchanged"]  # AdamW did not decay the weights
        assert result["adam_state_empty"]  # nor advance its step


def uneven_inputs_run(rank: int, world_size: int, limits: list[int]) -> dict:
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    from acco_hooks import ACCOState, acco_hook
    from tests.scenario import make_model, microbatch_loss

    model = make_model()
    ddp = DDP(model)
    opt_class, kwargs = OPTIMIZERS["adamw"]
    state = ACCOState(ddp, opt_class, mode="acco", accumulation_steps=MICRO, **kwargs)
    ddp.register_comm_hook(state, acco_hook)
    # averaged over the micro-batches that ran, as the engine's reference does (the default
    # divides by the initial world size, as plain DDP does: test_against_plain_ddp.py)
    with Join([ddp, state], divide_by_initial_world_size=False):
        for i in range(limits[rank]):
            microbatch_loss(ddp, rank, i // MICRO, i % MICRO).backward()
            state.step()
    state.flush()
    state.close()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "rounds": state.round_index}  # fmt: skip


def test_join_with_uneven_inputs_keeps_ranks_in_step() -> None:
    limits = [ROUNDS * MICRO, 15]  # rank 1 runs out of data in the middle of round 7
    results = run_distributed("tests.ddp_hooks.test_ddp_hooks:uneven_inputs_run", 2, limits)
    reference = reference_run(Config(mode="acco", rounds=ROUNDS, micro=[MICRO, MICRO],
                                     two_groups=False, limit=limits))  # fmt: skip
    for result in results:
        assert result["rounds"] == ROUNDS
        assert relative_error(result["params"], reference["params"]) <= TOLERANCE


def bad_use_run(rank: int, world_size: int) -> dict[str, str]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from acco_hooks import ACCOState, acco_hook
    from tests.scenario import make_model, microbatch_loss

    messages = {}

    def capture(key, fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the test inspects the message
            messages[key] = f"{type(exc).__name__}: {exc}"

    model = make_model()
    capture("not_ddp", lambda: ACCOState(model, torch.optim.AdamW))
    capture("lbfgs", lambda: ACCOState(DDP(make_model()), torch.optim.LBFGS, lr=1e-2))
    ddp = DDP(model)
    state = ACCOState(ddp, torch.optim.AdamW)
    ddp.register_comm_hook(state, acco_hook)
    capture("twice", lambda: ddp.register_comm_hook(state, acco_hook))
    capture("step_first", lambda: state.step())

    other = DDP(make_model())
    other.register_comm_hook(state, acco_hook)  # a state built for another model
    capture("other_model", lambda: microbatch_loss(other, rank, 0, 0).backward())
    state.close()
    return messages


def forgotten_step_run(rank: int, world_size: int) -> dict:
    """A loop that registers acco_hook but keeps its old optimizer.step(); zero_grad()."""
    import logging

    from torch.nn.parallel import DistributedDataParallel as DDP

    from acco_hooks import ACCOState, acco_hook
    from tests.scenario import make_model, microbatch_loss

    ddp = DDP(make_model())
    state = ACCOState(ddp, torch.optim.AdamW, accumulation_steps=2, lr=1e-3)
    ddp.register_comm_hook(state, acco_hook)
    old_optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    with ddp.no_sync():  # accumulating under no_sync() is legitimate: no refusal
        microbatch_loss(ddp, rank, 0, 0).backward()
    microbatch_loss(ddp, rank, 0, 1).backward()
    try:  # refused at once: .grad holds the engine's placeholder
        old_optimizer.step()
        old_step = None
    except RuntimeError as error:
        old_step = str(error)
    old_optimizer.zero_grad()
    try:
        microbatch_loss(ddp, rank, 0, 2).backward()
        refusal = None
    except RuntimeError as error:
        refusal = str(error)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("acco_hooks").addHandler(handler)
    state.close()
    return {"old_step": old_step, "refusal": refusal, "close": [r.getMessage() for r in records
                                          if r.levelno >= logging.WARNING]}


def test_a_forgotten_state_step_is_refused_at_the_next_backward_and_named_at_close() -> None:
    for result in run_distributed("tests.ddp_hooks.test_ddp_hooks:forgotten_step_run", 2):
        assert result["old_step"] is not None, "the old optimizer stepped the placeholders"
        assert "ACCOState.step() under DDP) replaces it" in result["old_step"]
        assert result["refusal"] is not None, "a second backward without state.step() ran"
        assert "call state.step() after every backward()" in result["refusal"]
        assert "ddp_model.no_sync()" in result["refusal"]
        (warning,) = result["close"]
        assert "never applied (0 updates in all): call step() after every backward()" in warning


def test_bad_use_is_refused_with_a_clear_message() -> None:
    messages = run_distributed("tests.ddp_hooks.test_ddp_hooks:bad_use_run", 1)[0]
    assert messages["not_ddp"].startswith("TypeError: ACCOState needs a torch.nn.parallel.DistributedDataParallel model")
    # plain DDP would run it; a sharded step on the communication thread cannot
    assert messages["lbfgs"].startswith("TypeError: acco_hooks: torch.optim.LBFGS cannot step "
                                        "the engine's shard: it needs a closure")
    assert "can only be called once" in messages["twice"]
    assert "no backward() ran since the last step()" in messages["step_first"]
    assert "the state was built for another model" in messages["other_model"]


class Branchy(nn.Module):
    """TinyNet and a branch that only some micro-batches use (a conditional path, an MoE
    expert): with ``find_unused_parameters`` DDP hands the hook zeros for it where unused."""

    def __init__(self) -> None:
        super().__init__()
        from tests.scenario import make_model

        self.trunk = make_model()
        self.branch = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        out = self.trunk(x)
        return out + self.branch(out) if use_branch else out


def find_unused_run(rank: int, world_size: int, who_uses_the_branch: str) -> dict:
    """The DDP hook in mode ddp against plain DDP with the same AdamW, both with
    ``find_unused_parameters=True``; every rank uses the branch in even steps, and in odd ones
    rank 0 alone (``"rank 0"``) or no rank (``"every rank"``)."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    from acco_hooks import ACCOState, acco_hook

    torch.manual_seed(0)
    model = Branchy()
    reference = copy.deepcopy(model)
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    plain = DDP(reference, find_unused_parameters=True)
    plain_opt = torch.optim.AdamW(reference.parameters(), **kwargs)
    ddp = DDP(model, find_unused_parameters=True)
    state = ACCOState(ddp, torch.optim.AdamW, mode="ddp", accumulation_steps=1, **kwargs)
    ddp.register_comm_hook(state, acco_hook)
    refusal = None
    for step in range(6):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
        use = step % 2 == 0 or (who_uses_the_branch == "rank 0" and rank == 0)
        nn.functional.mse_loss(plain(x, use), y).backward()
        plain_opt.step()
        plain_opt.zero_grad()
        nn.functional.mse_loss(ddp(x, use), y).backward()
        try:
            state.step()
        except RuntimeError as error:
            refusal = (step, str(error))
            break
    state.close(flush=refusal is None, barrier=refusal is None)
    return {"refusal": refusal,
            "hook": {n: p.detach().clone() for n, p in model.named_parameters()},
            "plain": {n: p.detach().clone() for n, p in reference.named_parameters()}}  # fmt: skip


def test_a_parameter_unused_on_some_ranks_trains_as_with_plain_ddp() -> None:
    """find_unused_parameters, a branch rank 1 leaves unused every other step: the engine
    averages its gradient over both ranks' micro-batches, as DDP averages rank 0's gradient
    with rank 1's zeros."""
    for result in run_distributed(f"{__name__}:find_unused_run", 2, "rank 0"):
        assert result["refusal"] is None
        assert relative_error(result["hook"], result["plain"]) <= 1e-5


def test_a_parameter_no_rank_used_in_a_round_is_refused_by_name() -> None:
    """Plain DDP skips a parameter no rank used in a step (no decay, no moment, no step
    count); the engine cannot leave part of its flat shard out of a step, so that round is
    refused, on every rank, naming the parameter, and nothing is stepped."""
    for result in run_distributed(f"{__name__}:find_unused_run", 2, "every rank"):
        step, message = result["refusal"]
        assert step in (1, 2)  # round 1's job finds it; ddp mode waits for it within step 1
        assert "no rank computed a gradient for branch.weight, branch.bias in round 1" in message
        assert "find_unused_parameters" in message and "requires_grad=False" in message


def one_step_late_reference(model: nn.Module, world_size: int, steps: int, batch) -> dict:
    """The delayed update written by hand, in one process: step t applies, with AdamW, the
    average over the ranks of step t-1's gradients (each rank's summed over its micro-batches),
    computed at step t-1's weights; ``None`` (skipped) for a parameter no rank used then."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    pending = None
    for step in range(steps):
        total: dict = {}
        for rank in range(world_size):
            for loss in batch(model, rank, step):
                model.zero_grad(set_to_none=True)
                loss.backward()
                for p in model.parameters():
                    if p.grad is not None:
                        total[p] = total.get(p, 0) + p.grad / world_size
        if pending is not None:
            for p in model.parameters():
                p.grad = pending.get(p)
            opt.step()
        pending = total
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def branchy_batches(model: nn.Module, rank: int, step: int, microbatches: int = 1,
                    branch_every: int = 1) -> list[torch.Tensor]:  # fmt: skip
    """A step's micro-batch losses on ``rank``; the branch is used on steps divisible by
    ``branch_every``, on every rank."""
    losses = []
    for micro in range(microbatches):
        g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
        losses.append(nn.functional.mse_loss(model(x, step % branch_every == 0), y))
    return losses


def delayed_hook_run(rank: int, world_size: int, no_sync: bool, branch_every: int,
                     ddp_options: tuple[str, ...] = ()) -> dict:  # fmt: skip
    """The delayed hook with AdamW over 6 steps of 2 micro-batches (the first under no_sync()
    or not), or of 1 micro-batch with the branch used every ``branch_every`` steps under
    ``find_unused_parameters``, with the DDP ``ddp_options`` turned on; and the one-step-late
    reference."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    from acco_hooks import DelayedAllReduceState, delayed_allreduce_hook

    steps, microbatches = 6, 2 if branch_every == 1 else 1
    torch.manual_seed(0)
    model = Branchy()
    reference = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=1e-4, find_unused_parameters=branch_every > 1,
              **dict.fromkeys(ddp_options, True))  # fmt: skip
    state = DelayedAllReduceState()
    ddp.register_comm_hook(state, delayed_allreduce_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    refusal = None
    try:
        for step in range(steps):
            for micro in range(microbatches):
                first = micro < microbatches - 1
                with ddp.no_sync() if no_sync and first else contextlib.nullcontext():
                    branchy_batches(ddp, rank, step, microbatches, branch_every)[micro].backward()
            opt.step()
            opt.zero_grad()
    except RuntimeError as error:
        refusal = (step, str(error))
    state.flush()
    batch = functools.partial(branchy_batches, microbatches=microbatches, branch_every=branch_every)
    return {"refusal": refusal, "hook": {n: p.detach().clone() for n, p in model.named_parameters()},
            "reference": one_step_late_reference(reference, world_size, steps, batch)}  # fmt: skip


@pytest.mark.parametrize("ddp_options", [(), ("gradient_as_bucket_view",)],
                         ids=lambda o: "+".join(o) or "default")  # fmt: skip
def test_delayed_hook_accumulates_under_no_sync_as_the_one_step_late_update(ddp_options) -> None:
    for result in run_distributed(f"{__name__}:delayed_hook_run", 2, True, 1, ddp_options):
        assert result["refusal"] is None
        assert relative_error(result["hook"], result["reference"]) <= 1e-5


def test_delayed_hook_refuses_a_backward_that_adds_to_the_delivered_gradient() -> None:
    """Two synchronized backward passes per step (a loop plain DDP accepts): the second adds to
    the average the first delivered, which would be all-reduced again (one micro-batch per
    update, not two). Refused at the first backward that would (step 1: step 0's first
    backward delivers nothing), on every rank."""
    for result in run_distributed(f"{__name__}:delayed_hook_run", 2, False, 1):
        step, message = result["refusal"]
        assert step == 1
        assert "adds to the gradient the hook delivered" in message
        assert "run all but the last under ddp_model.no_sync()" in message


def test_delayed_hook_with_find_unused_parameters_is_the_one_step_late_update() -> None:
    """A branch no rank uses every other step: one step later it gets None (skipped: no decay,
    no moment), as the one-step-late update of plain DDP's gradients would; after a step that
    used it, its average arrives although DDP leaves an unused parameter's .grad alone."""
    for result in run_distributed(f"{__name__}:delayed_hook_run", 2, False, 2):
        assert result["refusal"] is None
        assert relative_error(result["hook"], result["reference"]) <= 1e-5
