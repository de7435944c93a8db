"""Hugging Face architectures: which megatron-core models each can represent, the name maps, and
the translation of model configs in both directions.

A megatron-core GPT model maps to an HF architecture only when every parameter has a place
there and every structural setting means the same thing. Anything else is a `UCPError` naming
the parameter or config field: nothing is dropped or approximated silently.

The name maps below are data: (universal name, transform, HF names, feature that must be on).
`{i}` is the global layer index, `{e}` the global expert index; transforms are in `transforms`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.hf.transforms import Heads

ARCHS = ("llama", "qwen2", "mixtral", "gpt2", "qwen3", "qwen3_moe")
HF_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "mixtral": "MixtralForCausalLM", "gpt2": "GPT2LMHeadModel",
            "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# RMSNorm, SwiGLU, rotary positions, no LayerNorm biases
ROTARY = ("llama", "qwen2", "mixtral", "qwen3", "qwen3_moe")
QK_NORM = ("qwen3", "qwen3_moe")  # RMSNorm over each head's q and k (megatron-core: qk_layernorm)
MOE = ("mixtral", "qwen3_moe")

# (universal name, transform, HF names, feature); feature "" = always, else one of FEATURES
Entry = tuple[str, str, tuple[str, ...], str]
FEATURES = ("untied", "qkv_bias", "linear_bias", "moe", "qk_norm")

_ROTARY_GLOBAL: list[Entry] = [
    ("embedding.word_embeddings.weight", "copy", ("model.embed_tokens.weight",), ""),
    ("decoder.final_layernorm.weight", "copy", ("model.norm.weight",), ""),
    ("output_layer.weight", "copy", ("lm_head.weight",), "untied"),
]
_ROTARY_ATTENTION: list[Entry] = [
    ("decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight", "copy",
     ("model.layers.{i}.input_layernorm.weight",), ""),
    ("decoder.layers.{i}.self_attention.linear_qkv.weight", "qkv",
     ("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",
      "model.layers.{i}.self_attn.v_proj.weight"), ""),
    ("decoder.layers.{i}.self_attention.linear_qkv.bias", "qkv",
     ("model.layers.{i}.self_attn.q_proj.bias", "model.layers.{i}.self_attn.k_proj.bias",
      "model.layers.{i}.self_attn.v_proj.bias"), "qkv_bias"),
    ("decoder.layers.{i}.self_attention.linear_proj.weight", "copy",
     ("model.layers.{i}.self_attn.o_proj.weight",), ""),
    ("decoder.layers.{i}.self_attention.linear_proj.bias", "copy",
     ("model.layers.{i}.self_attn.o_proj.bias",), "linear_bias"),
    # megatron names the pre-MLP norm after the fc1 it feeds, also in MoE layers (FORMAT.md)
    ("decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight", "copy",
     ("model.layers.{i}.post_attention_layernorm.weight",), ""),
]
_ROTARY_DENSE_MLP: list[Entry] = [
    ("decoder.layers.{i}.mlp.linear_fc1.weight", "gate_up",
     ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"), ""),
    ("decoder.layers.{i}.mlp.linear_fc1.bias", "gate_up",
     ("model.layers.{i}.mlp.gate_proj.bias", "model.layers.{i}.mlp.up_proj.bias"), "linear_bias"),
    ("decoder.layers.{i}.mlp.linear_fc2.weight", "copy", ("model.layers.{i}.mlp.down_proj.weight",), ""),
    ("decoder.layers.{i}.mlp.linear_fc2.bias", "copy", ("model.layers.{i}.mlp.down_proj.bias",),
     "linear_bias"),
]
_QK_NORM: list[Entry] = [
    ("decoder.layers.{i}.self_attention.q_layernorm.weight", "copy",
     ("model.layers.{i}.self_attn.q_norm.weight",), "qk_norm"),
    ("decoder.layers.{i}.self_attention.k_layernorm.weight", "copy",
     ("model.layers.{i}.self_attn.k_norm.weight",), "qk_norm"),
]
# Qwen3-MoE in the Hub layout (transformers 5 fuses the experts when it loads them)
_QWEN3_MOE_ROUTER: list[Entry] = [
    ("decoder.layers.{i}.mlp.router.weight", "copy", ("model.layers.{i}.mlp.gate.weight",), ""),
]
_QWEN3_MOE_EXPERT: list[Entry] = [
    ("decoder.layers.{i}.mlp.experts.experts.{e}.linear_fc1.weight", "gate_up",
     ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
      "model.layers.{i}.mlp.experts.{e}.up_proj.weight"), ""),
    ("decoder.layers.{i}.mlp.experts.experts.{e}.linear_fc2.weight", "copy",
     ("model.layers.{i}.mlp.experts.{e}.down_proj.weight",), ""),
]
# Mixtral as every Mixtral checkpoint on the Hub stores it (and transformers' save_pretrained
# writes it): w1 = gate, w3 = up, w2 = down
_MIXTRAL_ROUTER: list[Entry] = [
    ("decoder.layers.{i}.mlp.router.weight", "copy", ("model.layers.{i}.block_sparse_moe.gate.weight",), ""),
]
_MIXTRAL_EXPERT: list[Entry] = [
    ("decoder.layers.{i}.mlp.experts.experts.{e}.linear_fc1.weight", "gate_up",
     ("model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
      "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight"), ""),
    ("decoder.layers.{i}.mlp.experts.experts.{e}.linear_fc2.weight", "copy",
     ("model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",), ""),
]
_GPT2_GLOBAL: list[Entry] = [
    ("embedding.word_embeddings.weight", "copy", ("transformer.wte.weight",), ""),
    ("embedding.position_embeddings.weight", "copy", ("transformer.wpe.weight",), ""),
    ("decoder.final_layernorm.weight", "copy", ("transformer.ln_f.weight",), ""),
    ("decoder.final_layernorm.bias", "copy", ("transformer.ln_f.bias",), ""),
    ("output_layer.weight", "copy", ("lm_head.weight",), "untied"),
]
_M, _H = "decoder.layers.{i}.", "transformer.h.{i}."  # layer prefixes: megatron, HF GPT-2
_GPT2_LAYER: list[Entry] = [
    (_M + "self_attention.linear_qkv.layer_norm_weight", "copy", (_H + "ln_1.weight",), ""),
    (_M + "self_attention.linear_qkv.layer_norm_bias", "copy", (_H + "ln_1.bias",), ""),
    (_M + "self_attention.linear_qkv.weight", "qkv_conv1d", (_H + "attn.c_attn.weight",), ""),
    (_M + "self_attention.linear_qkv.bias", "qkv_cat", (_H + "attn.c_attn.bias",), ""),
    (_M + "self_attention.linear_proj.weight", "conv1d", (_H + "attn.c_proj.weight",), ""),
    (_M + "self_attention.linear_proj.bias", "copy", (_H + "attn.c_proj.bias",), ""),
    (_M + "mlp.linear_fc1.layer_norm_weight", "copy", (_H + "ln_2.weight",), ""),
    (_M + "mlp.linear_fc1.layer_norm_bias", "copy", (_H + "ln_2.bias",), ""),
    (_M + "mlp.linear_fc1.weight", "conv1d", (_H + "mlp.c_fc.weight",), ""),
    (_M + "mlp.linear_fc1.bias", "copy", (_H + "mlp.c_fc.bias",), ""),
    (_M + "mlp.linear_fc2.weight", "conv1d", (_H + "mlp.c_proj.weight",), ""),
    (_M + "mlp.linear_fc2.bias", "copy", (_H + "mlp.c_proj.bias",), ""),
]
# tensors some HF checkpoints carry that are not parameters (recomputed buffers): skipped on import
IGNORED_HF = {
    "llama": (r"\.rotary_emb\.inv_freq$",), "qwen2": (r"\.rotary_emb\.inv_freq$",),
    "mixtral": (r"\.rotary_emb\.inv_freq$",), "gpt2": (r"\.attn\.(masked_)?bias$",),
    "qwen3": (r"\.rotary_emb\.inv_freq$",), "qwen3_moe": (r"\.rotary_emb\.inv_freq$",),
}


@dataclass(frozen=True)
class Rule:
    """One universal tensor and the HF tensors holding its numbers."""

    megatron: str
    kind: str
    hf: tuple[str, ...]


def _fail(arch: str, field: str, value, why: str) -> UCPError:
    return UCPError(f"cannot export as HF {arch}: model config {field}={value!r}: {why}")


def _differs(value, default) -> bool:
    """A config value other than megatron-core's default (None counts as False)."""
    return value != default and not (default is False and value is None)


