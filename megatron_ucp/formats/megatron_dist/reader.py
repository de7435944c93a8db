"""Megatron-LM `--ckpt-format torch_dist` checkpoints as a source, offline, no real process group.

A torch_dist checkpoint is readable only by a run with the same optimizer sharding machinery; its
`dp_reshardable` optimizer state is a raw copy of each model-parallel rank's flat
DistributedOptimizer buffer, so nothing outside megatron-core knows where a parameter lives in it.
We therefore ask megatron-core itself rather than re-implementing its rules:

* names, shapes, TP split axis, SwiGLU blocks and vocab rows come from `param_spec.local_params` on
  a GPT model rebuilt from the checkpoint's `args` at TP1 (`layout.plan_model`);
* for `dp_reshardable`, each parameter's offset in the flat buffer comes from megatron-core's own
  `DistributedDataParallel` (`buffer.param_index_map`) built at the *source* layout for the source
  model-parallel rank (fake process group of the source world size), and the TP-local slices are
  put back together with that rank's `local_params` pieces;
* `fully_reshardable` stores `optimizer.state.<state>.<model key>` at global shape: no layout math;
* `layer_wise` (megatron-core 0.19's LayerWiseDistributedOptimizer, `--optimizer muon|lion`) stores
  each chained optimizer's states in model space, `chained_<i>.optimizer.state.<state>.<model key>`
  at global shape: no layout math; each parameter takes the family of the chain holding it;
* `fully_sharded_model_space` (megatron-core 0.13/0.14 default, 0.15 with
  `--dist-ckpt-save-pre-mcore-014`; later releases no longer load it) stores each state of a model
  tensor as one row per TP-local chunk, the chunk flattened (`layout.flattened_shape`); the rows
  are put back at the chunks' places. The run's DP ranges only cut those rows, so no DDP rebuild.

Every master weight is checked against the stored model weight (bf16(master) == model tensor, bit
for bit), so a wrong offset can never produce a silently wrong universal checkpoint. Only tensors
that are needed are read; at most a few stacked tensors / flat buckets are in memory.
"""

from __future__ import annotations

import logging
import math
import time
from itertools import product
from pathlib import Path

import torch

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.base import RunFields, Source
from megatron_ucp.formats.dcp_reader import DistReader, ReadsDcp
from megatron_ucp.formats.manifest import Manifest, ParamEntry
from megatron_ucp.formats.megatron_common import (
    group_json,
    group_step,
    layer_wise_family,
    layout,
    resolve_iteration,
    torch_load,
)
from megatron_ucp.formats.megatron_dist.layout import (
    COMMON_FILE,
    COMMON_STATE_KEY,
    DENSE,
    EXPERT,
    FLATTENED,
    LAYER_WISE,
    LAYER_WISE_KEY,
    OPTIMIZER_KEY,
    READ_SHARDINGS,
    Param,
    bucket_key,
    buffer_sets,
    flattened_shape,
    flattened_state_key,
    is_iteration,
    layer_wise_key,
    param_groups_key,
    plan_model,
    saved_mamba_conv1d_module,
    state_key,
)
from megatron_ucp.formats.megatron_dist.model_only import MODEL_ONLY, model_only
from megatron_ucp.formats.megatron_te import dist_states, te_required
from megatron_ucp.progress import Progress
from megatron_ucp.spec import OPTIMIZER_STATES, STATES, ParamSpec

log = logging.getLogger(__name__)


def load_common(ckpt: Path, trust_pickle: bool = False) -> tuple[dict, Path]:
    """(the common state of iteration directory `ckpt`, where it was read): `common.pt`
    (megatron-core <= 0.18) or, without that file, the `common_state` object in the .distcp files
    (0.19)."""
    where = ckpt / COMMON_FILE
    if where.exists():
        return torch_load(where, "the checkpoint is incomplete", trust_pickle), where
    reader = DistReader(ckpt, trust_pickle=trust_pickle)
    if COMMON_STATE_KEY not in reader.meta:
        raise UCPError(f"{ckpt}: neither {COMMON_FILE} nor the object {COMMON_STATE_KEY!r} "
                       "(megatron-core 0.19) is there; the checkpoint is incomplete: copy "
                       f"{COMMON_FILE} back or convert another iteration")
    common = reader.obj(COMMON_STATE_KEY)
    return (common[0] if isinstance(common, list) and len(common) == 1 else common,
            ckpt / f"{COMMON_STATE_KEY} (in the .distcp files)")


