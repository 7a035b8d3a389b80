"""torchtitan 0.2.2 TOML job configs (and their ``--section.key`` overrides) for torchtitan 0.3.0.

torchtitan 0.3.0 dropped TOML job configs for Python config functions. This project promised
``train_titan.py --job.config_file X.toml``; on 0.3.0 that TOML is translated here into a
``Trainer.Config`` (``ACCOTrainer.Config`` with ``[acco] enable = true``), one key at a time,
by :data:`KEYS`. A key with no 0.3.0 meaning is an error that names it, before anything is
built; all such keys are reported together.

The shipped TOMLs stay the single source of truth: ``acco_hooks.titan.config_registry`` builds
its config functions with :func:`load_toml_config`.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from acco_hooks.titan.config import ACCO

__all__ = ["KEYS", "TomlConfigError", "build_config", "load_toml_config", "parse_overrides",
           "read_toml"]


class TomlConfigError(ValueError):
    """A 0.2.2 job-config key or value that has no meaning in torchtitan 0.3.0."""


@dataclass(frozen=True)
class Key:
    type: type
    """The value's type (bool keys are flags on the command line)."""
    target: str | None
    """Where it goes in 0.3.0's ``Trainer.Config`` (dotted), or None for a special case."""


def _acco_keys() -> dict[str, Key]:
    """Every field of the ``[acco]`` section, with the type torchtitan 0.2.2 parses it as."""
    keys = {}
    for name, hint in typing.get_type_hints(ACCO).items():
        # Optional[float] -> float: TOML has no None, a timeout is given as a number
        type_ = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
        keys[f"acco.{name}"] = Key(type_, f"acco.{name}")
    return keys


def _same(section: str, names: str, type_: type, target_section: str | None = None) -> dict:
    return {f"{section}.{n}": Key(type_, f"{target_section or section}.{n}") for n in names.split()}


# Every 0.2.2 key the translation accepts. Anything else is refused (TomlConfigError).
KEYS: dict[str, Key] = {
    "job.config_file": Key(str, None),
    "job.dump_folder": Key(str, "dump_folder"),
    "job.description": Key(str, None),  # no 0.3.0 field; dropped
    "model.name": Key(str, None),
    "model.flavor": Key(str, None),
    "model.hf_assets_path": Key(str, "hf_assets_path"),
    "optimizer.name": Key(str, None),
    **_same("optimizer", "lr eps weight_decay beta1 beta2", float, "param_group"),
    "optimizer.implementation": Key(str, "optimizer.implementation"),
    "optimizer.early_step_in_backward": Key(bool, None),
    **_same("lr_scheduler", "warmup_steps", int),
    "lr_scheduler.decay_ratio": Key(float, "lr_scheduler.decay_ratio"),
    "lr_scheduler.decay_type": Key(str, "lr_scheduler.decay_type"),
    "lr_scheduler.min_lr_factor": Key(float, "lr_scheduler.min_lr_factor"),
    "training.dataset": Key(str, "dataloader.dataset"),
    "training.dataset_path": Key(str, "dataloader.dataset_path"),
    **_same("training", "local_batch_size global_batch_size seq_len steps gc_freq", int),
    "training.max_norm": Key(float, "training.max_norm"),
    **_same("training", "dtype mixed_precision_param mixed_precision_reduce", str),
    **_same("parallelism", "data_parallel_replicate_degree data_parallel_shard_degree "
            "tensor_parallel_degree pipeline_parallel_degree pipeline_parallel_microbatch_size "
            "context_parallel_degree expert_parallel_degree", int),
    "parallelism.pipeline_parallel_schedule": Key(str, "parallelism.pipeline_parallel_schedule"),
    "parallelism.spmd_backend": Key(str, "parallelism.spmd_backend"),  # 0.3.0 only
    "parallelism.enable_sequence_parallel": Key(bool, "parallelism.enable_sequence_parallel"),
    "parallelism.fsdp_reshard_after_forward": Key(str, "parallelism.fsdp_reshard_after_forward"),
    "activation_checkpoint.mode": Key(str, None),
    "activation_checkpoint.selective_ac_option": Key(str, None),
    "compile.enable": Key(bool, "compile.enable"),
    "compile.components": Key(list, "compile.components"),
    **_same("checkpoint", "enable last_save_model_only load_only create_seed_checkpoint "
            "enable_first_step_checkpoint initial_load_model_only", bool),
    **_same("checkpoint", "interval keep_latest_k load_step", int),
    **_same("checkpoint", "folder export_dtype async_mode", str),
    "checkpoint.initial_load_path": Key(str, None),  # made absolute (0.3.0 requires it)
    "checkpoint.exclude_from_loading": Key(list, "checkpoint.exclude_from_loading"),
    **_same("metrics", "log_freq", int),
    **_same("metrics", "enable_tensorboard disable_color_printing", bool),
    "debug.seed": Key(int, "debug.seed"),
    "debug.deterministic": Key(bool, "debug.deterministic"),
    "debug.spmd_typechecking": Key(bool, "debug.spmd_typechecking"),  # 0.3.0 only
    "comm.trace_buf_size": Key(int, "comm.trace_buf_size"),
    "comm.init_timeout_seconds": Key(int, "comm.init_timeout_seconds"),
    "comm.train_timeout_seconds": Key(int, "comm.train_timeout_seconds"),
    "validation.enable": Key(bool, "validator.enable"),
    "validation.freq": Key(int, "validator.freq"),
    "validation.steps": Key(int, "validator.steps"),
    "validation.dataset": Key(str, None),
    "validation.dataset_path": Key(str, None),
    "validation.local_batch_size": Key(int, None),  # must equal training's (0.3.0 shares it)
    "validation.seq_len": Key(int, None),
    "experimental.custom_import": Key(str, None),  # imported by train_titan.py before building
    # ACCO's trainer has torchtitan's experiments.torchft section (its fields: 0.2.2's)
    "fault_tolerance.enable": Key(bool, "fault_tolerance.enable"),
    **_same("fault_tolerance", "replica_id group_size min_replica_size process_group_timeout_ms",
            int),
    **_same("fault_tolerance", "process_group semi_sync_method", str),
    **_acco_keys(),
}

