"""Pure-torch stand-ins for the Transformer Engine 2.20 kernels of FP8 parameters (`fp8_param=True`,
Megatron-LM `--fp8-param-gather`) with delayed scaling, for CPU-only hosts (test code only:
`te_cpu.install_quantize_stand_ins` installs them; megatron_ucp itself never does).

What each replaces (TE 2.20.2; the CUDA kernels need a GPU):
- `transformer_engine_torch.quantize(tensor, quantizer, output=None, noop_flag=None)`
  (csrc/extensions/cast.cpp `quantize`, csrc/quantizer.cpp `Float8Quantizer::create_tensor`,
  `convert_and_update_tensor`, `quantize` -> `nvte_quantize_v2`), for a `Float8Quantizer` only
  (every other quantizer goes on to TE's own function):
  * output buffers as TE creates them: `_data` uint8 when rowwise usage (or non-TN FP8 GEMMs,
    compute capability 10.x / >= 13), `_transpose` uint8 [last, rest...] when columnwise usage and
    TN-only GEMMs (Hopper: what the CPU shim reports), `_scale_inv` = reciprocal(scale) (fp32 [1]);
  * the kernel (common/util/vectorized_pointwise.h `unary_kernel`): amax of |x| in fp32 (`fmaxf`:
    NaN ignored) max-accumulated into `quantizer.amax` (`atomicMaxFloat` on the amax pointer),
    `scale_inv` = 1 / scale, every element `fp8(float(x) * scale)` with the CUDA conversion
    `__nv_fp8_e4m3` / `__nv_fp8_e5m2` (`__NV_SATFINITE`, round to nearest even):
    torch's `.to(float8_e4m3fn / float8_e5m2)` rounds to nearest even too, but gives NaN (e4m3) /
    inf (e5m2) past the format's max, so the product is clamped to +-max first (NaN stays NaN; the
    NaN byte pattern itself is torch's, not checked against CUDA's);
  * `noop_flag` (a tensor, 1 = skip) honoured as the kernel does.
- `transformer_engine_torch.create_empty_quantized_tensor(quantizer, shape, dtype, device, pin)`
  (`Quantizer.make_empty`; FusedAdam's fp8 moments, `--exp-avg-dtype fp8`): a Float8Quantizer's
  uninitialised Float8Tensor with the buffers above, on the host;
- `transformer_engine_torch.fp8_transpose(input, dtype, out=None)` (csrc/extensions/transpose.cpp,
  `nvte_transpose`): the bytes viewed as [M = numel / last, N = last] written transposed, [N, M],
  into `out` (shape [last, rest...] when created); called by `Float8TensorStorage._create_transpose`
  (TE's `post_all_gather_processing` after DDP's param all-gather on TN-only GPUs).
- `transformer_engine_torch.multi_tensor_scale` as bound in `transformer_engine.pytorch.tensor.utils`
  (csrc multi_tensor/scale.cu): out[i] = in[i] * scale for each pair of lists, in fp32, into the
  output's dtype; the noop flag set when a non-finite value is met (TE's overflow check).
These are what `megatron.core.fp8_utils.quantize_param_shard` -> TE
`cast_master_weights_to_fp8` (`_cast_master_weights_to_fp8_delayed_scaling`) and building a
`fp8_param` model (`TransformerEngineBaseModule.reset_parameters`: `quantizer(param)`) call for a
`Float8Quantizer`. Current scaling, block scaling, MXFP8 and NVFP4 keep TE's kernels (not stood in).
"""

from __future__ import annotations

import torch

_ORIGINAL: dict = {}


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


def _non_tn_supported() -> bool:
    from transformer_engine.pytorch.utils import is_non_tn_fp8_gemm_supported

    return is_non_tn_fp8_gemm_supported()


def _transpose_shape(shape) -> list:
    shape = list(shape)
    return [shape[-1], *shape[:-1]] if shape else []


def _transpose_bytes(data: torch.Tensor) -> torch.Tensor:
    if data.dim() < 2:
        return data.clone()
    return data.reshape(-1, data.shape[-1]).t().contiguous().reshape(_transpose_shape(data.shape))


