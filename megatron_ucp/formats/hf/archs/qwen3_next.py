"""HF `qwen3_next` (Qwen3NextForCausalLM): megatron-core's GPT model (0.16.1 and 0.19.2) with
`experimental_attention_variant="gated_delta_net"`: linear-attention layers (Gated DeltaNet) and
gated full-attention layers (`layer_types`: megatron-core's `linear_attention_freq`), each followed
by a MoE layer of softmax top-k experts plus a sigmoid-gated shared expert (`moe_shared_expert_gate`)
or, in `mlp_only_layers`, a dense SwiGLU MLP; zero-centered RMSNorms (HF scales by 1 + weight,
megatron-core's `layernorm_zero_centered_gamma`: both store the weight w), QK-norm, partial rotary
(`partial_rotary_factor`: megatron-core's rotary_percent; both rotate the halves of the first
rotary dims and pass the rest), no biases.

Element orders (`formats.tensor_transforms`): a full-attention layer's q_proj holds each head's
query then its gate (`qgkv`); a linear-attention layer's in_proj_qkvz / in_proj_ba hold q, k, v, z
and beta, alpha grouped per key head, megatron-core's in_proj [q; k; v; z; beta; alpha] over all
heads (`gdn_in_proj`); conv1d ([q; k; v] channels), A_log and dt_bias (per value head) are alike.
HF's gated output norm (linear_attn.norm) scales by its weight itself, megatron-core's zero-centered
out_norm by 1 + weight: the universal weight is HF's minus 1 (`plus_one`; exact for weights in
[0.5, 2], as trained ones are around their initial 1).

Not exported: multi-token prediction layers (transformers' Qwen3-Next builds none and ignores a
checkpoint's `mtp.*` tensors); refused on import: an HF checkpoint holding them.
"""

from __future__ import annotations

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.hf.archs._base import (
    ROTARY_INV_FREQ,
    Entry,
    HFArch,
    Refuse,
    Rule,
    check_common,
    check_defaults,
    check_wanted,
    default_rope,
    fail,
    features,
    fill,
    moe_layers,
    refuse_hybrid,
    require,
)
from megatron_ucp.formats.hf.archs._llama_like import DENSE_MLP, GLOBAL, MOE_NORM
from megatron_ucp.formats.hf.archs.qwen3 import QK_NORM
from megatron_ucp.formats.hf.archs.qwen3_moe import EXPERT, ROUTER
from megatron_ucp.formats.tensor_transforms import Heads

GATED_ATTENTION: list[Entry] = [
    ("decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight", "copy",
     ("model.layers.{i}.input_layernorm.weight",), ""),
    ("decoder.layers.{i}.self_attention.linear_qkv.weight", "qgkv",
     ("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",
      "model.layers.{i}.self_attn.v_proj.weight"), ""),
    ("decoder.layers.{i}.self_attention.linear_proj.weight", "copy",
     ("model.layers.{i}.self_attn.o_proj.weight",), ""),
    *QK_NORM,
]
LINEAR_ATTENTION: list[Entry] = [
    ("decoder.layers.{i}.self_attention.in_proj.layer_norm_weight", "copy",
     ("model.layers.{i}.input_layernorm.weight",), ""),
    ("decoder.layers.{i}.self_attention.in_proj.weight", "gdn_in_proj",
     ("model.layers.{i}.linear_attn.in_proj_qkvz.weight",
      "model.layers.{i}.linear_attn.in_proj_ba.weight"), ""),
    ("decoder.layers.{i}.self_attention.conv1d.weight", "copy",
     ("model.layers.{i}.linear_attn.conv1d.weight",), ""),
    ("decoder.layers.{i}.self_attention.A_log", "copy", ("model.layers.{i}.linear_attn.A_log",), ""),
    ("decoder.layers.{i}.self_attention.dt_bias", "copy", ("model.layers.{i}.linear_attn.dt_bias",), ""),
    ("decoder.layers.{i}.self_attention.out_norm.weight", "plus_one",
     ("model.layers.{i}.linear_attn.norm.weight",), ""),
    ("decoder.layers.{i}.self_attention.out_proj.weight", "copy",
     ("model.layers.{i}.linear_attn.out_proj.weight",), ""),
]
SHARED_EXPERT: list[Entry] = [
    ("decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight", "gate_up",
     ("model.layers.{i}.mlp.shared_expert.gate_proj.weight",
      "model.layers.{i}.mlp.shared_expert.up_proj.weight"), ""),
    ("decoder.layers.{i}.mlp.shared_experts.linear_fc2.weight", "copy",
     ("model.layers.{i}.mlp.shared_expert.down_proj.weight",), ""),
    ("decoder.layers.{i}.mlp.shared_experts.gate_weight", "copy",
     ("model.layers.{i}.mlp.shared_expert_gate.weight",), ""),
]
GDN = "gated_delta_net"
# the linear-attention geometry: TransformerConfig and config.json use the same names
LINEAR_FIELDS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_num_key_heads", "linear_num_value_heads")


