"""Run torchtitan's own Trainer (0.2.2 or 0.3.0) on CPU (gloo) when the machine has no accelerator.

This is the checkout's CPU scaffolding, not part of the library: ``train_titan.py`` imports it
when no accelerator is present, so that the README's main job runs on any machine. Importing it
installs it (torchtitan 0.2.2's ``--experimental.custom_import`` only imports); on a machine
with an accelerator that logs one line and patches nothing.

torchtitan has no CPU device option: ``torchtitan/tools/utils.py`` picks ``"cuda"`` and
``torch.cuda`` at import time and several modules copy those names, so the Trainer calls
``torch.cuda.set_device`` and asks for NCCL. :func:`install` (run on import, idempotent):

1. points ``device_type`` / ``device_module`` at ``"cpu"`` and :data:`CPU_DEVICE_MODULE` in
   every imported ``torchtitan.*`` module: ``torch.cpu`` plus what torchtitan calls that it
   lacks (``current_device() -> 0``, device name and memory; ``memory_stats`` reports the peak
   RSS, so the step log's "memory" column is the rank's real peak resident memory). The world
   mesh becomes a ``cpu`` mesh and the backend gloo.
2. makes FSDP2 work on gloo: torchtitan sets FSDP's gradient divide factor to 1 (it divides the
   loss by the global token count), which FSDP2 sends as ``PREMUL_SUM``, which gloo rejects.
   ``set_force_sum_reduction_for_comms(True)`` on every FSDP module (0.2.2: through
   ``apply_fsdp`` and a wrapped ``get_train_spec``; 0.3.0: through
   ``disable_fsdp_gradient_division``, which every parallelize function calls) gives a plain
   ``SUM``: the value NCCL's ``PREMUL_SUM(1.0)`` gives.
3. quiets what only a CPU run warns about (the peak-FLOPs lookup, DTensor's CPU-mesh RNG and
   CPU autocast notices, torchrun's ``TORCH_NCCL_ASYNC_ERROR_HANDLING``). MFU is meaningless on
   CPU; FSDP's sharded init draws other weights than an unsharded run (start both from one
   seed checkpoint to compare them).

4. (0.3.0) replaces FlexAttention's call by SDPA over the block mask's own ``mask_mod``,
   evaluated densely (:func:`dense_mask_attention`): torch has no FlexAttention backward on
   CPU. Same attention pattern, another kernel.
5. takes out the 2 s that rank 0 sleeps at the end of torchtitan's ``train()`` "for other ranks
   to complete" (its module's only ``time.sleep``), and the log line that announces it: every rank of
   ``train_titan.py`` goes on to close the trainer and destroy its groups, which waits for the
   others where it must. The checkout launches torchtitan about 170 times in CI, on CPU.

With torchtitan's own entry point, from the checkout's root: 0.2.2 ``-m torchtitan.train
--experimental.custom_import scaffolding.cpu_shim ...``; 0.3.0 has no hook that runs before the
device is chosen: ``train_titan.py --module M --config NAME`` installs the shim, then runs
torchtitan's own ``main()``.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import platform
import resource
import sys
import time
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

from acco_hooks.titan import TITAN_030

__all__ = ["CPU_DEVICE_MODULE", "dense_mask_attention", "force_sum_reduction_for_comms", "install",
           "is_installed"]

_MARK = "_acco_cpu_shim"  # attribute set on everything this module creates or wraps


def _log(msg: str) -> None:
    from torchtitan.tools.logging import logger

    logger.info(f"[acco cpu_shim] {msg}")


# --------------------------------------------------------------------------- the device module
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return "CPU " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU " + (platform.processor() or platform.machine() or "unknown")


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40  # unknown: 1 TiB keeps the percentage column finite


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


class _CPUDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the CUDA-style calls torchtitan makes on ``device_module``."""

    def __init__(self) -> None:
        super().__init__("scaffolding.cpu_shim.cpu_device_module")
        self.__file__ = __file__
        setattr(self, _MARK, True)

    def __getattr__(self, name: str) -> Any:  # everything else: torch.cpu (set_device, ...)
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0  # an int: torchtitan passes it to barrier(device_ids=[...])

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return _cpu_name()

    @staticmethod
    def get_device_properties(device: Any = None) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            name=_cpu_name(), total_memory=_total_memory(), multi_processor_count=os.cpu_count()
        )

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        pass  # the kernel's RSS high-water mark cannot be reset

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        peak = _peak_rss_bytes()
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }


