"""Megatron-LM `--ckpt-format torch_dist` -> universal directory, offline, no real process group.

Why this exists: a torch_dist checkpoint is readable only by a run with the same optimizer sharding
machinery; its `dp_reshardable` optimizer state is a raw copy of each model-parallel rank's flat
DistributedOptimizer buffer, so nothing outside megatron-core knows where a parameter lives in it.
We therefore ask megatron-core itself rather than re-implementing its rules:

* names, shapes, TP split axis, SwiGLU blocks and vocab rows come from
  `param_spec.local_params` on a GPT model rebuilt from the checkpoint's `args` at TP1 (a one-rank
  fake process group, meta tensors; see `megatron_ucp.megatron_rebuild`);
* for `dp_reshardable`, each parameter's offset in the flat buffer comes from megatron-core's own
  `DistributedDataParallel` (`buffer.param_index_map`) built at the *source* layout for the source
  model-parallel rank (fake process group of the source world size), and the TP-local slices are
  put back together with that rank's `local_params` pieces;
* `fully_reshardable` stores `optimizer.state.<state>.<model key>` at global shape: no layout math.

Every master weight is checked against the stored model weight (bf16(master) == model tensor, bit
for bit), so a wrong offset can never produce a silently wrong universal checkpoint.

Only tensors that are needed are read (`torch.distributed.checkpoint.load(..., no_dist=True)`
with a template of just those keys); at most a few stacked tensors / flat buckets are in memory.
"""

from __future__ import annotations

import dataclasses
import io
import math
import shutil
import time
from collections import OrderedDict
from pathlib import Path

import torch

from megatron_ucp.errors import UCPError
from megatron_ucp.megatron_rebuild import (
    build_chunks,
    model_config,
    single_rank_args,
    source_rank,
    wrap_ddp,
)
from megatron_ucp.optimizer_state import _jsonable

TRACKER = "latest_checkpointed_iteration.txt"
STATES = ("param", "exp_avg", "exp_avg_sq")


# --------------------------------------------------------------------------------------------
# Reading the torch_dist directory


def resolve_iter_dir(load_dir: str | Path) -> Path:
    """A torch_dist iteration directory, or a Megatron `--save` root whose tracker names one."""
    path = Path(load_dir)
    if (path / ".metadata").exists():
        return path
    tracker = path / TRACKER
    if tracker.exists():
        text = tracker.read_text().strip()
        name = "release" if text == "release" else f"iter_{int(text):07d}"
        target = path / name
        if not (target / ".metadata").exists():
            why = "does not exist" if not target.exists() else "has no .metadata (not torch_dist?)"
            raise UCPError(f"{tracker} says {text!r} but {target} {why}; pass an iter_XXXXXXX "
                           "directory of a --ckpt-format torch_dist save")
        return target
    if not path.exists():
        raise UCPError(f"{path} does not exist; pass a Megatron --save directory (with {TRACKER}) "
                       "or one of its iter_XXXXXXX directories")
    raise UCPError(f"{path} is not a torch_dist checkpoint: no .metadata and no {TRACKER}; legacy "
                   "--ckpt-format torch directories (mp_rank_XX) are not handled by this command")


