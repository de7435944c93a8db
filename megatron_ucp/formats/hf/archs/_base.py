"""What every Hugging Face architecture module builds on: the name-map data types, the megatron
model features they select on, the refusals most architectures share, and `HFArch`, the hooks an
architecture module fills in (its name rules, refusals, HF config and Megatron args).

A megatron-core GPT model maps to an HF architecture only when every parameter has a place
there and every structural setting means the same thing. Anything else is a `UCPError` naming
the parameter or config field: nothing is dropped or approximated silently.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.megatron_common import YARN_FROM_ARGS

if TYPE_CHECKING:  # (source imports this package)
    from megatron_ucp.formats.hf.source import HFDir

# A name map entry: (universal name, transform, HF names, feature). `{i}` is the global layer
# index, `{e}` the global expert index (`{m}` / `{h}` a megatron / HF layer prefix where an
# architecture says so); transforms are in `formats.tensor_transforms`; feature "" = always, else one
# of FEATURES (or an architecture's own, e.g. DeepSeek-V3's "q_lora").
Entry = tuple[str, str, tuple[str, ...], str]
FEATURES = ("untied", "qkv_bias", "linear_bias", "moe", "qk_norm")
# a non-parameter buffer some HF checkpoints of rotary models carry: skipped on import
ROTARY_INV_FREQ = r"\.rotary_emb\.inv_freq$"
# universal tensors exported in fp32 whatever the export dtype: megatron-core keeps the router's
# expert bias in fp32, and transformers keeps DeepSeek-V3's e_score_correction_bias in fp32
# (_keep_in_fp32_modules_strict): routing compares sums of it with sigmoid scores
KEEP_FP32 = (r"\.mlp\.router\.expert_bias$",)
# the weights of megatron-core's linear layers (either spec's names; MLA's projections, Mamba's
# in_proj / out_proj): in HF models nn.Linear modules (or experts of them), which transformers'
# FP8 quantizer (replace_with_fp8_linear) makes FP8Linear / FP8Experts. Not: the embedding, the
# output layer (transformers keeps lm_head), routers (their own modules), DeepSeek's MTP eh_proj
# (transformers builds no MTP layer), norms and biases
FP8_LINEAR = r"\.(linear_\w+|in_proj|out_proj)\.weight$"
# `refuse(field, why)` of `HFArch.megatron_args`: the UCPError naming a config.json field
Refuse = Callable[[str, str], UCPError]


@dataclass(frozen=True)
class Rule:
    """One universal tensor and the HF tensors holding its numbers."""

    megatron: str
    kind: str
    hf: tuple[str, ...]
    # (e, n): the universal tensor is slice e of the one HF tensor stacking n experts (GPT-OSS)
    slot: tuple[int, int] | None = None


def keeps_fp32(name: str) -> bool:
    return any(re.search(p, name) for p in KEEP_FP32)


def features(cfg: dict) -> set[str]:
    """Which optional parameters a megatron model has (see `FEATURES`)."""
    out = set()
    if not cfg.get("share_embeddings_and_output_weights", True):
        out.add("untied")
    if cfg.get("add_bias_linear", True):
        out |= {"linear_bias", "qkv_bias"}
    if cfg.get("add_qkv_bias", False):
        out.add("qkv_bias")
    if cfg.get("num_moe_experts"):
        out.add("moe")
    if cfg.get("qk_layernorm"):
        out.add("qk_norm")
    return out


def moe_layers(cfg: dict) -> list[bool]:
    """Which decoder layers are MoE layers (megatron-core's moe_layer_freq: every n-th, or a list)."""
    n = cfg["num_layers"]
    if not cfg.get("num_moe_experts"):
        return [False] * n
    freq = cfg.get("moe_layer_freq", 1)
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(n)]
    return [bool(x) for x in freq]


