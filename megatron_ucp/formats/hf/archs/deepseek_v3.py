"""HF `deepseek_v3` (DeepseekV3ForCausalLM): multi-latent attention (MLA, with or without a query
LoRA rank), the first first_k_dense_replace layers dense and every later one a MoE layer with
sigmoid routing, an expert bias (e_score_correction_bias) and shared experts, default RoPE or
YaRN, and multi-token prediction (MTP) layers as decoder layers num_hidden_layers + k.

Names (decoder layers and MTP layers alike; `{m}` the megatron layer prefix, `{h}` the HF one):
MLA's projections keep their element order: kv_a_proj_with_mqa is [kv latent; shared rope key],
q_b_proj / kv_b_proj are per head [no-rope; rope] / [k; v], as megatron-core's. The rope rows are
in DeepSeek's interleaved-pair order in both (megatron-core's MLA de-interleaves them before
rotating, as transformers does with rope_interleave=True). Norms carry Transformer Engine's fused
names (param_spec.TE_FUSED_NORMS): the q / kv latent norms are the up-projections'
layer_norm_weight, a dense MLP's norm linear_fc1's. Features: "q_lora" | "no_q_lora".
"""

from __future__ import annotations

import math

from megatron_ucp import mcore_compat
from megatron_ucp.formats.hf.archs._base import (
    ROTARY_INV_FREQ,
    Entry,
    HFArch,
    Refuse,
    Rule,
    check_common,
    check_group_topk,
    check_rope_moe,
    check_wanted,
    fail,
    features,
    fill,
    hf_rope,
    hf_yarn,
    megatron_yarn_scale,
    moe_layers,
    refuse_hybrid,
    refuse_partial_rotary,
    require,
    transformers_yarn_scale,
    yarn_mscale,
)

