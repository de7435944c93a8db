"""Rank-side benchmark functions, run through `megatron_ucp.testing.launch` (one call per rank).

Each function returns this rank's JSON-able measurements; `bench/bench_checkpoint.py` aggregates
them. Every timed operation is bracketed by barriers (`_timed`), so a rank's time is the wall time
from the moment all ranks start until all ranks have finished; the driver takes the max over ranks.

The megatron-core anchor builds the sharded state dict the way Megatron-LM's
`megatron/training/checkpointing.py` does (`generate_state_dict` with the metadata of
`_build_sharded_state_dict_metadata`): unwrapped model chunks' `sharded_state_dict(metadata=...)`,
then `optimizer.sharded_state_dict(state_dict, metadata=...)` with `distrib_optim_sharding_type`
set to `dp_reshardable` or `fully_reshardable`, the scheduler state and the RNG `ShardedObject`,
saved with `dist_checkpointing.save` and the default torch_dist strategy.
"""

from __future__ import annotations  # noqa: I001  (tiny_gpt must come before megatron.core)

from megatron_ucp.testing import tiny_gpt as tg  # installs the CPU shim
from megatron_ucp.testing.cpu_shim import REAL_CUDA
from megatron_ucp.testing.scenarios import setup

import gc
import os
import random
import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.utils import unwrap_model

import megatron_ucp as ucp
from bench._measure import PeakMemory, copy_tree_fsync, dir_bytes, drop_page_cache, proc_io
from megatron_ucp.optimizer_state import OptimizerIndex, torch_optimizers
from megatron_ucp.spec import STATES
from megatron_ucp.param_spec import local_params

UCP = "ucp"
UCP_ASYNC = "ucp_async"
STAGING_COPY = "staging_copy"
RAW_WRITE = "raw_write"
MCORE_DP = "mcore_dp_reshardable"
MCORE_FULL = "mcore_fully_reshardable"
SHARDING = {MCORE_DP: "dp_reshardable", MCORE_FULL: "fully_reshardable"}


def _timed(fn: Callable[[], Any], sample_s: float, collective: bool = True) -> dict:
    """Run `fn` between barriers; wall seconds, peak memory, /proc/self/io deltas, fn's result.

    Before starting, flush all dirty pages (os.sync) so an op does not pay for the previous op's
    writeback, and collect garbage so freed tensors of the previous op are not counted.
    """
    gc.collect()
    os.sync()
    if collective:
        dist.barrier()
    io0 = proc_io()
    with PeakMemory(sample_s) as mem:
        t0 = time.perf_counter()
        out = fn()
        if collective:
            dist.barrier()
        seconds = time.perf_counter() - t0
    io1 = proc_io()
    return {"seconds": seconds, "mem": mem.result, "out": out,
            "io_read_bytes": io1.get("read_bytes", 0) - io0.get("read_bytes", 0),
            "io_write_bytes": io1.get("write_bytes", 0) - io0.get("write_bytes", 0)}


def _fresh_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def _keep_or_remove(path: Path, keep_as: Path | None) -> None:
    if keep_as is None:
        shutil.rmtree(path)
        return
    shutil.rmtree(keep_as, ignore_errors=True)
    path.rename(keep_as)


def _rank0_then_barrier(fn: Callable[[], Any]) -> Any:
    out = fn() if dist.get_rank() == 0 else None
    dist.barrier()
    return out


# ---------------------------------------------------------------- megatron-core dist_checkpointing


