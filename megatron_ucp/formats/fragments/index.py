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

import json
import math
import zlib
from array import array
from collections.abc import Iterable
from itertools import chain
from operator import itemgetter

import numpy as np

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.manifest import ParamEntry, SliceEntry
from megatron_ucp.spec import ParamSpec, Piece

# name, local shape, pieces (JSON), start, end, step[, optimizer family when not "adam"]
Record = tuple


def index_part(specs: list[dict] | None, records: list[Record]) -> tuple[bytes | None, bytes]:
    """What a rank sends rank 0 for the index: its specs (if it sends them) and its fragment
    records, as compressed JSON. Rank 0 holds every rank's part at once: as a few MiB of bytes
    rather than millions of small objects (JSON of specs and records compresses 10 to 30 times),
    and it parses a rank's records only while it indexes them (`part_records`). Ranks of one
    model-parallel position send the same specs, parsed once (`merge_specs`)."""
    def pack(x) -> bytes:
        return zlib.compress(json.dumps(x, separators=(",", ":")).encode(), 1)

    return (pack(specs) if specs else None), pack(records)


def part_records(part: bytes) -> list[Record]:
    """The fragment records of an `index_part` (as JSON decodes them: lists)."""
    return json.loads(zlib.decompress(part))


def merge_specs(spec_parts: list[bytes | None]) -> dict[str, dict]:
    """One spec per tensor from the ranks that sent theirs (`index_part`); aliases are the union."""
    merged: dict[str, dict] = {}
    for part in dict.fromkeys(p for p in spec_parts if p is not None):  # each distinct part once
        for spec in json.loads(zlib.decompress(part)):
            prev = merged.setdefault(spec["name"], {**spec, "aliases": []})
            if {**prev, "aliases": []} != {**spec, "aliases": []}:
                raise UCPError(f"parameter {spec['name']}: ranks disagree on its spec ({prev} vs {spec})")
            prev["aliases"] = sorted(set(prev["aliases"]) | set(spec["aliases"]))
    return dict(sorted(merged.items()))


def build_index(specs: dict[str, dict], records_per_file: Iterable[list[Record]],
                where: str = "save") -> dict[str, ParamEntry]:
    """The manifest's params (merged specs, each with its step and slices) from every file's
    records (as JSON decodes them: lists), consumed one file at a time; raises UCPError naming
    the tensor and the ranks when the fragments do not tile a tensor exactly.

    The slices are built in their JSON form, reusing the records' own lists (the manifest is
    written from them; no object per piece and fragment)."""
    slices: dict[str, dict[tuple | str, dict]] = {name: {} for name in specs}  # name -> key -> slice
    steps: dict[str, tuple[float, int]] = {}
    families: dict[str, tuple[str, int]] = {}  # the first rank's family of each tensor's states
    n_files = 0
    for file_index, records in enumerate(records_per_file):
        n_files += 1
        for name, local_shape, pieces, start, end, step, *family in records:
            fam = family[0] if family else "adam"
            seen_family = families.setdefault(name, (fam, file_index))
            if seen_family[0] != fam:
                raise UCPError(f"{where}: parameter {name} has {fam} optimizer state on rank "
                               f"{file_index} and {seen_family[0]} on rank {seen_family[1]}; the "
                               "ranks' optimizers differ")
            by_key = slices.get(name)
            if by_key is None:
                raise UCPError(f"{where}: rank {file_index} saved a fragment of {name}, which no "
                               "rank declared; the ranks were built with different models")
            seen = steps.get(name)
            if seen is None:
                steps[name] = (step, file_index)
            elif seen[0] != step:
                raise UCPError(f"{where}: parameter {name} has Adam step {step} on rank {file_index} "
                               f"and {seen[0]} on rank {seen[1]}; the optimizer state mixes iterations")
            # The DP ranks holding parts of one saved slice send the same local shape and pieces.
            # Keyed by where its first piece sits (cheap), confirmed by comparing the lists; a
            # different slice with that key (a broken layout) gets the full key, as its own slice.
            key = (*pieces[0][1], -1, *local_shape) if pieces else ()
            entry = by_key.get(key)
            if entry is not None and (entry["pieces"] != pieces or entry["local_shape"] != local_shape):
                key = repr((local_shape, pieces))
                entry = by_key.get(key)
            if entry is None:
                by_key[key] = {"fragments": [[file_index, start, end]], "local_shape": local_shape,
                               "pieces": pieces}
            else:
                entry["fragments"].append([file_index, start, end])
    out = {}
    for name, spec in specs.items():
        if name not in steps:
            raise UCPError(f"{where}: no rank saved any element of {name}; every rank holding it "
                           "skipped it (is its optimizer state missing?)")
        entries = list(slices[name].values())
        for e in entries:
            if len(e["fragments"]) > 1:
                e["fragments"].sort(key=itemgetter(1))
        spec = ParamSpec.from_json(spec)
        spec.optimizer = families[name][0]
        out[name] = ParamEntry(spec, steps[name][0], slices_json=entries)
    for name in tiling_suspects(out, n_files, whole=True):  # the exact check names the problem
        check_tiling(where, name, out[name].shape, out[name].slices)
    return out