CPU_DEVICE_MODULE = _CPUDeviceModule()


# --------------------------------------------------------------------------- FSDP2 on gloo
def force_sum_reduction_for_comms(model: torch.nn.Module) -> int:
    """``set_force_sum_reduction_for_comms(True)`` on every FSDPModule in ``model``.

    Returns how many modules it set."""
    from torch.distributed.fsdp import FSDPModule

    n = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            n += 1
    return n


def _with_force_sum(fn: Callable, model_arg: bool) -> Callable:
    """Wrap ``fn(model, ...)``: after it ran, force SUM reductions on the FSDP modules of the model
    (the returned one for a parallelize_fn, the argument for apply_fsdp, which returns None)."""
    if getattr(fn, _MARK, False):
        return fn

    @functools.wraps(fn)
    def wrapper(model, *args, **kwargs):
        out = fn(model, *args, **kwargs)
        target = model if model_arg or not isinstance(out, torch.nn.Module) else out
        if isinstance(target, torch.nn.Module):
            force_sum_reduction_for_comms(target)
        return out

    setattr(wrapper, _MARK, True)
    return wrapper


def _wrap_get_train_spec(get_train_spec: Callable) -> Callable:
    if getattr(get_train_spec, _MARK, False):
        return get_train_spec

    @functools.wraps(get_train_spec)
    def wrapper(name: str):
        spec = get_train_spec(name)
        fn = getattr(spec, "parallelize_fn", None)
        if fn is None or getattr(fn, _MARK, False):
            return spec
        # a copy: registered specs are shared objects and must not be wrapped twice
        return dataclasses.replace(spec, parallelize_fn=_with_force_sum(fn, model_arg=False))

    setattr(wrapper, _MARK, True)
    return wrapper


# --------------------------------------------------------------------------- attention (0.3.0)
def dense_mask_attention(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux,
                         kernel_options):
    """FlexAttention's call, computed by SDPA over the block mask's dense boolean mask.

    torch has no FlexAttention backward on CPU (eager or compiled). The mask is the block
    mask's own ``mask_mod`` evaluated at every (batch, head, query, key) index, so the
    attention pattern is exactly the one FlexAttention would use; only the kernel differs.
    """
    import spmd_types  # torchtitan 0.3.0's type system (debug.spmd_typechecking)
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    if score_mod is not None or (return_aux is not None and (return_aux.lse or
                                                             return_aux.max_scores)):
        raise NotImplementedError(
            "acco cpu_shim: the CPU attention replacement supports mask_mod only (no "
            "score_mod, no returned log-sum-exp); run this model on a GPU"
        )
    batch, heads, q_len, _ = q.shape
    kv_len = k.shape[-2]
    # torch's own dense evaluation of a mask_mod: (B, H, Q_LEN, KV_LEN) booleans. It indexes
    # with autograd functions spmd_types does not know; a constant needs no type checking.
    with spmd_types.no_typecheck():
        mask = create_mask(block_mask.mask_mod, batch, heads, q_len, kv_len, device=q.device)
    if spmd_types.is_type_checking():  # the mask is laid out as q: (batch, heads, query, ...)
        spmd_types.assert_type(mask, spmd_types.get_local_type(q))
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    )
    return out, AuxOutput(lse=None, max_scores=None)


def _install_cpu_attention() -> None:
    import torchtitan.models.common.attention as tt_attention
    import torchtitan.models.common.decoder as tt_decoder
    from torch.nn.attention.flex_attention import create_block_mask

    tt_attention.FlexAttention.compiled_flex_attn = staticmethod(dense_mask_attention)
    # eager: the compiled builder would run inductor once per process for nothing on CPU
    tt_decoder.create_attention_mask = create_block_mask


# --------------------------------------------------------------------------- install
_installed = False


def _a100_peak_flops(device_name: str) -> float:
    return 312e12  # torchtitan's fallback for a device it does not know


def _without_end_of_training_sleep(trainer_module: types.ModuleType) -> None:
    """Give torchtitan's trainer module a ``time`` whose ``sleep`` returns at once; every other
    name is the real module's; and drop the log line that announces the sleep (idempotent)."""
    if getattr(trainer_module.time, _MARK, False):
        return
    names = {k: v for k, v in vars(time).items() if not k.startswith("__")}
    no_sleep = types.SimpleNamespace(**names)
    no_sleep.sleep = lambda seconds: None
    setattr(no_sleep, _MARK, True)
    trainer_module.time = no_sleep
    trainer_module.logger.addFilter(
        lambda record: not record.getMessage().startswith("Sleeping 2 seconds for other ranks")
    )


