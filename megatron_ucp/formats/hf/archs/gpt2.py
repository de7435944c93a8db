"""HF `gpt2` (GPT2LMHeadModel): megatron-core's default GPT. Learned absolute positions, LayerNorm
with biases, a GELU MLP, a bias on every linear layer, no grouped-query attention; HF's Conv1D
stores weights `[in, out]` and the fused `c_attn` as `[q; k; v]`."""

from __future__ import annotations

from megatron_ucp.formats.hf.archs._base import (
    Entry,
    HFArch,
    Refuse,
    Rule,
    check_common,
    fail,
    features,
    fill,
    refuse_hybrid,
    require,
)
from megatron_ucp.formats.tensor_transforms import Heads

GLOBAL: list[Entry] = [
    ("embedding.word_embeddings.weight", "copy", ("transformer.wte.weight",), ""),
    ("embedding.position_embeddings.weight", "copy", ("transformer.wpe.weight",), ""),
    ("decoder.final_layernorm.weight", "copy", ("transformer.ln_f.weight",), ""),
    ("decoder.final_layernorm.bias", "copy", ("transformer.ln_f.bias",), ""),
    ("output_layer.weight", "copy", ("lm_head.weight",), "untied"),
]
_M, _H = "decoder.layers.{i}.", "transformer.h.{i}."  # layer prefixes: megatron, HF GPT-2
LAYER: list[Entry] = [
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
GELUS = {"gelu": "gelu", "gelu_new": "openai_gelu", "gelu_pytorch_tanh": "openai_gelu"}  # HF -> megatron


class GPT2(HFArch):
    name = "gpt2"
    hf_class = "GPT2LMHeadModel"
    hf_defaults = {"layer_norm_epsilon": 1e-5, "n_positions": 1024, "tie_word_embeddings": True,
                   "activation_function": "gelu_new"}
    ignored_hf = (r"\.attn\.(masked_)?bias$",)  # the causal mask buffers

    def rules(self, cfg: dict) -> list[Rule]:
        feats = features(cfg)
        out = fill(GLOBAL, feats)
        for i in range(cfg["num_layers"]):
            out += fill(LAYER, feats, i=i)
        return out

    def check_exportable(self, cfg: dict, hints: dict) -> None:
        arch = self.name
        refuse_hybrid(arch, cfg)
        check_common(arch, cfg)
        h = Heads.of(cfg)
        if h.heads % h.groups:
            raise fail(arch, "num_query_groups", h.groups, "does not divide num_attention_heads")
        feats = features(cfg)
        if "moe" in feats:
            raise fail(arch, "num_moe_experts", cfg.get("num_moe_experts"), "a MoE model is --arch mixtral")
        require(arch, cfg, "position_embedding_type", "learned_absolute",
                "HF gpt2 learns absolute position embeddings (wpe)")
        require(arch, cfg, "normalization", "LayerNorm", "HF gpt2 uses LayerNorm")
        require(arch, cfg, "gated_linear_unit", False, "HF gpt2 has a plain MLP (c_fc, c_proj)")
        if "linear_bias" not in feats:
            raise fail(arch, "add_bias_linear", False, "HF gpt2 has a bias on every linear layer")
        if h.groups != h.heads:
            raise fail(arch, "num_query_groups", h.groups, "HF gpt2 has no grouped-query attention")
        if h.heads * h.head_dim != cfg["hidden_size"]:
            raise fail(arch, "kv_channels", h.head_dim, "HF gpt2's head_dim is hidden_size / heads")
        if hints.get("activation") not in (None, "gelu", "openai_gelu"):
            raise fail(arch, "activation", hints["activation"], "HF gpt2 has a GELU MLP")

    def fp8_refusal(self, cfg: dict) -> str | None:
        return ("GPT-2's linear layers are transformers Conv1D modules, which its FP8 quantizer does "
                "not replace (replace_with_fp8_linear takes nn.Linear only): no GPT-2 layer holds FP8 "
                "weights in transformers")

    def config_fields(self, cfg: dict, *, rope_theta: float, hints: dict, tokens: dict) -> dict:
        return {"n_positions": cfg["max_sequence_length"], "n_embd": cfg["hidden_size"],
                "n_layer": cfg["num_layers"], "n_head": Heads.of(cfg).heads,
                "n_inner": cfg["ffn_hidden_size"],
                "activation_function": "gelu_new" if hints.get("activation") == "openai_gelu" else "gelu",
                "layer_norm_epsilon": cfg.get("layernorm_epsilon", 1e-5),
                "resid_pdrop": cfg.get("hidden_dropout", 0.0), "embd_pdrop": cfg.get("hidden_dropout", 0.0),
                "attn_pdrop": cfg.get("attention_dropout", 0.0), "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}

    def args_of(self, d: dict, args: dict, refuse: Refuse, mtp_layers: int) -> tuple[dict, dict]:
        if d["activation_function"] not in GELUS:
            raise refuse("activation_function", f"megatron-core has {sorted(GELUS)}")
        if d.get("scale_attn_by_inverse_layer_idx"):
            raise refuse("scale_attn_by_inverse_layer_idx", "megatron-core has no per-layer scaling")
        if not d.get("scale_attn_weights", True):
            raise refuse("scale_attn_weights", "megatron-core scales attention by 1/sqrt(head_dim)")
        if d.get("embd_pdrop", 0.1) != d.get("resid_pdrop", 0.1):
            raise refuse("embd_pdrop", f"megatron-core's hidden_dropout is both the embedding's and "
                         f"the residual's dropout; resid_pdrop is {d.get('resid_pdrop', 0.1)}")
        hidden, heads = d["n_embd"], d["n_head"]
        args.update(hidden_dropout=d.get("resid_pdrop", 0.1))
        args.update(num_layers=d["n_layer"], hidden_size=hidden, num_attention_heads=heads,
                    ffn_hidden_size=d.get("n_inner") or 4 * hidden, kv_channels=hidden // heads,
                    group_query_attention=False, num_query_groups=None, normalization="LayerNorm",
                    layernorm_epsilon=d["layer_norm_epsilon"], swiglu=False, add_bias_linear=True,
                    add_qkv_bias=True, position_embedding_type="learned_absolute",
                    max_position_embeddings=d["n_positions"], attention_dropout=d.get("attn_pdrop", 0.0))
        return args, {"activation": GELUS[d["activation_function"]]}


ARCH = GPT2()
