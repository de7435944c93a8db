"""Rank-side functions of bench/bench_object_store.py (run through megatron_ucp.testing.launch).

Every timed operation is bracketed by barriers: a rank's time is the wall time from the moment all
ranks start until all have finished (the driver takes the max over ranks).
"""

from __future__ import annotations  # noqa: I001  (tiny_gpt must come before megatron.core)

from megatron_ucp.testing import tiny_gpt as tg  # installs the CPU shim
from megatron_ucp.testing.scenarios import setup

import os
import time

import obstore
import torch
import torch.distributed as dist

import megatron_ucp as ucp
from megatron_ucp import storage
from megatron_ucp.storage import object_store, store_reads
from megatron_ucp.formats import manifest as mf
from megatron_ucp.storage import location


def _machine_jiffies() -> tuple[int, int]:
    """(all, idle) CPU time of this machine so far (/proc/stat), (0, 0) where there is none."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    return sum(ticks), ticks[3] + ticks[4]


def _between_barriers(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def save_bench(layout: str, cfg: dict, url: str, reps: int) -> dict:
    """`reps` rounds of: a synchronous save of the same state to `url/ours<i>`, then this rank's
    rank-file bytes uploaded by a raw obstore multipart put (same part size and concurrency).
    Alternated, after one untimed round of each, so that both see the same server state (a fresh
    SeaweedFS allocates volumes on its first writes) and the same load from other jobs."""
    st = setup(layout, cfg)
    tg.train_step(st)
    rank = dist.get_rank()

    def ours_save(i: int) -> None:
        ucp.save(st.model, st.optimizer, st.scheduler, f"{url}/ours{i}", st.iteration)
    ours_save(0)
    mine = location(f"{url}/ours0") / mf.iteration_dir_name(st.iteration) / f"rank_{rank:05d}.safetensors"
    nbytes = mine.size()
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy()
    store = object_store.store(mine.scheme, mine.bucket)

    def raw_put(i: int) -> None:
        obstore.put(store, f"{url.split('/', 3)[3]}/raw{i}/rank_{rank:05d}", memoryview(data),
                    chunk_size=object_store.PART_BYTES, max_concurrency=object_store.UPLOAD_STREAMS)
    raw_put(0)
    ours, raw = [], []
    for i in range(1, reps + 1):
        ours.append(_between_barriers(lambda i=i: ours_save(i)))
        raw.append(_between_barriers(lambda i=i: raw_put(i)))
    tg.destroy()
    return {"ours": ours, "raw": raw, "file_bytes": nbytes}


def load_bench(layout: str, cfg: dict, url: str, reps: int, local: str) -> dict:
    """`reps` rounds of: a load of `url/ours0` at `layout` (its own planned, merged ranged GETs),
    then the same number of bytes per rank file fetched by raw obstore get_ranges (one contiguous
    range per file: the best case for the store), after one untimed round of each; then the same
    load from a local copy (`local`, page cache warm: the load's work that is not storage)."""
    from bench._rank import _poison
    from bench._scale_rank import state_crc
    from megatron_ucp import loader

    st = setup(layout, cfg)
    planning: list[float] = []
    real_plan = loader.plan_reads

    def timed_plan(source, reads) -> None:
        t0 = time.perf_counter()
        real_plan(source, reads)
        planning.append(time.perf_counter() - t0)
    loader.plan_reads = timed_plan
    results = []

    def ours_load() -> None:
        results.append(ucp.load(st.model, st.optimizer, st.scheduler, f"{url}/ours0"))
    ours_load()
    r = results[-1]
    ckpt = location(str(r.checkpoint))
    files = sorted((p for p, _ in object_store.list_objects(ckpt) if p.name.startswith("rank_")), key=str)
    share = r.bytes_read // len(files)

    def raw_get() -> None:
        for p in files:
            object_store.get_ranges(p, [0], [share])
    raw_get()
    ours, raw, busy = [], [], []
    for _ in range(reps):
        ours.append(_between_barriers(ours_load))
        before = _machine_jiffies()
        raw.append(_between_barriers(raw_get))
        after = _machine_jiffies()
        if after[0] > before[0]:  # how much of the machine the raw GETs and the server kept busy
            busy.append(1 - (after[1] - before[1]) / (after[0] - before[0]))
    # each timed load's read phase (open, checks, plan, reads into the optimizer state) and its
    # DP all-gather of the model weights, from LoadResult
    phases = [(x.read_seconds, x.param_sync_seconds) for x in results[-reps:]]
    store_planning = list(planning)  # (a local load plans nothing)
    store_crc = state_crc(st)  # what the last load from the store left in this rank's state
    from_disk = [_between_barriers(lambda: ucp.load(st.model, st.optimizer, st.scheduler, local))
                 for _ in range(reps)]
    # cross-check (untimed): the local copy, loaded over poisoned state, gives the same bytes
    _poison(st)
    ucp.load(st.model, st.optimizer, st.scheduler, local)
    store_equals_local = state_crc(st) == store_crc
    tg.destroy()
    return {"ours": ours, "raw": raw, "local": from_disk, "planning": min(store_planning),
            "store_equals_local": store_equals_local,
            "ours_read": [r for r, _ in phases], "ours_param_sync": [p for _, p in phases],
            "bytes_read": r.bytes_read, "requests": r.requests, "files_opened": r.files_opened,
            "raw_machine_busy": busy}


def dcp_bench(layout: str, cfg: dict, url: str, reps: int, endpoint: str) -> dict:
    """The anchor torch users have: torch DCP's FsspecWriter / FsspecReader through s3fs, saving
    and loading this rank's tensors of our checkpoint (`url/ours0`: the same bytes, read back from
    the store) under `url/dcp<i>`, one file per rank, `reps` times each. DCP loads them at the
    layout that saved them (no resharding: DCP's own planner needs the model's sharded state)."""
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    setup(layout, cfg)
    rank = dist.get_rank()
    ours = location(f"{url}/ours0")
    mine = ours / (ours / storage.LATEST).read_text().strip() / f"rank_{rank:05d}.safetensors"
    obj = store_reads.SafetensorsObject(mine)
    state = {f"rank{rank}/{k}": obj.get_tensor(k) for k in obj.keys()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    opts = {"endpoint_url": endpoint, "key": os.environ["AWS_ACCESS_KEY_ID"],
            "secret": os.environ["AWS_SECRET_ACCESS_KEY"]}
    saves = [_between_barriers(lambda i=i: dcp_save(state, storage_writer=FsspecWriter(
        f"{url}/dcp{i}", sync_files=False, **opts))) for i in range(reps)]
    into = {k: torch.empty_like(v) for k, v in state.items()}
    loads = [_between_barriers(lambda i=i: dcp_load(into, storage_reader=FsspecReader(
        f"{url}/dcp{i}", **opts))) for i in range(reps)]
    same = all(torch.equal(into[k], v) for k, v in state.items())
    tg.destroy()
    return {"save": saves, "load": loads, "bytes": nbytes, "bitwise": same}


def _msc_enabled() -> None:
    """megatron-core's dist_checkpointing through multi-storage-client (MSC_CONFIG names the
    profile the driver wrote); raises if the package is missing."""
    from megatron.core.msc_utils import MultiStorageClientFeature

    MultiStorageClientFeature.enable()
    MultiStorageClientFeature.import_package()


def msc_save_bench(layout: str, cfg: dict, url: str, reps: int) -> dict:
    """megatron-core's torch_dist save (Megatron-LM's state dict, fully_reshardable optimizer) to
    `url<i>` (msc://), `reps` times."""
    from bench._rank import mcore_save

    _msc_enabled()
    st = setup(layout, cfg)
    tg.train_step(st)
    times = [_between_barriers(lambda i=i: mcore_save(st, f"{url}{i}", "fully_reshardable"))
             for i in range(reps)]
    tg.destroy()
    return {"save": times}


def msc_load_bench(layout: str, cfg: dict, url: str, reps: int) -> dict:
    """megatron-core's torch_dist load of `url0` at `layout` (another layout than the save's)."""
    from bench._rank import mcore_load
    from megatron_ucp.optimizer_state import OptimizerIndex

    _msc_enabled()
    st = setup(layout, cfg)
    OptimizerIndex(st.optimizer).ensure_state()  # (a fresh optimizer has no Adam state to load into)
    times = [_between_barriers(lambda: mcore_load(st, f"{url}0")) for _ in range(reps)]
    tg.destroy()
    return {"load": times}
