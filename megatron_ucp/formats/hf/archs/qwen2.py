"""HF `qwen2` (Qwen2ForCausalLM): Llama's layers with biases on q/k/v only (megatron-core's
add_qkv_bias without add_bias_linear), no sliding window."""

from __future__ import annotations

from megatron_ucp.formats.hf.archs._base import ROTARY_INV_FREQ, fail
from megatron_ucp.formats.hf.archs._llama_like import LlamaLike


class Qwen2(LlamaLike):
    name = "qwen2"
    hf_class = "Qwen2ForCausalLM"
    hf_defaults = {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": False,
                   "rope_theta": 10000.0, "hidden_act": "silu"}
    ignored_hf = (ROTARY_INV_FREQ,)
    qkv_bias_always = True

    def check_biases(self, cfg: dict, feats: set[str]) -> None:
        if "linear_bias" in feats:
            raise fail(self.name, "add_bias_linear", True, "Qwen2 has biases on q/k/v only, not on "
                       "o_proj or the MLP")
        if "qkv_bias" not in feats:
            raise fail(self.name, "add_qkv_bias", False, "Qwen2 has q/k/v biases; a model without them "
                       "is --arch llama")

    def config_fields(self, cfg: dict, *, rope_theta: float, hints: dict, tokens: dict) -> dict:
        out = super().config_fields(cfg, rope_theta=rope_theta, hints=hints, tokens=tokens)
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg["num_layers"],
                   layer_types=["full_attention"] * cfg["num_layers"])
        return out


ARCH = Qwen2()
