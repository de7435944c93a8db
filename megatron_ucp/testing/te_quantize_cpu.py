"""Pure-torch stand-ins for the Transformer Engine 2.20 kernels of FP8 parameters (`fp8_param=True`,
Megatron-LM `--fp8-param-gather`) with delayed scaling (`Float8Quantizer`) and current scaling
(`Float8CurrentScalingQuantizer`, megatron's `fp8_recipe="tensorwise"`), for CPU-only hosts (test
code only: `te_cpu.install_quantize_stand_ins` installs them; megatron_ucp itself never does).

What each replaces (TE 2.20.2; the CUDA kernels need a GPU):
- `transformer_engine_torch.quantize(tensor, quantizer, output=None, noop_flag=None)`
  (csrc/extensions/cast.cpp `quantize`, csrc/quantizer.cpp `Float8Quantizer::create_tensor`,
  `convert_and_update_tensor`, `quantize` -> `nvte_quantize_v2`), for a `Float8Quantizer` only
  (MXFP8 goes to te_mxfp8_cpu; block scaling and NVFP4 quantizers to TE's own function):
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
  * `noop_flag` (a tensor, 1 = skip) honoured as the kernel does;
  * a Float8Quantizer whose `amax` is empty (`torch.Tensor()`, as TE's current-scaling partial
    cast builds one) gets no amax update: the C++ side then passes no amax pointer to the kernel.
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
- `transformer_engine_torch.quantize` for a `Float8CurrentScalingQuantizer`
  (csrc/quantizer.cpp `Float8CurrentScalingQuantizer::create_tensor` / `convert_and_update_tensor`
  / `quantize_impl`): the quantizer's own amax and scale are C++ buffers (TE 2.20's Python
  quantizer holds none), so here they are local tensors:
  * buffers as for a Float8Quantizer above (`_scale_inv` fp32 [1]);
  * `nvte_compute_amax_with_config` (common/recipe/current_scaling.cu `amax_kernel`): amax zeroed,
    then max |x| over the tensor in x's dtype (`__hmax(__habs(x))` for bf16/fp16, `fmaxf(fabsf)` for
    fp32: exact in any dtype, NaN ignored);
  * with `with_amax_reduction`: the amax all-reduced (MAX) over `amax_reduction_group`;
  * `nvte_compute_scale_from_amax` (common/recipe/recipe_common.cuh `compute_scale_from_amax`,
    `compute_scale_from_amax_reference` below) with the quantizer's `force_pow_2_scales` and
    `amax_epsilon`, value_for_inf = FLT_MAX, max_fp8 = 448 (E4M3) / 57344 (E5M2);
  * the cast (`nvte_quantize_v2` with no amax pointer: "avoid atomic amax updates"): the bytes and
    `scale_inv` = 1 / scale as for a Float8Quantizer above;
  * `noop_flag` (1 = skip) skips amax, scale and cast (each kernel checks it).
- `transformer_engine_torch.compute_amax(input, amax)` (csrc/extensions/recipe.cpp ->
  `nvte_compute_amax`): the amax above written into `amax` (fp32 [1]); TE's current-scaling
  `cast_master_weights_to_fp8` calls it on each rank's master shard.
- `transformer_engine_torch.multi_tensor_compute_scale_and_scale_inv` as bound in
  `transformer_engine.pytorch.tensor.utils` (common/multi_tensor/compute_scale.cu
  `ComputeScaleAndScaleInvFunctor`): for each (amax, scale, scale_inv) triple, scale =
  compute_scale_from_amax(amax, max_fp8, force_pow_2_scales, epsilon, FLT_MAX) and scale_inv =
  `reciprocal` (`__frcp_rn`: IEEE round-to-nearest 1/x, what torch.reciprocal gives in fp32); the
  noop flag is not read (the kernel propagates inf/NaN).
These are what `megatron.core.fp8_utils.quantize_param_shard` -> TE
`cast_master_weights_to_fp8` (`_cast_master_weights_to_fp8_delayed_scaling` and
`_cast_master_weights_to_fp8_current_scaling`: per-shard amax, MAX all-reduce over the DP group,
scales, then a Float8Quantizer partial cast of the shard into the weight's bytes) and building a
`fp8_param` model (`TransformerEngineBaseModule.reset_parameters`: `quantizer(param)`) call.
MXFP8 (`MXFP8Quantizer`) has its stand-ins in `te_mxfp8_cpu` (installed with these); block scaling
and NVFP4 keep TE's kernels (not stood in).
"""

from __future__ import annotations

import torch

from megatron_ucp.testing.te_fp8_cast_cpu import _max_fp8, _torch_fp8_dtype, cast_to_fp8_bytes  # noqa: F401

_ORIGINAL: dict = {}
FLT_MAX = torch.finfo(torch.float32).max


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
        if quantizer.amax.numel():  # (an empty amax: no amax pointer, no update)
            amax = abs_max(x).reshape(quantizer.amax.shape)
            quantizer.amax.copy_(torch.maximum(quantizer.amax, amax))
        output._scale_inv.copy_(torch.reciprocal(quantizer.scale).reshape(output._scale_inv.shape))
        raw = cast_to_fp8_bytes(x, quantizer.scale, quantizer.dtype)
        if output._data is not None:
            output._data.copy_(raw.reshape(output._data.shape))
        if output._transpose is not None:
            output._transpose.copy_(_transpose_bytes(raw.reshape(shape)))
    return output


