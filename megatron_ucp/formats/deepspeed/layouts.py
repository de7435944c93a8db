"""Element order of a DeepSpeed parameter versus the megatron-core universal tensor it becomes.

A name-map rule names one of these layouts. Adam moments are element-wise, so the fp32 master
weight and both moments of a parameter go through the same permutation.

* `same`: the same tensor (shape checked).
* `qkv_concat`: `[q; k; v]` stacked along rows (torch.nn.MultiheadAttention's `in_proj_weight` /
  `in_proj_bias`, and Megatron-DeepSpeed's `query_key_value` from its commit 676a482c (#441) on,
  there per TP rank: `qkv_blocks` consecutive `[q_r; k_r; v_r]` blocks, one per saving TP rank)
  -> megatron's rows per query group `[q heads of group g; k_g; v_g]` (docs/FORMAT.md).
* `qkv_per_head`: the fused QKV already in megatron's per-query-group order (Megatron-DeepSpeed's
  and legacy Megatron-LM's `query_key_value` before #441: per head `[q_h; k_h; v_h]` without GQA,
  per group with it): the same tensor, its row count checked against the attention geometry.
* `vocab_rows`: dim 0 is the vocabulary; rows past the true vocabulary (padding that
  `ds_to_universal` did not strip) are dropped.
"""

from __future__ import annotations

import torch

from megatron_ucp.errors import UCPError
from megatron_ucp.formats import tensor_transforms as transforms
from megatron_ucp.formats.tensor_transforms import Heads

LAYOUTS = ("same", "qkv_concat", "qkv_per_head", "vocab_rows")
Shape = tuple[int, ...]


def _block_heads(heads: Heads, blocks: int, what: str) -> Heads:
    if heads.heads % blocks or heads.groups % blocks:
        raise UCPError(f"{what}: qkv_blocks={blocks} does not divide {heads.heads} heads in "
                       f"{heads.groups} query groups")
    return Heads(heads.heads // blocks, heads.groups // blocks, heads.head_dim)


def fits(layout: str, ds_shape: Shape, mcore_shape: Shape) -> bool:
    """Whether a DeepSpeed tensor of `ds_shape` can become a megatron tensor of `mcore_shape`."""
    if layout == "vocab_rows":
        return len(ds_shape) == len(mcore_shape) and ds_shape[0] >= mcore_shape[0] and \
            ds_shape[1:] == mcore_shape[1:]
    return tuple(ds_shape) == tuple(mcore_shape)


def expected_ds_shape(layout: str, mcore_shape: Shape) -> str:
    """The DeepSpeed shape `fits` accepts, in words (for error messages)."""
    if layout == "vocab_rows":
        return f"[>= {mcore_shape[0]}, {', '.join(map(str, mcore_shape[1:]))}]"
    return str(list(mcore_shape))


def to_megatron(layout: str, t: torch.Tensor, heads: Heads, rows: int, blocks: int = 1,
                what: str = "tensor") -> torch.Tensor:
    """The universal tensor (megatron-core order, `rows` rows) holding DeepSpeed tensor `t`."""
    if layout == "same":
        return t
    if layout == "vocab_rows":
        return t[:rows]
    if layout == "qkv_per_head":
        transforms.check_qkv_rows(t.shape[0], heads, what)
        return t
    if layout == "qkv_concat":
        transforms.check_qkv_rows(t.shape[0], heads, what)
        block = _block_heads(heads, blocks, what)
        parts = t.chunk(blocks, dim=0)
        return torch.cat([transforms.join("qkv_cat", [p], block, what) for p in parts], dim=0)
    raise ValueError(f"unknown layout {layout!r}")


def to_deepspeed(layout: str, t: torch.Tensor, heads: Heads, blocks: int = 1,
                 what: str = "tensor") -> torch.Tensor:
    """The inverse of `to_megatron` (`vocab_rows`: the true rows only; padding is not recreated)."""
    if layout in ("same", "vocab_rows", "qkv_per_head"):
        return t
    if layout == "qkv_concat":
        block = _block_heads(heads, blocks, what)
        # TP rank r of the saving run held query groups [r G/TP, (r+1) G/TP): contiguous rows
        parts = t.chunk(blocks, dim=0)
        return torch.cat([transforms.split("qkv_cat", p, block, what)[0] for p in parts], dim=0)
    raise ValueError(f"unknown layout {layout!r}")
