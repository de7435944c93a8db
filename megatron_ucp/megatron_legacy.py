"""Megatron-LM legacy checkpoints (`--ckpt-format torch`, distributed optimizer) -> universal form.

A legacy save holds, per (TP, PP, EP) rank, `model_optim_rng.pt` (model weights in the training dtype
with local layer numbers, optimizer hyper-parameters and the Adam step, scheduler, args) and
`distrib_optim.pt` (fp32 master weights and Adam moments as flat per-buffer tensors gathered from all
DP ranks). Neither file says where a parameter sits in the flat tensors or in the global model: that
is decided by megatron-core's code at the saving layout (DDP's parameter/gradient buffers, the
pipeline layer offsets, the TP split of each layer).

So we do not re-implement those rules. For each rank directory we rebuild that rank's model inside
this process, at the SOURCE layout, on a fake process group (no real communication, meta tensors, no
memory for weights), wrap it in megatron-core's DistributedDataParallel with the distributed
optimizer's buffer settings, and read

* each parameter's offset in the flat tensors from DDP's own `param_index_map` and bucket list, and
* its universal name and the box of the universal tensor its TP slice fills from
  `megatron_ucp.param_spec.local_params` (the model's own `sharded_state_dict()`).

The full tensors are assembled from the rank files (memory-mapped), replicated and tied copies are
checked bitwise, and the result is written through `megatron_ucp.universal`, so `megatron_ucp.load`
resumes it at any layout. Only this file knows the legacy format.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron_ucp import manifest as mf
from megatron_ucp.errors import UCPError
from megatron_ucp.layout import Layout
from megatron_ucp.megatron_rebuild import build_chunks, model_config, source_rank, wrap_ddp
from megatron_ucp.megatron_rebuild import layout as _layout
from megatron_ucp.megatron_rebuild import rank_order as _order
from megatron_ucp.megatron_rebuild import world as _world
from megatron_ucp.spec import STATES, ParamSpec, Piece
from megatron_ucp.storage import fsync_dir
from megatron_ucp.universal import commit, write_params

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
OPTIM_FILE = "distrib_optim.pt"
_RANK_DIR = re.compile(r"mp_rank_\d{2}(_\d{3}){0,2}")

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


# ----------------------------------------------------------------------------------------------
# entry point


def convert_legacy(load_dir: str | Path, universal_dir: str | Path, progress: bool = True,
                   workers: int = 1) -> Path:
    """Convert a Megatron-LM `--ckpt-format torch` checkpoint into a universal directory.

    load_dir: the save root (with latest_checkpointed_iteration.txt) or one iter_XXXXXXX directory.
    Runs on a CPU-only box without a process group (it creates and destroys a fake one per source
    rank). Returns the universal directory, which `megatron_ucp.load` reads at any layout.
    """
    t0 = time.perf_counter()
    if dist.is_available() and dist.is_initialized():
        raise UCPError("convert_legacy rebuilds the source layout on its own fake process group and "
                       "cannot run inside a job that already has one; run it in a separate process "
                       "(`megatron-ucp import-legacy LOAD_DIR UNIVERSAL_DIR`)")
    iter_dir, iteration = _resolve(Path(load_dir))
    out = Path(universal_dir)
    if out.exists() and any(out.iterdir()):
        raise UCPError(f"{out} exists and is not empty; choose a new directory")

    found = sorted(p for p in iter_dir.iterdir() if p.is_dir() and _RANK_DIR.fullmatch(p.name))
    if not found:
        raise UCPError(f"{iter_dir} holds no mp_rank_* directories: it is not a Megatron-LM "
                       "`--ckpt-format torch` checkpoint (torch_dist checkpoints hold *.distcp files "
                       "and are not read by import-legacy)")
    args = _read_args(found[0] / MODEL_FILE, found)
    _check_supported(args, found[0] / MODEL_FILE)
    writers = _writer_ranks(args)
    missing = sorted(set(writers) - {p.name for p in found})
    if missing:
        raise UCPError(f"{iter_dir}: rank directories {missing} are missing (the saved layout "
                       f"{_layout(args)} needs {sorted(writers)}); the checkpoint is incomplete: "
                       "copy the missing directories or convert another iteration")
    extra = sorted({p.name for p in found} - set(writers))
    if extra:
        raise UCPError(f"{iter_dir}: rank directories {extra} do not belong to the layout "
                       f"{_layout(args)} recorded in {found[0] / MODEL_FILE} args (expected "
                       f"{sorted(writers)}); remove them or convert the directories of one save only")

    copies: dict[str, list[_Copy]] = {}
    specs: dict[str, ParamSpec] = {}
    model_cfg: dict = {}
    head: dict = {}  # model_optim_rng.pt of the first writer (global rank 0): scheduler, groups
    ranks = tqdm(sorted(writers.items(), key=lambda kv: kv[1]), desc="rebuild source ranks",
                 unit="rank", disable=not progress)
    for name, rank in ranks:
        files = _load_rank(iter_dir / name, iteration)
        _check_same_run(files, args, found[0] / MODEL_FILE)
        head = head or files.model
        with _source_rank(args, rank, name):
            chunks = wrap_ddp(build_chunks(args), args)
            if not model_cfg:
                model_cfg = model_config(chunks, args)
            _collect(chunks, files, args, copies, specs)

    params = {n: specs[n].to_json() for n in sorted(specs)}
    steps = {n: _step(n, copies[n]) for n in params}
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    bar = tqdm(total=len(params), desc="import-legacy", unit="param", disable=not progress)
    try:
        entries = write_params(partial, params,
                               lambda n, s: _assemble(n, s, specs[n], copies[n]), progress=bar,
                               workers=workers)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # an inconsistency found half-way: leave nothing
        raise
    finally:
        bar.close()
    m = head
    manifest = {
        "format": mf.FORMAT, "version": mf.VERSION, "kind": "universal",
        "iteration": iteration, "layout": _layout(args).to_json(), "layout_world_size": _world(args),
        "model": model_cfg,
        "params": {n: {**spec, "step": steps[n], "tensors": entries[n]} for n, spec in params.items()},
        "optimizer": _optimizer_json(m["optimizer"]),
        "scheduler": _jsonable_tree(m.get("opt_param_scheduler")),
        "extra": ({"consumed_samples": int(args.consumed_train_samples)}
                  if getattr(args, "consumed_train_samples", None) is not None else {}),
        "seed": int(getattr(args, "seed", 1234)),
        "converted_from": {"kind": "megatron-lm-torch", "path": str(iter_dir),
                           "checkpoint_version": m.get("checkpoint_version")},
    }
    commit(partial, out, manifest)
    if progress:
        print(f"[megatron-ucp] imported Megatron-LM iteration {iteration} ({_layout(args)}, "
              f"{len(writers)} rank dirs, {len(params)} parameters) into {out} in "
              f"{time.perf_counter() - t0:.2f}s")
    return out


# ----------------------------------------------------------------------------------------------
# files


def _resolve(path: Path) -> tuple[Path, int]:
    """(iteration directory, iteration) from a save root or an iter_* directory."""
    if not path.exists():
        raise UCPError(f"{path} does not exist; pass a Megatron-LM save root (with {TRACKER}) or one "
                       "of its iter_XXXXXXX directories")
    if (path / TRACKER).exists():
        text = (path / TRACKER).read_text().strip()
        if text == "release":
            return path / "release", 0
        if not text.isdigit():
            raise UCPError(f"{path / TRACKER} says {text!r}, not an iteration number; pass the "
                           "iter_XXXXXXX directory to convert instead")
        iter_dir = path / f"iter_{int(text):07d}"
        if not iter_dir.is_dir():
            raise UCPError(f"{path / TRACKER} names iteration {int(text)}, but {iter_dir} does not "
                           f"exist; pass an existing iter_XXXXXXX directory instead")
        return iter_dir, int(text)
    match = re.fullmatch(r"iter_(\d{7})", path.name)
    if match:
        return path, int(match.group(1))
    if path.name == "release":
        return path, 0
    raise UCPError(f"{path} is neither a Megatron-LM save root (no {TRACKER}) nor an iter_XXXXXXX "
                   "directory; pass one of those")


def _torch_load(path: Path) -> Any:
    """torch.load on CPU, memory-mapped so a large checkpoint is not read into RAM at once."""
    if not path.exists():
        raise UCPError(f"{path} is missing; every rank directory needs {MODEL_FILE} and "
                       f"{OPTIM_FILE} (saved with --use-distributed-optimizer); restore the file")
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            return torch.load(path, map_location="cpu", weights_only=False)  # old non-zip format
    except ModuleNotFoundError as e:
        raise UCPError(f"{path}: cannot unpickle it, it references module {e.name!r} which is not "
                       "installed here; install it (the checkpoint's args refer to it)") from e
    except Exception as e:
        raise UCPError(f"{path} cannot be read ({type(e).__name__}: {e}); the file is truncated or "
                       "corrupt: restore it from the source or convert another iteration") from e


def _read_args(path: Path, found: list[Path]):
    m = _torch_load(path)
    args = m.get("args") if isinstance(m, dict) else None
    sizes = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers")
    if args is None or not all(hasattr(args, k) for k in sizes):
        two_part = [p.name for p in found if p.name.count("_") == 3]
        why = (f"the directory names {two_part} are ambiguous without it (mp_rank_TT_XXX is a "
               "pipeline rank with PP>1 but an expert rank with EP>1) and " if two_part else "")
        raise UCPError(f"{path} has no Megatron-LM 'args' (argparse namespace with the parallel "
                       f"sizes and the model architecture); {why}the model cannot be rebuilt. Every "
                       "Megatron-LM save stores args: restore this file from the original save")
    return args


def _load_rank(rank_dir: Path, iteration: int) -> _RankFiles:
    model = _torch_load(rank_dir / MODEL_FILE)
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
    optim = _torch_load(rank_dir / OPTIM_FILE)
    optim = optim if isinstance(optim, list) else [optim]
    for entry in optim:
        if entry is not None and not (isinstance(entry, dict) and entry.get("buckets_coalesced")):
            raise UCPError(f"{rank_dir / OPTIM_FILE} is not in the coalesced-bucket format of "
                           "megatron-core >= 0.7; load and re-save it with a newer Megatron-LM")
    return _RankFiles(rank_dir, model, optim)


_LAYOUT_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                "virtual_pipeline_model_parallel_size", "expert_model_parallel_size",
                "context_parallel_size", "world_size", "num_layers", "hidden_size", "num_experts")


def _check_same_run(files: _RankFiles, args, first: Path) -> None:
    """Every rank file must come from the run whose args we rebuild (same sizes)."""
    other = files.model.get("args")
    diff = [k for k in _LAYOUT_ARGS if getattr(other, k, None) != getattr(args, k, None)]
    if other is None or diff:
        raise UCPError(f"{files.path / MODEL_FILE}: its args differ from {first} in "
                       f"{diff or ['(no args)']}; the rank directories come from different runs: "
                       "restore this directory from the same save")


# ----------------------------------------------------------------------------------------------
# the source layout, rebuilt with megatron-core's own code


def _check_supported(args, where: Path) -> None:
    problems = []
    if getattr(args, "use_legacy_models", False):
        problems.append("--use-legacy-models (megatron.legacy GPT) is not a megatron-core model")
    if getattr(args, "transformer_impl", "local") != "local":
        problems.append(f"--transformer-impl {args.transformer_impl}: rebuilding TransformerEngine "
                        "layers needs TransformerEngine, which megatron-ucp does not use")
    for flag in ("spec", "yaml_cfg", "heterogeneous_layers_config_path", "mtp_num_layers",
                 "experimental_attention_variant"):
        if getattr(args, flag, None):
            problems.append(f"--{flag.replace('_', '-')} is set")
    if not getattr(args, "use_distributed_optimizer", False):
        problems.append("the run did not use --use-distributed-optimizer (no distrib_optim.pt)")
    if getattr(args, "num_distributed_optimizer_instances", 1) != 1:
        problems.append("--num-distributed-optimizer-instances > 1")
    if getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False):
        problems.append("FSDP runs are not DDP + distributed optimizer")
    if _world(args) != _layout(args).world_size:
        problems.append(f"world_size {_world(args)} != TPxPPxDPxCP {_layout(args).world_size}")
    if problems:
        raise UCPError(f"{where}: cannot import this Megatron-LM checkpoint: " + "; ".join(problems))


def _dir_name(tp: int, pp: int, ep: int, args) -> str:
    """Megatron-LM's get_checkpoint_name: mp_rank_TT, then _PPP if PP > 1, then _EEE if EP > 1."""
    name = f"mp_rank_{tp:02d}"
    if args.pipeline_model_parallel_size > 1:
        name += f"_{pp:03d}"
    if getattr(args, "expert_model_parallel_size", 1) > 1:
        name += f"_{ep:03d}"
    return name


