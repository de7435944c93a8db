"""HF `olmoe` (OlmoeForCausalLM): not importable, and so not in the registry (no megatron-core
model exports as it either). Why, for import-hf's refusal:

OLMoE's q_norm / k_norm are RMSNorms over the whole q and k projections (transformers'
OlmoeAttention: `q_norm = OlmoeRMSNorm(hidden_size)` applied to `q_proj(x)` before the heads are
split; k_norm over num_key_value_heads * head_dim), one statistic per token across all heads.
megatron-core's only QK-norm (TransformerConfig.qk_layernorm, or qk_l2_norm; qk_clip is Muon's
weight clipping) builds its q_layernorm / k_layernorm with hidden_size=hidden_size_per_attention_head
and applies them to [s, b, heads, head_dim], one statistic per head: SelfAttention.__init__ and
get_query_key_value_tensors (megatron/core/transformer/attention.py:1281-1298 and :1477-1481 in
0.16.1, :1722-1739 and :1920-1924 in 0.19.2), and every GPT layer spec gives those submodules
(models/gpt/gpt_layer_specs.py). Imported as megatron-core's per-head norm, its [hidden_size]
weights would not even fit. Nor does megatron-core clamp q/k/v (OLMoE's clip_qkv): no such
TransformerConfig field in either release.
"""

from __future__ import annotations

from megatron_ucp.errors import UCPError

NAME = "olmoe"
WHOLE_WIDTH_QK_NORM = (
    "its q_norm / k_norm (model.layers.<i>.self_attn.q_norm.weight [num_attention_heads * head_dim], "
    "k_norm.weight [num_key_value_heads * head_dim]) are RMSNorms over the whole q and k projections; "
    "megatron-core's qk_layernorm normalizes each head (q_layernorm / k_layernorm of "
    "hidden_size_per_attention_head: megatron/core/transformer/attention.py:1281-1298 in 0.16.1, "
    ":1722-1739 in 0.19.2) and has no QK-norm over the whole projection")
NO_CLIP_QKV = "megatron-core does not clamp q/k/v (no TransformerConfig field for it in 0.16.1 or 0.19.2)"


def refusal(config: dict, where: str) -> UCPError:
    """import-hf's error for an OLMoE config.json: what megatron-core cannot build, by name."""
    why = f"{where}: cannot import HF olmoe (OlmoeForCausalLM): {WHOLE_WIDTH_QK_NORM}"
    if config.get("clip_qkv") is not None:
        why += f"; and config.json clip_qkv={config['clip_qkv']!r}: {NO_CLIP_QKV}"
    return UCPError(why)
