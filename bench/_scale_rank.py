"""Rank-side functions of bench/bench_scale.py, run through `megatron_ucp.testing.launch`.

`train_and_save`: build the GPT at the save layout, one train step (real Adam state), then time
`megatron_ucp.save`. `load`: build at the load layout and time `megatron_ucp.load` of each source.
Both return this rank's JSON-able measurements; the driver takes the max over ranks. Timing is
`bench._rank._timed` (os.sync, barrier, op, barrier), memory `bench._measure.PeakMemory`.

Both also return the global float64 sum of every state (fp32 master weight, exp_avg, exp_avg_sq)
over the canonical copies of all parameters, so the driver can check that what a load at another
layout holds is what the save wrote (the sum order differs across layouts: equal to ~1e-12
relative, not bitwise); the two loads at the same layout are compared bitwise (crc32 per shard).
"""

from __future__ import annotations  # noqa: I001  (tiny_gpt must come before megatron.core)

from megatron_ucp.testing import tiny_gpt as tg  # installs the CPU shim
from megatron_ucp.testing.scenarios import setup

import resource
import time
import zlib

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

import megatron_ucp as ucp
from bench._measure import drop_page_cache
from bench._rank import _poison, _rank0_then_barrier, _timed
from megatron_ucp.optimizer_state import OptimizerIndex
from megatron_ucp.spec import STATES
from megatron_ucp.param_spec import local_params
from megatron_ucp.storage import tensor_bytes


def _local_state_views(st: tg.TrainState) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """(name, {state: view}) of this rank's optimizer shard of every canonical parameter copy (TP
    replicas of replicated params are left out, so a sum over ranks counts every element once)."""
    index = OptimizerIndex(st.optimizer)
    out = []
    for lp in local_params(st.model):
        region = index.region_range(lp) if lp.canonical and not lp.spec.buffer else None
        if region is None:
            continue
        shard, a, b = region
        tensors, _ = index.get(lp.param)
        out.append((lp.spec.name, {s: tensors[s][a - shard[0]:b - shard[0]] for s in STATES}))
    return out


def state_sums(st: tg.TrainState) -> dict[str, float]:
    """Global float64 sum of each optimizer state over all parameters (collective)."""
    local = torch.zeros(len(STATES), dtype=torch.float64)
    for _, views in _local_state_views(st):
        for i, s in enumerate(STATES):
            local[i] += views[s].sum(dtype=torch.float64)
    dist.all_reduce(local)
    return {s: float(local[i]) for i, s in enumerate(STATES)}


def state_crc(st: tg.TrainState) -> int:
    """crc32 over this rank's optimizer shard and model weights, in a fixed order."""
    crc = 0
    for _, views in _local_state_views(st):
        for s in STATES:
            crc = zlib.crc32(tensor_bytes(views[s]), crc)
    for chunk in st.model:
        for p in chunk.parameters():
            crc = zlib.crc32(tensor_bytes(p.detach()), crc)
    return crc


def _global_params(st: tg.TrainState) -> int:
    """Elements of all canonical parameter copies, summed over ranks (each element once)."""
    n = torch.tensor([sum(lp.numel for lp in local_params(st.model) if lp.canonical and not lp.spec.buffer)],
                     dtype=torch.float64)
    dist.all_reduce(n)
    return int(n.item()) // ps.get_data_parallel_world_size()  # DP ranks hold the same copies


def train_and_save(layout: str, cfg: dict, save_dir: str, sample_s: float) -> dict:
    t0 = time.perf_counter()
    st = setup(layout, cfg)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    loss = tg.train_step(st)
    train_s = time.perf_counter() - t0
    rec = _timed(lambda: str(ucp.save(st.model, st.optimizer, st.scheduler, save_dir, st.iteration,
                                      seed=st.config.seed)), sample_s)
    out = {"rank": dist.get_rank(), "build_s": build_s, "train_s": train_s, "loss": loss,
           "save_s": rec["seconds"], "mem": rec["mem"], "io_write_bytes": rec["io_write_bytes"],
           "iter_dir": rec["out"], "params": _global_params(st), "state_sums": state_sums(st),
           "rank_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    tg.destroy()
    return out


def load(layout: str, cfg: dict, sources: dict[str, str], sample_s: float, cold: bool) -> dict:
    """Time `megatron_ucp.load` of each source (name -> directory) once, in order, with the model
    and optimizer state overwritten by a sentinel before each load (so the checks see only what
    the load wrote) and, with `cold`, the source's files evicted from the page cache."""
    st = setup(layout, cfg)
    # Adam state allocated up front (untimed): a fresh optimizer has none, and the first load
    # would otherwise pay for allocating it.
    OptimizerIndex(st.optimizer).ensure_state()
    records = {}
    for name, src in sources.items():
        _poison(st)
        if cold:
            _rank0_then_barrier(lambda s=src: drop_page_cache(s))

        def fn(s: str = src) -> dict:
            r = ucp.load(st.model, st.optimizer, st.scheduler, s)
            return {"bytes_read": r.bytes_read, "iteration": r.iteration}

        rec = _timed(fn, sample_s)
        records[name] = {"seconds": rec["seconds"], "mem": rec["mem"], "bytes_read": rec["out"]["bytes_read"],
                         "io_read_bytes": rec["io_read_bytes"], "iteration": rec["out"]["iteration"],
                         "crc": state_crc(st), "state_sums": state_sums(st)}
    out = {"rank": dist.get_rank(), "records": records,
           "rank_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    tg.destroy()
    return out
