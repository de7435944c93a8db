"""The fragment index: which rank file holds which range of which saved slice of every tensor.

`save` gathers one compact record per fragment from every rank (metadata only, no tensors) and
the parameter specs from one replica of each model-parallel position, so rank 0 holds
O(tensors + fragments), not O(world x tensors). Rank 0 checks that the fragments tile every
universal tensor exactly (no gap, no overlap: a broken layout is refused before anything is
committed) and writes the index into the manifest (format version 3, docs/FORMAT.md):

    params[name]["step"]   = the Adam step of the tensor
    params[name]["slices"] = [{"local_shape": [...], "pieces": [[start, offset, shape, strides], ...],
                               "fragments": [[file index, start, end], ...]}, ...]

A load then opens only the files that hold its bytes; checksums stay in each rank file's header,
which is read when that file is opened anyway.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Iterator

from megatron_ucp.errors import UCPError
from megatron_ucp.spec import Piece

# name, local shape, pieces (JSON), start, end, step
Record = tuple[str, list[int], list, int, int, float]


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection while building or parsing metadata: it allocates millions of
    small containers and no cycles, and the collector's passes over them would cost seconds
    (measured 5x on the 4096-rank plan benchmark)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def merge_specs(spec_lists: list[list[dict] | None]) -> dict[str, dict]:
    """One spec per tensor from the ranks that sent theirs; aliases are the union."""
    merged: dict[str, dict] = {}
    for specs in spec_lists:
        for spec in specs or ():
            prev = merged.setdefault(spec["name"], {**spec, "aliases": []})
            if {**prev, "aliases": []} != {**spec, "aliases": []}:
                raise UCPError(f"parameter {spec['name']}: ranks disagree on its spec ({prev} vs {spec})")
            prev["aliases"] = sorted(set(prev["aliases"]) | set(spec["aliases"]))
    return dict(sorted(merged.items()))


def build_index(params: dict[str, dict], records_per_file: list[list[Record]],
                where: str = "save") -> dict[str, dict]:
    """`params` (merged specs) with "step" and "slices" added from every file's records; raises
    UCPError naming the tensor and the ranks when the fragments do not tile a tensor exactly."""
    slices: dict[str, dict[str, dict]] = {name: {} for name in params}
    steps: dict[str, tuple[float, int]] = {}
    for file_index, records in enumerate(records_per_file):
        for name, local_shape, pieces, start, end, step in records:
            if name not in slices:
                raise UCPError(f"{where}: rank {file_index} saved a fragment of {name}, which no "
                               "rank declared; the ranks were built with different models")
            if name in steps and steps[name][0] != step:
                raise UCPError(f"{where}: parameter {name} has Adam step {step} on rank {file_index} "
                               f"and {steps[name][0]} on rank {steps[name][1]}; the optimizer state "
                               "mixes iterations")
            steps.setdefault(name, (step, file_index))
            key = (tuple(local_shape), tuple((p[0], *map(tuple, p[1:])) for p in pieces))
            entry = slices[name].setdefault(key, {"local_shape": list(local_shape), "pieces": pieces,
                                                  "fragments": []})
            entry["fragments"].append([file_index, start, end])
    out = {}
    for name, spec in params.items():
        if name not in steps:
            raise UCPError(f"{where}: no rank saved any element of {name}; every rank holding it "
                           "skipped it (is its optimizer state missing?)")
        entries = list(slices[name].values())
        for e in entries:
            e["fragments"].sort(key=lambda f: f[1])
        check_tiling(where, name, spec["shape"], entries)
        out[name] = {**spec, "step": steps[name][0], "slices": entries}
    return out


def check_tiling(where: str, name: str, shape: list[int], entries: list[dict]) -> None:
    """Every element of the tensor is saved exactly once: fragments tile each saved slice and the
    slices' pieces tile the universal tensor."""
    pieces = []
    for e in entries:
        pos, owners = 0, []
        for file_index, start, end in e["fragments"]:
            if start != pos:
                what = "twice" if start < pos else "by no rank"
                raise UCPError(
                    f"{where}: parameter {name}: elements [{min(pos, start)}, {max(pos, start)}) of "
                    f"a saved slice are saved {what} (ranks {owners[-1:] + [file_index]}); "
                    + ("two ranks hold the same part of the model: is the model built for this "
                       "layout (TransformerConfig.pipeline_model_parallel_size and friends)?"
                       if start < pos else "the checkpoint is incomplete"))
            pos = end
            owners.append(file_index)
        if pos != math.prod(e["local_shape"]):
            raise UCPError(f"{where}: parameter {name}: a saved slice ends at element {pos} of "
                           f"{math.prod(e['local_shape'])}; the checkpoint is incomplete")
        pieces += [(Piece.from_json(p), owners) for p in e["pieces"]]
    # sweep along the dim the slices are spread over: only boxes that meet on it can overlap
    d = max(range(len(shape)), key=lambda k: len({p.offset[k] for p, _ in pieces})) if shape else 0
    pieces.sort(key=lambda x: x[0].offset[d] if shape else 0)
    for i, (a, ranks_a) in enumerate(pieces):
        for b, ranks_b in pieces[i + 1:]:
            if shape and b.offset[d] >= a.offset[d] + a.shape[d]:
                break
            if all(max(x, y) < min(x + n, y + m)
                   for x, n, y, m in zip(a.offset, a.shape, b.offset, b.shape)):
                raise UCPError(
                    f"{where}: parameter {name}: ranks {sorted(set(ranks_a))} and {sorted(set(ranks_b))} "
                    f"saved overlapping slices at {list(a.offset)} and {list(b.offset)}; two ranks "
                    "hold the same part of the model: is the model built for this layout "
                    "(TransformerConfig.pipeline_model_parallel_size and friends)?")
    covered = sum(p.numel for p, _ in pieces)
    if covered != math.prod(shape):
        raise UCPError(f"{where}: parameter {name}: saved slices cover {covered} of "
                       f"{math.prod(shape)} elements; the checkpoint is incomplete")
