"""HF `deepseek_v2` (DeepseekV2ForCausalLM: DeepSeek-V2, V2-Lite, V2.5): DeepSeek-V3's multi-latent
attention (MLA, with a query LoRA rank or, as V2-Lite, without: megatron-core's linear_q_proj) and
tensors (`deepseek_v3`), with softmax routing: the first first_k_dense_replace layers dense, every
later one a MoE layer whose router takes the top-k of the softmax over all experts, neither
normalized nor biased, times routed_scaling_factor (megatron-core's softmax router with
moe_router_pre_softmax), optionally among the topk_group best of n_group expert groups
(topk_method group_limited_greedy), and shared experts. No MTP layers.

transformers rotates the rope part of q and k as complex numbers of DeepSeek's interleaved pairs
(apply_rotary_emb: view_as_complex), which is the rotation megatron-core's MLA applies to those
pairs after de-interleaving them (the dot products of q and k are the same). transformers'
DeepseekV2 ignores norm_topk_prob (it never normalizes the top-k weights) and scores an expert group
by its best expert, megatron-core by the sum of its best topk / group_topk: both are refused where
they would differ.
"""

from __future__ import annotations

from megatron_ucp.formats.hf.archs._base import (
    ROTARY_INV_FREQ,
    Refuse,
    check_wanted,
    fail,
    moe_layers,
)
from megatron_ucp.formats.hf.archs.deepseek_v3 import MOE, DeepseekV3

# transformers' DeepseekV2Config defaults of the fields read here
HF_DEFAULTS = {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "tie_word_embeddings": False,
               "rope_theta": 10000.0, "hidden_act": "silu", "norm_topk_prob": False,
               "first_k_dense_replace": 0, "routed_scaling_factor": 1.0, "n_shared_experts": 2,
               "q_lora_rank": 1536, "attention_bias": False, "mlp_bias": False, "topk_method": "greedy",
               # (no such field: transformers' DeepseekV2 always rotates interleaved pairs, which
               # DeepSeek-V3's import reads as rope_interleave)
               "rope_interleave": True}