def check_arch(arch: str) -> str:
    if arch not in ARCHS:
        raise UCPError(f"unknown HF architecture {arch!r}; supported: {', '.join(ARCHS)}")
    return arch


# ------------------------------------------------------------------------- megatron side


def features(cfg: dict) -> set[str]:
    """Which optional parameters a megatron model has (see `FEATURES`)."""
    out = set()
    if not cfg.get("share_embeddings_and_output_weights", True):
        out.add("untied")
    if cfg.get("add_bias_linear", True):
        out |= {"linear_bias", "qkv_bias"}
    if cfg.get("add_qkv_bias", False):
        out.add("qkv_bias")
    if cfg.get("num_moe_experts"):
        out.add("moe")
    if cfg.get("qk_layernorm"):
        out.add("qk_norm")
    return out


def rules(arch: str, cfg: dict) -> list[Rule]:
    """Every universal tensor of a megatron model of config `cfg` as HF `arch` holds it."""
    feats = features(cfg)
    if arch == "gpt2":
        glob, layer, per_expert = _GPT2_GLOBAL, _GPT2_LAYER, []
    elif arch == "mixtral":
        glob, layer, per_expert = _ROTARY_GLOBAL, _ROTARY_ATTENTION + _MIXTRAL_ROUTER, _MIXTRAL_EXPERT
    elif arch == "qwen3_moe":
        glob, layer = _ROTARY_GLOBAL, _ROTARY_ATTENTION + _QK_NORM + _QWEN3_MOE_ROUTER
        per_expert = _QWEN3_MOE_EXPERT
    else:
        glob, layer, per_expert = _ROTARY_GLOBAL, _ROTARY_ATTENTION + _QK_NORM + _ROTARY_DENSE_MLP, []
    out = [Rule(m, kind, hf) for m, kind, hf, when in glob if not when or when in feats]
    for i in range(cfg["num_layers"]):
        out += [Rule(m.format(i=i), kind, tuple(h.format(i=i) for h in hf))
                for m, kind, hf, when in layer if not when or when in feats]
        experts = (cfg.get("num_moe_experts") or 0) if per_expert else 0
        for e in range(experts):
            out += [Rule(m.format(i=i, e=e), kind, tuple(h.format(i=i, e=e) for h in hf))
                    for m, kind, hf, when in per_expert if not when or when in feats]
    return out


