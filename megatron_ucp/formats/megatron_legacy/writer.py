"""Universal tensors -> a stock Megatron-LM `--ckpt-format torch` checkpoint at any layout.

The target model, its DDP buffers and their rank directories are rebuilt with megatron-core's own
code (fake process group, meta tensors), so flat offsets are the ones the target run uses; each
rank directory's tensors are read from the source box by box (`local_slice.read_local`).
"""

from __future__ import annotations

import argparse
import collections
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state as ps

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.megatron_common import (
    TRACKER,
    chained_groups,
    check_export,
    iteration_dir_name,
    prepare_export,
    rng_for,
    scheduler_state,
    single_step,
    torch_group,
    writer_ranks,
)
from megatron_ucp.formats.megatron_legacy import layer_wise as lw_files
from megatron_ucp.formats.megatron_legacy.layout import (
    LAYER_WISE_FILE,
    MODEL_FILE,
    OPTIM_FILE,
    flat_offsets,
    optimizer_buffers,
    rank_context,
)
from megatron_ucp.formats.megatron_legacy.reader import LegacySource
from megatron_ucp.formats.megatron_rebuild import build_chunks, wrap_ddp
from megatron_ucp.formats.megatron_te import export_check, legacy_names, legacy_payload
from megatron_ucp.layout import Layout
from megatron_ucp.local_slice import read_local
from megatron_ucp.param_spec import local_params
from megatron_ucp.progress import Progress, bar
from megatron_ucp.spec import STATES
from megatron_ucp.storage import staged_dir

log = logging.getLogger(__name__)


def write(source, save_dir: str | Path, target: Layout, args_template,
          *, rng_state: dict | list | None = None,
          num_floating_point_operations_so_far: float | None = None,
          first_stage_layers: int | None = None, last_stage_layers: int | None = None,
          progress: Progress = True) -> Path:
    """Write a stock Megatron-LM `--ckpt-format torch` checkpoint (distributed optimizer:
    `distrib_optim.pt`; a LayerWiseDistributedOptimizer run, args of `--optimizer muon|lion`:
    `layer_wise_optimizer_<dp>.pt`, `megatron_legacy.layer_wise`) at `target` from any source of
    universal tensors. Returns `save_dir` (the save root).

    args_template: a Megatron-LM args Namespace of the same model (e.g. the source legacy
    checkpoint's `args`); its parallel sizes are replaced by the target's (`target_args`).
    rng_state: the `rng_state` list written in every rank directory, or a dict keyed by rank
    directory name or by (PP rank, TP rank) (a rank not in it gets the first entry); None: no
    `rng_state` key (resume with --no-load-rng). num_floating_point_operations_so_far: None
    writes 0.0.
    """
    t0 = time.perf_counter()
    args, out = prepare_export("legacy", source, save_dir, target, args_template,
                               first_stage_layers, last_stage_layers)
    args.ckpt_format = "torch"  # the template may be a torch_dist run's args (its common.pt)
    args.use_dist_ckpt = False
    manifest = source.manifest
    layer_wise = _layer_wise(source, args)
    iteration = int(manifest.iteration)
    writers = writer_ranks(args)
    done = bar(progress, len(writers), "export-legacy", "rank")
    fp8, written = source.te_states(), set()  # Transformer Engine FP8 state, by module
    read_back = export_check(check_export, source, LegacySource, args, written)  # tensors, FP8

    with staged_dir(out, TRACKER, check=read_back) as partial:
        iter_dir = partial / iteration_dir_name(iteration)
        iter_dir.mkdir()
        try:
            for name, rank in sorted(writers.items(), key=lambda kv: kv[1]):
                with rank_context(args, rank, name):
                    try:
                        chunks = wrap_ddp(build_chunks(args), args)
                    except UCPError:
                        raise
                    except Exception as e:
                        raise UCPError(f"cannot build the model at {target} from the args template "
                                       f"({type(e).__name__}: {e}); an uneven pipeline split needs "
                                       "first_stage_layers / last_stage_layers") from e
                    t = _inspect_target(chunks, args, name)
                    position = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank())
                model_keys = ["model"] if len(t.keys) == 1 else [f"model{i}" for i in range(len(t.keys))]
                if layer_wise:  # no flat buffer: its state goes to layer_wise_optimizer_<dp>.pt
                    t.flat = [None] * len(t.flat)
                models, optim = _target_files(t, source, model_keys, fp8, written)
                # LayerWise: each DP rank's layer_wise_optimizer_<dp>.pt, DP rank 0's in the model file
                per_dp = lw_files.rank_dir_files(source, args, name) if layer_wise else None
                rank_args = argparse.Namespace(**{**vars(args), "rank": rank, "local_rank": rank})
                state: dict = {"args": rank_args, "checkpoint_version": 3.0, "iteration": iteration}
                state.update(zip(model_keys, models))
                state["optimizer"] = per_dp[0] if layer_wise else _param_groups(source, len(t.flat))
                state["opt_param_scheduler"] = scheduler_state(manifest.scheduler)
                if rng_state is not None:
                    state["rng_state"] = rng_for(rng_state, name, position)
                state["num_floating_point_operations_so_far"] = float(
                    num_floating_point_operations_so_far or 0.0)
                rank_dir = iter_dir / name
                rank_dir.mkdir()
                torch.save(state, rank_dir / MODEL_FILE)
                if layer_wise:
                    for dp, saved in per_dp.items():
                        torch.save(saved, rank_dir / LAYER_WISE_FILE.format(dp=dp))
                else:
                    torch.save(optim, rank_dir / OPTIM_FILE)
                done.update(1)
        finally:
            done.close()
        (partial / TRACKER).write_text(str(iteration))
    log.info("wrote Megatron-LM legacy iteration %d at %s (%d rank dirs) into %s in %.2fs",
             iteration, target, len(writers), out, time.perf_counter() - t0)
    return out


