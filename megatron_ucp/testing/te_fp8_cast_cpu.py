"""The FP8 cast every Transformer Engine quantize stand-in shares (test code only): TE's FP8 dtypes
as torch's, and the saturating cast of TE's kernels (`__nv_fp8_*` with `__NV_SATFINITE`, round to
nearest even). Used by `te_quantize_cpu` (delayed and current scaling) and `te_mxfp8_cpu`."""

from __future__ import annotations

import torch


def _torch_fp8_dtype(te_dtype) -> torch.dtype:
    import transformer_engine_torch as tex

    if te_dtype == tex.DType.kFloat8E4M3:
        return torch.float8_e4m3fn
    if te_dtype == tex.DType.kFloat8E5M2:
        return torch.float8_e5m2
    raise ValueError(f"not an FP8 dtype: {te_dtype}")


def cast_to_fp8_bytes(x: torch.Tensor, scale: torch.Tensor, te_dtype) -> torch.Tensor:
    """The bytes of TE's FP8 cast of `x` with `scale` (a [1] fp32 tensor): uint8, x's shape."""
    dt = _torch_fp8_dtype(te_dtype)
    fmax = torch.finfo(dt).max
    y = x.float() * scale.float().reshape(())
    return y.clamp(-fmax, fmax).to(dt).view(torch.uint8)


def _max_fp8(te_dtype) -> float:
    return float(torch.finfo(_torch_fp8_dtype(te_dtype)).max)  # 448 / 57344
