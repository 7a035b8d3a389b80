"""Worker functions of ``tests/test_hf_trainer.py``, run on gloo processes by ``run_distributed``.

Each builds a tiny ``LlamaForCausalLM`` from a config (byte vocabulary) and trains it with the
Hugging Face ``Trainer`` on the embedded corpus (the Python standard library's source bytes).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from scaffolding.process_exit import group_worker_threads

SEQ_LEN = 32


def distributed_env(rank: int, world_size: int) -> None:
    """The variables ``torchrun`` sets, for a process group that ``run_distributed`` opened.

    ``TrainingArguments`` (through accelerate) reads them and finds the process group already
    initialised, so the Trainer runs distributed exactly as under ``torchrun``.
    """
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1",
    )  # fmt: skip


class BatchNormOverHidden(torch.nn.BatchNorm1d):
    """BatchNorm over the hidden features of ``(batch, sequence, hidden)`` activations."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


def tiny_llama(seed: int = 0, vocab_size: int = 256) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def byte_dataset(n: int, offset: int = 0, ragged: bool = False) -> Any:
    """``n`` windows of ``SEQ_LEN`` bytes of the stdlib corpus, each its own labels.

    ``ragged``: a random number of trailing labels per sequence is ignored (-100), so the
    label tokens differ between micro-batches and ranks (exercises the token weighting).
    """
    from datasets import Dataset

    from scaffolding.stdlib_data import stdlib_corpus

    tokens = stdlib_corpus(max_bytes=offset + n * SEQ_LEN)[offset:].long().view(n, SEQ_LEN)
    labels = tokens.clone()
    if ragged:
        lengths = torch.randint(4, SEQ_LEN + 1, (n,), generator=torch.Generator().manual_seed(1))
        labels[torch.arange(SEQ_LEN) >= lengths[:, None]] = -100
    return Dataset.from_dict({"input_ids": tokens.tolist(), "labels": labels.tolist()})