def fill(entries: list[Entry], feats: set[str], **names) -> list[Rule]:
    """The rules of name map `entries` whose feature is on, with `names` filled in."""
    return [Rule(m.format(**names), kind, tuple(h.format(**names) for h in hf))
            for m, kind, hf, when in entries if not when or when in feats]


# ------------------------------------------------------------------------- export refusals


def fail(arch: str, field: str, value, why: str) -> UCPError:
    return UCPError(f"cannot export as HF {arch}: model config {field}={value!r}: {why}")


def differs(value, default) -> bool:
    """A config value other than megatron-core's default (None counts as False)."""
    return value != default and not (default is False and value is None)


def require(arch: str, cfg: dict, field: str, value, why: str) -> None:
    if field in cfg and cfg[field] != value:
        raise fail(arch, field, cfg[field], why.format(arch=arch))


# (field, megatron-core default, why it matters): settings no architecture here has unless it
# says so (`HFArch.allowed`)
COMMON_REFUSALS = (
    ("multi_latent_attention", False, "multi-latent attention has other projections"),
    ("qk_layernorm", False, "HF {arch} has no QK-norm"),
    ("qk_l2_norm", False, "HF {arch} has no QK L2-norm"),
    ("softmax_scale", None, "HF {arch} scales attention by 1/sqrt(head_dim)"),
    ("attention_output_gate", False, "HF {arch} has no attention output gate"),
    ("apply_residual_connection_post_layernorm", False, "HF {arch} adds the residual before the norm"),
    ("layernorm_zero_centered_gamma", False, "HF {arch} norms scale by the weight itself"),
    ("window_size", None, "sliding-window attention is not exported"),
    ("experimental_attention_variant", None, "HF {arch} has standard attention"),
    ("softmax_type", "vanilla", "HF {arch} has vanilla softmax attention"),
    ("mtp_num_layers", None, "multi-token prediction layers have no place in HF {arch}"),
    ("heterogeneous_block_specs", False, "HF {arch} layers are all alike"),
)


def check_common(arch: str, cfg: dict, allowed: tuple[str, ...] = ()) -> None:
    """Refuse a setting of `COMMON_REFUSALS` other than megatron-core's default, but `allowed`."""
    for field, default, why in COMMON_REFUSALS:
        if field not in allowed and differs(cfg.get(field, default), default):
            raise fail(arch, field, cfg.get(field), why.format(arch=arch))


def refuse_hybrid(arch: str, cfg: dict) -> None:
    if cfg.get("hybrid_layer_pattern"):
        raise fail(arch, "hybrid_layer_pattern", cfg.get("hybrid_layer_pattern"), "a hybrid (Mamba) "
                   "model is --arch nemotron_h")


def check_defaults(arch: str, cfg: dict, settings: list[tuple[str, object, str]]) -> None:
    """Refuse a (field, megatron-core default, why) setting other than its default."""
    for field, default, why in settings:
        if differs(cfg.get(field, default), default):
            raise fail(arch, field, cfg.get(field), why)


def check_wanted(arch: str, cfg: dict, settings: list[tuple[str, object, str]]) -> None:
    """Refuse a (field, wanted value, why) setting other than wanted (a bool wanted: truthiness)."""
    for field, want, why in settings:
        got = cfg.get(field)
        if (bool(got) != want) if isinstance(want, bool) else got != want:
            raise fail(arch, field, got, why)