# Keys of 0.2.2 that users may know, with what to do instead on 0.3.0.
_NO_MEANING = {
    "optimizer.early_step_in_backward": "0.3.0 has no early step in backward; remove it",
    "validation.local_batch_size": "0.3.0 validates with training.local_batch_size: remove "
    "it or set it equal",
    "validation.seq_len": "0.3.0 validates with training.seq_len: remove it or set it equal",
}


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    """The TOML's settings as ``{"section.key": value}``."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    flat: dict[str, Any] = {}
    for section, values in data.items():
        if not isinstance(values, dict):
            flat[section] = values  # a top-level key: reported as unknown
            continue
        for key, value in values.items():
            flat[f"{section}.{key}"] = value
    return flat


def _coerce(key: str, text: str, type_: type) -> Any:
    try:
        if type_ is bool:
            if text.lower() in ("true", "1", "yes"):
                return True
            if text.lower() in ("false", "0", "no"):
                return False
            raise ValueError(text)
        if type_ is list:
            return [item for item in text.split(",") if item]
        return type_(text)
    except ValueError:
        raise TomlConfigError(f"--{key} {text!r}: expected {type_.__name__}") from None


def parse_overrides(args: Sequence[str], *, strict: bool = True) -> dict[str, Any]:
    """0.2.2-style overrides (``--a.b v``, ``--a.b=v``, ``--a.b`` / ``--a.no_b`` for booleans,
    ``-`` or ``_`` in names) as ``{"a.b": value}``, typed by :data:`KEYS`.

    Args:
        args: the command-line arguments after the config file's.
        strict: refuse keys outside :data:`KEYS` here; with False they are returned (with
            their text value, or True) for :func:`build_config` to report with the TOML's.
    """
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("--") or "." not in arg:
            raise TomlConfigError(f"{arg!r}: expected --section.key [value]")
        name, eq, text = arg[2:].partition("=")
        section, _, field_name = name.partition(".")
        key = f"{section.replace('-', '_')}.{field_name.replace('-', '_')}"
        negated = key.split(".", 1)[1].startswith("no_") and key not in KEYS
        if negated:
            key = key.replace(".no_", ".", 1)
        spec = KEYS.get(key)
        if spec is None or spec.type is bool:
            if not eq and i < len(args) and not args[i].startswith("--") and spec is None:
                text, eq = args[i], "="  # an unknown key's value
                i += 1
            out[key] = _coerce(key, text, bool) if eq and spec else (text if eq else not negated)
            continue
        if not eq:
            if i >= len(args):
                raise TomlConfigError(f"--{name} needs a value")
            text = args[i]
            i += 1
        out[key] = _coerce(key, text, spec.type)
    unknown = [k for k in out if k not in KEYS]
    if strict and unknown:
        raise _unknown_keys_error(unknown)
    return out


def _unknown_keys_error(keys: list[str]) -> TomlConfigError:
    lines = []
    for key in keys:
        hint = _NO_MEANING.get(key, "no torchtitan 0.3.0 setting corresponds to it")
        lines.append(f"  {key}: {hint}")
    return TomlConfigError(
        "these torchtitan 0.2.2 settings have no torchtitan 0.3.0 meaning here:\n"
        + "\n".join(lines)
        + "\nRemove them, or install torchtitan 0.2.2 (pip install 'torchtitan==0.2.2') to use "
        "them as they are; the keys this translation accepts are listed in "
        "acco_hooks/titan/toml_compat.py (KEYS)"
    )


def _check(settings: dict[str, Any]) -> None:
    unknown = [k for k in settings if k not in KEYS]
    if settings.get("optimizer.early_step_in_backward"):
        unknown.append("optimizer.early_step_in_backward")
    for key in ("validation.local_batch_size", "validation.seq_len"):
        training = settings.get(key.replace("validation.", "training."))
        if key in settings and settings[key] != training:
            unknown.append(key)
    if unknown:
        raise _unknown_keys_error(sorted(set(unknown)))
    for key, value in settings.items():
        spec = KEYS[key]
        ok = isinstance(value, spec.type) and not (spec.type is int and isinstance(value, bool))
        if spec.type is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise TomlConfigError(f"{key} = {value!r}: expected {spec.type.__name__}")
    if settings.get("model.name", "llama3") != "llama3":
        raise TomlConfigError(
            f"model.name = {settings['model.name']!r}: the 0.3.0 translation builds llama3 "
            "only; write a config function for other models (see acco_hooks.titan."
            "config_registry)"
        )


def load_toml_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> Any:
    """The 0.3.0 ``Trainer.Config`` (``ACCOTrainer.Config`` with ``[acco] enable``) of a 0.2.2
    TOML job config and 0.2.2-style command-line overrides."""
    settings = read_toml(path)
    settings.update(parse_overrides(overrides, strict=False))
    return build_config(settings)


def _set(obj: Any, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for name in parents:
        obj = getattr(obj, name)
    setattr(obj, last, value)


def build_config(settings: dict[str, Any]) -> Any:
    """The 0.3.0 config of flat 0.2.2 ``settings`` (see :func:`read_toml`).

    Raises:
        TomlConfigError: naming every key without a 0.3.0 meaning, or a value of a wrong type.
    """
    _check(settings)
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import (
        LRSchedulersContainer,
        OptimizersContainer,
        ParamGroupConfig,
    )
    from torchtitan.components.validate import Validator
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry
    from torchtitan.trainer import Trainer

    from acco_hooks.titan.v030 import ACCOTrainer

    get = settings.get
    spec = model_registry(get("model.flavor", "debugmodel"))
    acco = ACCO(**{k.split(".", 1)[1]: v for k, v in settings.items() if k.startswith("acco.")})
    mode = get("activation_checkpoint.mode", "selective")
    option = get("activation_checkpoint.selective_ac_option", "2")
    if mode == "none":
        ac = None
    elif mode == "full":
        ac = FullAC.Config()
    elif mode == "selective" and option == "op":
        ac = SelectiveAC.Config()
    else:
        raise TomlConfigError(
            f"activation_checkpoint.mode = {mode!r} with selective_ac_option = {option!r}: "
            "torchtitan 0.3.0 has 'none', 'full' and op-level 'selective' "
            "(selective_ac_option = \"op\"); layer-wise selective checkpointing is gone"
        )
    torchft = sorted(k for k in settings if k.startswith("fault_tolerance."))
    if torchft and not acco.enable:
        raise TomlConfigError(
            f"{', '.join(torchft)} without [acco] enable: torchtitan 0.3.0's own torchft "
            "trainer is another one (experiments.torchft: python -m torchtitan.train --module "
            "torchft.llama3 ...), which this launcher does not run; set [acco] enable = true "
            "for ACCO across torchft replica groups"
        )
    config_cls = ACCOTrainer.Config if acco.enable else Trainer.Config
    extra = {"acco": acco} if acco.enable else {}
    validation = HuggingFaceTextDataLoader.Config(
        dataset=get("validation.dataset", "c4_validation"),
        dataset_path=get("validation.dataset_path"), infinite=False,
    )  # fmt: skip
    config = config_cls(
        model_spec=spec,
        loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec)),
        optimizer=OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(
                pattern=r".*", optimizer_name=get("optimizer.name", "AdamW"),
                optimizer_kwargs={
                    "lr": get("optimizer.lr", 8e-4),
                    "betas": (get("optimizer.beta1", 0.9), get("optimizer.beta2", 0.95)),
                    "eps": get("optimizer.eps", 1e-8),
                    "weight_decay": get("optimizer.weight_decay", 0.1),
                },
            )],
        ),  # fmt: skip
        lr_scheduler=LRSchedulersContainer.Config(),
        training=TrainingConfig(disable_cuda_graphs=True),  # 0.2.2 had no CUDA graphs
        parallelism=ParallelismConfig(),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4"),
        activation_checkpoint=ac,
        compile=CompileConfig(),
        validator=Validator.Config(dataloader=validation),
        **extra,
    )
    for key, value in settings.items():
        target = KEYS[key].target
        if target is None or target.startswith("param_group.") or key.startswith("acco."):
            continue
        _set(config, target, value)
    if get("checkpoint.initial_load_path"):
        config.checkpoint.initial_load_path = os.path.abspath(settings["checkpoint.initial_load_path"])
    # re-run the checks the constructors run, now that every value is set
    for section in ("training", "parallelism", "lr_scheduler", "checkpoint", "validator"):
        value = getattr(config, section)
        post_init = getattr(type(value), "__post_init__", None)
        if post_init is not None:
            post_init(value)
    return dataclasses.replace(config)
