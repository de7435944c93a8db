"""The name map of a DeepSpeed import (YAML; schema in configs/deepspeed/README.md).

A DeepSpeed universal folder says nothing about the model beyond parameter names and shapes, and
DeepSpeed trains arbitrary torch modules. The map says which megatron-core model the run is
(`model`: the settings the model is rebuilt from, so the universal specs are megatron-core's own)
and, rule by rule, which megatron-core parameter each DeepSpeed parameter is and how its elements
are ordered (`layouts`). Every DeepSpeed parameter must match exactly one rule and every
megatron-core parameter must be produced exactly once: anything else is a `UCPError` naming the
parameter and the map file, never a silently dropped or invented tensor.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.deepspeed.layouts import LAYOUTS
from megatron_ucp.formats.tensor_transforms import Heads
from megatron_ucp.spec import ParamSpec

# model settings: name -> default (REQUIRED: must be given)
REQUIRED = object()
MODEL_FIELDS = {
    "num_layers": REQUIRED, "hidden_size": REQUIRED, "ffn_hidden_size": REQUIRED,
    "num_attention_heads": REQUIRED, "vocab_size": REQUIRED, "params_dtype": REQUIRED,
    "num_query_groups": None, "kv_channels": None,
    "max_position_embeddings": None, "position_embedding_type": "learned_absolute",
    "rotary_base": 10000, "rotary_percent": 1.0,
    "normalization": "LayerNorm", "layernorm_epsilon": 1e-5, "activation": "gelu",
    "add_bias_linear": True, "add_qkv_bias": None, "tied_embeddings": True,
}
# sizes a map may leave to the checkpoint (`auto`): the DeepSpeed tensors' shapes say them, the
# heads come from the saving run's args (Megatron-DeepSpeed) or hidden_size / kv_channels
AUTO = "auto"
SIZES = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size",
         "num_query_groups", "max_position_embeddings")
ACTIVATIONS = ("gelu", "relu", "squared_relu", "swiglu")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
POSITIONS = ("learned_absolute", "rope", "none")
NORMS = ("LayerNorm", "RMSNorm")
OPTIMIZER_FIELDS = ("lr", "betas", "eps", "weight_decay")
RULE_FIELDS = ("ds", "mcore", "layout", "layer_offset", "qkv_blocks")


@dataclass(frozen=True)
class Rule:
    """DeepSpeed names matching `ds` (the whole name) are megatron-core's `mcore`, with `{layer}`
    the regex's `layer` group (else its first group) minus `layer_offset`."""

    index: int
    ds: re.Pattern
    mcore: str
    layout: str = "same"
    layer_offset: int = 0
    qkv_blocks: int = 1

    def target(self, ds_name: str) -> str | None:
        m = self.ds.fullmatch(ds_name)
        if m is None:
            return None
        if "{layer}" not in self.mcore:
            return self.mcore
        group = m.group("layer") if "layer" in self.ds.groupindex else m.group(1)
        return self.mcore.format(layer=int(group) - self.layer_offset)

    def describe(self) -> str:
        return f"rule {self.index} (ds: {self.ds.pattern!r})"