def check_exportable(arch: str, cfg: dict, hints: dict) -> None:
    """Refuse a megatron model (manifest `model`, plus Megatron-LM args `hints` when known) that
    HF `arch` cannot represent exactly, naming the config field."""
    get = cfg.get
    common = [  # (field, megatron-core default, why it matters)
        ("multi_latent_attention", False, "multi-latent attention has other projections"),
        ("qk_layernorm", False, "HF {arch} has no QK-norm"),
        ("qk_l2_norm", False, "HF {arch} has no QK L2-norm"),
        ("softmax_scale", None, "HF {arch} scales attention by 1/sqrt(head_dim)"),
        ("attention_output_gate", False, "HF {arch} has no attention output gate"),
        ("apply_residual_connection_post_layernorm", False, "HF {arch} adds the residual before the norm"),
        ("layernorm_zero_centered_gamma", False, "HF {arch} norms scale by the weight itself"),
        ("window_size", None, "sliding-window attention is not exported"),
        ("experimental_attention_variant", None, "HF {arch} has standard attention"),
        ("softmax_type", "vanilla", "HF {arch} has vanilla softmax attention"),
        ("mtp_num_layers", None, "multi-token prediction layers have no place in HF {arch}"),
        ("heterogeneous_block_specs", False, "HF {arch} layers are all alike"),
    ]
    if arch in QK_NORM:
        common = [c for c in common if c[0] != "qk_layernorm"]
        if not get("qk_layernorm"):
            raise _fail(arch, "qk_layernorm", get("qk_layernorm"), f"HF {arch} normalizes q and k "
                        "per head; a model without QK-norm is --arch llama"
                        + (" or qwen2" if arch == "qwen3" else " or mixtral"))
    for field, default, why in common:
        if _differs(get(field, default), default):
            raise _fail(arch, field, get(field), why.format(arch=arch))
    h = Heads.of(cfg)
    if h.heads % h.groups:
        raise _fail(arch, "num_query_groups", h.groups, "does not divide num_attention_heads")
    feats = features(cfg)
    if arch in ROTARY:
        _require(arch, cfg, "position_embedding_type", "rope", "HF {arch} uses rotary position embeddings")
        _require(arch, cfg, "normalization", "RMSNorm", "HF {arch} uses RMSNorm")
        _require(arch, cfg, "gated_linear_unit", True, "HF {arch} has a SwiGLU MLP (gate_proj/up_proj)")
        if get("rotary_interleaved", False):
            raise _fail(arch, "rotary_interleaved", True, "HF rotates the two halves of each head")
        if hints.get("activation") not in (None, "swiglu"):
            raise _fail(arch, "activation", hints["activation"], f"HF {arch} needs SwiGLU (silu)")
        if float(hints.get("rotary_percent") or get("rotary_percent") or 1.0) != 1.0:
            raise _fail(arch, "rotary_percent", hints.get("rotary_percent") or get("rotary_percent"),
                        "partial rotary embeddings are not exported")
        if hints.get("use_rope_scaling") or get("rope_scaling"):
            raise _fail(arch, "rope_scaling", True, "scaled RoPE is not exported")
    if arch == "llama" and feats & {"qkv_bias", "linear_bias"} not in (set(), {"qkv_bias", "linear_bias"}):
        raise _fail(arch, "add_qkv_bias", True, "Llama's attention_bias covers q/k/v and o_proj "
                    "together; a model with q/k/v biases only is --arch qwen2")
    if arch == "qwen2":
        if "linear_bias" in feats:
            raise _fail(arch, "add_bias_linear", True, "Qwen2 has biases on q/k/v only, not on "
                        "o_proj or the MLP")
        if "qkv_bias" not in feats:
            raise _fail(arch, "add_qkv_bias", False, "Qwen2 has q/k/v biases; a model without them "
                        "is --arch llama")
    if arch in QK_NORM and feats & {"qkv_bias", "linear_bias"}:
        raise _fail(arch, "add_bias_linear" if "linear_bias" in feats else "add_qkv_bias", True,
                    f"HF {arch} has no MLP biases, and its attention_bias covers q/k/v and o_proj "
                    "together")
    if arch in MOE:
        name = {"mixtral": "Mixtral", "qwen3_moe": "Qwen3-MoE"}[arch]
        if feats & {"qkv_bias", "linear_bias"}:
            raise _fail(arch, "add_bias_linear" if "linear_bias" in feats else "add_qkv_bias", True,
                        f"{name} has no biases")
        if "moe" not in feats:
            raise _fail(arch, "num_moe_experts", get("num_moe_experts"), f"{name} is a MoE model; "
                        f"a dense model is --arch {'llama' if arch == 'mixtral' else 'qwen3'}")
        moe = [("moe_router_score_function", "softmax", f"{name}'s router scores are a softmax"),
               ("moe_router_topk_scaling_factor", None, f"{name} does not scale routing weights"),
               ("moe_router_enable_expert_bias", False, f"{name}'s router has no expert bias"),
               ("moe_shared_expert_intermediate_size", None, f"{name} has no shared experts"),
               ("moe_router_num_groups", None, f"{name} routes without expert groups"),
               ("moe_layer_freq", 1, f"every {name} layer is a MoE layer")]
        if arch == "mixtral":  # Qwen3-MoE's norm_topk_prob=false is megatron's pre-softmax routing
            moe.append(("moe_router_pre_softmax", False, "Mixtral renormalizes the top-k softmax weights"))
        for field, default, why in moe:
            if _differs(get(field, default), default):
                raise _fail(arch, field, get(field), why)
        ffn = get("moe_ffn_hidden_size")
        if arch == "mixtral" and ffn not in (None, get("ffn_hidden_size")):
            raise _fail(arch, "moe_ffn_hidden_size", ffn, "Mixtral's intermediate_size is both; "
                        f"ffn_hidden_size is {get('ffn_hidden_size')}")
    elif "moe" in feats:
        raise _fail(arch, "num_moe_experts", get("num_moe_experts"),
                    "a MoE model is --arch qwen3_moe" if arch in QK_NORM else "a MoE model is --arch mixtral")
    if arch == "gpt2":
        _require(arch, cfg, "position_embedding_type", "learned_absolute",
                 "HF gpt2 learns absolute position embeddings (wpe)")
        _require(arch, cfg, "normalization", "LayerNorm", "HF gpt2 uses LayerNorm")
        _require(arch, cfg, "gated_linear_unit", False, "HF gpt2 has a plain MLP (c_fc, c_proj)")
        if "linear_bias" not in feats:
            raise _fail(arch, "add_bias_linear", False, "HF gpt2 has a bias on every linear layer")
        if h.groups != h.heads:
            raise _fail(arch, "num_query_groups", h.groups, "HF gpt2 has no grouped-query attention")
        if h.heads * h.head_dim != cfg["hidden_size"]:
            raise _fail(arch, "kv_channels", h.head_dim, "HF gpt2's head_dim is hidden_size / heads")
        if hints.get("activation") not in (None, "gelu", "openai_gelu"):
            raise _fail(arch, "activation", hints["activation"], "HF gpt2 has a GELU MLP")