class DistReader:
    """Loads single keys of a torch_dist checkpoint without a process group, with a small cache.

    Why a cache: universal parameters are per layer, but torch_dist stores all layers in one
    stacked tensor (and the dp_reshardable optimizer in one flat bucket per rank), so consecutive
    parameters hit the same stored tensor.
    """

    def __init__(self, ckpt_dir: Path, cache_entries: int = 8):
        from torch.distributed.checkpoint import FileSystemReader

        self.dir = ckpt_dir
        try:
            self.metadata = FileSystemReader(str(ckpt_dir)).read_metadata()
        except Exception as e:  # noqa: BLE001 - any unreadable .metadata is the same user error
            raise UCPError(f"{ckpt_dir / '.metadata'}: cannot read torch_dist metadata ({e})") from e
        self.meta = self.metadata.state_dict_metadata
        files = sorted({s.relative_path for s in self.metadata.storage_data.values()})
        missing = [f for f in files if not (ckpt_dir / f).exists()]
        if missing:
            raise UCPError(f"{ckpt_dir}: data file(s) {', '.join(missing)} listed in .metadata are "
                           "missing; the checkpoint is incomplete (copy them back or use another "
                           "iteration)")
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.cache_entries = cache_entries
        self.bytes_read = 0

    def tensor_keys(self) -> list[str]:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        return [k for k, v in self.meta.items() if isinstance(v, TensorStorageMetadata)]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.meta[key].size)

    def tensor(self, key: str) -> torch.Tensor:
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        if key not in self.meta:
            raise UCPError(f"{self.dir}: tensor {key!r} is not in the checkpoint")
        m = self.meta[key]
        t = torch.empty(tuple(m.size), dtype=m.properties.dtype)
        self._load({key: t})
        self.bytes_read += t.numel() * t.element_size()
        self.cache[key] = t
        while len(self.cache) > self.cache_entries:
            self.cache.popitem(last=False)
        return t

    def obj(self, key: str):
        if key not in self.meta:
            raise UCPError(f"{self.dir}: object {key!r} is not in the checkpoint")
        sd = {key: io.BytesIO()}
        self._load(sd)
        return sd[key]

    def _load(self, sd: dict) -> None:
        import torch.distributed.checkpoint as dcp

        try:
            dcp.load(sd, checkpoint_id=str(self.dir), no_dist=True)
        except Exception as e:  # noqa: BLE001 - report which key and directory failed
            raise UCPError(f"{self.dir}: cannot read {list(sd)} ({type(e).__name__}: {e}); the "
                           "checkpoint files are damaged or incomplete") from e


# --------------------------------------------------------------------------------------------
# Matching the model rebuilt from args (megatron_ucp.megatron_rebuild) to torch_dist keys


def _storage_keys(model) -> dict[int, tuple[str, tuple[int, ...]]]:
    """id(param) -> (torch_dist key, indices along its stacked axes), from sharded_state_dict."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.utils import unwrap_model

    out = {}
    for entry in unwrap_model(model).sharded_state_dict().values():
        if isinstance(entry, ShardedTensorFactory):
            first = entry.build()
            while isinstance(first, (dict, list, tuple)):
                first = next(iter(first.values())) if isinstance(first, dict) else first[0]
        elif isinstance(entry, ShardedTensor):
            first = entry
        else:
            continue
        p = first.prepend_axis_num
        out[id(entry.data)] = (first.key, tuple(first.global_offset[:p]))
    return out


# --------------------------------------------------------------------------------------------
# Conversion


@dataclasses.dataclass
class _Param:
    """Where one universal parameter lives in the torch_dist checkpoint."""

    spec: dict
    key: str  # torch_dist model key (stacked)
    index: tuple[int, ...]  # position along the stacked axes
    # dp_reshardable: (flat-bucket key prefix, start in that bucket, numel, pieces)
    slabs: list = dataclasses.field(default_factory=list)


def _layout(args) -> dict:
    """The saving run's parallel layout (manifest `layout`), from Megatron-LM args."""
    return {"tp": int(args.tensor_model_parallel_size), "pp": int(args.pipeline_model_parallel_size),
            "dp": int(getattr(args, "data_parallel_size", 1)),
            "vpp": getattr(args, "virtual_pipeline_model_parallel_size", None),
            "cp": int(getattr(args, "context_parallel_size", 1) or 1),
            "ep": int(getattr(args, "expert_model_parallel_size", 1) or 1)}


