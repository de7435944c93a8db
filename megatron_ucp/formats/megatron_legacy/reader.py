"""Megatron-LM legacy checkpoints (`--ckpt-format torch`, distributed optimizer) as a source.

We do not re-implement megatron-core's layout rules. For each rank directory we rebuild that rank's
model inside this process, at the SOURCE layout, on a fake process group (no real communication,
meta tensors, no memory for weights), wrap it in megatron-core's DistributedDataParallel with the
distributed optimizer's buffer settings, and read

* each parameter's offset in the flat tensors from DDP's own `param_index_map` and bucket list, and
* its universal name and the box of the universal tensor its TP slice fills from
  `megatron_ucp.param_spec.local_params` (the model's own `sharded_state_dict()`).

The full tensors are assembled from the rank files (memory-mapped), replicated and tied copies are
checked bitwise, and every model weight must equal its master weight cast to the training dtype.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.base import RunFields, Source
from megatron_ucp.formats.manifest import Manifest, ParamEntry
from megatron_ucp.formats.megatron_common import (
    as_list,
    check_supported,
    group_step,
    hybrid_layer_pattern,
    jsonable_tree,
    layer_wise_family,
    layout,
    optimizer_json,
    resolve_iteration,
    torch_load,
    world,
    writer_ranks,
)
from megatron_ucp.formats.megatron_legacy.layout import (
    LAYER_WISE_FILE,
    MODEL_FILE,
    OPTIM_FILE,
    flat_offsets,
    is_iteration,
    layer_wise_ranks,
    load_file,
    optimizer_buffers,
    rank_context,
    rank_dirs,
    read_args,
)
from megatron_ucp.formats.megatron_rebuild import (
    build_chunks,
    layer_wise_params,
    model_config,
    source_rank,
    wrap_ddp,
)
from megatron_ucp.formats.megatron_te import rank_states
from megatron_ucp.mcore_compat import mamba_state_key, missing_module_hint, saved_mamba_conv1d_form
from megatron_ucp.param_spec import local_params
from megatron_ucp.progress import Progress, bar
from megatron_ucp.spec import OPTIMIZER_STATES, STATES, ParamSpec, Piece
from megatron_ucp.storage import size_of

log = logging.getLogger(__name__)
_LAYOUT_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                "virtual_pipeline_model_parallel_size", "expert_model_parallel_size",
                "context_parallel_size", "world_size", "num_layers", "hidden_size", "num_experts")


_RESTORE = "restore the rank directory's files from the original save"


@dataclass
class _Copy:
    """One rank's local copy of (part of) a universal tensor, with where its rows go."""

    source: Path  # the rank directory
    local_name: str
    pieces: list[Piece]
    canonical: bool
    weight: torch.Tensor  # model weight from model_optim_rng.pt (training dtype), local shape
    states: dict[str, torch.Tensor] | None  # fp32 views into distrib_optim.pt; None: not saved here
    step: float | None


@dataclass
class _RankFiles:
    path: Path
    model: dict
    optim: list  # distrib_optim.pt entries, one per chained optimizer (None: not DP rank 0 there)
    # LayerWiseDistributedOptimizer: dp rank -> its layer_wise_optimizer_<dp>.pt (one state dict
    # per chained torch optimizer) and the (chunk, local name)s it owns per chain and group
    layer_wise: dict | None = None


