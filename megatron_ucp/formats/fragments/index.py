"""The fragment index: which rank file holds which range of which saved slice of every tensor.

`save` gathers one compact record per fragment from every rank (metadata only, no tensors) and
the parameter specs from one replica of each model-parallel position, so rank 0 holds
O(tensors + fragments), not O(world x tensors). Rank 0 checks that the fragments tile every
universal tensor exactly (no gap, no overlap: a broken layout is refused before anything is
committed) and writes the index into the manifest (`ParamEntry.slices`, docs/FORMAT.md). A load
then opens only the files that hold its bytes; checksums stay in each rank file's header, which
is read when that file is opened anyway.
"""

from __future__ import annotations

import math

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.manifest import FragmentEntry, ParamEntry, SliceEntry
from megatron_ucp.spec import ParamSpec, Piece

# name, local shape, pieces (JSON), start, end, step
Record = tuple[str, list[int], list, int, int, float]


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


def build_index(specs: dict[str, dict], records_per_file: list[list[Record]],
                where: str = "save") -> dict[str, ParamEntry]:
    """The manifest's params (merged specs, each with its step and slices) from every file's
    records; raises UCPError naming the tensor and the ranks when the fragments do not tile a
    tensor exactly."""
    slices: dict[str, dict[tuple, SliceEntry]] = {name: {} for name in specs}
    steps: dict[str, tuple[float, int]] = {}
    pieces_of: dict[tuple, list[Piece]] = {}  # parsed once per distinct piece list
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
            entry = slices[name].get(key)
            if entry is None:
                parsed = pieces_of.setdefault(key[1], [Piece.from_json(p) for p in pieces])
                entry = slices[name][key] = SliceEntry(key[0], parsed, [])
            entry.fragments.append(FragmentEntry(file_index, start, end))
    out = {}
    for name, spec in specs.items():
        if name not in steps:
            raise UCPError(f"{where}: no rank saved any element of {name}; every rank holding it "
                           "skipped it (is its optimizer state missing?)")
        entries = list(slices[name].values())
        for e in entries:
            e.fragments.sort(key=lambda f: f.start)
        check_tiling(where, name, spec["shape"], entries)
        out[name] = ParamEntry(ParamSpec.from_json(spec), steps[name][0], slices=entries)
    return out


def check_tiling(where: str, name: str, shape: tuple[int, ...] | list[int], entries: list[SliceEntry],
                 overlap: bool = True, advice: str | None = None) -> None:
    """Every element of the tensor is saved exactly once: fragments tile each saved slice and the
    slices' pieces tile the universal tensor (overlap=False: only the volume, for a load that
    trusts the index its save checked). advice: what a reader of a committed checkpoint should
    do, in place of the hints for a save."""
    incomplete = advice or "the checkpoint is incomplete"
    pieces = []
    for e in entries:
        pos, owners = 0, []
        for f in e.fragments:
            if f.start != pos:
                what = "twice" if f.start < pos else "by no rank"
                raise UCPError(
                    f"{where}: parameter {name}: elements [{min(pos, f.start)}, {max(pos, f.start)}) "
                    f"of a saved slice are saved {what} (ranks {owners[-1:] + [f.file]}); "
                    + (advice or "two ranks hold the same part of the model: is the model built "
                       "for this layout (TransformerConfig.pipeline_model_parallel_size and friends)?"
                       if f.start < pos else incomplete))
            pos = f.end
            owners.append(f.file)
        if pos != math.prod(e.local_shape):
            raise UCPError(f"{where}: parameter {name}: a saved slice ends at element {pos} of "
                           f"{math.prod(e.local_shape)}; {incomplete}")
        pieces += [(p, owners) for p in e.pieces]
    if overlap:
        for p, owners in pieces:  # a box outside the tensor would make up for a gap inside it
            if len(p.offset) != len(shape) or any(o + n > d for o, n, d in zip(p.offset, p.shape, shape)):
                raise UCPError(f"{where}: parameter {name}: ranks {sorted(set(owners))} saved a slice "
                               f"at {list(p.offset)} of shape {list(p.shape)}, outside the tensor's "
                               f"shape {list(shape)}; {incomplete}")
        _check_no_overlap(where, name, shape, pieces, advice)
    covered = sum(p.numel for p, _ in pieces)
    if covered != math.prod(shape):
        raise UCPError(f"{where}: parameter {name}: saved slices cover {covered} of "
                       f"{math.prod(shape)} elements; {incomplete}")


def _check_no_overlap(where: str, name: str, shape, pieces: list[tuple[Piece, list[int]]],
                      advice: str | None = None) -> None:
    # sweep along the dim the slices are spread over: only boxes that meet on it can overlap
    d = max(range(len(shape)), key=lambda k: len({p.offset[k] for p, _ in pieces})) if shape else 0
    pieces = sorted(pieces, key=lambda x: x[0].offset[d] if shape else 0)
    for i, (a, ranks_a) in enumerate(pieces):
        for b, ranks_b in pieces[i + 1:]:
            if shape and b.offset[d] >= a.offset[d] + a.shape[d]:
                break
            if all(max(x, y) < min(x + n, y + m)
                   for x, n, y, m in zip(a.offset, a.shape, b.offset, b.shape)):
                raise UCPError(
                    f"{where}: parameter {name}: ranks {sorted(set(ranks_a))} and {sorted(set(ranks_b))} "
                    f"saved overlapping slices at {list(a.offset)} and {list(b.offset)}; "
                    + (advice or "two ranks hold the same part of the model: is the model built for "
                       "this layout (TransformerConfig.pipeline_model_parallel_size and friends)?"))
