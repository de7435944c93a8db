"""Core attention for multi-latent attention (MLA, DeepSeek-V3) on CPU runs.

What it replaces: megatron-core 0.16.1's `MLASelfAttention` builds its core attention with
`k_channels=` and `v_channels=` (query/key heads of qk_head_dim + qk_pos_emb_head_dim, value heads of
v_head_dim), which only Transformer Engine's `TEDotProductAttention` accepts; the local
`DotProductAttention` of the local spec has neither argument. And `multi_latent_attention.HAVE_TE`
is true without TE (megatron-core's TE extension module imports with stand-in mocks for TE's
classes, so `isinstance(self.linear_proj, TELinear)` raises): on import, where TELinear is not a
class, this module sets `HAVE_TE = False` there, which is what it means. `MLACoreAttention`
takes the core attention's arguments and computes causal softmax attention with PyTorch's
`scaled_dot_product_attention` at MLA's softmax scale. It has no parameters, so it changes
nothing a checkpoint holds: every MLA projection and norm is megatron-core's own.
"""

from __future__ import annotations

import torch
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.module import MegatronModule

if not isinstance(multi_latent_attention.TELinear, type):  # no Transformer Engine: see above
    multi_latent_attention.HAVE_TE = False


class MLACoreAttention(MegatronModule):
    """Causal attention of [sq, b, heads, dk] queries and keys with [sq, b, heads, dv] values."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, **_: object):
        super().__init__(config=config)
        # (megatron's Attention base class builds one without k_channels first; MLA replaces it)
        self.softmax_scale = softmax_scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> torch.Tensor:
        sq, b = query.shape[:2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, d]
        scale = self.softmax_scale if self.softmax_scale is not None else q.shape[-1] ** -0.5
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)
