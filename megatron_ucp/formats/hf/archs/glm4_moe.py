"""HF `glm4_moe` (Glm4MoeForCausalLM: GLM-4.5, GLM-4.5-Air, GLM-4.6): Llama's attention (GQA)
with biases on q/k/v only (attention_bias; o_proj has none: megatron-core's add_qkv_bias),
optional per-head QK-norm (use_qk_norm: megatron-core's qk_layernorm), RoPE on the first
partial_rotary_factor of each head (megatron-core's rotary_percent), and DeepSeek-V3's layers
otherwise: the first first_k_dense_replace dense, every later one a MoE layer with sigmoid routing,
an expert bias (e_score_correction_bias), shared experts, routed_scaling_factor and expert groups,
and multi-token prediction (MTP) layers stored as decoder layers num_hidden_layers + k.

The rotary convention is megatron-core's non-interleaved one: transformers' Glm4Moe rotates the two
halves of the first rotary_dim = int(head_dim * partial_rotary_factor) channels (rotate_half, cos
and sin as [freqs; freqs]) and passes the rest through, as megatron-core's apply_rotary_pos_emb
does with rotary_interleaved=False on a RotaryEmbedding of int(kv_channels * rotary_percent)
channels (tests/test_hf_import.py checks it bit for bit). Names: Llama's (`_llama_like`) with
Qwen3's q_norm / k_norm, DeepSeek-V3's MoE, expert and MTP entries (`deepseek_v3`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_ucp.formats.hf.archs._base import (
    ROTARY_INV_FREQ,
    Entry,
    Refuse,
    check_common,
    default_rope,
    fail,
    features,
    linear_rope_factor,
    refuse_hybrid,
    require,
)
from megatron_ucp.formats.hf.archs._llama_like import ATTENTION, DENSE_MLP
from megatron_ucp.formats.hf.archs.deepseek_v3 import DeepseekV3, sigmoid_moe_fields
from megatron_ucp.formats.hf.archs.qwen3 import QK_NORM
from megatron_ucp.formats.tensor_transforms import Heads

if TYPE_CHECKING:  # (source imports this package)
    from megatron_ucp.formats.hf.source import HFDir


def with_layer_prefixes(entries: list[Entry]) -> list[Entry]:
    """Llama-like entries (`decoder.layers.{i}.` / `model.layers.{i}.`) with DeepSeek-V3's layer
    prefixes `{m}` / `{h}`, so that they name an MTP layer's transformer layer too."""
    return [(m.replace("decoder.layers.{i}.", "{m}"), kind,
             tuple(h.replace("model.layers.{i}.", "{h}") for h in hf), when) for m, kind, hf, when in entries]


