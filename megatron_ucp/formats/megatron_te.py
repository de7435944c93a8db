"""Transformer Engine runs in Megatron-LM's checkpoint formats (torch, torch_dist), both directions.

A TE run's model is rebuilt with TE's layer spec (`uses_te`; the parameter order of its
DistributedOptimizer buffers, its state-dict keys, TE's fused norm names and one `_extra_state` per
TE module), which needs TE importable as megatron-core imports it (`te_unavailable`, `te_required`:
refused, saying to convert where TE is installed). The `_extra_state` payloads are read with
`te_state.decode` (never a plain unpickle) and written in TE 2.x's own form (`encode`); a torch
checkpoint holds one payload per grouped linear, torch_dist one per expert (`split_gemms`,
`merge_gemms`, megatron-core's own rule). Universal names are those of the live `te_state`
(`object_names`), so every form carries the same FP8 state.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import re
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

from megatron_ucp.errors import UCPError
from megatron_ucp.te_state import (
    DELAYED_TENSORS,
    ModuleState,
    _universal_object_name,
    decode,
    is_grouped,
    te_recipe,
)

log = logging.getLogger(__name__)


def te_unavailable() -> str | None:
    """Why megatron-core cannot build Transformer Engine layers in this process (None: it can):
    rebuilding a TE run's model (its Megatron-LM checkpoints' parameter order, keys and
    `_extra_state` objects) needs TE importable, as megatron-core imports it."""
    global _TE_UNAVAILABLE
    if _TE_UNAVAILABLE is None:
        try:
            import transformer_engine.pytorch  # noqa: F401
            from megatron.core.extensions import transformer_engine as ext
        except Exception as e:  # noqa: BLE001  (not installed, or no CUDA where TE asks for it)
            _TE_UNAVAILABLE = f"importing it fails: {type(e).__name__}: {str(e)[:200]}"
        else:
            _TE_UNAVAILABLE = "" if ext.HAVE_TE else (
                "megatron-core imported without it (megatron.core.extensions.transformer_engine.HAVE_TE "
                "is false: megatron-core was imported before TE could be)")
            if not _TE_UNAVAILABLE and not torch.cuda.is_available():  # (TE's modules refuse to build)
                _TE_UNAVAILABLE = "it is installed, but builds its modules only where CUDA is available"
    return _TE_UNAVAILABLE or None


_TE_UNAVAILABLE: str | None = None


def te_required(args, what: str) -> None:
    """Refuse, saying what to do, when the run `args` describe used Transformer Engine layers and
    this process cannot build them (`what`: the reading or writing that needs them)."""
    if getattr(args, "transformer_impl", "local") != "transformer_engine":
        return
    why = te_unavailable()
    if why:
        raise UCPError(f"{what}: the run used --transformer-impl transformer_engine, and its model "
                       "(parameter order, state-dict keys, each TE module's `_extra_state`) is rebuilt "
                       f"with Transformer Engine's layers, but Transformer Engine is not usable here "
                       f"({why}); run the conversion where Transformer Engine is installed (with CUDA, "
                       "which TE requires; the TE release of the target run), e.g. on a GPU node of "
                       "that run")


def uses_te(args) -> bool:
    """Whether a model rebuilt from `args` takes Transformer Engine's layer spec: the run used TE
    and TE is usable here (else the local spec, whose universal names are the same)."""
    return getattr(args, "transformer_impl", "local") == "transformer_engine" and not te_unavailable()


class _AllocateOnMeta(TorchFunctionMode):
    """Tensors created with an explicit device (megatron-core gives TE's layers `device="cpu"`
    under use_cpu_initialization) are made on the meta device, as the rest of the rebuild."""

    def __torch_function__(self, func, types, a=(), k=None):
        k = dict(k or {})
        if k.get("device") is not None and str(k["device"]) != "meta":
            k["device"] = "meta"
        return func(*a, **k)


@contextlib.contextmanager
def te_on_meta(te: bool) -> Iterator[None]:
    """While TE's layers are built: tensors on the meta device (`_AllocateOnMeta`), and CUDA's
    current device the index TE asks for (its norms place meta weights on `cuda:<index>`)."""
    if not te:
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0
    try:
        with _AllocateOnMeta():
            yield
    finally:
        torch.cuda.current_device = saved


def object_names(model) -> dict[str, tuple[str, str]]:
    """Every `_extra_state` ShardedObject of one unwrapped model chunk (a TE module's, or the `None`
    a local layer declares): local state-dict key -> (its torch_dist unique key, its universal
    name). A grouped linear's objects are per expert (`..._extra_state`, `..._extra_state1`, ...)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_ucp.param_spec import declared_state_dict

    out = {}
    for local_key, entry in declared_state_dict(model).items():
        if not isinstance(entry, ShardedObject) or "._extra_state" not in local_key:
            continue
        head = local_key.rpartition("._extra_state")[0]
        try:
            grouped = is_grouped(model.get_submodule(head))
        except AttributeError:
            grouped = False
        out[local_key] = (entry.unique_key, _universal_object_name(local_key, entry, grouped))
    return out