def mcore_metadata(sharding_type: str) -> dict:
    """Megatron-LM's `_build_sharded_state_dict_metadata` for a DistributedOptimizer run."""
    metadata: dict[str, Any] = {"distrib_optim_sharding_type": sharding_type}
    if sharding_type == "fully_reshardable":
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = False  # Megatron-LM default
    metadata["singleton_local_shards"] = False
    metadata["chained_optim_avoid_prefix"] = True
    metadata["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    return metadata


def _rng_sharded_object() -> ShardedObject:
    """Megatron-LM's `get_rng_state` for torch_dist (data_parallel_random_init off)."""
    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.cuda.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    return ShardedObject("rng_state", [state],
                         (ps.get_pipeline_model_parallel_world_size(),
                          ps.get_tensor_model_parallel_world_size()),
                         (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def mcore_state_dict(st: tg.TrainState, metadata: dict, is_loading: bool = False) -> dict:
    """Megatron-LM's `generate_state_dict` for ckpt_format='torch_dist'."""
    chunks = unwrap_model(st.model)
    sd: dict[str, Any] = {"checkpoint_version": 3.0, "iteration": st.iteration}
    for i, chunk in enumerate(chunks):
        sd["model" if len(chunks) == 1 else f"model{i}"] = chunk.sharded_state_dict(metadata=metadata)
    sd["optimizer"] = st.optimizer.sharded_state_dict(sd, is_loading=is_loading, metadata=metadata)
    sd["opt_param_scheduler"] = st.scheduler.state_dict()
    if not is_loading:  # RNG is per (PP, TP) rank: not loadable at another layout (--no-load-rng)
        sd["rng_state"] = _rng_sharded_object()
    return sd


def _content_metadata(metadata: dict) -> dict:
    return {k: v for k, v in metadata.items() if k != "dp_cp_group"}


def _save_strategy(fully_parallel: bool):
    if not fully_parallel:
        return None  # dist_checkpointing's default: TorchDistSaveShardedStrategy('torch_dist', 1)
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(),
                                            ps.get_data_parallel_group(with_context_parallel=True))


def mcore_save(st: tg.TrainState, ckpt_dir: Path, sharding_type: str,
               fully_parallel: bool = False) -> dict:
    t0 = time.perf_counter()
    metadata = mcore_metadata(sharding_type)
    sd = mcore_state_dict(st, metadata)
    t1 = time.perf_counter()
    dist_checkpointing.save(sd, str(ckpt_dir), sharded_strategy=_save_strategy(fully_parallel),
                            content_metadata=_content_metadata(metadata))
    del sd
    return {"state_dict_s": t1 - t0, "write_s": time.perf_counter() - t1}


def _patch_fully_reshardable_step() -> None:
    """Work around a megatron-core KeyError on the torch-Adam path (no TE/Apex, as here), present
    in 0.16.1 and still in 0.19.2 (whose `_set_main_param_and_optimizer_states` indexes the given
    tensors by every tensor key of the existing state, `step` included).

    `DistributedOptimizer.load_state_dict` gives every param's Adam state a `step` tensor (taken
    from param_groups), then `load_parameter_state_from_fully_reshardable` skips `step` and calls
    `_set_main_param_and_optimizer_states`, which copies every key of the existing state and so
    raises `KeyError: 'step'`. The patch passes the step that load_state_dict just set.
    """
    orig = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(orig, "bench_patched", False):
        return

    def patched(self, model_param, tensors):
        if "step" not in tensors:
            state = self._get_main_param_and_optimizer_states(model_param)
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}
        return orig(self, model_param, tensors)

    patched.bench_patched = True
    DistributedOptimizer._set_main_param_and_optimizer_states = patched


def mcore_load(st: tg.TrainState, ckpt_dir: Path) -> dict:
    """Megatron-LM's `load_checkpoint` path for torch_dist: build the sharded state dict for the
    current layout with the saved content metadata, load, then `load_state_dict` everything."""
    _patch_fully_reshardable_step()
    t0 = time.perf_counter()
    metadata = dist_checkpointing.load_content_metadata(str(ckpt_dir)) or {}
    metadata["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    sd = mcore_state_dict(st, metadata, is_loading=True)
    t1 = time.perf_counter()
    loaded = dist_checkpointing.load(sd, str(ckpt_dir))
    t2 = time.perf_counter()
    chunks = unwrap_model(st.model)
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded["model" if len(chunks) == 1 else f"model{i}"], strict=True)
    st.optimizer.load_state_dict(loaded["optimizer"])
    st.scheduler.load_state_dict(loaded["opt_param_scheduler"])
    st.iteration = int(loaded["iteration"])
    return {"state_dict_s": t1 - t0, "read_s": t2 - t1, "apply_s": time.perf_counter() - t2}


# ---------------------------------------------------------------------------------- save benchmark


def save_bench(layout: str, cfg: dict, train_steps: int, workdir: str, reps: int, ops: list[str],
               sample_s: float, warmup: int = 1, mcore_fully_parallel: bool = False) -> dict:
    """Train `train_steps`, then save `warmup` + `reps` rounds of every op in `ops`.

    Warm-up rounds have negative `rep` and pay one-time costs (first dist_checkpointing save spawns
    a multiprocessing Manager, lazy imports). The op order rotates each timed round. Keeps the last
    round of each op on disk under `workdir/<op>` for the load benchmark.
    """
    st = setup(layout, cfg)
    t0 = time.perf_counter()
    losses = [tg.train_step(st) for _ in range(train_steps)]
    train_s = time.perf_counter() - t0
    rank, work = dist.get_rank(), Path(workdir)
    records = []
    anchors = None
    for rep in range(-warmup, reps):
        k = max(rep, 0) % len(ops)
        for op in ops[k:] + ops[:k]:
            target = work / f"{op}.rep{rep}"
            _rank0_then_barrier(lambda t=target: _fresh_dir(t))
            if op == UCP:
                def fn(t: Path = target) -> None:
                    ucp.save(st.model, st.optimizer, st.scheduler, t, st.iteration, seed=st.config.seed)
            elif op == UCP_ASYNC:
                def fn(t: Path = target) -> dict:
                    return ucp_async_save(st, t)
            elif op in (STAGING_COPY, RAW_WRITE):
                anchors = anchors or CopyAnchors(st)
                fn = anchors.copy if op == STAGING_COPY else partial(anchors.write, target)
            else:
                def fn(t: Path = target, o: str = op) -> dict:
                    return mcore_save(st, t, SHARDING[o], mcore_fully_parallel)
            rec = _timed(fn, sample_s)
            rec.update(op=op, rep=rep)
            rec["disk_bytes"] = _rank0_then_barrier(lambda t=target: dir_bytes(t))
            records.append(rec)
            # keep the last round as `workdir/<op>`; delete the others at once (untimed)
            keep = work / op if rep == reps - 1 else None
            _rank0_then_barrier(lambda t=target, k=keep: _keep_or_remove(t, k))
    n_local = sum(p.numel() for m in st.model for p in m.parameters())
    coords = {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
              "dp": ps.get_data_parallel_rank()}
    iteration = st.iteration
    tg.destroy()
    return {"rank": rank, "coords": coords, "losses": losses, "train_seconds": train_s,
            "iteration": iteration, "local_params": n_local, "records": records}


def ucp_async_save(st: tg.TrainState, target: Path) -> dict:
    """megatron_ucp.save(async_save=True): the stall is until it returns (state staged on the host),
    the total until finalize has committed. Device memory added by the save is reported too."""
    on_gpu = REAL_CUDA
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    ucp.save(st.model, st.optimizer, st.scheduler, target, st.iteration, seed=st.config.seed,
             async_save=True)
    stall = time.perf_counter() - t0
    ucp.finalize(blocking=True)
    out = {"stall_s": stall, "total_s": time.perf_counter() - t0}
    if on_gpu:
        out["gpu_peak_delta_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return out


class CopyAnchors:
    """Anchors for the async save, over the same number of bytes as this rank's fragments
    (fp32 master weight + two Adam moments of its optimizer shard): one bare copy from device (or
    host) memory into a pinned host buffer, and one write of those bytes to a file with fsync."""

    def __init__(self, st: tg.TrainState) -> None:
        index = OptimizerIndex(st.optimizer)
        numel = 0  # what megatron_ucp.save writes: canonical copies only (not TP replicas, tied output)
        for lp in local_params(st.model):
            region = index.region_range(lp) if lp.canonical and not lp.spec.buffer else None
            if region is not None:
                numel += region[2] - region[1]
        self.nbytes = numel * 4 * len(STATES)
        self.on_gpu = REAL_CUDA
        device = torch.device("cuda", torch.cuda.current_device()) if REAL_CUDA else torch.device("cpu")
        self.src = torch.ones(self.nbytes, dtype=torch.uint8, device=device)
        self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=REAL_CUDA)

    def copy(self) -> dict:
        self.host.copy_(self.src, non_blocking=self.on_gpu)
        if self.on_gpu:
            torch.cuda.current_stream().synchronize()
        return None

    def write(self, target: Path) -> dict:
        with open(target / f"raw_{dist.get_rank():05d}.bin", "wb") as f:
            f.write(memoryview(self.host.numpy()))
            f.flush()
            os.fsync(f.fileno())
        return None


# ------------------------------------------------------------------------------- convert benchmark


def _read_all(src: Path) -> int:
    n = 0
    for p in sorted(src.rglob("*")):
        if p.is_file():
            with open(p, "rb", buffering=0) as f:
                while chunk := f.read(8 << 20):
                    n += len(chunk)
    return n


def convert_bench(src: str, workdir: str, reps: int, sample_s: float, cold: bool) -> dict:
    """One process, no process group: ucp.convert vs copy+fsync vs plain read of the same bytes."""
    src_dir = Path(src)
    ckpt = src_dir / (src_dir / "latest").read_text().strip() if (src_dir / "latest").exists() else src_dir
    work = Path(workdir)
    records = []
    for rep in range(reps):
        for op in ("convert", "copytree_fsync", "read_all"):
            out = work / f"{op}.rep{rep}"
            shutil.rmtree(out, ignore_errors=True)
            if cold:
                drop_page_cache(ckpt)
            fn: Callable[[], Any] = {
                "convert": lambda o=out: str(ucp.convert(ckpt, o, progress=False)),
                "copytree_fsync": lambda o=out: copy_tree_fsync(ckpt, o),
                "read_all": lambda: _read_all(ckpt),
            }[op]
            rec = _timed(fn, sample_s, collective=False)
            rec.update(op=op, rep=rep, in_bytes=dir_bytes(ckpt),
                       out_bytes=dir_bytes(out) if out.exists() else 0)
            records.append(rec)
            if op == "convert" and rep == reps - 1:
                shutil.rmtree(work / "universal", ignore_errors=True)
                out.rename(work / "universal")
            else:
                shutil.rmtree(out, ignore_errors=True)
    return {"records": records, "universal": str(work / "universal")}


# ---------------------------------------------------------------------------------- load benchmark


def _snapshot(st: tg.TrainState) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's optimizer shard (fp32 master + Adam moments) and model weights, by local name."""
    index = OptimizerIndex(st.optimizer)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for ci, chunk in enumerate(st.model):
        for name, p in unwrap_model(chunk).named_parameters():
            entry = {"model": p.detach().clone()}
            shard = index.shard_range(p)
            if shard is not None:
                tensors, step = index.get(p)
                entry.update({k: v.clone() for k, v in tensors.items()})
                entry["step"] = torch.tensor(step)
                # the model weight is the master weight cast to the model dtype after every step
                recast = tensors["param"].to(p.dtype).float()
                entry["master_vs_model"] = torch.tensor(float(
                    (p.detach().reshape(-1)[shard[0]:shard[1]].float() - recast).abs().max()))
            out[f"{ci}.{name}"] = entry
    return out


POISON = 12288.0  # exactly representable in bf16; far from any trained value


@torch.no_grad()
def _poison(st: tg.TrainState) -> None:
    """Overwrite model weights, fp32 master weights and Adam state with POISON before a load, so
    state a loader leaves untouched shows up in the cross-checks instead of carrying over."""
    for chunk in st.model:
        for p in chunk.parameters():
            p.fill_(POISON)
    for o in torch_optimizers(st.optimizer):
        for group in o.param_groups:
            for p in group["params"]:
                p.fill_(POISON)
                for v in o.state.get(p, {}).values():
                    if torch.is_tensor(v):
                        v.fill_(POISON)


def _consistency(snap: dict) -> dict:
    """max |cast(master) - model weight| over this rank's shard: 0 when the loaded optimizer state
    agrees with the loaded model weights (they were equal when the checkpoint was saved)."""
    bad = [n for n, e in snap.items() if "master_vs_model" in e and float(e["master_vs_model"]) > 0]
    worst = max((float(e["master_vs_model"]) for e in snap.values() if "master_vs_model" in e),
                default=0.0)
    return {"max_abs_diff": worst, "mismatched": bad}


def _compare(a: dict, b: dict) -> dict:
    """Max |a - b| per state over this rank's params, and the params where they differ."""
    diff = {k: 0.0 for k in ("model", *STATES, "step")}
    mismatched = []
    for name, ea in a.items():
        ea = {k: v for k, v in ea.items() if k != "master_vs_model"}
        eb = {k: v for k, v in b[name].items() if k != "master_vs_model"}
        if ea.keys() != eb.keys():
            raise RuntimeError(f"{name}: states differ between the two loads: {ea.keys()} vs {eb.keys()}")
        worst = 0.0
        for k, t in ea.items():
            d = float((t.float() - eb[k].float()).abs().max()) if t.numel() else 0.0
            diff[k] = max(diff[k], d)
            worst = max(worst, d)
        if worst > 0:
            mismatched.append(name)
    return {"max_abs_diff": diff, "mismatched": mismatched}


def load_bench(layout: str, cfg: dict, sources: dict[str, str], reps: int, sample_s: float,
               cold: bool) -> dict:
    """Load each source (op -> directory) `reps` times at `layout`; cross-check the loaded states.

    The state is poisoned before every load, and each op's last load is snapshotted; the snapshots
    are compared pairwise and each is checked for master/model-weight consistency.

    ops: "ucp_load" / "ucp_load_universal" (megatron_ucp.load), "mcore_load" (a megatron-core
    fully_reshardable checkpoint through dist_checkpointing.load, as Megatron-LM loads it) and
    "plain_read" (the anchor: rank 0 reads every file of the directory once, the others wait).
    """
    st = setup(layout, cfg)
    # Allocate Adam state up front (untimed): a fresh optimizer has none, and whichever loader ran
    # first would otherwise pay for allocating it (both loaders do this themselves when needed).
    OptimizerIndex(st.optimizer).ensure_state()
    rank = dist.get_rank()
    records, snapshots, failed = [], {}, {}
    for rep in range(reps):
        for op, src in sources.items():
            if op in failed:
                continue
            _poison(st)
            if cold:
                _rank0_then_barrier(lambda s=src: drop_page_cache(s))
            if op == "plain_read":  # the anchor, in the same launch: rank 0 reads every file
                def fn(s: str = src) -> dict:
                    return {"bytes": _read_all(Path(s)) if rank == 0 else 0}
            elif op.startswith("ucp"):
                def fn(s: str = src) -> dict:
                    r = ucp.load(st.model, st.optimizer, st.scheduler, s)
                    st.iteration = r.iteration
                    return {"bytes_read": r.bytes_read, "rng_restored": r.rng_restored}
            else:
                def fn(s: str = src) -> dict:
                    try:  # megatron-core cannot load every layout change (e.g. EP2 -> EP1)
                        return mcore_load(st, Path(s))
                    except Exception as e:  # reported in the table, not a crash of the bench
                        return {"error": f"{type(e).__name__}: {e}"}
            rec = _timed(fn, sample_s)
            if rec["out"].get("error"):
                failed[op] = rec["out"]["error"]
                continue
            rec.update(op=op, rep=rep)
            records.append(rec)
            if rep == reps - 1 and op != "plain_read":
                snapshots[op] = _snapshot(st)
    ops = [op for op in sources if op not in failed and op in snapshots]
    checks = {f"{a} vs {b}": _compare(snapshots[a], snapshots[b])
              for i, a in enumerate(ops) for b in ops[i + 1:]}
    consistency = {op: _consistency(snap) for op, snap in snapshots.items()}
    loss_after = tg.train_step(st)  # the loaded state trains (finite loss)
    tg.destroy()
    return {"rank": rank, "records": records, "checks": checks, "consistency": consistency,
            "loss_after_load": loss_after, "failed": failed}
