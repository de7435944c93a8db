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

Stock Megatron-LM `pretrain_gpt.py --transformer-impl local --multi-latent-attention` fails the same
way in core_v0.19.0 with megatron-core 0.19.2 (`multi_latent_attention.py:207` builds the core
attention with `k_channels=self.q_head_dim, v_channels=self.config.v_head_dim`;
`dot_product_attention.py:42` `DotProductAttention.__init__` has neither: `TypeError:
DotProductAttention.__init__() got an unexpected keyword argument 'k_channels' when instantiating
DotProductAttention when instantiating MLASelfAttention`). `install_local_spec()` lets CPU runs of
stock Megatron-LM build MLA (the fixture harness and tools/mlm_resume call it when argv holds
`--multi-latent-attention`): the local GPT layer spec (`get_gpt_layer_local_spec`, which the decoder
block, MoE and MTP specs of both releases build their layers from) gets `MLACoreAttention` as MLA's
core attention; nothing else of the spec changes.
"""

from __future__ import annotations

import torch
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.module import MegatronModule

from megatron_ucp.formats.megatron_rebuild import replace_module

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


def install_local_spec() -> None:
    """Stock Megatron-LM on CPU: MLA layers of the local spec get `MLACoreAttention` (see above).
    Call it after the CUDA shim and before Megatron-LM's `gpt_builders` is imported."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    local_spec = gpt_layer_specs.get_gpt_layer_local_spec
    if getattr(local_spec, "mla_stand_in", False):
        return

    def get_gpt_layer_local_spec(*args, **kwargs):
        spec = local_spec(*args, **kwargs)  # (Megatron-LM's gpt_builders passes its flags by position)
        attention = getattr(spec.submodules, "self_attention", None)
        if isinstance(getattr(attention, "module", None), type) and \
                issubclass(attention.module, multi_latent_attention.MLASelfAttention):
            spec = replace_module(spec, DotProductAttention, MLACoreAttention)
        return spec

    get_gpt_layer_local_spec.mla_stand_in = True
    gpt_layer_specs.get_gpt_layer_local_spec = get_gpt_layer_local_spec
