"""Train a small causal transformer with ACCOOptimizer on the embedded stdlib corpus.

    torchrun --standalone --nproc_per_node 2 -m examples.train_small_transformer --mode acco

Runs on CPU (gloo) or one GPU per process (nccl). Prints one line per round (rank 0's loss,
averaged over its micro-batches) and a summary line with the loss averaged over all ranks.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from acco_hooks import ACCOOptimizer
from scaffolding.process_exit import finish
from scaffolding.stdlib_data import random_windows, stdlib_corpus


class SmallTransformer(nn.Module):
    """A GPT-style byte-level language model built from torch's own layers."""

    def __init__(self, dim: int, layers: int, heads: int, seq_len: int, vocab: int = 256) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq_len = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(seq_len, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(seq_len, device=tokens.device)
        return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mode", default="acco", choices=["acco", "dpu", "ddp"])
    p.add_argument("--rounds", type=int, default=100, help="rounds to train")
    p.add_argument("--accumulation-steps", type=int, default=2, help="micro-batches per round")
    p.add_argument("--accumulate-until-ready", action="store_true")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-updates", type=int, default=4)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def warmup_cosine(warmup: int, total: int):
    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        progress = min(1.0, (update - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun, e.g. torchrun --standalone --nproc_per_node 2 " + __file__)
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))

    torch.manual_seed(args.seed)
    model = SmallTransformer(args.dim, args.layers, 4, args.seq_len).to(device)
    # No weight decay on norms, biases and embeddings: two parameter groups.
    decay = [(n, p) for n, p in model.named_parameters() if p.ndim == 2 and "tok" not in n and "pos" not in n]
    no_decay = [(n, p) for n, p in model.named_parameters() if (n, p) not in decay]
    total_updates = args.rounds // 2 if args.mode == "acco" else args.rounds
    opt = ACCOOptimizer(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
        torch.optim.AdamW,
        mode=args.mode,
        accumulation_steps=args.accumulation_steps,
        accumulate_until_ready=args.accumulate_until_ready,
        max_grad_norm=args.max_grad_norm,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(
            o, warmup_cosine(args.warmup_updates, total_updates)
        ),
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=0.1,
    )
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"model: {n_params / 1e6:.2f}M parameters; mode={args.mode} world_size={world} "
              f"accumulation_steps={args.accumulation_steps} device={device.type}", flush=True)

    batches = random_windows(stdlib_corpus(), args.micro_batch_size, args.seq_len, seed=1000 + rank)
    round_losses: list[float] = []
    tokens, start = 0, time.perf_counter()
    loss_sum, micro = 0.0, 0
    while opt.round_index < args.rounds:
        inputs, targets = (t.to(device) for t in next(batches))
        logits = model(inputs)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        loss_sum, micro, tokens = loss_sum + loss.item(), micro + 1, tokens + targets.numel()
        if opt.step():
            round_losses.append(loss_sum / micro)
            if rank == 0:
                print(f"round {opt.round_index:4d} | updates {opt.num_updates:4d} | "
                      f"loss {round_losses[-1]:.4f} | micro-batches {micro} | "
                      f"lr {opt.param_groups[0]['lr']:.2e} | "
                      f"comm wait {1e3 * opt.engine.last_wait_s:6.1f} ms", flush=True)
            loss_sum, micro = 0.0, 0
    opt.flush()
    elapsed = time.perf_counter() - start

    tail = max(1, len(round_losses) // 10)
    figures = torch.tensor([sum(round_losses[:tail]) / tail, sum(round_losses[-tail:]) / tail,
                            float(tokens)], dtype=torch.float64, device=device)  # fmt: skip
    dist.all_reduce(figures)  # on the device: NCCL has no CPU tensors
    first, final, all_tokens = (figures / world).tolist()[:2] + [int(figures[2])]
    if rank == 0:
        print(f"summary: mode={args.mode} world_size={world} rounds={opt.round_index} "
              f"updates={opt.num_updates} tokens={all_tokens} "
              f"mean_loss_first_{tail}_rounds={first:.4f} mean_loss_last_{tail}_rounds={final:.4f} "
              f"time={elapsed:.1f}s tokens/s={all_tokens / elapsed:.0f}",
              flush=True)
    opt.close()
    finish()  # dist.destroy_process_group(), and an exit that cannot abort (README: Ending)


if __name__ == "__main__":
    main()
