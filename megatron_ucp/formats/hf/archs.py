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
import math
import re
from dataclasses import dataclass

import torch

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.hf.transforms import Heads
from megatron_ucp.formats.megatron_common import YARN_FROM_ARGS

ARCHS = ("llama", "qwen2", "mixtral", "gpt2", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss", "nemotron_h")
HF_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "mixtral": "MixtralForCausalLM", "gpt2": "GPT2LMHeadModel",
            "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM",
            "nemotron_h": "NemotronHForCausalLM"}
# RMSNorm, SwiGLU, rotary positions, no LayerNorm biases
ROTARY = ("llama", "qwen2", "mixtral", "qwen3", "qwen3_moe")
QK_NORM = ("qwen3", "qwen3_moe")  # RMSNorm over each head's q and k (megatron-core: qk_layernorm)
MOE = ("mixtral", "qwen3_moe")
# GPT-OSS's clamped SwiGLU: megatron-core's gated quick_gelu (x * sigmoid(1.702 x)) with
# glu_linear_offset 1 and activation_func_clamp_value = HF swiglu_limit
QUICK_GELU = "megatron.core.fusions.fused_bias_geglu.quick_gelu"
QUICK_GELU_ALPHA = 1.702

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
# DeepSeek-V3 (decoder layers and MTP layers alike): {m} the megatron layer prefix, {h} the HF
# one. MLA's projections keep their element order: kv_a_proj_with_mqa is [kv latent; shared rope
# key], q_b_proj / kv_b_proj are per head [no-rope; rope] / [k; v], as megatron-core's. The rope
# rows are in DeepSeek's interleaved-pair order in both (megatron-core's MLA de-interleaves them
# before rotating, as transformers does with rope_interleave=True).
# Norms carry Transformer Engine's fused names (param_spec.TE_FUSED_NORMS): the q / kv latent
# norms are the up-projections' layer_norm_weight, a dense MLP's norm linear_fc1's.
# (universal, transform, HF, "" | "q_lora" | "no_q_lora")
_DSV3_ATTENTION: list[Entry] = [
    ("{m}input_layernorm.weight", "copy", ("{h}input_layernorm.weight",), ""),
    ("{m}self_attention.linear_q_down_proj.weight", "copy", ("{h}self_attn.q_a_proj.weight",), "q_lora"),
    ("{m}self_attention.linear_q_up_proj.layer_norm_weight", "copy", ("{h}self_attn.q_a_layernorm.weight",),
     "q_lora"),
    ("{m}self_attention.linear_q_up_proj.weight", "copy", ("{h}self_attn.q_b_proj.weight",), "q_lora"),
    ("{m}self_attention.linear_q_proj.weight", "copy", ("{h}self_attn.q_proj.weight",), "no_q_lora"),
    ("{m}self_attention.linear_kv_down_proj.weight", "copy", ("{h}self_attn.kv_a_proj_with_mqa.weight",), ""),
    ("{m}self_attention.linear_kv_up_proj.layer_norm_weight", "copy",
     ("{h}self_attn.kv_a_layernorm.weight",), ""),
    ("{m}self_attention.linear_kv_up_proj.weight", "copy", ("{h}self_attn.kv_b_proj.weight",), ""),
    ("{m}self_attention.linear_proj.weight", "copy", ("{h}self_attn.o_proj.weight",), ""),
]
_DSV3_DENSE: list[Entry] = [
    ("{m}mlp.linear_fc1.layer_norm_weight", "copy", ("{h}post_attention_layernorm.weight",), ""),
    ("{m}mlp.linear_fc1.weight", "gate_up", ("{h}mlp.gate_proj.weight", "{h}mlp.up_proj.weight"), ""),
    ("{m}mlp.linear_fc2.weight", "copy", ("{h}mlp.down_proj.weight",), ""),
]
# the router's aux-loss-free expert bias (a buffer in megatron-core) is DeepSeek's
# e_score_correction_bias; experts in the Hub layout (transformers 5 fuses them when it loads)
_DSV3_MOE: list[Entry] = [
    ("{m}pre_mlp_layernorm.weight", "copy", ("{h}post_attention_layernorm.weight",), ""),
    ("{m}mlp.router.weight", "copy", ("{h}mlp.gate.weight",), ""),
    ("{m}mlp.router.expert_bias", "copy", ("{h}mlp.gate.e_score_correction_bias",), ""),
    ("{m}mlp.shared_experts.linear_fc1.weight", "gate_up",
     ("{h}mlp.shared_experts.gate_proj.weight", "{h}mlp.shared_experts.up_proj.weight"), ""),
    ("{m}mlp.shared_experts.linear_fc2.weight", "copy", ("{h}mlp.shared_experts.down_proj.weight",), ""),
]
_DSV3_EXPERT: list[Entry] = [
    ("{m}mlp.experts.experts.{e}.linear_fc1.weight", "gate_up",
     ("{h}mlp.experts.{e}.gate_proj.weight", "{h}mlp.experts.{e}.up_proj.weight"), ""),
    ("{m}mlp.experts.experts.{e}.linear_fc2.weight", "copy", ("{h}mlp.experts.{e}.down_proj.weight",), ""),
]
# a multi-token prediction layer k is DeepSeek's extra decoder layer num_hidden_layers + k
_DSV3_MTP: list[Entry] = [
    ("mtp.layers.{k}.enorm.weight", "copy", ("{h}enorm.weight",), ""),
    ("mtp.layers.{k}.hnorm.weight", "copy", ("{h}hnorm.weight",), ""),
    ("mtp.layers.{k}.eh_proj.weight", "copy", ("{h}eh_proj.weight",), ""),
    ("mtp.layers.{k}.final_layernorm.weight", "copy", ("{h}shared_head.norm.weight",), ""),
]
# GPT-OSS: attention sinks are megatron-core's learnable softmax offset; the experts of a layer
# are one HF tensor each (expert index first), `slot` rules below
_GPT_OSS_LAYER: list[Entry] = [
    ("{m}self_attention.linear_qkv.layer_norm_weight", "copy", ("{h}input_layernorm.weight",), ""),
    ("{m}self_attention.linear_qkv.weight", "qkv",
     ("{h}self_attn.q_proj.weight", "{h}self_attn.k_proj.weight", "{h}self_attn.v_proj.weight"), ""),
    ("{m}self_attention.linear_qkv.bias", "qkv",
     ("{h}self_attn.q_proj.bias", "{h}self_attn.k_proj.bias", "{h}self_attn.v_proj.bias"), ""),
    ("{m}self_attention.core_attention.softmax_offset", "copy", ("{h}self_attn.sinks",), ""),
    ("{m}self_attention.linear_proj.weight", "copy", ("{h}self_attn.o_proj.weight",), ""),
    ("{m}self_attention.linear_proj.bias", "copy", ("{h}self_attn.o_proj.bias",), ""),
    ("{m}mlp.linear_fc1.layer_norm_weight", "copy", ("{h}post_attention_layernorm.weight",), ""),
    ("{m}mlp.router.weight", "copy", ("{h}mlp.router.weight",), ""),
    ("{m}mlp.router.bias", "copy", ("{h}mlp.router.bias",), ""),
]
_GPT_OSS_EXPERTS: list[Entry] = [
    ("{m}mlp.experts.experts.{e}.linear_fc1.weight", "gate_up_mix_t", ("{h}mlp.experts.gate_up_proj",), ""),
    ("{m}mlp.experts.experts.{e}.linear_fc1.bias", "gate_up_mix", ("{h}mlp.experts.gate_up_proj_bias",), ""),
    ("{m}mlp.experts.experts.{e}.linear_fc2.weight", "transpose", ("{h}mlp.experts.down_proj",), ""),
    ("{m}mlp.experts.experts.{e}.linear_fc2.bias", "copy", ("{h}mlp.experts.down_proj_bias",), ""),
]
# Nemotron-H: megatron-core's hybrid model (MambaModel), one HF block per layer of its pattern, each
# a norm and a mixer, in the Hub layout (`backbone.`, experts one tensor each; transformers 5
# renames and fuses them when it loads). Mamba-2's in_proj [z; x; B; C; dt] and conv1d [x; B; C]
# are in the same element order in both (HF splits [gate; xBC; dt], then xBC into [x; B; C]); A_log,
# D, dt_bias per head; the gated norm per channel. Every layer's input norm is the layer's `norm`.
NEMOTRON_H_LAYERS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_NH_GLOBAL: list[Entry] = [
    ("embedding.word_embeddings.weight", "copy", ("backbone.embeddings.weight",), ""),
    ("decoder.final_norm.weight", "copy", ("backbone.norm_f.weight",), ""),
    ("output_layer.weight", "copy", ("lm_head.weight",), "untied"),
]
_NH_MAMBA: list[Entry] = [
    ("{m}mixer.in_proj.layer_norm_weight", "copy", ("{h}norm.weight",), ""),
    ("{m}mixer.in_proj.weight", "copy", ("{h}mixer.in_proj.weight",), ""),
    ("{m}mixer.conv1d.weight", "copy", ("{h}mixer.conv1d.weight",), ""),
    ("{m}mixer.conv1d.bias", "copy", ("{h}mixer.conv1d.bias",), ""),
    ("{m}mixer.A_log", "copy", ("{h}mixer.A_log",), ""),
    ("{m}mixer.D", "copy", ("{h}mixer.D",), ""),
    ("{m}mixer.dt_bias", "copy", ("{h}mixer.dt_bias",), ""),
    ("{m}mixer.norm.weight", "copy", ("{h}mixer.norm.weight",), ""),
    ("{m}mixer.out_proj.weight", "copy", ("{h}mixer.out_proj.weight",), ""),
]
_NH_ATTENTION: list[Entry] = [
    ("{m}self_attention.linear_qkv.layer_norm_weight", "copy", ("{h}norm.weight",), ""),
    ("{m}self_attention.linear_qkv.weight", "qkv",
     ("{h}mixer.q_proj.weight", "{h}mixer.k_proj.weight", "{h}mixer.v_proj.weight"), ""),
    ("{m}self_attention.linear_proj.weight", "copy", ("{h}mixer.o_proj.weight",), ""),
]
_NH_MLP: list[Entry] = [
    ("{m}mlp.linear_fc1.layer_norm_weight", "copy", ("{h}norm.weight",), ""),
    ("{m}mlp.linear_fc1.weight", "copy", ("{h}mixer.up_proj.weight",), ""),
    ("{m}mlp.linear_fc2.weight", "copy", ("{h}mixer.down_proj.weight",), ""),
]
_NH_MOE: list[Entry] = [
    ("{m}pre_mlp_layernorm.weight", "copy", ("{h}norm.weight",), ""),
    ("{m}mlp.router.weight", "copy", ("{h}mixer.gate.weight",), ""),
    ("{m}mlp.router.expert_bias", "copy", ("{h}mixer.gate.e_score_correction_bias",), ""),
    ("{m}mlp.shared_experts.linear_fc1.weight", "copy", ("{h}mixer.shared_experts.up_proj.weight",), ""),
    ("{m}mlp.shared_experts.linear_fc2.weight", "copy", ("{h}mixer.shared_experts.down_proj.weight",), ""),
]
_NH_EXPERT: list[Entry] = [
    ("{m}mlp.experts.experts.{e}.linear_fc1.weight", "copy", ("{h}mixer.experts.{e}.up_proj.weight",), ""),
    ("{m}mlp.experts.experts.{e}.linear_fc2.weight", "copy", ("{h}mixer.experts.{e}.down_proj.weight",), ""),
]
# HF settings megatron-core's model does not hold and that change no result beyond rounding (the
# Mamba scan's chunk length): export-hf writes those of the model import-hf read, if any
RECORDED_HF = {"nemotron_h": ("chunk_size",)}
# tensors some HF checkpoints carry that are not parameters (recomputed buffers): skipped on import
IGNORED_HF = {
    "llama": (r"\.rotary_emb\.inv_freq$",), "qwen2": (r"\.rotary_emb\.inv_freq$",),
    "mixtral": (r"\.rotary_emb\.inv_freq$",), "gpt2": (r"\.attn\.(masked_)?bias$",),
    "qwen3": (r"\.rotary_emb\.inv_freq$",), "qwen3_moe": (r"\.rotary_emb\.inv_freq$",),
    "deepseek_v3": (r"\.rotary_emb\.inv_freq$",), "gpt_oss": (r"\.rotary_emb\.inv_freq$",),
    "nemotron_h": (),
}


