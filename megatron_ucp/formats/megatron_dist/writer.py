"""Universal tensors -> a Megatron-LM `--ckpt-format torch_dist` checkpoint at any layout.

Model tensors are written at their global shape (layers stacked). The optimizer state takes either
form Megatron-LM loads:

* `fully_reshardable` (`--dist-ckpt-optim-fully-reshardable`): one tensor per state at global
  shape, layout-free, so the target layout changes only `args` and the rng shards;
* `dp_reshardable` (Megatron-LM's default): each target model-parallel rank's flat
  DistributedOptimizer buckets, laid out by megatron-core's own DDP rebuilt at the target rank, so
  Megatron-LM loads it at the target TP/PP (and any DP: the buckets exclude the DP padding).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.megatron_common import (
    TRACKER,
    chained_groups,
    check_export,
    hybrid_layer_pattern,
    iteration_dir_name,
    prepare_export,
    rng_for,
    rng_shard_key,
    scheduler_state,
    single_step,
    torch_group,
)
from megatron_ucp.formats.megatron_dist import layer_wise
from megatron_ucp.formats.megatron_dist.layout import (
    COMMON_FILE,
    EXPERT,
    FULLY_RESHARDABLE_CONTENT,
    LAYER_WISE,
    METADATA_JSON,
    SHARDINGS,
    UCP_COMMON_KEY,
    bucket_key,
    buffer_sets,
    model_parallel_ranks,
    object_value,
    param_groups_key,
    plan_model,
    state_key,
)
from megatron_ucp.formats.megatron_dist.reader import TorchDistSource
from megatron_ucp.formats.megatron_te import dist_objects, export_check
from megatron_ucp.layout import Layout
from megatron_ucp.local_slice import read_local
from megatron_ucp.mcore_compat.dist_ckpt import rng_shard_dp_forms
from megatron_ucp.mcore_compat.mamba import mamba_conv1d_is_module
from megatron_ucp.progress import Progress, bar
from megatron_ucp.spec import STATES
from megatron_ucp.storage import staged_dir

log = logging.getLogger(__name__)


def write(source, save_dir: str | Path, target: Layout, args_template, *,
          rng_state: dict | list | None = None,
          num_floating_point_operations_so_far: float | None = None,
          first_stage_layers: int | None = None, last_stage_layers: int | None = None,
          sharding: str | None = None, expert_tensor_parallel: int | None = None,
          progress: Progress = True, flavor: Flavor | None = None) -> Path:
    """Write a Megatron-LM `--ckpt-format torch_dist` checkpoint at `target` from any source of
    universal tensors. Returns `save_dir` (the save root).

    sharding: the optimizer state's form, "fully_reshardable" (the default; resume with
    `--dist-ckpt-optim-fully-reshardable`, at any layout) or "dp_reshardable" (Megatron-LM's
    default; resume at the target's TP and PP, any DP; a MoE model: the ChainedOptimizer's dense
    and expert buckets). A LayerWiseDistributedOptimizer run (`--optimizer muon|lion`, args with
    use_layer_wise_distributed_optimizer: Muon/Lion and Adam state) has one form, its model-space
    chained states (`layer_wise`, resumable at any layout; sharding None). expert_tensor_parallel:
    the target's expert TP size (MoE; default: the source's rule).

    args_template: Megatron-LM args of the same model (e.g. the source checkpoint's); parallel
    sizes become the target's (`megatron_common.target_args`). rng_state: one rng list (Megatron's
    `rng_state` of one rank) for every (PP, TP) shard, or {(pp_rank, tp_rank): list}; None: no
    rng_state (resume with --no-load-rng). num_floating_point_operations_so_far: None writes 0.0.
    flavor: what the code that resumes it needs besides the tensors (default Megatron-LM's, `Flavor`).
    """
    flavor = flavor or Flavor()
    t0 = time.perf_counter()
    args, out = prepare_export("torch_dist", source, save_dir, target, args_template,
                               first_stage_layers, last_stage_layers, expert_tensor_parallel)
    manifest = source.manifest
    sharding = _sharding(source, args, sharding)
    # a second (expert) DistributedOptimizer only where megatron-core gives the experts their own
    # buffers (expert parallelism; 0.19 also an expert TP other than the TP); at EP1 they share
    # the dense buffers and optimizer
    moe = bool(getattr(args, "num_experts", None)) and _expert_buffers(args)
    if sharding == "dp_reshardable" and (target.vpp or target.cp > 1 or getattr(
            args, "overlap_param_gather_with_optimizer_step", False)):
        raise UCPError(f"dp_reshardable torch_dist export supports TP/PP/DP targets (got {target}); "
                       "write the fully_reshardable form, which loads at any layout")
    args.ckpt_format = "torch_dist"
    args.use_dist_ckpt = True
    args.dist_ckpt_optim_fully_reshardable = sharding == "fully_reshardable"
    args.rank, args.local_rank = 0, 0  # common.pt is written by global rank 0
    iteration = int(manifest.iteration)

    plan, objects = _plan(source, args)
    # (a source it cannot hold is refused before anything is read)
    lw = layer_wise.plan(source, args) if sharding == LAYER_WISE else None
    step = single_step(source) if lw is None else None
    state_dict = _model_state(source, plan, args, _optimizer_keys(sharding, lw), progress)
    for k, v in objects.items():
        state_dict[k] = object_value(v)
    if rng_state is not None:
        state_dict.update(_rng_shards(rng_state, target))
    optimizer, content = ((lw.optimizer, dict(layer_wise.LAYER_WISE_CONTENT)) if lw else
                          _optimizer_state(source, args, moe, sharding, step, state_dict, progress))
    common = {**({"args": args} if flavor.args_in_common else {}), "checkpoint_version": 3.0,
              "iteration": iteration,
              "optimizer": optimizer,
              "opt_param_scheduler": scheduler_state(manifest.scheduler),
              "num_floating_point_operations_so_far": float(num_floating_point_operations_so_far or 0.0),
              "content_metadata": content}
    if hybrid_layer_pattern(args):  # the buffers follow this release's Mamba parameter order
        common[UCP_COMMON_KEY] = {"mamba_conv1d_module": mamba_conv1d_is_module()}
    if flavor.record_world_size:  # (where no args say it)
        common.setdefault(UCP_COMMON_KEY, {})["world_size"] = target.world_size

    read_back = export_check(check_export, source, flavor.reader, args)  # tensors, FP8 state
    with staged_dir(out, TRACKER, check=read_back) as partial:
        iter_dir = partial / iteration_dir_name(iteration)
        iter_dir.mkdir()
        dcp.save(state_dict, storage_writer=FileSystemWriter(str(iter_dir)),
                 planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                 no_dist=True)
        torch.save(common, iter_dir / COMMON_FILE)
        (iter_dir / "metadata.json").write_text(json.dumps(METADATA_JSON))
        if flavor.files is not None:
            flavor.files(iter_dir, partial, args, sharding, rng_state is not None)
        (partial / TRACKER).write_text(str(iteration))
    log.info("wrote %s torch_dist iteration %d at %s (%s, %d parameters) into %s in %.2fs",
             flavor.saved_by, iteration, target, sharding, len(plan), out, time.perf_counter() - t0)
    return out


@dataclasses.dataclass(frozen=True)
class Flavor:
    """What a torch_dist checkpoint carries for the training code that resumes it."""

    saved_by: str = "Megatron-LM"
    args_in_common: bool = True  # Megatron-LM's args in the common state
    record_world_size: bool = False  # the target's world size in the common state's megatron-ucp record
    reader: type = TorchDistSource  # the source class that reads it back before the commit
    # files(iteration dir, save root, target args, optimizer sharding, rng written) writes the rest
    files: Callable[[Path, Path, object, str, bool], None] | None = None


def _plan(source, args) -> tuple[dict, dict]:
    """(universal name -> stacked key and index, extra-state objects) of the whole model rebuilt
    on one rank from the target args, which must name exactly the source's parameters; a TE
    module's `_extra_state` holds the source's FP8 state for it (`megatron_te.dist_objects`)."""
    objects: dict = {}
    plan, _ = plan_model(args, objects)
    saved = source.manifest.params
    missing = sorted(set(plan) - set(saved))
    if missing:
        raise UCPError(f"{source.dir}: the model rebuilt from the args template has parameter(s) "
                       f"{missing[:3]} that the checkpoint lacks; the args do not describe this "
                       "checkpoint's model")
    extra = sorted(set(saved) - set(plan))
    if extra:
        raise UCPError(f"{source.dir}: parameter(s) {extra[:3]} are not in the model rebuilt from "
                       "the args template; writing without them would drop state")
    return plan, dist_objects(objects, source.te_states(), args, str(source.dir))


def _sharding(source, args, sharding: str | None) -> str:
    """The optimizer form to write: the LayerWise one for a LayerWise run, else `sharding`
    (default fully_reshardable); the state of another optimizer than Adam's is refused by name."""
    if getattr(args, "use_layer_wise_distributed_optimizer", False):
        if sharding not in (None, LAYER_WISE):
            raise UCPError(f"torch_dist optimizer sharding {sharding!r}: the args describe a "
                           "LayerWiseDistributedOptimizer run (--optimizer "
                           f"{getattr(args, 'optimizer', '?')}), whose state has one form, model-space "
                           "per chained optimizer; pass no sharding")
        return LAYER_WISE
    sharding = sharding or "fully_reshardable"
    if sharding not in SHARDINGS:
        raise UCPError(f"torch_dist optimizer sharding {sharding!r}: choose one of {list(SHARDINGS)}")
    other = sorted({p.spec.optimizer for p in source.manifest.params.values()
                    if not p.spec.buffer and p.spec.optimizer != "adam"})
    if other:
        raise UCPError(f"{source.dir}: holds {', '.join(other)} optimizer state, but the args "
                       f"describe a DistributedOptimizer run (--optimizer {getattr(args, 'optimizer', '?')}),"
                       " whose torch_dist files megatron-ucp writes for Adam only; Muon and Lion state "
                       "goes into a LayerWiseDistributedOptimizer run's (args of an --optimizer "
                       "muon|lion --use-distributed-optimizer run)")
    return sharding


def _optimizer_keys(sharding: str, lw) -> Callable[[str, str], dict[str, str]] | None:
    """(universal name, stored part key) -> {state: torch_dist key} of the optimizer tensors kept
    next to the model tensors (fully_reshardable, layer_wise); None: the master weight only
    (dp_reshardable keeps the rest in its buckets)."""
    if lw is not None:
        return lw.keys
    if sharding == "fully_reshardable":
        return lambda _name, part_key: {s: state_key(s, part_key) for s in STATES}
    return None


def _model_state(source, plan: dict, args, opt_keys, progress: Progress) -> dict:
    """The model tensors at their global shape (layers stacked), in the training dtype, and the
    optimizer states `opt_keys` names (`_optimizer_keys`) next to them in fp32."""
    saved = source.manifest.params
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32

    def full(name: str, state: str, shape: tuple[int, ...]) -> torch.Tensor:
        have = saved[name].shape
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
    done = bar(progress, len(plan), "export torch_dist", "param")
    for key, names in by_key.items():
        index = [plan[n].index for n in names]
        stacked = tuple(max(i[a] for i in index) + 1 for a in range(len(index[0])))
        if len(set(index)) != len(names) or math.prod(stacked) != len(names):
            raise UCPError(f"internal: {key!r} has stacked entries {sorted(index)}")
        shape = tuple(plan[names[0]].spec["shape"])
        buffer = saved[names[0]].spec.buffer
        keyed = {} if buffer or opt_keys is None else {n: opt_keys(n, key) for n in names}
        states = tuple(keyed[names[0]]) if keyed else ("param",)
        if any(tuple(k) != states for k in keyed.values()):
            raise UCPError(f"{key!r}: its stacked parameters {names[:2]}... have different optimizer "
                           "states; one tensor per state cannot hold them")
        tensors = {s: torch.empty((*stacked, *shape), dtype=torch.float32) for s in states}
        for n in names:
            for s in states:
                tensors[s][plan[n].index] = full(n, s, shape)
            done.update(1)
        # one tensor per section where the parameter is stored in sections (Mamba's in_proj, conv1d)
        for part_key, box, _ in plan[names[0]].parts():
            at = (slice(None),) * len(stacked) + box
            state_dict[part_key] = tensors["param"][at].to(plan[names[0]].buffer_dtype or dtype)
            for s, k in (opt_keys(names[0], part_key) if keyed else {}).items():
                state_dict[k] = tensors[s][at].contiguous()
    done.close()
    return state_dict


def _rng_shards(rng_state: dict | list, target: Layout) -> dict:
    """The rng shards of every (PP, TP) rank, in the key forms of every release
    (`mcore_compat.dist_ckpt.rng_shard_dp_forms`)."""
    out = {}
    dps = rng_shard_dp_forms(target.dp, target.ep)
    for pp_rank in range(target.pp):
        for tp_rank in range(target.tp):
            rs = object_value(rng_for(rng_state, (pp_rank, tp_rank)))
            for dp in dps:
                out[rng_shard_key(pp_rank, tp_rank, target.pp, target.tp, dp)] = rs
    return out


def _optimizer_state(source, args, moe: bool, sharding: str, step: float, state_dict: dict,
                     progress: Progress) -> tuple[dict, dict]:
    """(common.pt's `optimizer`, its `content_metadata`); the dp_reshardable form adds its
    per-rank buckets and param groups to `state_dict`."""
    opt = source.manifest.optimizer
    chained = [[torch_group(g, step) for g in groups]  # MoE: dense and expert optimizers
               for groups in chained_groups(opt.get("param_groups", []), 2 if moe else 1)]
    groups = chained[0]
    if not all(chained):
        raise UCPError(f"{source.dir}: the universal manifest has no optimizer param groups"
                       f"{' for the expert optimizer' if groups else ''}")
    if opt.get("grad_scaler"):
        raise UCPError("fp16 runs (a grad scaler) are not supported by the torch_dist export")
    if sharding == "fully_reshardable":  # MoE: ChainedOptimizer's {index: state}
        optimizer = {i: {"optimizer": {"param_groups": g}, "param_state_sharding_type": sharding}
                     for i, g in enumerate(chained)}
        return (optimizer if moe else optimizer[0]), dict(FULLY_RESHARDABLE_CONTENT)
    # the param groups (and step) are stored per model-parallel rank, next to its buckets
    state_dict.update(_dp_reshardable_state(source, args, chained, progress))
    optimizer = {"param_state_sharding_type": sharding}
    optimizer = {i: dict(optimizer) for i in range(2)} if moe else optimizer
    return optimizer, {"distrib_optim_sharding_type": sharding, "singleton_local_shards": False,
                       "chained_optim_avoid_prefix": True}


def _expert_buffers(args) -> bool:
    """Whether megatron-core DDP keeps expert-parallel buffers on any target model-parallel rank
    (read off the model rebuilt there, meta tensors)."""
    if getattr(args, "expert_model_parallel_size", 1) > 1:
        return True
    return any(c.expert_parallel_buffers for _, chunks in model_parallel_ranks(args) for c in chunks)


def _dp_reshardable_state(source, args, chained: list[list[dict]], progress: Progress) -> dict:
    """The `optimizer.distributed.dp_group_idx_<k>.*` entries of every target model-parallel rank
    k, as DistributedOptimizer.sharded_param_state_dp_reshardable saves them: per DDP bucket one
    1-D tensor per state of the bucket's unpadded length (parameters at their DDP offsets, zero
    gaps), the per-bucket sizes and the rank's param groups with the step. A MoE model (chained:
    the dense and the expert param groups): megatron-core's ChainedOptimizer prefixes the dense
    optimizer's entries `chained_0.` and the expert optimizer's `chained_1.`, whose k is the rank
    in the expert tensor-model-pipeline group (layout.optimizer_ranks)."""
    def bucket_layout(buffers: list, lps: dict) -> list:
        """Per DDP buffer: its dtypes, (padded, unpadded) size of each bucket, and (param, bucket,
        start in the bucket) of every parameter copy (the tied output layer's too: Megatron keeps
        state for each)."""
        return [((buf.param_dtype, buf.grad_dtype),
                 [(b.grad_data.numel(), b.numel_unpadded) for b in buf.buckets],
                 [(lps[id(param)], b, start - buf.buckets[b].offset)
                  for param, (start, _end, b) in buf.param_index_map.items()])
                for buf in buffers]

    # the layouts first: tensors made inside a rebuilt rank's context would be on the meta device
    ranks = [(idx, prefix, chained[1 if prefix == EXPERT else 0], bucket_layout(buffers, lps))
             for idx, prefix, buffers, lps in buffer_sets(args, len(chained) == 2, "the target")]
    out: dict = {}
    done = bar(progress, len(ranks), "export dp_reshardable", "rank")
    for mp_rank, chain, groups, buffers in ranks:
        numel, unpadded = [], []
        for g, (dtypes, sizes, where) in enumerate(buffers):
            numel.append({dtypes: [n for n, _ in sizes]})
            unpadded.append({dtypes: [n for _, n in sizes]})
            flats = [{s: torch.zeros(n, dtype=torch.float32) for s in STATES} for _, n in sizes]
            for lp, b, start in where:
                a = start + lp.base
                for s in STATES:
                    flats[b][s][a:a + lp.numel] = read_local(source, lp, s, 0, lp.numel)
            for b, flat in enumerate(flats):
                for s, t in flat.items():
                    out[f"{bucket_key(mp_rank, g, dtypes, b, chain)}.{s}"] = t
        prefix = f"{chain}optimizer.distributed.dp_group_idx_{mp_rank}"
        out[param_groups_key(mp_rank, chain)] = object_value({"param_groups": groups})
        out[f"{prefix}.per_bucket_numel/shard_0_1"] = object_value(numel)
        out[f"{prefix}.per_bucket_numel_unpadded/shard_0_1"] = object_value(unpadded)
        done.update(1)
    done.close()
    return out