def _require(arch: str, cfg: dict, field: str, value, why: str) -> None:
    if field in cfg and cfg[field] != value:
        raise _fail(arch, field, cfg[field], why.format(arch=arch))


def hf_config(arch: str, cfg: dict, *, vocab: int, dtype: str, rope_theta: float,
              hints: dict, tokens: dict) -> dict:
    """config.json of HF `arch` for megatron model config `cfg` (already `check_exportable`)."""
    h = Heads.of(cfg)
    tied = "untied" not in features(cfg)
    eps = cfg.get("layernorm_epsilon", 1e-5)
    common = {"architectures": [HF_CLASS[arch]], "model_type": arch, "vocab_size": vocab,
              "tie_word_embeddings": tied, "initializer_range": cfg.get("init_method_std", 0.02),
              "dtype": dtype, "use_cache": True,
              "bos_token_id": tokens.get("bos_token_id"), "eos_token_id": tokens.get("eos_token_id"),
              "pad_token_id": tokens.get("pad_token_id")}
    if arch == "gpt2":
        return {**common, "n_positions": cfg["max_sequence_length"], "n_embd": cfg["hidden_size"],
                "n_layer": cfg["num_layers"], "n_head": h.heads, "n_inner": cfg["ffn_hidden_size"],
                "activation_function": "gelu_new" if hints.get("activation") == "openai_gelu" else "gelu",
                "layer_norm_epsilon": eps, "resid_pdrop": cfg.get("hidden_dropout", 0.0),
                "embd_pdrop": cfg.get("hidden_dropout", 0.0),
                "attn_pdrop": cfg.get("attention_dropout", 0.0), "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}
    out = {**common, "hidden_size": cfg["hidden_size"], "num_hidden_layers": cfg["num_layers"],
           "num_attention_heads": h.heads, "num_key_value_heads": h.groups, "head_dim": h.head_dim,
           "intermediate_size": cfg.get("moe_ffn_hidden_size") or cfg["ffn_hidden_size"],
           "hidden_act": "silu", "max_position_embeddings": cfg.get("max_sequence_length"),
           "rms_norm_eps": eps, "attention_dropout": cfg.get("attention_dropout", 0.0),
           "rope_parameters": {"rope_type": "default", "rope_theta": float(rope_theta)}}
    if out["max_position_embeddings"] is None:  # unknown: transformers' default, as the source's
        del out["max_position_embeddings"]
    if arch == "llama":
        bias = "linear_bias" in features(cfg)
        out.update(attention_bias=bias, mlp_bias=bias, pretraining_tp=1)
    elif arch == "qwen2":
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg["num_layers"],
                   layer_types=["full_attention"] * cfg["num_layers"])
    elif arch == "mixtral":
        out.update(num_local_experts=cfg["num_moe_experts"], num_experts_per_tok=cfg["moe_router_topk"],
                   sliding_window=None, output_router_logits=False, router_jitter_noise=0.0,
                   router_aux_loss_coef=cfg.get("moe_aux_loss_coeff") or 0.0)
    if arch in QK_NORM:
        out.update(attention_bias=False, use_sliding_window=False, sliding_window=None,
                   max_window_layers=cfg["num_layers"], layer_types=["full_attention"] * cfg["num_layers"])
    if arch == "qwen3_moe":
        # Hub config names; intermediate_size is the dense MLP's (mlp_only_layers, none here)
        # num_experts as the Hub's configs and transformers 4 spell it; num_local_experts, transformers 5
        out.update(num_experts=cfg["num_moe_experts"], num_local_experts=cfg["num_moe_experts"],
                   num_experts_per_tok=cfg["moe_router_topk"],
                   moe_intermediate_size=cfg.get("moe_ffn_hidden_size") or cfg["ffn_hidden_size"],
                   intermediate_size=cfg["ffn_hidden_size"],
                   norm_topk_prob=not cfg.get("moe_router_pre_softmax", False),
                   decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
                   router_aux_loss_coef=cfg.get("moe_aux_loss_coeff") or 0.0)
    return out


