"""Elastic ACCO under torchrun's elastic agent: a node lost (or added) restarts the workers on
the new world, and they resume from the last checkpoint, resharded.

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # a node joining a later round is taken in
    torchrun --nnodes 1:2 --nproc_per_node 2 --max-restarts 3 \\
        --rdzv-backend c10d --rdzv-endpoint $HEAD:29400 --rdzv-id job1 \\
        --rdzv-conf last_call_timeout=10 \\
        -m examples.elastic_train --checkpoint-dir /shared/ckpt

(both explained in docs/multinode.md). Run it from a checkout of this repository: besides
acco_hooks it imports ``scaffolding.process_exit.finish``, the checkout's guard against gloo's
exit-time abort; a script of your own ends with ``destroy_process_group()`` instead.

The loop is what makes a restart cheap and exact (docs/multinode.md):
- the global batch is fixed: each micro-batch is one global batch split over the ranks, so any
  world size that divides it trains on the same data;
- every ``--checkpoint-every`` updates all ranks save the model and the optimizer with
  ``torch.distributed.checkpoint`` into a directory of that update; DCP writes ``.metadata``
  last, so a directory without it (a save cut by the failure) is never resumed from;
- at start, the newest complete checkpoint is loaded into the freshly built model and optimizer
  (``dcp.load`` reshards the optimizer's shards onto this world), and the loop skips the
  micro-batches it already trained on;
- collectives time out after ``--timeout`` seconds, so a rank whose peer vanished fails fast and
  the agent's next attempt can start; such a rank prints one line (what was lost, the restart,
  the checkpoint it resumes from: ``acco_hooks.elastic.exit_for_restart``), not a traceback.

Rank 0 appends one JSON line per attempt to ``--checkpoint-dir/attempts.jsonl`` (world size,
the update it resumed from, when its first step ended) and writes the final parameters to
``final.pt`` there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from acco_hooks import ACCOOptimizer
from acco_hooks.elastic import exit_for_restart
from scaffolding.process_exit import finish

GLOBAL_BATCH = 24  # samples per global micro-batch: splits over 1, 2, 3, 4, 6 ... ranks


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--checkpoint-dir", required=True, help="shared by every node")
    p.add_argument("--mode", default="acco", choices=["acco", "dpu", "ddp"])
    p.add_argument("--updates", type=int, default=40, help="optimizer updates to train")
    p.add_argument("--accumulation-steps", type=int, default=2, help="micro-batches per round")
    p.add_argument("--checkpoint-every", type=int, default=4, help="updates between checkpoints")
    p.add_argument("--microbatch-seconds", type=float, default=0.0,
                   help="extra compute time per micro-batch, to stand for a real model")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds after which a collective with a silent peer fails")
    p.add_argument("--hold-for-ranks", type=int, default=None, metavar="N",
                   help="after the first checkpoint, wait while the world is smaller than N "
                        "ranks (the agent restarts the workers when a node joins; a demo of a "
                        "join that does not race the end of the run)")
    return p.parse_args()


def microbatch(index: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of global micro-batch ``index``: the same data on every world size."""
    g = torch.Generator().manual_seed(7919 * index)
    x, y = torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)
    share = GLOBAL_BATCH // world_size
    return x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]


def newest_checkpoint(root: Path) -> Path | None:
    """The newest checkpoint DCP finished writing (its ``.metadata`` is written last)."""
    done = [d for d in root.glob("update_*") if (d / ".metadata").exists()]
    return max(done, key=lambda d: int(d.name.split("_")[1]), default=None)


def _hold_until_restarted(ranks: int, timeout_s: float) -> None:
    """Wait for the agent to restart this worker on a world of ``ranks`` (a node joining makes
    it stop the workers and start them on the larger world); fail after ``timeout_s``."""
    time.sleep(timeout_s)
    raise SystemExit(f"elastic_train: --hold-for-ranks {ranks}: no node joined within "
                     f"{timeout_s:.0f} s")


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if GLOBAL_BATCH % world_size:
        raise SystemExit(f"elastic_train: a global batch of {GLOBAL_BATCH} does not split over "
                         f"{world_size} ranks; use 1, 2, 3, 4, 6, 8, 12 or 24 ranks")
    root = Path(args.checkpoint_dir)
    root.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    opt = ACCOOptimizer(model.named_parameters(), torch.optim.AdamW, mode=args.mode,
                        accumulation_steps=args.accumulation_steps, lr=1e-2,
                        timeout=args.timeout)  # fmt: skip
    # micro-batches per optimizer update: acco's estimate round and its update round
    per_update = args.accumulation_steps * (2 if args.mode == "acco" else 1)

    # where the loop is: the micro-batches already trained on are not trained on again
    progress = {"next_microbatch": 0}
    resumed_from = newest_checkpoint(root)
    if resumed_from is not None:
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "loop": progress}
        dcp.load(state, checkpoint_id=resumed_from)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
    first = progress["next_microbatch"]
    started = time.time()
    first_step_at = None
    try:
        for index in range(first, args.updates * per_update):
            x, y = microbatch(index, rank, world_size)
            torch.nn.functional.mse_loss(model(x), y).backward()
            time.sleep(args.microbatch_seconds)
            ended = opt.step()
            if first_step_at is None:
                first_step_at = time.time()
                if rank == 0:
                    with open(root / "attempts.jsonl", "a") as log:
                        log.write(json.dumps({
                            "world_size": world_size, "started": started,
                            "first_step_done": first_step_at,
                            "resumed_from_update": first // per_update if resumed_from else None,
                            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                        }) + "\n")  # fmt: skip
            if (index + 1) % per_update == 0 and rank == 0:
                print(f"update {(index + 1) // per_update} on {world_size} ranks", flush=True)
            if (index + 1) % (per_update * args.checkpoint_every) == 0:  # an update's last step()
                assert ended
                progress["next_microbatch"] = index + 1
                dcp.save({"model": model.state_dict(), "optim": opt.state_dict(), "loop": progress},
                         checkpoint_id=root / f"update_{(index + 1) // per_update}")
                if args.hold_for_ranks is not None and world_size < args.hold_for_ranks:
                    _hold_until_restarted(args.hold_for_ranks, timeout_s=300.0)
        opt.flush()
    except Exception as error:  # a lost peer under the elastic agent: one line, then restart
        exit_for_restart(error, resume_from=newest_checkpoint(root))
        raise
    if rank == 0:
        torch.save({n: p.detach().clone() for n, p in model.state_dict().items()},
                   root / "final.pt")
    opt.close()
    finish()


if __name__ == "__main__":
    main()
