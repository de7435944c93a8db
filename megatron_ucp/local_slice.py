"""A rank's local slice of a universal tensor, assembled from boxes read from any source.

Used by every target: `load` (into a live run's optimizer shard) and the Megatron-LM writers (into
rank files rebuilt at the target layout).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from megatron_ucp.spec import Piece

if TYPE_CHECKING:  # (param_spec imports megatron-core, which assembling a slice does not need)
    from megatron_ucp.formats.base import Source
    from megatron_ucp.param_spec import LocalParam


def read_local(source: Source, lp: LocalParam, state: str, a: int, b: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Elements [a, b) of this rank's flattened region of `lp`, assembled from universal boxes,
    written into `out` (a contiguous fp32 tensor of b - a elements, e.g. the optimizer's own
    shard: no intermediate copy of the region) or into a new tensor; returned.

    Vocab padding rows the checkpoint does not hold (the target pads more, or the universal form
    dropped them) are zero in the weight and in both Adam moments: they start as unused rows.
    """
    if out is None:
        out = torch.empty(b - a, dtype=torch.float32)
    elif out.dtype != torch.float32 or out.numel() != b - a or not out.is_contiguous():
        raise ValueError(f"read_local: out must be a contiguous float32 tensor of {b - a} elements")
    saved_rows = source.manifest.params[lp.spec.name].shape[0]
    shapes = []  # each piece's part that the checkpoint holds (vocab rows past it are padding)
    for pc in lp.pieces:
        shape = list(pc.shape)
        if lp.spec.vocab_rows:
            shape[0] = max(0, min(shape[0], saved_rows - pc.offset[0]))
        shapes.append(tuple(shape))
    if not all(pc.contiguous for pc in lp.pieces):
        out.copy_(_read_strided(source, lp, state, a, b, shapes))
        return out
    # row-major pieces: each box of [a, b) lands in its own contiguous range of `out`
    boxes = []  # (first element in out, universal offset, shape)
    for pc, shape in zip(lp.pieces, shapes):
        if 0 in shape:
            continue
        lo, hi = max(a, pc.start) - pc.start, min(b, pc.start + math.prod(shape)) - pc.start
        for box_offset, box_shape in flat_range_boxes(shape, lo, hi):
            first = pc.start + sum(o * st for o, st in zip(box_offset, pc.strides))
            boxes.append((first - a, tuple(o + p for o, p in zip(box_offset, pc.offset)), box_shape))
    if sum(math.prod(shape) for _, _, shape in boxes) != b - a:
        out.zero_()  # padding rows no box covers (pieces never overlap)
    for at, offset, shape in boxes:
        # straight from the source's bytes where the source can (`Source.read_into`)
        source.read_into(lp.spec.name, state, offset, shape, out[at:at + math.prod(shape)].view(shape))
    return out


def _read_strided(source: Source, lp: LocalParam, state: str, a: int, b: int,
                  shapes: list[tuple[int, ...]]) -> torch.Tensor:
    """`read_local` for a region with strided pieces (a GroupedMLP expert weight is a transposed
    view of its fused tensor): each piece's part is read and written through its strided view of
    a buffer spanning them all, then [a, b) is cut out."""
    parts = []  # (sub-piece, its values): every element of [a, b) lies in one of them
    for pc, full in zip(lp.pieces, shapes):
        shape = list(full)
        if 0 in shape:
            continue
        if pc.contiguous:  # exactly the elements [a, b): no neighbouring rank's bytes are read
            lo, hi = max(a, pc.start) - pc.start, min(b, pc.start + math.prod(shape)) - pc.start
            for box_offset, box_shape in flat_range_boxes(tuple(shape), lo, hi):
                sub = Piece(pc.start + sum(o * st for o, st in zip(box_offset, pc.strides)),
                            tuple(o + p for o, p in zip(box_offset, pc.offset)), box_shape, pc.strides)
                parts.append((sub, source.read(lp.spec.name, state, sub.offset, box_shape)))
            continue
        # narrow the outermost (largest-stride) dim to the indices that can reach [a, b)
        d = max(range(len(shape)), key=lambda k: pc.strides[k])
        step = pc.strides[d] or 1
        rest = sum((n - 1) * s for k, (n, s) in enumerate(zip(shape, pc.strides)) if k != d)
        lo, hi = max(0, -(-(a - pc.start - rest) // step)), min(shape[d], (b - 1 - pc.start) // step + 1)
        if hi <= lo:
            continue
        shape[d] = hi - lo
        sub = Piece(pc.start + lo * pc.strides[d], pc.offset, tuple(shape), pc.strides)
        offset = tuple(o + (lo if k == d else 0) for k, o in enumerate(pc.offset))
        parts.append((sub, source.read(lp.spec.name, state, offset, sub.shape)))
    # pieces never overlap, so elements outside [a, b) that a part brings along are just dropped
    lo = min([a, *(sub.start for sub, _ in parts)])
    hi = max([b, *(sub.span((0,) * len(sub.shape), sub.shape)[1] + 1 for sub, _ in parts)])
    buf = torch.zeros(hi - lo, dtype=torch.float32)
    for sub, values in parts:
        buf.as_strided(sub.shape, sub.strides, sub.start - lo).copy_(values)
    return buf[a - lo:b - lo]


def flat_range_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple, tuple]]:
    """Boxes (offset, shape) that cover elements [lo, hi) of a row-major tensor of `shape`, in
    order, each contiguous: a partial first row, whole rows, a partial last row (recursively)."""
    if hi <= lo:
        return []
    if len(shape) == 1:
        return [((lo,), (hi - lo,))]
    inner = math.prod(shape[1:])
    first, last = lo // inner, (hi - 1) // inner
    if first == last:
        return [((first, *o), (1, *sh)) for o, sh in flat_range_boxes(shape[1:], lo % inner,
                                                                       hi - first * inner)]
    out = []
    if lo % inner:
        out += [((first, *o), (1, *sh)) for o, sh in flat_range_boxes(shape[1:], lo % inner, inner)]
        first += 1
    if hi // inner > first:
        out.append(((first,) + (0,) * (len(shape) - 1), (hi // inner - first, *shape[1:])))
    if hi % inner:
        out += [((hi // inner, *o), (1, *sh)) for o, sh in flat_range_boxes(shape[1:], 0, hi % inner)]
    return out
