"""Optimizers that look at each parameter whole, on the whole-parameter layout (``engine.layout``).

``torch.optim.Muon`` steps the matrices and AdamW the rest, in one engine (the matrices' group
names its class): each rank steps the matrices it owns in their real shapes. Held to the
single-process reference of the spec's recursions with torch's own Muon and AdamW, in every
mode, on 1 to 4 ranks (with 4 ranks and 4 matrices each rank owns one; with the 2 matrices of
the small model, two ranks own none).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from acco_hooks import declare_per_parameter_optimizer
from tests.dist_utils import run_distributed
from tests.engine.test_optimizers import (
    LARS,
    STEPS,
    GlobalClippingSGD,
    LateTrustRatioSGD,
    MatrixDecayAdamW,
    MuPSGD,
    TrustRatioSGD,
    batch,
    through_dcp,
    torch_training,
    train_and_checkpoint,
)
from tests.scenario import (
    MUON,
    Config,
    expected_updates,
    make_model,
    reference_run,
    relative_error,
)

# Against the spec's reference, DeepNet's gradients lie on a grid whose float32 sums are exact
# in any order, so the ranks' ring and the reference's loop give Muon the same bits (measured:
# 0 in every mode on 1 to 4 ranks). Off the grid, Muon's bfloat16 Newton–Schulz turned a one-ulp
# difference of the averaged gradient into 1.2e-3 (ddp, 4 ranks, 12 rounds).
TOLERANCE = 1e-6


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", ["ddp", "dpu", "acco"])
def test_muon_and_adamw_match_the_reference(mode: str, world_size: int) -> None:
    cfg = Config(mode=mode, world_size=world_size, micro=[1, 2, 1, 2][:world_size], rounds=12,
                 optimizer="muon", model="deep_on_grid")  # fmt: skip
    results = run_distributed("tests.scenario:engine_run", world_size, cfg)
    reference = reference_run(cfg)
    for rank, result in enumerate(results):
        error = relative_error(result["params"], reference["params"])
        print(mode, world_size, rank, f"{error:.2e}")
        assert error <= TOLERANCE, (rank, error)
        assert result["num_updates"] == expected_updates(cfg)


# ---------------------------------------------------------------- against torch's own, and resumed


def groups(model: nn.Module, name: str) -> list[dict]:
    """``muon``: Muon on the matrices (their group names the class), AdamW on the rest;
    ``adafactor``: Adafactor on every group (its biases and gain at half the learning rate)."""
    named = list(model.named_parameters())
    matrices = [(n, p) for n, p in named if p.ndim == 2]
    rest = [(n, p) for n, p in named if p.ndim != 2]
    if name == "muon":
        return [{"params": matrices, "optimizer_class": torch.optim.Muon, **MUON},
                {"params": rest, "weight_decay": 0.0}]  # fmt: skip
    return [{"params": matrices}, {"params": rest, "lr": DEFAULT[name][1]["lr"] / 2}]


@declare_per_parameter_optimizer
class WholeLARS(LARS):
    pass


@declare_per_parameter_optimizer
class WholeTrustRatioSGD(TrustRatioSGD):
    pass


@declare_per_parameter_optimizer
class WholeMuPSGD(MuPSGD):
    pass


@declare_per_parameter_optimizer
class WholeMatrixDecayAdamW(MatrixDecayAdamW):
    pass


@declare_per_parameter_optimizer
class WholeLateTrustRatioSGD(LateTrustRatioSGD):
    pass


@declare_per_parameter_optimizer
class WholeGlobalClippingSGD(GlobalClippingSGD):
    pass


DEFAULT = {  # the class a group that names none is stepped by, and its arguments
    "muon": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adafactor": (torch.optim.Adafactor, dict(lr=1e-2, weight_decay=1e-2)),
    # classes that look at each parameter whole, declared by their author
    "lars": (WholeLARS, dict(lr=5e-2)),
    "trust_ratio": (WholeTrustRatioSGD, dict(lr=1e-2)),
    "mup": (WholeMuPSGD, dict(lr=5e-2)),
    "matrix_decay": (WholeMatrixDecayAdamW, dict(lr=1e-2)),
    "late_trust_ratio": (WholeLateTrustRatioSGD, dict(lr=1e-2)),
}
DECLARED = ("lars", "trust_ratio", "mup", "matrix_decay", "late_trust_ratio")
def torch_run(name: str, world_size: int) -> dict[str, torch.Tensor]:
    """The oracle: torch's own optimizers on the whole parameters, each step on the average of
    the ranks' gradients."""
    model = make_model(model="deep")
    cls, kwargs = DEFAULT[name]
    plain = [{**g, "params": [p for _, p in g["params"]]} for g in groups(model, name)]
    if name == "muon":
        matrices = {k: v for k, v in plain[0].items() if k != "optimizer_class"}
        optimizers = [torch.optim.Muon([matrices]), cls([plain[1]], **kwargs)]
    else:
        optimizers = [cls(plain, **kwargs)]
    return torch_training(model, optimizers, world_size)