# universal tensors exported in fp32 whatever the export dtype: megatron-core keeps the router's
# expert bias in fp32, and transformers keeps DeepSeek-V3's e_score_correction_bias in fp32
# (_keep_in_fp32_modules_strict): routing compares sums of it with sigmoid scores
KEEP_FP32 = (r"\.mlp\.router\.expert_bias$",)


def keeps_fp32(name: str) -> bool:
    return any(re.search(p, name) for p in KEEP_FP32)


@dataclass(frozen=True)
class Rule:
    """One universal tensor and the HF tensors holding its numbers."""

    megatron: str
    kind: str
    hf: tuple[str, ...]
    # (e, n): the universal tensor is slice e of the one HF tensor stacking n experts (GPT-OSS)
    slot: tuple[int, int] | None = None


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


def moe_layers(cfg: dict) -> list[bool]:
    """Which decoder layers are MoE layers (megatron-core's moe_layer_freq: every n-th, or a list)."""
    n = cfg["num_layers"]
    if not cfg.get("num_moe_experts"):
        return [False] * n
    freq = cfg.get("moe_layer_freq", 1)
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(n)]
    return [bool(x) for x in freq]


def _fill(entries: list[Entry], feats: set[str], **names) -> list[Rule]:
    return [Rule(m.format(**names), kind, tuple(h.format(**names) for h in hf))
            for m, kind, hf, when in entries if not when or when in feats]


def _deepseek_v3_rules(cfg: dict) -> list[Rule]:
    feats = {"q_lora" if cfg.get("q_lora_rank") else "no_q_lora"}
    layers, mtp = cfg["num_layers"], cfg.get("mtp_num_layers") or 0
    moe = moe_layers(cfg)
    tied = "untied" not in features(cfg)
    mtp_prefixes = [f"model.layers.{layers + k}." for k in range(mtp)]
    embedding = ("model.embed_tokens.weight", *[h + "embed_tokens.weight" for h in mtp_prefixes])
    head = ("lm_head.weight", *[h + "shared_head.head.weight" for h in mtp_prefixes])
    if tied:  # the MTP heads are the embedding too
        embedding, head = embedding + head[1:], ()
    out = [Rule("embedding.word_embeddings.weight", "dup" if len(embedding) > 1 else "copy", embedding),
           Rule("decoder.final_layernorm.weight", "copy", ("model.norm.weight",))]
    if head:
        out.append(Rule("output_layer.weight", "dup" if len(head) > 1 else "copy", head))

    def layer(m: str, h: str, is_moe: bool) -> list[Rule]:
        rules = _fill(_DSV3_ATTENTION, feats, m=m, h=h)
        if not is_moe:
            return rules + _fill(_DSV3_DENSE, feats, m=m, h=h)
        rules += _fill(_DSV3_MOE, feats, m=m, h=h)
        for e in range(cfg["num_moe_experts"]):
            rules += _fill(_DSV3_EXPERT, feats, m=m, h=h, e=e)
        return rules

    for i in range(layers):
        out += layer(f"decoder.layers.{i}.", f"model.layers.{i}.", moe[i])
    for k, h in enumerate(mtp_prefixes):  # megatron-core builds MTP layers like the last layer
        out += _fill(_DSV3_MTP, feats, k=k, h=h)
        out += layer(f"mtp.layers.{k}.transformer_layer.", h, moe[-1])
    return out


