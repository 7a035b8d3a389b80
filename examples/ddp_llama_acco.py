"""An existing DDP training loop of a Hugging Face Llama, switched to ACCO with two lines.

    torchrun --standalone --nproc_per_node 2 -m examples.ddp_llama_acco --mode acco

The model is a small ``LlamaForCausalLM`` built from a config in code (no download), trained
on the embedded stdlib corpus as bytes. The lines marked ``# ACCO`` are the whole change from
a plain DDP loop. They replace ``optimizer.step(); optimizer.zero_grad()`` and DDP's all-reduce.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import LlamaConfig, LlamaForCausalLM

from acco_hooks import ACCOState, acco_hook
from scaffolding.process_exit import finish
from scaffolding.stdlib_data import random_windows, stdlib_corpus


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mode", default="acco", choices=["acco", "dpu", "ddp"])
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--accumulation-steps", type=int, default=2)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.seq_len)  # fmt: skip
    model = LlamaForCausalLM(config).to(device)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    state = ACCOState(ddp_model, torch.optim.AdamW, mode=args.mode,  # ACCO
                      accumulation_steps=args.accumulation_steps, max_grad_norm=1.0,
                      lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)  # fmt: skip
    ddp_model.register_comm_hook(state, acco_hook)  # ACCO

    batches = random_windows(stdlib_corpus(), args.micro_batch_size, args.seq_len, seed=rank)
    losses, start = [], time.perf_counter()
    while state.round_index < args.rounds:
        inputs, _ = next(batches)
        loss = ddp_model(input_ids=inputs.to(device), labels=inputs.to(device)).loss
        loss.backward()
        losses.append(loss.item())
        if state.step():  # ACCO: replaces optimizer.step(); optimizer.zero_grad()
            if rank == 0 and state.round_index % 10 == 0:
                recent = losses[-10 * args.accumulation_steps:]
                print(f"round {state.round_index:4d} | updates {state.num_updates:4d} | "
                      f"loss {sum(recent) / len(recent):.4f}", flush=True)  # fmt: skip
    state.flush()  # ACCO: the model now holds the real parameters
    elapsed = time.perf_counter() - start
    k = max(1, len(losses) // 10)
    if rank == 0:
        print(f"summary: mode={args.mode} world_size={world} rounds={state.round_index} "
              f"updates={state.num_updates} mean_loss_first_{k}_microbatches={sum(losses[:k]) / k:.4f} "
              f"mean_loss_last_{k}_microbatches={sum(losses[-k:]) / k:.4f} time={elapsed:.1f}s", flush=True)  # fmt: skip
    state.close()
    finish()  # dist.destroy_process_group(), and an exit that cannot abort (README: Ending)


if __name__ == "__main__":
    main()