def engine_run(rank: int, world_size: int, name: str, mode: str = "ddp", first: int = 0,
               last: int = STEPS, save_to: str | None = None, save_at: int = -1,
               load_from: str | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """``ACCOOptimizer`` over the same groups, one micro-batch per round: micro-batches
    ``first`` .. ``last - 1``, saving with DCP after ``save_at`` of them, after loading
    ``load_from``."""
    from acco_hooks import ACCOOptimizer

    cls, kwargs = DEFAULT[name]
    model = make_model(model="deep")
    opt = ACCOOptimizer(groups(model, name), cls, mode=mode, accumulation_steps=1, **kwargs)
    return train_and_checkpoint(model, opt, rank, world_size, first, last, save_at,
                                *through_dcp(save_to, load_from))  # fmt: skip


@pytest.mark.parametrize("name", DECLARED)
def test_a_class_declared_per_parameter_steps_as_torch_on_whole_parameters(
    name: str, rank_pool
) -> None:
    """LARS's and LAMB's trust ratios, muP's fan-in, decay of matrices only, a trust ratio from
    the 4th step: what the flat shard refuses runs exactly on whole parameters, 3 ranks."""
    ranks = rank_pool.run(f"{__name__}:engine_run", 3, name)
    error = relative_error(ranks[0], torch_run(name, 3))
    assert error <= TOLERANCE, error


def test_a_class_declared_per_parameter_that_looks_at_other_parameters_is_refused() -> None:
    """Clipping by the norm over all of the optimizer's parameters inside ``step()``: the probe
    deals the parameters to two instances, and their norms differ."""
    from acco_hooks import ACCOOptimizer

    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    with pytest.raises(TypeError, match=r"WholeGlobalClippingSGD was declared per parameter "
                                        r"\(declare_per_parameter_optimizer\).*gave a different "
                                        r"its update.*several parameters at once"):
        ACCOOptimizer(model.named_parameters(), WholeGlobalClippingSGD, lr=0.1)


@pytest.mark.parametrize("name", ["adafactor", "muon"])
def test_whole_parameter_optimizers_step_as_torch_and_resume_anywhere(
    name: str, rank_pool, tmp_path
) -> None:
    """ddp on 1 to 4 ranks: torch's optimizers on the averaged gradient. acco, saved between an
    estimate and its update (the state, ΣG̃ and the update in flight), resumed through DCP on
    2, 1, 3 and 4 ranks, where other ranks own the parameters: the uninterrupted run's."""
    for world_size in (1, 2, 3, 4):
        ranks = rank_pool.run(f"{__name__}:engine_run", world_size, name)
        error = relative_error(ranks[0], torch_run(name, world_size))
        print(name, "ddp", world_size, f"{error:.2e}")
        assert error <= TOLERANCE, (world_size, error)
        assert all(relative_error(r, ranks[0]) == 0.0 for r in ranks[1:])
    ckpt = str(tmp_path / "between")
    straight = rank_pool.run(f"{__name__}:engine_run", 2, name, "acco", 0, 12, ckpt, 5)[0]
    for world_size in (2, 1, 3, 4):
        resumed = rank_pool.run(f"{__name__}:engine_run", world_size, name, "acco", 5, 12, None,
                                -1, ckpt)[0]  # fmt: skip
        error = relative_error(resumed, straight)
        print(name, "resumed on", world_size, f"{error:.2e}")
        assert error == 0.0 if world_size == 2 else error <= 1e-5, (world_size, error)


def per_rank_file_run(rank: int, world_size: int, first: int, last: int, directory: str,
                      save_at: int = -1) -> dict[str, torch.Tensor]:  # fmt: skip
    """The small model's two matrices under Muon on 3 ranks (one rank owns neither), in acco,
    saved to and resumed from per-rank files (``acco_hooks.checkpoint``)."""
    from acco_hooks import ACCOOptimizer, checkpoint

    model = make_model(model="tiny")
    cls, kwargs = DEFAULT["muon"]
    opt = ACCOOptimizer(groups(model, "muon"), cls, mode="acco", accumulation_steps=1, **kwargs)
    path = f"{directory}/rank{rank}.pt"
    return train_and_checkpoint(model, opt, rank, world_size, first, last, save_at,
                                lambda state: checkpoint.save(state, path),
                                (lambda _: checkpoint.load(path)) if first else None)  # fmt: skip


def test_a_rank_that_owns_no_matrix_trains_and_resumes_from_its_own_file(rank_pool, tmp_path):
    straight = rank_pool.run(f"{__name__}:per_rank_file_run", 3, 0, 12, str(tmp_path), 5)
    resumed = rank_pool.run(f"{__name__}:per_rank_file_run", 3, 5, 12, str(tmp_path))
    for before, after in zip(straight, resumed):
        assert relative_error(after, before) == 0.0


def ddp_hook_run(rank: int, world_size: int, mode: str) -> dict[str, torch.Tensor]:
    """The same Muon and AdamW groups through the DDP communication hook."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from acco_hooks import ACCOState, acco_hook

    model = DDP(make_model(model="deep"))
    cls, kwargs = DEFAULT["muon"]
    state = ACCOState(model, cls, param_groups=groups(model.module, "muon"), mode=mode,
                      accumulation_steps=1, **kwargs)  # fmt: skip
    model.register_comm_hook(state, acco_hook)
    for step in range(STEPS):
        x, y = batch(step, rank, world_size)
        nn.functional.mse_loss(model(x), y).backward()
        state.step()
    state.flush()
    params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    owned = [state.engine.layouts[0].owned(r) for r in range(world_size)]
    state.close()
    return {"params": params, "owned": owned}


def test_muon_through_the_ddp_hook_steps_as_torch(rank_pool) -> None:
    ranks = rank_pool.run(f"{__name__}:ddp_hook_run", 3, "ddp")
    error = relative_error(ranks[0]["params"], torch_run("muon", 3))
    assert error <= TOLERANCE, error
    # the four matrices, whole, over three ranks: one rank owns two
    assert sorted(len(owned) for owned in ranks[0]["owned"]) == [1, 1, 2]


# ---------------------------------------------------------------- auto, and a narrow estimate


@pytest.mark.parametrize("settings", [
    dict(mode="acco", accumulation_steps=2, estimate_dtype="bfloat16"),
    dict(mode="auto", accumulation_steps=4),
], ids=["bfloat16-estimate", "auto"])  # fmt: skip
def test_every_muon_update_averages_all_its_gradients(settings: dict) -> None:
    """Whole parameters under the other schedules: an estimate sent in bfloat16 (θ̃ − θ
    gathered narrow), and ``auto`` switching from synchronous updates to overlapped ones
    (emulated timings make it switch): each real update is torch's Muon and AdamW step of the
    float32 average of every gradient of that update, at the point it was computed at."""
    from tests.engine.test_schedules import (
        LINK_HIDES,
        assert_every_update_is_the_average,
    )

    emulated = LINK_HIDES if settings["mode"] == "auto" else None
    updates = 14 if emulated else 8
    results = run_distributed("tests.engine.test_schedules:recorded_run", 2, settings, updates,
                              emulated, None, None, False, "muon")  # fmt: skip
    if emulated:
        assert any(s[0] for s in results[0]["schedules"]), results[0]["schedules"]  # overlapped
    assert_every_update_is_the_average(results, updates)


# ---------------------------------------------------------------- refused by name


def test_a_muon_group_that_holds_a_bias_is_refused_by_name() -> None:
    """Before any process group exists. (Every layout runs whole parameters: FSDP and tensor
    parallelism inside a replica, tests/engine/test_hsdp.py and test_tensor_parallel.py; inside
    torchft groups, test_torchft.py.)"""
    from acco_hooks import ACCOOptimizer

    model = nn.Linear(4, 3)
    with pytest.raises(TypeError, match=r"torch\.optim\.Muon refused the parameters of its "
                                        r"group\(s\), shaped \[\(3,\), \(3, 4\)\].*2-D matrices"):
        ACCOOptimizer([{"params": list(model.named_parameters()),
                        "optimizer_class": torch.optim.Muon}], torch.optim.AdamW)  # fmt: skip


# ---------------------------------------------------------------- a torch optimizer's state, by name


def torch_then_engine(rank: int, world_size: int, load: bool) -> tuple[dict, dict]:
    """torch's Muon and AdamW on the averaged gradient for 3 steps, then the engine (``ddp``)
    from their weights and, by name, their state (or not), beside torch's going on."""
    from acco_hooks import ACCOOptimizer

    reference = make_model(model="deep")
    cls, kwargs = DEFAULT["muon"]
    plain = [{**g, "params": [p for _, p in g["params"]]} for g in groups(reference, "muon")]
    matrices = {k: v for k, v in plain[0].items() if k != "optimizer_class"}
    torch_opts = [torch.optim.Muon([matrices]), cls([plain[1]], **kwargs)]

    def torch_step(step: int) -> None:  # every rank's share, averaged
        reference.zero_grad()
        losses = [nn.functional.mse_loss(reference(x), y)
                  for x, y in (batch(step, r, world_size) for r in range(world_size))]  # fmt: skip
        (sum(losses) / world_size).backward()
        for optimizer in torch_opts:
            optimizer.step()

    for step in range(3):
        torch_step(step)
    model = copy.deepcopy(reference)
    opt = ACCOOptimizer(groups(model, "muon"), cls, mode="ddp", accumulation_steps=1, **kwargs)
    if load:
        state = {**torch_opts[0].state, **torch_opts[1].state}
        opt.engine.load_optimizer_state_by_name(
            {name: state[p] for name, p in reference.named_parameters()}
        )
    for step in range(3, 6):
        x, y = batch(step, rank, world_size)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        torch_step(step)
    opt.close()
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: p.detach().clone() for n, p in reference.named_parameters()})  # fmt: skip