def training_args(output_dir: str, **overrides: Any) -> Any:
    from transformers import TrainingArguments

    kwargs = dict(
        output_dir=output_dir, per_device_train_batch_size=2, per_device_eval_batch_size=4,
        gradient_accumulation_steps=2, max_steps=6, learning_rate=3e-3, warmup_steps=2,
        lr_scheduler_type="linear", logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def step_logs(trainer: Any, key: str = "loss") -> dict[int, float]:
    return {e["step"]: e[key] for e in trainer.state.log_history if key in e}


def params(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ------------------------------------------------------------------------------------ workers


def ddp_vs_hf_ddp(rank: int, world_size: int, variants: list[dict[str, Any]]) -> list[dict]:
    """Per variant: the plain Trainer (DDP) and ACCOTrainer(mode="ddp") on the same run."""
    from transformers import Trainer

    from acco_hooks.hf import ACCOArguments, ACCOTrainer

    distributed_env(rank, world_size)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant in variants:
            variant = dict(variant)
            ragged = variant.pop("ragged", False)
            mean_loss = variant.pop("mean_loss", False)
            batchnorm = variant.pop("batchnorm", False)
            optimizer = {"optimizer_cls_and_kwargs": variant.pop("optimizer_cls_and_kwargs")
                         } if "optimizer_cls_and_kwargs" in variant else {}  # fmt: skip
            data = byte_dataset(32, ragged=ragged)
            out = {}
            for name in ("hf", "acco"):
                args = training_args(os.path.join(tmp, name), **variant)
                model = tiny_llama()
                if batchnorm:  # running statistics: buffers DDP broadcasts from rank 0
                    model.model.embed_tokens = torch.nn.Sequential(
                        model.model.embed_tokens, BatchNormOverHidden(model.config.hidden_size)
                    )
                if name == "hf":
                    trainer = Trainer(model=model, args=args, train_dataset=data, **optimizer)
                else:
                    trainer = ACCOTrainer(model=model, args=args, train_dataset=data,
                                          acco_args=ACCOArguments(mode="ddp"), **optimizer)  # fmt: skip
                if mean_loss:  # the Trainer then divides each micro-batch's mean loss by GA
                    trainer.model_accepts_loss_kwargs = False
                trainer.train()
                out[name] = {
                    "loss": step_logs(trainer), "lr": step_logs(trainer, "learning_rate"),
                    "grad_norm": step_logs(trainer, "grad_norm"), "params": params(model),
                    "log_history": trainer.state.log_history,
                }  # fmt: skip
                if batchnorm:  # this rank's statistics, and what evaluating with them gives
                    out[name]["buffers"] = {n: b.detach().clone().double()
                                            for n, b in model.named_buffers()
                                            if "embed_tokens" in n}  # fmt: skip
                    out[name]["eval_loss"] = trainer.evaluate(byte_dataset(8, offset=4096))[
                        "eval_loss"
                    ]
            results.append(out)
    return results


def acco_runs(rank: int, world_size: int, output_dir: str) -> dict[str, Any]:
    """acco and dpu runs with evaluation and checkpoints, without them, and resumed ones; auto
    and ddp runs without them."""
    from acco_hooks.hf import ACCOArguments, ACCOTrainer

    distributed_env(rank, world_size)
    train, evaluation = byte_dataset(64), byte_dataset(8, offset=64 * SEQ_LEN)
    common = dict(max_steps=8, learning_rate=1e-2, warmup_steps=0, weight_decay=0.1)
    checkpoints = dict(save_strategy="steps", save_steps=3, eval_strategy="steps", eval_steps=2)

    def run(name: str, mode: str, resume: Any = None, out: str | None = None, **extra: Any) -> dict:
        args = training_args(os.path.join(output_dir, out or name), **common, **extra)
        model = tiny_llama(seed=1 if resume else 0)  # a resumed run must take the saved weights
        trainer = ACCOTrainer(model=model, args=args, train_dataset=train,
                              eval_dataset=evaluation,
                              acco_args=ACCOArguments(mode=mode))  # fmt: skip
        trainer.train(resume_from_checkpoint=resume)
        return {
            "loss": step_logs(trainer), "eval_loss": step_logs(trainer, "eval_loss"),
            "grad_norm": step_logs(trainer, "grad_norm"),
            "final_eval": trainer.evaluate()["eval_loss"],
            "params": params(model), "log_history": trainer.state.log_history,
        }  # fmt: skip

    results = {"acco": run("acco", "acco", **checkpoints)}
    results["acco_files"] = {
        step: sorted(os.listdir(os.path.join(output_dir, "acco", f"checkpoint-{step}")))
        for step in (3, 6)
    }
    results["acco_plain"] = run("acco_plain", "acco")
    # resume_from_checkpoint=True takes the latest checkpoint of output_dir: checkpoint-6, where
    # the model holds the estimate θ̃ and an update is in flight.
    results["acco_resumed_6"] = run("acco_resumed_6", "acco", resume=True, out="acco",
                                    **checkpoints)  # fmt: skip
    # checkpoint-3: the model holds θ and an estimate is in flight.
    results["acco_resumed_3"] = run(
        "acco_resumed_3", "acco", resume=os.path.join(output_dir, "acco", "checkpoint-3"),
        **checkpoints,
    )  # fmt: skip
    # mode="auto": one update per Trainer step, synchronous while it measures (5 updates)
    results["auto"], results["ddp"] = run("auto", "auto"), run("ddp", "ddp")
    results["dpu"] = run("dpu", "dpu", **checkpoints)
    results["dpu_resumed_3"] = run(
        "dpu_resumed_3", "dpu", resume=os.path.join(output_dir, "dpu", "checkpoint-3"),
        **checkpoints,
    )  # fmt: skip
    return results


def resume_on_one_process(rank: int, world_size: int, output_dir: str) -> dict[str, Any]:
    """``acco_runs``' 2-process acco checkpoints resumed by one process with twice the
    micro-batches per step (the same global batch), and once with the wrong number."""
    from acco_hooks.hf import ACCOArguments, ACCOTrainer

    distributed_env(rank, world_size)
    train, evaluation = byte_dataset(64), byte_dataset(8, offset=64 * SEQ_LEN)

    def run(step: int, accumulation: int) -> dict:
        args = training_args(os.path.join(output_dir, f"acco_on_1_from_{step}"), max_steps=8,
                             learning_rate=1e-2, warmup_steps=0, weight_decay=0.1,
                             gradient_accumulation_steps=accumulation, save_strategy="steps",
                             save_steps=3, eval_strategy="steps", eval_steps=2)  # fmt: skip
        trainer = ACCOTrainer(model=tiny_llama(seed=1), args=args, train_dataset=train,
                              eval_dataset=evaluation, acco_args=ACCOArguments(mode="acco"))
        checkpoint = os.path.join(output_dir, "acco", f"checkpoint-{step}")
        trainer.train(resume_from_checkpoint=checkpoint)
        return {"loss": step_logs(trainer), "params": params(trainer.model)}

    results: dict[str, Any] = {step: run(step, accumulation=4) for step in (3, 6)}
    try:
        run(6, accumulation=2)
    except ValueError as refusal:
        results["refusal"] = str(refusal)
    return results


def slow_shard_step_lrs(rank: int, world_size: int, output_dir: str) -> dict[int, float]:
    """The learning rates an acco run logs while every shard step waits 0.2 s on the
    communication thread: the scheduler then steps long after the next round began."""
    import time

    from transformers import TrainerCallback

    from acco_hooks.hf import ACCOArguments, ACCOTrainer

    distributed_env(rank, world_size)

    class SlowShardStep(TrainerCallback):
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            trainer.engine.optimizer.register_step_pre_hook(lambda *_: time.sleep(0.2))

    args = training_args(output_dir, max_steps=8, learning_rate=1e-2, warmup_steps=0)
    trainer = ACCOTrainer(model=tiny_llama(), args=args, train_dataset=byte_dataset(64),
                          acco_args=ACCOArguments(mode="acco"), callbacks=[SlowShardStep()])
    trainer.train()
    return step_logs(trainer, "learning_rate")


def all_runs(rank: int, world_size: int, variants: list[dict[str, Any]], output_dir: str) -> dict:
    """``ddp_vs_hf_ddp`` and ``acco_runs`` in one pair of processes (one import of transformers)."""
    return {
        "ddp_vs_hf_ddp": ddp_vs_hf_ddp(rank, world_size, variants),
        "acco_runs": acco_runs(rank, world_size, output_dir),
    }


def train_three_times(rank: int, world_size: int, output_dir: str) -> dict[str, Any]:
    """One ACCOTrainer, ``train()`` three times: what each call's engine held is released.

    The engine's groups are checked through the public ``torch.distributed`` API and then
    dropped here, so that the threads gloo runs for them must end when the engine lets go.
    """
    import threading

    import torch.distributed as dist
    from transformers import TrainerCallback

    from acco_hooks.hf import ACCOArguments, ACCOTrainer

    distributed_env(rank, world_size)
    engine_groups: list[Any] = []

    class RecordEngineGroups(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                        **kwargs: Any) -> None:  # fmt: skip
            engine_groups[:] = optimizer.engine.process_groups

    def destroyed(group: Any) -> bool:
        try:
            dist.get_process_group_ranks(group)
        except (KeyError, ValueError):
            return True
        return False

    trainer = ACCOTrainer(model=tiny_llama(), args=training_args(output_dir, max_steps=2),
                          train_dataset=byte_dataset(16), acco_args=ACCOArguments(mode="acco"),
                          callbacks=[RecordEngineGroups()])  # fmt: skip
    gloo_threads_before = group_worker_threads()
    after, group_names = [], set()
    for _ in range(3):
        trainer.train()
        after.append({
            "engine": trainer.engine,
            "groups": len(engine_groups),
            "destroyed": [destroyed(g) for g in engine_groups],
            "threads": [t.name for t in threading.enumerate() if t.name.startswith("acco-comm")],
            "steps": trainer.state.global_step,
        })  # fmt: skip
        group_names.update(g.group_name for g in engine_groups)
        engine_groups.clear()  # the last reference outside the engine
        after[-1]["gloo_threads_left"] = group_worker_threads() - gloo_threads_before
    return {"after": after, "distinct_groups": len(group_names)}


def stdlib_texts(n: int, chars: int = 2000) -> list[str]:
    """``n`` raw texts of ``chars`` characters of the stdlib corpus."""
    from scaffolding.stdlib_data import stdlib_corpus

    text = bytes(stdlib_corpus(max_bytes=n * chars).tolist()).decode("utf-8", "replace")
    return [text[i : i + chars] for i in range(0, n * chars, chars)]


def tiny_tokenizer(vocab_size: int = 320) -> Any:
    """A byte-level BPE tokenizer trained in a second on stdlib text, with an end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(stdlib_texts(50), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|end_of_text|>")


# The measured comparison of docs/hf.md:  python3 -m tests.hf.workers [steps]
COMPARISON = {
    "SGD, token-normalised loss, ragged labels":
        dict(optim="sgd", learning_rate=0.5, max_grad_norm=0.0, ragged=True),
    "SGD, average_tokens_across_devices=False":
        dict(optim="sgd", learning_rate=0.5, max_grad_norm=0.0, ragged=True,
             average_tokens_across_devices=False),
    "SGD, mean loss / GA, GA=3 with short steps":
        dict(optim="sgd", learning_rate=0.5, max_grad_norm=0.0, ragged=True, mean_loss=True,
             per_device_train_batch_size=1, gradient_accumulation_steps=3),
    "AdamW (fused), wd 0.1, clip 0.5, warm-up":
        dict(learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.5, ragged=True),
    "AdamW as above, bf16 autocast":
        dict(learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.5, ragged=True, bf16=True),
}  # fmt: skip


def _compare(steps: int) -> None:
    from tests.dist_utils import run_distributed

    variants = [dict(v, max_steps=steps) for v in COMPARISON.values()]
    results = run_distributed("tests.hf.workers:ddp_vs_hf_ddp", 2, variants, deadline_s=1800,
                              fresh_processes=True)  # fmt: skip
    print(f"| run ({steps} steps, 2 ranks) | max abs loss diff | max abs param diff "
          "| max abs grad-norm diff | LR equal |")
    print("|---|---|---|---|---|")
    for name, run in zip(COMPARISON, results[0]):
        hf, acco = run["hf"], run["acco"]
        loss = max(abs(hf["loss"][s] - acco["loss"][s]) for s in hf["loss"])
        param = max((hf["params"][n] - acco["params"][n]).abs().max().item() for n in hf["params"])
        norm = max(abs(hf["grad_norm"][s] - acco["grad_norm"][s]) for s in hf["grad_norm"])
        print(f"| {name} | {loss:.1e} | {param:.1e} | {norm:.1e} | {hf['lr'] == acco['lr']} |")


if __name__ == "__main__":
    import sys

    _compare(int(sys.argv[1]) if len(sys.argv) > 1 else 30)


def evaluate_on_one_rank(rank: int, world_size: int, output_dir: str) -> dict[str, Any]:
    """A callback evaluates on rank 0 only, during training: an error on every rank, no hang."""
    from transformers import TrainerCallback

    from acco_hooks import ACCOCommunicationError
    from acco_hooks.hf import ACCOArguments, ACCOTrainer

    distributed_env(rank, world_size)
    trainer: Any = None

    class EvaluateOnRankZero(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 2 and state.is_world_process_zero:
                trainer.evaluate()

    args = training_args(output_dir, ddp_timeout=5)
    trainer = ACCOTrainer(model=tiny_llama(), args=args, train_dataset=byte_dataset(32),
                          eval_dataset=byte_dataset(8, offset=32 * SEQ_LEN),
                          callbacks=[EvaluateOnRankZero()],
                          acco_args=ACCOArguments(mode="acco"))  # fmt: skip
    try:
        trainer.train()
    except (RuntimeError, ACCOCommunicationError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None}