def _gpt_oss_rules(cfg: dict) -> list[Rule]:
    feats = features(cfg)
    out = _fill(_ROTARY_GLOBAL, feats)
    experts = cfg["num_moe_experts"]
    for i in range(cfg["num_layers"]):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out += _fill(_GPT_OSS_LAYER, feats, m=m, h=h)
        for entry in _GPT_OSS_EXPERTS:  # expert after expert: each HF tensor is complete in turn
            for e in range(experts):
                (rule,) = _fill([entry], feats, m=m, h=h, e=e)
                out.append(Rule(rule.megatron, rule.kind, rule.hf, (e, experts)))
    return out


def nemotron_h_pattern(cfg: dict) -> str:
    """A hybrid model's layer symbols, one per decoder layer (megatron-core 0.19's pipeline-stage
    separators `|` dropped: they place layers, they are none)."""
    return (cfg.get("hybrid_layer_pattern") or "").replace("|", "")


def _nemotron_h_rules(cfg: dict) -> list[Rule]:
    feats = features(cfg)
    out = _fill(_NH_GLOBAL, feats)
    if "untied" not in feats:  # HF nemotron_h never ties lm_head: the embedding is stored twice
        out[0] = Rule(out[0].megatron, "dup", ("backbone.embeddings.weight", "lm_head.weight"))
    for i, symbol in enumerate(nemotron_h_pattern(cfg)):
        m, h = f"decoder.layers.{i}.", f"backbone.layers.{i}."
        table = {"M": _NH_MAMBA, "*": _NH_ATTENTION, "-": _NH_MLP, "E": _NH_MOE}.get(symbol)
        if table is None:
            raise _fail("nemotron_h", "hybrid_layer_pattern", cfg.get("hybrid_layer_pattern"),
                        f"layer {i} is {symbol!r}; HF nemotron_h has Mamba-2 (M), attention (*), "
                        "MLP (-) and MoE (E) layers")
        out += _fill(table, feats, m=m, h=h)
        if symbol == "E":
            for e in range(cfg["num_moe_experts"]):
                out += _fill(_NH_EXPERT, feats, m=m, h=h, e=e)
    return out


def rules(arch: str, cfg: dict) -> list[Rule]:
    """Every universal tensor of a megatron model of config `cfg` as HF `arch` holds it."""
    if arch == "nemotron_h":
        return _nemotron_h_rules(cfg)
    if arch == "deepseek_v3":
        return _deepseek_v3_rules(cfg)
    if arch == "gpt_oss":
        return _gpt_oss_rules(cfg)
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
    allowed = {"deepseek_v3": ("multi_latent_attention", "qk_layernorm", "mtp_num_layers"),
               "gpt_oss": ("window_size", "softmax_type")}.get(arch, ())
    if arch == "nemotron_h":
        for field, default, why in common:
            if _differs(get(field, default), default):
                raise _fail(arch, field, get(field), why.format(arch=arch))
        _check_nemotron_h(cfg, hints)
        return
    if get("hybrid_layer_pattern"):
        raise _fail(arch, "hybrid_layer_pattern", get("hybrid_layer_pattern"), "a hybrid (Mamba) "
                    "model is --arch nemotron_h")
    if arch in ("deepseek_v3", "gpt_oss"):
        for field, default, why in common:
            if field not in allowed and _differs(get(field, default), default):
                raise _fail(arch, field, get(field), why.format(arch=arch))
        _check_rope_model(arch, cfg, hints)
        if arch == "deepseek_v3":
            _check_deepseek_v3(cfg)
        else:
            _check_gpt_oss(cfg)
        return
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


def _check_rope_model(arch: str, cfg: dict, hints: dict) -> None:
    """What DeepSeek-V3 and GPT-OSS share: RMSNorm, a gated MLP, RoPE on whole heads, MoE."""
    if arch == "gpt_oss" and cfg.get("position_embedding_type") == "yarn":
        missing = [attr for attr, _, _ in YARN_FROM_ARGS if attr not in cfg]
        if missing:  # GPTModel cannot run YaRN without them: the record is damaged
            raise _fail(arch, missing[0], None, "a YaRN model's config records its yarn_* settings; "
                        "this checkpoint's manifest lacks them")
    else:  # (DeepSeek-V3's YaRN is MLA's rope_type)
        _require(arch, cfg, "position_embedding_type", "rope", "HF {arch} uses rotary position embeddings")
    _require(arch, cfg, "normalization", "RMSNorm", "HF {arch} uses RMSNorm")
    _require(arch, cfg, "gated_linear_unit", True, "HF {arch} has a gated MLP")
    if cfg.get("rotary_interleaved", False):
        raise _fail(arch, "rotary_interleaved", True, "HF rotates the two halves of each head")
    if float(hints.get("rotary_percent") or cfg.get("rotary_percent") or 1.0) != 1.0:
        raise _fail(arch, "rotary_percent", hints.get("rotary_percent") or cfg.get("rotary_percent"),
                    "partial rotary embeddings are not exported")
    if hints.get("use_rope_scaling") or cfg.get("rope_scaling"):
        raise _fail(arch, "rope_scaling", True, "Llama 3 RoPE scaling is not exported")
    if not cfg.get("num_moe_experts"):
        raise _fail(arch, "num_moe_experts", cfg.get("num_moe_experts"), f"HF {arch} is a MoE model")
    for field, default in (("moe_router_num_groups", None), ("moe_router_group_topk", None)):
        if arch == "gpt_oss" and _differs(cfg.get(field, default), default):
            raise _fail(arch, field, cfg.get(field), "GPT-OSS routes without expert groups")