def hints_from_args(args) -> dict:
    """What a Megatron-LM run's args say that megatron-core's model config does not."""
    act = next((flag for flag in ("swiglu", "squared_relu", "quick_geglu", "openai_gelu")
                if getattr(args, flag, False)), "gelu")  # megatron-core's default: exact GELU
    return {"activation": act, "rotary_base": getattr(args, "rotary_base", None),
            "rotary_percent": getattr(args, "rotary_percent", None),
            "use_rope_scaling": getattr(args, "use_rope_scaling", False)}


# ------------------------------------------------------------------------------- HF side

# transformers' defaults for fields a config.json may leave out
_HF_DEFAULTS = {
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "tie_word_embeddings": False,
              "rope_theta": 10000.0, "hidden_act": "silu"},
    "qwen2": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": False,
              "rope_theta": 10000.0, "hidden_act": "silu"},
    "mixtral": {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096 * 32,
                "tie_word_embeddings": False, "rope_theta": 1e6, "hidden_act": "silu",
                "num_experts_per_tok": 2},
    "gpt2": {"layer_norm_epsilon": 1e-5, "n_positions": 1024, "tie_word_embeddings": True,
             "activation_function": "gelu_new"},
    "qwen3": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": False,
              "rope_theta": 10000.0, "hidden_act": "silu", "head_dim": 128},
    "qwen3_moe": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": False,
                  "rope_theta": 10000.0, "hidden_act": "silu", "num_experts_per_tok": 8,
                  "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []},
}
GPT2_GELUS = {"gelu": "gelu", "gelu_new": "openai_gelu", "gelu_pytorch_tanh": "openai_gelu"}


