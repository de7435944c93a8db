"""HF `nemotron_h` (NemotronHForCausalLM): megatron-core's hybrid model (MambaModel), one HF block
per layer of its pattern, each a norm and a mixer: Mamba-2 (M), attention (*, GQA, no position
embedding), a squared-ReLU MLP (-) and MoE (E, sigmoid routing with an expert bias and a shared
expert); no biases.

Names in the Hub layout (`backbone.`, experts one tensor each; transformers 5 renames and fuses
them when it loads them). Mamba-2's in_proj [z; x; B; C; dt] and conv1d [x; B; C] are in the same
element order in both (HF splits [gate; xBC; dt], then xBC into [x; B; C]); A_log, D, dt_bias per
head; the gated norm per channel. Every layer's input norm is the layer's `norm`.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

import torch

from megatron_ucp.formats.hf.archs._base import (
    Entry,
    HFArch,
    Refuse,
    Rule,
    check_common,
    check_group_topk,
    check_wanted,
    fail,
    features,
    fill,
    require,
)
from megatron_ucp.formats.tensor_transforms import Heads

if TYPE_CHECKING:  # (source imports this package)
    from megatron_ucp.formats.hf.source import HFDir

log = logging.getLogger(__name__)

LAYERS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}  # symbol -> HF
# transformers 5.12.1's layers_block_type names (5.23.0: linear_attention, full_attention), read too
RELEASE_LAYERS = {"mamba": "M", "attention": "*"}
# transformers 5.12.1 saves the embedding as `backbone.embedding.weight` (its conversion mapping's
# reverse); 5.23.0 as `backbone.embeddings.weight`
RELEASE_NAMES = {"backbone.embedding.weight": "backbone.embeddings.weight"}
SQUARED_RELU = "megatron.core.activations.squared_relu"
# megatron-core's Mamba mixer normalizes its gated output with this eps, whatever layernorm_epsilon
MAMBA_NORM_EPS = 1e-5
MAMBA_CHUNK = 128  # the Mamba mixer's scan chunk length (megatron-core's default)
# transformers' Nemotron-H clamps softplus(dt + dt_bias) from below at time_step_min; megatron-core's
# mixer does not clamp. Written as the smallest normal float: only an fp32/bf16 softplus that
# underflows is raised to it (transformers' initialisation takes log(time_step_min), so not 0)
NO_DT_CLAMP = float(torch.finfo(torch.float32).tiny)
# older Nemotron-H config.json names (transformers renames them when it reads the config)
LEGACY_NAMES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
                "mamba_dt_min": "time_step_min", "mamba_conv_bias": "use_conv_bias",
                "mamba_chunk_size": "chunk_size"}

GLOBAL: list[Entry] = [
    ("embedding.word_embeddings.weight", "copy", ("backbone.embeddings.weight",), ""),
    ("decoder.final_norm.weight", "copy", ("backbone.norm_f.weight",), ""),
    ("output_layer.weight", "copy", ("lm_head.weight",), "untied"),
]
MAMBA: list[Entry] = [
    ("{m}mixer.in_proj.layer_norm_weight", "copy", ("{h}norm.weight",), ""),
    ("{m}mixer.in_proj.weight", "copy", ("{h}mixer.in_proj.weight",), ""),
    ("{m}mixer.conv1d.weight", "copy", ("{h}mixer.conv1d.weight",), ""),
    ("{m}mixer.conv1d.bias", "copy", ("{h}mixer.conv1d.bias",), ""),
    ("{m}mixer.A_log", "copy", ("{h}mixer.A_log",), ""),
    ("{m}mixer.D", "copy", ("{h}mixer.D",), ""),
    ("{m}mixer.dt_bias", "copy", ("{h}mixer.dt_bias",), ""),
    ("{m}mixer.norm.weight", "copy", ("{h}mixer.norm.weight",), ""),
    ("{m}mixer.out_proj.weight", "copy", ("{h}mixer.out_proj.weight",), ""),
]
ATTENTION: list[Entry] = [
    ("{m}self_attention.linear_qkv.layer_norm_weight", "copy", ("{h}norm.weight",), ""),
    ("{m}self_attention.linear_qkv.weight", "qkv",
     ("{h}mixer.q_proj.weight", "{h}mixer.k_proj.weight", "{h}mixer.v_proj.weight"), ""),
    ("{m}self_attention.linear_proj.weight", "copy", ("{h}mixer.o_proj.weight",), ""),
]
MLP: list[Entry] = [
    ("{m}mlp.linear_fc1.layer_norm_weight", "copy", ("{h}norm.weight",), ""),
    ("{m}mlp.linear_fc1.weight", "copy", ("{h}mixer.up_proj.weight",), ""),
    ("{m}mlp.linear_fc2.weight", "copy", ("{h}mixer.down_proj.weight",), ""),
]
MOE: list[Entry] = [
    ("{m}pre_mlp_layernorm.weight", "copy", ("{h}norm.weight",), ""),
    ("{m}mlp.router.weight", "copy", ("{h}mixer.gate.weight",), ""),
    ("{m}mlp.router.expert_bias", "copy", ("{h}mixer.gate.e_score_correction_bias",), ""),
    ("{m}mlp.shared_experts.linear_fc1.weight", "copy", ("{h}mixer.shared_experts.up_proj.weight",), ""),
    ("{m}mlp.shared_experts.linear_fc2.weight", "copy", ("{h}mixer.shared_experts.down_proj.weight",), ""),
]
EXPERT: list[Entry] = [
    ("{m}mlp.experts.experts.{e}.linear_fc1.weight", "copy", ("{h}mixer.experts.{e}.up_proj.weight",), ""),
    ("{m}mlp.experts.experts.{e}.linear_fc2.weight", "copy", ("{h}mixer.experts.{e}.down_proj.weight",), ""),
]


def megatron_pattern(cfg: dict) -> str:
    """A hybrid model's layer symbols, one per decoder layer (megatron-core 0.19's pipeline-stage
    separators `|` dropped: they place layers, they are none)."""
    return (cfg.get("hybrid_layer_pattern") or "").replace("|", "")


class NemotronH(HFArch):
    name = "nemotron_h"
    hf_class = "NemotronHForCausalLM"
    hf_defaults = {
        "layer_norm_epsilon": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "attention_bias": False,
        "mlp_hidden_act": "relu2", "mlp_bias": False, "mamba_hidden_act": "silu", "use_bias": False,
        "mamba_proj_bias": False, "use_conv_bias": True, "conv_kernel": 4, "time_step_min": 0.001,
        "ssm_state_size": 128, "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 7688,
        "moe_shared_expert_intermediate_size": 7688, "routed_scaling_factor": 1.0, "n_group": 1,
        "topk_group": 1, "norm_topk_prob": True, "intermediate_size": 21504, "num_nextn_predict_layers": 0}
    ignored_hf = ()
    # the Mamba scan's chunk length changes no result beyond rounding: export-hf writes import-hf's
    recorded_hf = ("chunk_size", "layers_block_type")

    def release_names(self, recorded: dict) -> dict[str, str]:
        return {new: old for old, new in RELEASE_NAMES.items()} if old_spelling(recorded) else {}

    def rules(self, cfg: dict) -> list[Rule]:
        feats = features(cfg)
        out = fill(GLOBAL, feats)
        if "untied" not in feats:  # HF nemotron_h never ties lm_head: the embedding is stored twice
            out[0] = Rule(out[0].megatron, "dup", ("backbone.embeddings.weight", "lm_head.weight"))
        for i, symbol in enumerate(megatron_pattern(cfg)):
            m, h = f"decoder.layers.{i}.", f"backbone.layers.{i}."
            table = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}.get(symbol)
            if table is None:
                raise fail(self.name, "hybrid_layer_pattern", cfg.get("hybrid_layer_pattern"),
                           f"layer {i} is {symbol!r}; HF nemotron_h has Mamba-2 (M), attention (*), "
                           "MLP (-) and MoE (E) layers")
            out += fill(table, feats, m=m, h=h)
            if symbol == "E":
                for e in range(cfg["num_moe_experts"]):
                    out += fill(EXPERT, feats, m=m, h=h, e=e)
        return out

    # ------------------------------------------------------------------ export

    def model_from_shapes(self, cfg: dict, shapes: dict[str, tuple[int, ...]]) -> dict:
        """What megatron-core's model config does not record of the Mamba mixers but their
        parameters show: the heads (when mamba_num_heads is unset: expand * hidden / head_dim) and
        the conv1d kernel width. Refuses a per-channel D (D_has_hdim), which HF keeps per head."""
        pattern = megatron_pattern(cfg)
        if "M" not in pattern:
            return {}
        m = f"decoder.layers.{pattern.index('M')}.mixer."
        need = [m + n for n in ("A_log", "D", "conv1d.weight", "norm.weight")]
        if any(n not in shapes for n in need):
            return {}  # (plan names what is missing)
        heads = shapes[m + "A_log"][0]
        if shapes[m + "D"] != (heads,):
            raise fail(self.name, "D_has_hdim", True, f"{m}D has shape {list(shapes[m + 'D'])}, one "
                       f"per channel; HF nemotron_h's D has one per head ({heads})")
        if shapes[m + "norm.weight"][0] != heads * cfg["mamba_head_dim"]:
            raise fail(self.name, "mamba_head_dim", cfg["mamba_head_dim"], f"{heads} heads of it are not "
                       f"the {shapes[m + 'norm.weight'][0]} channels of {m}norm.weight")
        return {"mamba_num_heads": heads, "mamba_conv_kernel": shapes[m + "conv1d.weight"][-1]}

    def fp8_refusal(self, cfg: dict) -> str | None:
        if "E" in megatron_pattern(cfg):
            return (f"hybrid_layer_pattern={cfg.get('hybrid_layer_pattern')!r} has MoE layers (E), and "
                    "transformers 5.23 cannot build FP8 experts for Nemotron-H (FP8Experts reads "
                    "config.hidden_act, which NemotronHConfig has not)")
        return None

    def check_exportable(self, cfg: dict, hints: dict) -> None:
        arch, get = self.name, cfg.get
        check_common(arch, cfg)
        pattern = megatron_pattern(cfg)
        if not pattern:
            raise fail(arch, "hybrid_layer_pattern", get("hybrid_layer_pattern"), "HF nemotron_h is a "
                       "hybrid model: export megatron-core's MambaModel (a GPT model has no layer pattern)")
        odd = sorted(set(pattern) - set(LAYERS))
        if odd:
            raise fail(arch, "hybrid_layer_pattern", get("hybrid_layer_pattern"), f"layer symbol(s) {odd} "
                       "have no HF nemotron_h layer; it has Mamba-2 (M), attention (*), MLP (-) and MoE (E)")
        require(arch, cfg, "position_embedding_type", "none", "HF nemotron_h's attention has no position "
                "embedding")
        require(arch, cfg, "normalization", "RMSNorm", "HF nemotron_h uses RMSNorm")
        require(arch, cfg, "gated_linear_unit", False, "HF nemotron_h's MLPs and experts are not gated "
                "(up_proj, relu2, down_proj)")
        if get("activation_func", SQUARED_RELU) != SQUARED_RELU:
            raise fail(arch, "activation_func", get("activation_func"), "HF nemotron_h's MLPs use relu2 "
                       "(megatron-core's squared_relu)")
        if hints.get("activation") not in (None, "squared_relu"):
            raise fail(arch, "activation", hints["activation"], "HF nemotron_h's MLPs use relu2 "
                       "(megatron-core's squared_relu)")
        if get("activation_func_clamp_value") is not None:
            raise fail(arch, "activation_func_clamp_value", get("activation_func_clamp_value"),
                       "HF nemotron_h does not clamp activations")
        if get("add_bias_linear", True) or get("add_qkv_bias"):
            raise fail(arch, "add_bias_linear" if get("add_bias_linear", True) else "add_qkv_bias", True,
                       "HF nemotron_h's attention has no biases (and megatron-core's add_bias_linear puts "
                       "biases on every linear layer or none)")
        if "M" in pattern and get("layernorm_epsilon", 1e-5) != MAMBA_NORM_EPS:
            raise fail(arch, "layernorm_epsilon", get("layernorm_epsilon"), "megatron-core's Mamba mixer "
                       f"normalizes its output with eps {MAMBA_NORM_EPS}; HF nemotron_h uses "
                       "layer_norm_epsilon for every norm")
        h = Heads.of(cfg)
        if "*" in pattern and h.heads % h.groups:
            raise fail(arch, "num_query_groups", h.groups, "does not divide num_attention_heads")
        if "E" in pattern:
            self.check_moe(cfg)

    def check_moe(self, cfg: dict) -> None:
        arch, get = self.name, cfg.get
        check_wanted(arch, cfg, [
            ("moe_router_score_function", "sigmoid", "HF nemotron_h's router scores are sigmoids"),
            ("moe_router_enable_expert_bias", True, "HF nemotron_h's router adds "
             "e_score_correction_bias to choose experts"),
            ("moe_shared_expert_gate", False, "HF nemotron_h's shared experts are not gated"),
            ("moe_router_pre_softmax", False, "HF nemotron_h normalizes the chosen sigmoid scores"),
            ("moe_apply_probs_on_input", False, "HF nemotron_h weights the experts' outputs")])
        if get("moe_latent_size") is not None:
            raise fail(arch, "moe_latent_size", get("moe_latent_size"), "latent MoE projections are not "
                       "exported")
        if get("moe_expert_capacity_factor") is not None:
            raise fail(arch, "moe_expert_capacity_factor", get("moe_expert_capacity_factor"), "HF "
                       "nemotron_h's experts drop no tokens")
        if not get("moe_shared_expert_intermediate_size"):
            raise fail(arch, "moe_shared_expert_intermediate_size",
                       get("moe_shared_expert_intermediate_size"),
                       "every HF nemotron_h MoE layer has a shared expert")
        check_group_topk(arch, cfg)

    def config_fields(self, cfg: dict, *, rope_theta: float, hints: dict, tokens: dict) -> dict:
        h, get = Heads.of(cfg), cfg.get
        pattern = megatron_pattern(cfg)
        names = {v: k for k, v in RELEASE_LAYERS.items()} if old_spelling(tokens) else {}
        out = {"hidden_size": cfg["hidden_size"],
               "layers_block_type": [names.get(c, LAYERS[c]) for c in pattern],
               "num_attention_heads": h.heads, "num_key_value_heads": h.groups, "head_dim": h.head_dim,
               "attention_bias": False, "attention_dropout": get("attention_dropout", 0.0),
               "sliding_window": None, "intermediate_size": cfg["ffn_hidden_size"], "mlp_hidden_act": "relu2",
               "mlp_bias": False, "use_bias": False, "layer_norm_epsilon": get("layernorm_epsilon", 1e-5),
               "max_position_embeddings": get("max_sequence_length"), "residual_in_fp32": False,
               "num_nextn_predict_layers": 0}
        if out["max_position_embeddings"] is None:
            del out["max_position_embeddings"]
        if "M" in pattern:
            heads, head_dim = cfg["mamba_num_heads"], cfg["mamba_head_dim"]
            out.update(ssm_state_size=cfg["mamba_state_dim"], mamba_num_heads=heads, mamba_head_dim=head_dim,
                       n_groups=cfg["mamba_num_groups"], conv_kernel=cfg["mamba_conv_kernel"],
                       mamba_hidden_act="silu", use_conv_bias=True, mamba_proj_bias=False,
                       chunk_size=tokens.get("chunk_size") or MAMBA_CHUNK, time_step_min=NO_DT_CLAMP)
            if heads * head_dim % cfg["hidden_size"] == 0:  # (transformers reads heads and head_dim)
                out["expand"] = heads * head_dim // cfg["hidden_size"]
        if "E" in pattern:
            topk, groups = cfg["moe_router_topk"], get("moe_router_num_groups") or 1
            out.update(n_routed_experts=cfg["num_moe_experts"], num_experts_per_tok=topk,
                       moe_intermediate_size=get("moe_ffn_hidden_size") or cfg["ffn_hidden_size"],
                       moe_shared_expert_intermediate_size=cfg["moe_shared_expert_intermediate_size"],
                       n_shared_experts=1,
                       routed_scaling_factor=float(get("moe_router_topk_scaling_factor") or 1.0),
                       n_group=groups, topk_group=get("moe_router_group_topk") or 1, norm_topk_prob=topk > 1,
                       moe_latent_size=None, output_router_logits=False)
        return out

    # ------------------------------------------------------------------ import

    def import_config(self, hf_dir: HFDir) -> dict:
        """Tensors of another transformers release's spelling read as this one's (`RELEASE_NAMES`).
        transformers' Nemotron-H never ties lm_head to the embedding, whatever
        tie_word_embeddings says: a tied config whose lm_head differs from the embedding is an
        untied model (one whose lm_head is the embedding's copy imports tied)."""
        hf_dir.rename(RELEASE_NAMES)
        config = hf_dir.config
        head, emb = "lm_head.weight", "backbone.embeddings.weight"
        if (config.get("tie_word_embeddings") and head in hf_dir.where and emb in hf_dir.where
                and hf_dir.header(head) == hf_dir.header(emb)
                and not torch.equal(hf_dir.tensor(head), hf_dir.tensor(emb))):
            log.info("%s: config.json says tie_word_embeddings, but transformers' Nemotron-H never "
                     "ties and its lm_head differs from the embedding: importing an untied model", hf_dir.dir)
            return {**config, "tie_word_embeddings": False}
        return config

    def megatron_args(self, hf: dict, where: str, mtp_layers: int = 0) -> tuple[argparse.Namespace, dict]:
        # older names, read as transformers reads them
        hf = {**{new: hf[old] for old, new in LEGACY_NAMES.items() if old in hf}, **hf}
        return super().megatron_args(hf, where, mtp_layers)

    def args_of(self, d: dict, args: dict, refuse: Refuse, mtp_layers: int) -> tuple[dict, dict]:
        """The hybrid model (MambaModel): no position embedding, no biases, squared-ReLU MLPs,
        sigmoid-routed MoE layers with expert bias and a shared expert."""
        pattern = hf_pattern(d, refuse)
        if d["mlp_hidden_act"] != "relu2":
            raise refuse("mlp_hidden_act", "megatron-core's hybrid MLPs are imported with squared_relu "
                         "(relu2)")
        if d["mlp_bias"]:
            raise refuse("mlp_bias", "HF nemotron_h's attention has no biases, and megatron-core's "
                         "add_bias_linear puts biases on every linear layer or none")
        if d.get("sliding_window"):
            raise refuse("sliding_window", "sliding-window attention is not imported")
        if d.get("moe_latent_size") is not None and "E" in pattern:
            raise refuse("moe_latent_size", "latent MoE projections are not imported")
        heads = d["num_attention_heads"]
        groups = d.get("num_key_value_heads") or heads
        if heads % groups:
            raise refuse("num_key_value_heads", f"does not divide num_attention_heads={heads}")
        args.update(num_layers=len(pattern), hybrid_override_pattern=pattern, is_hybrid_model=True,
                    hidden_size=d["hidden_size"], num_attention_heads=heads,
                    group_query_attention=groups != heads, num_query_groups=groups, kv_channels=d["head_dim"],
                    ffn_hidden_size=d["intermediate_size"], normalization="RMSNorm",
                    layernorm_epsilon=d["layer_norm_epsilon"], squared_relu=True, swiglu=False,
                    add_bias_linear=False, add_qkv_bias=False, position_embedding_type="none",
                    max_position_embeddings=d["max_position_embeddings"],
                    attention_dropout=d.get("attention_dropout", 0.0))
        if "M" in pattern:
            args.update(mamba_args(d, refuse))
        if "E" in pattern:
            args.update(moe_args(d, refuse))
        return args, {"activation": "squared_relu"}


def old_spelling(recorded: dict) -> bool:
    """The imported model was written by transformers 5.12.1 (its layer type names): an export of
    it keeps that spelling, which its release reads (5.12.1 refuses 5.23.0's)."""
    return bool(set(recorded.get("layers_block_type") or ()) & set(RELEASE_LAYERS))


def hf_pattern(d: dict, refuse: Refuse) -> str:
    """megatron-core's hybrid layer pattern of a Nemotron-H config (layers_block_type, or the older
    hybrid_override_pattern)."""
    types = d.get("layers_block_type") or d.get("layer_types")
    if types is None:
        pattern = d.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or not pattern:
            raise refuse("layers_block_type", "a Nemotron-H config.json lists its layers")
        types = [LAYERS.get(c, c) for c in pattern]
    symbols = {**{v: k for k, v in LAYERS.items()}, **RELEASE_LAYERS}
    odd = sorted({t for t in types if t not in symbols}, key=str)
    if odd:
        raise refuse("layers_block_type", f"layer type(s) {odd}: megatron-core's hybrid model has "
                     f"{sorted(symbols)}")
    return "".join(symbols[t] for t in types)


def mamba_args(d: dict, refuse: Refuse) -> dict:
    """The Mamba-2 mixers' settings, refusing what megatron-core's mixer computes otherwise."""
    if d["mamba_hidden_act"] != "silu":
        raise refuse("mamba_hidden_act", "megatron-core's Mamba mixer uses silu")
    if d["use_bias"] or d["mamba_proj_bias"]:
        raise refuse("use_bias" if d["use_bias"] else "mamba_proj_bias", "megatron-core's Mamba "
                     "mixer has no in_proj / out_proj bias")
    if not d["use_conv_bias"]:
        raise refuse("use_conv_bias", "megatron-core's hybrid layer specs give the Mamba mixer's "
                     "conv1d a bias")
    if d["conv_kernel"] != 4:
        raise refuse("conv_kernel", "megatron-core's hybrid layer specs build the Mamba mixer's "
                     "conv1d with d_conv 4")
    if d["time_step_min"] > NO_DT_CLAMP:
        raise refuse("time_step_min", "transformers clamps softplus(dt + dt_bias) from below at "
                     "time_step_min; megatron-core's Mamba mixer does not clamp it. To import the "
                     f"model anyway, computing without the clamp, set time_step_min to {NO_DT_CLAMP!r} "
                     "(or 0) in config.json")
    if d["layer_norm_epsilon"] != MAMBA_NORM_EPS:
        raise refuse("layer_norm_epsilon", f"megatron-core's Mamba mixer normalizes its output "
                     f"with eps {MAMBA_NORM_EPS}, whatever layernorm_epsilon says")
    mamba_heads, mamba_groups = d["mamba_num_heads"], d["n_groups"]
    if mamba_heads % mamba_groups:
        raise refuse("n_groups", f"does not divide mamba_num_heads={mamba_heads}")
    return dict(mamba_state_dim=d["ssm_state_size"], mamba_head_dim=d["mamba_head_dim"],
                mamba_num_groups=mamba_groups, mamba_num_heads=mamba_heads)


def moe_args(d: dict, refuse: Refuse) -> dict:
    """The MoE layers' settings: sigmoid routing with expert bias and a shared expert."""
    topk, experts = d["num_experts_per_tok"], d["n_routed_experts"]
    if d["norm_topk_prob"] != (topk > 1):
        raise refuse("norm_topk_prob", f"megatron-core normalizes sigmoid routing weights exactly "
                     f"when top-k > 1 (num_experts_per_tok={topk})")
    n_group, topk_group = d.get("n_group") or 1, d.get("topk_group") or 1
    if n_group > 1 and (topk // topk_group != 2 or experts // n_group < 2):
        raise refuse("topk_group", "transformers scores an expert group by its best two experts; "
                     "megatron-core by its best num_experts_per_tok / topk_group")
    return dict(num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=d["moe_intermediate_size"],
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_topk_scaling_factor=float(d["routed_scaling_factor"]),
                moe_shared_expert_intermediate_size=d["moe_shared_expert_intermediate_size"],
                moe_router_num_groups=n_group if n_group > 1 else None,
                moe_router_group_topk=topk_group if n_group > 1 else None)


ARCH = NemotronH()