def tiling_suspects(params: dict[str, ParamEntry], n_files: int, whole: bool) -> list[str]:
    """The parameters whose slices `check_tiling` must look at, found for all at once by array
    operations over every fragment and piece (an index at thousands of ranks has ~10^5 slices,
    too many for Python per slice). Every parameter that the check (or the parse of its slices)
    could refuse is among them, most others are not; an index that is not made of integers makes
    every parameter a suspect (the parse of its slices then names the entry).

    Each slice's fragments, in order, are [file < n_files, start, end) with start < end and
    tile [0, prod(local_shape)). whole=True (the save: `check_tiling` with overlap) also: a
    tensor's pieces add up to its volume, each is a box inside the tensor, and no two of them
    overlap where each spans the tensor in all dims but one, the same for all its pieces (TP
    slices, SwiGLU halves, experts; other arrangements are suspects)."""
    names = list(params)
    try:
        flags = _suspect_flags([params[n].slices_json for n in names], [params[n].shape for n in names],
                               n_files, whole)
    except (TypeError, ValueError, KeyError, IndexError, OverflowError):  # not [int]: parse each
        return names
    return [names[i] for i in np.flatnonzero(flags)]


LARGE = 2**40  # a volume above this is left to the exact check (sums of 2**23 of them fit int64)


def _ints(values: Iterable) -> np.ndarray:
    """int64 array of Python ints; anything else (a float, a string, a list) raises TypeError."""
    return np.frombuffer(array("q", values), dtype=np.int64)