@dataclass
class _TargetRank:
    """What one target rank directory needs, read off the model rebuilt at the target layout."""

    name: str
    keys: list[list[tuple[str, Any]]]  # per chunk: (state-dict key, non-tensor value or _TENSOR)
    params: list  # LocalParam
    flat: list[dict[int, tuple[tuple, int]] | None]  # per optimizer: buffer -> (dtypes, numel)
    where: dict[int, tuple[int, int, int]]  # id(param) -> (optimizer, buffer, start)
    # per chunk: a TE module's `_extra_state` key -> the universal names of its gemms
    extra: list[dict[str, list[str]]]


_TENSOR = object()
_EXTRA = object()  # a Transformer Engine module's `_extra_state`: the source's FP8 state for it


def _inspect_target(chunks: list, args, name: str) -> _TargetRank:
    from megatron.core import parallel_state as ps
    from megatron.core.utils import unwrap_model

    extra = [legacy_names(unwrap_model(c)) for c in chunks]
    keys = [[(k, _EXTRA if k.endswith("._extra_state") and torch.is_tensor(v) else
              _TENSOR if torch.is_tensor(v) else v)
             for k, v in unwrap_model(c).state_dict(keep_vars=True).items()] for c in chunks]
    buffers = optimizer_buffers(chunks, args)
    expert = any(c.expert_parallel_buffers for c in chunks)
    flat, where = [], {}
    for i, bufs in enumerate(buffers):
        is_expert = expert and i == len(buffers) - 1
        dp0 = (ps.get_expert_data_parallel_rank() if is_expert else ps.get_data_parallel_rank()) == 0
        flat.append({b: ((buf.param_dtype, buf.grad_dtype), buf.numel_unpadded)
                     for b, buf in enumerate(bufs)} if dp0 else None)
        for b, buf in enumerate(bufs):
            for p, start in flat_offsets(buf).items():
                where[id(p)] = (i, b, start)
    return _TargetRank(name, keys, local_params(chunks), flat, where, extra)


def _layer_wise(source, args) -> bool:
    """Whether the target is a LayerWiseDistributedOptimizer run (its own optimizer files); the
    state of another optimizer than Adam's for a DistributedOptimizer target is refused by name."""
    if getattr(args, "use_layer_wise_distributed_optimizer", False):
        return True
    other = sorted({p.spec.optimizer for p in source.manifest.params.values()
                    if not p.spec.buffer and p.spec.optimizer != "adam"})
    if other:
        raise UCPError(f"{source.dir}: holds {', '.join(other)} optimizer state, but the args "
                       f"describe a DistributedOptimizer run (--optimizer {getattr(args, 'optimizer', '?')}),"
                       f" whose {OPTIM_FILE} megatron-ucp writes for Adam only; Muon and Lion state "
                       "goes into a LayerWiseDistributedOptimizer run's files (args of an "
                       "--optimizer muon|lion --use-distributed-optimizer run)")
    return False


def _target_files(t: _TargetRank, source, model_keys: list[str], fp8: dict,
                  written: set) -> tuple[list[dict], Any]:
    """(model state dict per chunk, distrib_optim.pt object) of one target rank directory. fp8:
    the source's FP8 states (`Source.te_states`); the names written go into `written`."""
    saved = source.manifest.params
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
            if v is _EXTRA:  # TE's payload (empty without FP8 state, or for a module not declared)
                gemms = t.extra[c].get(k, [])
                v = legacy_payload(gemms, fp8, f"{model_keys[c]} {k}")
                written.update(n for n in gemms if n in fp8)
            elif v is _TENSOR:
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
    step = single_step(source)
    opt = source.manifest.optimizer
    out = []
    for i, chained in enumerate(chained_groups(opt.get("param_groups", []), n_optimizers)):
        groups = [torch_group(g, step) for g in chained]
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
