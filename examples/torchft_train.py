"""ACCO across torchft replica groups: a lost group drops out, the others keep stepping.

One lighthouse for the job, then one ``torchrun`` per replica group (a node, typically); on
one machine (docs/multinode.md, "Try it on one machine")::

    export TORCHFT_LIGHTHOUSE=http://localhost:29510 RUST_LOG=warn
    torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000 &
    for i in 0 1; do  # each group its own torchrun, with a port of its own on one host
        torchrun --nproc_per_node 2 --master_addr localhost --master_port $((29500 + i)) \\
            -m examples.torchft_train --replica-id $i --groups 2 --start-together \\
            --rounds 300 --microbatch-seconds 0.05 --out outputs/torchft &
    done

The first rank of each group prints a line every ``--log-every`` rounds (the round, its loss,
the updates applied), and acco_hooks one line per event (a group that left or joined, a sum
tried again, when it committed); torchft's own log is left out unless ``--torchft-logs``.

Inside a group, the engine shards its optimizer over the group's ranks (ZeRO-1) as usual, or,
with ``--fsdp S``, FSDP2 shards the model over S ranks and the engine runs over the group's
replicas of each shard (HSDP, ``ACCOHSDPOptimizer``); at each round end its communication thread sums rank r's shard over the groups through the
torchft ``Manager`` (``acco_hooks/engine/replicas.py``). Every group builds the same model from
the same seed; rank r of group i reads the data of data-parallel rank ``i * group_size + r`` of
the job, so that with every group alive the run equals one run over all the ranks
(``--groups G`` without ``--replica-id``: one torchrun of G x group_size processes, no torchft).

A group that joins a running job (restarted after it was lost, or started late: run its
torchrun again) takes a live group's state when the optimizer is built and trains on from the
round the engine says (``engine.round_index``), reading its data on from
``engine.microbatches_scheduled`` (in ``--mode auto`` rounds change size).

A group whose sum failed alone (its link, not the others') is left a committed round behind:
it takes a live group's state again in a later round's sum, sits that round out, and reads on
from ``engine.microbatches_scheduled``, which the loop therefore reads at every round end.

``--save NAME`` writes a distributed checkpoint (``torch.distributed.checkpoint``: the model and
``opt.state_dict()``) once the rounds are done, to ``--out/NAME_g{i}`` (the reference run:
``--out/NAME_ref``); ``--resume PATH`` loads one (a folder, in ``--out`` if relative) into the
optimizer just built, on any number of groups and ranks, with or without torchft, and trains on
to ``--rounds``.

Each rank writes its real parameters at the end to ``--out/params_g{i}_r{r}.pt`` (the reference
run: ``params_ref_r{rank}.pt``), with the updates it applied, the round it started training in
(after a join, the round after the one it joined in) and its data position then, the last
round it sat out to take a live group's state (``engine.joined_round``), and, for each round
end, the rounds ended, the updates applied, the time, how long the round end waited, the
schedule the round ran (``--mode auto`` changes it, the same in every group), the data
position and the micro-batches the rank ran in the round (``--until-ready``: more on a faster
group, up to ``--max-microbatches-per-round``; every round then takes that many data
positions, so the data position after round r is (r + 1) times it).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from acco_hooks import ACCOHSDPOptimizer, ACCOOptimizer
from acco_hooks.engine.replicas import check_lighthouse_address
from scaffolding.process_exit import finish

SAMPLES = 8  # per rank and micro-batch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="where each rank writes its final parameters")
    p.add_argument("--replica-id", type=int, default=None,
                   help="this replica group's index; omit for the reference run without torchft")
    p.add_argument("--groups", type=int, required=True, help="replica groups in the job")
    p.add_argument("--mode", default="acco", choices=["acco", "dpu", "ddp", "auto"])
    p.add_argument("--rounds", type=int, default=12, help="rounds to train")
    p.add_argument("--accumulation-steps", type=int, default=2, help="micro-batches per round")
    p.add_argument("--fsdp", type=int, default=0,
                   help="HSDP inside each group: shard the model with FSDP2 over this many ranks "
                   "(the group's ranks are replicas x shards; 0: plain ZeRO-1 data parallelism)")
    p.add_argument("--max-grad-norm", type=float, default=None)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--muon", action="store_true",
                   help="torch.optim.Muon on the two matrices (whole parameters, each on the "
                   "rank that owns it; with --fsdp brought together from the FSDP pieces), "
                   "AdamW on the biases")
    p.add_argument("--seed", type=int, default=0, help="of the initial parameters")
    p.add_argument("--init-sync", action="store_true",
                   help="torchft's init_sync=True: every group takes the first group's "
                   "parameters (and state) at the start")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds a collective may wait for a silent peer")
    p.add_argument("--engine-timeout", default=None,
                   help="the optimizer's timeout= if not --timeout ('none': None, the manager's "
                   "timeout bounds the search for a quorum)")
    p.add_argument("--min-replica-size", type=int, default=1,
                   help="torchft's min_replica_size: a step commits only over this many groups")
    p.add_argument("--lr-step-size", type=int, default=0,
                   help="an LR scheduler: halve the learning rate every this many updates "
                   "(StepLR; 0: none)")
    p.add_argument("--lr-at", type=float, nargs=2, default=None, metavar=("ROUND", "LR"),
                   help="set the learning rate by hand (opt.param_groups) once ROUND rounds "
                   "ended, as a warm-up written in the loop would")
    p.add_argument("--save", default=None,
                   help="write a distributed checkpoint to --out/NAME_g{i} (the reference: "
                   "NAME_ref) once the rounds are done")
    p.add_argument("--resume", default=None,
                   help="load this distributed checkpoint (a folder; relative: in --out) before "
                   "training")
    p.add_argument("--until-ready", action="store_true",
                   help="accumulate_until_ready: a group runs more micro-batches while the "
                        "previous round's sum is in flight (groups of unequal speed)")
    p.add_argument("--max-microbatches-per-round", type=int, default=None,
                   help="with --until-ready, required under torchft: the most micro-batches a "
                        "rank runs in a round, and the data positions every round takes")
    p.add_argument("--microbatch-seconds", type=float, default=0.0,
                   help="extra compute time per micro-batch, to stand for a real model (0.05 "
                   "with --rounds 300: a run of about a minute, long enough to kill a group)")
    p.add_argument("--log-every", type=int, default=10,
                   help="the first rank of each group prints the round and its loss every this "
                   "many rounds (0: never)")
    p.add_argument("--torchft-logs", action="store_true",
                   help="show torchft's own log too (its Python loggers, and RUST_LOG=info for "
                   "the lighthouse client and manager server: several lines per round)")
    p.add_argument("--link-seconds", type=float, default=0.0,
                   help="extra time each round's sum over the groups takes, to stand for a slow "
                   "link between them (--mode auto then chooses an overlapped schedule)")
    # A node lost at a chosen point (what tests/engine/test_torchft.py does to the job); each
    # torchrun must then run in a session of its own (setsid), which the kill takes whole.
    p.add_argument("--kill-group", type=int, default=None,
                   help="this replica group SIGKILLs itself (all its processes) at --kill-at")
    p.add_argument("--kill-at", default="mid_round",
                   choices=["mid_round", "after_estimate", "in_reduction"],
                   help="mid_round: in round --kill-round, after its first micro-batch; "
                   "after_estimate: once estimate round --kill-round was summed, before its "
                   "update; in_reduction: as the round's sum over the groups starts")
    p.add_argument("--kill-round", type=int, default=4)
    # A transient fault on one group's link: its sum of a round fails there alone (the others
    # commit it), and torchft retries that group by itself
    p.add_argument("--flaky-group", type=int, default=None,
                   help="this replica group's vote on round --flaky-round fails once, as after "
                   "an error on its own link")
    p.add_argument("--flaky-round", type=int, default=5)
    # A group that joins a running job: it waits for a file the running group writes at a round
    p.add_argument("--start-together", type=int, nargs="*", default=None, metavar="GROUP",
                   help="the first round waits for every group (--groups; or as many as these "
                   "groups are) to be up, for at most twice --timeout: the engine's "
                   "replica_groups. A group that comes later joins the running job (takes a "
                   "live group's state)")
    p.add_argument("--mark-round", type=int, default=None,
                   help="write --out/round_N once N rounds ended (local rank 0)")
    p.add_argument("--wait-for", default=None,
                   help="wait for this file in --out before joining (building the manager)")
    p.add_argument("--announce", default=None,
                   help="write this file in --out once the lighthouse has this group's first "
                   "quorum request (a joiner: the running group's next quorum then takes it "
                   "in); the lighthouse's log must be --out/lighthouse.log, as in "
                   "scaffolding.torchft_job.run_groups")
    p.add_argument("--hold-round", type=int, default=None,
                   help="once this many rounds ended (in --mode auto at the first update's end "
                   "from then on), wait for --hold-for in --out: a group that joins then meets "
                   "this one in the next round's sum (its first step, which compares settings) "
                   "and joins in the one after, whenever it comes")
    p.add_argument("--hold-for", default=None)
    p.add_argument("--hold-mid-update", action="store_true",
                   help="--mode auto: hold at a round end inside an update instead (after an "
                   "estimate round), so that a joiner's first step meets this group in the "
                   "update round's sum, and its join in the next estimate round's")
    # The reference of such a run: the same ranks without torchft, the lost group's ranks
    # contributing nothing from --stop-round on, until --resume-round (it joined again)
    p.add_argument("--stop-group", type=int, default=None)
    p.add_argument("--stop-round", type=int, default=None)
    p.add_argument("--resume-round", type=int, default=None)
    p.add_argument("--also-stop", type=int, nargs=3, action="append", default=[],
                   metavar=("GROUP", "FROM", "UNTIL"),
                   help="the same for another group: its ranks contribute nothing in rounds "
                   "FROM to UNTIL - 1")
    return p.parse_args()


def kill_this_group(out: Path) -> None:
    """What losing the node does: every process of this replica group dies at once. The time
    goes to ``out/killed_at`` first (for the recovery time)."""
    (out / "killed_at").write_text(repr(time.time()))
    os.killpg(os.getpgid(0), signal.SIGKILL)


def microbatch(index: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank ``dp_rank``'s micro-batch ``index``: the same in every launch."""
    g = torch.Generator().manual_seed(104729 * index + dp_rank)
    return torch.randn(SAMPLES, 16, generator=g), torch.randn(SAMPLES, 4, generator=g)


