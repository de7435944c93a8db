"""Blockwise FP8 Hugging Face weights: DeepSeek-V3/R1's and Kimi-K2's official form, transformers'
`quant_method: "fp8"` (FineGrainedFP8Config).

config.json carries `quantization_config = {"activation_scheme": "dynamic", "fmt": "e4m3",
"quant_method": "fp8", "weight_block_size": [b0, b1]}`. Each quantized linear weight `W` of shape
[..., rows, cols] is F8_E4M3 with an fp32 companion `W_scale_inv` (for `<prefix>.weight`:
`<prefix>.weight_scale_inv`, transformers' Fp8Quantize name) of shape [..., ceil(rows / b0),
ceil(cols / b1)]; element (i, j) means `fp32(W[i, j]) * scale_inv[i // b0, j // b1]`. The last
blocks of a dimension that `b` does not divide are partial (DeepSeek-V3's kv_a_proj_with_mqa:
576 rows, 5 scale rows).

Import (`dequantize`): fp8 -> fp32 is exact, the product with the fp32 scale one fp32 rounding:
the value DeepSeek's `weight_dequant` and transformers' `Fp8Dequantize` compute in fp32.

Export (`quantize`): DeepSeek's own blockwise formula (inference/kernel.py `act_quant`):
`scale_inv = amax / 448` (fp32, amax over the block's elements), `W = e4m3(x / scale_inv)`.
transformers' Fp8Quantize computes `1 / (448 / amax)` and multiplies by `448 / amax`: two
roundings, one or two ulps off DeepSeek's scale for 36% of the fp32 amax values. DeepSeek's is
kept because it is idempotent: the amax of a dequantized block is `fl(448 * s)` (its element coded
448), and `fl(fl(448 * s) / 448) == s` for every scale `fl(a / 448)` (checked over all fp32
mantissas), so importing an FP8 directory and exporting it again writes the same bytes and scales;
transformers' formula does not give its own scale back for 12% of them (and DeepSeek's formula does
not give transformers' scale back for 9%: re-exporting a directory transformers quantized keeps its
FP8 bytes, a scale may move by one ulp).
An all-zero block gets scale 1 (as transformers'); non-finite weights are refused.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from megatron_ucp.errors import UCPError

FP8_DTYPE = torch.float8_e4m3fn
FP8_ST = "F8_E4M3"  # its safetensors name
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
DEFAULT_BLOCK = (128, 128)  # DeepSeek-V3's and transformers' default weight_block_size
SCALE_SUFFIX = "_scale_inv"  # "x.weight" -> "x.weight_scale_inv", as transformers names it
# the HF model dtypes a config.json may name for the weights left unquantized
# tensors of other FP8 schemes: static activation scales, per-tensor weight scales
OTHER_SCHEME_TENSORS = r"\.(activation_scale|input_scale|weight_scale)$"


def quantization_config(block: tuple[int, int]) -> dict:
    """config.json's quantization_config of an FP8 export: DeepSeek-V3's own."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": list(block)}


def scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The shape of the scale_inv of a weight of `shape`: one per block of its last two dims."""
    return (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))


@dataclass(frozen=True)
class Scheme:
    """A config.json's blockwise FP8 settings, checked."""

    block: tuple[int, int]
    config: dict  # quantization_config as given

    def record(self, tensors: int) -> dict:
        """The manifest's `hf_import.quantization` record."""
        return {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(self.block),
                "activation_scheme": "dynamic", "scale_fmt": self.config.get("scale_fmt", "float"),
                "fp8_tensors": tensors, "dequantized_to": "float32"}


def scheme_of(config: dict, where: str) -> Scheme | None:
    """The blockwise FP8 scheme of config.json `config` (None without quantization_config), or a
    UCPError naming the field that is not that scheme."""
    q = config.get("quantization_config")
    if q is None:
        return None

    def refuse(field: str, why: str) -> UCPError:
        value = q.get(field) if isinstance(q, dict) else q
        return UCPError(f"{where}/config.json: quantization_config.{field}={value!r}: {why}; only "
                        "blockwise FP8 weights (DeepSeek-V3 / Kimi-K2 style: quant_method 'fp8', fmt "
                        "'e4m3', activation_scheme 'dynamic', weight_block_size [rows, cols], an fp32 "
                        "weight_scale_inv per block) are dequantized on import; dequantize the model "
                        "first (e.g. save it in bf16)")

    if not isinstance(q, dict):
        raise refuse("quant_method", "not a quantization config")
    if q.get("quant_method") != "fp8":
        raise refuse("quant_method", "another quantization method")
    if q.get("fmt", "e4m3") != "e4m3":
        raise refuse("fmt", "FP8 weights must be e4m3 (F8_E4M3)")
    if str(q.get("activation_scheme", "dynamic")).lower() != "dynamic":
        raise refuse("activation_scheme", "static activation scales have no place in megatron-core's "
                     "model")
    block = q.get("weight_block_size", list(DEFAULT_BLOCK))
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise refuse("weight_block_size", "needs two positive block sizes [rows, cols] (None is "
                     "per-tensor FP8)")
    if q.get("scale_fmt", "float") not in ("float", "ue8m0"):
        raise refuse("scale_fmt", "scales must be fp32 ('float'; 'ue8m0' scales stored as F32)")
    if q.get("expert_dtype", "fp8") != "fp8":
        raise refuse("expert_dtype", "FP4 experts are not this scheme")
    return Scheme((block[0], block[1]), q)