def _suspect_flags(raw: list[list], shapes: list[tuple[int, ...]], n_files: int,
                   whole: bool) -> np.ndarray:
    n_params = len(raw)
    slice_counts = np.array(list(map(len, raw)), dtype=np.int64)
    slices = list(chain.from_iterable(raw))
    slice_param = np.repeat(np.arange(n_params), slice_counts)
    suspect = slice_counts == 0  # no rank file holds it
    if not slices:
        return suspect
    local = [s["local_shape"] for s in slices]
    frags = [s["fragments"] for s in slices]

    # fragments: in order, each starts where the previous ended, the first at 0, the last ends
    # at the slice's size (so start >= 0 and end <= size follow from start < end)
    size = _ints(map(math.prod, local))
    n_frags = np.array(list(map(len, frags)), dtype=np.int64)
    if set(map(len, chain.from_iterable(frags))) - {3}:
        raise ValueError("a fragment entry is not [file, start, end]")
    file, start, end = _ints(chain.from_iterable(chain.from_iterable(frags))).reshape(-1, 3).T
    first = np.cumsum(n_frags) - n_frags
    held = n_frags > 0
    prev_end = np.empty_like(end)
    prev_end[1:] = end[:-1]
    prev_end[first[held]] = 0
    bad_frag = (file < 0) | (file >= n_files) | (start != prev_end) | (end <= start)
    last_end = np.full(len(slices), -1, dtype=np.int64)
    last_end[held] = end[first[held] + n_frags[held] - 1]
    bad_slice = (last_end != size) | (size > LARGE)
    bad_slice[np.repeat(np.arange(len(slices)), n_frags)[bad_frag]] = True
    suspect[slice_param[bad_slice]] = True
    if not whole:
        return suspect

    # volumes: the pieces of a tensor's slices add up to the tensor
    pieces = [s["pieces"] for s in slices]
    n_pieces = np.array(list(map(len, pieces)), dtype=np.int64)
    flat_pieces = list(chain.from_iterable(pieces))
    if not flat_pieces or set(map(len, flat_pieces)) != {4}:
        raise ValueError("a piece is not [start, offset, shape, strides]")
    offsets = [p[1] for p in flat_pieces]
    piece_shapes = [p[2] for p in flat_pieces]
    numel = _ints(map(math.prod, piece_shapes))
    piece_param = np.repeat(slice_param, n_pieces)
    large = numel > LARGE
    suspect[piece_param[large]] = True
    covered = np.zeros(n_params, dtype=np.int64)
    np.add.at(covered, piece_param, np.where(large, 0, numel))
    suspect |= covered != np.array([math.prod(s) for s in shapes], dtype=np.int64)

    # boxes: [P, D] offsets, shapes and the tensor's shape of every piece, padded with 0, 1, 1
    nd_offset = np.array(list(map(len, offsets)), dtype=np.int64)
    nd_shape = np.array(list(map(len, piece_shapes)), dtype=np.int64)
    nd_param = np.array(list(map(len, shapes)), dtype=np.int64)
    nd_tensor = nd_param[piece_param]
    dims = int(max(nd_offset.max(), nd_shape.max(), nd_tensor.max(), 1))  # (1: scalars span it)
    box_offset = _padded(_ints(chain.from_iterable(offsets)), nd_offset, dims, 0)
    box_shape = _padded(_ints(chain.from_iterable(piece_shapes)), nd_shape, dims, 1)
    tensor_shape = _padded(_ints(chain.from_iterable(shapes)), nd_param, dims, 1)[piece_param]
    split = (box_offset != 0) | (box_shape != tensor_shape)  # dims the box does not span
    n_split = split.sum(1)
    split_dim = np.where(n_split == 1, split.argmax(1), -1)
    several = np.bincount(piece_param, minlength=n_params)[piece_param] > 1
    outside = (box_offset < 0) | (box_shape < 0) | (box_offset + box_shape > tensor_shape)
    bad_piece = ((nd_offset != nd_tensor) | (nd_shape != nd_tensor) | outside.any(1)
                 | (n_split > 1) | (several & (split_dim < 0)))
    suspect[piece_param[bad_piece]] = True
    lowest = np.full(n_params, dims, dtype=np.int64)
    highest = np.full(n_params, -1, dtype=np.int64)
    np.minimum.at(lowest, piece_param, split_dim)
    np.maximum.at(highest, piece_param, split_dim)
    suspect |= (highest >= 0) & (lowest != highest)  # pieces split along different dims
    # along the split dim, sorted by offset, each piece starts at or after the previous one's end
    rows = np.arange(len(flat_pieces))
    along = np.maximum(split_dim, 0)
    a, n = box_offset[rows, along], box_shape[rows, along]
    order = np.lexsort((a, piece_param))
    p_, a, n = piece_param[order], a[order], n[order]
    overlap = (p_[1:] == p_[:-1]) & (a[1:] < a[:-1] + n[:-1])
    suspect[p_[1:][overlap]] = True
    return suspect


def _padded(flat: np.ndarray, lengths: np.ndarray, dims: int, fill: int) -> np.ndarray:
    """Rows of `lengths[i]` values, concatenated in `flat`, as a [rows, dims] array (fill after)."""
    out = np.full((len(lengths), dims), fill, dtype=np.int64)
    begin = np.cumsum(lengths) - lengths
    for d in range(dims):
        has = lengths > d
        out[has, d] = flat[begin[has] + d]
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