ATTENTION: list[Entry] = [
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
DENSE: list[Entry] = [
    ("{m}mlp.linear_fc1.layer_norm_weight", "copy", ("{h}post_attention_layernorm.weight",), ""),
    ("{m}mlp.linear_fc1.weight", "gate_up", ("{h}mlp.gate_proj.weight", "{h}mlp.up_proj.weight"), ""),
    ("{m}mlp.linear_fc2.weight", "copy", ("{h}mlp.down_proj.weight",), ""),
]
# the router's aux-loss-free expert bias (a buffer in megatron-core) is DeepSeek's
# e_score_correction_bias; experts in the Hub layout (transformers 5 fuses them when it loads)
MOE: list[Entry] = [
    ("{m}pre_mlp_layernorm.weight", "copy", ("{h}post_attention_layernorm.weight",), ""),
    ("{m}mlp.router.weight", "copy", ("{h}mlp.gate.weight",), ""),
    ("{m}mlp.router.expert_bias", "copy", ("{h}mlp.gate.e_score_correction_bias",), ""),
    ("{m}mlp.shared_experts.linear_fc1.weight", "gate_up",
     ("{h}mlp.shared_experts.gate_proj.weight", "{h}mlp.shared_experts.up_proj.weight"), ""),
    ("{m}mlp.shared_experts.linear_fc2.weight", "copy", ("{h}mlp.shared_experts.down_proj.weight",), ""),
]
EXPERT: list[Entry] = [
    ("{m}mlp.experts.experts.{e}.linear_fc1.weight", "gate_up",
     ("{h}mlp.experts.{e}.gate_proj.weight", "{h}mlp.experts.{e}.up_proj.weight"), ""),
    ("{m}mlp.experts.experts.{e}.linear_fc2.weight", "copy", ("{h}mlp.experts.{e}.down_proj.weight",), ""),
]
# a multi-token prediction layer k is DeepSeek's extra decoder layer num_hidden_layers + k
MTP: list[Entry] = [
    ("mtp.layers.{k}.enorm.weight", "copy", ("{h}enorm.weight",), ""),
    ("mtp.layers.{k}.hnorm.weight", "copy", ("{h}hnorm.weight",), ""),
    ("mtp.layers.{k}.eh_proj.weight", "copy", ("{h}eh_proj.weight",), ""),
    ("mtp.layers.{k}.final_layernorm.weight", "copy", ("{h}shared_head.norm.weight",), ""),
]


class DeepseekV3(HFArch):
    name = "deepseek_v3"
    hf_class = "DeepseekV3ForCausalLM"
    hf_defaults = {"rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
                   "rope_theta": 10000.0, "hidden_act": "silu", "num_experts_per_tok": 8,
                   "norm_topk_prob": True, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
                   "routed_scaling_factor": 2.5, "n_shared_experts": 1, "q_lora_rank": 1536,
                   "rope_interleave": True, "attention_bias": False, "num_nextn_predict_layers": 1}
    ignored_hf = (ROTARY_INV_FREQ,)

    # the name maps of a layer (GLM-4.5 puts its own attention and dense MLP here)
    attention, dense, moe, expert = ATTENTION, DENSE, MOE, EXPERT
    title = "DeepSeek-V3"  # the model's name in messages

    def rule_features(self, cfg: dict) -> set[str]:
        """The features (`fill`) this model's name maps select on."""
        return {"q_lora" if cfg.get("q_lora_rank") else "no_q_lora"}

    def rules(self, cfg: dict) -> list[Rule]:
        feats = self.rule_features(cfg)
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
            rules = fill(self.attention, feats, m=m, h=h)
            if not is_moe:
                return rules + fill(self.dense, feats, m=m, h=h)
            rules += fill(self.moe, feats, m=m, h=h)
            for e in range(cfg["num_moe_experts"]):
                rules += fill(self.expert, feats, m=m, h=h, e=e)
            return rules

        for i in range(layers):
            out += layer(f"decoder.layers.{i}.", f"model.layers.{i}.", moe[i])
        for k, h in enumerate(mtp_prefixes):  # megatron-core builds MTP layers like the last layer
            out += fill(MTP, feats, k=k, h=h)
            out += layer(f"mtp.layers.{k}.transformer_layer.", h, moe[-1])
        return out

    # ------------------------------------------------------------------ export

    def check_exportable(self, cfg: dict, hints: dict) -> None:
        arch, get = self.name, cfg.get
        refuse_hybrid(arch, cfg)
        check_common(arch, cfg, allowed=("multi_latent_attention", "qk_layernorm", "mtp_num_layers"))
        # (DeepSeek-V3's YaRN is MLA's rope_type)
        require(arch, cfg, "position_embedding_type", "rope", "HF {arch} uses rotary position embeddings")
        check_rope_moe(arch, cfg, hints)
        if not get("multi_latent_attention"):
            raise fail(arch, "multi_latent_attention", get("multi_latent_attention"),
                       "DeepSeek-V3's attention is multi-latent attention")
        if not get("qk_layernorm"):
            raise fail(arch, "qk_layernorm", get("qk_layernorm"), "DeepSeek-V3 normalizes the q and kv "
                       "latents (q_a_layernorm, kv_a_layernorm)")
        if get("add_bias_linear", True) or get("add_qkv_bias"):
            raise fail(arch, "add_bias_linear", True, "DeepSeek-V3's linear layers have no biases "
                       "(its attention_bias covers only the attention projections)")
        if get("layernorm_epsilon", 1e-5) != 1e-6:
            raise fail(arch, "layernorm_epsilon", get("layernorm_epsilon", 1e-5), f"HF {arch} "
                       "normalizes the q and kv latents with eps 1e-6 whatever rms_norm_eps says")
        if not str(get("activation_func", "silu")).endswith("silu"):
            raise fail(arch, "activation_func", get("activation_func"), "DeepSeek-V3's MLP is SwiGLU")
        if get("rope_type", "yarn") not in ("yarn", "rope"):
            raise fail(arch, "rope_type", get("rope_type"), "only rope and yarn are exported")
        if get("rope_type", "yarn") == "rope" and yarn_mscale(get("rotary_scaling_factor", 40.0),
                                                            get("mscale_all_dim", 0.0)) != 1.0:
            raise fail(arch, "mscale_all_dim", get("mscale_all_dim"), "megatron-core scales MLA's "
                       "softmax by it also without YaRN; transformers only with YaRN")
        self.check_moe(cfg)

    def check_moe(self, cfg: dict) -> None:
        arch, get, title = self.name, cfg.get, self.title
        check_wanted(arch, cfg, [
            ("moe_router_score_function", "sigmoid", f"{title}'s router scores are sigmoids"),
            ("moe_router_enable_expert_bias", True, f"{title}'s router adds e_score_correction_bias "
             "to choose experts"),
            ("moe_shared_expert_gate", False, f"{title}'s shared experts are not gated"),
            ("moe_router_pre_softmax", False, f"{title} normalizes the chosen sigmoid scores")])
        shared = get("moe_shared_expert_intermediate_size")
        ffn = get("moe_ffn_hidden_size") or get("ffn_hidden_size")
        if not shared or shared % ffn:
            raise fail(arch, "moe_shared_expert_intermediate_size", shared, f"{title}'s shared experts "
                       f"are n_shared_experts experts of moe_ffn_hidden_size={ffn}")
        moe_at = moe_layers(cfg)
        k = moe_at.index(True)
        if moe_at != [False] * k + [True] * (len(moe_at) - k):
            raise fail(arch, "moe_layer_freq", get("moe_layer_freq"), f"{title}'s first "
                       "first_k_dense_replace layers are dense, every later one a MoE layer")
        check_group_topk(arch, cfg)

    def config_fields(self, cfg: dict, *, rope_theta: float, hints: dict, tokens: dict) -> dict:
        layers, get = cfg["num_layers"], cfg.get
        if get("rope_type", "yarn") == "yarn":
            rope = hf_yarn(rope_theta, factor=float(get("rotary_scaling_factor", 40.0)),
                           original=get("original_max_position_embeddings", 4096),
                           beta_fast=float(get("beta_fast", 32.0)), beta_slow=float(get("beta_slow", 1.0)),
                           mscale=float(get("mscale", 1.0)), mscale_all_dim=float(get("mscale_all_dim", 0.0)))
        else:
            rope = {"rope_type": "default", "rope_theta": float(rope_theta)}
        out = {"hidden_size": cfg["hidden_size"], "num_hidden_layers": layers,
               "num_attention_heads": cfg["num_attention_heads"],
               "num_key_value_heads": cfg["num_attention_heads"],
               **sigmoid_moe_fields(cfg),
               "kv_lora_rank": cfg["kv_lora_rank"], "q_lora_rank": get("q_lora_rank"),
               "qk_nope_head_dim": cfg["qk_head_dim"], "qk_rope_head_dim": cfg["qk_pos_emb_head_dim"],
               "v_head_dim": cfg["v_head_dim"], "head_dim": cfg["qk_pos_emb_head_dim"],
               "hidden_act": "silu", "rope_parameters": rope,
               "rope_interleave": True, "attention_bias": False,
               "max_position_embeddings": get("max_sequence_length"),
               "rms_norm_eps": get("layernorm_epsilon", 1e-5),
               "attention_dropout": get("attention_dropout", 0.0)}
        if out["max_position_embeddings"] is None:
            del out["max_position_embeddings"]
        return out

    # ------------------------------------------------------------------ import

    def megatron_args(self, hf: dict, where: str, mtp_layers: int = 0):
        """q_lora_rank null (V2-Lite's, no query LoRA) is not the default 1536 config.json omits."""
        if "q_lora_rank" in hf and hf["q_lora_rank"] is None:
            hf = {**hf, "q_lora_rank": 0}
        return super().megatron_args(hf, where, mtp_layers)

    def mtp_layers_held(self, hf: dict, names) -> int:
        """transformers' own save_pretrained writes no MTP layer, DeepSeek's checkpoints theirs."""
        first = hf.get("num_hidden_layers", 0)
        declared = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 1)) or 0
        return sum(f"model.layers.{first + k}.eh_proj.weight" in names for k in range(declared))

    def args_of(self, d: dict, args: dict, refuse: Refuse, mtp_layers: int) -> tuple[dict, dict]:
        """MLA, sigmoid routing with expert bias, shared experts, first-k-dense, and the
        `mtp_layers` MTP layers the checkpoint holds."""
        if d["hidden_act"] != "silu":
            raise refuse("hidden_act", "megatron-core's SwiGLU MLP uses silu")
        if not d["rope_interleave"]:
            raise refuse("rope_interleave", "megatron-core's MLA rotates DeepSeek's interleaved pairs "
                         "of rope dimensions only")
        if d["attention_bias"]:
            raise refuse("attention_bias", "megatron-core's add_bias_linear puts biases on every "
                         "linear layer or none")
        if d["rms_norm_eps"] != 1e-6:
            raise refuse("rms_norm_eps", f"HF {self.name} normalizes the q and kv latents with eps 1e-6, "
                         "megatron-core every norm with one layernorm_epsilon")
        heads = d["num_attention_heads"]
        if (d.get("num_key_value_heads") or heads) != heads:
            raise refuse("num_key_value_heads", "multi-latent attention has a key and value per head")
        theta, mla = mla_args(d, refuse)
        args.update(hidden_size=d["hidden_size"], num_attention_heads=heads,
                    group_query_attention=False, num_query_groups=None, kv_channels=d["v_head_dim"],
                    normalization="RMSNorm", layernorm_epsilon=d["rms_norm_eps"],
                    swiglu=True, add_bias_linear=False, add_qkv_bias=False, position_embedding_type="rope",
                    max_position_embeddings=d["max_position_embeddings"],
                    attention_dropout=d.get("attention_dropout", 0.0), mtp_num_layers=mtp_layers or None,
                    **self.moe_args(d, refuse), **mla)
        return args, {"activation": "swiglu", "rotary_base": theta}

    def moe_args(self, d: dict, refuse: Refuse) -> dict:
        """The layers of config `d`: the first first_k_dense_replace dense, every later one a MoE
        layer with sigmoid routing, expert bias, shared experts, scaled top-k, expert groups."""
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
            raise refuse("n_shared_experts", f"megatron-core's {self.title} MoE layer has shared experts")
        ffn = d["moe_intermediate_size"]
        return dict(num_layers=layers, ffn_hidden_size=d["intermediate_size"], num_experts=experts,
                    moe_router_topk=topk, moe_ffn_hidden_size=ffn,
                    moe_layer_freq=[0] * k + [1] * (layers - k),
                    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_topk_scaling_factor=float(d["routed_scaling_factor"]),
                    moe_shared_expert_intermediate_size=ffn * d["n_shared_experts"],
                    moe_router_num_groups=groups if groups > 1 else None,
                    moe_router_group_topk=group_topk if groups > 1 else None)


