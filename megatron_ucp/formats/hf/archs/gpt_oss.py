"""HF `gpt_oss` (GptOssForCausalLM): attention sinks (megatron-core's learnable softmax offset),
sliding-window attention on some layers, biases everywhere, every layer a MoE layer whose
experts use a clamped SwiGLU, default RoPE or GPT-OSS's own YaRN.

The clamped SwiGLU is megatron-core's gated quick_gelu (x * sigmoid(1.702 x)) with
glu_linear_offset 1 and activation_func_clamp_value = HF swiglu_limit. The experts of a layer are
one HF tensor each (expert index first): `Rule.slot`, the tensor written after its last expert.
"""

from __future__ import annotations

import math

from megatron_ucp.formats.hf.archs._base import (
    ROTARY_INV_FREQ,
    Entry,
    HFArch,
    Refuse,
    Rule,
    check_common,
    check_defaults,
    check_rope_moe,
    check_yarn_record,
    differs,
    fail,
    features,
    fill,
    hf_rope,
    refuse_hybrid,
    refuse_partial_rotary,
    require,
    yarn_args,
    yarn_rope,
)
from megatron_ucp.formats.hf.archs._llama_like import GLOBAL
from megatron_ucp.formats.tensor_transforms import Heads

QUICK_GELU = "megatron.core.fusions.fused_bias_geglu.quick_gelu"
QUICK_GELU_ALPHA = 1.702

LAYER: list[Entry] = [
    ("{m}self_attention.linear_qkv.layer_norm_weight", "copy", ("{h}input_layernorm.weight",), ""),
    ("{m}self_attention.linear_qkv.weight", "qkv",
     ("{h}self_attn.q_proj.weight", "{h}self_attn.k_proj.weight", "{h}self_attn.v_proj.weight"), ""),
    ("{m}self_attention.linear_qkv.bias", "qkv",
     ("{h}self_attn.q_proj.bias", "{h}self_attn.k_proj.bias", "{h}self_attn.v_proj.bias"), ""),
    ("{m}self_attention.core_attention.softmax_offset", "copy", ("{h}self_attn.sinks",), ""),
    ("{m}self_attention.linear_proj.weight", "copy", ("{h}self_attn.o_proj.weight",), ""),
    ("{m}self_attention.linear_proj.bias", "copy", ("{h}self_attn.o_proj.bias",), ""),
    ("{m}pre_mlp_layernorm.weight", "copy", ("{h}post_attention_layernorm.weight",), ""),
    ("{m}mlp.router.weight", "copy", ("{h}mlp.router.weight",), ""),
    ("{m}mlp.router.bias", "copy", ("{h}mlp.router.bias",), ""),
]
EXPERTS: list[Entry] = [
    ("{m}mlp.experts.experts.{e}.linear_fc1.weight", "gate_up_mix_t", ("{h}mlp.experts.gate_up_proj",), ""),
    ("{m}mlp.experts.experts.{e}.linear_fc1.bias", "gate_up_mix", ("{h}mlp.experts.gate_up_proj_bias",), ""),
    ("{m}mlp.experts.experts.{e}.linear_fc2.weight", "transpose", ("{h}mlp.experts.down_proj",), ""),
    ("{m}mlp.experts.experts.{e}.linear_fc2.bias", "copy", ("{h}mlp.experts.down_proj_bias",), ""),
]