def _param_groups(groups: list[dict]) -> tuple[list[dict], float]:
    """JSON hyper-parameters (manifest format) and the one Adam step they share."""
    steps = {float(g["step"]) for g in groups if g.get("step") is not None}
    if len(steps) != 1:
        raise UCPError(f"optimizer param groups carry steps {sorted(steps)}; expected exactly one "
                       "common Adam step (megatron's DistributedOptimizer keeps one per group)")
    # the step is per parameter in the manifest (as the legacy importer writes it), not per group
    out = [{"optimizer": 0, **{k: _jsonable(v) for k, v in g.items()
                               if k not in ("params", "step") and _jsonable(v) is not None}}
           for g in groups]
    return out, steps.pop()


def _plan_model(args) -> tuple[dict[str, _Param], dict]:
    """Universal params (in storage-key order) and the model config, from the run's model rebuilt
    whole on one rank (TP1/PP1, world 1, rank 0)."""
    from megatron_ucp.param_spec import local_params

    one = single_rank_args(args)
    with source_rank(one, 0):
        model = build_chunks(one)[0]
        keys = _storage_keys(model)
        plan = {}
        for lp in local_params([model]):
            if id(lp.param) not in keys:
                raise UCPError(f"parameter {lp.local_name!r} has no sharded_state_dict key")
            key, index = keys[id(lp.param)]
            plan[lp.spec.name] = _Param(lp.spec.to_json(), key, (*index, *lp.stack_index))
        cfg = model_config([model], args)
        del model
    plan = dict(sorted(plan.items(), key=lambda kv: (kv[1].key, kv[1].index)))
    return plan, cfg


def _check_names(reader: DistReader, plan: dict[str, _Param], sharding: str) -> None:
    """Every universal name has its tensor in the checkpoint and every checkpoint tensor is used."""
    stored = {k: reader.shape(k) for k in reader.tensor_keys() if not k.startswith("optimizer.")}
    used: dict[str, set] = {}
    for name, p in plan.items():
        if p.key not in stored:
            raise UCPError(f"{reader.dir}: the model built from the checkpoint's args has parameter "
                           f"{name!r} (torch_dist key {p.key!r}) but the checkpoint has no such "
                           "tensor; the args do not describe this checkpoint")
        want = (*[i + 1 for i in p.index], *p.spec["shape"])
        have = stored[p.key]
        if len(have) != len(want) or tuple(have[len(p.index):]) != tuple(p.spec["shape"]) or any(
                i >= n for i, n in zip(p.index, have)):
            raise UCPError(f"{reader.dir}: tensor {p.key!r} has shape {list(have)} but parameter "
                           f"{name!r} needs index {list(p.index)} of shape {p.spec['shape']}")
        used.setdefault(p.key, set()).add(p.index)
        if sharding == "fully_reshardable":
            for s in STATES:
                k = f"optimizer.state.{s}.{p.key}"
                if k not in reader.meta:
                    raise UCPError(f"{reader.dir}: optimizer state {k!r} for parameter {name!r} "
                                   "is missing")
    for key, shape in stored.items():
        if key not in used:
            raise UCPError(f"{reader.dir}: checkpoint tensor {key!r} {list(shape)} is not a parameter "
                           "of the model built from its args (an unsupported module or buffer?)")
        stacked = len(next(iter(used[key])))
        if len(used[key]) != math.prod(shape[:stacked]):
            raise UCPError(f"{reader.dir}: checkpoint tensor {key!r} {list(shape)} has "
                           f"{math.prod(shape[:stacked])} stacked entries but the model uses "
                           f"{len(used[key])}; num_layers in args does not match the tensors")