@dataclass
class NameMap:
    path: Path
    model: dict  # MODEL_FIELDS, defaults filled in
    optimizer: dict | None  # Adam hyper-parameters for param_groups, or None (the run keeps its own)
    rules: list[Rule]

    @classmethod
    def load(cls, path: str | Path) -> NameMap:
        path = Path(path)
        try:
            doc = yaml.safe_load(path.read_text())
        except OSError as e:
            raise UCPError(f"name map {path}: cannot read it ({e}); pass --name-map with a YAML "
                           "file (configs/deepspeed/*.yaml)") from e
        except yaml.YAMLError as e:
            raise UCPError(f"name map {path}: not valid YAML ({e})") from e
        check = _Check(path)
        check.keys(doc, "the file", ("model", "rules"), ("optimizer",))
        model = _model(check, doc["model"])
        optimizer = doc.get("optimizer")
        if optimizer is not None:
            check.keys(optimizer, "optimizer", (), OPTIMIZER_FIELDS)
            for k in ("lr", "eps", "weight_decay"):
                if k in optimizer:
                    check.number(optimizer[k], f"optimizer.{k}")
            if "betas" in optimizer:
                b = optimizer["betas"]
                if not (isinstance(b, list) and len(b) == 2 and all(_is_number(x) for x in b)):
                    raise check.fail("optimizer.betas", f"expected [beta1, beta2], got {b!r}")
        if not isinstance(doc["rules"], list) or not doc["rules"]:
            raise check.fail("rules", "expected a non-empty list of {ds, mcore[, layout]} rules")
        rules = [_rule(check, i, r) for i, r in enumerate(doc["rules"])]
        return cls(path, model, optimizer, rules)

    # ------------------------------------------------------------------ megatron-core model

    def with_sizes(self, shapes: dict[str, tuple[int, ...]], args: dict, where: str) -> NameMap:
        """The map with its `auto` sizes taken from the DeepSpeed parameters' `shapes` (and the
        heads from the saving run's `args`), every size it gives checked against them: a map
        written for one size of a model serves every size of it."""
        found, evidence = _sizes_from_shapes(self.rules, shapes)
        for key, arg in (("num_attention_heads", "num_attention_heads"),
                         ("num_query_groups", "num_key_value_heads")):
            if isinstance(args.get(arg), int) and args[arg] > 0:
                found.setdefault(key, args[arg])
                evidence.setdefault(key, f"the saving run's args.{arg}")
        m = dict(self.model)
        if m["num_attention_heads"] == AUTO and "num_attention_heads" not in found \
                and isinstance(m["kv_channels"], int) and "hidden_size" in found:
            found["num_attention_heads"] = found["hidden_size"] // m["kv_channels"]
            evidence["num_attention_heads"] = "hidden_size / model.kv_channels"
        if m["num_query_groups"] == AUTO and "num_query_groups" not in found and "qkv_rows" in found:
            heads = m["num_attention_heads"] if m["num_attention_heads"] != AUTO else \
                found.get("num_attention_heads")
            hidden = m["hidden_size"] if m["hidden_size"] != AUTO else found.get("hidden_size")
            if heads and hidden:
                head_dim = m["kv_channels"] or hidden // heads
                found["num_query_groups"] = (found["qkv_rows"] // head_dim - heads) // 2
                evidence["num_query_groups"] = evidence["qkv_rows"] + f" ({heads} heads of {head_dim})"
        for key in SIZES:
            if m[key] == AUTO:
                if key not in found:
                    raise UCPError(f"name map {self.path}: model.{key} is auto, but {where} does not "
                                   f"say it ({_AUTO_SOURCES[key]}); write the run's value in the map")
                m[key] = found[key]
            elif key == "vocab_size" and key in found and m[key] <= found[key]:
                pass  # the rows may still hold padding: the map's true vocabulary keeps a prefix
            elif key in found and m[key] is not None and m[key] != found[key]:
                raise UCPError(f"name map {self.path}: model.{key} is {m[key]}, but {where} has "
                               f"{found[key]} ({evidence[key]}); the map was written for another "
                               f"size of the model: set model.{key} to {found[key]} or to auto")
        _check_sizes(_Check(self.path), m)
        return NameMap(self.path, m, self.optimizer, self.rules)

    def megatron_args(self) -> tuple[argparse.Namespace, dict]:
        """Megatron-LM style args of the map's megatron-core model (one rank; the rebuild's
        input, `megatron_rebuild.megatron_specs`), and what a megatron run must set that the
        model config does not record (the activation, the rotary base)."""
        m = self.model
        heads, h = m["num_attention_heads"], Heads.of(m)
        bias = m["add_bias_linear"]
        args = dict(
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1, world_size=1,
            data_parallel_size=1, params_dtype=torch.float32, fp16=False, bf16=False,
            transformer_impl="local", hidden_dropout=0.0, attention_dropout=0.0, qk_layernorm=False,
            num_layers=m["num_layers"], hidden_size=m["hidden_size"], num_attention_heads=heads,
            group_query_attention=h.groups != heads, num_query_groups=h.groups,
            kv_channels=h.head_dim, ffn_hidden_size=m["ffn_hidden_size"],
            normalization=m["normalization"], layernorm_epsilon=m["layernorm_epsilon"],
            add_bias_linear=bias,
            add_qkv_bias=bias if m["add_qkv_bias"] is None else m["add_qkv_bias"],
            position_embedding_type=m["position_embedding_type"],
            # RoPE has no parameter of that length (the manifest drops it, as import-hf does)
            max_position_embeddings=m["max_position_embeddings"] or 4096,
            rotary_base=m["rotary_base"], rotary_percent=m["rotary_percent"],
            padded_vocab_size=m["vocab_size"],
            untie_embeddings_and_output_weights=not m["tied_embeddings"],
            swiglu=m["activation"] == "swiglu", squared_relu=m["activation"] == "squared_relu",
        )
        if m["activation"] == "relu":  # a TransformerConfig field: the rebuild passes it through
            args["activation_func"] = F.relu
        run = {"activation": m["activation"]}
        if m["position_embedding_type"] == "rope":
            run["rotary_base"] = m["rotary_base"]
        return argparse.Namespace(**args), run

    def param_groups(self) -> list[dict]:
        """The map's Adam hyper-parameters as megatron-core param groups, for both of
        megatron-core's standard groups (decayed: wd_mult 1; biases and norms: wd_mult 0, no
        decay), or [] when the map has none (the loading run keeps its own)."""
        if self.optimizer is None:
            return []
        groups = []
        for wd_mult in (1.0, 0.0):
            g = {"optimizer": 0, "wd_mult": wd_mult, "lr_mult": 1.0, "is_decoupled_lr": False,
                 **{k: v for k, v in self.optimizer.items()}}
            if "weight_decay" in g:
                g["weight_decay"] = g["weight_decay"] * wd_mult
            groups.append(g)
        return groups

    # ---------------------------------------------------------------------- the name rules

    def assign(self, ds_names: list[str], specs: dict[str, ParamSpec],
               where: str) -> dict[str, tuple[str, Rule]]:
        """megatron name -> (DeepSpeed name, rule) for every megatron-core parameter, in the
        model's order; refuses a DeepSpeed name no rule or two rules cover, a target the model
        lacks, a target produced twice, and a megatron-core parameter nothing produces."""
        out: dict[str, tuple[str, Rule]] = {}
        for ds_name in ds_names:
            hits = [(r, t) for r in self.rules if (t := r.target(ds_name)) is not None]
            if not hits:
                raise UCPError(f"{where}: DeepSpeed parameter {ds_name!r} matches no rule of name "
                               f"map {self.path}; add a rule for it (configs/deepspeed/README.md)")
            if len(hits) > 1:
                raise UCPError(f"{where}: DeepSpeed parameter {ds_name!r} matches "
                               f"{' and '.join(r.describe() for r, _ in hits)} of name map "
                               f"{self.path}; make the rules' regexes exclusive")
            rule, target = hits[0]
            if target not in specs:
                raise UCPError(f"{where}: name map {self.path} {rule.describe()} makes DeepSpeed "
                               f"parameter {ds_name!r} megatron-core's {target!r}, which the map's "
                               f"model ({_summary(self.model)}) does not have; fix the rule or the "
                               "model settings")
            if target in out:
                raise UCPError(f"{where}: name map {self.path} makes both {out[target][0]!r} and "
                               f"{ds_name!r} megatron-core's {target!r}; each megatron-core "
                               "parameter must come from exactly one DeepSpeed parameter")
            out[target] = (ds_name, rule)
        missing = [n for n in specs if n not in out]
        if missing:
            raise UCPError(f"{where}: megatron-core parameter {missing[0]!r}"
                           f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''} of the "
                           f"model in name map {self.path} ({_summary(self.model)}) comes from no "
                           "DeepSpeed parameter; the folder lacks it or the map's model settings "
                           "are not the DeepSpeed run's (e.g. num_layers, biases, tied embeddings)")
        return {n: out[n] for n in specs}


