"""Hugging Face architectures, one module each: its name map (universal name -> HF names and
transform), what it refuses to export, its config.json (export-hf) and the megatron-core model of
a config.json (import-hf). `_base` holds what they share and the `HFArch` hooks; `_llama_like`
the rotary decoder Llama, Qwen2, Qwen3, Mixtral and Qwen3-MoE build on; the element order of fused
tensors is in `formats.tensor_transforms`.

The registry below is the one list of architectures: `export-hf --arch` offers it, import-hf
finds a config.json's `model_type` in it, and the tests fail for an architecture without test
rows. Adding an architecture: its module here (an `HFArch` subclass as `ARCH`), its entry in
`REGISTRY`, a transformers model of it in tests/test_hf_import.py `MODELS` with its expected
tensors in tests/oracles.py `hf_expected` (split by hand, independently of this package), and a
megatron-core run of it in tests/test_hf_export.py `CFGS` (or `NATIVE_NEW`).
"""

from __future__ import annotations

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.hf.archs import (
    deepseek_v3,
    gpt2,
    gpt_oss,
    llama,
    mixtral,
    nemotron_h,
    qwen2,
    qwen3,
    qwen3_moe,
    qwen3_next,
)
from megatron_ucp.formats.hf.archs._base import HFArch, Rule, hints_from_args, keeps_fp32

REGISTRY: dict[str, HFArch] = {module.ARCH.name: module.ARCH for module in (
    llama, qwen2, mixtral, gpt2, qwen3, qwen3_moe, deepseek_v3, gpt_oss, nemotron_h,
    qwen3_next)}
ARCHS = tuple(REGISTRY)  # names: transformers' model_type, export-hf --arch


def get(name: str) -> HFArch:
    """The architecture export-hf --arch `name` writes."""
    if name not in REGISTRY:
        raise UCPError(f"unknown HF architecture {name!r}; supported: {', '.join(ARCHS)}")
    return REGISTRY[name]


def of_hf_config(config: dict, where: str) -> HFArch:
    """The architecture of an HF config.json (its model_type), which import-hf reads."""
    name = config.get("model_type")
    if name not in REGISTRY:
        raise UCPError(f"{where}: config.json model_type {name!r} is not supported; import-hf reads "
                       f"{', '.join(ARCHS)}")
    return REGISTRY[name]


__all__ = ["ARCHS", "REGISTRY", "HFArch", "Rule", "get", "of_hf_config", "hints_from_args", "keeps_fp32"]
