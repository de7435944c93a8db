"""HF `qwen3` (Qwen3ForCausalLM): Llama's layers with QK-norm (RMSNorm over each head's q and k;
megatron-core's qk_layernorm), no biases, no sliding window."""

from __future__ import annotations

from megatron_ucp.formats.hf.archs._base import ROTARY_INV_FREQ, Entry, fail
from megatron_ucp.formats.hf.archs._llama_like import ATTENTION, DENSE_MLP, LlamaLike

QK_NORM: list[Entry] = [
    ("decoder.layers.{i}.self_attention.q_layernorm.weight", "copy",
     ("model.layers.{i}.self_attn.q_norm.weight",), "qk_norm"),
    ("decoder.layers.{i}.self_attention.k_layernorm.weight", "copy",
     ("model.layers.{i}.self_attn.k_norm.weight",), "qk_norm"),
]


class Qwen3(LlamaLike):
    name = "qwen3"
    hf_class = "Qwen3ForCausalLM"
    hf_defaults = {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": False,
                   "rope_theta": 10000.0, "hidden_act": "silu", "head_dim": 128}
    ignored_hf = (ROTARY_INV_FREQ,)
    layer = ATTENTION + QK_NORM + DENSE_MLP
    qk_norm = True
    without_qk_norm = "llama or qwen2"  # the architectures of this one without QK-norm
    moe_sibling = "qwen3_moe"

    def check_qk_norm(self, cfg: dict) -> None:
        if not cfg.get("qk_layernorm"):
            raise fail(self.name, "qk_layernorm", cfg.get("qk_layernorm"), f"HF {self.name} normalizes "
                       f"q and k per head; a model without QK-norm is --arch {self.without_qk_norm}")

    def check_biases(self, cfg: dict, feats: set[str]) -> None:
        if feats & {"qkv_bias", "linear_bias"}:
            raise fail(self.name, "add_bias_linear" if "linear_bias" in feats else "add_qkv_bias", True,
                       f"HF {self.name} has no MLP biases, and its attention_bias covers q/k/v and "
                       "o_proj together")

    def config_fields(self, cfg: dict, *, rope_theta: float, hints: dict, tokens: dict) -> dict:
        out = super().config_fields(cfg, rope_theta=rope_theta, hints=hints, tokens=tokens)
        out.update(attention_bias=False, use_sliding_window=False, sliding_window=None,
                   max_window_layers=cfg["num_layers"], layer_types=["full_attention"] * cfg["num_layers"])
        return out


ARCH = Qwen3()