def build_model(seed: int, fsdp: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # every group starts from the same parameters
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    if fsdp:  # HSDP over this process's ranks (one group, or the reference's whole world)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size() // fsdp, fsdp),
                                mesh_dim_names=("dp_replicate", "dp_shard"))  # fmt: skip
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
    return model


def main() -> None:
    args = parse_args()
    if args.replica_id is not None and not args.torchft_logs:
        # torchft logs each quorum and commit (its manager server, in Rust: RUST_LOG) and
        # every error it hands the engine with a traceback (its Python loggers); the engine
        # says what happened to the job in one line per event instead
        os.environ.setdefault("RUST_LOG", "warn")
        logging.getLogger("torchft").setLevel(logging.CRITICAL)
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", timeout=timeout)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rank, group_size = dist.get_rank(), dist.get_world_size()
    manager = None
    if args.wait_for is not None:
        _wait_for(out, [args.wait_for], 4 * args.timeout)
    if args.replica_id is None:  # the reference: one group of every rank, no torchft
        dp_rank, tag = rank, f"ref_r{rank}"
    else:
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo

        check_lighthouse_address()  # before torchft's connect timeout hides a typo
        dying = args.kill_group == args.replica_id and args.kill_at == "in_reduction"
        manager_class = _slow_link(Manager, args.link_seconds) if args.link_seconds else Manager
        if dying:
            manager_class = _dying_manager(manager_class, args.kill_round, out)
        if args.flaky_group == args.replica_id:
            manager_class = _flaky_link(manager_class, args.flaky_round)
        name = f"acco_{args.replica_id}"  # the lighthouse's, with a uuid per start of the group
        manager = manager_class(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
            min_replica_size=args.min_replica_size,
            replica_id=name, timeout=timeout, connect_timeout=timeout,
            # every group builds the same model from the same seed: nothing to copy at the
            # start (init_sync=True copies the first group's state to the others)
            init_sync=args.init_sync,
        )  # fmt: skip
        if args.announce is not None:  # a test's joiner, under scaffolding.torchft_job
            from scaffolding.torchft_job import announce_first_quorum_request

            announce_first_quorum_request(manager, name, out, out / f"{args.announce}_r{rank}",
                                          4 * args.timeout)
        dp_rank, tag = args.replica_id * group_size + rank, f"g{args.replica_id}_r{rank}"
    model = build_model(args.seed, args.fsdp)
    engine_timeout = args.timeout if args.engine_timeout is None else (
        None if args.engine_timeout == "none" else float(args.engine_timeout)
    )  # fmt: skip
    step_size = args.lr_step_size
    settings = dict(mode=args.mode, accumulation_steps=args.accumulation_steps,
                    accumulate_until_ready=args.until_ready,
                    max_microbatches_per_round=args.max_microbatches_per_round,
                    max_grad_norm=args.max_grad_norm, timeout=engine_timeout, manager=manager,
                    lr=args.lr,
                    lr_scheduler=(lambda o: torch.optim.lr_scheduler.StepLR(o, step_size, 0.5))
                    if step_size else None)  # fmt: skip
    if args.start_together is not None and manager is not None:
        settings["replica_groups"] = len(args.start_together) or args.groups
    params = list(model.named_parameters())
    if args.muon:  # the matrices in Muon's group, the rest in AdamW's
        params = [{"params": [(n, p) for n, p in params if p.ndim == 2],
                   "optimizer_class": torch.optim.Muon, "lr": 0.02},
                  {"params": [(n, p) for n, p in params if p.ndim != 2]}]  # fmt: skip
    if args.fsdp:
        opt = ACCOHSDPOptimizer(model, torch.optim.AdamW, params=params, **settings)
    else:
        opt = ACCOOptimizer(params, torch.optim.AdamW, **settings)
    engine = opt.engine
    if args.resume is not None:  # every group loads the same checkpoint, before its first round
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.load(state, checkpoint_id=out / args.resume)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
    # at each round end: rounds ended, updates applied, the time, how long the end waited, the
    # schedule the round ran, the data position and the micro-batches this rank ran in it
    round_ends = []
    dies = args.replica_id is not None and args.kill_group == args.replica_id
    ranks_per_group = group_size if manager is not None else group_size // args.groups
    stops = [tuple(away) for away in args.also_stop]
    if args.stop_group is not None:
        stops.append((args.stop_group, args.stop_round,
                      args.rounds if args.resume_round is None else args.resume_round))
    # the rounds in which this rank contributes nothing (the reference's lost groups)
    away = [(start, until) for group, start, until in stops if dp_rank // ranks_per_group == group]
    first_round = engine.round_index  # > 0: this group joined a running job (joined_round)
    # the data position: 0, or where the live groups stand after the round this group sat out
    index = first_index = engine.microbatches_scheduled
    # the round this group joined in was an estimate round: it trains from its update round on
    joined_mid_update = engine.joined_round is not None and not engine.step_boundary
    held = False
    says = rank == 0 and args.log_every > 0
    name, loss = ("ref" if manager is None else f"acco_{args.replica_id}"), None
    while engine.round_index < args.rounds:
        ran = engine.schedule
        if any(start <= engine.round_index < until for start, until in away):
            ended = engine.skip_microbatch()  # the reference: the lost group contributes nothing
        else:
            x, y = microbatch(index, dp_rank)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            time.sleep(args.microbatch_seconds)
            ended = opt.step()
        index += 1
        if ended:  # a group that fell behind took a live group's state: it reads on from theirs
            index = engine.microbatches_scheduled
        if ended and args.lr_at is not None and engine.round_index == int(args.lr_at[0]):
            opt.param_groups[0]["lr"] = args.lr_at[1]
        if ended and engine.round_index == args.mark_round and rank == 0:
            (out / f"round_{args.mark_round}").write_text("")
        if (ended and not held and args.hold_round is not None
                and engine.round_index >= args.hold_round
                and engine.step_boundary != args.hold_mid_update):
            # the joiner's quorum request is at the lighthouse (its manager sends it once every
            # rank of the joiner asked), so this group's next quorum takes it in
            _wait_for(out, [f"{args.hold_for}_r0"], 6 * args.timeout)
            held = True
        if ended and says and engine.round_index % args.log_every == 0:
            said = "-" if loss is None else f"{loss.item():.4f}"
            print(f"{name} round {engine.round_index}: loss {said} (this rank's last "
                  f"micro-batch), {engine.num_updates} updates", flush=True)  # fmt: skip
        if ended:
            round_ends.append((engine.round_index, engine.num_updates, time.time(),
                               engine.last_wait_s, tuple(ran), index,
                               engine.last_round_microbatches))  # fmt: skip
        if dies and (ended, engine.round_index) == {
            "mid_round": (False, args.kill_round),  # the round's first micro-batch is in
            "after_estimate": (True, args.kill_round + 1),  # the estimate round just ended
        }.get(args.kill_at):
            _kill_when_summed(engine, out)
    if args.save is not None:  # before flush(): the round in flight stays pending in it
        group = "ref" if manager is None else f"g{args.replica_id}"
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
                 checkpoint_id=out / f"{args.save}_{group}")  # fmt: skip
    opt.flush()
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for n, p in model.named_parameters()}  # fmt: skip
    torch.save({"params": params,
                "updates": engine.num_updates, "first_round": first_round,
                "first_index": first_index, "joined_mid_update": joined_mid_update,
                "last_joined": engine.joined_round, "round_ends": round_ends},
               out / f"params_{tag}.pt")  # fmt: skip
    opt.close()
    if manager is not None:
        manager.shutdown(wait=False)
    # Nothing is left to finalize; tearing down torch's modules would take a second per rank.
    finish(0, finalize=False)


