"""Transformer Engine `_extra_state` (FP8 scaling metadata): read without pickle's code execution,
carried as JSON and tensors, put back at any layout.

Every TE module (linear, layer-norm linear, grouped linear) declares one `_extra_state`
ShardedObject per layer in megatron-core's `sharded_state_dict()`; megatron-core splits a grouped
linear's state per expert (`_split_extra_state`), so each object belongs to one (layer, expert) and
gets a universal name like a parameter's: `decoder.layers.3.mlp.experts.experts.5.linear_fc1._extra_state`.

The payload TE writes depends on its release (`PAYLOAD_FORMS`). It is decoded by an unpickler that
builds only tensors, plain containers and stand-ins for TE's recipe classes (`_RecipeUnpickler`):
the recipe becomes JSON (`ModuleState.recipe`), the scaling tensors safetensors. A load writes them
into the module's `fp8_meta` as TE's own `set_extra_state` does after unpickling, with no pickle.

TE reduces amax over the amax-reduction group (TP x DP in Megatron-LM), so every copy of a module's
state is equal; the save checks it and refuses, naming the module, when copies differ.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import json
import pickle
import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_ucp.errors import UCPError

TE_STATE_FILE = "te_state.safetensors"
RECIPE_MODULE = "transformer_engine.common.recipe"
# the tensors of a delayed-scaling module: fp8_meta[scaling_fwd|scaling_bwd].(scale|amax_history)
DELAYED_TENSORS = {"scale_fwd": ("scaling_fwd", "scale"), "amax_history_fwd": ("scaling_fwd", "amax_history"),
                   "scale_bwd": ("scaling_bwd", "scale"), "amax_history_bwd": ("scaling_bwd", "amax_history")}
# TE 1.x also kept the inverse scales, which TE 2 recomputes (its set_extra_state drops them)
TE1_DROPPED = ("scale_inv_fwd", "scale_inv_bwd")
# The payload forms, by the TE releases that write them
PAYLOAD_FORMS = {
    "te2-pickle": "uint8 tensor holding a pickled dict {recipe, scale_fwd, amax_history_fwd, scale_bwd, "
                  "amax_history_bwd, extra_fp8_variables} (TE 2.0 on; from TE 2.18 for delayed scaling only)",
    "te1-bytesio": "io.BytesIO holding torch.save of {scale_fwd, scale_inv_fwd, amax_history_fwd, ..., "
                   "extra_fp8_variables}, no recipe: delayed scaling with TE's defaults (TE 1.x)",
    "stateless": "empty uint8 tensor of a module whose recipe keeps no state (TE >= 2.18: current "
                 "scaling, MXFP8, block scaling, NVFP4): the recipe is recorded from the module",
}
RECIPES = ("DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling", "Float8BlockScaling",
           "NVFP4BlockScaling")
STATELESS_RECIPES = set(RECIPES) - {"DelayedScaling"}
FORMATS = {(448, 448): "E4M3", (57344, 57344): "E5M2", (448, 57344): "HYBRID"}  # Format's values


@dataclass
class ModuleState:
    """One TE module's FP8 state (one layer, one expert of a grouped linear)."""

    recipe: dict  # {"class": "DelayedScaling", "margin": 0, "fp8_format": "HYBRID", ...}
    variables: dict  # TE's extra_fp8_variables (num_gemms, fp8_max_fwd, ...)
    form: str  # PAYLOAD_FORMS key
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def header(self) -> dict:
        return {"recipe": self.recipe, "variables": self.variables, "form": self.form}

    def digest(self) -> str:
        h = hashlib.sha256(json.dumps(self.header(), sort_keys=True).encode())
        for k in sorted(self.tensors):
            t = self.tensors[k].contiguous()
            h.update(f"{k}{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return h.hexdigest()


# ---------------------------------------------------------------------------- decoding payloads

class _Recorded:
    """Stands in for a TE recipe class while unpickling: keeps the fields, runs nothing."""

    te_class = ""

    def __setstate__(self, state):
        self.__dict__.update(state if isinstance(state, dict) else state[1] or {})


_FormatValue = collections.namedtuple("_FormatHelper", "max_fwd max_bwd")


def _format_member(value) -> str:
    """`Format(_FormatHelper(max_fwd, max_bwd))` -> the member's name."""
    name = FORMATS.get((int(value.max_fwd), int(value.max_bwd)))
    if name is None:
        raise pickle.UnpicklingError(f"unknown FP8 format {tuple(value)}")
    return name


def _storage_from_bytes(b: bytes):
    return torch.load(io.BytesIO(b), weights_only=True)


def _stand_in(name: str) -> type:
    return type(name, (_Recorded,), {"te_class": name})


_STAND_INS = {n: _stand_in(n) for n in (*RECIPES, "MMParams", "QParams")}
# megatron-core's own recipe classes, subclasses of TE's that add no field: Megatron-LM's FP8 runs
# pickle `TEDelayedScaling` (fp8_utils.get_fp8_recipe builds it for --fp8-recipe delayed)
MCORE_RECIPES = {("megatron.core.extensions.transformer_engine", "TEDelayedScaling"): "DelayedScaling"}
_ALLOWED = {
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor"): torch._utils._rebuild_tensor,
    ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
    ("megatron.core.safe_globals", "safe_load_from_bytes"): _storage_from_bytes,
    ("collections", "OrderedDict"): collections.OrderedDict,
    (RECIPE_MODULE, "Format"): _format_member,
    (RECIPE_MODULE, "_FormatHelper"): _FormatValue,
}


class _RecipeUnpickler(pickle.Unpickler):
    """Builds tensors, containers and recipe stand-ins only; any other global is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == RECIPE_MODULE and name in _STAND_INS:
            return _STAND_INS[name]
        if (module, name) in MCORE_RECIPES:
            return _STAND_INS[MCORE_RECIPES[(module, name)]]
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


def _jsonable(v, where: str):
    if isinstance(v, _Recorded):
        return {"class": v.te_class, **{k: _jsonable(x, where) for k, x in sorted(vars(v).items())
                                        if k != "_cached_repr"}}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x, where) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x, where) for k, x in v.items()}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise UCPError(f"{where}: its FP8 recipe holds a {type(v).__name__} ({v!r}), which has no JSON form "
                   "(a custom amax or scaling function?); megatron-ucp carries TE's built-in recipes")


def decode(data, where: str) -> ModuleState | None:
    """A TE `_extra_state` payload -> its state; None when it holds none (no FP8, or a stateless
    recipe: the caller records that from the module). Never runs code from the payload."""
    if data is None:
        return None
    if torch.is_tensor(data):
        if data.numel() == 0:
            return None
        raw, form = data.detach().cpu().contiguous().numpy().tobytes(), "te2-pickle"
    elif isinstance(data, io.BytesIO):
        raw, form = data.getvalue(), "te1-bytesio"
        if not raw:
            return None
    else:
        raise UCPError(f"{where}: Transformer Engine extra state of type {type(data).__name__} is none "
                       f"of the forms megatron-ucp reads ({', '.join(PAYLOAD_FORMS)})")
    try:
        if form == "te2-pickle":
            state = _RecipeUnpickler(io.BytesIO(raw)).load()
        else:
            state = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  (a refused global or a damaged payload)
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"refuses to build {found.group(1)}" if found else f"cannot read it ({e})"
        raise UCPError(f"{where}: Transformer Engine extra state ({form}): the pickle-free decoder {what}; "
                       "it holds FP8 scaling metadata in a form megatron-ucp does not know") from None
    if state is None or (isinstance(state, dict) and not state):
        return None
    if not isinstance(state, dict):
        raise UCPError(f"{where}: Transformer Engine extra state ({form}) is a {type(state).__name__}, "
                       "not the dict TE writes")
    recipe = state.get("recipe")
    recipe = {"class": "DelayedScaling"} if recipe is None else _jsonable(recipe, where)
    if recipe.get("class") not in RECIPES:
        raise UCPError(f"{where}: FP8 recipe {recipe.get('class')!r} is not one of TE's {RECIPES}")
    tensors = {}
    for k in DELAYED_TENSORS:
        if k in state:
            t = state[k]
            if not torch.is_tensor(t):
                raise UCPError(f"{where}: extra state {k!r} is a {type(t).__name__}, not a tensor")
            tensors[k] = t.detach().to("cpu").clone().contiguous()
    if recipe["class"] == "DelayedScaling" and set(tensors) != set(DELAYED_TENSORS):
        missing = sorted(set(DELAYED_TENSORS) - set(tensors))
        raise UCPError(f"{where}: delayed-scaling extra state lacks {missing}")
    variables = _jsonable(state.get("extra_fp8_variables", {}), where)
    return ModuleState(recipe, variables, form, tensors)


def recipe_json(recipe, where: str) -> dict:
    """A live TE recipe object -> its JSON form (the same as a decoded payload's; megatron-core's
    subclasses, `MCORE_RECIPES`, as the TE recipe they are)."""
    out = {"class": recipe_class(recipe)}
    for f in dataclasses.fields(recipe):
        v = getattr(recipe, f.name)
        if f.name == "_cached_repr":
            continue
        if type(v).__name__ == "Format":
            v = v.name
        elif dataclasses.is_dataclass(v):
            v = recipe_json(v, where)
        out[f.name] = _jsonable(v, where)
    return out


def recipe_class(recipe) -> str:
    """The TE recipe class (`RECIPES`) a live recipe object is an instance of, nearest first."""
    for cls in type(recipe).__mro__:
        if cls.__module__ == RECIPE_MODULE and cls.__name__ in RECIPES:
            return cls.__name__
    return type(recipe).__name__


def te_recipe(recipe: dict):
    """The JSON form -> TE's recipe object (needs Transformer Engine: the model is a TE model)."""
    from transformer_engine.common import recipe as te

    def build(d: dict):
        cls = getattr(te, d["class"])
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in d or not f.init:
                continue
            v = d[f.name]
            if f.name == "fp8_format":
                v = te.Format[v]
            elif isinstance(v, dict) and "class" in v:
                v = build(v)
            kwargs[f.name] = v
        return cls(**kwargs)

    return build(recipe)


# ---------------------------------------------------------------------------- the live model

@dataclass
class _Entry:
    name: str  # universal name
    module: torch.nn.Module
    gemm: int  # the gemm of a grouped linear (its local expert); 0 otherwise
    canonical: bool
    data: object


def _universal_object_name(local_key: str, entry, grouped: bool) -> str:
    """The universal name of a TE module's `_extra_state` object: a parameter name's rules
    (`param_spec.universal_name`) applied to the module's weight, `.weight` -> `._extra_state`."""
    from megatron_ucp.param_spec import universal_name

    head, _, gemm = local_key.rpartition("._extra_state")
    key_head = entry.key.rpartition("._extra_state")[0]
    weight = f"{head}.weight{gemm or 0}" if grouped else f"{head}.weight"
    offsets = tuple(entry.global_offset)
    # A key that spells its layer index (hybrid and MTP layers, heterogeneous blocks) still gets a
    # ShardedObject axis for it: an axis no index of the name is left for is that one, dropped.
    for drop in range(len(offsets) + 1):
        try:
            name = universal_name(weight, f"{key_head}.weight", offsets[drop:])
        except UCPError:
            if drop == len(offsets):
                raise
            continue
        return name[:-len("weight")] + "_extra_state"
    raise AssertionError("unreachable")


def is_grouped(module) -> bool:
    return any(c.__name__ == "GroupedLinear" for c in type(module).__mro__)


def module_entries(model_chunks: list) -> list[_Entry]:
    """Every TE module's `_extra_state` object of the chunks (one per gemm of a grouped linear)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.utils import unwrap_model

    from megatron_ucp.param_spec import declared_state_dict

    out = []
    for chunk in model_chunks:
        model = unwrap_model(chunk)
        for local_key, entry in declared_state_dict(model).items():
            if not isinstance(entry, ShardedObject) or "._extra_state" not in local_key:
                continue
            head, _, gemm = local_key.rpartition("._extra_state")
            try:
                module = model.get_submodule(head)
            except AttributeError:
                continue
            if not hasattr(module, "fp8_meta"):  # not a TE module (local layers declare None)
                continue
            grouped = is_grouped(module)
            rid = entry.replica_id
            canonical = all(r == 0 for r in (rid if isinstance(rid, tuple) else (rid,)))
            out.append(_Entry(_universal_object_name(local_key, entry, grouped), module,
                              int(gemm or 0), canonical, entry.data))
    seen: dict[str, tuple[int, int]] = {}
    for e in out:
        if seen.setdefault(e.name, (id(e.module), e.gemm)) != (id(e.module), e.gemm):
            raise UCPError(f"two Transformer Engine modules' extra states get the universal name {e.name}; "
                           "no rule tells them apart")
    return out


def _module_state(e: _Entry) -> ModuleState | None:
    state = decode(e.data, e.name)
    if state is not None:
        return state
    meta = e.module.fp8_meta
    recipe = meta.get("recipe")
    if recipe is None or not meta.get("fp8_checkpoint"):
        return None
    if recipe_class(recipe) not in STATELESS_RECIPES:
        raise UCPError(f"{e.name}: its FP8 recipe {type(recipe).__name__} keeps state that Transformer "
                       f"Engine did not write into the module's extra state; megatron-ucp carries "
                       f"TE's built-in recipes {RECIPES}")
    return ModuleState(recipe_json(recipe, e.name), {}, "stateless")


def capture(model_chunks: list) -> dict[str, ModuleState]:
    """This rank's canonical FP8 module states by universal name, after checking that every copy
    of each module's state (its TP / DP / expert-DP replicas, on whichever rank) is equal.
    Collective."""
    mine, digests = {}, {}
    for e in module_entries(model_chunks):
        state = _module_state(e)
        digests[e.name] = None if state is None else state.digest()
        if state is not None and e.canonical:
            mine[e.name] = state
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (digests, sorted(mine)))
    written = {name for _, names in everyone for name in names}
    unwritten = sorted(n for ds, _ in everyone for n, d in ds.items() if d is not None and n not in written)
    if unwritten:  # (every rank sees the same: all raise)
        raise UCPError(f"{unwritten[0]}: no rank holds the canonical copy (replica_id all 0) of this "
                       f"module's FP8 state ({len(unwritten)} such modules); megatron-ucp cannot tell "
                       "which copy to write")
    seen: dict[str, tuple[str | None, int]] = {}
    for rank, (ds, _) in enumerate(everyone):
        for name, d in ds.items():
            if name in seen and seen[name][0] != d:
                raise UCPError(f"{name}: the Transformer Engine FP8 state of this module differs between "
                               f"rank {seen[name][1]} and rank {rank}, which hold copies of it (TE "
                               "reduces amax over tensor- and data-parallel ranks, so copies are equal "
                               "after a training step); save after a step, or with the same FP8 recipe "
                               "on every rank")
            seen.setdefault(name, (d, rank))
    return mine


def restore(entries: list[_Entry], saved: dict[str, ModuleState], where: str) -> int:
    """Put the saved FP8 state into the TE modules of `entries` (`module_entries` of this rank's
    chunks); returns the number of modules set. A module the checkpoint has no state for keeps its
    own (a save without FP8)."""
    by_module: dict[int, tuple[torch.nn.Module, dict[int, ModuleState]]] = {}
    for e in entries:
        if e.name in saved:
            by_module.setdefault(id(e.module), (e.module, {}))[1][e.gemm] = saved[e.name]
    for module, gemms in by_module.values():
        n = getattr(module, "num_gemms", 1) if is_grouped(module) else 1
        if sorted(gemms) != list(range(n)):
            raise UCPError(f"{where}: the checkpoint holds FP8 state for gemms {sorted(gemms)} of a "
                           f"module with {n}; it is damaged")
        _apply(module, [gemms[g] for g in range(n)], where)
    return len(by_module)


def _apply(module, states: list[ModuleState], where: str) -> None:
    """What TE's set_extra_state does after unpickling, from the decoded states of the module's
    gemms (a grouped linear's are merged as megatron-core's `merge_extra_states` merges them)."""
    first = states[0]
    if any(s.recipe != first.recipe for s in states):
        raise UCPError(f"{where}: the experts of one grouped linear have different FP8 recipes")
    recipe = te_recipe(first.recipe)
    meta = module.fp8_meta
    meta.update({**first.variables, "num_gemms": len(states)} if first.variables else {})
    meta["recipe"] = recipe
    meta["fp8_checkpoint"] = True
    meta.pop("global_fp8_buffer_pos_fwd_recompute", None)
    if not first.tensors:
        return
    if "num_gemms" not in meta:
        meta["num_gemms"] = len(states)
    module.init_fp8_meta_tensors(recipe)
    length = recipe.amax_history_len
    with torch.no_grad():
        for k, (which, attr) in DELAYED_TENSORS.items():
            parts = [s.tensors[k] for s in states]
            t = parts[0] if len(parts) == 1 else torch.cat([p.reshape(-1, 1) for p in parts], dim=1)
            dst = getattr(meta[which], attr)
            t = t.reshape(length, -1) if k.startswith("amax") else t.reshape(-1)
            if t.shape != dst.shape:
                raise UCPError(f"{where}: saved FP8 {k} of shape {list(t.shape)} does not fit the "
                               f"module's {list(dst.shape)} (another amax_history_len or gemm count)")
            dst.copy_(t.to(dst.dtype))


# ---------------------------------------------------------------------------- on disk

def write(out_dir, states: dict[str, ModuleState]) -> dict:
    """`te_state.safetensors` in `out_dir` (a local directory or a store prefix); returns the
    manifest's `te_state` field: per module its recipe, variables, payload form and the crc32 of
    each tensor (keys `<module>/<tensor>` in the file)."""
    from megatron_ucp.storage import crc32, write_tensors

    tensors = {f"{name}/{k}": t for name, st in sorted(states.items()) for k, t in st.tensors.items()}
    write_tensors(out_dir / TE_STATE_FILE, tensors)
    return {"file": TE_STATE_FILE,
            "modules": {name: {**st.header(), "crc32": {k: crc32(t) for k, t in st.tensors.items()}}
                        for name, st in sorted(states.items())}}


def check_field(d, check, version: int) -> dict:
    """The manifest's `te_state` field, validated (`check` is the manifest's `_Check`)."""
    if version < 4:
        raise check.fail("te_state", f"is a field of format version 4, the manifest says {version}")
    check.obj(d, "te_state", ("file", "modules"))
    check.name(d["file"], "te_state.file")
    for name, m in check.typed(d["modules"], "te_state.modules", dict).items():
        path = f"te_state.modules[{name!r}]"
        check.obj(m, path, ("recipe", "variables", "form", "crc32"))
        recipe = check.typed(m["recipe"], f"{path}.recipe", dict)
        if recipe.get("class") not in RECIPES:
            raise check.fail(f"{path}.recipe.class", f"{recipe.get('class')!r} is not one of {RECIPES}")
        check.typed(m["variables"], f"{path}.variables", dict)
        check.choice(m["form"], f"{path}.form", tuple(PAYLOAD_FORMS))
        crcs = check.typed(m["crc32"], f"{path}.crc32", dict)
        wanted = set(DELAYED_TENSORS) if recipe["class"] == "DelayedScaling" else set()
        if set(crcs) != wanted or not all(type(v) is int for v in crcs.values()):
            raise check.fail(f"{path}.crc32", f"expected an int for each of {sorted(wanted)}, got {crcs}")
    return d


def read(reader, ckpt_dir, field: dict, names, verify_checksums: bool = True) -> dict[str, ModuleState]:
    """The saved states of `names` (those the checkpoint has) from `te_state.safetensors`."""
    from megatron_ucp.storage import crc32

    out = {}
    path = ckpt_dir / field["file"]
    for name in names:
        m = field["modules"].get(name)
        if m is None:
            continue
        tensors = {}
        for k, crc in m["crc32"].items():
            t = reader.read(path, f"{name}/{k}")
            if verify_checksums and crc32(t) != crc:
                raise UCPError(f"{path}: tensor {name}/{k} fails its crc32 check; the file is damaged: "
                               "restore it or load another iteration")
            tensors[k] = t
        out[name] = ModuleState(m["recipe"], m["variables"], m["form"], tensors)
    return out


def summary(field: dict | None) -> dict:
    """For inspect: the recipes and how many modules carry each (stateless recipes included)."""
    if not field:
        return {}
    recipes: dict[str, int] = {}
    for m in field["modules"].values():
        r = m["recipe"]
        key = r["class"] + (f"({r['fp8_format']}, amax_history_len={r['amax_history_len']})"
                            if r["class"] == "DelayedScaling" and "fp8_format" in r else "")
        recipes[key] = recipes.get(key, 0) + 1
    return recipes


def source_states(source, verify_checksums: bool = False) -> dict[str, ModuleState]:
    """Every FP8 module state a source checkpoint holds: megatron-ucp's own `te_state.safetensors`
    (each tensor's crc32 checked with `verify_checksums`), any other source's `te_states()` (a
    Megatron-LM checkpoint's decoded `_extra_state` entries)."""
    field = getattr(source.manifest, "te_state", None)
    if not field:
        return source.te_states()
    from megatron_ucp.storage import Reader

    return read(Reader(), source.dir, field, list(field["modules"]), verify_checksums)


def copy(source, out_dir) -> dict | None:
    """The source's FP8 state (`Source.te_states()`: any format's) written under `out_dir` (a
    conversion); its manifest field, None when it has none."""
    states = source.te_states()
    return write(out_dir, states) if states else None

