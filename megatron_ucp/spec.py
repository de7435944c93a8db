"""Plain metadata: where a slab of a local tensor sits in a universal tensor, and a param's spec."""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch

STATES = ("param", "exp_avg", "exp_avg_sq")  # fp32 master weight and Adam moments
BUFFER_STATES = ("param",)  # a persistent buffer (e.g. MoE router expert_bias): its value only
# The optimizer families megatron-ucp reshards, by the per-parameter state each keeps: tensors of
# the parameter's own shape, element for element, so they slice over TP/PP/DP/EP like the
# weight. A parameter records its family in its spec (`ParamSpec.optimizer`, default "adam":
# manifests before it). A Kronecker-factored state does not slice so: UNRESHARDABLE_STATES.
OPTIMIZER_STATES = {
    "adam": ("exp_avg", "exp_avg_sq"),  # torch Adam/AdamW, TE/Apex FusedAdam: + a step
    "lion": ("exp_avg",),  # emerging_optimizers Lion
    "sgd": ("momentum_buffer",),  # torch SGD with momentum
    "plain_sgd": (),  # torch SGD without momentum: no state
    "muon": ("momentum_buffer",),  # Muon (emerging_optimizers OrthogonalizedOptimizer)
}

# Families megatron-ucp recognises but whose state it cannot lay out (not saved, never in a
# manifest): what the state is, as a refusal says it. A SOAP run loads weights only.
UNRESHARDABLE_STATES = {
    # emerging_optimizers SOAP, per parameter of its TP shard [m, n]: step (int), the Kronecker
    # factors L [m, m] and R [n, n], their eigenbases Q_L [m, m] and Q_R [n, n], and exp_avg /
    # exp_avg_sq [m, n] rotated into that eigenbasis (fp32)
    "soap": "SOAP keeps per TP shard [m, n] of a weight the Kronecker factors L [m, m] and R [n, n], "
            "their eigenbases Q_L and Q_R, and exp_avg / exp_avg_sq rotated into that eigenbasis: "
            "none of it is elementwise in the weight, so none of it slices over TP like the weight, "
            "and megatron-ucp has no universal form for it yet",
}

# (a tuple: `in` on an unhashable JSON value is False, not a TypeError)
OPTIMIZER_FAMILIES = tuple(OPTIMIZER_STATES)


def states_of(spec: ParamSpec) -> tuple[str, ...]:
    return BUFFER_STATES if spec.buffer else ("param", *OPTIMIZER_STATES[spec.optimizer])


@functools.lru_cache(maxsize=4096)  # a model has few distinct shapes; an index, many pieces
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