def _wait_for(out: Path, names: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all((out / name).exists() for name in names):
        if time.monotonic() > deadline:
            raise SystemExit(f"not all of {names} appeared in {out} within {timeout_s:.0f} s")
        time.sleep(0.05)


def _kill_when_summed(engine: Any, out: Path) -> None:
    """Die once the round in flight was summed over the groups (and so committed by all)."""
    while engine.communication_in_flight:
        time.sleep(0.01)
    kill_this_group(out)


def _slow_link(manager_class: type, seconds: float) -> type:
    """A torchft Manager whose every step takes ``seconds`` longer to commit, as a slower link
    between the groups would: on the engine's communication thread, where a link's time goes."""

    class SlowLinkManager(manager_class):
        def should_commit(self, *args: Any, **kwargs: Any) -> bool:
            time.sleep(seconds)
            return super().should_commit(*args, **kwargs)

    return SlowLinkManager


def _flaky_link(manager_class: type, round_index: int) -> type:
    """A torchft Manager whose group's vote on round ``round_index`` fails once, as after an
    error on its own link once the round's sum was through: the other groups commit the round,
    this one retries it alone (torchft's commit is each group's)."""

    class FlakyLinkManager(manager_class):
        failed = False

        def should_commit(self, *args: Any, **kwargs: Any) -> bool:
            if not self.failed and self.current_step() == round_index + 1:
                self.failed = True
                self.report_error(RuntimeError("a transient error on this group's link"))
            return super().should_commit(*args, **kwargs)

    return FlakyLinkManager


def _dying_manager(manager_class: type, round_index: int, out: Path) -> type:
    """A torchft Manager whose group dies in the middle of the sum of round ``round_index``:
    its quorum formed, its first tensor on the way (each round is one committed torchft step,
    after the step every group takes as it joins: round r's step is r + 1)."""

    class DyingManager(manager_class):
        def allreduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            work = super().allreduce(tensor, *args, **kwargs)
            if self.current_step() == round_index + 1:
                kill_this_group(out)
            return work

    return DyingManager


if __name__ == "__main__":
    main()
