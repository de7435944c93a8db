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

import gc
import os
import random
import shutil
import time
from collections.abc import Callable
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

from bench._measure import PeakMemory, dir_bytes, drop_page_cache, proc_io
from megatron_ucp.consolidate import convert as ucp_convert
from megatron_ucp.layout import Layout
from megatron_ucp.load import load as ucp_load
from megatron_ucp.optimizer_state import STATES, OptimizerIndex
from megatron_ucp.save import save as ucp_save

# Not `megatron_ucp.save(...)`: the package's lazy attribute returns the function on first access
# only; importing the submodule `megatron_ucp.save` then shadows it with the module (same for load).

UCP = "ucp"
MCORE_DP = "mcore_dp_reshardable"
MCORE_FULL = "mcore_fully_reshardable"
SHARDING = {MCORE_DP: "dp_reshardable", MCORE_FULL: "fully_reshardable"}


def _setup(layout: str, cfg: dict) -> tg.TrainState:
    lay = Layout.parse(layout)
    tg.init_distributed(lay)
    return tg.build(tg.TinyGPTConfig(**cfg), lay)


def _timed(fn: Callable[[], Any], sample_s: float, collective: bool = True) -> dict:
    """Run `fn` between barriers; wall seconds, peak memory, /proc/self/io deltas, fn's result."""
    gc.collect()
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
    """Work around a megatron-core 0.16.1 KeyError on the torch-Adam path (no TE/Apex, as here).

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
               sample_s: float, mcore_fully_parallel: bool = False) -> dict:
    """Train `train_steps`, then save `reps` times with every op in `ops` (order rotated per rep).

    Keeps the last repetition of each op on disk under `workdir/<op>` for the load benchmark.
    """
    st = _setup(layout, cfg)
    t0 = time.perf_counter()
    losses = [tg.train_step(st) for _ in range(train_steps)]
    train_s = time.perf_counter() - t0
    rank, work = dist.get_rank(), Path(workdir)
    records = []
    for rep in range(reps):
        order = ops[rep % len(ops):] + ops[:rep % len(ops)]
        for op in order:
            target = work / f"{op}.rep{rep}"
            _rank0_then_barrier(lambda t=target: _fresh_dir(t))
            if op == UCP:
                def fn(t: Path = target) -> None:
                    ucp_save(st.model, st.optimizer, st.scheduler, t, st.iteration, seed=st.config.seed)
            else:
                def fn(t: Path = target, o: str = op) -> dict:
                    return mcore_save(st, t, SHARDING[o], mcore_fully_parallel)
            rec = _timed(fn, sample_s)
            rec.update(op=op, rep=rep)
            rec["disk_bytes"] = _rank0_then_barrier(lambda t=target: dir_bytes(t))
            records.append(rec)
    # keep the last repetition of each op as `workdir/<op>`, remove the others
    def _tidy() -> None:
        for op in ops:
            for rep in range(reps):
                d = work / f"{op}.rep{rep}"
                if rep == reps - 1:
                    shutil.rmtree(work / op, ignore_errors=True)
                    d.rename(work / op)
                else:
                    shutil.rmtree(d)
    _rank0_then_barrier(_tidy)
    n_local = sum(p.numel() for m in st.model for p in m.parameters())
    coords = {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
              "dp": ps.get_data_parallel_rank()}
    iteration = st.iteration
    tg.destroy()
    return {"rank": rank, "coords": coords, "losses": losses, "train_seconds": train_s,
            "iteration": iteration, "local_params": n_local, "records": records}


# ------------------------------------------------------------------------------- convert benchmark


def _copy_and_fsync(src: Path, dst: Path) -> int:
    shutil.copytree(src, dst)
    n = 0
    for p in sorted(dst.rglob("*")):
        if p.is_file():
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
            n += p.stat().st_size
    return n


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
                "convert": lambda o=out: str(ucp_convert(ckpt, o, progress=False)),
                "copytree_fsync": lambda o=out: _copy_and_fsync(ckpt, o),
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
            if index.shard_range(p) is not None:
                tensors, step = index.get(p)
                entry.update({k: v.clone() for k, v in tensors.items()})
                entry["step"] = torch.tensor(step)
            out[f"{ci}.{name}"] = entry
    return out


def _compare(a: dict, b: dict) -> dict:
    """Max |a - b| per state over this rank's params, and the params where they differ."""
    diff = {k: 0.0 for k in ("model", *STATES, "step")}
    mismatched = []
    for name, ea in a.items():
        eb = b[name]
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

    ops: "ucp_load" / "ucp_load_universal" (megatron_ucp.load) and "mcore_load" (a megatron-core
    fully_reshardable checkpoint through dist_checkpointing.load, as Megatron-LM loads it).
    """
    st = _setup(layout, cfg)
    rank = dist.get_rank()
    records, snapshots = [], {}
    for rep in range(reps):
        for op, src in sources.items():
            if cold:
                _rank0_then_barrier(lambda s=src: drop_page_cache(s))
            if op.startswith("ucp"):
                def fn(s: str = src) -> dict:
                    r = ucp_load(st.model, st.optimizer, st.scheduler, s)
                    st.iteration = r.iteration
                    return {"bytes_read": r.bytes_read, "rng_restored": r.rng_restored}
            else:
                def fn(s: str = src) -> dict:
                    return mcore_load(st, Path(s))
            rec = _timed(fn, sample_s)
            rec.update(op=op, rep=rep)
            records.append(rec)
            if rep == reps - 1:
                snapshots[op] = _snapshot(st)
    ops = list(sources)
    checks = {f"{a} vs {b}": _compare(snapshots[a], snapshots[b])
              for i, a in enumerate(ops) for b in ops[i + 1:]}
    loss_after = tg.train_step(st)  # the loaded state trains (finite loss)
    tg.destroy()
    return {"rank": rank, "records": records, "checks": checks, "loss_after_load": loss_after}