def arch_of(hf: dict, where: str) -> str:
    arch = hf.get("model_type")
    if arch not in ARCHS:
        raise UCPError(f"{where}: config.json model_type {arch!r} is not supported; import-hf reads "
                       f"{', '.join(ARCHS)}")
    return arch


def _rope(arch: str, hf: dict) -> tuple[float, str, float]:
    """(rope_theta, rope_type, partial rotary factor) of a config of transformers 4 or 5."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", _HF_DEFAULTS[arch]["rope_theta"]))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    return float(theta), kind, float(partial)


def megatron_args(arch: str, hf: dict, where: str) -> tuple[argparse.Namespace, dict]:
    """Megatron-LM style args of the megatron-core model equal to HF config `hf` (one rank), and
    what the megatron run must set that the model config does not record (activation, rope)."""
    d = {**_HF_DEFAULTS[arch], **{k: v for k, v in hf.items() if v is not None}}

    def refuse(field: str, why: str) -> UCPError:
        return UCPError(f"{where}: cannot import HF {arch}: config.json {field}={d.get(field)!r}: {why}")

    args = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, world_size=1,
                data_parallel_size=1, params_dtype=torch.float32, fp16=False, bf16=False,
                transformer_impl="local", hidden_dropout=0.0, qk_layernorm=False,
                init_method_std=d.get("initializer_range", 0.02), rotary_percent=1.0)
    if arch == "gpt2":
        if d["activation_function"] not in GPT2_GELUS:
            raise refuse("activation_function", f"megatron-core has {sorted(GPT2_GELUS)}")
        if d.get("scale_attn_by_inverse_layer_idx"):
            raise refuse("scale_attn_by_inverse_layer_idx", "megatron-core has no per-layer scaling")
        if not d.get("scale_attn_weights", True):
            raise refuse("scale_attn_weights", "megatron-core scales attention by 1/sqrt(head_dim)")
        hidden, heads = d["n_embd"], d["n_head"]
        args.update(num_layers=d["n_layer"], hidden_size=hidden, num_attention_heads=heads,
                    ffn_hidden_size=d.get("n_inner") or 4 * hidden, kv_channels=hidden // heads,
                    group_query_attention=False, num_query_groups=None, normalization="LayerNorm",
                    layernorm_epsilon=d["layer_norm_epsilon"], swiglu=False, add_bias_linear=True,
                    add_qkv_bias=True, position_embedding_type="learned_absolute",
                    max_position_embeddings=d["n_positions"], attention_dropout=d.get("attn_pdrop", 0.0))
        run = {"activation": GPT2_GELUS[d["activation_function"]]}
    else:
        if d["hidden_act"] != "silu":
            raise refuse("hidden_act", "megatron-core's SwiGLU MLP uses silu")
        theta, kind, partial = _rope(arch, d)
        if kind != "default":
            raise refuse("rope_type", f"{kind!r} RoPE scaling is not imported (default only)")
        if partial != 1.0:
            raise refuse("partial_rotary_factor", "partial rotary embeddings are not imported")
        if d.get("use_sliding_window") or (arch == "mixtral" and d.get("sliding_window")):
            raise refuse("sliding_window", "megatron-core's local attention has no sliding window")
        bias_attn, bias_mlp = bool(d.get("attention_bias")), bool(d.get("mlp_bias"))
        if arch in QK_NORM and bias_attn:
            raise refuse("attention_bias", f"HF {arch} has no MLP biases; megatron-core's "
                         "add_bias_linear puts biases on every linear layer or none")
        if bias_attn != bias_mlp:
            raise refuse("attention_bias", f"with mlp_bias={bias_mlp}: megatron-core's "
                         "add_bias_linear puts biases on every linear layer or none")
        heads = d["num_attention_heads"]
        groups = d.get("num_key_value_heads") or heads
        if heads % groups:
            raise refuse("num_key_value_heads", f"does not divide num_attention_heads={heads}")
        args.update(num_layers=d["num_hidden_layers"], hidden_size=d["hidden_size"],
                    num_attention_heads=heads, group_query_attention=groups != heads,
                    num_query_groups=groups, ffn_hidden_size=d["intermediate_size"],
                    kv_channels=d.get("head_dim") or d["hidden_size"] // heads,
                    normalization="RMSNorm", layernorm_epsilon=d["rms_norm_eps"], swiglu=True,
                    add_bias_linear=bias_attn, add_qkv_bias=arch == "qwen2" or bias_attn,
                    position_embedding_type="rope", rotary_base=theta,
                    max_position_embeddings=d["max_position_embeddings"],
                    attention_dropout=d.get("attention_dropout", 0.0))
        run = {"activation": "swiglu", "rotary_base": theta}
        if arch in QK_NORM:
            args["qk_layernorm"] = True
        if arch == "mixtral":
            args.update(num_experts=d["num_local_experts"], moe_router_topk=d["num_experts_per_tok"],
                        moe_ffn_hidden_size=d["intermediate_size"])
        if arch == "qwen3_moe":
            if d["decoder_sparse_step"] != 1 or d["mlp_only_layers"]:
                field = "decoder_sparse_step" if d["decoder_sparse_step"] != 1 else "mlp_only_layers"
                raise refuse(field, "dense layers between MoE layers are not imported (every layer "
                             "must be a MoE layer)")
            args.update(num_experts=d.get("num_experts", d.get("num_local_experts")),
                        moe_router_topk=d["num_experts_per_tok"],
                        moe_ffn_hidden_size=d["moe_intermediate_size"],
                        moe_router_pre_softmax=not d["norm_topk_prob"])
    args.update(padded_vocab_size=d["vocab_size"],
                untie_embeddings_and_output_weights=not d["tie_word_embeddings"])
    return argparse.Namespace(**args), run