def _check_optimizer_keys(reader: DistReader, plan: dict[str, _Param], sharding: str) -> None:
    """Every stored optimizer tensor is accounted for: no state is silently dropped."""
    if sharding == "fully_reshardable":
        wanted = {f"optimizer.state.{s}.{p.key}" for p in plan.values() for s in STATES}
    else:
        wanted = {f"{slab[0]}.{s}" for p in plan.values() for slab in p.slabs for s in STATES}
    extra = sorted(k for k in reader.tensor_keys() if k.startswith("optimizer.") and k not in wanted)
    if extra:
        raise UCPError(f"{reader.dir}: optimizer tensor(s) {extra[:3]}{' ...' if len(extra) > 3 else ''}"
                       f" ({len(extra)} in all) belong to no parameter of the model built from args")


def _plan_dp_reshardable(args, reader: DistReader, plan: dict[str, _Param]) -> None:
    """Attach each parameter's flat-buffer slabs, from megatron-core DDP at the source layout."""
    from megatron.core import parallel_state as ps

    from megatron_ucp.param_spec import local_params

    lay = _layout(args)
    if lay["vpp"] or lay["cp"] > 1 or lay["ep"] > 1 or getattr(args, "num_experts", None):
        raise UCPError("dp_reshardable torch_dist import supports TP/PP/DP layouts of dense GPT "
                       f"models only (got {lay}, num_experts={getattr(args, 'num_experts', None)})")
    if getattr(args, "transformer_impl", "local") != "local":
        raise UCPError(f"dp_reshardable flat buffers follow the parameter order of the layer spec; "
                       f"this checkpoint used transformer_impl={args.transformer_impl!r}, which "
                       "cannot be rebuilt here (TransformerEngine not installed)")
    tp, pp, dp = lay["tp"], lay["pp"], lay["dp"]
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            rank = tp_rank + tp * dp * pp_rank  # megatron's default order tp-cp-ep-dp-pp, dp rank 0
            with source_rank(args, rank):
                if (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                        ps.get_data_parallel_rank()) != (tp_rank, pp_rank, 0):
                    raise UCPError(f"rank {rank} is not (tp {tp_rank}, pp {pp_rank}, dp 0) in "
                                   "megatron's rank order; unsupported rank order")
                mp_rank = ps.get_model_parallel_group().rank()
                ddp = wrap_ddp(build_chunks(args), args)[0]
                lps = {id(lp.param): lp for lp in local_params([ddp])}
                for g, buf in enumerate(ddp.buffers):
                    prefix = (f"optimizer.distributed.dp_group_idx_{mp_rank}.gbuf_idx_{g}."
                              f"dtype_({buf.param_dtype}, {buf.grad_dtype})")
                    for param, (start, _end, b) in buf.param_index_map.items():
                        lp = lps[id(param)]
                        if not lp.canonical:
                            continue
                        bucket_key = f"{prefix}.bucket_idx_{b}"
                        local_start = start - buf.buckets[b].offset
                        if f"{bucket_key}.param" not in reader.meta:
                            raise UCPError(f"{reader.dir}: flat optimizer buffer "
                                           f"{bucket_key + '.param'!r} (model-parallel rank {mp_rank}) "
                                           "is missing")
                        size = reader.shape(f"{bucket_key}.param")[0]
                        if local_start + param.numel() > size:
                            raise UCPError(f"{reader.dir}: {bucket_key!r} has {size} elements but "
                                           f"{lp.spec.name!r} ends at {local_start + param.numel()}")
                        if lp.spec.name not in plan:
                            raise UCPError(f"parameter {lp.spec.name!r} at TP {tp_rank} PP {pp_rank} "
                                           "is not in the TP1 model")
                        plan[lp.spec.name].slabs.append(
                            (bucket_key, local_start + lp.base, lp.numel, lp.pieces))
                del ddp
    for name, p in plan.items():
        covered = sum(math.prod(pc.shape) for s in p.slabs for pc in s[3])
        if covered != math.prod(p.spec["shape"]):
            raise UCPError(f"parameter {name!r}: the flat buffers cover {covered} of "
                           f"{math.prod(p.spec['shape'])} elements; layout not understood")