class Glm4Moe(DeepseekV3):
    name = "glm4_moe"
    hf_class = "Glm4MoeForCausalLM"
    title = "GLM-4.5"
    # transformers' Glm4MoeConfig defaults (its __post_init__ sets partial_rotary_factor 0.5 where
    # config.json gives none)
    hf_defaults = {"rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": False,
                   "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "hidden_act": "silu",
                   "num_experts_per_tok": 8, "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
                   "first_k_dense_replace": 1, "routed_scaling_factor": 1.0, "n_shared_experts": 1,
                   "attention_bias": False, "use_qk_norm": False, "num_nextn_predict_layers": 1}
    ignored_hf = (ROTARY_INV_FREQ,)
    attention = with_layer_prefixes(ATTENTION + QK_NORM)
    dense = with_layer_prefixes(DENSE_MLP)

    def rule_features(self, cfg: dict) -> set[str]:
        return features(cfg)

    # ------------------------------------------------------------------ export

    def check_exportable(self, cfg: dict, hints: dict) -> None:
        arch, get = self.name, cfg.get
        refuse_hybrid(arch, cfg)
        check_common(arch, cfg, allowed=("qk_layernorm", "mtp_num_layers"))
        require(arch, cfg, "position_embedding_type", "rope", "HF {arch} uses rotary position embeddings")
        require(arch, cfg, "normalization", "RMSNorm", "HF {arch} uses RMSNorm")
        require(arch, cfg, "gated_linear_unit", True, "HF {arch} has a SwiGLU MLP (gate_proj/up_proj)")
        if get("rotary_interleaved", False):
            raise fail(arch, "rotary_interleaved", True, "HF glm4_moe rotates the two halves of the "
                       "rotary part of each head")
        if hints.get("activation") not in (None, "swiglu"):
            raise fail(arch, "activation", hints["activation"], "HF glm4_moe needs SwiGLU (silu)")
        if hints.get("use_rope_scaling") or get("rope_scaling"):
            raise fail(arch, "rope_scaling", True, "Llama 3 RoPE scaling is not exported for HF glm4_moe")
        if linear_rope_factor(cfg, hints) is not None:
            raise fail(arch, "seq_len_interpolation_factor", linear_rope_factor(cfg, hints),
                       "linear RoPE scaling is not exported for HF glm4_moe")
        h = Heads.of(cfg)
        percent = rotary_percent(cfg, hints)
        if not 0 < percent <= 1 or int(h.head_dim * percent) % 2:
            raise fail(arch, "rotary_percent", percent, f"the rotary part of a head of {h.head_dim} "
                       "channels must be an even number of them")
        if h.heads % h.groups:
            raise fail(arch, "num_query_groups", h.groups, "does not divide num_attention_heads")
        if get("add_bias_linear", True):
            raise fail(arch, "add_bias_linear", True, "GLM-4.5 has biases on q/k/v only (add_qkv_bias), "
                       "none on o_proj or the MLPs")
        if not get("num_moe_experts"):
            raise fail(arch, "num_moe_experts", get("num_moe_experts"), "GLM-4.5 is a MoE model")
        self.check_moe(cfg)

    def config_fields(self, cfg: dict, *, rope_theta: float, hints: dict, tokens: dict) -> dict:
        h, get = Heads.of(cfg), cfg.get
        percent = rotary_percent(cfg, hints)
        out = {"hidden_size": cfg["hidden_size"], "num_hidden_layers": cfg["num_layers"],
               "num_attention_heads": h.heads, "num_key_value_heads": h.groups, "head_dim": h.head_dim,
               **sigmoid_moe_fields(cfg), "hidden_act": "silu",
               "rope_parameters": {"rope_type": "default", "rope_theta": float(rope_theta),
                                   "partial_rotary_factor": percent},
               "attention_bias": bool(get("add_qkv_bias")), "use_qk_norm": bool(get("qk_layernorm")),
               "max_position_embeddings": get("max_sequence_length"),
               "rms_norm_eps": get("layernorm_epsilon", 1e-5),
               "attention_dropout": get("attention_dropout", 0.0)}
        if out["max_position_embeddings"] is None:
            del out["max_position_embeddings"]
        return out

    # ------------------------------------------------------------------ import

    def import_config(self, hf_dir: HFDir) -> dict:
        """GLM-4.5's checkpoints repeat the embedding and output layer in each MTP layer
        (embed_tokens, shared_head.head), as DeepSeek-V3's do; GLM-4.6's leave them out: those are
        read as the model's own (export-hf writes the copies)."""
        d = hf_dir.config
        first = d.get("num_hidden_layers", 0)
        head = "model.embed_tokens.weight" if d.get("tie_word_embeddings") else "lm_head.weight"
        for k in range(self.mtp_layers_held(d, hf_dir.where)):
            hf_dir.alias(f"model.layers.{first + k}.embed_tokens.weight", "model.embed_tokens.weight")
            hf_dir.alias(f"model.layers.{first + k}.shared_head.head.weight", head)
        return d

    def args_of(self, d: dict, args: dict, refuse: Refuse, mtp_layers: int) -> tuple[dict, dict]:
        """Llama's attention with q/k/v biases, QK-norm, partial RoPE; DeepSeek-V3's MoE layers and
        the `mtp_layers` MTP layers the checkpoint holds."""
        if d["hidden_act"] != "silu":
            raise refuse("hidden_act", "megatron-core's SwiGLU MLP uses silu")
        rope = default_rope(d, refuse, self.name)
        theta = float(rope["rope_theta"])
        heads = d["num_attention_heads"]
        groups = d.get("num_key_value_heads") or heads
        if heads % groups:
            raise refuse("num_key_value_heads", f"does not divide num_attention_heads={heads}")
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        percent = float(rope.get("partial_rotary_factor") or 1.0)
        if not 0 < percent <= 1 or int(head_dim * percent) % 2:
            field = ("rope_parameters.partial_rotary_factor"
                     if (d.get("rope_parameters") or {}).get("partial_rotary_factor") is not None
                     else "partial_rotary_factor")
            raise refuse(field, f"the rotary part of a head of {head_dim} channels must be an even "
                         "number of them (transformers' and megatron-core's frequencies differ otherwise)")
        bias = bool(d["attention_bias"])
        args.update(hidden_size=d["hidden_size"], num_attention_heads=heads,
                    group_query_attention=groups != heads, num_query_groups=groups, kv_channels=head_dim,
                    normalization="RMSNorm", layernorm_epsilon=d["rms_norm_eps"], swiglu=True,
                    add_bias_linear=False, add_qkv_bias=bias, qk_layernorm=bool(d["use_qk_norm"]),
                    position_embedding_type="rope", rotary_base=theta, rotary_percent=percent,
                    max_position_embeddings=d["max_position_embeddings"],
                    attention_dropout=d.get("attention_dropout", 0.0), mtp_num_layers=mtp_layers or None,
                    **self.moe_args(d, refuse))
        return args, {"activation": "swiglu", "rotary_base": theta, "rotary_percent": percent}


def rotary_percent(cfg: dict, hints: dict) -> float:
    """The rotated fraction of a head: the model config's record (megatron_ucp.save and import-hf
    record GPTModel's rotary_percent), else Megatron-LM's --rotary-percent, else all of it."""
    percent = cfg.get("rotary_percent")
    return float(percent if percent is not None else hints.get("rotary_percent") or 1.0)


ARCH = Glm4Moe()
