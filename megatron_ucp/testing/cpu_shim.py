"""Run real megatron-core on a CPU-only host: import this module before megatron.core.

Only `torch.cuda` plumbing and device placement are replaced; no megatron-core model, optimizer or
checkpoint code is touched. The "CUDA" random generator is a separate CPU `torch.Generator`, so
Megatron's per-TP-rank CUDA seeding (model-parallel RNG tracker) never changes the default CPU
generator: replicated parameters initialised from it stay identical across TP ranks. Without the
CUDA `grouped_gemm` library, `grouped_gemm_cpu` stands in for it so GroupedMLP can be built.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch.overrides import TorchFunctionMode

from megatron_ucp.testing.devices import has_real_cuda

_CPU = torch.device("cpu")
CUDA_GENERATOR = torch.Generator()  # stands in for the device's default CUDA generator

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # megatron's jit fusions run eagerly


class _Event:
    def __init__(self, *a, **k): ...
    def record(self, *a, **k): ...
    def synchronize(self): ...
    def wait(self, *a, **k): ...
    def query(self) -> bool:
        return True
    def elapsed_time(self, other) -> float:
        return 0.0


class _Stream(_Event):
    def wait_stream(self, *a, **k): ...
    def wait_event(self, *a, **k): ...
    def record_event(self, *a, **k) -> _Event:
        return _Event()
    def __enter__(self):
        return self
    def __exit__(self, *a) -> bool:
        return False


# the compute capability the shim reports: Hopper's 9.0 unless a scenario asks for another
# (`set_compute_capability`: TE refuses MXFP8 below 10.0 and changes FP8 buffer layouts at 10.x)
_CAPABILITY = [9, 0]


def set_compute_capability(major: int, minor: int = 0) -> None:
    """Report compute capability major.minor from now on (this process: a scenario that needs
    another one, e.g. MXFP8's 10.0, sets it before it builds its model). TE caches what it
    derives from it (`functools.lru_cache`): those caches are cleared."""
    _CAPABILITY[:] = [major, minor]
    _Props.major, _Props.minor = major, minor
    try:
        import transformer_engine.pytorch.quantization as te_quantization
        import transformer_engine.pytorch.utils as te_utils
    except ImportError:
        return
    for name in dir(te_utils):
        fn = getattr(te_utils, name)
        if callable(fn) and hasattr(fn, "cache_clear"):
            fn.cache_clear()
    for name in dir(te_quantization):  # _FP8_SUPPORT, _MXFP8_SUPPORT, ...: computed once
        if name.startswith("_") and name.endswith("_SUPPORT"):
            setattr(te_quantization, name, None)


class _Props:
    name = "cpu (megatron_ucp shim)"
    major, minor = 9, 0
    total_memory = 24 * 2**30
    multi_processor_count = 1
    gcnArchName = ""  # queried by some MoE code paths to detect ROCm


class _Generators(tuple):
    def __getitem__(self, i):  # indexed with torch.cuda.current_device(), a cpu device here
        return CUDA_GENERATOR


def _get_rng_state(*a, **k) -> torch.Tensor:
    return CUDA_GENERATOR.get_state()


def _set_rng_state(state, *a, **k) -> None:
    CUDA_GENERATOR.set_state(state)


def _manual_seed(seed) -> None:
    CUDA_GENERATOR.manual_seed(int(seed))


_default_stream = _Stream()
_cuda_api = {
    "is_available": lambda: True,
    "current_device": lambda: _CPU,
    "device_count": lambda: 1,
    "set_device": lambda *a, **k: None,
    "synchronize": lambda *a, **k: None,
    "empty_cache": lambda *a, **k: None,
    "get_rng_state": _get_rng_state,
    "set_rng_state": _set_rng_state,
    "manual_seed": _manual_seed,
    "manual_seed_all": lambda seed: None,  # torch.manual_seed() calls this; keep it off the CPU one
    "default_generators": _Generators((CUDA_GENERATOR,)),
    "_lazy_call": lambda cb, **k: cb(),
    "Event": _Event,
    "Stream": _Stream,
    "current_stream": lambda *a, **k: _default_stream,
    "default_stream": lambda *a, **k: _default_stream,
    "set_stream": lambda *a, **k: None,
    "stream": lambda *a, **k: contextlib.nullcontext(),
    "memory_allocated": lambda *a, **k: 0,
    "max_memory_allocated": lambda *a, **k: 0,
    "memory_reserved": lambda *a, **k: 0,
    "max_memory_reserved": lambda *a, **k: 0,
    "memory_stats": lambda *a, **k: {},
    "reset_peak_memory_stats": lambda *a, **k: None,
    "get_device_capability": lambda *a, **k: tuple(_CAPABILITY),
    "get_device_name": lambda *a, **k: _Props.name,
    "get_device_properties": lambda *a, **k: _Props(),
}


def _cpu_device(d):
    if isinstance(d, str) and d.startswith("cuda"):
        return _CPU
    if isinstance(d, torch.device) and d.type == "cuda":
        return _CPU
    if isinstance(d, int) and not isinstance(d, bool):
        return _CPU
    return d


class CudaToCpu(TorchFunctionMode):
    """Rewrites `device='cuda'` (and integer device indices) to the CPU; drops `pin_memory`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):  # host-to-device staging (RoPE's CP index); no device here
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to:
            args = tuple(
                _cpu_device(a) if isinstance(a, (str, torch.device)) else a for a in args
            )
        return func(*args, **kwargs)


_orig_tensor_type = torch.Tensor.type


def _tensor_type(self, dtype=None, non_blocking=False, **kw):
    # megatron compares `tensor.type()` with 'torch.cuda.FloatTensor' and friends
    if dtype is None:
        name = _orig_tensor_type(self)
        return name if name.startswith("torch.cuda") else name.replace("torch.", "torch.cuda.", 1)
    return _orig_tensor_type(self, dtype, non_blocking, **kw)


_INSTALLED = False
# A real GPU (and no UCP_CPU_SHIM=1): the shim stays out of the way and tests run on CUDA.
REAL_CUDA = has_real_cuda()


def install() -> None:
    """Install the shim (idempotent). Importing this module installs it, unless a GPU is present."""
    global _INSTALLED
    if _INSTALLED or REAL_CUDA:
        return
    for name, fn in _cuda_api.items():
        setattr(torch.cuda, name, fn)
    import torch.cuda.random as cuda_random

    cuda_random.get_rng_state = _get_rng_state
    cuda_random.set_rng_state = _set_rng_state
    cuda_random.manual_seed = _manual_seed
    cuda_random.manual_seed_all = torch.cuda.manual_seed_all
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.type = _tensor_type
    # A CUDA build of torch (Python 3.12's wheel from the index) on a host without a driver: its
    # optimizers ask torch.accelerator for the current stream (graph-capture check), which would
    # initialise CUDA. The CPU build answers None here; so does the shim.
    torch.accelerator.current_accelerator = lambda *a, **k: None
    CudaToCpu().__enter__()
    _INSTALLED = True
    try:
        import grouped_gemm  # noqa: F401  (the real CUDA library, if someone has it)
    except ImportError:
        from megatron_ucp.testing import grouped_gemm_cpu

        grouped_gemm_cpu.install()
    _patch_megatron_plumbing()


def _patch_megatron_plumbing() -> None:
    # megatron-core 0.16.1 moe_utils defines te_general_gemm only when TE imports, yet the router
    # tests it unconditionally; None selects the plain torch path meant for "no TE".
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not getattr(moe_utils, "HAVE_TE", False) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


install()