def check_group_topk(arch: str, cfg: dict) -> None:
    """Sigmoid routing over expert groups as transformers scores a group (its best two experts)."""
    topk, experts = cfg.get("moe_router_topk"), cfg.get("num_moe_experts")
    groups, group_topk = cfg.get("moe_router_num_groups"), cfg.get("moe_router_group_topk")
    if groups and groups > 1 and (topk // (group_topk or 1) != 2 or experts // groups < 2):
        raise fail(arch, "moe_router_group_topk", group_topk, "transformers scores an expert group "
                   "by its best two experts; megatron-core by its best topk / group_topk")


def check_rope_moe(arch: str, cfg: dict, hints: dict) -> None:
    """What DeepSeek-V3 and GPT-OSS share after their position embedding: RMSNorm, a gated MLP,
    RoPE on whole heads, MoE."""
    require(arch, cfg, "normalization", "RMSNorm", "HF {arch} uses RMSNorm")
    require(arch, cfg, "gated_linear_unit", True, "HF {arch} has a gated MLP")
    if cfg.get("rotary_interleaved", False):
        raise fail(arch, "rotary_interleaved", True, "HF rotates the two halves of each head")
    check_whole_head_rotary(arch, cfg, hints)
    if hints.get("use_rope_scaling") or cfg.get("rope_scaling"):
        raise fail(arch, "rope_scaling", True, "Llama 3 RoPE scaling is not exported")
    if linear_rope_factor(cfg, hints) is not None:
        raise fail(arch, "seq_len_interpolation_factor", linear_rope_factor(cfg, hints),
                   f"linear RoPE scaling is not exported for HF {arch}")
    if not cfg.get("num_moe_experts"):
        raise fail(arch, "num_moe_experts", cfg.get("num_moe_experts"), f"HF {arch} is a MoE model")


def config_value(d: dict, field: str):
    """A config.json field's value; `rope_parameters.<k>` as transformers reads it (`hf_rope`)."""
    head, _, key = field.partition(".")
    if not key:
        return d.get(field)
    if head == "rope_parameters":
        return hf_rope(d).get(key)
    return (d.get(head) or {}).get(key)


def hints_from_args(args) -> dict:
    """What a Megatron-LM run's args say that megatron-core's model config does not."""
    act = next((flag for flag in ("swiglu", "squared_relu", "quick_geglu", "openai_gelu")
                if getattr(args, flag, False)), "gelu")  # megatron-core's default: exact GELU
    return {"activation": act, "rotary_base": getattr(args, "rotary_base", None),
            "rotary_percent": getattr(args, "rotary_percent", None),
            "use_rope_scaling": getattr(args, "use_rope_scaling", False),
            "rope_scaling_factor": getattr(args, "rope_scaling_factor", None),
            "rotary_seq_len_interpolation_factor": getattr(args, "rotary_seq_len_interpolation_factor", None)}


# ----------------------------------------------------------------------------------- RoPE

# the RoPE kinds transformers gives an original_max_position_embeddings (standardize_rope_params)
ORIGINAL_CONTEXT_KINDS = ("llama3", "yarn", "longrope")


def hf_rope(d: dict) -> dict:
    """A config's RoPE settings as transformers 5 reads them (`standardize_rope_params`):
    rope_parameters over transformers 4's rope_scaling, `type` as `rope_type`, the top-level
    rope_theta and partial_rotary_factor where neither holds them, and a scaled kind's
    original_max_position_embeddings: a top-level one first, else max_position_embeddings."""
    rope = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {})}
    rope["rope_type"] = rope.get("rope_type") or rope.get("type") or "default"
    for key in ("rope_theta", "partial_rotary_factor"):
        if rope.get(key) is None and d.get(key) is not None:
            rope[key] = d[key]
    if rope["rope_type"] in ORIGINAL_CONTEXT_KINDS:
        if d.get("original_max_position_embeddings") is not None:  # (transformers prefers it)
            rope["original_max_position_embeddings"] = d["original_max_position_embeddings"]
        elif rope.get("original_max_position_embeddings") is None:
            rope["original_max_position_embeddings"] = d.get("max_position_embeddings")
    return rope


def default_rope(d: dict, refuse: Refuse, arch: str) -> dict:
    """`hf_rope(d)` of an architecture that imports the default RoPE only (scaled kinds refused)."""
    rope = hf_rope(d)
    if rope["rope_type"] != "default":
        raise refuse("rope_parameters.rope_type", f"{rope['rope_type']!r} RoPE scaling is not imported "
                     f"for {arch} (default only)")
    return rope


