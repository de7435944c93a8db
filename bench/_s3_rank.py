"""Rank-side functions of bench/bench_object_store.py (run through megatron_ucp.testing.launch).

Every timed operation is bracketed by barriers: a rank's time is the wall time from the moment all
ranks start until all have finished (the driver takes the max over ranks).
"""

from __future__ import annotations  # noqa: I001  (tiny_gpt must come before megatron.core)

from megatron_ucp.testing import tiny_gpt as tg  # installs the CPU shim
from megatron_ucp.testing.scenarios import setup

import time

import obstore
import torch
import torch.distributed as dist

import megatron_ucp as ucp
from megatron_ucp import object_store
from megatron_ucp.formats import manifest as mf
from megatron_ucp.storage import location


def _between_barriers(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def save_bench(layout: str, cfg: dict, url: str, reps: int) -> dict:
    """`reps` synchronous saves of the same state to `url/ours<i>`; then this rank's rank-file bytes
    uploaded by a raw obstore multipart put (same part size and concurrency), `reps` times."""
    st = setup(layout, cfg)
    tg.train_step(st)
    rank = dist.get_rank()
    ours = [_between_barriers(lambda i=i: ucp.save(st.model, st.optimizer, st.scheduler, f"{url}/ours{i}",
                                                    st.iteration)) for i in range(reps)]
    mine = location(f"{url}/ours0") / mf.iteration_dir_name(st.iteration) / f"rank_{rank:05d}.safetensors"
    nbytes = mine.size()
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy()
    store = object_store.store(mine.scheme, mine.bucket)

    def raw_put(i: int) -> None:
        obstore.put(store, f"{url.split('/', 3)[3]}/raw{i}/rank_{rank:05d}", memoryview(data),
                    chunk_size=object_store.PART_BYTES, max_concurrency=object_store.UPLOAD_STREAMS)
    raw = [_between_barriers(lambda i=i: raw_put(i)) for i in range(reps)]
    tg.destroy()
    return {"ours": ours, "raw": raw, "file_bytes": nbytes}


def load_bench(layout: str, cfg: dict, url: str, reps: int, local: str) -> dict:
    """`reps` loads of `url/ours0` at `layout` (its own planned, merged ranged GETs); the same
    load from a local copy (`local`, page cache warm: the load's work that is not storage); then
    the same number of bytes per rank file fetched by raw obstore get_ranges (one contiguous
    range per file: the best case for the store), `reps` times."""
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
    ours = [_between_barriers(lambda: results.append(ucp.load(st.model, st.optimizer, st.scheduler,
                                                                f"{url}/ours0"))) for _ in range(reps)]
    from_disk = [_between_barriers(lambda: ucp.load(st.model, st.optimizer, st.scheduler, local))
                 for _ in range(reps)]
    r = results[-1]
    ckpt = location(str(r.checkpoint))
    files = sorted((p for p, _ in object_store.list_objects(ckpt) if p.name.startswith("rank_")), key=str)
    share = r.bytes_read // len(files)

    def raw_get() -> None:
        for p in files:
            object_store.get_ranges(p, [0], [share])
    raw = [_between_barriers(raw_get) for _ in range(reps)]
    tg.destroy()
    return {"ours": ours, "raw": raw, "local": from_disk, "planning": max(planning),
            "bytes_read": r.bytes_read, "requests": r.requests, "files_opened": r.files_opened}