def _writer_ranks(args) -> dict[str, int]:
    """Rank directory -> the global rank that wrote it (expert-data-parallel rank 0).

    Uses megatron-core's RankGenerator with the sizes initialize_model_parallel derives, so rank
    orders other than the default are handled the way the saving run handled them.
    """
    from megatron.core.parallel_state import RankGenerator

    lay, world = _layout(args), _world(args)
    etp = getattr(args, "expert_tensor_parallel_size", None) or lay.tp
    dense = RankGenerator(tp=lay.tp, ep=1, dp=lay.dp, pp=lay.pp, cp=lay.cp, order=_order(args))
    expert = RankGenerator(tp=etp, ep=lay.ep, dp=world // (etp * lay.ep * lay.pp), pp=lay.pp, cp=1,
                           order=_order(args))

    def position(gen, token: str) -> dict[int, int]:
        return {r: i for group in gen.get_ranks(token) for i, r in enumerate(group)}

    tp, pp = position(dense, "tp"), position(dense, "pp")
    ep, edp = position(expert, "ep"), position(expert, "dp")
    out: dict[str, int] = {}
    for r in range(world):
        if edp[r] == 0:
            out.setdefault(_dir_name(tp[r], pp[r], ep[r], args), r)
    return out


@contextlib.contextmanager
def _source_rank(args, rank: int, name: str) -> Iterator[None]:
    """`megatron_rebuild.source_rank`, checking that global rank `rank` is the writer of rank
    directory `name` (its expert-data-parallel rank 0), so the files read match the rebuilt rank."""
    from megatron.core import parallel_state as ps

    with source_rank(args, rank):
        here = _dir_name(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                         ps.get_expert_model_parallel_rank(), args)
        if here != name or ps.get_expert_data_parallel_rank() != 0:
            raise UCPError(f"internal: global rank {rank} is {here}, not the writer of {name}")
        yield