def test_a_torch_optimizers_state_by_name_continues_on_the_owners(rank_pool) -> None:
    """What continuing torchtitan's own checkpoints needs: Muon's momentum of each matrix
    reaches the rank that owns it (3 ranks: one owns two)."""
    for ours, torchs in rank_pool.run(f"{__name__}:torch_then_engine", 3, True):
        assert relative_error(ours, torchs) <= TOLERANCE
    ours, torchs = rank_pool.run(f"{__name__}:torch_then_engine", 3, False)[0]
    assert relative_error(ours, torchs) > 1e-4  # without it, Muon's momentum starts at zero


# ---------------------------------------------------------------- which options a group takes


def test_a_group_takes_the_defaults_of_the_class_that_steps_it() -> None:
    """torch's rule: the keyword arguments are the optimizer class's defaults. The vectors'
    group names that class (AdamW) and inherits lr and weight_decay from them; the matrices'
    group names Muon and takes Muon's own defaults, not AdamW's keyword arguments."""
    from acco_hooks import ACCOOptimizer

    model, reference = make_model(model="deep"), make_model(model="deep")
    named = list(model.named_parameters())
    opt = ACCOOptimizer(
        [{"params": [(n, p) for n, p in named if p.ndim == 2], "optimizer_class": torch.optim.Muon},
         {"params": [(n, p) for n, p in named if p.ndim != 2],
          "optimizer_class": torch.optim.AdamW}],
        torch.optim.AdamW, mode="ddp", accumulation_steps=1, lr=3e-2, weight_decay=0.3,
    )  # fmt: skip
    muon, adamw = opt.param_groups
    defaults = torch.optim.Muon([torch.zeros(2, 2)]).defaults
    assert (muon["lr"], muon["weight_decay"]) == (defaults["lr"], defaults["weight_decay"])
    assert (adamw["lr"], adamw["weight_decay"]) == (3e-2, 0.3)
    plain = list(reference.parameters())
    torch_opts = [torch.optim.Muon([p for p in plain if p.ndim == 2]),
                  torch.optim.AdamW([p for p in plain if p.ndim != 2], lr=3e-2, weight_decay=0.3)]
    expected = torch_training(reference, torch_opts, 1)
    ours = train_and_checkpoint(model, opt, 0, 1, 0, STEPS)
    assert relative_error(ours, expected) <= TOLERANCE


