"""Hugging Face architectures, one module each: its name map (universal name -> HF names and
transform), what it refuses to export, its config.json (export-hf) and the megatron-core model of
a config.json (import-hf). `_base` holds what they share and the `HFArch` hooks; `_llama_like`
the rotary decoder Llama, Qwen2, Mistral, Qwen3, Mixtral and Qwen3-MoE build on (GLM-4.5 takes its
attention and DeepSeek-V3's MoE layers; Kimi-K2 is DeepSeek-V3's model, DeepSeek-V2 its attention
with softmax routing); the element order of fused
tensors is in `formats.tensor_transforms`.

The registry below is the one list of architectures: `export-hf --arch` offers it, import-hf
finds a config.json's `model_type` in it, and the tests fail for an architecture without test
rows. Adding an architecture: its module here (an `HFArch` subclass as `ARCH`), its entry in
`REGISTRY`, a transformers model of it in tests/test_hf_import.py `MODELS` with its expected
tensors in tests/oracles.py `hf_expected` (split by hand, independently of this package), and a
megatron-core run of it in tests/test_hf_export.py `CFGS` (or `NATIVE_NEW`). An architecture
megatron-core cannot build is refused by import-hf naming what is missing (`UNIMPORTABLE`).
"""

from __future__ import annotations

from collections.abc import Callable

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.hf.archs import (
    deepseek_v2,
    deepseek_v3,
    glm4_moe,
    gpt2,
    gpt_oss,
    kimi_k2,
    llama,
    mistral,
    mixtral,
    nemotron_h,
    olmoe,
    qwen2,
    qwen3,
    qwen3_moe,
    qwen3_next,
)
from megatron_ucp.formats.hf.archs._base import HFArch, Rule, hints_from_args, keeps_fp32

REGISTRY: dict[str, HFArch] = {module.ARCH.name: module.ARCH for module in (
    llama, qwen2, mistral, mixtral, gpt2, qwen3, qwen3_moe, deepseek_v2, deepseek_v3, kimi_k2, glm4_moe,
    gpt_oss, nemotron_h, qwen3_next)}
ARCHS = tuple(REGISTRY)  # names: transformers' model_type, export-hf --arch
# model types users bring that no megatron-core model (0.16.1 .. 0.19.2, GPTModel or MambaModel)
# computes, and what it lacks: refused by name, never imported as a near relative. (Bridge trains
# Gemma with modules of its own, on Transformer Engine: megatron-core has none of them.)
_GEMMA = ("an RMSNorm of weight 1 + w (megatron-core's layernorm_zero_centered_gamma exists for "
          "Transformer Engine's norm only), the embedding scaled by sqrt(hidden_size) before the "
          "first layer, tied to an unscaled output layer")
_GEMMA2 = (_GEMMA + ", norms after attention and after the MLP (post_attention_layernorm, "
           "post_feedforward_layernorm: megatron-core's TransformerLayer has none), "
           "query_pre_attn_scalar, attention and final logit soft-capping")
LACKING: dict[str, str] = {
    "gemma": _GEMMA,
    "gemma2": _GEMMA2,
    "gemma3_text": _GEMMA2 + ", a RoPE base per layer type (rope_parameters.sliding_attention / "
                   "full_attention)",
    "gemma3": "the Gemma 3 language model (" + _GEMMA2 + ") with a vision tower",
    "falcon_h1": ("attention and Mamba-2 side by side in every layer (MambaModel stacks them), and "
                  "muP multipliers (embedding_multiplier, lm_head_multiplier, ssm_multipliers, "
                  "mlp_multipliers, attention_in/out_multiplier)"),
}


def _lacking(name: str) -> Callable[[dict, str], UCPError]:
    return lambda config, where: UCPError(
        f"{where}: config.json model_type {name!r} is not imported: megatron-core has no model with "
        f"{LACKING[name]}. import-hf reads {', '.join(ARCHS)}")


# model_types import-hf knows and refuses, naming what megatron-core cannot build (their modules)
UNIMPORTABLE: dict[str, Callable[[dict, str], UCPError]] = {
    olmoe.NAME: olmoe.refusal, **{name: _lacking(name) for name in LACKING}}


def get(name: str) -> HFArch:
    """The architecture export-hf --arch `name` writes."""
    if name not in REGISTRY:
        raise UCPError(f"unknown HF architecture {name!r}; supported: {', '.join(ARCHS)}")
    return REGISTRY[name]


def of_hf_config(config: dict, where: str) -> HFArch:
    """The architecture of an HF config.json (its model_type), which import-hf reads."""
    name = config.get("model_type")
    if name in UNIMPORTABLE:
        raise UNIMPORTABLE[name](config, where)
    if name not in REGISTRY:
        raise UCPError(f"{where}: config.json model_type {name!r} is not supported; import-hf reads "
                       f"{', '.join(ARCHS)}")
    return REGISTRY[name]


__all__ = ["ARCHS", "REGISTRY", "UNIMPORTABLE", "HFArch", "Rule", "get", "of_hf_config", "hints_from_args",
           "keeps_fp32"]