def _read_full(reader: DistReader, p: _Param, state: str, sharding: str) -> torch.Tensor:
    """One full fp32 universal tensor; master weights are verified against the stored bf16 model."""
    if sharding == "fully_reshardable":
        t = reader.tensor(f"optimizer.state.{state}.{p.key}")[p.index].clone()
    else:
        t = torch.empty(p.spec["shape"], dtype=torch.float32)
        for bucket_key, start, numel, pieces in p.slabs:
            local = reader.tensor(f"{bucket_key}.{state}")[start:start + numel]
            for pc in pieces:
                t[pc.box] = pc.take(local)
    if t.dtype != torch.float32:
        raise UCPError(f"optimizer state {state} of {p.spec['name']!r} is {t.dtype}, expected float32")
    if state == "param":
        model = reader.tensor(p.key)[p.index]
        if not torch.equal(t.to(model.dtype), model):
            raise UCPError(f"{reader.dir}: master weight of {p.spec['name']!r} cast to {model.dtype} "
                           f"differs from the stored model tensor {p.key!r}{list(p.index)}; the "
                           "optimizer layout was not understood (refusing to write wrong state)")
    return t.contiguous()


def convert_torch_dist(load_dir: str | Path, universal_dir: str | Path, progress: bool = True,
                       max_file_bytes: int = 2**31, workers: int = 1) -> Path:
    """Convert a Megatron-LM torch_dist checkpoint into a universal directory; returns its path.

    `load_dir` is a `--save` root (with latest_checkpointed_iteration.txt) or an iter directory.
    Must run in a process without torch.distributed initialised (models are built on a fake group).
    """
    from tqdm import tqdm

    t0 = time.perf_counter()
    ckpt = resolve_iter_dir(load_dir)
    out = Path(universal_dir)
    if out.exists() and any(out.iterdir()):
        raise UCPError(f"{out} exists and is not empty; choose a new directory")
    reader = DistReader(ckpt)

    from megatron_ucp import manifest as mf
    from megatron_ucp.testing import cpu_shim  # noqa: F401  (must precede megatron.core)
    from megatron_ucp.universal import commit, write_params

    common_path = ckpt / "common.pt"
    if not common_path.exists():
        raise UCPError(f"{ckpt}: common.pt is missing; the checkpoint is incomplete")
    common = torch.load(common_path, map_location="cpu", weights_only=False)
    args = common.get("args")
    if args is None:
        raise UCPError(f"{common_path} has no 'args'; only Megatron-LM training saves are supported")
    opt = common.get("optimizer") or {}
    sharding = opt.get("param_state_sharding_type") or (common.get("content_metadata") or {}).get(
        "distrib_optim_sharding_type")
    if sharding not in ("dp_reshardable", "fully_reshardable"):
        raise UCPError(f"{ckpt}: optimizer sharding {sharding!r} is not supported (expected "
                       "dp_reshardable or fully_reshardable from --use-distributed-optimizer)")

    if getattr(args, "num_experts", None):
        raise UCPError(f"{ckpt}: a MoE run (num_experts={args.num_experts}); torch_dist import "
                       "supports dense GPT models only (its expert optimizer buffers are not mapped "
                       "yet): save the run with --ckpt-format torch and convert that")
    plan, model_cfg = _plan_model(args)
    _check_names(reader, plan, sharding)
    if sharding == "fully_reshardable":
        groups = opt.get("optimizer", {}).get("param_groups")
    else:
        lay = _layout(args)
        groups = None
        for k in range(lay["tp"] * lay["pp"]):  # one optimizer per model-parallel rank
            obj = reader.obj(f"optimizer.distributed.dp_group_idx_{k}.optimizer/shard_0_1")
            g = (obj[0] if isinstance(obj, list) else obj)["param_groups"]
            if groups is not None and _param_groups(g)[1] != _param_groups(groups)[1]:
                raise UCPError(f"{ckpt}: model-parallel rank {k} is at Adam step "
                               f"{_param_groups(g)[1]}, rank 0 at {_param_groups(groups)[1]}")
            groups = groups or g
        _plan_dp_reshardable(args, reader, plan)
    _check_optimizer_keys(reader, plan, sharding)
    if not groups:
        raise UCPError(f"{ckpt}: no optimizer param groups found (was it saved without optimizer?)")
    param_groups, step = _param_groups(groups)

    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    bar = tqdm(total=len(plan), desc="import torch_dist", unit="param", disable=not progress)
    specs = {n: p.spec for n, p in plan.items()}
    entries = write_params(partial, specs, lambda n, s: _read_full(reader, plan[n], s, sharding),
                           max_file_bytes, bar, workers)
    bar.close()
    lay = _layout(args)
    iteration = int(common.get("iteration", getattr(args, "iteration", 0)))
    manifest = {
        "format": mf.FORMAT, "version": mf.VERSION, "kind": "universal",
        "iteration": iteration, "layout": lay,
        "layout_world_size": lay["tp"] * lay["pp"] * lay["dp"] * lay["cp"],
        "model": model_cfg,
        "params": {n: {**spec, "step": step, "tensors": entries[n]} for n, spec in specs.items()},
        "optimizer": {"param_groups": param_groups, "grad_scaler": None},
        "scheduler": common.get("opt_param_scheduler"),
        "extra": {"consumed_samples": int(getattr(args, "consumed_train_samples", 0) or 0)},
        "seed": int(getattr(args, "seed", 1234)),
        "converted_from": {"kind": f"megatron-lm torch_dist ({sharding})", "path": str(ckpt)},
    }
    commit(partial, out, manifest)
    if progress:
        print(f"[megatron-ucp] {len(plan)} parameters from {ckpt} ({sharding}), "
              f"{reader.bytes_read / 2**20:.1f} MiB read, written to {out} in "
              f"{time.perf_counter() - t0:.2f}s")
    return out


