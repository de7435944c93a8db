"""HF `llama` (LlamaForCausalLM): the rotary decoder of `_llama_like` as it is, GQA, its
attention_bias covering q/k/v and o_proj and mlp_bias the MLP (megatron-core: both or neither)."""

from __future__ import annotations

from megatron_ucp.formats.hf.archs._base import ROTARY_INV_FREQ, fail, features
from megatron_ucp.formats.hf.archs._llama_like import LlamaLike


class Llama(LlamaLike):
    name = "llama"
    hf_class = "LlamaForCausalLM"
    hf_defaults = {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "tie_word_embeddings": False,
                   "rope_theta": 10000.0, "hidden_act": "silu"}
    ignored_hf = (ROTARY_INV_FREQ,)

    def check_biases(self, cfg: dict, feats: set[str]) -> None:
        if feats & {"qkv_bias", "linear_bias"} not in (set(), {"qkv_bias", "linear_bias"}):
            raise fail(self.name, "add_qkv_bias", True, "Llama's attention_bias covers q/k/v and "
                       "o_proj together; a model with q/k/v biases only is --arch qwen2")

    def config_fields(self, cfg: dict, *, rope_theta: float, hints: dict, tokens: dict) -> dict:
        out = super().config_fields(cfg, rope_theta=rope_theta, hints=hints, tokens=tokens)
        bias = "linear_bias" in features(cfg)
        out.update(attention_bias=bias, mlp_bias=bias, pretraining_tp=1)
        return out


ARCH = Llama()
