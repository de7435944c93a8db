"""Universal tensors -> a Megatron-LM `--ckpt-format torch_dist` checkpoint at any layout.

Every tensor is written at its global shape (layers stacked), with the optimizer state in the
layout-free `fully_reshardable` form, so the target layout changes only `args` and the rng shards;
torch.distributed.checkpoint itself reshards at load.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.megatron_common import (
    TRACKER,
    iteration_dir_name,
    prepare_export,
    rng_for,
    rng_shard_key,
    scheduler_state,
    single_step,
    torch_group,
)
from megatron_ucp.formats.megatron_dist.layout import (
    COMMON_FILE,
    FULLY_RESHARDABLE_CONTENT,
    METADATA_JSON,
    object_value,
    plan_model,
    sharded_objects,
    state_key,
)
from megatron_ucp.formats.megatron_rebuild import build_chunks, single_rank_args, source_rank
from megatron_ucp.layout import Layout
from megatron_ucp.progress import Progress, bar
from megatron_ucp.spec import STATES
from megatron_ucp.storage import staged_dir

log = logging.getLogger(__name__)


def write(source, save_dir: str | Path, target: Layout, args_template, *,
          rng_state: dict | list | None = None,
          num_floating_point_operations_so_far: float | None = None,
          first_stage_layers: int | None = None, last_stage_layers: int | None = None,
          progress: Progress = True) -> Path:
    """Write a Megatron-LM `--ckpt-format torch_dist` checkpoint at `target` from any source of
    universal tensors, optimizer state in the layout-free `fully_reshardable` form (resume with
    `--dist-ckpt-optim-fully-reshardable`). Returns `save_dir` (the save root).

    args_template: Megatron-LM args of the same model (e.g. the source checkpoint's); parallel
    sizes become the target's (`megatron_common.target_args`). rng_state: one rng list (Megatron's
    `rng_state` of one rank) for every (PP, TP) shard, or {(pp_rank, tp_rank): list}; None: no
    rng_state (resume with --no-load-rng). num_floating_point_operations_so_far: None writes 0.0.
    """
    t0 = time.perf_counter()
    args, out = prepare_export("torch_dist", source, save_dir, target, args_template,
                               first_stage_layers, last_stage_layers)
    manifest = source.manifest
    if getattr(args, "num_experts", None) or target.ep > 1:
        raise UCPError("torch_dist export supports dense GPT models only (MoE runs chain two "
                       "optimizers whose fully_reshardable keys are not written here)")
    args.ckpt_format = "torch_dist"
    args.use_dist_ckpt = True
    args.dist_ckpt_optim_fully_reshardable = True
    args.rank, args.local_rank = 0, 0  # common.pt is written by global rank 0
    iteration = int(manifest.iteration)

    # names, stacked keys and extra-state objects of the whole model, rebuilt on one rank
    plan, _ = plan_model(args)
    one = single_rank_args(args)
    with source_rank(one, 0):
        objects = sharded_objects(build_chunks(one)[0])
    saved = manifest.params
    missing = sorted(set(plan) - set(saved))
    if missing:
        raise UCPError(f"{source.dir}: the model rebuilt from the args template has parameter(s) "
                       f"{missing[:3]} that the checkpoint lacks; the args do not describe this "
                       "checkpoint's model")
    extra = sorted(set(saved) - set(plan))
    if extra:
        raise UCPError(f"{source.dir}: parameter(s) {extra[:3]} are not in the model rebuilt from "
                       "the args template; writing without them would drop state")
    step = single_step(source)
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
        states = ("param",) if buffer else STATES
        tensors = {s: torch.empty((*stacked, *shape), dtype=torch.float32) for s in states}
        for n in names:
            for s in states:
                tensors[s][plan[n].index] = full(n, s, shape)
            done.update(1)
        state_dict[key] = tensors["param"].to(dtype)
        if not buffer:
            for s in STATES:
                state_dict[state_key(s, key)] = tensors[s]
    done.close()
    for k, v in objects.items():
        state_dict[k] = object_value(v)
    if rng_state is not None:
        for pp_rank in range(target.pp):
            for tp_rank in range(target.tp):
                rs = rng_for(rng_state, (pp_rank, tp_rank))
                state_dict[rng_shard_key(pp_rank, tp_rank, target.pp, target.tp)] = object_value(rs)

    opt = manifest.optimizer
    groups = [torch_group(g, step) for g in opt.get("param_groups", []) if g.get("optimizer", 0) == 0]
    if not groups:
        raise UCPError(f"{source.dir}: the universal manifest has no optimizer param groups")
    if opt.get("grad_scaler"):
        raise UCPError("fp16 runs (a grad scaler) are not supported by the torch_dist export")
    common = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
              "optimizer": {"optimizer": {"param_groups": groups},
                            "param_state_sharding_type": "fully_reshardable"},
              "opt_param_scheduler": scheduler_state(manifest.scheduler),
              "num_floating_point_operations_so_far": float(num_floating_point_operations_so_far or 0.0),
              "content_metadata": dict(FULLY_RESHARDABLE_CONTENT)}

    with staged_dir(out) as partial:
        iter_dir = partial / iteration_dir_name(iteration)
        iter_dir.mkdir()
        dcp.save(state_dict, storage_writer=FileSystemWriter(str(iter_dir)),
                 planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                 no_dist=True)
        torch.save(common, iter_dir / COMMON_FILE)
        (iter_dir / "metadata.json").write_text(json.dumps(METADATA_JSON))
        (partial / TRACKER).write_text(str(iteration))
    log.info("wrote Megatron-LM torch_dist iteration %d at %s (fully_reshardable, %d parameters) "
             "into %s in %.2fs", iteration, target, len(plan), out, time.perf_counter() - t0)
    return out
