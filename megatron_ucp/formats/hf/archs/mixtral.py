"""HF `mixtral` (MixtralForCausalLM): Llama's attention, every layer a MoE layer of SwiGLU experts
with a softmax top-k router (renormalized), no biases. The names are those of every Mixtral
checkpoint on the Hub (and transformers' save_pretrained): w1 = gate, w3 = up, w2 = down."""

from __future__ import annotations

from megatron_ucp.formats.hf.archs._base import ROTARY_INV_FREQ, Entry, Refuse, fail
from megatron_ucp.formats.hf.archs._llama_like import ATTENTION, MOE_NORM, LlamaLike, check_softmax_moe

ROUTER: list[Entry] = [
    ("decoder.layers.{i}.mlp.router.weight", "copy", ("model.layers.{i}.block_sparse_moe.gate.weight",), ""),
]
EXPERT: list[Entry] = [
    ("decoder.layers.{i}.mlp.experts.experts.{e}.linear_fc1.weight", "gate_up",
     ("model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
      "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight"), ""),
    ("decoder.layers.{i}.mlp.experts.experts.{e}.linear_fc2.weight", "copy",
     ("model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",), ""),
]


class Mixtral(LlamaLike):
    name = "mixtral"
    hf_class = "MixtralForCausalLM"
    hf_defaults = {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096 * 32,
                   "tie_word_embeddings": False, "rope_theta": 1e6, "hidden_act": "silu",
                   "num_experts_per_tok": 2}
    ignored_hf = (ROTARY_INV_FREQ,)
    layer = ATTENTION + MOE_NORM + ROUTER
    expert = EXPERT
    window_without_flag = True

    def check_moe(self, cfg: dict, feats: set[str]) -> None:
        check_softmax_moe(self.name, "Mixtral", cfg, feats, dense="llama", extra=(
            ("moe_router_pre_softmax", False, "Mixtral renormalizes the top-k softmax weights"),))
        ffn = cfg.get("moe_ffn_hidden_size")
        if ffn not in (None, cfg.get("ffn_hidden_size")):
            raise fail(self.name, "moe_ffn_hidden_size", ffn, "Mixtral's intermediate_size is both; "
                       f"ffn_hidden_size is {cfg.get('ffn_hidden_size')}")

    def config_fields(self, cfg: dict, *, rope_theta: float, hints: dict, tokens: dict) -> dict:
        out = super().config_fields(cfg, rope_theta=rope_theta, hints=hints, tokens=tokens)
        out.update(num_local_experts=cfg["num_moe_experts"], num_experts_per_tok=cfg["moe_router_topk"],
                   sliding_window=None, output_router_logits=False, router_jitter_noise=0.0,
                   router_aux_loss_coef=cfg.get("moe_aux_loss_coeff") or 0.0)
        return out

    def moe_args(self, d: dict, args: dict, refuse: Refuse) -> None:
        args.update(num_experts=d["num_local_experts"], moe_router_topk=d["num_experts_per_tok"],
                    moe_ffn_hidden_size=d["intermediate_size"],
                    moe_aux_loss_coeff=float(d.get("router_aux_loss_coef") or 0.0))


ARCH = Mixtral()