def _check_deepseek_v3(cfg: dict) -> None:
    arch, get = "deepseek_v3", cfg.get
    if not get("multi_latent_attention"):
        raise _fail(arch, "multi_latent_attention", get("multi_latent_attention"),
                    "DeepSeek-V3's attention is multi-latent attention")
    if not get("qk_layernorm"):
        raise _fail(arch, "qk_layernorm", get("qk_layernorm"), "DeepSeek-V3 normalizes the q and kv "
                    "latents (q_a_layernorm, kv_a_layernorm)")
    if get("add_bias_linear", True) or get("add_qkv_bias"):
        raise _fail(arch, "add_bias_linear", True, "DeepSeek-V3's linear layers have no biases "
                    "(its attention_bias covers only the attention projections)")
    if get("layernorm_epsilon", 1e-5) != 1e-6:
        raise _fail(arch, "layernorm_epsilon", get("layernorm_epsilon", 1e-5), "HF deepseek_v3 "
                    "normalizes the q and kv latents with eps 1e-6 whatever rms_norm_eps says")
    if not str(get("activation_func", "silu")).endswith("silu"):
        raise _fail(arch, "activation_func", get("activation_func"), "DeepSeek-V3's MLP is SwiGLU")
    if get("rope_type", "yarn") not in ("yarn", "rope"):
        raise _fail(arch, "rope_type", get("rope_type"), "only rope and yarn are exported")
    if get("rope_type", "yarn") == "rope" and _yarn_mscale(get("rotary_scaling_factor", 40.0),
                                                         get("mscale_all_dim", 0.0)) != 1.0:
        raise _fail(arch, "mscale_all_dim", get("mscale_all_dim"), "megatron-core scales MLA's "
                    "softmax by it also without YaRN; transformers only with YaRN")
    topk, experts = get("moe_router_topk"), get("num_moe_experts")
    moe = [("moe_router_score_function", "sigmoid", "DeepSeek-V3's router scores are sigmoids"),
           ("moe_router_enable_expert_bias", True, "DeepSeek-V3's router adds e_score_correction_bias "
            "to choose experts"),
           ("moe_shared_expert_gate", False, "DeepSeek-V3's shared experts are not gated"),
           ("moe_router_pre_softmax", False, "DeepSeek-V3 normalizes the chosen sigmoid scores")]
    for field, want, why in moe:
        got = get(field)
        if (bool(got) != want) if isinstance(want, bool) else got != want:
            raise _fail(arch, field, got, why)
    shared = get("moe_shared_expert_intermediate_size")
    ffn = get("moe_ffn_hidden_size") or get("ffn_hidden_size")
    if not shared or shared % ffn:
        raise _fail(arch, "moe_shared_expert_intermediate_size", shared, "DeepSeek-V3's shared experts "
                    f"are n_shared_experts experts of moe_ffn_hidden_size={ffn}")
    moe_at = moe_layers(cfg)
    k = moe_at.index(True)
    if moe_at != [False] * k + [True] * (len(moe_at) - k):
        raise _fail(arch, "moe_layer_freq", get("moe_layer_freq"), "DeepSeek-V3's first "
                    "first_k_dense_replace layers are dense, every later one a MoE layer")
    groups, group_topk = get("moe_router_num_groups"), get("moe_router_group_topk")
    if groups and groups > 1 and (topk // (group_topk or 1) != 2 or experts // groups < 2):
        raise _fail(arch, "moe_router_group_topk", group_topk, "transformers scores an expert group "
                    "by its best two experts; megatron-core by its best topk / group_topk")


SQUARED_RELU = "megatron.core.activations.squared_relu"
# megatron-core's Mamba mixer normalizes its gated output with this eps, whatever layernorm_epsilon
MAMBA_NORM_EPS = 1e-5
MAMBA_CHUNK = 128  # the Mamba mixer's scan chunk length (megatron-core's default)
# transformers' Nemotron-H clamps softplus(dt + dt_bias) from below at time_step_min; megatron-core's
# mixer does not clamp. Written as the smallest normal float: only an fp32/bf16 softplus that
# underflows is raised to it (transformers' initialisation takes log(time_step_min), so not 0)
NO_DT_CLAMP = float(torch.finfo(torch.float32).tiny)


def nemotron_h_geometry(cfg: dict, shapes: dict[str, tuple[int, ...]]) -> dict:
    """What megatron-core's model config does not record of a hybrid model's Mamba mixers but its
    parameters show: the heads (when mamba_num_heads is unset: expand * hidden / head_dim) and the
    conv1d kernel width. Refuses a per-channel D (D_has_hdim), which HF keeps per head."""
    pattern = nemotron_h_pattern(cfg)
    if "M" not in pattern:
        return {}
    m = f"decoder.layers.{pattern.index('M')}.mixer."
    need = [m + n for n in ("A_log", "D", "conv1d.weight", "norm.weight")]
    if any(n not in shapes for n in need):
        return {}  # (plan names what is missing)
    heads = shapes[m + "A_log"][0]
    if shapes[m + "D"] != (heads,):
        raise _fail("nemotron_h", "D_has_hdim", True, f"{m}D has shape {list(shapes[m + 'D'])}, one "
                    f"per channel; HF nemotron_h's D has one per head ({heads})")
    if shapes[m + "norm.weight"][0] != heads * cfg["mamba_head_dim"]:
        raise _fail("nemotron_h", "mamba_head_dim", cfg["mamba_head_dim"], f"{heads} heads of it are not "
                    f"the {shapes[m + 'norm.weight'][0]} channels of {m}norm.weight")
    return {"mamba_num_heads": heads, "mamba_conv_kernel": shapes[m + "conv1d.weight"][-1]}


def _check_nemotron_h(cfg: dict, hints: dict) -> None:
    arch, get = "nemotron_h", cfg.get
    pattern = nemotron_h_pattern(cfg)
    if not pattern:
        raise _fail(arch, "hybrid_layer_pattern", get("hybrid_layer_pattern"), "HF nemotron_h is a "
                    "hybrid model: export megatron-core's MambaModel (a GPT model has no layer pattern)")
    odd = sorted(set(pattern) - set(NEMOTRON_H_LAYERS))
    if odd:
        raise _fail(arch, "hybrid_layer_pattern", get("hybrid_layer_pattern"), f"layer symbol(s) {odd} "
                    "have no HF nemotron_h layer; it has Mamba-2 (M), attention (*), MLP (-) and MoE (E)")
    _require(arch, cfg, "position_embedding_type", "none", "HF nemotron_h's attention has no position "
             "embedding")
    _require(arch, cfg, "normalization", "RMSNorm", "HF nemotron_h uses RMSNorm")
    _require(arch, cfg, "gated_linear_unit", False, "HF nemotron_h's MLPs and experts are not gated "
             "(up_proj, relu2, down_proj)")
    if get("activation_func", SQUARED_RELU) != SQUARED_RELU:
        raise _fail(arch, "activation_func", get("activation_func"), "HF nemotron_h's MLPs use relu2 "
                    "(megatron-core's squared_relu)")
    if hints.get("activation") not in (None, "squared_relu"):
        raise _fail(arch, "activation", hints["activation"], "HF nemotron_h's MLPs use relu2 "
                    "(megatron-core's squared_relu)")
    if get("activation_func_clamp_value") is not None:
        raise _fail(arch, "activation_func_clamp_value", get("activation_func_clamp_value"),
                    "HF nemotron_h does not clamp activations")
    if get("add_bias_linear", True) or get("add_qkv_bias"):
        raise _fail(arch, "add_bias_linear" if get("add_bias_linear", True) else "add_qkv_bias", True,
                    "HF nemotron_h's attention has no biases (and megatron-core's add_bias_linear puts "
                    "biases on every linear layer or none)")
    if "M" in pattern and get("layernorm_epsilon", 1e-5) != MAMBA_NORM_EPS:
        raise _fail(arch, "layernorm_epsilon", get("layernorm_epsilon"), "megatron-core's Mamba mixer "
                    f"normalizes its output with eps {MAMBA_NORM_EPS}; HF nemotron_h uses "
                    "layer_norm_epsilon for every norm")
    h = Heads.of(cfg)
    if "*" in pattern and h.heads % h.groups:
        raise _fail(arch, "num_query_groups", h.groups, "does not divide num_attention_heads")
    if "E" not in pattern:
        return
    topk, experts = get("moe_router_topk"), get("num_moe_experts")
    moe = [("moe_router_score_function", "sigmoid", "HF nemotron_h's router scores are sigmoids"),
           ("moe_router_enable_expert_bias", True, "HF nemotron_h's router adds "
            "e_score_correction_bias to choose experts"),
           ("moe_shared_expert_gate", False, "HF nemotron_h's shared experts are not gated"),
           ("moe_router_pre_softmax", False, "HF nemotron_h normalizes the chosen sigmoid scores"),
           ("moe_apply_probs_on_input", False, "HF nemotron_h weights the experts' outputs")]
    for field, want, why in moe:
        got = get(field)
        if (bool(got) != want) if isinstance(want, bool) else got != want:
            raise _fail(arch, field, got, why)
    if get("moe_latent_size") is not None:
        raise _fail(arch, "moe_latent_size", get("moe_latent_size"), "latent MoE projections are not "
                    "exported")
    if get("moe_expert_capacity_factor") is not None:
        raise _fail(arch, "moe_expert_capacity_factor", get("moe_expert_capacity_factor"), "HF "
                    "nemotron_h's experts drop no tokens")
    if not get("moe_shared_expert_intermediate_size"):
        raise _fail(arch, "moe_shared_expert_intermediate_size", get("moe_shared_expert_intermediate_size"),
                    "every HF nemotron_h MoE layer has a shared expert")
    groups, group_topk = get("moe_router_num_groups"), get("moe_router_group_topk")
    if groups and groups > 1 and (topk // (group_topk or 1) != 2 or experts // groups < 2):
        raise _fail(arch, "moe_router_group_topk", group_topk, "transformers scores an expert group "
                    "by its best two experts; megatron-core by its best topk / group_topk")


def _check_gpt_oss(cfg: dict) -> None:
    arch, get = "gpt_oss", cfg.get
    if get("softmax_type", "vanilla") != "learnable":
        raise _fail(arch, "softmax_type", get("softmax_type"), "GPT-OSS's attention has learnable "
                    "sinks (softmax_type='learnable')")
    if not get("add_bias_linear", True):
        raise _fail(arch, "add_bias_linear", False, "GPT-OSS has biases on q/k/v, o_proj, the router "
                    "and the experts")
    window = get("window_size")
    if window is not None and (len(window) != 2 or window[1] != 0 or window[0] < 0):
        raise _fail(arch, "window_size", window, "GPT-OSS's sliding window looks back only, "
                    "(w, 0) with w >= 0")
    if get("activation_func") != QUICK_GELU:
        raise _fail(arch, "activation_func", get("activation_func"), "GPT-OSS's experts use a "
                    "clamped SwiGLU x * sigmoid(1.702 x): megatron-core's quick_gelu")
    if get("glu_linear_offset", 0.0) != 1.0:
        raise _fail(arch, "glu_linear_offset", get("glu_linear_offset"), "GPT-OSS multiplies by "
                    "(up + 1)")
    if get("activation_func_clamp_value") is None:
        raise _fail(arch, "activation_func_clamp_value", None, "GPT-OSS clamps the gate and up "
                    "projections (swiglu_limit)")
    moe = [("moe_router_score_function", "softmax", "GPT-OSS's router takes a softmax"),
           ("moe_router_pre_softmax", False, "GPT-OSS takes the softmax over the top-k logits"),
           ("moe_router_topk_scaling_factor", None, "GPT-OSS does not scale routing weights"),
           ("moe_router_enable_expert_bias", False, "GPT-OSS's router has no expert bias"),
           ("moe_shared_expert_intermediate_size", None, "GPT-OSS has no shared experts"),
           ("moe_layer_freq", 1, "every GPT-OSS layer is a MoE layer")]
    for field, default, why in moe:
        if _differs(get(field, default), default):
            raise _fail(arch, field, get(field), why)


def _yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention scale (megatron-core's and transformers' get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _megatron_yarn_scale(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """The cos/sin scale megatron-core's YaRN applies: mscale(mscale) / mscale(mscale_all_dim)."""
    return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)


def _transformers_yarn_scale(factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    """The attention_factor transformers infers when a config gives none: megatron-core's ratio
    only when both are non-zero, else mscale(1)."""
    return _megatron_yarn_scale(factor, mscale, mscale_all_dim) if mscale and mscale_all_dim \
        else _yarn_mscale(factor, 1.0)


def _hf_yarn(rope_theta: float, *, factor: float, original: int, beta_fast: float, beta_slow: float,
             mscale: float, mscale_all_dim: float, truncate: bool | None = None) -> dict:
    """transformers' rope_parameters for megatron-core's YaRN settings."""
    rope = {"rope_type": "yarn", "rope_theta": float(rope_theta), "factor": factor,
            "original_max_position_embeddings": original, "beta_fast": beta_fast, "beta_slow": beta_slow,
            "mscale": mscale, "mscale_all_dim": mscale_all_dim}
    if truncate is not None:  # megatron-core's yarn_correction_range_round_to_int
        rope["truncate"] = truncate
    # say the scale where transformers would infer another one
    wanted = _megatron_yarn_scale(factor, mscale, mscale_all_dim)
    if _transformers_yarn_scale(factor, mscale, mscale_all_dim) != wanted:
        rope["attention_factor"] = wanted
    return rope


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
    if arch == "deepseek_v3":
        return {**common, **_deepseek_v3_config(cfg, rope_theta)}
    if arch == "gpt_oss":
        return {**common, **_gpt_oss_config(cfg, rope_theta)}
    if arch == "nemotron_h":
        return {**common, **_nemotron_h_config(cfg, tokens.get("chunk_size") or MAMBA_CHUNK)}
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


def _deepseek_v3_config(cfg: dict, rope_theta: float) -> dict:
    layers, get = cfg["num_layers"], cfg.get
    ffn = get("moe_ffn_hidden_size") or cfg["ffn_hidden_size"]
    topk, groups = cfg["moe_router_topk"], get("moe_router_num_groups") or 1
    if get("rope_type", "yarn") == "yarn":
        rope = _hf_yarn(rope_theta, factor=float(get("rotary_scaling_factor", 40.0)),
                        original=get("original_max_position_embeddings", 4096),
                        beta_fast=float(get("beta_fast", 32.0)), beta_slow=float(get("beta_slow", 1.0)),
                        mscale=float(get("mscale", 1.0)), mscale_all_dim=float(get("mscale_all_dim", 0.0)))
    else:
        rope = {"rope_type": "default", "rope_theta": float(rope_theta)}
    out = {"hidden_size": cfg["hidden_size"], "num_hidden_layers": layers,
           "num_attention_heads": cfg["num_attention_heads"],
           "num_key_value_heads": cfg["num_attention_heads"],
           "intermediate_size": cfg["ffn_hidden_size"], "moe_intermediate_size": ffn,
           "n_routed_experts": cfg["num_moe_experts"], "num_experts_per_tok": topk,
           "n_shared_experts": get("moe_shared_expert_intermediate_size") // ffn,
           "routed_scaling_factor": float(get("moe_router_topk_scaling_factor") or 1.0),
           "n_group": groups, "topk_group": get("moe_router_group_topk") or 1,
           "norm_topk_prob": topk > 1, "first_k_dense_replace": moe_layers(cfg).index(True),
           "kv_lora_rank": cfg["kv_lora_rank"], "q_lora_rank": get("q_lora_rank"),
           "qk_nope_head_dim": cfg["qk_head_dim"], "qk_rope_head_dim": cfg["qk_pos_emb_head_dim"],
           "v_head_dim": cfg["v_head_dim"], "head_dim": cfg["qk_pos_emb_head_dim"],
           "hidden_act": "silu", "rope_parameters": rope,
           "rope_interleave": True, "attention_bias": False,
           "max_position_embeddings": get("max_sequence_length"),
           "rms_norm_eps": get("layernorm_epsilon", 1e-5),
           "attention_dropout": get("attention_dropout", 0.0),
           "num_nextn_predict_layers": get("mtp_num_layers") or 0, "output_router_logits": False}
    if out["max_position_embeddings"] is None:
        del out["max_position_embeddings"]
    return out


def _nemotron_h_config(cfg: dict, chunk_size: int) -> dict:
    h, get = Heads.of(cfg), cfg.get
    pattern = nemotron_h_pattern(cfg)
    out = {"hidden_size": cfg["hidden_size"], "layers_block_type": [NEMOTRON_H_LAYERS[c] for c in pattern],
           "num_attention_heads": h.heads, "num_key_value_heads": h.groups, "head_dim": h.head_dim,
           "attention_bias": False, "attention_dropout": get("attention_dropout", 0.0),
           "sliding_window": None, "intermediate_size": cfg["ffn_hidden_size"], "mlp_hidden_act": "relu2",
           "mlp_bias": False, "use_bias": False, "layer_norm_epsilon": get("layernorm_epsilon", 1e-5),
           "max_position_embeddings": get("max_sequence_length"), "residual_in_fp32": False,
           "num_nextn_predict_layers": 0}
    if out["max_position_embeddings"] is None:
        del out["max_position_embeddings"]
    if "M" in pattern:
        heads, head_dim = cfg["mamba_num_heads"], cfg["mamba_head_dim"]
        out.update(ssm_state_size=cfg["mamba_state_dim"], mamba_num_heads=heads, mamba_head_dim=head_dim,
                   n_groups=cfg["mamba_num_groups"], conv_kernel=cfg["mamba_conv_kernel"],
                   mamba_hidden_act="silu", use_conv_bias=True, mamba_proj_bias=False,
                   chunk_size=chunk_size, time_step_min=NO_DT_CLAMP)
        if heads * head_dim % cfg["hidden_size"] == 0:  # (transformers reads heads and head_dim)
            out["expand"] = heads * head_dim // cfg["hidden_size"]
    if "E" in pattern:
        topk, groups = cfg["moe_router_topk"], get("moe_router_num_groups") or 1
        out.update(n_routed_experts=cfg["num_moe_experts"], num_experts_per_tok=topk,
                   moe_intermediate_size=get("moe_ffn_hidden_size") or cfg["ffn_hidden_size"],
                   moe_shared_expert_intermediate_size=cfg["moe_shared_expert_intermediate_size"],
                   n_shared_experts=1,
                   routed_scaling_factor=float(get("moe_router_topk_scaling_factor") or 1.0),
                   n_group=groups, topk_group=get("moe_router_group_topk") or 1, norm_topk_prob=topk > 1,
                   moe_latent_size=None, output_router_logits=False)
    return out


def gpt_oss_layer_types(cfg: dict) -> list[str]:
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


def _gpt_oss_config(cfg: dict, rope_theta: float) -> dict:
    h, get = Heads.of(cfg), cfg.get
    window = get("window_size")
    out = {"hidden_size": cfg["hidden_size"], "num_hidden_layers": cfg["num_layers"],
           "num_attention_heads": h.heads, "num_key_value_heads": h.groups, "head_dim": h.head_dim,
           "intermediate_size": get("moe_ffn_hidden_size") or cfg["ffn_hidden_size"],
           "num_local_experts": cfg["num_moe_experts"], "num_experts_per_tok": cfg["moe_router_topk"],
           # transformers' window counts the token itself: kv > q - sliding_window
           "sliding_window": window[0] + 1 if window else None,
           "layer_types": gpt_oss_layer_types(cfg), "attention_bias": True,
           "swiglu_alpha": QUICK_GELU_ALPHA, "swiglu_limit": float(cfg["activation_func_clamp_value"]),
           "hidden_act": "silu", "rope_parameters": {"rope_type": "default", "rope_theta": float(rope_theta)},
           "max_position_embeddings": get("max_sequence_length"),
           "rms_norm_eps": get("layernorm_epsilon", 1e-5),
           "attention_dropout": get("attention_dropout", 0.0), "output_router_logits": False,
           "router_aux_loss_coef": get("moe_aux_loss_coeff") or 0.0}
    if get("position_embedding_type") == "yarn":  # GPT-OSS's own: factor 32 of 4096, truncate false
        rope = _hf_yarn(rope_theta, factor=float(cfg["yarn_rotary_scaling_factor"]),
                        original=cfg["yarn_original_max_position_embeddings"],
                        beta_fast=float(cfg["yarn_beta_fast"]), beta_slow=float(cfg["yarn_beta_slow"]),
                        mscale=float(cfg["yarn_mscale"]), mscale_all_dim=float(cfg["yarn_mscale_all_dim"]),
                        truncate=bool(cfg["yarn_correction_range_round_to_int"]))
        if (rope["mscale"], rope["mscale_all_dim"]) == (1.0, 0.0):  # megatron-core's defaults:
            del rope["mscale"], rope["mscale_all_dim"]  # transformers' attention factor mscale(1)
        out["rope_parameters"] = rope
    if out["max_position_embeddings"] is None:
        del out["max_position_embeddings"]
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
    "deepseek_v3": {"rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
                    "rope_theta": 10000.0, "hidden_act": "silu", "num_experts_per_tok": 8,
                    "norm_topk_prob": True, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
                    "routed_scaling_factor": 2.5, "n_shared_experts": 1, "q_lora_rank": 1536,
                    "rope_interleave": True, "attention_bias": False, "num_nextn_predict_layers": 1},
    "gpt_oss": {"rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": False,
                "rope_theta": 150000.0, "hidden_act": "silu", "num_experts_per_tok": 4,
                "swiglu_alpha": QUICK_GELU_ALPHA, "swiglu_limit": 7.0, "sliding_window": 128,
                "attention_bias": True, "head_dim": 64},
}
_HF_DEFAULTS["nemotron_h"] = {
    "layer_norm_epsilon": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "attention_bias": False,
    "mlp_hidden_act": "relu2", "mlp_bias": False, "mamba_hidden_act": "silu", "use_bias": False,
    "mamba_proj_bias": False, "use_conv_bias": True, "conv_kernel": 4, "time_step_min": 0.001,
    "ssm_state_size": 128, "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 7688,
    "moe_shared_expert_intermediate_size": 7688, "routed_scaling_factor": 1.0, "n_group": 1,
    "topk_group": 1, "norm_topk_prob": True, "intermediate_size": 21504, "num_nextn_predict_layers": 0}
# older Nemotron-H config.json names (transformers renames them when it reads the config)
NEMOTRON_H_LEGACY = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
                     "mamba_dt_min": "time_step_min", "mamba_conv_bias": "use_conv_bias",
                     "mamba_chunk_size": "chunk_size"}
GPT2_GELUS = {"gelu": "gelu", "gelu_new": "openai_gelu", "gelu_pytorch_tanh": "openai_gelu"}


def mtp_layers_held(arch: str, hf: dict, names) -> int:
    """How many of DeepSeek-V3's MTP layers (decoder layers num_hidden_layers + k) the tensor
    `names` hold: transformers' own save_pretrained writes none, DeepSeek's checkpoints theirs."""
    if arch != "deepseek_v3":
        return 0
    first = hf.get("num_hidden_layers", 0)
    declared = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 1)) or 0
    return sum(f"model.layers.{first + k}.eh_proj.weight" in names for k in range(declared))


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