def read_common(load_dir: str | Path, trust_pickle: bool = False) -> tuple[Path, dict, object]:
    """(iteration directory, the common state, the run's args)."""
    ckpt, _ = resolve_iteration(load_dir, is_iteration, "--ckpt-format torch_dist")
    common, where = load_common(ckpt, trust_pickle)
    args = common.get("args") if isinstance(common, dict) else None
    if args is None:
        if (ckpt / "train_state.pt").exists() or (ckpt.parent / "latest_train_state.pt").exists():
            raise UCPError(f"{ckpt}: a Megatron-Bridge checkpoint (train_state.pt) whose run_config.yaml "
                           "is missing: Bridge's run description is read from it (the common state "
                           "holds no Megatron-LM args); copy run_config.yaml back from the run")
        raise UCPError(f"{where} has no 'args'; only Megatron-LM and Megatron-Bridge training saves are "
                       "supported")
    return ckpt, common, args


class TorchDistSource(ReadsDcp, Source):
    """A Megatron-LM torch_dist checkpoint read as universal tensors.

    `load_dir` is a `--save` root (with latest_checkpointed_iteration.txt) or an iter directory.
    Must run in a process without torch.distributed initialised (models are built on a fake group).
    """

    format = "megatron_torch_dist"  # its name in the `formats` registry
    saved_by = "megatron-lm"  # (origin kind) the training code whose save this is
    # (iteration directory, common state, Megatron-LM style args) of a save root or iteration directory
    read_common = staticmethod(read_common)

    def __init__(self, load_dir: str | Path, progress: Progress = True, trust_pickle: bool = False):
        t0 = time.perf_counter()
        ckpt, common, args = self.read_common(load_dir, trust_pickle)
        self.dir, self.args = ckpt, args  # the run's args
        self.reader = reader = DistReader(ckpt, trust_pickle=trust_pickle)
        if not any(OPTIMIZER_KEY.match(k) for k in reader.meta):
            return model_only(self, common, args, check_names)  # --no-save-optim, Bridge's
        opt = common.get("optimizer") or {}
        sharding = _sharding_of(common, args)
        if sharding not in (*READ_SHARDINGS, LAYER_WISE):
            raise UCPError(f"{ckpt}: optimizer sharding {sharding!r} is not supported (expected "
                           f"one of {', '.join(READ_SHARDINGS)} from --use-distributed-optimizer)")
        moe = bool(getattr(args, "num_experts", None))
        if moe and sharding == FLATTENED:
            raise UCPError(f"{ckpt}: a MoE run (num_experts={args.num_experts}) saved with the "
                           f"{sharding} optimizer; its expert state is not mapped: save the "
                           "run with --dist-ckpt-optim-fully-reshardable or --ckpt-format torch and "
                           "convert that")
        self.sharding, self._objects = sharding, {}  # (the rebuilt model's `_extra_state` names)
        self.plan, model_cfg = plan_model(args, self._objects)
        check_names(reader, self.plan, sharding)
        lay = layout(args)
        replica_buckets: set[str] = set()
        self.chain: dict[str, int | None] = {}  # layer_wise: the chained optimizer of each param
        families: dict[str, str] = {}
        steps: dict[str, float] = {}
        # both keep the param groups in common.pt (megatron-core's "fully reshardable formats");
        # fully_reshardable MoE: {0: dense, 1: expert} (a ChainedOptimizer)
        if sharding == LAYER_WISE:
            groups, step, self.chain, families, steps = _plan_layer_wise(reader, self.plan, opt, args)
        elif sharding in ("fully_reshardable", FLATTENED):
            chained = [opt[i] for i in sorted(k for k in opt if isinstance(k, int))] or [opt]
            groups = [(i, g) for i, o in enumerate(chained)
                      for g in (o.get("optimizer") or {}).get("param_groups") or []]
            step = group_step([g for _, g in groups], str(ckpt))
        else:
            groups, step = None, None
            # one optimizer per model-parallel rank; a MoE run whose experts have their own
            # buffers (EP > 1, or an expert TP other than the TP): a ChainedOptimizer of the dense
            # one and one per expert tensor-model-pipeline rank (ETP x EP x PP), its keys
            # prefixed `chained_<i>.`; at EP1 the experts share the dense buffers and optimizer
            chained = any(k.startswith(DENSE) for k in reader.meta)
            optimizers = [(0, "", k) for k in range(lay.tp * lay.pp)] if not chained else \
                [(0, DENSE, k) for k in range(lay.tp * lay.pp)] + \
                [(1, EXPERT, k) for k in range(expert_tp(args) * lay.ep * lay.pp)]
            for chain, prefix, k in optimizers:
                obj = reader.obj(param_groups_key(k, prefix))
                g = (obj[0] if isinstance(obj, list) else obj)["param_groups"]
                s = group_step(g, f"{ckpt}: {prefix}model-parallel rank {k}")
                if step is not None and s != step:
                    raise UCPError(f"{ckpt}: {prefix}model-parallel rank {k} is at Adam step {s}, "
                                   f"rank 0 at {step}")
                step = s
                if k == 0:
                    groups = (groups or []) + [(chain, x) for x in g]
            if sharding == "dp_reshardable":
                replica_buckets = _plan_dp_reshardable(args, reader, self.plan, chained,
                                                       saved_mamba_conv1d_module(common, ckpt))
        _check_optimizer_keys(reader, self.plan, sharding, replica_buckets, self.chain, families)
        if not groups:
            raise UCPError(f"{ckpt}: no optimizer param groups found (was it saved without optimizer?)")
        if step is None:
            raise UCPError(f"{ckpt}: the optimizer param groups carry no Adam step")
        self.origin = {"kind": f"{self.saved_by} torch_dist ({sharding})", "path": str(ckpt)}
        # the step is per parameter in the manifest (as in every megatron-ucp form), not per group
        self.manifest = Manifest(
            "universal", int(common.get("iteration", getattr(args, "iteration", 0))), lay,
            lay.world_size, model_cfg,
            {n: ParamEntry(ParamSpec.from_json({**p.spec, **({"optimizer": families[n]} if n in families
                                                             else {})}),
                           steps.get(n, step) if p.buffer_dtype is None else 0.0)
             for n, p in self.plan.items()},
            {"param_groups": [group_json(g, i) for i, g in groups], "grad_scaler": None},
            common.get("opt_param_scheduler"),
            {"consumed_samples": int(getattr(args, "consumed_train_samples", 0) or 0)},
            int(getattr(args, "seed", 1234)))
        self._last: tuple[tuple[str, str], torch.Tensor] | None = None
        log.info("planned %d parameters of %s (%s) in %.2fs", len(self.plan), ckpt, sharding,
                 time.perf_counter() - t0)

    def read(self, name: str, state: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        if self._last is None or self._last[0] != (name, state):
            self._last = ((name, state), _read_full(self.reader, self.plan[name], state, self.sharding,
                                                    self.chain.get(name)))
        return self._last[1][tuple(slice(o, o + n) for o, n in zip(offset, shape))]

    def rng_ranks(self) -> list[int]:
        return []  # per-rank generator states are Megatron-LM's, kept by its own writers (fields)

    def te_states(self) -> dict:
        """Its `_extra_state` objects decoded (pickle-free), by universal module name."""
        if getattr(self, "_te", None) is None:
            self._te = dist_states(list(self.reader.meta), self.reader.obj,
                                   {u: n for u, (_, n) in self._objects.items()}, str(self.dir))
        return self._te


def run_fields(load_dir: str | Path, trust_pickle: bool = False, read=read_common) -> RunFields:
    """From a torch_dist checkpoint: its args, rng states {(pp, tp): rng list}, layout and flops
    (what a Megatron-LM writer takes from the source run). read: `read_common` or a variant of it."""
    ckpt, common, args = read(load_dir, trust_pickle)
    reader = DistReader(ckpt, trust_pickle=trust_pickle)
    rng = {}
    for key in reader.meta:
        if key.startswith("rng_state/shard_"):
            offset = key.removeprefix("rng_state/shard_").split("_")[0].split(".")
            data = reader.obj(key)
            rng[tuple(int(i) for i in offset[:2])] = data[0] if isinstance(data, list) and len(
                data) == 1 else data
    return RunFields(args=args, layout=layout(args), rng_state=rng or None,
                     rng_by_position=rng or None, num_floating_point_operations_so_far=common.get(
                         "num_floating_point_operations_so_far"))


def _sharding_of(common: dict, args) -> str | None:
    """The optimizer form the common state names (a LayerWise run's: its own)."""
    if getattr(args, "use_layer_wise_distributed_optimizer", False):
        return LAYER_WISE  # (its content_metadata says dp_reshardable, its state is not)
    return (common.get("optimizer") or {}).get("param_state_sharding_type") or (
        common.get("content_metadata") or {}).get("distrib_optim_sharding_type")


def check_names(reader: DistReader, plan: dict[str, Param], sharding: str) -> None:
    """Every universal name has its tensor in the checkpoint and every checkpoint tensor is used."""
    stored = {k: reader.shape(k) for k in reader.tensor_keys() if not OPTIMIZER_KEY.match(k)}
    used: dict[str, set] = {}
    for name, p in plan.items():
        for key, _, part_shape in p.parts():  # (one per section of a sectioned parameter)
            if key not in stored:
                raise UCPError(f"{reader.dir}: the model built from the checkpoint's args has "
                               f"parameter {name!r} (torch_dist key {key!r}) but the checkpoint has "
                               "no such tensor; the args do not describe this checkpoint")
            want = (*[i + 1 for i in p.index], *part_shape)
            have = stored[key]
            if len(have) != len(want) or tuple(have[len(p.index):]) != part_shape or any(
                    i >= n for i, n in zip(p.index, have)):
                raise UCPError(f"{reader.dir}: tensor {key!r} has shape {list(have)} but parameter "
                               f"{name!r} needs index {list(p.index)} of shape {list(part_shape)}")
            used.setdefault(key, set()).add(p.index)
            if sharding == "fully_reshardable" and p.buffer_dtype is None:
                for s in STATES:
                    k = state_key(s, key)
                    if k not in reader.meta:
                        raise UCPError(f"{reader.dir}: optimizer state {k!r} for parameter "
                                       f"{name!r} is missing")
        have = stored[p.key]
        if sharding == FLATTENED and p.section_keys:
            raise UCPError(f"{reader.dir}: parameter {name!r} is stored in sections "
                           f"{p.section_keys}; their fully_sharded_model_space optimizer form is "
                           "not mapped (convert a save of another form)")
        if sharding == FLATTENED:
            for s in STATES:
                k = flattened_state_key(s, p.key)
                if k not in reader.meta:
                    raise UCPError(f"{reader.dir}: optimizer state {k!r} for parameter {name!r} "
                                   "is missing (was the run saved without its optimizer?)")
                if flattened_shape(tuple(have), reader.shape(k)) is None:
                    raise UCPError(f"{reader.dir}: flattened optimizer state {k!r} has shape "
                                   f"{list(reader.shape(k))}, which is no chunk grid of the model "
                                   f"tensor {p.key!r} {list(have)} (expected [chunks per axis..., "
                                   "chunk elements]); the file is not megatron-core's "
                                   "fully_sharded_model_space form")
    for key, shape in stored.items():
        if key not in used:
            raise UCPError(f"{reader.dir}: checkpoint tensor {key!r} {list(shape)} is not a parameter "
                           "of the model built from its args (an unsupported module or buffer?)")
        stacked = len(next(iter(used[key])))
        if len(used[key]) != math.prod(shape[:stacked]):
            raise UCPError(f"{reader.dir}: checkpoint tensor {key!r} {list(shape)} has "
                           f"{math.prod(shape[:stacked])} stacked entries but the model uses "
                           f"{len(used[key])}; num_layers in args does not match the tensors")


def _check_optimizer_keys(reader: DistReader, plan: dict[str, Param], sharding: str,
                          replica_buckets: set[str], chain: dict | None = None,
                          families: dict | None = None) -> None:
    """Every stored optimizer tensor is accounted for: no state is silently dropped.
    replica_buckets: dp_reshardable buckets holding replicas only (with PP > 1, the tied output
    layer's copy of the embedding sits in a bucket of its own on the last stage).
    chain, families (layer_wise): each parameter's chained optimizer and family."""
    if sharding == LAYER_WISE:
        wanted = {layer_wise_key(chain[n], s, key) for n, p in plan.items() if p.buffer_dtype is None
                  for key, _, _ in p.parts() for s in ("param", *OPTIMIZER_STATES[families[n]])}
    elif sharding == "fully_reshardable":
        wanted = {state_key(s, key) for p in plan.values() if p.buffer_dtype is None
                  for key, _, _ in p.parts() for s in STATES}
    elif sharding == FLATTENED:
        wanted = {flattened_state_key(s, p.key) for p in plan.values() if p.buffer_dtype is None
                  for s in STATES}
    else:
        buckets = {slab[0] for p in plan.values() for slab in p.slabs} | replica_buckets
        wanted = {f"{b}.{s}" for b in buckets for s in STATES}
    extra = sorted(k for k in reader.tensor_keys() if OPTIMIZER_KEY.match(k) and k not in wanted)
    if extra:
        raise UCPError(f"{reader.dir}: optimizer tensor(s) {extra[:3]}{' ...' if len(extra) > 3 else ''}"
                       f" ({len(extra)} in all) belong to no parameter of the model built from args")


def _plan_dp_reshardable(args, reader: DistReader, plan: dict[str, Param], chained: bool,
                         mamba_conv1d_module: bool | None = None) -> set[str]:
    """Attach each parameter's flat-buffer slabs, from megatron-core DDP at the source layout.
    Returns the buckets that hold replicas (read from their canonical copy, not from there).
    chained (a MoE run whose experts have their own buffers): the dense buffers of each
    model-parallel rank (`chained_0.`) and the expert buffers of each expert tensor-model-pipeline
    rank (`chained_1.`), see `optimizer_ranks`; a MoE run at EP1 keeps its experts in the dense
    buffers, mapped like every other parameter. mamba_conv1d_module: the saving release's Mamba
    conv1d form (`saved_mamba_conv1d_module`), whose order a hybrid model's buffers follow."""
    lay = layout(args)
    if lay.vpp or lay.cp > 1:
        raise UCPError(f"dp_reshardable torch_dist import supports TP/PP/DP layouts only (got {lay})")
    # the flat buffers follow the parameter order of the layer spec: a TE run's needs TE's layers
    te_required(args, f"{reader.dir}: its dp_reshardable optimizer buffers")
    replica_buckets = set()
    # the saving release's Mamba conv1d form orders a hybrid model's buffers (wrap_ddp)
    for mp_rank, prefix, buffers, lps in buffer_sets(args, chained, reader.dir, mamba_conv1d_module):
        for g, buf in enumerate(buffers):
            for param, (start, _end, b) in buf.param_index_map.items():
                lp = lps[id(param)]
                bucket = bucket_key(mp_rank, g, (buf.param_dtype, buf.grad_dtype), b, prefix)
                if not lp.canonical:
                    replica_buckets.add(bucket)
                    continue
                local_start = start - buf.buckets[b].offset
                if f"{bucket}.param" not in reader.meta:
                    raise UCPError(f"{reader.dir}: flat optimizer buffer "
                                   f"{bucket + '.param'!r} (model-parallel rank {mp_rank}) "
                                   "is missing")
                size = reader.shape(f"{bucket}.param")[0]
                if local_start + param.numel() > size:
                    raise UCPError(f"{reader.dir}: {bucket!r} has {size} elements but "
                                   f"{lp.spec.name!r} ends at {local_start + param.numel()}")
                if lp.spec.name not in plan:
                    raise UCPError(f"parameter {lp.spec.name!r} of model-parallel rank {mp_rank} "
                                   "is not in the TP1 model")
                plan[lp.spec.name].slabs.append(
                    (bucket, local_start + lp.base, lp.numel, lp.pieces))
    for name, p in plan.items():
        if p.buffer_dtype is not None:  # a persistent buffer (the router's expert_bias): no state
            continue
        covered = sum(math.prod(pc.shape) for s in p.slabs for pc in s[3])
        if covered != math.prod(p.spec["shape"]):
            raise UCPError(f"parameter {name!r}: the flat buffers cover {covered} of "
                           f"{math.prod(p.spec['shape'])} elements; layout not understood")
    return replica_buckets


def _plan_layer_wise(reader: DistReader, plan: dict[str, Param], opt: dict, args):
    """LayerWiseDistributedOptimizer (megatron-core 0.19, `--optimizer muon|lion`): which chained
    optimizer holds each parameter (its `fp32_param` key), that optimizer's family (by the states
    it stores: Muon's momentum_buffer, Lion's exp_avg, Adam's moments), the param groups of every
    chained optimizer, in order, and the steps (Adam's `common_step`; Muon and Lion count none).
    Returns (groups, step, chain, families, steps)."""
    by_chain: dict[int | None, dict[str, set[str]]] = {}  # chain -> model key -> its states
    model_keys = {key for p in plan.values() for key, _, _ in p.parts()}
    for k in reader.meta:
        m = LAYER_WISE_KEY.match(k)
        if not m:
            continue
        chain = None if m.group(1) is None else int(m.group(1))
        state, key = next(((st, key) for st in ("fp32_param", "momentum_buffer", "exp_avg_sq", "exp_avg")
                           for key in [m.group(2).removeprefix(st + ".")]
                           if m.group(2).startswith(st + ".") and key in model_keys), (None, None))
        if state is None:
            raise UCPError(f"{reader.dir}: LayerWiseDistributedOptimizer tensor {k!r} is no state of a "
                           "parameter of the model built from args (an unsupported optimizer state "
                           "or module?)")
        by_chain.setdefault(chain, {}).setdefault(key, set()).add(state)
    if not by_chain:
        raise UCPError(f"{reader.dir}: the run used the LayerWiseDistributedOptimizer "
                       "(use_layer_wise_distributed_optimizer in args) but the checkpoint holds no "
                       "`chained_<i>.optimizer.state.*` tensor (saved without its optimizer?)")
    fam = {c: layer_wise_family(set().union(*keys.values()), args,
                                f"{reader.dir}: chained optimizer {c}") for c, keys in by_chain.items()}
    chains = [opt[i] for i in sorted(k for k in opt if isinstance(k, int))] or [opt]
    groups = [(i, g) for i, o in enumerate(chains)
              for g in (o.get("optimizer") or {}).get("param_groups") or []]
    adam_steps = {}
    for i, o in enumerate(chains):
        st = (o.get("optimizer") or {}).get("state") or {}
        step = st.get("common_step") if isinstance(st, dict) else None
        step = group_step((o.get("optimizer") or {}).get("param_groups") or [], str(reader.dir)) \
            if step is None else float(step)
        adam_steps[i if len(chains) > 1 else None] = step
    chain_of, families, steps = {}, {}, {}
    for name, p in plan.items():
        if p.buffer_dtype is not None:
            continue
        keys = [key for key, _, _ in p.parts()]
        holders = {c for c, held in by_chain.items() for key in keys if key in held}
        if len(holders) != 1:
            raise UCPError(f"{reader.dir}: parameter {name!r} ({keys}) has its state in "
                           f"{'no' if not holders else len(holders)} chained optimizers "
                           f"{sorted(holders, key=str)} of the LayerWiseDistributedOptimizer (expected "
                           "one); the checkpoint is incomplete or not understood")
        c = holders.pop()
        f = fam[c]
        for key in keys:
            want = {"fp32_param", *OPTIMIZER_STATES[f]}
            if by_chain[c].get(key) != want:
                have = sorted(by_chain[c].get(key) or [])
                raise UCPError(f"{reader.dir}: tensor {key!r} has states {have} in chained "
                               f"optimizer {c} ({f}), expected {sorted(want)}")
        if f == "adam" and adam_steps.get(c) is None:
            raise UCPError(f"{reader.dir}: chained optimizer {c} (Adam) records no step "
                           "(`common_step`); the optimizer state was saved before the first step")
        chain_of[name], families[name] = c, f
        steps[name] = adam_steps[c] if f == "adam" else 0.0  # (as megatron-ucp's own saves)
    adam = {s for n, s in steps.items() if families[n] == "adam"}
    return groups, (adam.pop() if len(adam) == 1 else 0.0), chain_of, families, steps


def expert_tp(args) -> int:
    return getattr(args, "expert_tensor_parallel_size", None) or args.tensor_model_parallel_size


def _read_full(reader: DistReader, p: Param, state: str, sharding: str,
               chain: int | None = None) -> torch.Tensor:
    """One full fp32 universal tensor; master weights are verified against the stored bf16 model.
    A persistent buffer's only state is its stored value (as the live save and the legacy reader)."""
    if p.buffer_dtype is not None:
        if state != "param":
            raise UCPError(f"internal: buffer {p.spec['name']!r} has no optimizer state {state!r}")
        stored = reader.tensor(p.key)[p.index]
        if stored.dtype != p.buffer_dtype:
            raise UCPError(f"{reader.dir}: buffer {p.key!r} is {stored.dtype} but the model built "
                           f"from args keeps it in {p.buffer_dtype}")
        return stored.float().contiguous()
    if sharding == MODEL_ONLY:
        if state != "param":  # (a weights-only source: the reader of its form serves zeros)
            raise UCPError(f"internal: a model-only checkpoint has no optimizer state {state!r}")
        return p.stored(reader.tensor).float().contiguous()
    if sharding == LAYER_WISE:
        t = p.stored(lambda key: reader.tensor(layer_wise_key(chain, state, key))).clone()
    elif sharding == "fully_reshardable":
        t = p.stored(lambda key: reader.tensor(state_key(state, key))).clone()
    elif sharding == FLATTENED:
        t = _read_flattened(reader, p, state)
    else:
        t = torch.empty(p.spec["shape"], dtype=torch.float32)
        for bucket, start, numel, pieces in p.slabs:
            local = reader.tensor(f"{bucket}.{state}")[start:start + numel]
            for pc in pieces:
                t[pc.box] = pc.take(local)
    if t.dtype != torch.float32:
        raise UCPError(f"optimizer state {state} of {p.spec['name']!r} is {t.dtype}, expected float32")
    if state == "param":
        model = p.stored(reader.tensor)
        if not torch.equal(t.to(model.dtype), model):
            raise UCPError(f"{reader.dir}: master weight of {p.spec['name']!r} cast to {model.dtype} "
                           f"differs from the stored model tensor {p.key!r}{list(p.index)}; the "
                           "optimizer layout was not understood (refusing to write wrong state)")
    return t.contiguous()


def _read_flattened(reader: DistReader, p: Param, state: str) -> torch.Tensor:
    """One parameter's state from the flattened_range form: its rows (one per TP-local chunk,
    `layout.flattened_shape`) reshaped to the chunk and put at the chunk's place."""
    key = flattened_state_key(state, p.key)
    local = flattened_shape(reader.shape(p.key), reader.shape(key))  # checked in check_names
    stacked = len(p.index)
    rows = reader.tensor(key)[p.index]  # [chunks per unstacked axis..., chunk elements]
    chunk = local[stacked:]
    t = torch.empty(p.spec["shape"], dtype=rows.dtype)
    for at in product(*(range(n) for n in rows.shape[:-1])):
        t[tuple(slice(i * n, (i + 1) * n) for i, n in zip(at, chunk))] = rows[at].view(chunk)
    return t
