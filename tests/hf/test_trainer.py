"""``ACCOTrainer`` / ``DecoupledTrainer``: the Hugging Face Trainer front-end of the engine.

Distributed runs use 2 gloo processes (``run_distributed``) with a tiny ``LlamaForCausalLM`` on
the embedded stdlib corpus; one test launches ``examples.hf_finetune`` with torchrun.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from tests.dist_utils import run_distributed

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Float noise of a reduction in another order; a factor-2 gradient scale or a skipped update
# moves SGD's losses and parameters by more than 1e-2 within these few steps.
LOSS_TOLERANCE = 1e-5
PARAM_TOLERANCE = 1e-5


def _max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


# ------------------------------------------------------------------------- ACCOArguments


@pytest.mark.parametrize(
    "field, value",
    [("mode", "zero1"), ("accumulate_until_ready", "yes"), ("reduce_dtype", "int8"),
     ("nonfinite", "ignore"), ("timeout", -5.0), ("timeout", float("nan"))],
)  # fmt: skip
def test_acco_arguments_refuse_bad_values(field: str, value: object) -> None:
    from acco_hooks.hf import ACCOArguments

    with pytest.raises(ValueError, match=rf"ACCOArguments\.{field}="):
        ACCOArguments(**{field: value})


def test_acco_arguments_are_command_line_flags_with_help() -> None:
    from transformers import HfArgumentParser

    from acco_hooks.hf import ACCOArguments

    parser = HfArgumentParser(ACCOArguments)
    (acco,) = parser.parse_args_into_dataclasses(
        ["--mode", "dpu", "--reduce_dtype", "bfloat16", "--timeout", "30"]
    )
    assert acco == ACCOArguments(mode="dpu", reduce_dtype="bfloat16", timeout=30.0)
    assert acco.reduce_torch_dtype is torch.bfloat16
    assert "estimate step" in parser.format_help()  # the field docstrings are the --help


# ------------------------------------------------------------------------------ refusals


class MatrixDecayAdamW(torch.optim.AdamW):
    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim >= 2:
                    p.mul_(1 - group["lr"] * 0.1)
        return super().step(closure)


REFUSALS = {  # setting: (how to spoil the run, what the message must name)
    "deepspeed": ({"after": {"deepspeed": {"zero_optimization": {"stage": 1}}}},
                  "TrainingArguments.deepspeed"),
    "fsdp": ({"after": {"fsdp": ["full_shard"]}}, "TrainingArguments.fsdp"),
    "fp16": ({"after": {"fp16": True}}, "TrainingArguments.fp16"),
    "parallelism_config": ({"after": {"parallelism_config": object()}}, "parallelism_config"),
    "auto_find_batch_size": ({"args": {"auto_find_batch_size": True}}, "auto_find_batch_size"),
    "reduce_lr_on_plateau": ({"args": {"lr_scheduler_type": "reduce_lr_on_plateau",
                                       "eval_strategy": "steps"}}, "lr_scheduler_type"),
    "schedule_free": ({"args": {"optim": "schedule_free_adamw"}}, "TrainingArguments.optim"),
    # transformers' Adafactor scales each update by RMS values over a whole parameter
    "adafactor": ({"args": {"optim": "adafactor"}},
                  "TrainingArguments.optim='adafactor' gives Adafactor, which the ACCO engine "
                  "cannot run (acco_hooks: transformers.optimization.Adafactor is not known to "
                  "step each parameter element on its own"),
    # a user's AdamW that decays matrices only (a branch on p.ndim): refused unless declared,
    # and the probe at the model's shapes refuses it declared
    "matrix_decay_adamw": ({"trainer": {"optimizer_cls_and_kwargs": (MatrixDecayAdamW,
                                                                     {"lr": 1e-2})}},
                           "optimizer_cls_and_kwargs gives MatrixDecayAdamW, which the ACCO "
                           "engine cannot run (acco_hooks: tests.hf.test_trainer."
                           "MatrixDecayAdamW is not known to step each parameter element"),
    # torch's Muon steps 2-D matrices only: over the Trainer's groups, the biases and norms too
    "torch_muon": ({"trainer": {"optimizer_cls_and_kwargs": (torch.optim.Muon, {})}},
                   "optimizer_cls_and_kwargs gives Muon, which the ACCO engine cannot run "
                   "(acco_hooks: torch.optim.Muon refused the parameters of its group(s)"),
    "not_an_optimizer": ({"trainer": {"optimizer_cls_and_kwargs": (dict, {})}},
                         "optimizer_cls_and_kwargs"),
    "optimizers": ({"trainer": {"optimizers": "an SGD instance"}}, "optimizers="),
    "accumulate_until_ready": ({"acco": {"accumulate_until_ready": True}},
                               "accumulate_until_ready"),
}  # fmt: skip


@pytest.mark.parametrize("setting", REFUSALS)
def test_unsupported_settings_are_refused_at_construction(setting: str, tmp_path) -> None:
    from acco_hooks.hf import ACCOArguments, ACCOTrainer
    from tests.hf.workers import byte_dataset, tiny_llama, training_args

    how, named = REFUSALS[setting]
    args = training_args(str(tmp_path), **how.get("args", {}))
    for name, value in how.get("after", {}).items():  # values the constructor would reject
        setattr(args, name, value)
    model = tiny_llama()
    trainer_kwargs = dict(how.get("trainer", {}))
    if "optimizers" in trainer_kwargs:
        trainer_kwargs["optimizers"] = (torch.optim.SGD(model.parameters(), lr=0.1), None)
    with pytest.raises(ValueError, match=re.escape(named)) as error:
        ACCOTrainer(model=model, args=args, train_dataset=byte_dataset(8),
                    acco_args=ACCOArguments(**how.get("acco", {})), **trainer_kwargs)  # fmt: skip
    assert "ACCOTrainer" in str(error.value)


# ---------------------------------------------------- ddp mode equals the plain Trainer + DDP

DDP_VARIANTS = [
    # SGD without clipping: any gradient scale error changes the update. Ragged labels: the
    # label tokens differ between micro-batches and ranks (token-count normalisation).
    dict(optim="sgd", learning_rate=0.5, max_grad_norm=0.0, ragged=True),
    dict(optim="sgd", learning_rate=0.5, max_grad_norm=0.0, ragged=True,
         average_tokens_across_devices=False),
    # A per-micro-batch mean loss divided by gradient_accumulation_steps; 16 micro-batches per
    # rank and epoch in steps of 3: the 6th step is a short one (1 micro-batch).
    dict(optim="sgd", learning_rate=0.5, max_grad_norm=0.0, ragged=True, mean_loss=True,
         per_device_train_batch_size=1, gradient_accumulation_steps=3),
    # The default AdamW (fused), weight decay, global-norm clipping active, linear warm-up.
    dict(learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.5, ragged=True),
    # Other optimizers the engine steps by snapshot; schedules with their own step counts; label
    # smoothing (the Trainer's own loss, not the model's).
    dict(optim="adagrad", learning_rate=5e-2, max_grad_norm=1.0, ragged=True),
    dict(optim="rmsprop", learning_rate=2e-3, max_grad_norm=1.0, ragged=True),
    dict(learning_rate=1e-2, lr_scheduler_type="cosine", warmup_steps=0.3,
         label_smoothing_factor=0.1, ragged=True),
    dict(learning_rate=1e-2, lr_scheduler_type="warmup_stable_decay", warmup_steps=1,
         lr_scheduler_kwargs={"num_stable_steps": 2, "num_decay_steps": 3}, ragged=True),
    # BatchNorm's running statistics (buffers, which DDP broadcasts from rank 0 before each
    # step's first forward), and the evaluation each rank runs with its own
    dict(optim="sgd", learning_rate=0.5, max_grad_norm=0.0, batchnorm=True),
    # torch's Adafactor, whose factored second moment and RMS scaling see each parameter
    # whole: the engine steps each on the rank that owns it (the whole-parameter layout)
    dict(learning_rate=5e-2, max_grad_norm=0.5, ragged=True,
         optimizer_cls_and_kwargs=(torch.optim.Adafactor, {"lr": 5e-2})),
]  # fmt: skip


@pytest.fixture(scope="module")
def output_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("acco"))


@pytest.fixture(scope="module")
def distributed_results(output_dir) -> list[dict]:
    """Every 2-rank Trainer run of this file, in one pair of gloo processes (importing
    transformers dominates the cost): ``tests.hf.workers.ddp_vs_hf_ddp`` over ``DDP_VARIANTS``
    and ``tests.hf.workers.acco_runs``."""
    # fresh processes in every call here: Accelerate's state is one per process
    return run_distributed("tests.hf.workers:all_runs", 2, DDP_VARIANTS, output_dir,
                           fresh_processes=True)  # fmt: skip


def test_ddp_mode_equals_plain_trainer_with_ddp(distributed_results) -> None:
    results = [result["ddp_vs_hf_ddp"] for result in distributed_results]
    for rank, per_variant in enumerate(results):
        for variant, run in zip(DDP_VARIANTS, per_variant):
            hf, acco = run["hf"], run["acco"]
            where = f"rank {rank}, {variant}"
            assert acco["loss"].keys() == hf["loss"].keys() == set(range(1, 7)), where
            torch.testing.assert_close(acco["loss"], hf["loss"], rtol=0, atol=LOSS_TOLERANCE,
                                       msg=where)  # fmt: skip
            torch.testing.assert_close(acco["grad_norm"], hf["grad_norm"], rtol=1e-5, atol=1e-6,
                                       msg=where)  # fmt: skip
            assert acco["lr"] == hf["lr"], where
            assert _max_param_diff(acco["params"], hf["params"]) <= PARAM_TOLERANCE, where
            if "buffers" in hf:
                assert _max_param_diff(acco["buffers"], hf["buffers"]) <= PARAM_TOLERANCE, where
                assert abs(acco["eval_loss"] - hf["eval_loss"]) <= LOSS_TOLERANCE, where
            assert hf["loss"][6] < hf["loss"][1] - 0.05, where  # it trained: the check has teeth
    for variant_0, variant_1 in zip(*results):  # the replicas agree
        assert _max_param_diff(variant_0["acco"]["params"], variant_1["acco"]["params"]) == 0


# ------------------------------------------------------- acco / dpu: training and checkpoints


@pytest.fixture(scope="module")
def acco_results(distributed_results) -> list[dict]:
    """Runs of 8 steps on 2 ranks: with evaluation and checkpoints (every 2 and 3 steps),
    without them, and resumed from their checkpoints. See ``tests.hf.workers.acco_runs``."""
    return [result["acco_runs"] for result in distributed_results]


def test_acco_loss_goes_down(acco_results) -> None:
    for result in acco_results:
        loss, eval_loss = result["acco"]["loss"], result["acco"]["eval_loss"]
        assert loss[7] + loss[8] < loss[1] + loss[2] - 0.5
        assert eval_loss[8] < eval_loss[2] - 0.3


def test_acco_logs_show_rounds_real_updates_and_communication_wait(acco_results) -> None:
    logs = [e for e in acco_results[0]["acco"]["log_history"] if "loss" in e]
    assert [e["step"] for e in logs] == list(range(1, 9))
    for entry in logs:
        assert entry["acco/round"] == entry["step"]
        assert entry["acco/real_updates"] == entry["step"] // 2  # every other round in acco
        assert 0 <= entry["acco/comm_wait_s"] < 60
    assert {"grad_norm", "learning_rate"} <= logs[-1].keys()


def test_the_logged_learning_rate_is_the_one_of_the_update_each_round_joins(acco_results) -> None:
    """The linear schedule over the real updates (lr 1e-2, no warm-up): acco's rounds 2u + 1
    and 2u + 2 join update u of 4, dpu's round s is update s - 1 of 8. Read at the round end,
    not while the communication thread may be stepping the scheduler: two runs log the same."""
    for result in acco_results:
        for name, updates, rounds_per_update in (("acco", 4, 2), ("acco_plain", 4, 2),
                                                 ("dpu", 8, 1)):  # fmt: skip
            logged = {e["step"]: e["learning_rate"] for e in result[name]["log_history"]
                      if "learning_rate" in e}  # fmt: skip
            expected = {s: 1e-2 * (updates - (s - 1) // rounds_per_update) / updates
                        for s in range(1, 9)}  # fmt: skip
            assert logged == pytest.approx(expected, rel=1e-9), (name, logged)


def test_the_logged_learning_rate_does_not_depend_on_the_communication_pace(tmp_path) -> None:
    """The same schedule with every shard step held 0.2 s: the rate each round logs is still
    the one of the update it joins (read at the start of a round, it was the previous one's)."""
    (logged,) = run_distributed("tests.hf.workers:slow_shard_step_lrs", 1, str(tmp_path),
                                fresh_processes=True)  # fmt: skip
    expected = {s: 1e-2 * (4 - (s - 1) // 2) / 4 for s in range(1, 9)}
    assert logged == pytest.approx(expected, rel=1e-9), logged


def test_auto_mode_trains_one_update_per_step_starting_synchronous(acco_results) -> None:
    """accumulation_steps per update as in ddp: switching ddp -> auto keeps the batch; while it
    measures (its first 5 updates) it is the synchronous schedule, bit for bit."""
    for result in acco_results:
        auto, ddp = result["auto"], result["ddp"]
        assert sorted(auto["loss"]) == list(range(1, 9))
        assert [auto["loss"][s] for s in range(1, 6)] == [ddp["loss"][s] for s in range(1, 6)]
        logs = [e for e in auto["log_history"] if "loss" in e]
        assert [e["acco/real_updates"] for e in logs] == list(range(1, 9))
        assert auto["loss"][7] + auto["loss"][8] < auto["loss"][1] + auto["loss"][2] - 0.5


def test_evaluation_runs_at_real_parameters_without_changing_training(acco_results) -> None:
    for result in acco_results:
        with_eval, without = result["acco"], result["acco_plain"]
        assert with_eval["loss"] == without["loss"]
        assert _max_param_diff(with_eval["params"], without["params"]) == 0
        # Step 8 ends with an update in flight (the model holds θ̃): the evaluation at step 8
        # saw the final θ, which the trainer also holds after train().
        assert with_eval["eval_loss"][8] == with_eval["final_eval"]


@pytest.mark.parametrize(
    "resumed, uninterrupted, step",
    [("acco_resumed_6", "acco", 6),  # the model held θ̃, an update was in flight
     ("acco_resumed_3", "acco", 3),  # the model held θ, an estimate was in flight
     ("dpu_resumed_3", "dpu", 3)],  # the model held θ one update behind
)  # fmt: skip
def test_resume_from_checkpoint_equals_uninterrupted_run(
    acco_results, resumed: str, uninterrupted: str, step: int
) -> None:
    for result in acco_results:
        after = {s: v for s, v in result[resumed]["loss"].items() if s > step}
        expected = {s: v for s, v in result[uninterrupted]["loss"].items() if s > step}
        assert after and after == expected
        assert result[resumed]["eval_loss"] == result[uninterrupted]["eval_loss"]
        assert _max_param_diff(result[resumed]["params"], result[uninterrupted]["params"]) == 0


@pytest.fixture(scope="module")
def resumed_on_one(acco_results, output_dir) -> dict:
    """``acco_results``' checkpoints resumed by one process (``resume_on_one_process``)."""
    (resumed,) = run_distributed("tests.hf.workers:resume_on_one_process", 1, output_dir,
                                 fresh_processes=True)  # fmt: skip
    return resumed


@pytest.mark.parametrize("step", [6, 3])
def test_a_checkpoint_of_two_processes_resumes_on_one(acco_results, resumed_on_one, step) -> None:
    """The same global batch on one process (twice the micro-batches per step): the Trainer's
    data skipping and the resharded engine state continue the 2-process run."""
    resumed = resumed_on_one
    uninterrupted = acco_results[0]["acco"]
    after = {s: v for s, v in resumed[step]["loss"].items() if s > step}
    assert sorted(after) == list(range(step + 1, 9))
    for s, loss in after.items():
        assert abs(loss - uninterrupted["loss"][s]) <= 1e-5 * abs(loss), s
    assert _max_param_diff(resumed[step]["params"], uninterrupted["params"]) <= PARAM_TOLERANCE
    assert "gradient_accumulation_steps=4" in resumed["refusal"]
    assert "2 processes × gradient_accumulation_steps=2 × per-device batch 2" in resumed["refusal"]


def test_checkpoint_folder_holds_engine_state_and_live_parameters(acco_results) -> None:
    files = acco_results[0]["acco_files"]
    for step in (3, 6):
        assert {"acco_engine", "model.safetensors", "trainer_state.json"} <= set(files[step])
    assert "acco_live_params.pt" not in files[3]  # θ in the model: nothing else to keep
    assert "acco_live_params.pt" in files[6]  # θ̃ in the model, θ in model.safetensors


def test_acco_replicas_agree(acco_results) -> None:
    for name in ("acco", "acco_resumed_6", "dpu"):
        rank0, rank1 = (result[name]["params"] for result in acco_results)
        assert _max_param_diff(rank0, rank1) == 0


# ------------------------------------------------------------------------ DecoupledTrainer


def test_decoupled_trainer_tokenises_a_raw_text_column_and_trains(tmp_path) -> None:
    from datasets import Dataset

    from acco_hooks.hf import DecoupledTrainer
    from tests.hf.workers import stdlib_texts, tiny_llama, tiny_tokenizer, training_args

    tokenizer = tiny_tokenizer()
    texts = stdlib_texts(40)
    raw = Dataset.from_dict({"text": texts[:36], "source": ["stdlib"] * 36})
    raw_eval = Dataset.from_dict({"text": texts[36:], "source": ["stdlib"] * 4})
    model = tiny_llama(vocab_size=len(tokenizer))
    args = training_args(str(tmp_path), max_steps=6, learning_rate=1e-2, warmup_steps=0,
                         eval_strategy="steps", eval_steps=6)  # fmt: skip
    trainer = DecoupledTrainer(model=model, tokenizer=tokenizer, train_dataset=raw,
                               eval_dataset=raw_eval, text_column_name="text", args=args,
                               block_size=32)  # fmt: skip
    assert trainer.train_dataset.column_names == ["input_ids", "labels"]
    assert {len(ids) for ids in trainer.train_dataset["input_ids"]} == {32}
    assert trainer.train_dataset[0]["input_ids"] == trainer.train_dataset[0]["labels"]
    eos = tokenizer.eos_token_id
    assert sum(ids.count(eos) for ids in trainer.train_dataset["input_ids"]) >= 30  # one per text
    trainer.train()
    loss = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    assert trainer.state.global_step == 6 and loss[6] < loss[1]
    assert trainer.state.log_history[-2]["eval_loss"] < 6.0


def test_decoupled_trainer_accepts_the_paper_config(tmp_path, monkeypatch) -> None:
    from datasets import Dataset

    from acco_hooks.hf import DecoupledTrainer, training_arguments_from_paper_config
    from tests.hf.workers import stdlib_texts, tiny_llama, tiny_tokenizer

    config = {  # the paper code's ``train`` section (the keys its trainer reads)
        "method_name": "acco", "run_baseline_ddp": False, "batch_size": 2, "n_grad_accumulation": 2,
        "nb_steps_tot": 24, "learning_rate": 6e-4, "weight_decay": 0.1, "adam_beta1": 0.9,
        "adam_beta2": 0.95, "scheduler_name": "cosine", "warmup": 1, "max_length": 32,
        "const_len_batch": True, "label_smoothing_factor": 0.0, "n_warmup_steps": 0,
        "dataloader_num_workers": 0, "use_mixed_precision": False, "eval": False, "finetune": False,
    }  # fmt: skip
    args, acco_args, data_kwargs = training_arguments_from_paper_config(
        config, str(tmp_path), world_size=2
    )
    assert args.max_steps == 6  # 24 gradients / (2 ranks x 2 micro-batches per round)
    assert (args.gradient_accumulation_steps, args.per_device_train_batch_size) == (2, 2)
    assert (args.adam_beta2, args.weight_decay) == (0.95, 0.1)
    assert str(args.lr_scheduler_type.value) == "cosine"
    assert args.warmup_steps == 2  # 1 update of warm-up = 2 rounds in acco
    assert acco_args.mode == "acco" and data_kwargs == {"block_size": 32, "group_texts": True}
    with pytest.raises(ValueError, match="n_warmup_steps"):
        training_arguments_from_paper_config({**config, "n_warmup_steps": 5})

    monkeypatch.chdir(tmp_path)  # a paper config writes under ./outputs/<run_name>
    tokenizer = tiny_tokenizer()
    trainer = DecoupledTrainer(
        model=tiny_llama(vocab_size=len(tokenizer)), tokenizer=tokenizer,
        train_dataset=Dataset.from_dict({"text": stdlib_texts(20)}), eval_dataset=None,
        text_column_name="text", args={**config, "nb_steps_tot": 8, "run_baseline_ddp": True},
        log=None, preprocess_dataset_fn=None, run_name="paper",
    )  # fmt: skip
    assert trainer.acco_args.mode == "ddp"  # run_baseline_ddp
    assert trainer.args.output_dir == os.path.join("outputs", "paper")
    trainer.train()
    assert trainer.state.global_step == 4  # 8 micro-batch gradients / (1 rank x 2 per round)


def test_train_three_times_leaves_no_group_or_thread_behind(tmp_path) -> None:
    for rank in run_distributed("tests.hf.workers:train_three_times", 2, str(tmp_path),
                                fresh_processes=True):  # fmt: skip
        assert rank["distinct_groups"] >= 3  # a new engine, with new groups, per train()
        for call in rank["after"]:
            assert call["engine"] is None
            assert call["steps"] == 2
            assert call["groups"] >= 1 and all(call["destroyed"])
            assert call["threads"] == []
            assert call["gloo_threads_left"] == 0  # the groups' C++ objects are gone too


# --------------------------------------------------------------------- the torchrun launch


def test_example_script_trains_with_torchrun(tmp_path) -> None:
    from tests.hf.workers import stdlib_texts, tiny_tokenizer

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in stdlib_texts(40)))
    tiny_tokenizer().save_pretrained(tmp_path / "tokenizer")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "examples.hf_finetune", "--mode", "acco", "--train_file", str(data),
        "--validation_file", str(data), "--max_eval_samples", "8", "--tokenizer_name",
        str(tmp_path / "tokenizer"), "--block_size", "32", "--per_device_train_batch_size", "4",
        "--max_steps", "8", "--learning_rate", "1e-2", "--warmup_steps", "0", "--logging_steps",
        "1", "--eval_steps", "8", "--output_dir", str(tmp_path / "out"),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "terminate called" not in done.stderr
    summary = re.search(r"summary: mode=acco steps=8 real_updates=4 first_loss=(\S+) "
                        r"last_loss=(\S+) eval_loss=(\S+)", done.stdout)  # fmt: skip
    assert summary, done.stdout[-3000:]
    first, last, _ = map(float, summary.groups())
    assert last < first
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_evaluate_on_one_rank_during_training_raises_instead_of_hanging(tmp_path) -> None:
    # A faulted job: no orderly teardown barrier after the ranks' errors (may_die).
    rank0, rank1 = run_distributed("tests.hf.workers:evaluate_on_one_rank", 2, str(tmp_path),
                                   deadline_s=120, may_die=(1,), fresh_processes=True)  # fmt: skip
    assert rank0["error"] is not None and "must run on every rank" in rank0["error"]
    assert "ddp_timeout" in rank0["error"]
    assert rank1 is not None and rank1["error"] is not None  # its next collective lost rank 0


@pytest.mark.parametrize("schedule, kwargs", [
    ("warmup_stable_decay", {"num_stable_steps": 2, "num_decay_steps": 4}),
    ("inverse_sqrt", {"timescale": 4}),
])  # fmt: skip
def test_step_counts_in_lr_scheduler_kwargs_last_as_many_trainer_steps_in_acco(
    schedule, kwargs, tmp_path
) -> None:
    """In acco a real update takes two Trainer steps: the scheduler's own step counts are
    converted as warmup_steps is, so each phase lasts the Trainer steps it says. The plain
    schedule over 8 steps, read every other step, is the one the engine runs over 4 updates."""
    from transformers.optimization import get_scheduler

    from acco_hooks.hf import ACCOArguments, ACCOTrainer
    from tests.hf.workers import byte_dataset, tiny_llama, training_args

    args = training_args(str(tmp_path), max_steps=8, warmup_steps=2, lr_scheduler_type=schedule,
                         lr_scheduler_kwargs=kwargs)  # fmt: skip
    model = tiny_llama()
    trainer = ACCOTrainer(model=model, args=args, train_dataset=byte_dataset(8),
                          acco_args=ACCOArguments(mode="acco"))  # fmt: skip
    trainer.create_optimizer_and_scheduler(num_training_steps=8)
    engine_schedule = trainer.optimizer.lr_scheduler  # stepped by the engine, once per update
    plain = get_scheduler(schedule, torch.optim.SGD(model.parameters(), lr=args.learning_rate),
                          num_warmup_steps=2, num_training_steps=8,
                          scheduler_specific_kwargs=kwargs)  # fmt: skip
    ours, theirs = [], []
    for step in range(8):
        theirs.append(plain.get_last_lr()[0])
        plain.step()
        if step % 2 == 0:
            ours.append(engine_schedule.get_last_lr()[0])
            engine_schedule.step()
    assert ours == pytest.approx(theirs[::2], rel=1e-6)
    trainer.optimizer.close()


def test_a_single_process_resume_says_what_is_left_and_warns_nothing(tmp_path, caplog) -> None:
    """One process, no launcher: the startup line is the whole run's, in the singular, the
    resume says where it took up, and DCP is told there is no process group (it would warn
    that it assumes one process)."""
    import logging
    import warnings

    from acco_hooks.hf import ACCOArguments, ACCOTrainer
    from tests.hf.workers import byte_dataset, tiny_llama, training_args

    def trainer(max_steps: int) -> ACCOTrainer:
        args = training_args(str(tmp_path), max_steps=max_steps, save_strategy="steps",
                             save_steps=2, warmup_steps=0)  # fmt: skip
        return ACCOTrainer(model=tiny_llama(), args=args, train_dataset=byte_dataset(32),
                           acco_args=ACCOArguments(mode="acco"))  # fmt: skip

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*torch.distributed is disabled")
        with caplog.at_level(logging.INFO, logger="acco_hooks.hf.trainer"):
            trainer(4).train()
            caplog.clear()
            trainer(8).train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    said = caplog.text
    assert "the whole run: 8 rounds of 2 micro-batches per rank, 4 real updates, on 1 rank," in said
    assert (f"resumed from {tmp_path / 'checkpoint-4'} after 2 of the run's 4 real updates, on "
            "1 rank (saved by 1 rank)") in said, said  # fmt: skip
