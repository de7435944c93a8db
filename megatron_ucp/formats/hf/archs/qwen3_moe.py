"""HF `qwen3_moe` (Qwen3MoeForCausalLM): Qwen3 (QK-norm, no biases) with every layer a MoE layer of
SwiGLU experts and a softmax top-k router; norm_topk_prob=false is megatron-core's pre-softmax
routing. Experts in the Hub layout (transformers 5 fuses them when it loads them)."""

from __future__ import annotations

from megatron_ucp.formats.hf.archs._base import ROTARY_INV_FREQ, Entry, Refuse
from megatron_ucp.formats.hf.archs._llama_like import ATTENTION, MOE_NORM, check_softmax_moe
from megatron_ucp.formats.hf.archs.qwen3 import QK_NORM, Qwen3

ROUTER: list[Entry] = [
    ("decoder.layers.{i}.mlp.router.weight", "copy", ("model.layers.{i}.mlp.gate.weight",), ""),
]
EXPERT: list[Entry] = [
    ("decoder.layers.{i}.mlp.experts.experts.{e}.linear_fc1.weight", "gate_up",
     ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
      "model.layers.{i}.mlp.experts.{e}.up_proj.weight"), ""),
    ("decoder.layers.{i}.mlp.experts.experts.{e}.linear_fc2.weight", "copy",
     ("model.layers.{i}.mlp.experts.{e}.down_proj.weight",), ""),
]


class Qwen3Moe(Qwen3):
    name = "qwen3_moe"
    hf_class = "Qwen3MoeForCausalLM"
    hf_defaults = {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": False,
                   "rope_theta": 10000.0, "hidden_act": "silu", "num_experts_per_tok": 8,
                   "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []}
    ignored_hf = (ROTARY_INV_FREQ,)
    layer = ATTENTION + QK_NORM + MOE_NORM + ROUTER
    expert = EXPERT
    without_qk_norm = "llama or mixtral"

    def check_moe(self, cfg: dict, feats: set[str]) -> None:
        check_softmax_moe(self.name, "Qwen3-MoE", cfg, feats, dense="qwen3")

    def config_fields(self, cfg: dict, *, rope_theta: float, hints: dict, tokens: dict) -> dict:
        out = super().config_fields(cfg, rope_theta=rope_theta, hints=hints, tokens=tokens)
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

    def moe_args(self, d: dict, args: dict, refuse: Refuse) -> None:
        if d["decoder_sparse_step"] != 1 or d["mlp_only_layers"]:
            field = "decoder_sparse_step" if d["decoder_sparse_step"] != 1 else "mlp_only_layers"
            raise refuse(field, "dense layers between MoE layers are not imported (every layer "
                         "must be a MoE layer)")
        args.update(num_experts=d.get("num_experts", d.get("num_local_experts")),
                    moe_router_topk=d["num_experts_per_tok"],
                    moe_ffn_hidden_size=d["moe_intermediate_size"],
                    moe_router_pre_softmax=not d["norm_topk_prob"],
                    moe_aux_loss_coeff=float(d.get("router_aux_loss_coef") or 0.0))


ARCH = Qwen3Moe()