def check_weight(scheme: Scheme | None, name: str, shape: tuple[int, ...], scale: tuple[str, tuple] | None,
                 where: str) -> None:
    """An F8_E4M3 tensor `name` of `shape` (in file `where`) with its scale_inv's (dtype, shape),
    None when there is none: refused unless it is the blockwise scheme."""
    what = f"{where}: tensor {name!r} is {FP8_ST}"
    if scheme is None:
        raise UCPError(f"{what} but config.json has no quantization_config: its block size is unknown "
                       "(DeepSeek-V3's: quant_method 'fp8', weight_block_size [128, 128])")
    if len(shape) < 2:
        raise UCPError(f"{what} of shape {list(shape)}: blockwise FP8 weights have two dimensions "
                       "(experts stacked: more)")
    if scale is None:
        raise UCPError(f"{what} without its {scale_name(name)!r}: the per-block scales are missing "
                       "(incomplete download?)")
    want = scale_shape(shape, scheme.block)
    if scale[0] != "F32" or tuple(scale[1]) != want:
        raise UCPError(f"{where}: tensor {scale_name(name)!r} is {scale[0]} of shape {list(scale[1])}; "
                       f"{name} of shape {list(shape)} in blocks of quantization_config."
                       f"weight_block_size={list(scheme.block)} needs F32 of shape {list(want)}")


def other_scheme(name: str) -> bool:
    """A tensor of another FP8 scheme (static activation scales, per-tensor weight scales)."""
    return re.search(OTHER_SCHEME_TENSORS, name) is not None


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 values of an e4m3 `weight` [..., rows, cols] and its fp32 `scale_inv` per block:
    `fp32(w) * s`, one rounding per element (partial last blocks included)."""
    out = weight.to(torch.float32)
    rows, cols = out.shape[-2:]
    b0, b1 = block
    # the scale of each column, per row block: small ([..., row blocks, cols]); rows are broadcast
    col_scale = scale_inv.to(torch.float32).repeat_interleave(b1, dim=-1)[..., :cols]
    full = rows // b0
    if full:
        out[..., :full * b0, :].unflatten(-2, (full, b0)).mul_(col_scale[..., :full, None, :])
    if rows % b0:
        out[..., full * b0:, :].mul_(col_scale[..., full:full + 1, :])
    return out


def quantize(weight: torch.Tensor, block: tuple[int, int], what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 scale_inv) of `weight` [..., rows, cols] in blocks of `block` (module
    doc: DeepSeek's formula). `what` names the tensor in errors."""
    w = weight.to(torch.float32)
    rows, cols = w.shape[-2:]
    b0, b1 = block
    n0, n1 = math.ceil(rows / b0), math.ceil(cols / b1)
    if (n0 * b0, n1 * b1) != (rows, cols):  # zeros fill the partial blocks: no effect on amax
        w = torch.nn.functional.pad(w, (0, n1 * b1 - cols, 0, n0 * b0 - rows))
    blocks = w.unflatten(-1, (n1, b1)).unflatten(-3, (n0, b0))  # [..., n0, b0, n1, b1]
    amax = blocks.abs().amax(dim=(-3, -1))
    if not torch.isfinite(amax).all():
        raise UCPError(f"{what} holds non-finite values: it cannot be written as FP8 (export another "
                       "dtype to keep them)")
    scale = amax / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: any scale
    codes = (blocks / scale[..., :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    codes = codes.flatten(-4, -3).flatten(-2, -1)[..., :rows, :cols].contiguous()
    return codes, scale.contiguous()


def partial_blocks(shape: tuple[int, ...], block: tuple[int, int]) -> bool:
    return shape[-2] % block[0] != 0 or shape[-1] % block[1] != 0