def encode(state: ModuleState | None) -> torch.Tensor:
    """The `_extra_state` payload Transformer Engine 2.x writes for `state` (TE's own form, as its
    `get_extra_state` and megatron-core's `_encode_extra_state` make it): a uint8 tensor holding
    the pickled dict {recipe, scale_fwd, amax_history_fwd, scale_bwd, amax_history_bwd,
    extra_fp8_variables}, the recipe as TE's own class (`te_recipe`); an empty uint8 tensor for no
    FP8 or a stateless recipe (as TE >= 2.18 writes them). Needs Transformer Engine (the recipe
    object). A TE 1.x state (te1-bytesio) is written in this form too: the target runs TE 2."""
    if state is None or not state.tensors:
        return torch.empty(0, dtype=torch.uint8, device="cpu")
    payload = {"recipe": te_recipe(state.recipe),
               **{k: state.tensors[k].detach().to("cpu").contiguous() for k in DELAYED_TENSORS},
               "extra_fp8_variables": dict(state.variables)}
    return torch.frombuffer(bytearray(pickle.dumps(payload)), dtype=torch.uint8)


def split_gemms(state: ModuleState, n: int, where: str) -> list[ModuleState]:
    """One grouped linear's state (`n` gemms, as its `state_dict()` holds it in a torch-format
    checkpoint) -> one state per gemm, as megatron-core's `_split_extra_state` splits it for
    torch_dist (each gemm's column of the scales and amax histories; num_gemms 1)."""
    variables = {**state.variables, "num_gemms": 1} if state.variables else {}
    if not state.tensors:
        return [ModuleState(state.recipe, variables, state.form) for _ in range(n)]
    parts: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
    for k, t in state.tensors.items():
        rows = 3 if k.endswith("fwd") else 2
        if t.numel() % (rows * n):
            raise UCPError(f"{where}: FP8 {k} of shape {list(t.shape)} does not split into {n} gemms")
        view = t.reshape(-1, rows, n) if k.startswith("amax") else t.reshape(rows, n)
        for g in range(n):
            parts[g][k] = view[..., g].clone()
    return [ModuleState(state.recipe, variables, state.form, p) for p in parts]


def merge_gemms(states: list[ModuleState], where: str) -> ModuleState:
    """The inverse of `split_gemms`: the state of one grouped linear of `len(states)` gemms, as
    megatron-core's `merge_extra_states` builds it (what its `state_dict()` holds)."""
    first = states[0]
    if any(s.recipe != first.recipe or bool(s.tensors) != bool(first.tensors) for s in states):
        raise UCPError(f"{where}: the experts of one grouped linear have different FP8 recipes")
    variables = {**first.variables, "num_gemms": len(states)} if first.variables else {}
    tensors = {}
    for k in first.tensors:
        cols = torch.cat([s.tensors[k].reshape(-1, 1) for s in states], dim=1)
        tensors[k] = cols.reshape(-1, (3 if k.endswith("fwd") else 2) * len(states)) \
            if k.startswith("amax") else cols.reshape(-1)
    return ModuleState(first.recipe, variables, first.form, tensors)


