"""Is there a real CUDA device? Asked without installing the CPU shim (which makes
`torch.cuda.is_available()` true for the whole process), so test modules can decide at import."""

from __future__ import annotations

import os

import torch


def has_real_cuda() -> bool:
    """A CUDA device that the shim is not told to hide (UCP_CPU_SHIM=1). torch's C extension
    is asked, since the shim replaces `torch.cuda`'s Python functions once installed."""
    if os.environ.get("UCP_CPU_SHIM") == "1":
        return False
    count = getattr(torch._C, "_cuda_getDeviceCount", None)  # absent from CPU builds of torch
    return bool(count is not None and count() > 0)