# --------------------------------------------------------------------------------------------
# universal -> torch_dist (the writer)

# common.pt['content_metadata'] of a `--dist-ckpt-optim-fully-reshardable` save (megatron-core 0.16)
FULLY_RESHARDABLE_CONTENT = {"distrib_optim_sharding_type": "fully_reshardable",
                             "distrib_optim_fully_reshardable_mem_efficient": False,
                             "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                 "common_backend": "torch", "common_backend_version": 1}


def _sharded_objects(model) -> dict[str, object]:
    """unique key (e.g. `decoder.layers.mlp.linear_fc1._extra_state/shard_2_3`) -> data, for every
    ShardedObject of the whole model rebuilt on one rank (the `_extra_state` entries)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.utils import unwrap_model

    return {v.unique_key: v.data for v in unwrap_model(model).sharded_state_dict().values()
            if isinstance(v, ShardedObject)}


def _object_value(data) -> list:
    """A ShardedObject as megatron-core's torch_dist strategy stores it: `[data]` (it saves
    torch.save([sh_obj.data]); DefaultSavePlanner torch.saves every non-tensor value itself)."""
    return [data]


def rng_key(pp_rank: int, tp_rank: int, pp: int, tp: int) -> str:
    """The torch_dist key of one (PP, TP) rank's rng_state ShardedObject."""
    return f"rng_state/shard_{pp_rank}.{tp_rank}_{pp}.{tp}"


