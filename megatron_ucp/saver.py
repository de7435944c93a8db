"""Save: every rank writes its own fragments; only metadata crosses ranks; the commit is atomic.

Commit protocol: all ranks write into `<root>/.iter_XXXXXXX.partial/` and fsync their file; after
a barrier rank 0 writes manifest.json, fsyncs, renames the directory to `iter_XXXXXXX` and then
atomically replaces `<root>/latest`. A crash at any point leaves `latest` on the previous
checkpoint; a `.partial` directory is never loaded.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch.distributed as dist

from megatron_ucp import manifest as mf
from megatron_ucp import rng
from megatron_ucp.errors import UCPError
from megatron_ucp.fragments import Fragment, rank_file_name, write_rank_file
from megatron_ucp.layout import Layout
from megatron_ucp.optimizer_state import OptimizerIndex
from megatron_ucp.param_spec import local_params
from megatron_ucp.storage import fsync_dir
from megatron_ucp.validation import model_config


def save(model_chunks: list, optimizer, scheduler, path: str | Path, iteration: int, *,
         extra: dict | None = None, seed: int = 1234, vocab_size: int | None = None) -> Path:
    """Save a fragment checkpoint of model + DistributedOptimizer + scheduler under `path`.

    extra: JSON-able training state (consumed samples, ...) returned by `load`.
    seed: the run's base seed, used to re-derive RNG streams when resuming at another layout.
    vocab_size: the true (unpadded) vocabulary size. With it, a load may change the vocab padding
        (Megatron-LM pads to a multiple of make_vocab_size_divisible_by x TP) and the universal
        form keeps only the true rows. Without it the padded size must stay the same.
    Returns the committed directory `path/iter_XXXXXXX`. Collective: call on every rank.
    """
    t0 = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = Layout.current()
    root = Path(path)
    final = root / mf.iteration_dir_name(iteration)
    partial = root / f".{final.name}.partial"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
    dist.barrier()

    index = OptimizerIndex(optimizer)
    params = local_params(model_chunks)
    fragments = []
    for lp in params:
        if lp.spec.buffer and lp.canonical:
            fragments.append(Fragment(lp.spec.name, lp.local_shape, lp.pieces, 0, lp.numel, 0.0,
                                      {"param": lp.region(lp.param.detach()).float()}))
            continue
        shard = index.shard_range(lp.param) if lp.canonical else None
        if shard is None:
            continue
        # the part of the optimizer shard inside this universal tensor's region of the parameter
        a, b = max(shard[0], lp.base), min(shard[1], lp.base + lp.numel)
        if b <= a:
            continue
        tensors, step = index.get(lp.param)
        tensors = {s: t[a - shard[0]:b - shard[0]] for s, t in tensors.items()}
        fragments.append(Fragment(lp.spec.name, lp.local_shape, lp.pieces, a - lp.base, b - lp.base,
                                  step, tensors))
    rng_tensors, rng_meta = rng.capture()
    from megatron.core import parallel_state as ps

    coords = {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
              "dp": ps.get_data_parallel_rank()}
    nbytes = write_rank_file(partial / rank_file_name(rank), fragments, rng_tensors, rng_meta, coords)

    # Metadata only: each rank's parameter specs (names, shapes, split axes).
    specs = [lp.spec.to_json() for lp in params]
    gathered = [None] * world
    dist.all_gather_object(gathered, (specs, nbytes))  # also the barrier before commit

    if rank == 0:
        manifest = {
            "format": mf.FORMAT, "version": mf.VERSION, "kind": "fragments",
            "iteration": iteration, "layout": layout.to_json(), "layout_world_size": world,
            "model": {**model_config(model_chunks), "unpadded_vocab_size": vocab_size},
            "params": _merge_specs(gathered),
            "optimizer": {"param_groups": index.param_groups(), "grad_scaler": index.grad_scaler()},
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "extra": extra or {}, "seed": seed,
            "files": [rank_file_name(r) for r in range(world)],
            "bytes": sum(g[1] for g in gathered),
        }
        mf.write(partial, manifest)
        fsync_dir(partial)
        if final.exists():  # re-saving an iteration: swap, never delete the old one first
            old = root / f".{final.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            partial.rename(final)
            shutil.rmtree(old)
        else:
            partial.rename(final)
        fsync_dir(root)
        mf.write_latest(root, final.name)
    dist.barrier()
    if rank == 0:
        print(f"[megatron-ucp] saved iteration {iteration} at {layout} to {final} "
              f"in {time.perf_counter() - t0:.2f}s", flush=True)
    return final


def _merge_specs(gathered: list) -> dict:
    merged: dict[str, dict] = {}
    for specs, _ in gathered:
        for spec in specs:
            prev = merged.setdefault(spec["name"], {**spec, "aliases": []})
            if {**prev, "aliases": []} != {**spec, "aliases": []}:
                raise UCPError(f"parameter {spec['name']}: ranks disagree on its spec ({prev} vs {spec})")
            prev["aliases"] = sorted(set(prev["aliases"]) | set(spec["aliases"]))
    return dict(sorted(merged.items()))