def linear_layers(cfg: dict) -> list[bool]:
    """Which decoder layers are linear-attention layers (megatron-core's linear_attention_freq: an
    int N makes every N-th layer full attention, a list says 1 for linear attention)."""
    n, freq = cfg["num_layers"], cfg.get("linear_attention_freq")
    if isinstance(freq, int):
        return [(i + 1) % freq != 0 for i in range(n)]
    return [bool(x) for x in freq] if freq is not None else [False] * n


class Qwen3Next(HFArch):
    name = "qwen3_next"
    hf_class = "Qwen3NextForCausalLM"
    hf_defaults = {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": False,
                   "hidden_act": "silu", "head_dim": 256, "attention_bias": False, "num_experts_per_tok": 10,
                   "num_experts": 512, "norm_topk_prob": True, "decoder_sparse_step": 1,
                   "mlp_only_layers": [],
                   "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                   "linear_num_key_heads": 16, "linear_num_value_heads": 32, "moe_intermediate_size": 512,
                   "shared_expert_intermediate_size": 512, "partial_rotary_factor": 0.25,
                   "router_aux_loss_coef": 0.001}
    ignored_hf = (ROTARY_INV_FREQ,)

    def rules(self, cfg: dict) -> list[Rule]:
        feats = features(cfg)
        out = fill(GLOBAL, feats)
        for i, (linear, moe) in enumerate(zip(linear_layers(cfg), moe_layers(cfg))):
            out += fill(LINEAR_ATTENTION if linear else GATED_ATTENTION, feats, i=i)
            if not moe:
                out += fill(DENSE_MLP, feats, i=i)
                continue
            out += fill(MOE_NORM + ROUTER + SHARED_EXPERT, feats, i=i)
            for e in range(cfg["num_moe_experts"]):
                out += fill(EXPERT, feats, i=i, e=e)
        return out

    # ------------------------------------------------------------------ export

    def fp8_refusal(self, cfg: dict) -> str | None:
        return ("FP8 weights of HF qwen3_next are not written: which of its linear layers transformers' "
                "FP8 quantizer replaces (Gated DeltaNet's in_proj_qkvz / in_proj_ba / out_proj, the shared "
                "expert's gate) is not checked against its replace_with_fp8_linear here")

    def check_exportable(self, cfg: dict, hints: dict) -> None:
        arch, get = self.name, cfg.get
        refuse_hybrid(arch, cfg)
        check_common(arch, cfg, allowed=("qk_layernorm", "attention_output_gate",
                                          "layernorm_zero_centered_gamma", "experimental_attention_variant"))
        check_wanted(arch, cfg, [
            ("experimental_attention_variant", GDN, "HF qwen3_next's linear-attention layers are Gated "
             "DeltaNet (megatron-core's experimental_attention_variant='gated_delta_net')"),
            ("layernorm_zero_centered_gamma", True, "HF qwen3_next's RMSNorms scale by 1 + weight"),
            ("attention_output_gate", True, "HF qwen3_next gates every attention head's output"),
            ("qk_layernorm", True, "HF qwen3_next normalizes q and k per head")])
        if get("linear_attention_freq") is None:
            raise fail(arch, "linear_attention_freq", None, "says which layers are linear attention")
        require(arch, cfg, "position_embedding_type", "rope", "HF {arch} uses rotary position embeddings")
        require(arch, cfg, "normalization", "RMSNorm", "HF {arch} uses RMSNorm")
        require(arch, cfg, "gated_linear_unit", True, "HF {arch} has SwiGLU MLPs and experts")
        if not str(get("activation_func", "silu")).endswith("silu"):
            raise fail(arch, "activation_func", get("activation_func"), "HF qwen3_next's MLPs and Gated "
                       "DeltaNet use silu")
        if hints.get("activation") not in (None, "swiglu"):
            raise fail(arch, "activation", hints["activation"], "HF qwen3_next needs SwiGLU (silu)")
        if get("rotary_interleaved", False):
            raise fail(arch, "rotary_interleaved", True, "HF rotates the two halves of the rotary dims")
        check_defaults(arch, cfg, [
            ("rope_scaling", False, "RoPE scaling is not exported for HF qwen3_next"),
            ("seq_len_interpolation_factor", None, "linear RoPE scaling is not exported for HF qwen3_next"),
            ("add_bias_linear", False, "HF qwen3_next has no biases"),
            ("add_qkv_bias", False, "HF qwen3_next has no biases"),
            ("qk_l2_norm", False, "HF qwen3_next's attention has RMSNorm QK-norm")])
        for field, hint in (("rope_scaling", "use_rope_scaling"),  # (Megatron-LM's args say them)
                            ("seq_len_interpolation_factor", "rotary_seq_len_interpolation_factor")):
            if hints.get(hint):
                raise fail(arch, field, hints[hint], "RoPE scaling is not exported for HF qwen3_next")
        h = Heads.of(cfg)
        if h.heads % h.groups:
            raise fail(arch, "num_query_groups", h.groups, "does not divide num_attention_heads")
        if get("num_moe_experts"):
            self.check_moe(cfg)

    def check_moe(self, cfg: dict) -> None:
        arch, get = self.name, cfg.get
        check_defaults(arch, cfg, [
            ("moe_router_score_function", "softmax", "HF qwen3_next's router scores are a softmax"),
            ("moe_router_topk_scaling_factor", None, "HF qwen3_next does not scale routing weights"),
            ("moe_router_enable_expert_bias", False, "HF qwen3_next's router has no expert bias"),
            ("moe_router_num_groups", None, "HF qwen3_next routes without expert groups"),
            ("moe_latent_size", None, "latent MoE projections are not exported"),
            ("moe_expert_capacity_factor", None, "HF qwen3_next's experts drop no tokens")])
        check_wanted(arch, cfg, [("moe_shared_expert_gate", True, "HF qwen3_next gates its shared expert "
                                  "(shared_expert_gate)")])
        if not get("moe_shared_expert_intermediate_size"):
            raise fail(arch, "moe_shared_expert_intermediate_size",
                       get("moe_shared_expert_intermediate_size"), "every HF qwen3_next MoE layer has a "
                       "shared expert")

    def config_fields(self, cfg: dict, *, rope_theta: float, hints: dict, tokens: dict) -> dict:
        h, get = Heads.of(cfg), cfg.get
        layers = cfg["num_layers"]
        percent = float(hints.get("rotary_percent") or get("rotary_percent") or 1.0)
        moe = moe_layers(cfg)
        out = {"hidden_size": cfg["hidden_size"], "num_hidden_layers": layers,
               "num_attention_heads": h.heads, "num_key_value_heads": h.groups, "head_dim": h.head_dim,
               "intermediate_size": cfg["ffn_hidden_size"], "hidden_act": "silu",
               "max_position_embeddings": get("max_sequence_length"),
               "rms_norm_eps": get("layernorm_epsilon", 1e-5), "attention_bias": False,
               "attention_dropout": get("attention_dropout", 0.0),
               "rope_parameters": {"rope_type": "default", "rope_theta": float(rope_theta),
                                   "partial_rotary_factor": percent},
               "layer_types": ["linear_attention" if x else "full_attention" for x in linear_layers(cfg)],
               **{f: cfg[f] for f in LINEAR_FIELDS},
               "num_experts": get("num_moe_experts") or 0, "decoder_sparse_step": 1,
               "mlp_only_layers": [i for i, x in enumerate(moe) if not x]}
        if get("num_moe_experts"):
            out.update(num_experts_per_tok=cfg["moe_router_topk"],
                       moe_intermediate_size=get("moe_ffn_hidden_size") or cfg["ffn_hidden_size"],
                       shared_expert_intermediate_size=cfg["moe_shared_expert_intermediate_size"],
                       norm_topk_prob=not get("moe_router_pre_softmax", False), output_router_logits=False,
                       router_aux_loss_coef=get("moe_aux_loss_coeff") or 0.0)
        if out["max_position_embeddings"] is None:
            del out["max_position_embeddings"]
        return out

    # ------------------------------------------------------------------ import

    def mtp_layers_held(self, hf: dict, names) -> int:
        """Qwen3-Next checkpoints on the Hub hold an MTP layer (`mtp.*`), which transformers ignores:
        refused rather than dropped."""
        mtp = sorted(n for n in names if n.startswith("mtp."))
        if mtp:
            raise UCPError(f"cannot import HF {self.name}: the checkpoint holds {len(mtp)} multi-token "
                           f"prediction tensors ({mtp[0]}, ...), which megatron-ucp does not map to "
                           "megatron-core's MTP layers yet (transformers ignores them); remove them to "
                           "import the model without MTP")
        return 0

    def args_of(self, d: dict, args: dict, refuse: Refuse, mtp_layers: int) -> tuple[dict, dict]:
        if d["hidden_act"] != "silu":
            raise refuse("hidden_act", "megatron-core's SwiGLU MLP and Gated DeltaNet use silu")
        if d["attention_bias"]:
            raise refuse("attention_bias", "megatron-core's Gated DeltaNet and experts here have no biases")
        rope = default_rope(d, refuse, self.name)
        theta = float(rope["rope_theta"])
        percent = float(rope.get("partial_rotary_factor", d["partial_rotary_factor"]))
        heads, layers = d["num_attention_heads"], d["num_hidden_layers"]
        groups = d.get("num_key_value_heads") or heads
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        if heads % groups:
            raise refuse("num_key_value_heads", f"does not divide num_attention_heads={heads}")
        if int(head_dim * percent) % 2:
            raise refuse("rope_parameters.partial_rotary_factor", f"rotates {head_dim * percent} dims of "
                         f"head_dim={head_dim}; megatron-core rotates an even number")
        types = d.get("layer_types") or [
            "linear_attention" if (i + 1) % d.get("full_attention_interval", 4) else "full_attention"
            for i in range(layers)]
        odd = sorted(set(types) - {"linear_attention", "full_attention"})
        if odd or len(types) != layers:
            raise refuse("layer_types", "needs one of linear_attention / full_attention per layer")
        if d["linear_num_value_heads"] % d["linear_num_key_heads"]:
            raise refuse("linear_num_value_heads", f"is no multiple of linear_num_key_heads="
                         f"{d['linear_num_key_heads']} (megatron-core's Gated DeltaNet needs one)")
        args.update(num_layers=layers, hidden_size=d["hidden_size"], num_attention_heads=heads,
                    group_query_attention=groups != heads, num_query_groups=groups,
                    ffn_hidden_size=d["intermediate_size"], kv_channels=head_dim, normalization="RMSNorm",
                    layernorm_epsilon=d["rms_norm_eps"], swiglu=True, add_bias_linear=False,
                    add_qkv_bias=False,
                    position_embedding_type="rope", rotary_base=theta, rotary_percent=percent,
                    max_position_embeddings=d["max_position_embeddings"],
                    attention_dropout=d.get("attention_dropout", 0.0), qk_layernorm=True,
                    layernorm_zero_centered_gamma=True, attention_output_gate=True,
                    experimental_attention_variant=GDN,
                    linear_attention_freq=[int(t == "linear_attention") for t in types],
                    **{f: d[f] for f in LINEAR_FIELDS})
        experts = d["num_experts"]
        moe = [experts > 0 and i not in d["mlp_only_layers"] and (i + 1) % d["decoder_sparse_step"] == 0
               for i in range(layers)]
        if any(moe):
            if not d["shared_expert_intermediate_size"]:
                raise refuse("shared_expert_intermediate_size", "megatron-core's shared expert needs a size")
            args.update(num_experts=experts, moe_router_topk=d["num_experts_per_tok"],
                        moe_ffn_hidden_size=d["moe_intermediate_size"], moe_layer_freq=[int(x) for x in moe],
                        moe_shared_expert_intermediate_size=d["shared_expert_intermediate_size"],
                        moe_shared_expert_gate=True, moe_router_pre_softmax=not d["norm_topk_prob"],
                        moe_aux_loss_coeff=float(d.get("router_aux_loss_coef") or 0.0))
        return args, {"activation": "swiglu", "rotary_base": theta, "rotary_percent": percent}


ARCH = Qwen3Next()