def check_copies(states: dict[str, ModuleState], name: str, state: ModuleState, where: str) -> None:
    """Record `state` as module `name`'s, or check it equals the copy already recorded (TE reduces
    amax over the TP and DP ranks, so every rank file's copy is the same)."""
    if name not in states:
        states[name] = state
    elif states[name].digest() != state.digest():
        raise UCPError(f"{where}: the Transformer Engine FP8 state of {name} differs from another "
                       "rank's copy of it; the rank files come from different saves")


def _where_saved(local_key: str) -> tuple[str, int]:
    """A `_extra_state` object's local key -> (the state-dict key its module saves it under, its
    gemm): a grouped linear declares `..._extra_state`, `..._extra_state1`, ... for one `_extra_state`."""
    m = re.fullmatch(r"(.*\._extra_state)(\d*)", local_key)
    return m.group(1), int(m.group(2) or 0)


def legacy_names(model) -> dict[str, list[str]]:
    """The `_extra_state` keys of one unwrapped chunk's `state_dict()` (a torch-format checkpoint's
    model keys) -> the universal names of their gemms, in gemm order (one but for a grouped linear)."""
    out: dict[str, dict[int, str]] = {}
    for local_key, (_, name) in object_names(model).items():
        saved, gemm = _where_saved(local_key)
        out.setdefault(saved, {})[gemm] = name
    return {k: [g[i] for i in sorted(g)] for k, g in out.items()}


def legacy_states(names: dict[str, list[str]], saved: dict, states: dict[str, ModuleState],
                  where: str) -> None:
    """The FP8 states a torch-format model state dict `saved` holds, by universal name, into
    `states` (`check_copies`: another rank's copy must be equal). A payload the rebuilt model has no
    module for is refused (its state would be dropped)."""
    for key, data in saved.items():
        if not key.endswith("._extra_state"):
            continue
        state = decode(data, f"{where} [{key}]")
        if state is None:
            continue
        if key not in names:
            raise UCPError(f"{where}: {key} holds Transformer Engine FP8 state, but the model rebuilt "
                           "from the args has no such module; converting would drop it")
        gemms = names[key]
        parts = split_gemms(state, len(gemms), f"{where} [{key}]") if len(gemms) > 1 else [state]
        for name, part in zip(gemms, parts):
            check_copies(states, name, part, f"{where} [{key}]")


def legacy_payload(gemms: list[str], states: dict[str, ModuleState], where: str) -> torch.Tensor:
    """A torch-format target's `_extra_state` value for the module of universal names `gemms`:
    TE's payload of their state (merged for a grouped linear), or TE's empty one without FP8."""
    held = [n for n in gemms if n in states]
    if not held:
        return encode(None)
    if len(held) != len(gemms):
        raise UCPError(f"{where}: the source holds FP8 state for {held} but not for "
                       f"{sorted(set(gemms) - set(held))}, gemms of one grouped linear")
    if len(gemms) == 1:
        return encode(states[gemms[0]])
    return encode(merge_gemms([states[n] for n in gemms], where))


def dist_states(keys, read_object, names: dict[str, str | None], where: str) -> dict[str, ModuleState]:
    """The FP8 states a torch_dist checkpoint holds, by universal name: each `_extra_state` object
    among `keys` (`read_object(key)`) decoded; `names`: unique key -> universal name of the
    objects of the model rebuilt from the args. Objects the checkpoint lacks (megatron-LM main's
    --ckpt-drop-redundant-extra-state writes none without delayed-scaling state) hold nothing."""
    out: dict[str, ModuleState] = {}
    for key in keys:
        if "._extra_state" not in key:
            continue
        data = read_object(key)
        data = data[0] if isinstance(data, list) and len(data) == 1 else data
        state = decode(data, f"{where} [{key}]")
        if state is None:
            continue
        name = names.get(key)
        if name is None:
            raise UCPError(f"{where}: object {key!r} holds Transformer Engine FP8 state, but the model "
                           "rebuilt from the args has no such module; converting would drop it")
        check_copies(out, name, state, f"{where} [{key}]")
    return out