_AUTO_SOURCES = {
    "num_layers": "no rule maps a DeepSpeed parameter to decoder.layers.<i>",
    "hidden_size": "no rule maps a DeepSpeed parameter to embedding.word_embeddings.weight",
    "vocab_size": "no rule maps a DeepSpeed parameter to embedding.word_embeddings.weight",
    "ffn_hidden_size": "no same-layout rule maps a DeepSpeed parameter to "
                       "decoder.layers.0.mlp.linear_fc2.weight",
    "max_position_embeddings": "no rule maps a DeepSpeed parameter to "
                               "embedding.position_embeddings.weight",
    "num_attention_heads": "shapes do not say how the hidden size splits into heads: the folder has "
                           "no mp_rank_00_model_states.pt with the run's args, and model.kv_channels "
                           "is not given",
    "num_query_groups": "no rule maps a DeepSpeed parameter to decoder.layers.0.self_attention."
                        "linear_qkv.weight, or the heads are unknown",
}


def _sizes_from_shapes(rules: list[Rule], shapes: dict[str, tuple[int, ...]]) -> tuple[dict, dict]:
    """Model sizes the DeepSpeed parameters' shapes say, and for each the parameter saying it."""
    by_target: dict[str, tuple[str, tuple[int, ...], Rule]] = {}
    for ds_name, shape in shapes.items():
        rule = next((r for r in rules if r.target(ds_name) is not None), None)
        if rule is not None:
            by_target.setdefault(rule.target(ds_name), (ds_name, shape, rule))
    found, evidence = {}, {}

    def take(key: str, target: str, dim: int, same_layout: bool = False) -> None:
        hit = by_target.get(target)
        if hit and len(hit[1]) > dim and (not same_layout or hit[2].layout == "same"):
            found[key] = hit[1][dim]
            evidence[key] = f"DeepSpeed parameter {hit[0]!r} of shape {list(hit[1])}"

    layers = {int(m.group(1)): t for t in by_target if (m := re.match(r"decoder\.layers\.(\d+)\.", t))}
    if layers:
        found["num_layers"] = max(layers) + 1
        evidence["num_layers"] = f"DeepSpeed parameter {by_target[layers[max(layers)]][0]!r} (the last layer)"
    take("vocab_size", "embedding.word_embeddings.weight", 0)
    take("hidden_size", "embedding.word_embeddings.weight", 1)
    take("max_position_embeddings", "embedding.position_embeddings.weight", 0)
    take("ffn_hidden_size", "decoder.layers.0.mlp.linear_fc2.weight", 1, same_layout=True)
    take("qkv_rows", "decoder.layers.0.self_attention.linear_qkv.weight", 0)
    return found, evidence