class LegacySource(Source):
    """A Megatron-LM `--ckpt-format torch` checkpoint read as universal tensors.

    load_dir: the save root (with latest_checkpointed_iteration.txt) or one iter_XXXXXXX directory.
    Runs on a CPU-only box without a process group (it creates and destroys a fake one per source
    rank); opening it rebuilds every source rank, reading assembles one tensor at a time.
    """

    format = "megatron_torch"  # its name in the `formats` registry

    def __init__(self, load_dir: str | Path, progress: Progress = True, trust_pickle: bool = False):
        t0 = time.perf_counter()
        iter_dir, iteration = resolve_iteration(load_dir, is_iteration, "--ckpt-format torch")
        found = rank_dirs(iter_dir)
        self.args = args = read_args(found[0] / MODEL_FILE, found, trust_pickle)  # the run's
        check_supported(args, found[0] / MODEL_FILE)
        if iteration is None:  # a directory whose name does not say: its first rank file does
            iteration = load_file(found[0] / MODEL_FILE, trust_pickle).get("iteration")
        writers = writer_ranks(args)
        missing = sorted(set(writers) - {p.name for p in found})
        if missing:
            raise UCPError(f"{iter_dir}: rank directories {missing} are missing (the saved layout "
                           f"{layout(args)} needs {sorted(writers)}); the checkpoint is incomplete: "
                           "copy the missing directories or convert another iteration")
        extra = sorted({p.name for p in found} - set(writers))
        if extra:
            raise UCPError(f"{iter_dir}: rank directories {extra} do not belong to the layout "
                           f"{layout(args)} recorded in {found[0] / MODEL_FILE} args (expected "
                           f"{sorted(writers)}); remove them or convert the directories of one save only")

        self.copies: dict[str, list[_Copy]] = {}
        self._te: dict = {}  # Transformer Engine FP8 state by universal module name
        self.specs: dict[str, ParamSpec] = {}
        model_cfg: dict = {}
        head: dict = {}  # model_optim_rng.pt of the first writer (global rank 0): scheduler, groups
        done = bar(progress, len(writers), "rebuild source ranks", "rank")
        self.layer_wise = bool(getattr(args, "use_layer_wise_distributed_optimizer", False))
        for name, rank in sorted(writers.items(), key=lambda kv: kv[1]):
            files = _load_rank(iter_dir / name, iteration, trust_pickle, args if self.layer_wise else None)
            _check_same_run(files, args, found[0] / MODEL_FILE)
            head = head or files.model
            # a hybrid model's buffers follow the saving release's Mamba parameter order
            conv1d_module = saved_mamba_conv1d_form(k for key in files.model if key.startswith("model")
                                                    and isinstance(files.model[key], dict)
                                                    for k in files.model[key])
            with rank_context(args, rank, name):
                chunks = wrap_ddp(build_chunks(args), args, conv1d_module)
                if not model_cfg:
                    model_cfg = model_config(chunks, args)
                _collect(chunks, files, args, self.copies, self.specs)
                rank_states(chunks, files.model, self._te, str(iter_dir / name / MODEL_FILE))
            done.update(1)
        done.close()

        self.dir = iter_dir
        self.steps = {n: _step(n, self.copies[n]) for n in sorted(self.specs)}
        self.origin = {"kind": "megatron-lm-torch", "path": str(iter_dir),
                       "checkpoint_version": head.get("checkpoint_version")}
        self.manifest = Manifest(
            "universal", iteration, layout(args), world(args), model_cfg,
            {n: ParamEntry(self.specs[n], step) for n, step in self.steps.items()},
            optimizer_json(head["optimizer"]), jsonable_tree(head.get("opt_param_scheduler")),
            ({"consumed_samples": int(args.consumed_train_samples)}
             if getattr(args, "consumed_train_samples", None) is not None else {}),
            int(getattr(args, "seed", 1234)))
        optim_files = [LAYER_WISE_FILE.format(dp=d) for d in range(layout(args).dp)] \
            if self.layer_wise else [OPTIM_FILE]
        self.bytes_read = sum(size_of(d / f) for d in found for f in (MODEL_FILE, *optim_files))
        self.files_opened = (1 + len(optim_files)) * len(found)
        self._last: tuple[tuple[str, str], torch.Tensor] | None = None
        log.info("rebuilt Megatron-LM iteration %d (%s, %d rank dirs, %d parameters) in %.2fs",
                 iteration, layout(args), len(writers), len(self.steps), time.perf_counter() - t0)

    def step(self, name: str) -> float:
        return self.steps[name]

    def read(self, name: str, state: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """A box of the full tensor (assembled once per tensor and state, then sliced)."""
        if self._last is None or self._last[0] != (name, state):
            self._last = ((name, state), _assemble(name, state, self.specs[name], self.copies[name]))
        return self._last[1][tuple(slice(o, o + n) for o, n in zip(offset, shape))]

    def rng_ranks(self) -> list[int]:
        return []  # per-rank generator states are Megatron-LM's, kept by its own writers (fields)

    def te_states(self) -> dict:
        """The TE modules' `_extra_state` entries of its rank files, decoded (pickle-free)."""
        return self._te


def run_fields(load_dir: str | Path, trust_pickle: bool = False) -> RunFields:
    """From a legacy checkpoint: its args, rng states (by rank directory name and by (PP, TP)
    rank), its layout and flops: what a Megatron-LM writer takes from the source run."""
    iter_dir, _ = resolve_iteration(load_dir, is_iteration, "--ckpt-format torch")
    found = rank_dirs(iter_dir)
    args = read_args(found[0] / MODEL_FILE, found, trust_pickle)
    rng, by_position, flops = {}, {}, None
    writers = writer_ranks(args)
    for name in sorted(writers, key=writers.get):
        if (iter_dir / name / MODEL_FILE).exists():
            m = load_file(iter_dir / name / MODEL_FILE, trust_pickle)
            if "rng_state" in m:
                rng[name] = m["rng_state"]
                tp, *rest = (int(x) for x in name.removeprefix("mp_rank_").split("_"))
                by_position.setdefault((rest[0] if args.pipeline_model_parallel_size > 1 else 0, tp),
                                       m["rng_state"])
            if flops is None:
                flops = m.get("num_floating_point_operations_so_far")
    return RunFields(args=args, layout=layout(args), rng_state=rng or None,
                     rng_by_position=by_position or None,
                     num_floating_point_operations_so_far=flops)


def _load_rank(rank_dir: Path, iteration: int, trust_pickle: bool, layer_wise_args=None) -> _RankFiles:
    model = load_file(rank_dir / MODEL_FILE, trust_pickle)
    if not isinstance(model, dict) or "optimizer" not in model:
        raise UCPError(f"{rank_dir / MODEL_FILE} has no optimizer state; it was saved with "
                       "--no-save-optim and cannot be resumed")
    if model.get("iteration") != iteration:
        raise UCPError(f"{rank_dir / MODEL_FILE} is from iteration {model.get('iteration')}, but the "
                       f"checkpoint is iteration {iteration}; the rank directories mix different "
                       "saves: restore this directory from the same save")
    if float(model.get("checkpoint_version", 0)) < 3.0:
        raise UCPError(f"{rank_dir / MODEL_FILE}: checkpoint_version {model.get('checkpoint_version')}"
                       " predates 3.0 (older QKV layout); load and re-save it with Megatron-LM first")
    if layer_wise_args is not None:
        return _RankFiles(rank_dir, model, [], _load_layer_wise(rank_dir, layer_wise_args, trust_pickle))
    optim = load_file(rank_dir / OPTIM_FILE, trust_pickle)
    optim = optim if isinstance(optim, list) else [optim]
    for entry in optim:
        if entry is not None and not (isinstance(entry, dict) and entry.get("buckets_coalesced")):
            raise UCPError(f"{rank_dir / OPTIM_FILE} is not in the coalesced-bucket format of "
                           "megatron-core >= 0.7; load and re-save it with a newer Megatron-LM")
    return _RankFiles(rank_dir, model, optim)


def _load_layer_wise(rank_dir: Path, args, trust_pickle: bool) -> dict:
    """Every DP rank's `layer_wise_optimizer_<dp>.pt` of this rank directory, with the parameters
    megatron-core assigns to that rank (`megatron_rebuild.layer_wise_params`, rebuilt at the
    source rank), checked against the file's param groups."""
    out = {}
    for dp, rank in layer_wise_ranks(args, rank_dir.name):
        path = rank_dir / LAYER_WISE_FILE.format(dp=dp)
        if not path.exists():
            raise UCPError(f"{path} is missing: a LayerWiseDistributedOptimizer run (--optimizer "
                           f"{getattr(args, 'optimizer', '?')}) saves each data-parallel rank's "
                           f"optimizer state there; {_RESTORE}")
        saved = torch_load(path, _RESTORE, trust_pickle)
        saved = saved if isinstance(saved, list) else [saved]
        with source_rank(args, rank):
            owned = layer_wise_params(build_chunks(args), args)
        if len(saved) != len(owned):
            raise UCPError(f"{path} holds {len(saved)} chained optimizers, the optimizer rebuilt from "
                           f"args {len(owned)}; the args do not describe this checkpoint: {_RESTORE}")
        for c, (entry, groups) in enumerate(zip(saved, owned)):
            got = [len(g.get("params", [])) for g in (entry.get("optimizer") or {}).get("param_groups", [])]
            masters = [len(g) for g in entry.get("fp32_from_fp16_params") or []]
            if got != [len(g) for g in groups] or masters != got:
                raise UCPError(f"{path}: chained optimizer {c} has param groups of {got} parameters "
                               f"({masters} fp32 masters), but megatron-core assigns this rank "
                               f"{[len(g) for g in groups]}; the args do not describe this "
                               f"checkpoint (or a parameter is not bf16): {_RESTORE}")
        out[dp] = (path, saved, owned)
    return out


def _layer_wise_where(files: _RankFiles, args) -> dict:
    """(chunk, local name) -> (file, family, fp32 master, states, step) from the LayerWise files."""
    where = {}
    for path, saved, owned in files.layer_wise.values():
        for c, (entry, groups) in enumerate(zip(saved, owned)):
            opt = entry["optimizer"]
            for g, (group, names) in enumerate(zip(opt["param_groups"], groups)):
                for j, (pid, key) in enumerate(zip(group["params"], names)):
                    state = opt["state"].get(pid)
                    if not state:
                        raise UCPError(f"{path}: chained optimizer {c} has no state for parameter "
                                       f"{key[1]} (saved before the first step?)")
                    fam = layer_wise_family(set(state), args, f"{path}: chained optimizer {c}")
                    if key in where:
                        raise UCPError(f"{path}: {key[1]} is also in {where[key][0]}")
                    step = float(state["step"]) if fam == "adam" else 0.0
                    where[key] = (path, fam, entry["fp32_from_fp16_params"][g][j],
                                  {s: state[s] for s in OPTIMIZER_STATES[fam]}, step)
    return where


def _check_same_run(files: _RankFiles, args, first: Path) -> None:
    """Every rank file must come from the run whose args we rebuild (same sizes)."""
    other = files.model.get("args")
    diff = [k for k in _LAYOUT_ARGS if getattr(other, k, None) != getattr(args, k, None)]
    if other is None or diff:
        raise UCPError(f"{files.path / MODEL_FILE}: its args differ from {first} in "
                       f"{diff or ['(no args)']}; the rank directories come from different runs: "
                       "restore this directory from the same save")


def _saved_models(chunks: list, files: _RankFiles, args) -> tuple[list[str], list[dict]]:
    """(the model state dict keys, one saved state dict per model chunk), each checked to hold
    exactly the modules of the chunk rebuilt from the args."""
    from megatron.core.utils import unwrap_model

    model_file = files.path / MODEL_FILE
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    state_dicts = []
    for key, chunk in zip(keys, chunks):
        saved = files.model.get(key)
        if not isinstance(saved, dict):
            raise UCPError(f"{model_file} has no {key!r} state dict; expected {keys} for "
                           f"{len(chunks)} model chunk(s) per rank (VPP {layout(args).vpp}): "
                           f"{_RESTORE}")
        if hybrid_layer_pattern(args):  # another release's Mamba conv1d names, as this one's
            saved = {mamba_state_key(k): v for k, v in saved.items()}
        ours = set(unwrap_model(chunk).state_dict())
        hint = missing_module_hint(set(saved) - ours)
        if hint:
            raise UCPError(f"{model_file} [{key}]: {hint}")
        if ours != set(saved):
            raise UCPError(f"{model_file} [{key}]: the model rebuilt from its args does not have "
                           f"the saved modules (saved only: {sorted(set(saved) - ours)[:5]}, rebuilt "
                           f"only: {sorted(ours - set(saved))[:5]}); the args do not describe this "
                           f"checkpoint ({_RESTORE}) or it uses a layer spec megatron-ucp cannot "
                           "rebuild")
        state_dicts.append(saved)
    return keys, state_dicts


def _collect(chunks: list, files: _RankFiles, args, copies: dict[str, list[_Copy]],
             specs: dict[str, ParamSpec]) -> None:
    """Every parameter of this rank: its spec, pieces, model weight and optimizer slices."""
    model_file, optim_file = files.path / MODEL_FILE, files.path / OPTIM_FILE
    keys, state_dicts = _saved_models(chunks, files, args)
    if files.layer_wise is not None:
        return _collect_layer_wise(chunks, files, args, keys, state_dicts, copies, specs)

    buffers = optimizer_buffers(chunks, args)
    if len(buffers) != len(files.optim):
        raise UCPError(f"{optim_file} holds {len(files.optim)} optimizer entries, but the model "
                       f"rebuilt from args has {len(buffers)} (dense/expert); the args do not match: "
                       f"{_RESTORE}")
    where: dict = {}  # param -> (entry index, flat tensors, start)
    for i, (bufs, entry) in enumerate(zip(buffers, files.optim)):
        if entry is None:
            continue  # this rank was not DP rank 0 of that optimizer; another rank dir holds it
        for b, buf in enumerate(bufs):
            key = (buf.param_dtype, buf.grad_dtype)
            flat = entry.get(b, {}).get(key)
            if flat is None or flat["numel_unpadded"] != buf.numel_unpadded:
                got = {k: {d: t.get("numel_unpadded") for d, t in v.items()}
                       for k, v in entry.items() if isinstance(k, int)}
                raise UCPError(f"{optim_file}: optimizer {i} buffer {b} {key}: expected "
                               f"{buf.numel_unpadded} elements from the model rebuilt from args, file "
                               f"has {got}; the args do not describe this checkpoint: {_RESTORE}")
            for p, start in flat_offsets(buf).items():
                where[p] = (i, flat, start)

    steps = [None if opt is None else group_step(opt.get("optimizer", {}).get("param_groups", []),
                                                 f"{model_file}: optimizer {i}")
             for i, opt in enumerate(as_list(files.model["optimizer"]))]
    for lp in local_params(chunks):
        weight = _saved_weight(state_dicts, lp, model_file, keys)
        weight = lp.region(weight)
        states, step = None, None
        if lp.spec.buffer:  # a persistent buffer (MoE expert_bias): its value, no optimizer state
            states, step = {"param": weight.float()}, 0.0
        elif lp.param in where:
            i, flat, start = where[lp.param]
            n = lp.param.numel()
            if start + n > flat["param"].numel():
                raise UCPError(f"{optim_file}: {lp.local_name} would end at element {start + n} of "
                               f"{flat['param'].numel()}; the args do not describe this checkpoint: "
                               f"{_RESTORE}")
            states = {s: lp.region(flat[s][start:start + n]) for s in STATES}
            step = steps[i] if i < len(steps) else None
            if step is None:
                raise UCPError(f"{model_file}: no Adam step for optimizer {i}; the optimizer state "
                               "was saved before the first step")
        prev = specs.setdefault(lp.spec.name, dataclasses.replace(lp.spec, aliases=[]))
        if dataclasses.replace(prev, aliases=[]) != dataclasses.replace(lp.spec, aliases=[]):
            raise UCPError(f"{model_file}: parameter {lp.spec.name} ({lp.local_name}) has spec "
                           f"{lp.spec} here but {prev} on another rank")
        prev.aliases = sorted(set(prev.aliases) | set(lp.spec.aliases))
        copies.setdefault(lp.spec.name, []).append(
            _Copy(files.path, lp.local_name, lp.pieces, lp.canonical, weight, states, step))


def _saved_weight(state_dicts, lp, model_file: Path, keys) -> torch.Tensor:
    """The rank file's saved weight of `lp`, which must have the rebuilt model's shape."""
    weight = state_dicts[lp.chunk].get(lp.local_name)
    if not torch.is_tensor(weight) or weight.shape != lp.param.shape:
        raise UCPError(f"{model_file} [{keys[lp.chunk]}] {lp.local_name}: saved "
                       f"{tuple(weight.shape) if torch.is_tensor(weight) else weight}, rebuilt "
                       f"model has shape {tuple(lp.param.shape)}; the args do not describe this "
                       f"checkpoint: {_RESTORE}")
    return weight


def _collect_layer_wise(chunks, files: _RankFiles, args, keys, state_dicts, copies, specs) -> None:
    """`_collect` for a LayerWiseDistributedOptimizer run: each parameter's whole state from the
    DP rank that owns it (its family from the chained optimizer holding it)."""
    model_file = files.path / MODEL_FILE
    where = _layer_wise_where(files, args)
    for lp in local_params(chunks):
        weight = _saved_weight(state_dicts, lp, model_file, keys)
        spec = lp.spec
        if lp.spec.buffer:
            states, step = {"param": lp.region(weight).float()}, 0.0
        else:
            held = where.get((lp.chunk, lp.local_name))
            if held is None:
                raise UCPError(f"{files.path}: no layer_wise_optimizer_<dp>.pt holds {lp.local_name}; "
                               f"the checkpoint is incomplete: {_RESTORE}")
            path, fam, master, state, step = held
            for what, t in (("fp32 master", master), *state.items()):
                if not torch.is_tensor(t) or t.shape != lp.param.shape or t.dtype != torch.float32:
                    raise UCPError(f"{path}: {what} of {lp.local_name} is "
                                   f"{tuple(t.shape) if torch.is_tensor(t) else t}, expected fp32 "
                                   f"{tuple(lp.param.shape)}; the args do not describe this "
                                   f"checkpoint: {_RESTORE}")
            states = {"param": lp.region(master), **{s: lp.region(t) for s, t in state.items()}}
            spec = dataclasses.replace(lp.spec, optimizer=fam)
        prev = specs.setdefault(spec.name, dataclasses.replace(spec, aliases=[]))
        if dataclasses.replace(prev, aliases=[]) != dataclasses.replace(spec, aliases=[]):
            raise UCPError(f"{model_file}: parameter {spec.name} ({lp.local_name}) has spec "
                           f"{spec} here but {prev} on another rank")
        prev.aliases = sorted(set(prev.aliases) | set(spec.aliases))
        copies.setdefault(spec.name, []).append(
            _Copy(files.path, lp.local_name, lp.pieces, lp.canonical, lp.region(weight), states, step))


def _step(name: str, copies: list[_Copy]) -> float:
    steps = {c.step for c in copies if c.states is not None}
    if not steps:
        raise UCPError(f"parameter {name}: no {OPTIM_FILE} holds its optimizer state (copies in "
                       f"{sorted({str(c.source) for c in copies})}); the checkpoint is incomplete")
    if len(steps) != 1:
        raise UCPError(f"parameter {name}: rank files disagree on its Adam step ({sorted(steps)} in "
                       f"{sorted({str(c.source) for c in copies})}); the checkpoint mixes iterations")
    return steps.pop()


def _assemble(name: str, state: str, spec: ParamSpec, copies: list[_Copy]) -> torch.Tensor:
    """Full fp32 tensor of one state from the copies that hold optimizer state (canonical copies
    first); every other copy of the same box must be bitwise equal. For `param`, every saved model
    weight must equal the master weight cast to its dtype."""
    full = torch.empty(spec.shape, dtype=torch.float32)
    filled = torch.zeros(spec.shape, dtype=torch.bool)
    for c in sorted((c for c in copies if c.states is not None), key=lambda c: not c.canonical):
        local = c.states[state]
        for pc in c.pieces:
            rows, box = pc.take(local), pc.box
            if filled[box].any():
                if not filled[box].all() or not torch.equal(full[box], rows):
                    raise UCPError(f"{c.source / OPTIM_FILE}: {state} of {c.local_name} (universal "
                                   f"{name}) differs from another rank's copy of the same elements; "
                                   "replicated or tied copies must be identical, the checkpoint is "
                                   "inconsistent (mixed saves?)")
                continue
            full[box] = rows
            filled[box] = True
    if not bool(filled.all()):
        held = sorted({str(c.source) for c in copies if c.states is not None})
        raise UCPError(f"parameter {name}: {int((~filled).sum())} of {filled.numel()} elements of "
                       f"{state} are in no {OPTIM_FILE} (held by {held}); the checkpoint is "
                       "incomplete: a rank directory's optimizer file is missing its part")
    if state == "param":
        for c in copies:
            for pc in c.pieces:
                if not torch.equal(pc.take(c.weight), full[pc.box].to(c.weight.dtype)):
                    raise UCPError(f"{c.source / MODEL_FILE}: model weight {c.local_name} (universal "
                                   f"{name}) is not the master weight from {OPTIM_FILE} cast to "
                                   f"{c.weight.dtype}; the two files are from different saves or a "
                                   "replica diverged")
    return full