def megatron_args(arch: str, hf: dict, where: str, mtp_layers: int = 0) -> tuple[argparse.Namespace, dict]:
    """Megatron-LM style args of the megatron-core model equal to HF config `hf` (one rank), and
    what the megatron run must set that the model config does not record (activation, rope).
    mtp_layers: the multi-token prediction layers the checkpoint holds (DeepSeek-V3)."""
    if arch == "nemotron_h":  # older names, read as transformers reads them
        hf = {**{new: hf[old] for old, new in NEMOTRON_H_LEGACY.items() if old in hf}, **hf}
    d = {**_HF_DEFAULTS[arch], **{k: v for k, v in hf.items() if v is not None}}

    def refuse(field: str, why: str) -> UCPError:
        return UCPError(f"{where}: cannot import HF {arch}: config.json {field}={d.get(field)!r}: {why}")

    args = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, world_size=1,
                data_parallel_size=1, params_dtype=torch.float32, fp16=False, bf16=False,
                transformer_impl="local", hidden_dropout=0.0, qk_layernorm=False,
                init_method_std=d.get("initializer_range", 0.02), rotary_percent=1.0)
    if arch == "deepseek_v3":
        args, run = _deepseek_v3_args(d, args, refuse, mtp_layers)
    elif arch == "nemotron_h":
        args, run = _nemotron_h_args(d, args, refuse)
    elif arch == "gpt_oss":
        args, run = _gpt_oss_args(d, args, refuse)
    elif arch == "gpt2":
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