def is_persistent(state: ModuleState | None) -> bool:
    """Whether Megatron-LM main's --ckpt-drop-redundant-extra-state keeps a module's `_extra_state`
    in torch_dist: delayed-scaling state only (`_fp8_extra_state_is_persistent`)."""
    return state is not None and bool(state.tensors)


def unwritten(states: dict[str, ModuleState], written: set[str], args, where: str) -> None:
    """Refuse a Transformer Engine target that has no module for some of the source's FP8 states;
    a local-spec target (no TE modules) is told, as a live local load is."""
    left = sorted(set(states) - written)
    if not left:
        return
    if getattr(args, "transformer_impl", "local") == "transformer_engine":
        raise UCPError(f"{where}: the target model has no Transformer Engine module for the source's FP8 "
                       f"state of {left[:3]}{' ...' if len(left) > 3 else ''} ({len(left)} in all); "
                       "the args do not describe the source's model")
    log.warning("%s: the target is a local-spec run; the FP8 state of %d Transformer Engine modules "
                "is not written", where, len(left))


def rank_states(chunks: list, saved: dict, states: dict[str, ModuleState], where: str) -> None:
    """A torch-format rank file's FP8 states (`saved`: its model_optim_rng.pt, one `model` /
    `model<i>` state dict per chunk of the rank rebuilt from the args) into `states`."""
    from megatron.core.utils import unwrap_model

    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for key, chunk in zip(keys, chunks):
        legacy_states(legacy_names(unwrap_model(chunk)), saved.get(key) or {}, states, f"{where} [{key}]")


def dist_objects(objects: dict, states: dict[str, ModuleState], args, where: str) -> dict:
    """A torch_dist target's ShardedObjects (unique key -> data) from the model rebuilt at TP1
    (`layout.plan_model`'s objects: unique key -> (data, universal name)): each TE module's
    `_extra_state` is TE's payload of the source's state for it (`encode`: empty without FP8); a
    local layer's (data None) stays None. With --ckpt-drop-redundant-extra-state (Megatron-LM main)
    a module without delayed-scaling state has no object, as that run writes it."""
    drop = bool(getattr(args, "ckpt_drop_redundant_extra_state", False))
    out, written = {}, set()
    for key, (data, name) in objects.items():
        if name is None or data is None:  # not an `_extra_state`, or a local layer's None
            out[key] = data
            continue
        state = states.get(name)
        if drop and not is_persistent(state):
            continue
        out[key] = encode(state)
        if state is not None:
            written.add(name)
    unwritten(states, written, args, where)
    return out


def check_read_back(back: dict[str, ModuleState], states: dict[str, ModuleState], args,
                    where: str) -> None:
    """The FP8 state read back from a written target (`back`) is the source's (`states`), module by
    module (digests), for a Transformer Engine target; stateless recipes read back as none."""
    if getattr(args, "transformer_impl", "local") != "transformer_engine":
        return
    want = {n: s.digest() for n, s in states.items() if s.tensors}
    have = {n: s.digest() for n, s in back.items()}
    if have != want:
        wrong = sorted(n for n in set(want) | set(have) if want.get(n) != have.get(n))
        raise UCPError(f"{where}: the written Transformer Engine FP8 state differs from the source's "
                       f"for {wrong[:3]} ({len(wrong)} modules); nothing is committed")


def export_check(check_export, source, reader, args, written: set | None = None):
    """The `check` of a Megatron-LM writer's commit: `check_export` (megatron_common's: every tensor
    read back with `reader`, the format's own source class), then, for a TE target, every module's
    FP8 state read back is the source's (`check_read_back`). written (the torch writer, which fills
    it while it writes): the modules it wrote, among which every source state must be (`unwritten`)."""

    def check(d) -> None:
        if written is not None:
            unwritten(source.te_states(), written, args, str(source.dir))
        opened: list = []
        check_export(d, source, lambda path: opened.append(reader(path, progress=False)) or opened[-1])
        check_read_back(opened[-1].te_states(), source.te_states(), args, str(d))

    return check