def refuse_partial_rotary(d: dict, refuse: Refuse, why: str) -> None:
    """Refuse a partial_rotary_factor other than 1, naming where config.json sets it."""
    inside = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {})}
    field = ("rope_parameters.partial_rotary_factor" if inside.get("partial_rotary_factor") is not None
             else "partial_rotary_factor")
    if float(hf_rope(d).get("partial_rotary_factor") or 1.0) != 1.0:
        raise refuse(field, why)


def linear_rope_factor(cfg: dict, hints: dict) -> float | None:
    """GPTModel's seq_len_interpolation_factor (positions divided by it: transformers' linear RoPE
    scaling): the model config's record, else Megatron-LM's --rotary-seq-len-interpolation-factor
    or import-hf's record (`hints`)."""
    factor = cfg.get("seq_len_interpolation_factor")
    return factor if factor is not None else hints.get("rotary_seq_len_interpolation_factor")


def check_whole_head_rotary(arch: str, cfg: dict, hints: dict) -> None:
    """The HF architectures here rotate whole heads (transformers' apply_rotary_pos_emb has no
    pass-through channels): refuse megatron-core's rotary_percent < 1."""
    percent = hints.get("rotary_percent") or cfg.get("rotary_percent") or 1.0
    if float(percent) != 1.0:
        raise fail(arch, "rotary_percent", percent, f"HF {arch} rotates whole heads (transformers' "
                   "apply_rotary_pos_emb has no pass-through channels); partial rotary embeddings "
                   "are not exported")


