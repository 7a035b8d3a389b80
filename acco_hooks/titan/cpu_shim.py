"""Run torchtitan's own Trainer on CPU (gloo) when the machine has no accelerator.

torchtitan 0.2.2 has no CPU device option. ``torchtitan/tools/utils.py`` picks the device at
import time (``device_type = _get_available_device_type() or "cuda"``, ``device_module =
torch.cuda``), and several modules copy those two names when they are imported
(``from torchtitan.tools.utils import device_module, device_type`` in ``components/metrics.py``,
``distributed/utils.py``, ``distributed/parallel_dims.py``, ``tools/profiling.py``). On a
CPU-only machine the Trainer therefore calls ``torch.cuda.set_device``, builds a ``cuda`` device
mesh and asks for the ``nccl`` backend, and dies.

Importing this module calls :func:`install`, which, only when no accelerator is available:

1. sets ``device_type = "cpu"`` and ``device_module = CPU_DEVICE_MODULE`` in
   ``torchtitan.tools.utils`` (and makes its ``get_device_info()`` return them), then replaces the
   copies in every already-imported ``torchtitan.*`` module that still holds the original
   ``"cuda"`` / ``torch.cuda`` values (modules imported later copy the patched values).
   ``Trainer.__init__`` reads ``utils.device_module`` / ``utils.device_type`` right after it
   imports ``--experimental.custom_import``, so the device becomes ``cpu:<LOCAL_RANK>``, the
   world mesh is a ``cpu`` mesh, and ``init_distributed`` resolves the backend from
   ``Backend.default_device_backend_map["cpu"]``, i.e. ``gloo``.
   ``CPU_DEVICE_MODULE`` is ``torch.cpu`` plus what torchtitan calls that ``torch.cpu`` lacks or
   answers differently: ``current_device() -> 0`` (an int: it ends up in
   ``barrier(device_ids=[...])``), ``get_device_name``, ``get_device_properties(...).total_memory``
   (physical RAM), ``reset_peak_memory_stats``/``empty_cache`` (no-ops) and ``memory_stats``, which
   reports the process's peak RSS (``resource.getrusage``) as ``active_bytes.all.peak`` and
   ``reserved_bytes.all.peak``, so the "memory: x GiB (y%)" column of torchtitan's step log is the
   real peak resident memory of the rank (the kernel's high-water mark cannot be reset, so it is
   the peak since process start, not since the last reset).

2. makes FSDP2 work on gloo. torchtitan's ``apply_fsdp`` calls ``disable_fsdp_gradient_division``
   (``set_gradient_divide_factor(1.0)`` on every ``FSDPModule``) because it divides the loss by the
   *global* number of valid tokens itself, so the reduction it wants is a plain SUM of the
   per-rank gradients. With an fp32 reduce dtype and an explicit factor FSDP2 expresses that as
   ``ReduceOp.PREMUL_SUM(1 / 1.0)``, and gloo rejects it: the first backward dies with
   "Cannot use ReduceOp.PREMUL_SUM with Gloo".
   ``FSDPModule.set_force_sum_reduction_for_comms(True)``
   makes FSDP2 use ``ReduceOp.SUM`` for the reduce-scatter (and HSDP all-reduce) and apply the
   divide factor as a separate post-division (``_get_gradient_divide_factors`` in
   ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``). With torchtitan's factor 1.0 that
   post-division is skipped, so the reduced gradient is exactly ``sum_r grad_r`` -- the same value
   NCCL's ``PREMUL_SUM(1.0)`` produces; gradient scaling is unchanged and equals torchtitan's
   intended semantics on NCCL (the mean over all global tokens). If some other code left the
   factor unset, force-sum gives ``SUM`` followed by ``/ dp_size``, which equals the ``AVG`` that
   FSDP2 would use otherwise (gloo in torch 2.13 does accept ``AVG``; only PREMUL_SUM fails).
   Hook points (both harmless if they overlap; the flag is idempotent):
   ``torchtitan.models.llama3.infra.parallelize.apply_fsdp`` is wrapped in that module's namespace
   (``parallelize_llama`` looks it up there at call time), and
   ``torchtitan.protocols.train_spec.get_train_spec`` (what ``Trainer.__init__`` calls) returns a
   copy of the spec whose ``parallelize_fn`` runs the same post-pass over ``model.modules()``, which
   covers every model, including those with their own ``apply_fsdp`` and the pipeline path (the
   Trainer hands ``train_spec.parallelize_fn`` to ``pipelining_fn``).

3. quiets what only a CPU run makes torchtitan and torch warn about, so that a first run shows
   no warning that is not the user's to act on: ``get_peak_flops`` returns torchtitan's own
   fallback (the A100's, so the ``mfu`` column means nothing on CPU) without running ``lspci``
   and warning twice per rank; DTensor's "may not have complete support on cpu device mesh"
   and CPU autocast's "target dtype is not supported" (float32 runs need no autocast) are
   ignored; ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (set by torchrun, and torchtitan warns that it
   overrides it) is unset: there is no NCCL here.

Calling :func:`install` again (or importing this module twice) changes nothing. When an
accelerator is available it only logs a line and patches nothing.

Use it with torchtitan's own entry point (one process per rank, gloo on CPU)::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        -m torchtitan.train --experimental.custom_import acco_hooks.titan.cpu_shim \\
        --model.flavor debugmodel --model.hf_assets_path <dir with tokenizer.json> \\
        --training.mixed_precision_param float32 --activation_checkpoint.mode none ...

(``--training.dataset c4_test --training.dataset_path <dir with a .jsonl of {"text": ...}>`` works
offline), or ``import acco_hooks.titan.cpu_shim`` before building a ``torchtitan.train.Trainer``.

Things the shim does not change (same as on GPUs, or CPU limits of torch itself):

* the default ``--training.mixed_precision_param bfloat16`` works (FSDP computes in bf16, DDP and
  single-process runs use a CPU bf16 autocast); with ``float32`` torch warns "In CPU autocast, but
  the target dtype is not supported. Disabling autocast." for DDP, which is harmless;
* DTensor's RNG tracker refuses ``cpu`` ("DTensor random operators may not have complete support
  on cpu device mesh"), so FSDP's sharded ``init_weights`` draws different initial weights than an
  unsharded (DDP / 1-process) run with the same seed. To compare parallelisms, start them from one
  ``--checkpoint.create_seed_checkpoint`` (loaded with ``--checkpoint.initial_load_path``);
* torchtitan's DDP path (``replicate``) still averages gradients although the loss is already
  divided by the global token count, so DDP gradients (and the logged grad_norm) are ``1/dp`` of
  FSDP's; AdamW hides the constant factor, but grad-norm clipping then acts differently;
* MFU is meaningless: ``get_peak_flops`` falls back to the A100 figure for an unknown device.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import resource
import sys
import types
import warnings
from typing import Any, Callable

import torch

__all__ = ["CPU_DEVICE_MODULE", "force_sum_reduction_for_comms", "install", "is_installed"]

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
        super().__init__("acco_hooks.titan.cpu_shim.cpu_device_module")
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


# --------------------------------------------------------------------------- install
_installed = False


def _a100_peak_flops(device_name: str) -> float:
    return 312e12  # torchtitan's fallback for a device it does not know


def is_installed() -> bool:
    """True once :func:`install` patched torchtitan in this process."""
    import torchtitan.tools.utils as tt_utils

    return getattr(tt_utils.device_module, _MARK, False)


def install() -> None:
    """Patch torchtitan for CPU + gloo if no accelerator is available (idempotent)."""
    global _installed
    from torch._utils import _get_available_device_type

    import torchtitan.tools.utils as tt_utils

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
    import torchtitan.components.metrics as tt_metrics
    import torchtitan.distributed.parallel_dims  # noqa: F401
    import torchtitan.distributed.utils  # noqa: F401
    import torchtitan.tools.profiling  # noqa: F401

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
    import torchtitan.models.llama3.infra.parallelize as llama3_par
    import torchtitan.protocols.train_spec as train_spec_mod

    llama3_par.apply_fsdp = _with_force_sum(llama3_par.apply_fsdp, model_arg=True)
    train_spec_mod.get_train_spec = _wrap_get_train_spec(train_spec_mod.get_train_spec)

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