def _deepseek_v3_args(d: dict, args: dict, refuse, mtp_layers: int) -> tuple[dict, dict]:
    """megatron-core's DeepSeek-V3: MLA, sigmoid routing with expert bias, shared experts,
    first-k-dense, and the `mtp_layers` MTP layers the checkpoint holds."""
    if d["hidden_act"] != "silu":
        raise refuse("hidden_act", "megatron-core's SwiGLU MLP uses silu")
    if not d["rope_interleave"]:
        raise refuse("rope_interleave", "megatron-core's MLA rotates DeepSeek's interleaved pairs "
                     "of rope dimensions only")
    if d["attention_bias"]:
        raise refuse("attention_bias", "megatron-core's add_bias_linear puts biases on every "
                     "linear layer or none")
    if d["rms_norm_eps"] != 1e-6:
        raise refuse("rms_norm_eps", "HF deepseek_v3 normalizes the q and kv latents with eps 1e-6, "
                     "megatron-core every norm with one layernorm_epsilon")
    heads = d["num_attention_heads"]
    if (d.get("num_key_value_heads") or heads) != heads:
        raise refuse("num_key_value_heads", "multi-latent attention has a key and value per head")
    layers, topk, experts = d["num_hidden_layers"], d["num_experts_per_tok"], d["n_routed_experts"]
    k = d["first_k_dense_replace"]
    if not 0 <= k < layers:
        raise refuse("first_k_dense_replace", f"needs 0 <= k < num_hidden_layers={layers} (a MoE model)")
    if d["norm_topk_prob"] != (topk > 1):
        raise refuse("norm_topk_prob", f"megatron-core normalizes sigmoid routing weights exactly "
                     f"when top-k > 1 (num_experts_per_tok={topk})")
    groups, group_topk = d.get("n_group") or 1, d.get("topk_group") or 1
    if groups > 1 and (topk // group_topk != 2 or experts // groups < 2):
        raise refuse("topk_group", "transformers scores an expert group by its best two experts; "
                     "megatron-core by its best num_experts_per_tok / topk_group")
    if not d["n_shared_experts"]:
        raise refuse("n_shared_experts", "megatron-core's DeepSeek MoE layer has shared experts")
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    rope = {**scaling, **params}
    theta = float(rope.get("rope_theta", d["rope_theta"]))
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise refuse("partial_rotary_factor", "partial rotary embeddings are not imported")
    mla = dict(multi_latent_attention=True, q_lora_rank=d["q_lora_rank"], kv_lora_rank=d["kv_lora_rank"],
               qk_head_dim=d["qk_nope_head_dim"], qk_pos_emb_head_dim=d["qk_rope_head_dim"],
               v_head_dim=d["v_head_dim"], rotary_base=theta, qk_layernorm=True)
    if kind == "yarn":
        original = rope.get("original_max_position_embeddings")
        factor = rope.get("factor") or d["max_position_embeddings"] / original
        mscale, mscale_all_dim = rope.get("mscale") or 1.0, rope.get("mscale_all_dim") or 0.0
        # transformers' cos/sin scale (attention_factor) against megatron-core's
        theirs = rope.get("attention_factor")
        if theirs is None:
            theirs = _transformers_yarn_scale(factor, rope.get("mscale"), rope.get("mscale_all_dim"))
        if not math.isclose(theirs, _megatron_yarn_scale(factor, mscale, mscale_all_dim),
                            rel_tol=1e-12):
            raise refuse("rope_parameters.attention_factor", "megatron-core scales YaRN's cos/sin by "
                         "mscale(mscale) / mscale(mscale_all_dim)")
        if rope.get("truncate", True) is False:
            raise refuse("rope_parameters.truncate", "megatron-core's MLA rounds YaRN's correction range")
        mla.update(rope_type="yarn", rotary_scaling_factor=float(factor),
                   original_max_position_embeddings=original, beta_fast=float(rope.get("beta_fast") or 32),
                   beta_slow=float(rope.get("beta_slow") or 1), mscale=float(mscale),
                   mscale_all_dim=float(mscale_all_dim))
    elif kind == "default":  # megatron-core's MLA still scales the softmax by mscale_all_dim
        mla.update(rope_type="rope", mscale_all_dim=0.0)
    else:
        raise refuse("rope_type", f"{kind!r} RoPE scaling is not imported (default and yarn)")
    ffn = d["moe_intermediate_size"]
    args.update(num_layers=layers, hidden_size=d["hidden_size"], num_attention_heads=heads,
                group_query_attention=False, num_query_groups=None, ffn_hidden_size=d["intermediate_size"],
                kv_channels=d["v_head_dim"], normalization="RMSNorm", layernorm_epsilon=d["rms_norm_eps"],
                swiglu=True, add_bias_linear=False, add_qkv_bias=False, position_embedding_type="rope",
                max_position_embeddings=d["max_position_embeddings"],
                attention_dropout=d.get("attention_dropout", 0.0), num_experts=experts,
                moe_router_topk=topk, moe_ffn_hidden_size=ffn, moe_layer_freq=[0] * k + [1] * (layers - k),
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_topk_scaling_factor=float(d["routed_scaling_factor"]),
                moe_shared_expert_intermediate_size=ffn * d["n_shared_experts"],
                moe_router_num_groups=groups if groups > 1 else None,
                moe_router_group_topk=group_topk if groups > 1 else None,
                mtp_num_layers=mtp_layers or None, **mla)
    return args, {"activation": "swiglu", "rotary_base": theta}


def nemotron_h_layer_pattern(d: dict, refuse) -> str:
    """megatron-core's hybrid layer pattern of a Nemotron-H config (layers_block_type, or the older
    hybrid_override_pattern)."""
    types = d.get("layers_block_type") or d.get("layer_types")
    if types is None:
        pattern = d.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or not pattern:
            raise refuse("layers_block_type", "a Nemotron-H config.json lists its layers")
        types = [NEMOTRON_H_LAYERS.get(c, c) for c in pattern]
    symbols = {v: k for k, v in NEMOTRON_H_LAYERS.items()}
    odd = sorted({t for t in types if t not in symbols}, key=str)
    if odd:
        raise refuse("layers_block_type", f"layer type(s) {odd}: megatron-core's hybrid model has "
                     f"{sorted(symbols)}")
    return "".join(symbols[t] for t in types)


def _nemotron_h_args(d: dict, args: dict, refuse) -> tuple[dict, dict]:
    """megatron-core's hybrid model (MambaModel) of a Nemotron-H config: no position embedding, no
    biases, squared-ReLU MLPs, sigmoid-routed MoE layers with expert bias and a shared expert."""
    pattern = nemotron_h_layer_pattern(d, refuse)
    if d["mlp_hidden_act"] != "relu2":
        raise refuse("mlp_hidden_act", "megatron-core's hybrid MLPs are imported with squared_relu (relu2)")
    if d["mlp_bias"]:
        raise refuse("mlp_bias", "HF nemotron_h's attention has no biases, and megatron-core's "
                     "add_bias_linear puts biases on every linear layer or none")
    if d.get("sliding_window"):
        raise refuse("sliding_window", "sliding-window attention is not imported")
    if d.get("moe_latent_size") is not None and "E" in pattern:
        raise refuse("moe_latent_size", "latent MoE projections are not imported")
    heads = d["num_attention_heads"]
    groups = d.get("num_key_value_heads") or heads
    if heads % groups:
        raise refuse("num_key_value_heads", f"does not divide num_attention_heads={heads}")
    args.update(num_layers=len(pattern), hybrid_override_pattern=pattern, is_hybrid_model=True,
                hidden_size=d["hidden_size"], num_attention_heads=heads,
                group_query_attention=groups != heads, num_query_groups=groups, kv_channels=d["head_dim"],
                ffn_hidden_size=d["intermediate_size"], normalization="RMSNorm",
                layernorm_epsilon=d["layer_norm_epsilon"], squared_relu=True, swiglu=False,
                add_bias_linear=False, add_qkv_bias=False, position_embedding_type="none",
                max_position_embeddings=d["max_position_embeddings"],
                attention_dropout=d.get("attention_dropout", 0.0))
    if "M" in pattern:
        if d["mamba_hidden_act"] != "silu":
            raise refuse("mamba_hidden_act", "megatron-core's Mamba mixer uses silu")
        if d["use_bias"] or d["mamba_proj_bias"]:
            raise refuse("use_bias" if d["use_bias"] else "mamba_proj_bias", "megatron-core's Mamba "
                         "mixer has no in_proj / out_proj bias")
        if not d["use_conv_bias"]:
            raise refuse("use_conv_bias", "megatron-core's hybrid layer specs give the Mamba mixer's "
                         "conv1d a bias")
        if d["conv_kernel"] != 4:
            raise refuse("conv_kernel", "megatron-core's hybrid layer specs build the Mamba mixer's "
                         "conv1d with d_conv 4")
        if d["time_step_min"] > NO_DT_CLAMP:
            raise refuse("time_step_min", "transformers clamps softplus(dt + dt_bias) from below at "
                         "time_step_min; megatron-core's Mamba mixer does not clamp it. To import the "
                         f"model anyway, computing without the clamp, set time_step_min to {NO_DT_CLAMP!r} "
                         "(or 0) in config.json")
        if d["layer_norm_epsilon"] != MAMBA_NORM_EPS:
            raise refuse("layer_norm_epsilon", f"megatron-core's Mamba mixer normalizes its output "
                         f"with eps {MAMBA_NORM_EPS}, whatever layernorm_epsilon says")
        mamba_heads, mamba_groups = d["mamba_num_heads"], d["n_groups"]
        if mamba_heads % mamba_groups:
            raise refuse("n_groups", f"does not divide mamba_num_heads={mamba_heads}")
        args.update(mamba_state_dim=d["ssm_state_size"], mamba_head_dim=d["mamba_head_dim"],
                    mamba_num_groups=mamba_groups, mamba_num_heads=mamba_heads)
    if "E" in pattern:
        topk, experts = d["num_experts_per_tok"], d["n_routed_experts"]
        if d["norm_topk_prob"] != (topk > 1):
            raise refuse("norm_topk_prob", f"megatron-core normalizes sigmoid routing weights exactly "
                         f"when top-k > 1 (num_experts_per_tok={topk})")
        n_group, topk_group = d.get("n_group") or 1, d.get("topk_group") or 1
        if n_group > 1 and (topk // topk_group != 2 or experts // n_group < 2):
            raise refuse("topk_group", "transformers scores an expert group by its best two experts; "
                         "megatron-core by its best num_experts_per_tok / topk_group")
        args.update(num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=d["moe_intermediate_size"],
                    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_topk_scaling_factor=float(d["routed_scaling_factor"]),
                    moe_shared_expert_intermediate_size=d["moe_shared_expert_intermediate_size"],
                    moe_router_num_groups=n_group if n_group > 1 else None,
                    moe_router_group_topk=topk_group if n_group > 1 else None)
    return args, {"activation": "squared_relu"}


def gpt_oss_window(layer_types: list[str]) -> int | list[int] | None:
    """megatron-core's window_attn_skip_freq for transformers' layer_types: None (every layer
    sliding), n (all but every n-th layer), else the per-layer list."""
    sliding = [t == "sliding_attention" for t in layer_types]
    if all(sliding):
        return None
    for n in range(2, len(sliding) + 1):
        if sliding == [(i + 1) % n != 0 for i in range(len(sliding))]:
            return n
    return [int(x) for x in sliding]


def _gpt_oss_yarn(d: dict, rope: dict, refuse) -> dict:
    """Megatron-LM's YaRN args (GPTModel's config.yarn_*, set by megatron_rebuild) for
    transformers' yarn `rope`, read as transformers' _compute_yarn_parameters reads it."""
    original = rope.get("original_max_position_embeddings") or d["max_position_embeddings"]
    factor = float(rope.get("factor") or d["max_position_embeddings"] / original)
    # transformers' inferred scale: its ratio of both where both are non-zero, else mscale(f, 1),
    # which is megatron-core's at (1, 0)
    if rope.get("mscale") and rope.get("mscale_all_dim"):
        mscale, mscale_all_dim = float(rope["mscale"]), float(rope["mscale_all_dim"])
    else:
        mscale, mscale_all_dim = 1.0, 0.0
    given = rope.get("attention_factor")
    if given is not None and given != _megatron_yarn_scale(factor, mscale, mscale_all_dim):
        if factor <= 1:
            raise refuse("rope_parameters.attention_factor", f"megatron-core does not scale YaRN's "
                         f"cos/sin when factor={factor} <= 1")
        # any other factor a is mscale(f, (a - 1) / (0.1 ln f)) over mscale(f, 0) = 1
        mscale, mscale_all_dim = (given - 1.0) / (0.1 * math.log(factor)), 0.0
    return dict(position_embedding_type="yarn", rotary_scaling_factor=factor,
                yarn_original_max_position_embeddings=int(original),
                yarn_beta_fast=float(rope.get("beta_fast") or 32),
                yarn_beta_slow=float(rope.get("beta_slow") or 1),
                mscale=mscale, mscale_all_dim=mscale_all_dim,
                yarn_correction_range_round_to_int=bool(rope.get("truncate", True)))


def _gpt_oss_args(d: dict, args: dict, refuse) -> tuple[dict, dict]:
    """megatron-core's GPT-OSS: learnable sinks, sliding windows, biases everywhere, clamped SwiGLU,
    default RoPE or YaRN."""
    rope = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {})}
    theta = float(rope.get("rope_theta", d["rope_theta"]))
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in ("default", "yarn"):
        raise refuse("rope_parameters.rope_type", f"{kind!r} RoPE scaling is not imported for "
                     "GPT-OSS (default and yarn)")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise refuse("partial_rotary_factor", "partial rotary embeddings are not imported")
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
    layer_types = d.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    window = None
    if "sliding_attention" in layer_types:
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
                window_size=window, window_attn_skip_freq=gpt_oss_window(layer_types) if window else None,
                num_experts=d["num_local_experts"], moe_router_topk=d["num_experts_per_tok"],
                moe_ffn_hidden_size=d["intermediate_size"])
    if kind == "yarn":
        args.update(_gpt_oss_yarn(d, rope, refuse))
    return args, {"activation": "quick_geglu", "rotary_base": theta}
