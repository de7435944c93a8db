"""One rank's file of a fragment checkpoint: `rank_XXXXX.safetensors`.

It holds, for every parameter copy the rank owns canonically, the rank's distributed-optimizer
range [start, end) of the flattened local (TP-sliced) tensor: tensors `<name>/param` (fp32 master
weight), `<name>/exp_avg`, `<name>/exp_avg_sq` (a persistent buffer: `<name>/param` only, the whole
local tensor, from DP rank 0). Its safetensors `__metadata__` key `fragments` is JSON: for each
fragment the local shape, the range, the Adam step, the crc32 of each tensor and the pieces
(strided views of the local tensor -> boxes of the universal tensor). `rng/*` tensors and the
`rng` metadata key hold the rank's generator states; `coords` its TP/PP/DP ranks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_ucp.errors import UCPError
from megatron_ucp.spec import Piece
from megatron_ucp.storage import Location, Reader, SafetensorsWriter, crc32_many


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


@dataclass
class Fragment:
    name: str
    local_shape: tuple[int, ...]
    pieces: list[Piece]
    start: int
    end: int
    step: float
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # state -> 1-D fp32
    crc: dict[str, int] = field(default_factory=dict)
    family: str = "adam"  # the optimizer family of the states (spec.OPTIMIZER_STATES)

    def to_json(self) -> dict:
        return {"name": self.name, "local_shape": list(self.local_shape),
                "pieces": [p.to_json() for p in self.pieces], "range": [self.start, self.end],
                "step": self.step, "crc32": self.crc}

    def record(self) -> tuple:
        """What the fragment index needs of it (`index.Record`)."""
        record = (self.name, list(self.local_shape), [p.to_json() for p in self.pieces], self.start,
                  self.end, self.step)
        return record if self.family == "adam" else (*record, self.family)


def write_rank_file(path: Location, fragments: list[Fragment], rng_tensors: dict[str, torch.Tensor],
                    rng_meta: dict, coords: dict) -> int:
    """Write one rank's fragments; returns bytes written. The file is fsynced before returning."""
    entries = [(f"{f.name}/{s}", torch.float32, (f.end - f.start,)) for f in fragments for s in f.tensors]
    entries += [(f"rng/{k}", v.dtype, tuple(v.shape)) for k, v in rng_tensors.items()]
    crcs = iter(crc32_many([t for f in fragments for t in f.tensors.values()]))
    for f in fragments:
        f.crc = {s: next(crcs) for s in f.tensors}
    meta = {"fragments": json.dumps([f.to_json() for f in fragments]),
            "rng": json.dumps(rng_meta), "coords": json.dumps(coords)}
    w = SafetensorsWriter(path, entries, meta)
    try:
        for f in fragments:
            for s, t in f.tensors.items():
                w.write(f"{f.name}/{s}", t)
        for k, v in rng_tensors.items():
            w.write(f"rng/{k}", v)
        w.close()
    except BaseException:
        w.abort()  # in a store: the multipart upload is aborted, nothing of it stays
        raise
    return w.nbytes


def header_fragments(reader: Reader, path: Path) -> list[dict]:
    """The `fragments` metadata of a rank file: name, local_shape, pieces, range, step, crc32,
    each of its JSON type (a damaged header is refused here, not met as a KeyError later)."""
    records = _header_json(reader, path, "fragments", "[]")
    if not isinstance(records, list):
        raise _damaged(path, "fragments", f"expected a list of records, got {type(records).__name__}")
    for i, d in enumerate(records):
        problem = _record_problem(d)
        if problem:
            raise _damaged(path, "fragments", f"record {i} {problem}")
    return records


_RECORD = ("name", "local_shape", "pieces", "range", "step", "crc32")


def _record_problem(d) -> str | None:
    def ints(v, n: int | None = None) -> bool:
        return (isinstance(v, list) and (n is None or len(v) == n)
                and all(type(x) is int and x >= 0 for x in v))

    if not isinstance(d, dict) or not set(_RECORD) <= set(d):
        return (f"has fields {sorted(d) if isinstance(d, dict) else type(d).__name__}, expected "
                f"{', '.join(_RECORD)}")
    if not isinstance(d["name"], str) or not ints(d["local_shape"]) or not ints(d["range"], 2):
        return f"of {d['name']!r}: bad name, local_shape or range"
    if not (isinstance(d["step"], (int, float)) and not isinstance(d["step"], bool)):
        return f"of {d['name']!r}: step {d['step']!r} is not a number"
    if not (isinstance(d["crc32"], dict) and all(type(v) is int for v in d["crc32"].values())):
        return f"of {d['name']!r}: crc32 {d['crc32']!r} is not {{state: int}}"
    if not (isinstance(d["pieces"], list) and all(
            isinstance(p, list) and len(p) in (3, 4) and type(p[0]) is int and p[0] >= 0
            and all(ints(x) for x in p[1:]) for p in d["pieces"])):
        return f"of {d['name']!r}: pieces {d['pieces']!r} are not [start, offset, shape, strides]"
    return None


def _header_json(reader: Reader, path: Path, key: str, default: str):
    try:
        return json.loads(reader.metadata(path).get(key, default))
    except (json.JSONDecodeError, RecursionError) as e:
        raise _damaged(path, key, f"not JSON ({e})") from None


def _damaged(path: Path, key: str, problem: str) -> UCPError:
    return UCPError(f"{path}: header metadata {key!r}: {problem}; the file is corrupt: restore it "
                    "or load another iteration")


def read_rng(reader: Reader, path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    f = reader.open(path)
    tensors = {k.removeprefix("rng/"): f.get_tensor(k) for k in f.keys() if k.startswith("rng/")}
    return tensors, _header_json(reader, path, "rng", "{}")