def _summary(m: dict) -> str:
    return (f"{m['num_layers']} layers, hidden {m['hidden_size']}, "
            f"{'tied' if m['tied_embeddings'] else 'untied'} embeddings, "
            f"add_bias_linear {m['add_bias_linear']}, {m['normalization']}")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class _Check:
    def __init__(self, path: Path):
        self.path = path

    def fail(self, field: str, problem: str) -> UCPError:
        return UCPError(f"name map {self.path}: {field}: {problem} (schema: configs/deepspeed/README.md)")

    def keys(self, d, field: str, required: tuple[str, ...], optional: tuple[str, ...]) -> dict:
        if not isinstance(d, dict):
            raise self.fail(field, f"expected a mapping, got {type(d).__name__}")
        missing = [k for k in required if k not in d]
        if missing:
            raise self.fail(field, f"missing {missing}")
        unknown = sorted(set(d) - set(required) - set(optional))
        if unknown:
            raise self.fail(field, f"unknown key(s) {unknown}; known: {sorted(required + optional)}")
        return d

    def number(self, v, field: str) -> None:
        if not _is_number(v):
            raise self.fail(field, f"expected a number, got {v!r}")


def _model(check: _Check, d) -> dict:
    required = tuple(k for k, v in MODEL_FIELDS.items() if v is REQUIRED)
    check.keys(d, "model", required, tuple(k for k in MODEL_FIELDS if k not in required))
    m = {k: d.get(k, v) for k, v in MODEL_FIELDS.items()}
    for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size",
              "num_query_groups", "kv_channels", "max_position_embeddings"):
        optional = MODEL_FIELDS[k] is not REQUIRED
        if (m[k] == AUTO and k in SIZES) or (optional and m[k] is None):
            continue
        if not (isinstance(m[k], int) and not isinstance(m[k], bool) and m[k] > 0):
            raise check.fail(f"model.{k}", f"expected a positive integer{' or auto' if k in SIZES else ''}, "
                             f"got {m[k]!r}")
    for k in ("add_bias_linear", "tied_embeddings"):
        if not isinstance(m[k], bool):
            raise check.fail(f"model.{k}", f"expected true or false, got {m[k]!r}")
    if m["add_qkv_bias"] is not None and not isinstance(m["add_qkv_bias"], bool):
        raise check.fail("model.add_qkv_bias", f"expected true or false, got {m['add_qkv_bias']!r}")
    for k in ("layernorm_epsilon", "rotary_base", "rotary_percent"):
        check.number(m[k], f"model.{k}")
    for k, choices in (("activation", ACTIVATIONS), ("params_dtype", tuple(DTYPES)),
                       ("position_embedding_type", POSITIONS), ("normalization", NORMS)):
        if m[k] not in choices:
            raise check.fail(f"model.{k}", f"{m[k]!r} is not one of {list(choices)}")
    if not any(m[k] == AUTO for k in SIZES):
        _check_sizes(check, m)
    return m


