"""HF `mistral` (MistralForCausalLM): Llama's layers without biases (GQA, head_dim, tied or
untied) and a sliding window on every layer when config.json's sliding_window is set (null in
Mistral's current releases): megatron-core's window_size (sliding_window - 1, 0), no
window_attn_skip_freq. transformers' Mistral masks kv > q - sliding_window (the token itself
counts, as GPT-OSS's), megatron-core's window (w, 0) keeps w tokens before the query."""

from __future__ import annotations

from megatron_ucp.formats.hf.archs._base import ROTARY_INV_FREQ, fail
from megatron_ucp.formats.hf.archs._llama_like import LlamaLike


class Mistral(LlamaLike):
    name = "mistral"
    hf_class = "MistralForCausalLM"
    hf_defaults = {"rms_norm_eps": 1e-6, "max_position_embeddings": 4096 * 32, "tie_word_embeddings": False,
                   "rope_theta": 10000.0, "hidden_act": "silu"}
    ignored_hf = (ROTARY_INV_FREQ,)
    every_layer_window = True

    def check_biases(self, cfg: dict, feats: set[str]) -> None:
        if feats & {"qkv_bias", "linear_bias"}:
            raise fail(self.name, "add_bias_linear" if "linear_bias" in feats else "add_qkv_bias", True,
                       "Mistral has no biases")

    def config_fields(self, cfg: dict, *, rope_theta: float, hints: dict, tokens: dict) -> dict:
        out = super().config_fields(cfg, rope_theta=rope_theta, hints=hints, tokens=tokens)
        window = cfg.get("window_size")
        out["sliding_window"] = window[0] + 1 if window else None
        return out


ARCH = Mistral()