def test_a_required_argument_comes_from_the_groups_or_is_refused_by_name() -> None:
    """A class whose ``__init__`` requires ``lr`` (many LARS ports) is built with its groups'
    own, which each keeps; a group that names it without one is refused, naming the group."""
    from acco_hooks import ACCOOptimizer
    from tests.scenario import WarmupTrustRatioSGD

    declare_per_parameter_optimizer(WarmupTrustRatioSGD)
    model = make_model(model="deep")
    named = list(model.named_parameters())
    matrices = [(n, p) for n, p in named if p.ndim == 2]
    rest = [(n, p) for n, p in named if p.ndim != 2]
    opt = ACCOOptimizer([{"params": matrices[:2], "optimizer_class": WarmupTrustRatioSGD,
                          "lr": 0.1},
                         {"params": matrices[2:], "optimizer_class": WarmupTrustRatioSGD,
                          "lr": 0.2},
                         {"params": rest}], torch.optim.AdamW, lr=1e-2)  # fmt: skip
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.2, 1e-2]
    opt.close()
    with pytest.raises(TypeError, match=r"WarmupTrustRatioSGD.__init__ requires 'lr', and the "
                                        r"group of layers\.2\.weight is stepped by .* without one: "
                                        r"set 'lr' in every group that names optimizer_class="):
        ACCOOptimizer([{"params": matrices[:2], "optimizer_class": WarmupTrustRatioSGD,
                        "lr": 0.1},
                       {"params": matrices[2:], "optimizer_class": WarmupTrustRatioSGD},
                       {"params": rest}], torch.optim.AdamW, lr=1e-2)  # fmt: skip
    with pytest.raises(TypeError, match=r"requires 'lr', and the group of layers\.0\.weight is "
                                        r"stepped by .* pass lr= beside the optimizer class"):
        ACCOOptimizer(matrices, WarmupTrustRatioSGD)


