"""HF `kimi_k2` (Kimi-K2): DeepSeek-V3's model and tensors (`deepseek_v3`) under Kimi-K2's own
config.json: model_type "kimi_k2", architectures ["DeepseekV3ForCausalLM"] and an auto_map to the
remote code shipped with the weights (configuration_deepseek.DeepseekV3Config, modeling_deepseek),
which reads DeepSeek's original fields: transformers 4's rope_scaling ({"type": "yarn", ...}) and
top-level rope_theta, topk_method / scoring_func (noaux_tc / sigmoid: megatron-core's sigmoid
router with expert bias), moe_layer_freq, ep_size, seq_aux, aux_loss_alpha. transformers has no
kimi_k2 class: its DeepseekV3ForCausalLM runs the same model (the tests load an export that way,
model_type rewritten). Non-weight files (tokenizer, the remote code) are not written here."""

from __future__ import annotations

from megatron_ucp.formats.hf.archs._base import Refuse, fail
from megatron_ucp.formats.hf.archs.deepseek_v3 import DeepseekV3

AUTO_MAP = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModel": "modeling_deepseek.DeepseekV3Model",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}
# the remote DeepseekV3Config's rope_scaling keys (its yarn_get_mscale reads mscale / mscale_all_dim)
REMOTE_YARN = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
               "mscale_all_dim")


class KimiK2(DeepseekV3):
    name = "kimi_k2"
    hf_class = "DeepseekV3ForCausalLM"
    # the remote DeepseekV3Config's defaults for fields Kimi-K2's config.json may leave out
    hf_defaults = {**DeepseekV3.hf_defaults, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                   "moe_layer_freq": 1}

    def config_fields(self, cfg: dict, *, rope_theta: float, hints: dict, tokens: dict) -> dict:
        out = super().config_fields(cfg, rope_theta=rope_theta, hints=hints, tokens=tokens)
        rope = out["rope_parameters"]
        if "attention_factor" in rope:  # the remote code derives it from mscale / mscale_all_dim
            raise fail(self.name, "mscale", cfg.get("mscale"), "Kimi-K2's remote code scales YaRN "
                       "attention by mscale / mscale_all_dim only; this model's scale differs")
        scaling = None
        if rope["rope_type"] == "yarn":
            scaling = {"type": "yarn", **{k: rope[k] for k in REMOTE_YARN}}
        out.update(auto_map=AUTO_MAP, rope_theta=rope["rope_theta"], rope_scaling=scaling,
                   topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1, ep_size=1,
                   seq_aux=True, aux_loss_alpha=float(cfg.get("moe_aux_loss_coeff") or 0.0),
                   pretraining_tp=1)
        return out

    def args_of(self, d: dict, args: dict, refuse: Refuse, mtp_layers: int) -> tuple[dict, dict]:
        """DeepSeek-V3's, with the remote code's routing fields checked (transformers' class has
        none: it always routes as noaux_tc / sigmoid)."""
        if d["scoring_func"] != "sigmoid":
            raise refuse("scoring_func", "Kimi-K2 (DeepSeek-V3) routes by sigmoid scores with an "
                         "expert bias; megatron-core's sigmoid router is imported")
        if d["topk_method"] != "noaux_tc":
            raise refuse("topk_method", "DeepSeek-V3's noaux_tc (expert bias added for the choice) "
                         "is the routing imported")
        if d["moe_layer_freq"] != 1:
            raise refuse("moe_layer_freq", "every layer past first_k_dense_replace is a MoE layer")
        args, run = super().args_of(d, args, refuse, mtp_layers)
        args["moe_aux_loss_coeff"] = float(d.get("aux_loss_alpha") or 0.0)  # (exported back)
        return args, run


ARCH = KimiK2()