def _empty_float8(quantizer, shape: list, dtype: torch.dtype, device, scale_inv=None):
    """A Float8Tensor (Float8TensorStorage for an internal quantizer) with buffers as TE creates
    them, uninitialised (scale_inv: 1 / the quantizer's scale unless given)."""
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

    non_tn = _non_tn_supported()
    data = (torch.empty(shape, dtype=torch.uint8, device=device)
            if quantizer.rowwise_usage or non_tn else None)
    transpose = (torch.empty(_transpose_shape(shape), dtype=torch.uint8, device=device)
                 if quantizer.columnwise_usage and not non_tn else None)
    if scale_inv is None:
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


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a fp32 scalar, NaN ignored (`fmaxf` / `__hmax`); 0 for an empty tensor."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32)
    a = x.detach().abs()
    return torch.where(torch.isnan(a), torch.zeros((), dtype=a.dtype), a).amax().float()


def compute_scale_from_amax_reference(amax: torch.Tensor, max_fp8: float, force_pow_2_scales: bool,
                                      epsilon: float) -> torch.Tensor:
    """TE's `compute_scale_from_amax` (recipe_common.cuh), elementwise on a fp32 tensor:
    amax < epsilon -> epsilon; inf, 0 or NaN amax -> scale 1; else max_fp8 / amax (`__fdiv_rn`,
    IEEE fp32 division), an infinite quotient -> FLT_MAX; force_pow_2_scales keeps only the
    sign and exponent bits (`bits & 0xFF800000`)."""
    amax = amax.float()
    amax = torch.where(amax < epsilon, torch.full_like(amax, epsilon), amax)
    scale = torch.full_like(amax, max_fp8) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FLT_MAX), scale)
    if force_pow_2_scales:
        bits = scale.view(torch.int32) & torch.tensor(0xFF800000 - 2**32, dtype=torch.int32)
        scale = bits.view(torch.float32)
    one = torch.ones_like(scale)
    return torch.where(torch.isinf(amax) | (amax == 0) | torch.isnan(amax), one, scale)


def compute_amax(tensor: torch.Tensor, amax: torch.Tensor) -> None:
    """`tex.compute_amax` (`nvte_compute_amax`), see the module docstring."""
    with torch.no_grad():
        amax.copy_(abs_max(tensor).reshape(amax.shape))


def multi_tensor_compute_scale_and_scale_inv(chunk_size, noop_flag, tensor_lists, max_fp8,
                                             force_pow_2_scales=False, epsilon=0.0):
    """`tex.multi_tensor_compute_scale_and_scale_inv`, see the module docstring."""
    del chunk_size, noop_flag
    with torch.no_grad():
        for amax, scale, scale_inv in zip(*tensor_lists):
            s = compute_scale_from_amax_reference(amax, max_fp8, force_pow_2_scales, epsilon)
            scale.copy_(s.reshape(scale.shape))
            scale_inv.copy_(torch.reciprocal(s).reshape(scale_inv.shape))


def current_scaling_quantize(tensor: torch.Tensor, quantizer, output=None, noop_flag=None):
    """`tex.quantize` for a Float8CurrentScalingQuantizer, see the module docstring."""
    import torch.distributed as dist
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer, Float8Tensor

    x = tensor.contiguous()
    if output is None:
        output = _empty_float8(quantizer, list(x.shape), x.dtype, x.device,
                               scale_inv=torch.empty(1, dtype=torch.float32, device=x.device))
    elif not isinstance(output, Float8Tensor) and not hasattr(output, "_scale_inv"):
        raise ValueError("Float8CurrentScalingQuantizer must output to Float8Tensor.")
    if x.numel() == 0:
        return output
    if noop_flag is not None and float(noop_flag.reshape(-1)[0]) == 1.0:
        return output
    with torch.no_grad():
        amax = abs_max(x).reshape(1).clone()
        if quantizer.with_amax_reduction:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=quantizer.amax_reduction_group)
        scale = compute_scale_from_amax_reference(amax, _max_fp8(quantizer.dtype),
                                                  quantizer.force_pow_2_scales,
                                                  quantizer.amax_epsilon)
    # the cast itself: a Float8Quantizer with that scale and no amax (what the kernel then does)
    cast = Float8Quantizer(scale=scale, amax=torch.Tensor(), fp8_dtype=quantizer.dtype,
                           rowwise=quantizer.rowwise_usage, columnwise=quantizer.columnwise_usage)
    return float8_quantize(x, cast, output, None)


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
    from transformer_engine.pytorch.tensor.float8_tensor import (
        Float8CurrentScalingQuantizer,
        Float8Quantizer,
    )

    if type(quantizer) is Float8Quantizer:
        return float8_quantize(tensor, quantizer, output, noop_flag)
    if type(quantizer) is Float8CurrentScalingQuantizer:
        return current_scaling_quantize(tensor, quantizer, output, noop_flag)
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

    if type(quantizer) is MXFP8Quantizer:
        from megatron_ucp.testing import te_mxfp8_cpu

        return te_mxfp8_cpu.mxfp8_quantize(tensor, quantizer, output, noop_flag)
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
        _ORIGINAL["compute_amax"] = tex.compute_amax
        _ORIGINAL["multi_tensor_compute_scale_and_scale_inv"] = (
            te_utils.multi_tensor_compute_scale_and_scale_inv)
    tex.quantize = quantize
    tex.compute_amax = compute_amax
    te_utils.multi_tensor_compute_scale_and_scale_inv = multi_tensor_compute_scale_and_scale_inv
    tex.create_empty_quantized_tensor = create_empty_quantized_tensor
    tex.fp8_transpose = fp8_transpose
    te_utils.multi_tensor_scale = multi_tensor_scale
    from megatron_ucp.testing import te_mxfp8_cpu

    te_mxfp8_cpu.install()