class DeepseekV2(DeepseekV3):
    name = "deepseek_v2"
    hf_class = "DeepseekV2ForCausalLM"
    title = "DeepSeek-V2"
    hf_defaults = HF_DEFAULTS
    ignored_hf = (ROTARY_INV_FREQ,)
    moe = [entry for entry in MOE if not entry[0].endswith("router.expert_bias")]  # (none in V2)

    # ------------------------------------------------------------------ export

    def check_exportable(self, cfg: dict, hints: dict) -> None:
        if cfg.get("mtp_num_layers"):
            raise fail(self.name, "mtp_num_layers", cfg["mtp_num_layers"], "DeepSeek-V2 has no "
                       "multi-token prediction layers (export as deepseek_v3)")
        super().check_exportable(cfg, hints)

    def check_moe(self, cfg: dict) -> None:
        arch, get = self.name, cfg.get
        check_wanted(arch, cfg, [
            ("moe_router_score_function", "softmax", "DeepSeek-V2's router scores are a softmax"),
            ("moe_router_pre_softmax", True, "DeepSeek-V2 takes the top-k of the softmax over all "
             "experts (megatron-core's moe_router_pre_softmax), not a softmax of the top-k"),
            ("moe_router_enable_expert_bias", False, "DeepSeek-V2's router has no expert bias"),
            ("moe_shared_expert_gate", False, "DeepSeek-V2's shared experts are not gated")])
        shared = get("moe_shared_expert_intermediate_size")
        ffn = get("moe_ffn_hidden_size") or get("ffn_hidden_size")
        if not shared or shared % ffn:
            raise fail(arch, "moe_shared_expert_intermediate_size", shared, "DeepSeek-V2's shared "
                       f"experts are n_shared_experts experts of moe_ffn_hidden_size={ffn}")
        moe_at = moe_layers(cfg)
        k = moe_at.index(True)
        if moe_at != [False] * k + [True] * (len(moe_at) - k):
            raise fail(arch, "moe_layer_freq", get("moe_layer_freq"), "DeepSeek-V2's first "
                       "first_k_dense_replace layers are dense, every later one a MoE layer")
        topk, experts = cfg["moe_router_topk"], cfg["num_moe_experts"]
        groups, group_topk = get("moe_router_num_groups") or 1, get("moe_router_group_topk") or 1
        if groups > 1 and (topk // group_topk != 1 or experts % groups):
            raise fail(arch, "moe_router_group_topk", group_topk, "transformers' DeepSeek-V2 scores an "
                       "expert group by its best expert; megatron-core by the sum of its best "
                       f"moe_router_topk / moe_router_group_topk = {topk // group_topk}")

    def config_fields(self, cfg: dict, *, rope_theta: float, hints: dict, tokens: dict) -> dict:
        out = super().config_fields(cfg, rope_theta=rope_theta, hints=hints, tokens=tokens)
        for key in ("rope_interleave", "num_nextn_predict_layers"):  # (DeepSeek-V3's fields)
            del out[key]
        groups = out["n_group"]
        out.update(norm_topk_prob=False, mlp_bias=False,
                   topk_method="group_limited_greedy" if groups > 1 else "greedy")
        return out

    # ------------------------------------------------------------------ import

    def mtp_layers_held(self, hf: dict, names) -> int:
        return 0

    def moe_args(self, d: dict, refuse: Refuse) -> dict:
        """The layers of config `d`: the first first_k_dense_replace dense, every later one a MoE
        layer with softmax routing (top-k of the softmax, scaled), expert groups, shared experts."""
        layers, topk, experts = d["num_hidden_layers"], d.get("num_experts_per_tok"), d["n_routed_experts"]
        if not topk:
            raise refuse("num_experts_per_tok", "DeepSeek-V2's MoE layers need a top-k")
        if d["mlp_bias"]:
            raise refuse("mlp_bias", "megatron-core's add_bias_linear puts biases on every linear "
                         "layer or none")
        k = d["first_k_dense_replace"]
        if not 0 <= k < layers:
            raise refuse("first_k_dense_replace", f"needs 0 <= k < num_hidden_layers={layers} (a MoE model)")
        if d.get("moe_layer_freq", 1) != 1:  # (DeepSeek's remote code reads it, transformers does not)
            raise refuse("moe_layer_freq", "transformers' DeepSeek-V2 makes every layer past "
                         "first_k_dense_replace a MoE layer")
        if d.get("scoring_func", "softmax") != "softmax":
            raise refuse("scoring_func", "transformers' DeepSeek-V2 routes by a softmax")
        if d["norm_topk_prob"] and topk > 1:
            raise refuse("norm_topk_prob", "transformers' DeepSeek-V2 ignores it (never normalizes the "
                         "top-k weights), DeepSeek's remote code normalizes them: which one is meant "
                         "is not known")
        method = d["topk_method"]
        groups, group_topk = d.get("n_group") or 1, d.get("topk_group") or 1
        if method == "greedy":
            groups = group_topk = 1
        elif method != "group_limited_greedy":
            raise refuse("topk_method", "transformers' DeepSeek-V2 routes by greedy or "
                         "group_limited_greedy")
        if groups > 1 and experts % groups:
            raise refuse("n_group", f"does not divide n_routed_experts={experts}")
        if groups > 1 and topk // group_topk != 1:
            raise refuse("topk_group", "transformers' DeepSeek-V2 scores an expert group by its best "
                         "expert; megatron-core by the sum of its best num_experts_per_tok / topk_group "
                         f"= {topk // group_topk} (imported where that is 1)")
        if not d["n_shared_experts"]:
            raise refuse("n_shared_experts", "megatron-core's DeepSeek-V2 MoE layer has shared experts "
                         "(transformers 5.12's has none to run without)")
        ffn = d["moe_intermediate_size"]
        return dict(num_layers=layers, ffn_hidden_size=d["intermediate_size"], num_experts=experts,
                    moe_router_topk=topk, moe_ffn_hidden_size=ffn,
                    moe_layer_freq=[0] * k + [1] * (layers - k),
                    moe_router_score_function="softmax", moe_router_pre_softmax=True,
                    moe_router_enable_expert_bias=False,
                    moe_router_topk_scaling_factor=float(d["routed_scaling_factor"]),
                    moe_shared_expert_intermediate_size=ffn * d["n_shared_experts"],
                    moe_router_num_groups=groups if groups > 1 else None,
                    moe_router_group_topk=group_topk if groups > 1 else None)


ARCH = DeepseekV2()