def sigmoid_moe_fields(cfg: dict) -> dict:
    """config.json's MoE fields of a model `DeepseekV3.check_moe` passed (DeepSeek-V3's spelling,
    which GLM-4.5 shares)."""
    get = cfg.get
    ffn = get("moe_ffn_hidden_size") or cfg["ffn_hidden_size"]
    topk, groups = cfg["moe_router_topk"], get("moe_router_num_groups") or 1
    return {"intermediate_size": cfg["ffn_hidden_size"], "moe_intermediate_size": ffn,
            "n_routed_experts": cfg["num_moe_experts"], "num_experts_per_tok": topk,
            "n_shared_experts": get("moe_shared_expert_intermediate_size") // ffn,
            "routed_scaling_factor": float(get("moe_router_topk_scaling_factor") or 1.0),
            "n_group": groups, "topk_group": get("moe_router_group_topk") or 1,
            "norm_topk_prob": topk > 1, "first_k_dense_replace": moe_layers(cfg).index(True),
            "num_nextn_predict_layers": get("mtp_num_layers") or 0, "output_router_logits": False}


def mla_args(d: dict, refuse: Refuse) -> tuple[float, dict]:
    """rope_theta and megatron-core's MLA settings (its rope_type: rope or yarn) of config `d`."""
    rope = hf_rope(d)
    theta, kind = float(rope["rope_theta"]), rope["rope_type"]
    refuse_partial_rotary(d, refuse, "DeepSeek-V3's rotary part of a head is qk_rope_head_dim; "
                          "transformers' DeepSeek-V3 rotates all of it")
    if not d["q_lora_rank"] and not mcore_compat.local_mla_qk_norm_without_q_lora():
        raise refuse("q_lora_rank", f"null (no query LoRA rank) cannot be built by "
                     f"{mcore_compat.release_name()}: its MLA wants a Q norm fused into linear_q_proj "
                     "there (transformer/mla_qk_norm_config.py), a layer only Transformer Engine has and "
                     "a norm HF's model lacks; import it with megatron-core 0.16")
    mla = dict(multi_latent_attention=True, q_lora_rank=d["q_lora_rank"] or None,
               kv_lora_rank=d["kv_lora_rank"],
               qk_head_dim=d["qk_nope_head_dim"], qk_pos_emb_head_dim=d["qk_rope_head_dim"],
               v_head_dim=d["v_head_dim"], rotary_base=theta, qk_layernorm=True)
    if kind == "yarn":
        original = rope.get("original_max_position_embeddings")
        factor = rope.get("factor") or d["max_position_embeddings"] / original
        mscale, mscale_all_dim = rope.get("mscale") or 1.0, rope.get("mscale_all_dim") or 0.0
        # transformers' cos/sin scale (attention_factor) against megatron-core's
        theirs = rope.get("attention_factor")
        if theirs is None:
            theirs = transformers_yarn_scale(factor, rope.get("mscale"), rope.get("mscale_all_dim"))
        if not math.isclose(theirs, megatron_yarn_scale(factor, mscale, mscale_all_dim), rel_tol=1e-12):
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
        raise refuse("rope_parameters.rope_type", f"{kind!r} RoPE scaling is not imported for "
                     "DeepSeek-V3 (default and yarn: megatron-core's MLA rope_type rope and yarn)")
    return theta, mla


ARCH = DeepseekV3()