def float8_quantize(tensor: torch.Tensor, quantizer, output=None, noop_flag=None):
    """`tex.quantize` for a Float8Quantizer (delayed scaling), see the module docstring."""
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

    x = tensor.contiguous()
    non_tn = _non_tn_supported()
    need_data = quantizer.rowwise_usage or non_tn
    need_transpose = quantizer.columnwise_usage and not non_tn
    if output is None:
        shape = list(x.shape)
        output = _empty_float8(quantizer, shape, x.dtype, x.device)
    else:
        if not isinstance(output, Float8Tensor) and not hasattr(output, "_scale_inv"):
            raise ValueError("Float8Quantizer must output to Float8Tensor.")
        shape = list(output._data.shape if output._data is not None
                     else [*output._transpose.shape[1:], output._transpose.shape[0]])
        if output._data is not None and not need_data:
            output._data = None
        elif output._data is None and need_data:
            output._data = torch.empty(shape, dtype=torch.uint8, device=x.device)
        if output._transpose is not None and not need_transpose:
            output._transpose = None
        elif output._transpose is None and need_transpose:
            output._transpose = torch.empty(_transpose_shape(shape), dtype=torch.uint8, device=x.device)
        output._transpose_invalid = not need_transpose
        output._fp8_dtype = quantizer.dtype
    if x.numel() == 0:
        return output
    if noop_flag is not None and float(noop_flag.reshape(-1)[0]) == 1.0:
        return output
    with torch.no_grad():
        a = x.float().abs()
        amax = torch.where(torch.isnan(a), 0.0, a).amax().reshape(quantizer.amax.shape)  # fmaxf
        quantizer.amax.copy_(torch.maximum(quantizer.amax, amax))
        output._scale_inv.copy_(torch.reciprocal(quantizer.scale).reshape(output._scale_inv.shape))
        raw = cast_to_fp8_bytes(x, quantizer.scale, quantizer.dtype)
        if output._data is not None:
            output._data.copy_(raw.reshape(output._data.shape))
        if output._transpose is not None:
            output._transpose.copy_(_transpose_bytes(raw.reshape(shape)))
    return output


def _empty_float8(quantizer, shape: list, dtype: torch.dtype, device):
    """A Float8Tensor (Float8TensorStorage for an internal quantizer) with buffers as TE creates
    them, uninitialised."""
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

    non_tn = _non_tn_supported()
    data = (torch.empty(shape, dtype=torch.uint8, device=device)
            if quantizer.rowwise_usage or non_tn else None)
    transpose = (torch.empty(_transpose_shape(shape), dtype=torch.uint8, device=device)
                 if quantizer.columnwise_usage and not non_tn else None)
    scale_inv = torch.reciprocal(quantizer.scale)
    if quantizer.internal:
        from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import (
            Float8TensorStorage,
        )

        return Float8TensorStorage(data=data, fp8_scale_inv=scale_inv, fp8_dtype=quantizer.dtype,
                                   data_transpose=transpose, quantizer=quantizer, fake_dtype=dtype)
    return Float8Tensor(shape=shape, dtype=dtype, data=data, fp8_scale_inv=scale_inv,
                        fp8_dtype=quantizer.dtype, data_transpose=transpose, quantizer=quantizer,
                        device=device)


def create_empty_quantized_tensor(quantizer, shape, dtype, device, pin_memory=False):
    """`tex.create_empty_quantized_tensor` (`Quantizer.make_empty`): the stand-in for a
    Float8Quantizer (on the host), TE's own function for the others."""
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    if type(quantizer) is Float8Quantizer:
        return _empty_float8(quantizer, list(shape), dtype, torch.device("cpu"))
    return _ORIGINAL["create_empty_quantized_tensor"](quantizer, shape, dtype, device, pin_memory)


def fp8_transpose(tensor: torch.Tensor, otype, out=None):
    """`tex.fp8_transpose`, see the module docstring."""
    del otype
    shape = list(tensor.shape)
    if out is None:
        out = torch.empty(_transpose_shape(shape), dtype=torch.uint8, device=tensor.device)
    if tensor.numel() == 0:
        return out
    n = shape[-1] if shape else 1
    with torch.no_grad():
        out.view(torch.uint8).reshape(n, -1).copy_(tensor.view(torch.uint8).reshape(-1, n).t())
    return out


def quantize(tensor, quantizer, output=None, noop_flag=None):
    """`tex.quantize`: the stand-in for a Float8Quantizer, TE's own function for the others."""
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    if type(quantizer) is Float8Quantizer:
        return float8_quantize(tensor, quantizer, output, noop_flag)
    return _ORIGINAL["quantize"](tensor, quantizer, output, noop_flag)


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """`tex.multi_tensor_scale`: out = in * scale elementwise (fp32 math), per pair of the lists."""
    del chunk_size
    with torch.no_grad():
        for src, dst in zip(tensor_lists[0], tensor_lists[1]):
            v = src.float() * scale
            if not torch.isfinite(v).all():
                noop_flag.fill_(1)
            dst.copy_(v.to(dst.dtype))


def install() -> None:
    """Put the stand-ins where TE's Python looks them up (idempotent)."""
    import transformer_engine.pytorch.tensor.utils as te_utils
    import transformer_engine_torch as tex

    if "quantize" not in _ORIGINAL:
        _ORIGINAL["quantize"] = tex.quantize
        _ORIGINAL["multi_tensor_scale"] = te_utils.multi_tensor_scale
        _ORIGINAL["fp8_transpose"] = tex.fp8_transpose
        _ORIGINAL["create_empty_quantized_tensor"] = tex.create_empty_quantized_tensor
    tex.quantize = quantize
    tex.create_empty_quantized_tensor = create_empty_quantized_tensor
    tex.fp8_transpose = fp8_transpose
    te_utils.multi_tensor_scale = multi_tensor_scale