def _check_sizes(check: _Check, m: dict) -> None:
    """The sizes agree with each other (once every `auto` one is known)."""
    heads, groups = m["num_attention_heads"], m["num_query_groups"] or m["num_attention_heads"]
    if groups <= 0 or heads % groups:
        raise check.fail("model.num_query_groups", f"{groups} does not divide {heads} heads")
    if m["kv_channels"] is None and m["hidden_size"] % heads:
        raise check.fail("model.kv_channels", f"not given and hidden_size {m['hidden_size']} is "
                         f"not a multiple of {heads} heads")
    if m["position_embedding_type"] == "learned_absolute" and not m["max_position_embeddings"]:
        raise check.fail("model.max_position_embeddings", "learned position embeddings need the "
                         "table's rows")


def _rule(check: _Check, i: int, r) -> Rule:
    field = f"rules[{i}]"
    check.keys(r, field, ("ds", "mcore"), tuple(k for k in RULE_FIELDS if k not in ("ds", "mcore")))
    if not isinstance(r["ds"], str) or not isinstance(r["mcore"], str):
        raise check.fail(field, "ds (a regex) and mcore (a name template) must be strings")
    try:
        pattern = re.compile(r["ds"])
    except re.error as e:
        raise check.fail(f"{field}.ds", f"bad regex {r['ds']!r} ({e})") from e
    layout = r.get("layout", "same")
    if layout not in LAYOUTS:
        raise check.fail(f"{field}.layout", f"{layout!r} is not one of {list(LAYOUTS)}")
    offset, blocks = r.get("layer_offset", 0), r.get("qkv_blocks", 1)
    for k, v in (("layer_offset", offset), ("qkv_blocks", blocks)):
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if k == "layer_offset" else 1):
            raise check.fail(f"{field}.{k}", f"expected an integer >= {0 if k == 'layer_offset' else 1}, "
                             f"got {v!r}")
    if blocks != 1 and layout != "qkv_concat":
        raise check.fail(f"{field}.qkv_blocks", "only a qkv_concat rule has blocks")
    try:
        r["mcore"].format(layer=0)
    except (KeyError, IndexError, ValueError) as e:
        raise check.fail(f"{field}.mcore", f"{r['mcore']!r}: the only placeholder is {{layer}} "
                         f"({type(e).__name__}: {e})") from e
    if "{layer}" in r["mcore"] and not pattern.groups:
        raise check.fail(f"{field}.ds", f"{r['ds']!r} has no group for the {{layer}} of "
                         f"{r['mcore']!r}; write the layer index as (\\d+) or (?P<layer>\\d+)")
    return Rule(i, pattern, r["mcore"], layout, offset, blocks)
