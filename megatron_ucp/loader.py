"""Load a fragment or universal checkpoint into a run at any TP/PP/DP layout.

Each rank asks its own model which box of each universal tensor its local slice is, narrows that
to the rows covering its distributed-optimizer range, and reads only those bytes. Master weights
and Adam moments go straight into the optimizer shard; model weights are then produced by the
optimizer's own main->model copy and DP all-gather, exactly as after a training step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_ucp import rng
from megatron_ucp.errors import UCPError
from megatron_ucp.layout import Layout
from megatron_ucp.optimizer_state import OptimizerIndex
from megatron_ucp.param_spec import LocalParam, local_params
from megatron_ucp.sources import open_source
from megatron_ucp.spec import STATES
from megatron_ucp.validation import check_layout, check_model_config, model_config


@dataclass
class LoadResult:
    iteration: int
    extra: dict
    checkpoint: Path
    source_layout: Layout
    rng_restored: bool  # False: layout changed, generators re-derived from the seed
    bytes_read: int  # by this rank


def read_rows(source, lp: LocalParam, state: str, r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) of this rank's local tensor of `lp`, assembled from universal boxes.

    Vocab padding rows the checkpoint does not hold (the target pads more, or the universal form
    dropped them) are zero in the weight and in both Adam moments: they start as unused rows.
    """
    out = torch.zeros((r1 - r0, *lp.local_shape[1:]), dtype=torch.float32)
    saved_rows = source.manifest["params"][lp.spec.name]["shape"][0]
    for pc in lp.pieces:
        a, b = max(r0, pc.row), min(r1, pc.row + pc.shape[0])
        g0 = pc.offset[0] + a - pc.row  # first global row
        b = min(b, a + saved_rows - g0) if lp.spec.vocab_rows else b
        if b <= a:
            continue
        offset = (g0, *pc.offset[1:])
        out[a - r0:b - r0] = source.read(lp.spec.name, state, offset, (b - a, *pc.shape[1:]))
    return out


def _check_params(source, params: list[LocalParam], strict: bool) -> None:
    saved = source.manifest["params"]
    where = source.dir
    true_vocab = source.manifest["model"].get("unpadded_vocab_size")
    for lp in params:
        spec = saved.get(lp.spec.name)
        if spec is None:
            raise UCPError(f"{where}: the model's parameter {lp.spec.name} (local name "
                           f"{lp.local_name}) is not in the checkpoint; the model has a module the "
                           "saved run did not have: build the checkpoint's architecture")
        for k in ("shape", "tp_axis", "tp_blocks"):
            mine = list(lp.spec.shape) if k == "shape" else getattr(lp.spec, k)
            if (k == "shape" and lp.spec.vocab_rows and true_vocab and spec[k][1:] == mine[1:]
                    and mine[0] >= true_vocab):
                continue  # only the vocab padding differs; read_rows re-pads
            if spec[k] != mine:
                raise UCPError(f"{where}: parameter {lp.spec.name}: checkpoint {k}={spec[k]}, "
                               f"model {k}={mine}; the model architecture differs")
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted({lp.spec.name for lp in params}))
    extra = sorted(set(saved) - set().union(*names))
    if extra and strict:
        raise UCPError(f"{where}: the checkpoint has parameters the model lacks: {extra[:5]}"
                       f"{' ...' if len(extra) > 5 else ''} ({len(extra)} in all); build the same "
                       "architecture or pass strict=False to drop them")


def load(model_chunks: list, optimizer, scheduler, path: str | Path, *, strict: bool = True,
         verify_checksums: bool = True) -> LoadResult:
    """Fill model weights, DistributedOptimizer master weights, Adam moments and step, scheduler,
    and RNG from `path` (a save root with `latest`, a fragment directory or a universal directory).
    Collective: call on every rank after building model, optimizer and scheduler."""
    t0 = time.perf_counter()
    source = open_source(path, verify_checksums)
    manifest = source.manifest
    layout = Layout.current()
    check_layout(manifest["model"], layout, str(source.dir))
    check_model_config(manifest["model"], model_config(model_chunks), str(source.dir))
    params = local_params(model_chunks)
    _check_params(source, params, strict)

    index = OptimizerIndex(optimizer)
    index.ensure_state()
    for lp in params:
        if lp.spec.buffer:  # every holder reads its whole local slice; no optimizer state
            with torch.no_grad():
                lp.param.copy_(read_rows(source, lp, "param", 0, lp.local_shape[0]).view(lp.local_shape))
            continue
        shard = index.shard_range(lp.param)
        if shard is None:
            continue
        start, end = shard
        row = math.prod(lp.local_shape[1:])
        r0, r1 = start // row, -(-end // row)
        tensors = {s: read_rows(source, lp, s, r0, r1).reshape(-1)[start - r0 * row:end - r0 * row]
                   for s in STATES}
        index.set(lp.param, tensors, source.step(lp.spec.name))
    index.copy_main_to_model(model_chunks)
    index.load_param_groups(manifest["optimizer"]["param_groups"])
    index.load_grad_scaler(manifest["optimizer"].get("grad_scaler"))
    if scheduler is not None and manifest.get("scheduler"):
        scheduler.num_steps = 0  # load_state_dict advances by the saved count
        scheduler.load_state_dict(manifest["scheduler"])

    source_layout = Layout.from_json(manifest["layout"])
    same = source_layout == layout
    rng_tensors, rng_meta = source.rng(dist.get_rank()) if same else ({}, {})
    if rng_tensors:
        rng.restore(rng_tensors, rng_meta)
    else:
        rng.rederive(manifest.get("seed", 1234), manifest["iteration"])
    if dist.get_rank() == 0:
        print(f"[megatron-ucp] loaded iteration {manifest['iteration']} ({manifest['kind']}, saved "
              f"at {source_layout}) at {layout} in {time.perf_counter() - t0:.2f}s", flush=True)
    return LoadResult(manifest["iteration"], manifest.get("extra", {}), source.dir, source_layout,
                      bool(rng_tensors), source.reader.bytes_read)