class Piece(NamedTuple):
    """The box [offset, offset + shape) of a universal tensor is a strided view of a local tensor:
    box element i is element `start + sum(i[d] * strides[d])` of the flattened local tensor.

    Most pieces are blocks of rows (contiguous strides); a GroupedMLP expert weight is a
    transposed view of the fused local tensor. (A NamedTuple: a fragment index at thousands of
    ranks parses hundreds of thousands of them.)"""

    start: int
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @classmethod
    def rows(cls, row: int, offset: tuple[int, ...], shape: tuple[int, ...]) -> Piece:
        """Rows [row, row + shape[0]) of a local tensor whose rows are shape[1:]."""
        return cls(row * math.prod(shape[1:]), tuple(offset), tuple(shape), contiguous_strides(shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def contiguous(self) -> bool:
        return all(s == c for s, c, n in zip(self.strides, contiguous_strides(self.shape), self.shape)
                   if n > 1)

    @property
    def injective(self) -> bool:
        """No two elements of the box are the same local element: with the dims sorted by
        stride, each stride steps over everything the smaller ones reach."""
        reach = 0
        for n, s in sorted(((n, s) for n, s in zip(self.shape, self.strides) if n > 1),
                           key=lambda x: x[1]):
            if s <= reach:
                return False
            reach += (n - 1) * s
        return True

    @property
    def dense(self) -> bool:
        """The piece is exactly the local elements [start, start + numel) (in some order)."""
        return self.injective and self.span((0,) * len(self.shape), self.shape)[1] + 1 == \
            self.start + self.numel

    @property
    def box(self) -> tuple[slice, ...]:
        """Index of this piece in the universal tensor."""
        return tuple(slice(o, o + n) for o, n in zip(self.offset, self.shape))

    def local_index(self, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """The flat local index of every element of the box (a strided view of an arange)."""
        last = self.span((0,) * len(self.shape), self.shape)[1]
        return torch.arange(last + 1, dtype=dtype, device="cpu").as_strided(self.shape, self.strides,
                                                                            self.start)

    def take(self, local: torch.Tensor) -> torch.Tensor:
        """This piece of `local` (a contiguous tensor of the local shape), as a view."""
        flat = local.reshape(-1)
        return flat.as_strided(self.shape, self.strides, flat.storage_offset() + self.start)

    def span(self, lo: tuple[int, ...], hi: tuple[int, ...]) -> tuple[int, int]:
        """Local flat elements [first, last] touched by the sub-box [lo, hi) of this piece."""
        first = self.start + sum(a * s for a, s in zip(lo, self.strides))
        return first, first + sum((b - a - 1) * s for a, b, s in zip(lo, hi, self.strides))

    def to_json(self) -> list:
        return [self.start, list(self.offset), list(self.shape), list(self.strides)]

    @classmethod
    def from_json(cls, d: list) -> Piece:
        if len(d) == 3:  # format version 1: [row, offset, shape], a block of rows
            return cls.rows(d[0], tuple(d[1]), tuple(d[2]))
        return cls(d[0], tuple(d[1]), tuple(d[2]), tuple(d[3]))


@dataclass
class ParamSpec:
    """Layout-free description of one parameter: how any TP degree slices it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # model weight dtype when saved; master weights and optimizer state are float32
    tp_axis: int | None  # dim that tensor parallelism splits; None = replicated over TP
    tp_blocks: int = 1  # blocks along tp_axis each split over TP (2: SwiGLU gate and up halves)
    aliases: list[str] = field(default_factory=list)  # other local names holding the same tensor
    vocab_rows: bool = False  # dim 0 is the (padded) vocabulary: rows past the true vocab are padding
    buffer: bool = False  # a persistent buffer, not trained: no optimizer state, stored as fp32
    # the blocks' sizes along tp_axis where they differ (None: tp_blocks equal blocks): Mamba's
    # in_proj is [z, x, B, C, dt] and its conv1d [x, B, C], each section split over TP on its own
    tp_sections: list[int] | None = None
    # the optimizer family whose state the parameter carries (OPTIMIZER_STATES)
    optimizer: str = "adam"

    def to_json(self) -> dict:
        return self.omit_defaults({**asdict(self), "shape": list(self.shape)})

    @staticmethod
    def omit_defaults(d: dict) -> dict:
        """A spec's JSON without the fields at the default their absence means in manifests
        written before they existed (tp_sections None, optimizer "adam")."""
        for k, default in (("tp_sections", None), ("optimizer", "adam")):
            if d.get(k, default) == default:
                d.pop(k, None)
        return d

    @classmethod
    def from_json(cls, d: dict) -> ParamSpec:
        return cls(**{**d, "shape": tuple(d["shape"])})


def cover_once_cheap(pieces: list[Piece], size: int) -> bool:
    """What can be checked of `tiles_exactly` without touching every element: each piece a one
    to one view inside [0, size), the volumes add up, and dense pieces (intervals) tile
    [0, size). Pieces that interleave pass here and need `tiles_exactly`."""
    dense, total = True, 0
    for pc in pieces:
        n = len(pc.shape)
        if len(pc.offset) != n or len(pc.strides) != n:
            return False
        numel = math.prod(pc.shape)
        total += numel
        if pc.strides == contiguous_strides(pc.shape):  # the common block of rows
            if pc.start + numel > size:
                return False
        elif not pc.injective or pc.span((0,) * n, pc.shape)[1] >= size:
            return False
        else:
            dense = dense and pc.dense
    return total == size and (not dense or intervals_tile(pieces, size))


def intervals_tile(pieces: list[Piece], size: int) -> bool:
    """Dense pieces (each an interval of the flattened local tensor) cover [0, size) once."""
    pos = 0
    for pc in sorted(pieces, key=lambda pc: pc.start):
        if pc.start != pos:
            return False
        pos += pc.numel
    return pos == size


def tiles_exactly(pieces: list[Piece], size: int) -> bool:
    """The pieces together are every element of a flattened local tensor of `size` elements,
    each once: `cover_once_cheap`, then, for pieces that interleave (SwiGLU halves of a
    GroupedMLP expert), element by element (O(size))."""
    if not cover_once_cheap(pieces, size):
        return False
    if all(pc.dense for pc in pieces):
        return True
    hit = torch.zeros(size, dtype=torch.int32)
    for pc in pieces:
        hit[pc.local_index().reshape(-1)] += 1
    return bool((hit == 1).all())