def torch_dist_source_fields(load_dir: str | Path) -> dict:
    """From a torch_dist checkpoint: its args, rng states {(pp, tp): rng list}, layout and flops
    (what `write_torch_dist` takes from the source when resharding torch_dist -> torch_dist)."""
    from megatron_ucp.megatron_rebuild import layout

    ckpt = resolve_iter_dir(load_dir)
    common = torch.load(ckpt / "common.pt", map_location="cpu", weights_only=False)
    args = common.get("args")
    if args is None:
        raise UCPError(f"{ckpt / 'common.pt'} has no 'args'; only Megatron-LM training saves are "
                       "supported")
    reader = DistReader(ckpt)
    rng = {}
    for key in reader.meta:
        if key.startswith("rng_state/shard_"):
            offset = key.removeprefix("rng_state/shard_").split("_")[0].split(".")
            data = reader.obj(key)
            rng[tuple(int(i) for i in offset[:2])] = data[0] if isinstance(data, list) and len(
                data) == 1 else data
    return {"args": args, "rng_state": rng or None, "layout": layout(args),
            "num_floating_point_operations_so_far": common.get("num_floating_point_operations_so_far")}


def write_torch_dist(universal_dir: str | Path, save_dir: str | Path, target, args_template, *,
                     rng_state: dict | list | None = None,
                     num_floating_point_operations_so_far: float | None = None,
                     first_stage_layers: int | None = None, last_stage_layers: int | None = None,
                     progress: bool = True) -> Path:
    """Write a Megatron-LM `--ckpt-format torch_dist` checkpoint at `target` from a universal (or
    fragment) directory, optimizer state in the layout-free `fully_reshardable` form (resume with
    `--dist-ckpt-optim-fully-reshardable`). Returns `save_dir` (the save root).

    Every tensor is at its global shape (layers stacked), so the target layout changes only
    `args` and the rng shards; torch.distributed.checkpoint itself reshards at load.
    args_template: Megatron-LM args of the same model (e.g. the source checkpoint's); parallel
    sizes become the target's (`megatron_legacy.target_args`). rng_state: one rng list (Megatron's
    `rng_state` of one rank) for every (PP, TP) shard, or {(pp_rank, tp_rank): list}; None: no
    rng_state (resume with --no-load-rng). num_floating_point_operations_so_far: None writes 0.0.
    """
    import json

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from tqdm import tqdm

    from megatron_ucp.megatron_legacy import _scheduler, _torch_group, prepare_export
    from megatron_ucp.storage import fsync_dir
    from megatron_ucp.testing import cpu_shim  # noqa: F401  (must precede megatron.core)

    t0 = time.perf_counter()
    source, args, out = prepare_export("torch_dist", universal_dir, save_dir, target, args_template,
                                       first_stage_layers, last_stage_layers)
    manifest = source.manifest
    if getattr(args, "num_experts", None) or target.ep > 1:
        raise UCPError("torch_dist export supports dense GPT models only (MoE runs chain two "
                       "optimizers whose fully_reshardable keys are not written here)")
    args.ckpt_format = "torch_dist"
    args.use_dist_ckpt = True
    args.dist_ckpt_optim_fully_reshardable = True
    args.rank, args.local_rank = 0, 0  # common.pt is written by global rank 0
    iteration = int(manifest["iteration"])

    # names, stacked keys and extra-state objects of the whole model, rebuilt on one rank
    plan, _ = _plan_model(args)
    one = single_rank_args(args)
    with source_rank(one, 0):
        objects = _sharded_objects(build_chunks(one)[0])
    saved = manifest["params"]
    missing = sorted(set(plan) - set(saved))
    if missing:
        raise UCPError(f"{source.dir}: the model rebuilt from the args template has parameter(s) "
                       f"{missing[:3]} that the checkpoint lacks; the args do not describe this "
                       "checkpoint's model")
    extra = sorted(set(saved) - set(plan))
    if extra:
        raise UCPError(f"{source.dir}: parameter(s) {extra[:3]} are not in the model rebuilt from "
                       "the args template; writing without them would drop state")
    steps = {source.step(n) for n in plan if not saved[n].get("buffer")}
    if len(steps) != 1:
        raise UCPError(f"the universal checkpoint has parameters at Adam steps {sorted(steps)}; a "
                       "Megatron-LM checkpoint keeps one step per param group")
    step = float(steps.pop())
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32

    def full(name: str, state: str, shape: tuple[int, ...]) -> torch.Tensor:
        have = tuple(saved[name]["shape"])
        if have == shape:
            return source.read(name, state, (0,) * len(have), have)
        if not plan[name].spec.get("vocab_rows") or have[1:] != shape[1:]:
            raise UCPError(f"{name}: universal shape {list(have)}, the target model needs "
                           f"{list(shape)}")
        t = torch.zeros(shape, dtype=torch.float32)  # padded vocab rows: zero weight and moments
        rows = min(have[0], shape[0])
        t[:rows] = source.read(name, state, (0,) * len(have), (rows, *have[1:]))
        return t

    by_key: dict[str, list[str]] = {}
    for name, p in plan.items():
        by_key.setdefault(p.key, []).append(name)
    state_dict: dict = {}
    bar = tqdm(total=len(plan), desc="export torch_dist", unit="param", disable=not progress)
    for key, names in by_key.items():
        index = [plan[n].index for n in names]
        stacked = tuple(max(i[a] for i in index) + 1 for a in range(len(index[0])))
        if len(set(index)) != len(names) or math.prod(stacked) != len(names):
            raise UCPError(f"internal: {key!r} has stacked entries {sorted(index)}")
        shape = tuple(plan[names[0]].spec["shape"])
        buffer = bool(saved[names[0]].get("buffer"))
        states = ("param",) if buffer else STATES
        tensors = {s: torch.empty((*stacked, *shape), dtype=torch.float32) for s in states}
        for n in names:
            for s in states:
                tensors[s][plan[n].index] = full(n, s, shape)
            bar.update(1)
        state_dict[key] = tensors["param"].to(dtype)
        if not buffer:
            for s in STATES:
                state_dict[f"optimizer.state.{s}.{key}"] = tensors[s]
    bar.close()
    for k, v in objects.items():
        state_dict[k] = _object_value(v)
    if rng_state is not None:
        for pp_rank in range(target.pp):
            for tp_rank in range(target.tp):
                rs = rng_state if isinstance(rng_state, list) else rng_state.get(
                    (pp_rank, tp_rank), next(iter(rng_state.values())))
                state_dict[rng_key(pp_rank, tp_rank, target.pp, target.tp)] = _object_value(rs)

    opt = manifest.get("optimizer", {})
    groups = [_torch_group(g, step) for g in opt.get("param_groups", []) if g.get("optimizer", 0) == 0]
    if not groups:
        raise UCPError(f"{source.dir}: the universal manifest has no optimizer param groups")
    if opt.get("grad_scaler"):
        raise UCPError("fp16 runs (a grad scaler) are not supported by the torch_dist export")
    common = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
              "optimizer": {"optimizer": {"param_groups": groups},
                            "param_state_sharding_type": "fully_reshardable"},
              "opt_param_scheduler": _scheduler(manifest.get("scheduler")),
              "num_floating_point_operations_so_far": float(num_floating_point_operations_so_far or 0.0),
              "content_metadata": dict(FULLY_RESHARDABLE_CONTENT)}

    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    iter_dir = partial / f"iter_{iteration:07d}"
    iter_dir.mkdir(parents=True)
    try:
        dcp.save(state_dict, storage_writer=FileSystemWriter(str(iter_dir)),
                 planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                 no_dist=True)
        torch.save(common, iter_dir / "common.pt")
        (iter_dir / "metadata.json").write_text(json.dumps(METADATA_JSON))
        fsync_dir(iter_dir)
        (partial / TRACKER).write_text(str(iteration))
        fsync_dir(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if out.exists():
        out.rmdir()
    partial.rename(out)
    if progress:
        print(f"[megatron-ucp] wrote Megatron-LM torch_dist iteration {iteration} at {target} "
              f"(fully_reshardable, {len(plan)} parameters) into {out} in "
              f"{time.perf_counter() - t0:.2f}s")
    return out