def is_installed() -> bool:
    """True once :func:`install` patched torchtitan in this process."""
    import torchtitan.tools.utils as tt_utils

    return getattr(tt_utils.device_module, _MARK, False)


def install() -> None:
    """Patch torchtitan for CPU + gloo if no accelerator is available (idempotent)."""
    global _installed
    import torchtitan.tools.utils as tt_utils
    from torch._utils import _get_available_device_type

    available = _get_available_device_type()
    if available is not None:
        if not _installed:
            _log(f"{available} is available: torchtitan runs on it unchanged (shim not applied)")
            _installed = True
        return

    # 1. device_type / device_module, in tools.utils and in every module that copied them
    orig_type, orig_module = tt_utils.device_type, tt_utils.device_module
    cpu_module: types.ModuleType = CPU_DEVICE_MODULE
    if getattr(orig_module, _MARK, False):  # installed before (e.g. this module was reloaded)
        orig_type, orig_module, cpu_module = "cuda", torch.cuda, orig_module
    tt_utils.device_type, tt_utils.device_module = "cpu", cpu_module
    if not getattr(tt_utils.get_device_info, _MARK, False):

        def get_device_info() -> tuple[str, types.ModuleType]:
            return "cpu", cpu_module

        setattr(get_device_info, _MARK, True)
        tt_utils.get_device_info = get_device_info

    # import the known copiers now so they are patched even if nothing imported them yet
    if TITAN_030:
        import torchtitan.distributed.parallel_dims
        import torchtitan.distributed.utils
        import torchtitan.tools.profiler
        import torchtitan.trainer  # (imports the rest of the training stack)
    else:
        import torchtitan.distributed.parallel_dims
        import torchtitan.distributed.utils
        import torchtitan.tools.profiling
        import torchtitan.train  # noqa: F401  (the trainer's module: 5. below)

    import torchtitan.components.metrics as tt_metrics

    patched = []
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("torchtitan.") or mod is None or mod is tt_utils:
            continue
        d = getattr(mod, "__dict__", None)
        if not isinstance(d, dict):
            continue
        hit = False
        if d.get("device_type") == orig_type and isinstance(d.get("device_type"), str):
            d["device_type"] = "cpu"
            hit = True
        if d.get("device_module") is orig_module:
            d["device_module"] = cpu_module
            hit = True
        if hit:
            patched.append(mod_name)
    # DeviceMemoryMonitor(device=f"{device_type}:0") froze "cuda:0" as its default argument
    init = tt_metrics.DeviceMemoryMonitor.__init__
    if init.__defaults__ and str(init.__defaults__[0]).startswith(f"{orig_type}:"):
        init.__defaults__ = ("cpu:0",)

    # 2. FSDP2 on gloo: force ReduceOp.SUM (see the module docstring)
    if TITAN_030:
        import torchtitan.distributed.fsdp as tt_fsdp

        # called by every parallelize function once FSDP is applied (a module global there)
        tt_fsdp.disable_fsdp_gradient_division = _with_force_sum(
            tt_fsdp.disable_fsdp_gradient_division, model_arg=True
        )
        # 4. attention: FlexAttention has no CPU backward (see the module docstring)
        _install_cpu_attention()
    else:
        import torchtitan.models.llama3.infra.parallelize as llama3_par
        import torchtitan.protocols.train_spec as train_spec_mod

        llama3_par.apply_fsdp = _with_force_sum(llama3_par.apply_fsdp, model_arg=True)
        train_spec_mod.get_train_spec = _wrap_get_train_spec(train_spec_mod.get_train_spec)

    # 5. no sleep at the end of train() (see the module docstring)
    trainer_module = "torchtitan.trainer" if TITAN_030 else "torchtitan.train"
    _without_end_of_training_sleep(sys.modules[trainer_module])

    # 3. CPU-only noise (see the module docstring)
    tt_utils.get_peak_flops = _a100_peak_flops
    for message in (r"DTensor .* may not have complete support on cpu device mesh",
                    r"In CPU autocast, but the target dtype is not supported"):  # fmt: skip
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)

    if not _installed:
        _log(
            "no accelerator: torchtitan device_type='cpu' (backend gloo), patched "
            f"{', '.join(sorted(patched)) or 'no copies'}; FSDP2 reductions forced to SUM"
        )
    _installed = True


install()