def _optimizer_buffers(chunks: list, args) -> list[list]:
    """The buffers of each chained optimizer in the order the legacy save lists them
    (megatron.core.optimizer.get_megatron_optimizer: dense optimizer(s) over all chunks, the first
    chunk alone when overlapping param gather with the optimizer step, then the expert optimizer)."""
    if getattr(args, "overlap_param_gather_with_optimizer_step", False):
        groups = [chunks[:1], chunks[1:]]
    else:
        groups = [chunks]
    out = [[b for c in group for b in c.buffers] for group in groups]
    expert = [b for c in chunks for b in c.expert_parallel_buffers]
    if expert:
        out.append(expert)
    return out


def _flat_offsets(buffer) -> dict:
    """param -> start in the legacy flat tensor of `buffer`. get_parameter_state_dp_zero writes
    bucket after bucket, each without its end padding: bucket b starts at the sum of the earlier
    buckets' numel_unpadded; inside it a param keeps its DDP offset from the bucket start."""
    starts = [0]
    for bucket in buffer.buckets:
        starts.append(starts[-1] + bucket.numel_unpadded)
    return {p: start - buffer.buckets[b].offset + starts[b]
            for p, (start, _end, b) in buffer.param_index_map.items()}


def _collect(chunks: list, files: _RankFiles, args, copies: dict[str, list[_Copy]],
             specs: dict[str, ParamSpec]) -> None:
    """Every parameter of this rank: its spec, pieces, model weight and optimizer slices."""
    from megatron.core.utils import unwrap_model

    from megatron_ucp.param_spec import local_params

    model_file, optim_file = files.path / MODEL_FILE, files.path / OPTIM_FILE
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    state_dicts = []
    for key, chunk in zip(keys, chunks):
        saved = files.model.get(key)
        if saved is None:
            raise UCPError(f"{model_file} has no {key!r} entry; expected {keys} for {len(chunks)} "
                           f"model chunk(s) per rank (VPP {_layout(args).vpp})")
        ours = set(unwrap_model(chunk).state_dict())
        if ours != set(saved):
            raise UCPError(f"{model_file} [{key}]: the model rebuilt from its args does not have "
                           f"the saved modules (saved only: {sorted(set(saved) - ours)[:5]}, rebuilt "
                           f"only: {sorted(ours - set(saved))[:5]}); the args do not describe this "
                           "checkpoint or it uses a layer spec megatron-ucp cannot rebuild")
        state_dicts.append(saved)

    buffers = _optimizer_buffers(chunks, args)
    if len(buffers) != len(files.optim):
        raise UCPError(f"{optim_file} holds {len(files.optim)} optimizer entries, but the model "
                       f"rebuilt from args has {len(buffers)} (dense/expert); the args do not match")
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
                               f"has {got}; the args do not describe this checkpoint")
            for p, start in _flat_offsets(buf).items():
                where[p] = (i, flat, start)

    steps = [_group_step(opt, files.path / MODEL_FILE, i)
             for i, opt in enumerate(_as_list(files.model["optimizer"]))]
    for lp in local_params(chunks):
        weight = state_dicts[lp.chunk].get(lp.local_name)
        if not torch.is_tensor(weight) or weight.shape != lp.param.shape:
            raise UCPError(f"{model_file} [{keys[lp.chunk]}] {lp.local_name}: saved "
                           f"{tuple(weight.shape) if torch.is_tensor(weight) else weight}, rebuilt "
                           f"model has shape {tuple(lp.param.shape)}; the args do not describe this "
                           "checkpoint")
        weight = lp.region(weight)
        states, step = None, None
        if lp.spec.buffer:  # a persistent buffer (MoE expert_bias): its value, no optimizer state
            states, step = {"param": weight.float()}, 0.0
        elif lp.param in where:
            i, flat, start = where[lp.param]
            n = lp.param.numel()
            if start + n > flat["param"].numel():
                raise UCPError(f"{optim_file}: {lp.local_name} would end at element {start + n} of "
                               f"{flat['param'].numel()}; the args do not describe this checkpoint")
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


