"""Is the model the checkpoint's model, and can the target layout hold it? Clear errors if not."""

from __future__ import annotations

from megatron_ucp.errors import UCPError
from megatron_ucp.layout import Layout

# Fields that change parameter shapes or meaning; a mismatch is an error, not a reshard.
ARCH_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "ffn_hidden_size", "gated_linear_unit", "normalization", "add_bias_linear", "add_qkv_bias",
    "qk_layernorm", "num_moe_experts", "moe_router_topk", "vocab_size", "max_sequence_length",
    "share_embeddings_and_output_weights", "position_embedding_type",
)


def model_config(model_chunks: list) -> dict:
    """The architecture of the model as JSON: TransformerConfig scalars plus GPT-level fields."""
    # imported here: the offline tools (convert, inspect) use this module without a model and
    # need not pay megatron-core's import (seconds, ~130 MB)
    from megatron.core.utils import unwrap_model

    model = unwrap_model(model_chunks[0])
    cfg = {k: v for k, v in vars(model.config).items()
           if isinstance(v, (bool, int, float, str)) or v is None}
    for k in ("vocab_size", "max_sequence_length", "share_embeddings_and_output_weights",
              "position_embedding_type"):
        if hasattr(model, k):
            cfg[k] = getattr(model, k)
    if cfg.get("num_query_groups") is None:
        cfg["num_query_groups"] = cfg.get("num_attention_heads")
    # megatron gives linear_qkv a bias if either flag is set (Megatron-LM sets both)
    cfg["add_qkv_bias"] = bool(cfg.get("add_bias_linear") or cfg.get("add_qkv_bias"))
    return cfg


def check_model_config(saved: dict, current: dict, where: str) -> None:
    bad = [(k, saved.get(k), current.get(k)) for k in ARCH_FIELDS
           if k in saved and k in current and saved[k] != current[k]]
    true_vocab = saved.get("unpadded_vocab_size")
    if true_vocab and current.get("vocab_size", 0) >= true_vocab:  # only the padding differs
        bad = [b for b in bad if b[0] != "vocab_size"]
    if bad:
        lines = "; ".join(f"{k}: checkpoint {a!r}, model {b!r}" for k, a, b in bad)
        hint = ""
        if any(k == "vocab_size" for k, _, _ in bad):
            hint = (" If only the vocabulary padding differs, the checkpoint must record the true "
                    "vocabulary: save with megatron_ucp.save(..., vocab_size=<unpadded size>).")
        raise UCPError(f"{where}: the model does not match the checkpoint ({lines}); build the "
                       "model with the checkpoint's architecture (only the parallel layout may "
                       "change)." + hint)


def check_layout(cfg: dict, layout: Layout, where: str = "checkpoint") -> None:
    """Raise if `layout` cannot hold the model described by `cfg` (a manifest's `model`)."""
    problems = []
    tp = layout.tp
    heads = cfg.get("num_attention_heads")
    groups = cfg.get("num_query_groups") or heads
    if heads and heads % tp:
        problems.append(f"num_attention_heads={heads} is not divisible by TP={tp}")
    if groups and groups % tp:
        problems.append(f"num_query_groups={groups} is not divisible by TP={tp}")
    if cfg.get("ffn_hidden_size") and cfg["ffn_hidden_size"] % tp:
        problems.append(f"ffn_hidden_size={cfg['ffn_hidden_size']} is not divisible by TP={tp}")
    if cfg.get("vocab_size") and not cfg.get("unpadded_vocab_size") and cfg["vocab_size"] % tp:
        problems.append(f"vocab_size={cfg['vocab_size']} (padded) is not divisible by TP={tp}")
    stages = layout.pp * (layout.vpp or 1)
    layers = cfg.get("num_layers")
    uneven = cfg.get("num_layers_in_first_pipeline_stage") or cfg.get("num_layers_in_last_pipeline_stage")
    if layers and not uneven and layers % stages:
        problems.append(f"num_layers={layers} is not divisible by PP={layout.pp} x VPP={layout.vpp or 1}")
    experts = cfg.get("num_moe_experts")
    if experts and experts % layout.ep:
        problems.append(f"num_moe_experts={experts} is not divisible by EP={layout.ep}")
    if problems:
        raise UCPError(f"{where}: target layout {layout} cannot hold this model: "
                       + "; ".join(problems) + ". Choose parallel sizes that divide these (only the layout "
                       "may change on load, not the architecture).")