class GptOss(HFArch):
    name = "gpt_oss"
    hf_class = "GptOssForCausalLM"
    hf_defaults = {"rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": False,
                   "rope_theta": 150000.0, "hidden_act": "silu", "num_experts_per_tok": 4,
                   "swiglu_alpha": QUICK_GELU_ALPHA, "swiglu_limit": 7.0, "sliding_window": 128,
                   "attention_bias": True, "head_dim": 64}
    ignored_hf = (ROTARY_INV_FREQ,)

    def rules(self, cfg: dict) -> list[Rule]:
        feats = features(cfg)
        out = fill(GLOBAL, feats)
        experts = cfg["num_moe_experts"]
        for i in range(cfg["num_layers"]):
            m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
            out += fill(LAYER, feats, m=m, h=h)
            for entry in EXPERTS:  # expert after expert: each HF tensor is complete in turn
                for e in range(experts):
                    (rule,) = fill([entry], feats, m=m, h=h, e=e)
                    out.append(Rule(rule.megatron, rule.kind, rule.hf, (e, experts)))
        return out

    # ------------------------------------------------------------------ export

    def fp8_refusal(self, cfg: dict) -> str | None:
        return ("GPT-OSS's experts have biases, which transformers' FP8 experts do not (5.23's "
                "FP8Experts asserts has_bias is False); GPT-OSS's own weights are MXFP4, another scheme")

    def check_exportable(self, cfg: dict, hints: dict) -> None:
        arch, get = self.name, cfg.get
        refuse_hybrid(arch, cfg)
        check_common(arch, cfg, allowed=("window_size", "softmax_type"))
        if get("position_embedding_type") == "yarn":
            check_yarn_record(arch, cfg)
        else:
            require(arch, cfg, "position_embedding_type", "rope", "HF {arch} uses rotary position embeddings")
        check_rope_moe(arch, cfg, hints)
        for field, default in (("moe_router_num_groups", None), ("moe_router_group_topk", None)):
            if differs(get(field, default), default):
                raise fail(arch, field, get(field), "GPT-OSS routes without expert groups")
        if get("softmax_type", "vanilla") != "learnable":
            raise fail(arch, "softmax_type", get("softmax_type"), "GPT-OSS's attention has learnable "
                       "sinks (softmax_type='learnable')")
        if not get("add_bias_linear", True):
            raise fail(arch, "add_bias_linear", False, "GPT-OSS has biases on q/k/v, o_proj, the router "
                       "and the experts")
        window = get("window_size")
        if window is not None and (len(window) != 2 or window[1] != 0 or window[0] < 0):
            raise fail(arch, "window_size", window, "GPT-OSS's sliding window looks back only, "
                       "(w, 0) with w >= 0")
        if get("activation_func") != QUICK_GELU:
            raise fail(arch, "activation_func", get("activation_func"), "GPT-OSS's experts use a "
                       "clamped SwiGLU x * sigmoid(1.702 x): megatron-core's quick_gelu")
        if get("glu_linear_offset", 0.0) != 1.0:
            raise fail(arch, "glu_linear_offset", get("glu_linear_offset"), "GPT-OSS multiplies by "
                       "(up + 1)")
        if get("activation_func_clamp_value") is None:
            raise fail(arch, "activation_func_clamp_value", None, "GPT-OSS clamps the gate and up "
                       "projections (swiglu_limit)")
        check_defaults(arch, cfg, [
            ("moe_router_score_function", "softmax", "GPT-OSS's router takes a softmax"),
            ("moe_router_pre_softmax", False, "GPT-OSS takes the softmax over the top-k logits"),
            ("moe_router_topk_scaling_factor", None, "GPT-OSS does not scale routing weights"),
            ("moe_router_enable_expert_bias", False, "GPT-OSS's router has no expert bias"),
            ("moe_shared_expert_intermediate_size", None, "GPT-OSS has no shared experts"),
            ("moe_layer_freq", 1, "every GPT-OSS layer is a MoE layer")])

    def config_fields(self, cfg: dict, *, rope_theta: float, hints: dict, tokens: dict) -> dict:
        h, get = Heads.of(cfg), cfg.get
        window = get("window_size")
        out = {"hidden_size": cfg["hidden_size"], "num_hidden_layers": cfg["num_layers"],
               "num_attention_heads": h.heads, "num_key_value_heads": h.groups, "head_dim": h.head_dim,
               "intermediate_size": get("moe_ffn_hidden_size") or cfg["ffn_hidden_size"],
               "num_local_experts": cfg["num_moe_experts"], "num_experts_per_tok": cfg["moe_router_topk"],
               # transformers' window counts the token itself: kv > q - sliding_window
               "sliding_window": window[0] + 1 if window else None,
               "layer_types": layer_types(cfg), "attention_bias": True,
               "swiglu_alpha": QUICK_GELU_ALPHA, "swiglu_limit": float(cfg["activation_func_clamp_value"]),
               "hidden_act": "silu",
               "rope_parameters": {"rope_type": "default", "rope_theta": float(rope_theta)},
               "max_position_embeddings": get("max_sequence_length"),
               "rms_norm_eps": get("layernorm_epsilon", 1e-5),
               "attention_dropout": get("attention_dropout", 0.0), "output_router_logits": False,
               "router_aux_loss_coef": get("moe_aux_loss_coeff") or 0.0}
        if get("position_embedding_type") == "yarn":  # GPT-OSS's own: factor 32 of 4096, truncate false
            out["rope_parameters"] = yarn_rope(cfg, rope_theta)
        if out["max_position_embeddings"] is None:
            del out["max_position_embeddings"]
        return out

    # ------------------------------------------------------------------ import

    def args_of(self, d: dict, args: dict, refuse: Refuse, mtp_layers: int) -> tuple[dict, dict]:
        """Learnable sinks, sliding windows, biases everywhere, clamped SwiGLU, default RoPE or YaRN."""
        rope = hf_rope(d)
        theta, kind = float(rope["rope_theta"]), rope["rope_type"]
        if kind not in ("default", "yarn"):
            raise refuse("rope_parameters.rope_type", f"{kind!r} RoPE scaling is not imported for "
                         "GPT-OSS (default and yarn)")
        refuse_partial_rotary(d, refuse, "transformers' GPT-OSS rotates whole heads (its "
                              "_apply_rotary_emb has no pass-through channels)")
        if not d["attention_bias"]:
            raise refuse("attention_bias", "GPT-OSS's experts have biases, and megatron-core's "
                         "add_bias_linear puts biases on every linear layer or none")
        if not math.isclose(d["swiglu_alpha"], QUICK_GELU_ALPHA):
            raise refuse("swiglu_alpha", f"megatron-core's quick_gelu is x * sigmoid({QUICK_GELU_ALPHA} x)")
        if d["swiglu_limit"] is None:
            raise refuse("swiglu_limit", "megatron-core clamps with activation_func_clamp_value")
        heads = d["num_attention_heads"]
        groups = d.get("num_key_value_heads") or heads
        if heads % groups:
            raise refuse("num_key_value_heads", f"does not divide num_attention_heads={heads}")
        layers = d["num_hidden_layers"]
        types = d.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
        window = None
        if "sliding_attention" in types:
            if not d.get("sliding_window"):
                raise refuse("sliding_window", "sliding_attention layers need a window")
            window = [int(d["sliding_window"]) - 1, 0]  # megatron-core's window excludes the token itself
        args.update(num_layers=layers, hidden_size=d["hidden_size"], num_attention_heads=heads,
                    group_query_attention=groups != heads, num_query_groups=groups,
                    ffn_hidden_size=d["intermediate_size"], kv_channels=d["head_dim"],
                    normalization="RMSNorm", layernorm_epsilon=d["rms_norm_eps"], quick_geglu=True,
                    glu_linear_offset=1.0, activation_func_clamp_value=float(d["swiglu_limit"]),
                    add_bias_linear=True, add_qkv_bias=True, position_embedding_type="rope",
                    rotary_base=theta, max_position_embeddings=d["max_position_embeddings"],
                    attention_dropout=d.get("attention_dropout", 0.0), softmax_type="learnable",
                    window_size=window, window_attn_skip_freq=window_skip_freq(types) if window else None,
                    num_experts=d["num_local_experts"], moe_router_topk=d["num_experts_per_tok"],
                    moe_ffn_hidden_size=d["intermediate_size"],
                    moe_aux_loss_coeff=float(d.get("router_aux_loss_coef") or 0.0))
        run = {"activation": "quick_geglu", "rotary_base": theta}
        if kind == "yarn":  # (the run record: the Megatron-LM flags, --position-embedding-type yarn ...)
            yarn = yarn_args(d, rope, refuse)
            args.update(yarn)
            run.update(yarn)
        return args, run


def layer_types(cfg: dict) -> list[str]:
    """Sliding or full attention per layer, as megatron-core's is_layer_window_attention decides."""
    window, skip = cfg.get("window_size"), cfg.get("window_attn_skip_freq")
    out = []
    for n in range(1, cfg["num_layers"] + 1):  # megatron-core's layer numbers start at 1
        if not window:
            sliding = False
        elif skip is None:
            sliding = True
        elif isinstance(skip, int):
            sliding = n % skip != 0
        else:
            sliding = bool(skip[n - 1])
        out.append("sliding_attention" if sliding else "full_attention")
    return out


def window_skip_freq(types: list[str]) -> int | list[int] | None:
    """megatron-core's window_attn_skip_freq for transformers' layer_types: None (every layer
    sliding), n (all but every n-th layer), else the per-layer list."""
    sliding = [t == "sliding_attention" for t in types]
    if all(sliding):
        return None
    for n in range(2, len(sliding) + 1):
        if sliding == [(i + 1) % n != 0 for i in range(len(sliding))]:
            return n
    return [int(x) for x in sliding]


ARCH = GptOss()