def _as_list(x) -> list:
    return x if isinstance(x, list) else [x]


def _group_step(opt: dict | None, where: Path, i: int) -> float | None:
    """The Adam step of one chained optimizer: its param groups' 'step' (one value for all)."""
    if opt is None:
        return None
    groups = opt.get("optimizer", {}).get("param_groups", [])
    steps = {float(g["step"]) for g in groups if "step" in g}
    if len(steps) > 1:
        raise UCPError(f"{where}: optimizer {i} param groups have different Adam steps {sorted(steps)}"
                       "; megatron-ucp keeps one step per parameter and cannot tell which is whose")
    return steps.pop() if steps else None


# ----------------------------------------------------------------------------------------------
# assembly


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


# ----------------------------------------------------------------------------------------------
# JSON


def _jsonable_tree(x):
    if isinstance(x, dict):
        return {str(k): _jsonable_tree(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable_tree(v) for v in x]
    if torch.is_tensor(x):
        return x.item() if x.numel() == 1 else x.tolist()
    if isinstance(x, (bool, int, float, str)) or x is None:
        return x
    return str(x)


def _optimizer_json(saved) -> dict:
    """Hyper-parameters of every param group of every chained optimizer (the step is per param)."""
    groups, scaler = [], None
    for i, opt in enumerate(_as_list(saved)):
        if opt is None:
            continue
        for g in opt.get("optimizer", {}).get("param_groups", []):
            entry = {"optimizer": i}
            for k, v in g.items():
                v = _jsonable_tree(v)
                if k not in ("params", "step") and v is not None:
                    entry[k] = v
            groups.append(entry)
        if scaler is None and opt.get("grad_scaler"):
            scaler = _jsonable_tree(opt["grad_scaler"])
    return {"param_groups": groups, "grad_scaler": scaler}


# ----------------------------------------------------------------------------------------------
# universal -> legacy (the writer)


def target_args(template, target: Layout, first_stage_layers: int | None = None,
                last_stage_layers: int | None = None, consumed_samples: int | None = None):
    """A copy of the template `args` (e.g. the source legacy checkpoint's) describing the same
    model trained at `target`: every layout-dependent setting is set to the target, the uneven
    pipeline split is reset unless given, the padded vocabulary is rounded up to the target's
    multiple (make_vocab_size_divisible_by x TP) as Megatron-LM pads it at start-up."""
    a = argparse.Namespace(**vars(template))
    vpp = target.vpp or None
    a.tensor_model_parallel_size = target.tp
    a.pipeline_model_parallel_size = target.pp
    a.transformer_pipeline_model_parallel_size = target.pp
    a.context_parallel_size = target.cp
    a.expert_model_parallel_size = target.ep
    if getattr(template, "expert_tensor_parallel_size", None) in (None, template.tensor_model_parallel_size):
        a.expert_tensor_parallel_size = target.tp
    a.data_parallel_size = target.dp
    a.world_size = target.world_size
    a.virtual_pipeline_model_parallel_size = vpp
    if getattr(template, "num_virtual_stages_per_pipeline_rank", None):
        a.num_virtual_stages_per_pipeline_rank, a.num_layers_per_virtual_pipeline_stage = vpp, None
    else:
        a.num_virtual_stages_per_pipeline_rank = None
        a.num_layers_per_virtual_pipeline_stage = a.num_layers // (target.pp * vpp) if vpp else None
    a.decoder_first_pipeline_num_layers = first_stage_layers
    a.decoder_last_pipeline_num_layers = last_stage_layers
    pp_layout = getattr(a, "pipeline_model_parallel_layout", None)
    if pp_layout and target.pp != template.pipeline_model_parallel_size:
        raise UCPError("the template args set --pipeline-model-parallel-layout for PP "
                       f"{template.pipeline_model_parallel_size}; it cannot describe PP {target.pp}: "
                       "pass args without it")
    if target.tp == 1:
        a.sequence_parallel = False
    multiple = getattr(a, "make_vocab_size_divisible_by", 128) * target.tp
    a.padded_vocab_size = -(-a.padded_vocab_size // multiple) * multiple
    if consumed_samples is not None:
        a.consumed_train_samples = consumed_samples
    return a


@dataclass
class _TargetRank:
    """What one target rank directory needs, read off the model rebuilt at the target layout."""

    name: str
    keys: list[list[tuple[str, Any]]]  # per chunk: (state-dict key, non-tensor value or _TENSOR)
    params: list  # LocalParam
    flat: list[dict[int, tuple[tuple, int]] | None]  # per optimizer: buffer -> (dtypes, numel)
    where: dict[int, tuple[int, int, int]]  # id(param) -> (optimizer, buffer, start)


_TENSOR = object()


def _inspect_target(chunks: list, args, name: str) -> _TargetRank:
    from megatron.core import parallel_state as ps
    from megatron.core.utils import unwrap_model

    from megatron_ucp.param_spec import local_params

    keys = [[(k, _TENSOR if torch.is_tensor(v) else v)
             for k, v in unwrap_model(c).state_dict(keep_vars=True).items()] for c in chunks]
    buffers = _optimizer_buffers(chunks, args)
    expert = any(c.expert_parallel_buffers for c in chunks)
    flat, where = [], {}
    for i, bufs in enumerate(buffers):
        is_expert = expert and i == len(buffers) - 1
        dp0 = (ps.get_expert_data_parallel_rank() if is_expert else ps.get_data_parallel_rank()) == 0
        flat.append({b: ((buf.param_dtype, buf.grad_dtype), buf.numel_unpadded)
                     for b, buf in enumerate(bufs)} if dp0 else None)
        for b, buf in enumerate(bufs):
            for p, start in _flat_offsets(buf).items():
                where[id(p)] = (i, b, start)
    return _TargetRank(name, keys, local_params(chunks), flat, where)


def _target_files(t: _TargetRank, source, model_keys: list[str]) -> tuple[list[dict], Any]:
    """(model state dict per chunk, distrib_optim.pt object) of one target rank directory."""
    from megatron_ucp.loader import read_local

    saved = source.manifest["params"]
    by_name: dict[tuple[int, str], Any] = {}
    flats: list[dict | None] = [
        None if f is None else {b: {**{s: torch.zeros(n, dtype=torch.float32) for s in STATES},
                                    "numel_unpadded": n} for b, (_, n) in f.items()}
        for f in t.flat]
    for lp in t.params:
        if lp.spec.name not in saved:
            raise UCPError(f"{source.dir}: the model rebuilt at the target layout has parameter "
                           f"{lp.spec.name} ({lp.local_name}) that the checkpoint lacks; the args "
                           "template does not describe this checkpoint's model")
        master = read_local(source, lp, "param", 0, lp.numel)
        if (lp.chunk, lp.local_name) not in by_name:  # a fused expert weight has several regions
            by_name[(lp.chunk, lp.local_name)] = torch.empty_like(lp.param, device="cpu")
        lp.region(by_name[(lp.chunk, lp.local_name)]).copy_(master)
        if lp.spec.buffer:
            continue
        if id(lp.param) not in t.where:
            raise UCPError(f"internal: {lp.local_name} is in no DDP buffer of the target model")
        i, b, start = t.where[id(lp.param)]
        if flats[i] is None:
            continue  # another rank directory (that optimizer's DP rank 0) holds its state
        a, e = start + lp.base, start + lp.base + lp.numel
        entry = flats[i][b]
        entry["param"][a:e] = master
        for s in STATES[1:]:
            entry[s][a:e] = read_local(source, lp, s, 0, lp.numel)
    models = []
    for c, keys in enumerate(t.keys):
        sd = collections.OrderedDict()
        for k, v in keys:
            if v is _TENSOR:
                if (c, k) not in by_name:
                    raise UCPError(f"{model_keys[c]} {k}: a tensor of the model rebuilt at the "
                                   "target that is neither a parameter nor a declared buffer; "
                                   "megatron-ucp cannot fill it")
                v = by_name[(c, k)]
            sd[k] = v
        models.append(sd)
    optim = []
    for f, entries in zip(t.flat, flats):
        optim.append(None if entries is None else {"buckets_coalesced": True, **{
            b: {f[b][0]: e} for b, e in entries.items()}})
    return models, (optim[0] if len(optim) == 1 else optim)


def _param_groups(source, n_optimizers: int) -> Any:
    """`model_optim_rng.pt['optimizer']`: per chained optimizer {'optimizer': {'param_groups'}}
    with the manifest's hyper-parameters and the Adam step (a float) in every group."""
    manifest = source.manifest
    steps = {source.step(n) for n, p in manifest["params"].items() if not p.get("buffer")}
    if len(steps) != 1:
        raise UCPError(f"the universal checkpoint has parameters at different Adam steps "
                       f"{sorted(steps)}; a Megatron-LM legacy checkpoint keeps one step per "
                       "param group and cannot hold them")
    step = float(steps.pop())
    opt = manifest.get("optimizer", {})
    out = []
    for i in range(n_optimizers):
        groups = []
        for g in opt.get("param_groups", []):
            if g.get("optimizer", 0) != i:
                continue
            groups.append(_torch_group(g, step))
        if not groups:
            raise UCPError(f"the universal manifest has no param groups for optimizer {i} (the "
                           f"target model has {n_optimizers} chained optimizers: dense/expert); "
                           "it was not converted from a Megatron-LM run with the same optimizer")
        entry: dict = {"optimizer": {"param_groups": groups}}
        if opt.get("grad_scaler"):  # fp16 DynamicGradScaler.state_dict(): 'scale' is a tensor
            entry["grad_scaler"] = {k: (torch.tensor(v, dtype=torch.float32) if k == "scale" else v)
                                    for k, v in opt["grad_scaler"].items()}
        out.append(entry)
    return out[0] if n_optimizers == 1 else out


# Megatron's param-group keys (megatron.core.optimizer._get_param_groups), in its order
_MEGATRON_GROUP_KEYS = ("is_expert_parallel", "default_config", "wd_mult", "lr_mult",
                        "is_decoupled_lr", "max_lr", "min_lr")


def _torch_group(g: dict, step: float) -> dict:
    """A param group as DistributedOptimizer.state_dict() writes it from a manifest entry: the
    manifest (JSON) drops None values and turns tuples into lists; torch AdamW's defaults that
    the import dropped (foreach=None, fused=None) come back; keys in Megatron's then torch's order,
    the step (a float) last."""
    g = {k: (tuple(v) if k == "betas" and isinstance(v, list) else v)
         for k, v in g.items() if k != "optimizer"}
    defaults: dict = {}
    if "decoupled_weight_decay" in g or "amsgrad" in g:  # torch.optim.Adam/AdamW
        defaults = torch.optim.AdamW([torch.zeros(1, device="cpu")]).defaults
        g = {**{k: v for k, v in defaults.items() if v is None and k not in g}, **g}
    order = [k for k in _MEGATRON_GROUP_KEYS if k in g] + [k for k in defaults if k in g]
    order += [k for k in g if k not in order]
    return {**{k: g[k] for k in order}, "step": step}


# OptimizerParamScheduler.state_dict() key order (megatron-core 0.16)
_SCHEDULER_KEYS = ("max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style", "lr_decay_steps",
                   "min_lr", "start_wd", "end_wd", "wd_incr_style", "wd_incr_steps")


def _scheduler(saved: dict | None) -> dict | None:
    if not saved:
        return saved
    order = [k for k in _SCHEDULER_KEYS if k in saved] + [k for k in saved if k not in _SCHEDULER_KEYS]
    return {k: saved[k] for k in order}


def prepare_export(fmt: str, universal_dir: str | Path, save_dir: str | Path, target: Layout,
                   args_template, first_stage_layers: int | None, last_stage_layers: int | None):
    """Checks and inputs shared by the Megatron-LM writers: no live process group (the target is
    rebuilt on a private fake one), args to describe the run, a new output directory, a target
    layout that can hold the model. Returns (universal source, target args, output path)."""
    from megatron_ucp.sources import open_source
    from megatron_ucp.validation import check_layout

    if dist.is_available() and dist.is_initialized():
        raise UCPError(f"writing Megatron-LM {fmt} rebuilds the target layout on its own fake "
                       "process group and cannot run inside a job that already has one; run it in "
                       "a separate process")
    if args_template is None:
        raise UCPError(f"writing a Megatron-LM {fmt} checkpoint needs Megatron-LM args (model "
                       "architecture, optimizer and run settings); pass the args of a Megatron-LM "
                       "checkpoint of this model")
    out = Path(save_dir)
    if out.exists() and any(out.iterdir()):
        raise UCPError(f"{out} exists and is not empty; choose a new directory")
    source = open_source(universal_dir)
    manifest = source.manifest
    args = target_args(args_template, target, first_stage_layers, last_stage_layers,
                       manifest.get("extra", {}).get("consumed_samples"))
    _check_supported(args, Path("args template"))
    check_layout({**manifest["model"], "num_layers_in_first_pipeline_stage": first_stage_layers,
                  "num_layers_in_last_pipeline_stage": last_stage_layers}, target, str(source.dir))
    return source, args, out


def write_legacy(universal_dir: str | Path, save_dir: str | Path, target: Layout, args_template,
                 *, rng_state: dict[str, list] | list | None = None,
                 num_floating_point_operations_so_far: float | None = None,
                 first_stage_layers: int | None = None, last_stage_layers: int | None = None,
                 progress: bool = True) -> Path:
    """Write a stock Megatron-LM `--ckpt-format torch` checkpoint (distributed optimizer) at
    `target` from a universal (or fragment) directory. Returns `save_dir` (the save root).

    args_template: a Megatron-LM args Namespace of the same model (e.g. the source legacy
    checkpoint's `args`); its parallel sizes are replaced by the target's (`target_args`).
    rng_state: the `rng_state` list written in every rank directory, or rank directory name ->
    list (a name not in it gets the first entry); None: no `rng_state` key (resume with
    --no-load-rng). num_floating_point_operations_so_far: None writes 0.0.
    The target model, its DDP buffers and their rank directories are rebuilt with megatron-core's
    own code (fake process group, meta tensors), so flat offsets are the ones the target run uses.
    """
    t0 = time.perf_counter()
    source, args, out = prepare_export("legacy", universal_dir, save_dir, target, args_template,
                                       first_stage_layers, last_stage_layers)
    manifest = source.manifest
    iteration = int(manifest["iteration"])
    writers = _writer_ranks(args)

    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    iter_dir = partial / f"iter_{iteration:07d}"
    iter_dir.mkdir(parents=True)
    bar = tqdm(sorted(writers.items(), key=lambda kv: kv[1]), desc="export-legacy", unit="rank",
               disable=not progress)
    try:
        for name, rank in bar:
            with _source_rank(args, rank, name):
                try:
                    chunks = wrap_ddp(build_chunks(args), args)
                except UCPError:
                    raise
                except Exception as e:
                    raise UCPError(f"cannot build the model at {target} from the args template "
                                   f"({type(e).__name__}: {e}); an uneven pipeline split needs "
                                   "first_stage_layers / last_stage_layers") from e
                t = _inspect_target(chunks, args, name)
            model_keys = ["model"] if len(t.keys) == 1 else [f"model{i}" for i in range(len(t.keys))]
            models, optim = _target_files(t, source, model_keys)
            rank_args = argparse.Namespace(**{**vars(args), "rank": rank, "local_rank": rank})
            state: dict = {"args": rank_args, "checkpoint_version": 3.0, "iteration": iteration}
            state.update(zip(model_keys, models))
            state["optimizer"] = _param_groups(source, len(t.flat))
            state["opt_param_scheduler"] = _scheduler(manifest.get("scheduler"))
            if rng_state is not None:
                rs = rng_state if isinstance(rng_state, list) else rng_state.get(
                    name, next(iter(rng_state.values())))
                state["rng_state"] = rs
            state["num_floating_point_operations_so_far"] = float(
                num_floating_point_operations_so_far or 0.0)
            rank_dir = iter_dir / name
            rank_dir.mkdir()
            torch.save(state, rank_dir / MODEL_FILE)
            torch.save(optim, rank_dir / OPTIM_FILE)
            fsync_dir(rank_dir)
        (partial / TRACKER).write_text(str(iteration))
        fsync_dir(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        bar.close()
    if out.exists():
        out.rmdir()
    partial.rename(out)
    if progress:
        print(f"[megatron-ucp] wrote Megatron-LM legacy iteration {iteration} at {target} "
              f"({len(writers)} rank dirs) into {out} in {time.perf_counter() - t0:.2f}s")
    return out


def legacy_source_fields(load_dir: str | Path) -> dict:
    """From a legacy checkpoint: its args, every rank directory's rng_state, its layout and flops
    (what `write_legacy` takes from the source when resharding legacy -> legacy)."""
    iter_dir, _ = _resolve(Path(load_dir))
    found = sorted(p for p in iter_dir.iterdir() if p.is_dir() and _RANK_DIR.fullmatch(p.name))
    if not found:
        raise UCPError(f"{iter_dir} holds no mp_rank_* directories")
    args = _read_args(found[0] / MODEL_FILE, found)
    rng, flops = {}, None
    writers = _writer_ranks(args)
    for name in sorted(writers, key=writers.get):
        if (iter_dir / name / MODEL_FILE).exists():
            m = _torch_load(iter_dir / name / MODEL_FILE)
            if "rng_state" in m:
                rng[name] = m["rng_state"]
            if flops is None:
                flops = m.get("num_floating_point_operations_so_far")
    return {"args": args, "rng_state": rng or None, "layout": _layout(args),
            "num_floating_point_operations_so_far": flops}
