"""Pure-torch stand-ins for the Transformer Engine 2.20 MXFP8 kernels of FP8 parameters
(`fp8_param=True` with megatron's `fp8_recipe="mxfp8"`, TE's `MXFP8Quantizer`: blocks of 32
elements, one E8M0 scale per block, a rowwise copy with 1x32 blocks and a columnwise copy with 32x1
blocks, both in the tensor's own [M, K] layout), for CPU-only hosts (test code only:
`te_quantize_cpu.install` installs them; megatron_ucp itself never does).

What each replaces (TE 2.20.2; the CUDA kernels need a GPU, and TE refuses MXFP8 below compute
capability 10.0: `cpu_shim.set_compute_capability(10, 0)` in the scenarios that use it):
- `float_to_e8m0` (common/util/ptx.cuh `ptx::float_to_e8m0`; on compute capability 10.x
  `cvt.rp.satfinite.ue8m0x2.f32`, elsewhere the integer code it documents as equal): the biased
  exponent of a non-negative fp32 value rounded up to a power of two (a non-zero mantissa adds
  one, except at 0xFE (saturated) and for subnormals <= 2^-127, which stay 0); NaN -> 0xFF,
  inf -> 0xFE, 0 -> 0.
- `exp2f_rcp` (`ptx::exp2f_rcp`): the fp32 2^(127 - e) as bits `(254 - e) << 23`; e = 0 -> 1.
- `transformer_engine_torch.quantize(tensor, MXFP8Quantizer, output=None, noop_flag=None)`
  (csrc/quantizer.cpp `MXFP8Quantizer::create_tensor` / `convert_and_update_tensor` / `quantize`
  -> `nvte_quantize_v2`, common/cast/mxfp8 `quantize_mxfp8`), for compact (unswizzled) scales:
  * buffers: `_rowwise_data` / `_columnwise_data` uint8 [M, K] (the tensor's shape, flattened to
    M = prod(shape[:-1]) rows), `_rowwise_scale_inv` uint8 [roundup(M, 128), roundup(K / 32, 4)],
    `_columnwise_scale_inv` uint8 [roundup(M / 32, 4), roundup(K, 128)] (`get_scale_shape`);
    TE allocates the scales uninitialised (`at::empty`) and its kernel writes only the
    [M, K / 32] / [M / 32, K] blocks: a new tensor's padding is 0 here, an existing one's is kept;
  * per block: amax = max |x| (fp32), e = float_to_e8m0(amax * (1 / max_norm)) (`max_norm_rcp`,
    the fp32 of 1/448 for E4M3, 1/57344 for E5M2), every element `fp8(float(x) * exp2f_rcp(e))`
    saturating, round to nearest even (`te_quantize_cpu.cast_to_fp8_bytes` with scale 1);
  * quantizers with `optimize_for_gemm` (GEMM-swizzled scales, `with_gemm_swizzled_scales`):
    refused (NotImplementedError): TE's swizzled layout (common/cast/mxfp8/swizzle.cuh) is not
    reproduced here; FP8 primary weights never use it (`_enable_weight_preswizzle` is False for
    `primary_weights_in_fp8`).
- `transformer_engine_torch.mxfp8_scaling_compute_partial_amax(input, amax_rowwise, amax_colwise,
  rows, cols, start_offset)` (common/recipe/mxfp8_scaling.cu): for the flat shard `input` of a
  [rows, cols] weight starting at `start_offset`, each block's amax over the shard's elements (0
  outside it) in the amax buffers' dtype (the model dtype), written into their [rows, cols / 32]
  / [rows / 32, cols] blocks (the padding stays as the caller zeroed it).
- `transformer_engine_torch.multi_tensor_compute_scale_inv_e8m0` as bound in
  `transformer_engine.pytorch.tensor.utils` (common/multi_tensor/compute_scale.cu
  `ComputeScaleInvE8M0Functor`): scale_inv = float_to_e8m0(float(amax) * (1 / 448)) for every
  element of each (bf16 amax, uint8 scale_inv) pair, padding included.
- `transformer_engine_torch.mxfp8_scaling_partial_cast(input, output_rowwise, output_colwise,
  scale_inv_rowwise, scale_inv_colwise, rows, cols, start_offset)`: each shard element cast to
  E4M3 with its rowwise and its columnwise block's exp2f_rcp(scale_inv), into the two flat
  output fragments.
- `transformer_engine_torch.dequantize` of an MXFP8 tensor as TE 2.20's
  `_FromMXFP8Func.forward` calls it (it moves a host tensor to CUDA first;
  common/cast/mxfp8/dequantize_mxfp8.cuh): the rowwise copy (the columnwise one without it),
  every byte's fp8 value times its block's 2^(e - 127) (`ptx::exp2f`) in fp32, then the
  requested dtype (round to nearest even); used when megatron-core builds the fp32 masters.
These are what building a `fp8_param` model (`quantizer(param)`), megatron-core's param sync with
`reuse_grad_buf_for_mxfp8_param_ag` (`_post_param_sync` -> `copy_tensor_to_quantized_param` ->
the quantize above) and TE's `cast_master_weights_to_fp8` for MXFP8
(`_cast_master_weights_to_fp8_mxfp8_scaling`) call.
"""

