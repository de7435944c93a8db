"""The fragment form: what `save` writes, one safetensors file per rank, no gathering.

`rank_XXXXX.safetensors` holds, for every parameter copy the rank owns canonically, the rank's
distributed-optimizer range [start, end) of the flattened local (TP-sliced) tensor: tensors
`<name>/param` (fp32 master weight), `<name>/exp_avg`, `<name>/exp_avg_sq` (a persistent buffer:
`<name>/param` only, the whole local tensor, from DP rank 0). Its safetensors
`__metadata__` key `fragments` is JSON: for each fragment the local shape, the range, the Adam step,
the crc32 of each tensor and the pieces (strided views of the local tensor -> boxes of the universal
tensor).
`rng/*` tensors and the `rng` metadata key hold the rank's generator states.

`FragmentSource` answers "give me this box of this universal tensor" by reading only the byte
ranges of the fragments that overlap it.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_ucp.errors import UCPError
from megatron_ucp.fragment_index import paused_gc
from megatron_ucp.spec import Piece, states_of
from megatron_ucp.storage import Reader, SafetensorsWriter, crc32, crc32_many

RECENT_BYTES = 256 * 2**20  # whole local tensors kept for transposed pieces (oldest evicted first)


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
    file: Path | None = None  # when read back

    def to_json(self) -> dict:
        return {"name": self.name, "local_shape": list(self.local_shape),
                "pieces": [p.to_json() for p in self.pieces], "range": [self.start, self.end],
                "step": self.step, "crc32": self.crc}

    @classmethod
    def from_json(cls, d: dict, file: Path) -> Fragment:
        return cls(d["name"], tuple(d["local_shape"]), [Piece.from_json(p) for p in d["pieces"]],
                   d["range"][0], d["range"][1], d["step"], crc=d["crc32"], file=file)


def write_rank_file(path: Path, fragments: list[Fragment], rng_tensors: dict[str, torch.Tensor],
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
    for f in fragments:
        for s, t in f.tensors.items():
            w.write(f"{f.name}/{s}", t)
    for k, v in rng_tensors.items():
        w.write(f"rng/{k}", v)
    w.close()
    return w.nbytes


@dataclass
class SourceTensor:
    """One canonical local tensor of the saving run and the fragments that hold it."""

    local_shape: tuple[int, ...]
    pieces: list[Piece]
    fragments: list[Fragment]


class FragmentSource:
    """Reads boxes of universal tensors out of a fragment checkpoint."""

    def __init__(self, ckpt_dir: Path, manifest: dict, reader: Reader | None = None,
                 verify_checksums: bool = True):
        self.dir = Path(ckpt_dir)
        self.manifest = manifest
        self.reader = reader or Reader()
        # whole local tensors read for transposed pieces: the pieces of an expert weight (and its
        # TP slices) interleave, so each tensor is read once
        self._recent: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.verify_checksums = verify_checksums
        self.tensors: dict[str, list[SourceTensor]] = {}
        self.steps: dict[str, float] = {}
        self._crcs: dict[Path, dict[tuple[str, int], dict[str, int]]] = {}  # from rank file headers
        if all("slices" in p for p in manifest["params"].values()):  # version 3: the manifest indexes
            with paused_gc():                                        # them, no rank file is opened
                self._from_index()
        else:  # versions 1 and 2: every rank file's header lists its fragments
            for rank in range(manifest["layout_world_size"]):
                path = self.dir / rank_file_name(rank)
                for d in json.loads(self.reader.metadata(path).get("fragments", "[]")):
                    self._add(Fragment.from_json(d, path))
        self._check_coverage()

    def _from_index(self) -> None:
        files = [self.dir / f for f in self.manifest["files"]]
        for name, p in self.manifest["params"].items():
            self.steps[name] = p["step"]
            for s in p["slices"]:
                shape, pieces = tuple(s["local_shape"]), [Piece.from_json(x) for x in s["pieces"]]
                try:
                    frags = [Fragment(name, shape, pieces, a, b, p["step"], file=files[i])
                             for i, a, b in s["fragments"]]
                except (IndexError, TypeError, ValueError) as e:
                    raise UCPError(f"{self.dir / 'manifest.json'}: parameter {name}: bad fragment "
                                   f"entry ({e}); the manifest is damaged") from e
                self.tensors.setdefault(name, []).append(SourceTensor(shape, pieces, frags))

    def _crc(self, f: Fragment, state: str) -> int:
        """A fragment's checksum, from its rank file's header (read when the file is opened)."""
        if not f.crc:
            if f.file not in self._crcs:
                self._crcs[f.file] = {(d["name"], d["range"][0]): d["crc32"] for d in json.loads(
                    self.reader.metadata(f.file).get("fragments", "[]"))}
            crc = self._crcs[f.file].get((f.name, f.start))
            if crc is None:
                raise UCPError(f"{f.file}: has no fragment of {f.name} at element {f.start}, which "
                               "the manifest puts there; the file is from another save")
            f.crc = crc
        return f.crc[state]

    def _add(self, f: Fragment) -> None:
        if f.name in self.steps and self.steps[f.name] != f.step:
            raise UCPError(f"{f.file}: parameter {f.name} has Adam step {f.step} but another rank "
                           f"saved {self.steps[f.name]}; the checkpoint mixes iterations")
        self.steps[f.name] = f.step
        for st in self.tensors.setdefault(f.name, []):
            if st.pieces == f.pieces:
                st.fragments.append(f)
                return
        self.tensors[f.name].append(SourceTensor(f.local_shape, f.pieces, [f]))

    def _check_coverage(self) -> None:
        for name, spec in self.manifest["params"].items():
            sts = self.tensors.get(name)
            if not sts:
                raise UCPError(f"{self.dir}: no rank file holds parameter {name}; the checkpoint "
                               "is incomplete (a rank file is missing or from another save)")
            covered = 0
            for st in sts:
                st.fragments.sort(key=lambda f: f.start)
                pos = 0
                for f in st.fragments:
                    if f.start != pos:
                        raise UCPError(f"{self.dir}: parameter {name}: elements [{pos}, {f.start}) "
                                       "of a saved slice are in no rank file; checkpoint incomplete")
                    pos = f.end
                if pos != math.prod(st.local_shape):
                    raise UCPError(f"{self.dir}: parameter {name}: a saved slice ends at element "
                                   f"{pos} of {math.prod(st.local_shape)}; checkpoint incomplete")
                covered += sum(math.prod(p.shape) for p in st.pieces)
            if covered != math.prod(spec["shape"]):
                raise UCPError(f"{self.dir}: parameter {name}: saved slices cover {covered} of "
                               f"{math.prod(spec['shape'])} elements; checkpoint incomplete")

    def step(self, name: str) -> float:
        return self.steps[name]

    def verify(self) -> int:
        """Read every fragment whole and check its crc32; the constructor already checked that
        every element of every parameter is saved exactly once. Returns tensors checked."""
        n = 0
        for name, sts in self.tensors.items():
            _check_tiling(self.dir, name, [p for st in sts for p in st.pieces])
            for st in sts:
                for f in st.fragments:
                    for state in states_of(self.manifest["params"][name]):
                        self._read_flat(name, state, st, f.start, f.end)  # checks the crc32
                        n += 1
        return n

    def _read_whole(self, name: str, state: str, st: SourceTensor) -> torch.Tensor:
        if any(k[0] != name for k in self._recent):  # only one universal tensor's pieces interleave
            self._recent.clear()
        key = (name, state, id(st))
        if key in self._recent:
            self._recent.move_to_end(key)
            return self._recent[key]
        buf = self._read_flat(name, state, st, 0, math.prod(st.local_shape))
        self._recent[key] = buf
        while len(self._recent) > 1 and sum(t.nbytes for t in self._recent.values()) > RECENT_BYTES:
            self._recent.popitem(last=False)
        return buf

    def _read_flat(self, name: str, state: str, st: SourceTensor, a: int, b: int) -> torch.Tensor:
        buf = torch.empty(b - a, dtype=torch.float32)
        for f in st.fragments:
            s, e = max(a, f.start), min(b, f.end)
            if e <= s:
                continue
            key = f"{name}/{state}"
            if s == f.start and e == f.end:
                crc = self._crc(f, state) if self.verify_checksums else None  # the header first
                t = self.reader.read(f.file, key)
                if crc is not None and crc32(t) != crc:
                    raise UCPError(f"{f.file}: checksum mismatch in tensor {key!r}; the file is "
                                   "corrupt: restore it or load an earlier iteration")
            else:
                t = self.reader.read(f.file, key, (slice(s - f.start, e - f.start),))
            buf[s - a:e - a] = t
        return buf

    def read(self, name: str, state: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """Box [offset, offset + shape) of universal tensor `name`, state `state`, as fp32."""
        out = torch.empty(shape, dtype=torch.float32)
        filled = 0
        for st in self.tensors[name]:
            for pc in st.pieces:
                lo = [max(o, p) for o, p in zip(offset, pc.offset)]
                hi = [min(o + n, p + m) for o, n, p, m in zip(offset, shape, pc.offset, pc.shape)]
                if any(h <= lo_ for lo_, h in zip(lo, hi)):
                    continue
                first, last = pc.span(tuple(a - p for a, p in zip(lo, pc.offset)),
                                      tuple(b - p for b, p in zip(hi, pc.offset)))
                if pc.contiguous:
                    flat = self._read_flat(name, state, st, first, last + 1)
                else:  # a transposed piece interleaves with its neighbours: read the tensor once
                    flat = self._read_whole(name, state, st)[first:]
                region = flat.as_strided([h - lo_ for lo_, h in zip(lo, hi)], pc.strides)
                out[tuple(slice(lo_ - o, h - o) for lo_, h, o in zip(lo, hi, offset))] = region
                filled += region.numel()
        if filled != out.numel():
            raise UCPError(f"{self.dir}: parameter {name}: only {filled} of {out.numel()} requested "
                           "elements are saved; checkpoint incomplete")
        return out

    def rng(self, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
        path = self.dir / rank_file_name(rank)
        f = self.reader.open(path)
        tensors = {k.removeprefix("rng/"): f.get_tensor(k) for k in f.keys() if k.startswith("rng/")}
        return tensors, json.loads(self.reader.metadata(path).get("rng", "{}"))


def _check_tiling(where: Path, name: str, pieces: list[Piece]) -> None:
    """No two saved boxes of one universal tensor overlap (with the volume check: exact cover)."""
    for i, a in enumerate(pieces):
        for b in pieces[i + 1:]:
            if all(max(x, y) < min(x + n, y + m)
                   for x, n, y, m in zip(a.offset, a.shape, b.offset, b.shape)):
                raise UCPError(f"{where}: parameter {name}: two saved slices overlap at "
                               f"{a.offset} and {b.offset}; the checkpoint mixes layouts")
