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
    # what the same weights compute: attention windows, softmax, RoPE-free layers
    "window_size", "window_attn_skip_freq", "softmax_type", "no_rope_freq", "attention_output_gate",
    "multi_latent_attention",
    # hybrid models (MambaModel): which layer is what, and the Mamba mixer's sizes
    "hybrid_layer_pattern", "mamba_state_dim", "mamba_head_dim",
    "mamba_num_groups", "mamba_num_heads",
)

# TransformerConfig (and MLATransformerConfig) fields the manifest does not record, and why: none
# changes a tensor's shape or what the model computes from its weights, and none is plain data.
# Every other field is recorded (lists and tuples as JSON lists, callables by qualified name,
# dtypes and enums by name); tests/test_model_config.py fails for a field of a megatron-core
# release that is in neither, so a new field cannot slip through unrecorded.
NOT_RECORDED = {
    # hooks and objects the training loop sets at run time (bound methods, timers, contexts)
    "timers": "run-time object", "finalize_model_grads_func": "run-time hook",
    "grad_scale_func": "run-time hook", "no_sync_func": "run-time hook", "grad_sync_func": "run-time hook",
    "param_sync_func": "run-time hook", "_cpu_offloading_context": "run-time object",
    # weight initialisation: a checkpoint carries the weights themselves
    "init_method": "initialisation only", "output_layer_init_method": "initialisation only",
    "embedding_init_method": "initialisation only",
    # quantizer factories are objects; the FP8/FP4 recipes are recorded by name (fp8_recipe, ...)
    "fp8_quantizer_factory": "object; fp8_recipe is recorded",
    "fp4_quantizer_factory": "object; fp4_recipe is recorded",
}


UNRECORDABLE = object()  # what `config_value` returns for a value JSON cannot hold


def config_value(value):
    """A config value as JSON, or `UNRECORDABLE`: tuples and lists as lists (of JSON values),
    callables by qualified name (the activation), torch dtypes and enums by name."""
    import enum

    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        items = [config_value(v) for v in value]
        return UNRECORDABLE if any(v is UNRECORDABLE for v in items) else items
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        items = {k: config_value(v) for k, v in value.items()}
        return UNRECORDABLE if any(v is UNRECORDABLE for v in items.values()) else items
    if isinstance(value, enum.Enum):
        return value.name
    if type(value).__name__ == "dtype" and type(value).__module__ == "torch":
        return str(value)
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', None) or ''}.{value.__qualname__}".lstrip(".")
    return UNRECORDABLE


def config_record(config) -> dict:
    """A TransformerConfig's fields as the manifest records them (all but `NOT_RECORDED`)."""
    out = {}
    for k, v in vars(config).items():
        value = UNRECORDABLE if k in NOT_RECORDED else config_value(v)
        if value is not UNRECORDABLE:
            out[k] = value
    return out


def model_config(model_chunks: list) -> dict:
    """The architecture of the model as JSON: every TransformerConfig field but `NOT_RECORDED`
    (lists and tuples included: window_size, moe_layer_freq, no_rope_freq, ...) plus GPT-level
    fields."""
    # imported here: the offline tools (convert, inspect) use this module without a model and
    # need not pay megatron-core's import (seconds, ~130 MB)
    from megatron.core.utils import unwrap_model

    from megatron_ucp.mcore_compat import hybrid_layer_pattern

    model = unwrap_model(model_chunks[0])
    cfg = config_record(model.config)
    for k in ("vocab_size", "max_sequence_length", "share_embeddings_and_output_weights",
              "position_embedding_type"):
        if hasattr(model, k):
            cfg[k] = getattr(model, k)
    # a hybrid model's layer pattern (MambaModel's, not in TransformerConfig), under one name on
    # every release
    if hybrid_layer_pattern(model):
        cfg["hybrid_layer_pattern"] = hybrid_layer_pattern(model)
    if getattr(model, "rotary_scaling", False):  # GPTModel's Llama 3 RoPE scaling (its factor: not kept)
        cfg["rope_scaling"] = True
    cfg.update(_gpt_rotary(model, cfg))
    if cfg.get("num_query_groups") is None:
        cfg["num_query_groups"] = cfg.get("num_attention_heads")
    # megatron gives linear_qkv a bias if either flag is set (Megatron-LM sets both)
    cfg["add_qkv_bias"] = bool(cfg.get("add_bias_linear") or cfg.get("add_qkv_bias"))
    return cfg


def _gpt_rotary(model, cfg: dict) -> dict:
    """GPTModel's RoPE arguments its TransformerConfig does not hold, where they are not
    megatron-core's defaults: the linear scaling (seq_len_interpolation_factor, Megatron-LM's
    --rotary-seq-len-interpolation-factor) and the rotated fraction of a head (rotary_percent;
    MLA's config has its own)."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None:  # no RoPE, or MLA's (inside its attention)
        return {}
    out = {}
    if getattr(rotary, "seq_len_interpolation_factor", None) is not None:
        out["seq_len_interpolation_factor"] = float(rotary.seq_len_interpolation_factor)
    if "rotary_percent" not in cfg and float(getattr(model, "rotary_percent", 1.0)) != 1.0:
        out["rotary_percent"] = float(model.rotary_percent)
    return out


def check_model_config(saved: dict, current: dict, where: str) -> None:
    bad = [(k, saved.get(k), current.get(k)) for k in ARCH_FIELDS
           if k in saved and k in current and saved[k] != current[k]]
    true_vocab = saved.get("unpadded_vocab_size")
    if true_vocab and current.get("vocab_size", 0) >= true_vocab:  # only the padding differs
        bad = [b for b in bad if b[0] != "vocab_size"]
    # a Mamba mixer without mamba_num_heads derives its heads (expand * hidden / mamba_head_dim,
    # expand being a layer-spec argument the config does not hold); whether they agree with a
    # given number, the parameter shapes say (A_log, D, dt_bias: one per head), which a load checks
    bad = [b for b in bad if not (b[0] == "mamba_num_heads" and None in b[1:])]
    # the `|`s of a hybrid pattern cut pipeline stages (Megatron-LM 0.19): layout, not the model
    bad = [b for b in bad if not (b[0] == "hybrid_layer_pattern" and all(isinstance(x, str) for x in b[1:])
                                  and b[1].replace("|", "") == b[2].replace("|", ""))]
    if bad:
        lines = "; ".join(f"{k}: checkpoint {a!r}, model {b!r}" for k, a, b in bad)
        hint = ""
        if any(k == "vocab_size" for k, _, _ in bad):
            hint = (" If only the vocabulary padding differs, the checkpoint must record the true "
                    "vocabulary: save with megatron_ucp.save(..., vocab_size=<unpadded size>).")
        raise UCPError(f"{where}: the model does not match the checkpoint ({lines}); build the "
                       "model with the checkpoint's architecture (only the parallel layout may "
                       "change)." + hint)


PIPELINE_SPLIT = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")


def check_load_layout(saved: dict, current: dict, layout: Layout, where: str = "checkpoint") -> None:
    """`check_layout` for a load into a built model (`current`: its `model_config`): the checkpoint
    says the architecture, the model its own pipeline split (the saved one was the saving run's;
    3 layers saved at PP1 load into stages of 2 + 1)."""
    check_layout({**saved, **{k: current.get(k) for k in PIPELINE_SPLIT}}, layout, where)


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
