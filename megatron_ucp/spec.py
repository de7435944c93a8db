"""Plain metadata: where a slab of a local tensor sits in a universal tensor, and a param's spec."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

STATES = ("param", "exp_avg", "exp_avg_sq")  # fp32 master weight and Adam moments
BUFFER_STATES = ("param",)  # a persistent buffer (e.g. MoE router expert_bias): its value only


def states_of(spec: dict) -> tuple[str, ...]:
    return BUFFER_STATES if spec.get("buffer") else STATES


@dataclass(frozen=True)
class Piece:
    """Rows [row, row + shape[0]) of a local tensor fill the box at `offset` of the universal tensor."""

    row: int
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def to_json(self) -> list:
        return [self.row, list(self.offset), list(self.shape)]

    @classmethod
    def from_json(cls, d: list) -> Piece:
        return cls(d[0], tuple(d[1]), tuple(d[2]))


@dataclass
class ParamSpec:
    """Layout-free description of one parameter: how any TP degree slices it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # model weight dtype when saved; master weights and optimizer state are float32
    tp_axis: int | None  # dim that tensor parallelism splits; None = replicated over TP
    tp_blocks: int = 1  # equal blocks along tp_axis each split over TP (2: SwiGLU gate and up halves)
    aliases: list[str] = field(default_factory=list)  # other local names holding the same tensor
    vocab_rows: bool = False  # dim 0 is the (padded) vocabulary: rows past the true vocab are padding
    buffer: bool = False  # a persistent buffer, not trained: no optimizer state, stored as fp32

    def to_json(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_json(cls, d: dict) -> ParamSpec:
        return cls(**{**d, "shape": tuple(d["shape"])})