# ----------------------------------------------------------------------------------- YaRN


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention scale (megatron-core's and transformers' get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def megatron_yarn_scale(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """The cos/sin scale megatron-core's YaRN applies: mscale(mscale) / mscale(mscale_all_dim)."""
    return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)


def transformers_yarn_scale(factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    """The attention_factor transformers infers when a config gives none: megatron-core's ratio
    only when both are non-zero, else mscale(1)."""
    return megatron_yarn_scale(factor, mscale, mscale_all_dim) if mscale and mscale_all_dim \
        else yarn_mscale(factor, 1.0)


def hf_yarn(rope_theta: float, *, factor: float, original: int, beta_fast: float, beta_slow: float,
            mscale: float, mscale_all_dim: float, truncate: bool | None = None) -> dict:
    """transformers' rope_parameters for megatron-core's YaRN settings."""
    rope = {"rope_type": "yarn", "rope_theta": float(rope_theta), "factor": factor,
            "original_max_position_embeddings": original, "beta_fast": beta_fast, "beta_slow": beta_slow,
            "mscale": mscale, "mscale_all_dim": mscale_all_dim}
    if truncate is not None:  # megatron-core's yarn_correction_range_round_to_int
        rope["truncate"] = truncate
    # say the scale where transformers would infer another one
    wanted = megatron_yarn_scale(factor, mscale, mscale_all_dim)
    if transformers_yarn_scale(factor, mscale, mscale_all_dim) != wanted:
        rope["attention_factor"] = wanted
    return rope


def yarn_rope(cfg: dict, rope_theta: float) -> dict:
    """transformers' yarn rope_parameters of a GPTModel YaRN model (`position_embedding_type`
    yarn: megatron-core's `config.yarn_*`)."""
    rope = hf_yarn(rope_theta, factor=float(cfg["yarn_rotary_scaling_factor"]),
                   original=cfg["yarn_original_max_position_embeddings"],
                   beta_fast=float(cfg["yarn_beta_fast"]), beta_slow=float(cfg["yarn_beta_slow"]),
                   mscale=float(cfg["yarn_mscale"]), mscale_all_dim=float(cfg["yarn_mscale_all_dim"]),
                   truncate=bool(cfg["yarn_correction_range_round_to_int"]))
    if (rope["mscale"], rope["mscale_all_dim"]) == (1.0, 0.0):  # megatron-core's defaults:
        del rope["mscale"], rope["mscale_all_dim"]  # transformers' attention factor mscale(1)
    return rope


def check_yarn_record(arch: str, cfg: dict) -> None:
    """A GPTModel YaRN model's config records the `config.yarn_*` GPTModel reads."""
    missing = [attr for attr, _, _ in YARN_FROM_ARGS if attr not in cfg]
    if missing:  # GPTModel cannot run YaRN without them: the record is damaged
        raise fail(arch, missing[0], None, "a YaRN model's config records its yarn_* settings; "
                   "this checkpoint's manifest lacks them")


def yarn_args(d: dict, rope: dict, refuse: Refuse) -> dict:
    """Megatron-LM's YaRN args (GPTModel's config.yarn_*, set by megatron_rebuild) for
    transformers' yarn `rope` (`hf_rope`), read as transformers' _compute_yarn_parameters reads it:
    every field maps to megatron-core's YarnRotaryEmbedding, which scales cos/sin as transformers
    does (attention_factor: megatron-core's mscale(mscale) / mscale(mscale_all_dim))."""
    original = rope.get("original_max_position_embeddings") or d["max_position_embeddings"]
    factor = float(rope.get("factor") or d["max_position_embeddings"] / original)
    # transformers' inferred scale: its ratio of both where both are non-zero, else mscale(f, 1),
    # which is megatron-core's at (1, 0)
    if rope.get("mscale") and rope.get("mscale_all_dim"):
        mscale, mscale_all_dim = float(rope["mscale"]), float(rope["mscale_all_dim"])
    else:
        mscale, mscale_all_dim = 1.0, 0.0
    given = rope.get("attention_factor")
    if given is not None and given != megatron_yarn_scale(factor, mscale, mscale_all_dim):
        if factor <= 1:
            raise refuse("rope_parameters.attention_factor", f"megatron-core does not scale YaRN's "
                         f"cos/sin when factor={factor} <= 1")
        # any other factor a is mscale(f, (a - 1) / (0.1 ln f)) over mscale(f, 0) = 1
        mscale, mscale_all_dim = (given - 1.0) / (0.1 * math.log(factor)), 0.0
    return dict(position_embedding_type="yarn", rotary_scaling_factor=factor,
                yarn_original_max_position_embeddings=int(original),
                yarn_beta_fast=float(rope.get("beta_fast") or 32),
                yarn_beta_slow=float(rope.get("beta_slow") or 1),
                mscale=mscale, mscale_all_dim=mscale_all_dim,
                yarn_correction_range_round_to_int=bool(rope.get("truncate", True)))


# ------------------------------------------------------------------------- the architecture


class HFArch:
    """One HF architecture: its names, its name map (`rules`), what it refuses to export
    (`check_exportable`), its config.json (`hf_config`, export) and the megatron-core model of a
    config.json (`megatron_args`, import). One instance per module, `ARCH`, in the registry."""

    name: str = ""  # transformers' model_type; export-hf --arch
    hf_class: str = ""  # config.json "architectures"
    # transformers' defaults for fields a config.json may leave out
    hf_defaults: dict = {}
    # tensors some HF checkpoints carry that are not parameters (recomputed buffers): skipped on import
    ignored_hf: tuple[str, ...] = (ROTARY_INV_FREQ,)
    # HF settings megatron-core's model does not hold and that change no result beyond rounding:
    # export-hf writes those of the model import-hf read, if any
    recorded_hf: tuple[str, ...] = ()

    def release_names(self, recorded: dict) -> dict[str, str]:
        """HF tensor renames {name: as written} of an export in the transformers release spelling of
        the model import-hf read (`recorded`: its `recorded_hf` settings); {}: this release's."""
        return {}

    # ------------------------------------------------------------------ export (megatron -> HF)

    def rules(self, cfg: dict) -> list[Rule]:
        """Every universal tensor of a megatron model of config `cfg` as this architecture holds it."""
        raise NotImplementedError

    def model_from_shapes(self, cfg: dict, shapes: dict[str, tuple[int, ...]]) -> dict:
        """Model config settings the manifest does not record but the parameter shapes show."""
        return {}

    def check_exportable(self, cfg: dict, hints: dict) -> None:
        """Refuse a megatron model (manifest `model`, plus Megatron-LM args `hints` when known)
        that this architecture cannot represent exactly, naming the config field."""
        raise NotImplementedError

    def fp8_quantized(self, rule: Rule) -> bool:
        """Whether export-hf --dtype fp8 writes `rule`'s HF tensors as blockwise FP8: the linear
        weights transformers' FP8 quantizer replaces (`FP8_LINEAR`)."""
        return re.search(FP8_LINEAR, rule.megatron) is not None

    def fp8_refusal(self, cfg: dict) -> str | None:
        """Why transformers cannot load this model (config `cfg`) with FP8 weights, or None."""
        return None

    def hf_config(self, cfg: dict, *, vocab: int, dtype: str, rope_theta: float,
                  hints: dict, tokens: dict) -> dict:
        """config.json for megatron model config `cfg` (already `check_exportable`)."""
        common = {"architectures": [self.hf_class], "model_type": self.name, "vocab_size": vocab,
                  "tie_word_embeddings": "untied" not in features(cfg),
                  "initializer_range": cfg.get("init_method_std", 0.02),
                  "dtype": dtype, "use_cache": True,
                  "bos_token_id": tokens.get("bos_token_id"), "eos_token_id": tokens.get("eos_token_id"),
                  "pad_token_id": tokens.get("pad_token_id")}
        return {**common, **self.config_fields(cfg, rope_theta=rope_theta, hints=hints, tokens=tokens)}

    def config_fields(self, cfg: dict, *, rope_theta: float, hints: dict, tokens: dict) -> dict:
        """This architecture's own config.json fields (`hf_config` adds the common ones)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ import (HF -> megatron)

    def mtp_layers_held(self, hf: dict, names) -> int:
        """How many multi-token prediction layers the tensor `names` hold (DeepSeek-V3's)."""
        return 0

    def import_config(self, hf_dir: HFDir) -> dict:
        """The config.json to import the model of `hf_dir` (`source.HFDir`) as: its own."""
        return hf_dir.config

    def megatron_args(self, hf: dict, where: str, mtp_layers: int = 0) -> tuple[argparse.Namespace, dict]:
        """Megatron-LM style args of the megatron-core model equal to HF config `hf` (one rank),
        and what the megatron run must set that the model config does not record (activation,
        rope). mtp_layers: the multi-token prediction layers the checkpoint holds."""
        d = {**self.hf_defaults, **{k: v for k, v in hf.items() if v is not None}}

        def refuse(field: str, why: str) -> UCPError:
            return UCPError(f"{where}: cannot import HF {self.name}: config.json {field}="
                            f"{config_value(d, field)!r}: {why}")

        args = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, world_size=1,
                    data_parallel_size=1, params_dtype=torch.float32, fp16=False, bf16=False,
                    transformer_impl="local", hidden_dropout=0.0, qk_layernorm=False,
                    init_method_std=d.get("initializer_range", 0.02), rotary_percent=1.0)
        args, run = self.args_of(d, args, refuse, mtp_layers)
        args.update(padded_vocab_size=d["vocab_size"],
                    untie_embeddings_and_output_weights=not d["tie_word_embeddings"])
        return argparse.Namespace(**args), run

    def args_of(self, d: dict, args: dict, refuse: Refuse, mtp_layers: int) -> tuple[dict, dict]:
        """`args` updated with this architecture's settings for config `d` (transformers' defaults
        filled in), and the run facts (`megatron_args`)."""
        raise NotImplementedError