from __future__ import annotations

import torch

BLOCK = 32  # MXFP8_BLOCK_SCALING_SIZE


def _roundup(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def max_norm_rcp(te_dtype) -> torch.Tensor:
    """`Quantized_Limits<T>::max_norm_rcp`: the fp32 of 1 / max_norm (a double, then fp32)."""
    from megatron_ucp.testing.te_fp8_cast_cpu import _max_fp8

    return torch.tensor(1.0 / _max_fp8(te_dtype), dtype=torch.float32)


def float_to_e8m0(v: torch.Tensor) -> torch.Tensor:
    """`ptx::float_to_e8m0` of a non-negative fp32 tensor, as uint8 (see the module docstring)."""
    v = v.float()
    bits = v.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    e = exponent + up.to(torch.int32)
    e = torch.where(v == 0, torch.zeros_like(e), e)
    e = torch.where(torch.isinf(v), torch.full_like(e, 0xFE), e)
    e = torch.where(torch.isnan(v), torch.full_like(e, 0xFF), e)
    return e.to(torch.uint8)


def exp2f_rcp(e: torch.Tensor) -> torch.Tensor:
    """`ptx::exp2f_rcp` of uint8 biased exponents: 2^(127 - e) as fp32 (e = 0 -> 1)."""
    e = e.to(torch.int32)
    r = ((254 - e) << 23).view(torch.float32)
    return torch.where(e == 0, torch.ones_like(r), r)


def block_scales(x2d: torch.Tensor, te_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(rowwise e8m0 [M, K/32], columnwise e8m0 [M/32, K]) of a [M, K] tensor: TE's block amax
    (NaN ignored) times max_norm_rcp, through float_to_e8m0."""
    a = x2d.detach().float().abs()
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    m, k = a.shape
    row = a.reshape(m, k // BLOCK, BLOCK).amax(-1)
    col = a.reshape(m // BLOCK, BLOCK, k).amax(1)
    rcp = max_norm_rcp(te_dtype)
    return float_to_e8m0(row * rcp), float_to_e8m0(col * rcp)


def _cast(x: torch.Tensor, scale: torch.Tensor, te_dtype) -> torch.Tensor:
    from megatron_ucp.testing.te_fp8_cast_cpu import cast_to_fp8_bytes

    return cast_to_fp8_bytes(x.float() * scale, torch.ones(1), te_dtype)


def quantize_2d(x2d: torch.Tensor, te_dtype) -> dict[str, torch.Tensor]:
    """TE's MXFP8 quantize of a [M, K] tensor: {"rowwise_data", "rowwise_e8m0" [M, K/32],
    "columnwise_data", "columnwise_e8m0" [M/32, K]} (unpadded scales)."""
    row_e, col_e = block_scales(x2d, te_dtype)
    row_s = exp2f_rcp(row_e).repeat_interleave(BLOCK, dim=1)
    col_s = exp2f_rcp(col_e).repeat_interleave(BLOCK, dim=0)
    return {"rowwise_data": _cast(x2d, row_s, te_dtype), "rowwise_e8m0": row_e,
            "columnwise_data": _cast(x2d, col_s, te_dtype), "columnwise_e8m0": col_e}


def scale_shape(shape, columnwise: bool) -> tuple[int, int]:
    m, k = _flat_2d(shape)
    if columnwise:
        return _roundup(m // BLOCK, 4), _roundup(k, 128)
    return _roundup(m, 128), _roundup(k // BLOCK, 4)


def _flat_2d(shape) -> tuple[int, int]:
    shape = list(shape)
    k = shape[-1] if shape else 1
    m = 1
    for s in shape[:-1]:
        m *= s
    return m, k


def mxfp8_quantize(tensor: torch.Tensor, quantizer, output=None, noop_flag=None):
    """`tex.quantize` for an MXFP8Quantizer, see the module docstring."""
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Tensor

    if getattr(quantizer, "optimize_for_gemm", False):
        raise NotImplementedError("te_mxfp8_cpu: GEMM-swizzled MXFP8 scales (optimize_for_gemm) "
                                  "have no CPU stand-in")
    x = tensor.contiguous()
    shape = list(x.shape)
    m, k = _flat_2d(shape)
    if m % BLOCK or k % BLOCK:
        raise ValueError(f"MXFP8 requires tensor dims that are divisible by {BLOCK} (got shape="
                         f"{shape})")
    if output is None:
        def new(usage, columnwise):
            if not usage:
                return None, None
            return (torch.empty(shape, dtype=torch.uint8, device=x.device),
                    torch.zeros(scale_shape(shape, columnwise), dtype=torch.uint8, device=x.device))

        rd, rs = new(quantizer.rowwise_usage, False)
        cd, cs = new(quantizer.columnwise_usage, True)
        kwargs = dict(rowwise_data=rd, rowwise_scale_inv=rs, columnwise_data=cd,
                      columnwise_scale_inv=cs, fp8_dtype=quantizer.dtype, quantizer=quantizer,
                      with_gemm_swizzled_scales=False)
        if quantizer.internal:
            from transformer_engine.pytorch.tensor.storage.mxfp8_tensor_storage import (
                MXFP8TensorStorage,
            )

            output = MXFP8TensorStorage(**kwargs, fake_dtype=x.dtype)
        else:
            output = MXFP8Tensor(shape=shape, dtype=x.dtype, device=x.device, **kwargs)
    else:
        _coerce(output, quantizer, shape, x.device)
    if x.numel() == 0 or (noop_flag is not None and float(noop_flag.reshape(-1)[0]) == 1.0):
        return output
    with torch.no_grad():
        q = quantize_2d(x.reshape(m, k), quantizer.dtype)
        if output._rowwise_data is not None:
            output._rowwise_data.copy_(q["rowwise_data"].reshape(output._rowwise_data.shape))
            output._rowwise_scale_inv[:m, :k // BLOCK].copy_(q["rowwise_e8m0"])
        if output._columnwise_data is not None:
            output._columnwise_data.copy_(q["columnwise_data"].reshape(output._columnwise_data.shape))
            output._columnwise_scale_inv[:m // BLOCK, :k].copy_(q["columnwise_e8m0"])
    return output


def _coerce(output, quantizer, shape: list, device) -> None:
    """`MXFP8Quantizer::convert_and_update_tensor`: the buffers the quantizer's usages need."""
    if not hasattr(output, "_rowwise_scale_inv"):
        raise ValueError("MXFP8Quantizer must output to MXFP8Tensor.")
    for usage, data, scale, columnwise in ((quantizer.rowwise_usage, "_rowwise_data",
                                            "_rowwise_scale_inv", False),
                                           (quantizer.columnwise_usage, "_columnwise_data",
                                            "_columnwise_scale_inv", True)):
        if usage:
            if getattr(output, data) is None:
                setattr(output, data, torch.empty(shape, dtype=torch.uint8, device=device))
            if getattr(output, scale) is None:
                setattr(output, scale, torch.empty(scale_shape(shape, columnwise),
                                                   dtype=torch.uint8, device=device))
        else:
            setattr(output, data, None)
            setattr(output, scale, None)
    output._fp8_dtype = quantizer.dtype


def _shard_2d(master: torch.Tensor, rows: int, cols: int, start_offset: int):
    """The shard in a zero [rows, cols] tensor of its dtype, and the mask of its elements."""
    n = master.numel()
    full = torch.zeros(rows * cols, dtype=master.dtype, device=master.device)
    full[start_offset:start_offset + n] = master.reshape(-1)
    mask = torch.zeros(rows * cols, dtype=torch.bool, device=master.device)
    mask[start_offset:start_offset + n] = True
    return full.reshape(rows, cols), mask.reshape(rows, cols)


def mxfp8_scaling_compute_partial_amax(master, amax_rowwise, amax_colwise, rows, cols,
                                       start_offset):
    """`tex.mxfp8_scaling_compute_partial_amax`, see the module docstring."""
    if rows % BLOCK or cols % BLOCK:
        raise ValueError("rows and cols must be divisible by 32")
    with torch.no_grad():
        full, _ = _shard_2d(master, rows, cols, start_offset)
        a = full.float().abs()
        a = torch.where(torch.isnan(a), torch.zeros_like(a), a)  # fmaxf
        amax_rowwise[:rows, :cols // BLOCK].copy_(
            a.reshape(rows, cols // BLOCK, BLOCK).amax(-1).to(amax_rowwise.dtype))
        amax_colwise[:rows // BLOCK, :cols].copy_(
            a.reshape(rows // BLOCK, BLOCK, cols).amax(1).to(amax_colwise.dtype))


def multi_tensor_compute_scale_inv_e8m0(chunk_size, noop_flag, tensor_lists):
    """`tex.multi_tensor_compute_scale_inv_e8m0`, see the module docstring."""
    import transformer_engine_torch as tex

    del chunk_size, noop_flag
    rcp = max_norm_rcp(tex.DType.kFloat8E4M3)
    with torch.no_grad():
        for amax, scale_inv in zip(*tensor_lists):
            scale_inv.view(torch.uint8).copy_(float_to_e8m0(amax.float() * rcp))


def mxfp8_scaling_partial_cast(master, output_rowwise, output_colwise, scale_inv_rowwise,
                               scale_inv_colwise, rows, cols, start_offset):
    """`tex.mxfp8_scaling_partial_cast`, see the module docstring."""
    import transformer_engine_torch as tex

    if rows % BLOCK or cols % BLOCK:
        raise ValueError("rows and cols must be divisible by 32")
    n = master.numel()
    e4m3 = tex.DType.kFloat8E4M3
    with torch.no_grad():
        full, mask = _shard_2d(master, rows, cols, start_offset)
        row_s = exp2f_rcp(scale_inv_rowwise[:rows, :cols // BLOCK]).repeat_interleave(BLOCK, 1)
        col_s = exp2f_rcp(scale_inv_colwise[:rows // BLOCK, :cols]).repeat_interleave(BLOCK, 0)
        sel = mask.reshape(-1)
        output_rowwise.view(torch.uint8).reshape(-1)[:n].copy_(
            _cast(full, row_s, e4m3).reshape(-1)[sel])
        output_colwise.view(torch.uint8).reshape(-1)[:n].copy_(
            _cast(full, col_s, e4m3).reshape(-1)[sel])


def dequantize(tensor, dtype: torch.dtype) -> torch.Tensor:
    """`_FromMXFP8Func.forward` with TE's dequantize kernel on the host, see the module docstring."""
    from megatron_ucp.testing.te_fp8_cast_cpu import _torch_fp8_dtype

    if tensor._rowwise_data is None and tensor._columnwise_data is None:
        raise ValueError("Cannot dequantize MXFP8 tensor with no data")
    rowwise = tensor._rowwise_data is not None
    data = tensor._rowwise_data if rowwise else tensor._columnwise_data
    if data.numel() == 0:
        return torch.empty(tensor.size(), dtype=dtype, device=data.device)
    m, k = _flat_2d(data.shape)
    if rowwise:
        e = tensor._rowwise_scale_inv[:m, :k // BLOCK].to(torch.int32)
        scale = (e << 23).view(torch.float32).repeat_interleave(BLOCK, 1)
    else:
        e = tensor._columnwise_scale_inv[:m // BLOCK, :k].to(torch.int32)
        scale = (e << 23).view(torch.float32).repeat_interleave(BLOCK, 0)
    values = data.reshape(m, k).view(_torch_fp8_dtype(tensor._fp8_dtype)).float() * scale
    return values.to(dtype).reshape(tensor.size())


def _dequantize_forward(_ctx, tensor, dtype):
    return dequantize(tensor, dtype)


def install() -> None:
    """Put the stand-ins where TE's Python looks them up (`tex.quantize` dispatches MXFP8 here
    through `te_quantize_cpu.quantize`)."""
    import transformer_engine.pytorch.tensor.utils as te_utils
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.storage import mxfp8_tensor_storage

    mxfp8_tensor_storage._FromMXFP8Func.forward = staticmethod(_dequantize_forward)
    tex.mxfp8_scaling_compute_partial_amax = mxfp8_scaling_compute_partial_amax
    tex.mxfp8_scaling_partial_cast = mxfp8_scaling_partial_cast
    te_utils.multi_tensor_compute_scale_inv_e8m0 = multi_tensor_compute_scale_inv_e8m0