# ---------------------------------------------------------------- the estimate leaves no trace


@pytest.mark.parametrize("mode", ["ddp", "acco"])
def test_a_step_count_kept_on_the_instance_matches_the_reference(mode: str) -> None:
    """WarmupTrustRatioSGD counts its steps in ``self.calls``: the estimate puts the count back,
    so that its warm-up counts real updates only (unrestored, it read 12 after 6 updates)."""
    cfg = Config(mode=mode, world_size=2, micro=[1, 2], rounds=12, optimizer="warmup",
                 model="deep")  # fmt: skip
    results = run_distributed("tests.scenario:engine_run", 2, cfg)
    reference = reference_run(cfg)
    for result in results:
        assert relative_error(result["params"], reference["params"]) <= TOLERANCE
        assert result["num_updates"] == expected_updates(cfg)


class InPlaceCountSGD(torch.optim.SGD):
    """A warm-up whose count lives in a tensor on the instance, added to in place."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, lr=lr)
        self.seen = torch.zeros(())

    @torch.no_grad()
    def step(self, closure=None):
        self.seen.add_(1)
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] * min(1.0, float(self.seen) / 4))


class ClassClockSGD(torch.optim.SGD):
    """A warm-up counted on the class, which no instance holds."""

    calls = [0]

    @torch.no_grad()
    def step(self, closure=None):
        type(self).calls[0] += 1
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] * min(1.0, type(self).calls[0] / 100))


@pytest.mark.parametrize("cls, trace", [
    (InPlaceCountSGD, r"its step changes 'seen' of the optimizer in place"),
    (ClassClockSGD, r"its estimate step gave another update than the real step"),
])  # fmt: skip
def test_a_step_that_leaves_a_trace_the_estimate_cannot_put_back_is_refused(cls, trace) -> None:
    """In the modes with an estimate round, by name, before any process group exists. The
    others have no estimate step: they run the count on the instance (the clock on the class,
    which every rank's instance would share, differs between two instances there too)."""
    from acco_hooks import ACCOOptimizer

    declare_per_parameter_optimizer(cls)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    for mode in ("acco", "auto"):
        with pytest.raises(TypeError, match=rf"{cls.__qualname__} cannot take the estimate step "
                                            rf"of mode '{mode}': {trace}.*choose mode 'dpu' or 'ddp'"):
            ACCOOptimizer(model.named_parameters(), cls, mode=mode, accumulation_steps=2)
    if cls is InPlaceCountSGD:
        for mode in ("ddp", "dpu"):
            ACCOOptimizer(model.named_parameters(), cls, mode=mode).close()


# ---------------------------------------------------------------- schedulers over several classes


def test_a_momentum_cycling_scheduler_over_classes_that_keep_different_momenta() -> None:
    """OneCycleLR and CyclicLR cycle one momentum option in every group: Muon's groups keep
    'momentum' and AdamW's 'betas', refused by name; without cycling momentum they cycle the
    learning rate of every group as torch's own; Muon and SGD share 'momentum', which cycles."""
    from acco_hooks import ACCOOptimizer

    model = make_model(model="deep")
    named = list(model.named_parameters())
    matrices = [(n, p) for n, p in named if p.ndim == 2]
    rest = [(n, p) for n, p in named if p.ndim != 2]

    def one_cycle(cycle_momentum: bool):
        return lambda o: torch.optim.lr_scheduler.OneCycleLR(
            o, max_lr=0.1, total_steps=STEPS, cycle_momentum=cycle_momentum)

    def cyclic(o):
        return torch.optim.lr_scheduler.CyclicLR(o, 0.01, 0.1, step_size_up=2)

    for schedule in (one_cycle(True), cyclic):
        with pytest.raises(ValueError, match=r"lr_scheduler= failed on the shard optimizer "
                                             r"\(ValueError: optimizer must support momentum.*"
                                             r"Muon keeps 'momentum'; AdamW keeps 'betas'.*"
                                             r"build them with cycle_momentum=False"):
            ACCOOptimizer([{"params": matrices, "optimizer_class": torch.optim.Muon},
                           {"params": rest}], torch.optim.AdamW, lr_scheduler=schedule)
    for default_class, kwargs, cycle_momentum, keys in (
        (torch.optim.AdamW, dict(lr=1e-2), False, ("lr",)),
        (torch.optim.SGD, dict(lr=1e-2, momentum=0.9), True, ("lr", "momentum")),
    ):
        opt = ACCOOptimizer([{"params": matrices, "optimizer_class": torch.optim.Muon},
                             {"params": rest}], default_class, mode="ddp", accumulation_steps=1,
                            lr_scheduler=one_cycle(cycle_momentum), **kwargs)  # fmt: skip
        plain = torch.optim.SGD([{"params": [torch.zeros(1)]}, {"params": [torch.zeros(1)]}],
                                lr=1e-2, momentum=0.9)
        oracle = one_cycle(cycle_momentum)(plain)
        for step in range(STEPS - 1):
            x, y = batch(step, 0, 1)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.flush()
            plain.step()
            oracle.step()
            for ours, torchs in zip(opt.param_groups, plain.param_groups):
                assert all(ours[k] == pytest.approx(torchs[k]) for k in keys), (step, ours)
        opt.close()
