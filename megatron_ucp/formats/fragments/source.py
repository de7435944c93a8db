"""Read boxes of universal tensors out of a fragment checkpoint, touching only the bytes needed.

The manifest's index (format 3) says which rank file holds which range of each saved slice, so
opening the checkpoint opens no rank file; formats 1 and 2 list the fragments in each rank file's
header instead, which is read at open. Checksums are in the headers and are checked for every
fragment read whole (`verify_fragments=True`: for every fragment touched, as `convert` needs).
"""

from __future__ import annotations

import math
import re
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from megatron_ucp import storage
from megatron_ucp.errors import UCPError
from megatron_ucp.formats.base import Source
from megatron_ucp.formats.fragments.index import check_tiling, tiling_suspects
from megatron_ucp.formats.fragments.rank_file import header_fragments, rank_file_name, read_rng
from megatron_ucp.formats.manifest import FragmentEntry, Manifest, SliceEntry
from megatron_ucp.spec import Piece, contiguous_strides, tiles_exactly
from megatron_ucp.storage import (
    ByteRun,
    Reader,
    ReadsFiles,
    crc32,
    crc32_combine,
    location,
    tensor_bytes,
)

GATHER_BYTES = 8 * 2**20  # scratch per gathered block (`_row_blocks`): bounds a load's added memory
RECENT_BYTES = 256 * 2**20  # whole local tensors / fragments kept for reuse (oldest evicted first)
DAMAGED_INDEX = ("the manifest's index or the rank files are damaged or incomplete: restore them or "
                 "load another iteration")


class _Paths:
    """The rank files' paths by index, each made when first asked for (a load opens a few of
    thousands)."""

    def __init__(self, root: Path, names: list[str]):
        self.root, self.names = root, names

    def __getitem__(self, i: int) -> Path:
        return self.root / self.names[i]

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[Path]:
        return (self.root / name for name in self.names)


class _IndexSlices(dict):
    """name -> the tensor's saved slices, parsed (`ParamEntry.slices`) and checked (`_check_volume`)
    when first asked for. It holds no reference to its FragmentSource: a cycle through the source
    would keep the rank files' mappings alive until a full garbage collection."""

    def __init__(self, ckpt_dir: Path, params: dict):
        super().__init__()
        self.dir, self.params = ckpt_dir, params

    def __missing__(self, name: str) -> list[SliceEntry]:
        slices = self.params[name].slices
        _check_volume(self.dir, name, self.params[name].shape, slices)
        self[name] = slices
        return slices


def _checksum_mismatch(path: Path, key: str) -> UCPError:
    return UCPError(f"{path}: checksum mismatch in tensor {key!r}; the file is corrupt: restore it "
                    "or load an earlier iteration")


def _check_volume(ckpt_dir: Path, name: str, shape: tuple[int, ...], slices: list[SliceEntry]) -> None:
    """Every element of the tensor is in exactly one fragment (the volume: the reads check where
    the slices fall)."""
    if not slices:
        raise UCPError(f"{ckpt_dir}: no rank file holds parameter {name}; the checkpoint "
                       "is incomplete (a rank file is missing or from another save)")
    check_tiling(str(ckpt_dir), name, shape, slices, overlap=False, advice=DAMAGED_INDEX)


def _check_iteration_dir(ckpt_dir: Path, manifest: Manifest) -> None:
    """A save names its directory after its iteration (`iter_XXXXXXX`); a manifest that says
    another one was damaged or copied from another save, and would resume at the wrong step."""
    named = re.fullmatch(r"iter_(\d+)", ckpt_dir.name)
    if named and int(named.group(1)) != manifest.iteration:
        raise UCPError(f"{ckpt_dir / 'manifest.json'}: iteration {manifest.iteration!r}, but the save "
                       f"wrote it to {ckpt_dir.name}; the manifest is damaged or from another save: "
                       "restore it or load another iteration")


def _row_blocks(lo: list[int], hi: list[int], sl: SliceEntry, pc: Piece) -> list[tuple]:
    """The part [lo, hi) of a box that contiguous piece `pc` holds, cut along its first dim into
    blocks whose bytes in the rank file span at most GATHER_BYTES: a piece whose rows interleave
    with another's in the box (a TP split of dim 1) is gathered through a bounded scratch buffer."""
    if not pc.contiguous or len(lo) < 2:
        return [(lo, hi, sl, pc)]
    rows = max(1, GATHER_BYTES // (4 * pc.strides[0]))
    return [([r, *lo[1:]], [min(r + rows, hi[0]), *hi[1:]], sl, pc) for r in range(lo[0], hi[0], rows)]


class FragmentSource(ReadsFiles, Source):
    """Reads boxes of universal tensors out of a fragment checkpoint."""

    format = "fragments"  # its name in the `formats` registry

    def __init__(self, ckpt_dir: Path, manifest: Manifest, verify_checksums: bool = True,
                 verify_fragments: bool = False):
        self.dir = location(ckpt_dir)
        self.manifest = manifest
        _check_iteration_dir(self.dir, manifest)
        self.origin = {"kind": "fragments", "path": str(self.dir)}
        self.reader = Reader()
        self.verify_checksums = verify_checksums
        # every fragment a read touches is read whole once and checked against its crc32, also
        # when a read needs only part of it (a fragment can span several pieces)
        self.verify_fragments = verify_fragments and verify_checksums
        # whole local tensors (transposed pieces interleave) or fragments read for reuse
        self._recent: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        # rank file -> its header's fragment records by (name, start), read when the file is
        # opened; each fragment the index names is checked against them once (`_header`)
        self._headers: dict[int, dict[tuple[str, int], dict]] = {}
        self._matched: set[tuple[int, int]] = set()  # (id(slice), fragment file)
        self._tiled: set[int] = set()  # slices whose interleaved pieces were checked
        self._scratch_buf = torch.empty(0)  # `_scratch`
        # (rank file, tensor key) -> (next element, crc32 so far) of a fragment being read in order
        self._running: dict[tuple[int, str], tuple[int, int]] = {}
        files = manifest.files or [rank_file_name(r) for r in range(manifest.layout_world_size)]
        self.files = _Paths(self.dir, files)
        if all(p.slices_json is not None and p.step is not None for p in manifest.params.values()):
            # version 3: the index. Every tensor's fragments are checked now, in bulk (the
            # suspects one by one); its slices are parsed, and their volume checked, when it is
            # first read (a load reads a few of thousands)
            self.slices = _IndexSlices(self.dir, manifest.params)
            self.steps = {name: p.step for name, p in manifest.params.items()}
            for name in tiling_suspects(manifest.params, len(files), whole=False):
                self.slices[name]  # parsed and checked now
        else:  # versions 1 and 2: every rank file's header lists its fragments
            self._from_headers()
            for name in manifest.params:
                _check_volume(self.dir, name, manifest.params[name].shape, self.slices.get(name, []))

    def _from_headers(self) -> None:
        self.slices: dict[str, list[SliceEntry]] = {}
        self.steps: dict[str, float] = {}
        for i, path in enumerate(self.files):
            for d in self._records(i).values():
                name, step = d["name"], d["step"]
                if name in self.steps and self.steps[name] != step:
                    raise UCPError(f"{path}: parameter {name} has Adam step {step} but another "
                                   f"rank saved {self.steps[name]}; the checkpoint mixes iterations")
                self.steps[name] = step
                shape, pieces = tuple(d["local_shape"]), [Piece.from_json(p) for p in d["pieces"]]
                entries = self.slices.setdefault(name, [])
                sl = next((s for s in entries if s.pieces == pieces), None)
                if sl is None:
                    entries.append(sl := SliceEntry(shape, pieces, []))
                sl.fragments.append(FragmentEntry(i, *d["range"]))
        for entries in self.slices.values():
            for sl in entries:
                sl.fragments.sort(key=lambda f: f.start)

    def step(self, name: str) -> float:
        return self.steps[name]

    def planning_copy(self, reader: Reader) -> FragmentSource:
        planner = super().planning_copy(reader)
        planner.verify_fragments = False
        planner._recent = OrderedDict()  # (its placeholder tensors must not reach this source's cache)
        planner._running = {}
        return planner

    def check_files(self, part: int = 0, parts: int = 1) -> None:
        """Every parameter whose fragments a rank file holds is in the manifest: a manifest that
        lost a parameter's entry would otherwise load, verify and convert without it (and its Adam
        moments). Headers only (the records and tensor keys); files part, part + parts, ... of
        the checkpoint, so the ranks of a load share the work."""
        params = self.manifest.params
        for i in range(part, len(self.files), parts):
            path = self.files[i]
            names = {d["name"] for d in self._records(i).values()}
            keys = [k.rsplit("/", 1) for k in self.reader.open(path).keys() if not k.startswith("rng/")]
            unlisted = sorted((names | {name for name, _ in keys}) - params.keys())
            if unlisted:
                raise UCPError(f"{path}: holds fragments of parameter {unlisted[0]}"
                               f"{f' (and {len(unlisted) - 1} more)' if len(unlisted) > 1 else ''}, "
                               "which the manifest does not list; the manifest is damaged or from "
                               "another save (a checkpoint read through it would silently lack the "
                               "parameter): restore it or load another iteration")
            # a state the manifest does not give the parameter (e.g. Adam moments of a parameter
            # it calls a buffer) would be dropped as silently
            extra = next(((n, st) for n, st in keys if st not in params[n].states), None)
            if extra:
                raise UCPError(f"{path}: holds state {extra[1]!r} of parameter {extra[0]}, which the "
                               f"manifest does not list for it (states {list(params[extra[0]].states)}); "
                               "the manifest is damaged or from another save: restore it or load "
                               "another iteration")

    def _records(self, file: int) -> dict[tuple[str, int], dict]:
        """A rank file's header records by (name, start), parsed once."""
        if file not in self._headers:
            self._headers[file] = {(d["name"], d["range"][0]): d
                                   for d in header_fragments(self.reader, self.files[file])}
        return self._headers[file]

    def _header(self, name: str, sl: SliceEntry, f: FragmentEntry) -> dict:
        """The rank file's own record of a fragment the index names: it must be there, with the
        same range and the same place in the universal tensor (pieces), or the index points
        at the wrong file or range."""
        d = self._records(f.file).get((name, f.start))
        if d is None:
            raise UCPError(f"{self.files[f.file]}: has no fragment of {name} at element {f.start}, "
                           "which the manifest puts there; the file is from another save: restore "
                           "this iteration's own file or load another iteration")
        if (id(sl), f.file) not in self._matched:
            if (d["range"] != [f.start, f.end] or tuple(d["local_shape"]) != sl.local_shape
                    or [Piece.from_json(p) for p in d["pieces"]] != sl.pieces):
                raise UCPError(f"{self.files[f.file]}: its fragment of {name} at element {f.start} "
                               "is not the one the manifest index describes (range or place in the "
                               "tensor differ); the index or the file is damaged: restore them or "
                               "load another iteration")
            if d["step"] != self.steps[name]:
                raise UCPError(f"{self.files[f.file]}: its fragment of {name} was saved at Adam step "
                               f"{d['step']}, the manifest says {self.steps[name]}; the manifest is "
                               "damaged or mixes iterations: restore it or load another iteration")
            self._matched.add((id(sl), f.file))
        return d

    def _expected_crc(self, name: str, state: str, sl: SliceEntry, f: FragmentEntry) -> int | None:
        """The crc32 a fragment's rank-file header gives (None when checksums are not verified),
        its header entry checked first: a clear error for a wrong index."""
        path, key = self.files[f.file], f"{name}/{state}"
        header = self._header(name, sl, f)
        if self.verify_checksums and state not in header["crc32"]:
            raise UCPError(f"{path}: its header has no checksum of {key!r}; the file is corrupt: "
                           "restore it or load an earlier iteration")
        self.reader.check(path, key, "F32", (f.end - f.start,))
        return header["crc32"][state] if self.verify_checksums else None

    def _read_fragment(self, name: str, state: str, sl: SliceEntry, f: FragmentEntry) -> torch.Tensor:
        """A whole fragment, its checksum checked."""
        crc = self._expected_crc(name, state, sl, f)
        t = self.reader.read(self.files[f.file], f"{name}/{state}")
        if crc is not None and crc32(t) != crc:
            raise _checksum_mismatch(self.files[f.file], f"{name}/{state}")
        return t

    def _cached(self, key: tuple, read: Callable[[], torch.Tensor]) -> torch.Tensor:
        if any(k[0] != key[0] for k in self._recent):  # only one tensor's pieces interleave
            self._recent.clear()
        if key in self._recent:
            self._recent.move_to_end(key)
            return self._recent[key]
        t = self._recent[key] = read()
        while len(self._recent) > 1 and sum(v.nbytes for v in self._recent.values()) > RECENT_BYTES:
            self._recent.popitem(last=False)
        return t

    def verify(self) -> int:
        """Read every fragment whole and check its crc32, and that the slices of every parameter
        tile it exactly (no gap, no overlap), and that the manifest lists every parameter the
        rank files hold. Returns tensors checked."""
        self.check_files()
        n = 0
        for name, p in self.manifest.params.items():
            check_tiling(str(self.dir), name, p.shape, self.slices[name], advice=DAMAGED_INDEX)
            for sl in self.slices[name]:
                self._check_interleaved(name, sl)  # every piece, as a read of the slice would
                for f in sl.fragments:
                    for state in p.states:
                        self._read_fragment(name, state, sl, f)
                        n += 1
        return n

    def _read_flat(self, name: str, state: str, sl: SliceEntry, a: int, b: int,
                   into: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [a, b) of the slice's flattened local tensor: gathered into `into` (b - a
        elements) when given; else possibly a view of a mapped file or of a cached fragment, which
        the caller copies out and never writes to."""
        if into is not None and not self.verify_fragments:
            self._pread_flat(name, state, sl, a, b, into)
            return into
        parts = []
        for f in sl.fragments:
            s, e = max(a, f.start), min(b, f.end)
            if e <= s:
                continue
            if s == f.start and e == f.end:
                t = self._read_fragment(name, state, sl, f)
            elif self.verify_fragments:
                whole = self._cached((name, state, "fragment", f.file, f.start),
                                     lambda f=f: self._read_fragment(name, state, sl, f))
                t = whole[s - f.start:e - f.start]
            else:
                self._header(name, sl, f)
                self.reader.check(self.files[f.file], f"{name}/{state}", "F32", (f.end - f.start,))
                t = self.reader.read(self.files[f.file], f"{name}/{state}",
                                     (slice(s - f.start, e - f.start),))
            parts.append((s, t))
        if into is None and len(parts) == 1 and parts[0][0] == a and parts[0][1].numel() == b - a:
            return parts[0][1]  # one fragment holds the range: no gathering copy
        buf = torch.empty(b - a, dtype=torch.float32) if into is None else into
        for s, t in parts:
            buf[s - a:s - a + t.numel()] = t
        return buf

    def _pread_flat(self, name: str, state: str, sl: SliceEntry, a: int, b: int,
                    into: torch.Tensor) -> None:
        """`_read_flat` into `into` with each fragment's bytes read straight into their place
        (`Reader.read_into`). A fragment read whole, or front to back in consecutive parts (a
        gather's blocks), is checked against its crc32 when its last element is read."""
        key = f"{name}/{state}"
        for f in sl.fragments:
            s, e = max(a, f.start), min(b, f.end)
            if e <= s:
                continue
            path, dst = self.files[f.file], into[s - a:e - a]
            expected = self._expected_crc(name, state, sl, f)
            # the crc32 of the fragment's elements up to s, when they were read in order up to here
            running = self._running.pop((f.file, key), None)
            so_far = 0 if s == f.start else (running[1] if running and running[0] == s else None)
            verify = expected is not None and so_far is not None
            crc = self.reader.read_into(path, key, dst, start=s - f.start, checksum=verify,
                                        crc=so_far or 0)
            if verify and e == f.end and crc != expected:
                raise _checksum_mismatch(path, key)
            if verify and e < f.end:
                self._running[(f.file, key)] = (e, crc)

    def _scratch(self, n: int) -> torch.Tensor:
        """n fp32 elements of a buffer reused by every read that gathers through one (its pages
        are faulted in once, not per read); it grows to the largest such read."""
        if self._scratch_buf.numel() < n:
            self._scratch_buf = torch.empty(0)  # (freed before the larger one is allocated)
            self._scratch_buf = torch.empty(n, dtype=torch.float32)
        return self._scratch_buf[:n]

    def read(self, name: str, state: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """Box [offset, offset + shape) of universal tensor `name`, state `state`, as fp32 (a new
        tensor: it shares memory with no file and no cache)."""
        hits = self._box_hits(name, offset, shape)  # (a damaged index is refused before allocating)
        out = torch.empty(shape, dtype=torch.float32)
        self._fill(name, state, offset, shape, out, hits)
        return out

    def read_into(self, name: str, state: str, offset: tuple[int, ...], shape: tuple[int, ...],
                  out: torch.Tensor) -> None:
        """`read` into `out` (a contiguous fp32 tensor of `shape`, e.g. a view of the optimizer's
        own state): each fragment's bytes are copied once, from the mapped file into `out`."""
        if tuple(out.shape) != tuple(shape) or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"read_into: out must be a contiguous float32 tensor of shape {list(shape)}")
        self._fill(name, state, offset, shape, out, self._box_hits(name, offset, shape))

    def _box_hits(self, name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> list:
        """The parts of box [offset, offset + shape) the saved pieces hold: (lo, hi, slice, piece)
        each, checked to tile the box."""
        slices = self.slices[name]
        hits = []
        for sl in slices:
            self._check_interleaved(name, sl)
            for pc in sl.pieces:
                lo = [max(o, p) for o, p in zip(offset, pc.offset)]
                hi = [min(o + n, p + m) for o, n, p, m in zip(offset, shape, pc.offset, pc.shape)]
                if all(lo_ < h for lo_, h in zip(lo, hi)):
                    hits.append((lo, hi, sl, pc))
        # every element of the box in exactly one piece, or the index is wrong (the first use
        # checks only the volume of a tensor's slices, this read checks where they fall)
        self._check_cover(name, shape, [(lo, hi) for lo, hi, _, _ in hits])
        return hits

    def _fill(self, name: str, state: str, offset: tuple[int, ...], shape: tuple[int, ...],
              out: torch.Tensor, hits: list) -> None:
        def span(lo: list[int], hi: list[int], pc: Piece) -> tuple[int, int]:
            return pc.span(tuple(a - p for a, p in zip(lo, pc.offset)),
                           tuple(b - p for b, p in zip(hi, pc.offset)))

        if len(hits) == 1 and tuple(hits[0][3].strides) == contiguous_strides(tuple(shape)):
            lo, hi, sl, pc = hits[0]
            first, last = span(lo, hi, pc)
            if last + 1 - first == out.numel():
                # the box is one row-major run of the slice: its fragments land in `out` directly
                self._read_flat(name, state, sl, first, last + 1, into=out.view(-1))
                return
        if not self.verify_fragments:  # (gathering through the scratch buffer, a block at a time)
            hits = [block for hit in hits for block in _row_blocks(*hit)]
        for lo, hi, sl, pc in hits:
            first, last = span(lo, hi, pc)
            if pc.contiguous:  # (through the scratch buffer: `flat` is used before the next read)
                scratch = None if self.verify_fragments else self._scratch(last + 1 - first)
                flat = self._read_flat(name, state, sl, first, last + 1, into=scratch)
            else:  # a transposed piece interleaves with its neighbours: read the tensor once
                flat = self._cached((name, state, "slice", id(sl)), lambda sl=sl: self._read_flat(
                    name, state, sl, 0, math.prod(sl.local_shape)))[first:]
            box = tuple(slice(lo_ - o, h - o) for lo_, h, o in zip(lo, hi, offset))
            out[box] = flat.as_strided([h - lo_ for lo_, h in zip(lo, hi)], pc.strides)

    def read_order(self, names: list[str]) -> list[str]:
        """`names` in the order their first bytes lie in the rank files (file, then offset): a
        conversion that reads in this order reads each file front to back, as `cp` does, instead
        of seeking between files tensor by tensor."""
        def where(name: str) -> tuple[int, int]:
            f = self.slices[name][0].fragments[0]
            state = self.manifest.params[name].states[0]
            return f.file, self.reader.byte_run(self.files[f.file], f"{name}/{state}").offset
        return sorted(names, key=where)

    def leading_runs(self, name: str, state: str,
                     shape: tuple[int, ...]) -> tuple[list[ByteRun], Callable[[], int]] | None:
        """Box [0, shape) of universal tensor `name` (the whole tensor, or its rows up to the true
        vocabulary) as runs of rank-file bytes, for a caller that copies it out unchanged (a
        conversion), where the box is a prefix of one row-major slice: a layout that does not split
        the tensor over TP, its fragments (one, or one per DP rank) consecutive ranges of it. With
        them a function that, once the runs are copied (their pages then in the page cache), checks
        every fragment's crc32 against its header and returns the box's crc32, in one pass over the
        bytes. None where the box needs gathering, checksums are not verified or the checkpoint is in
        an object store (use `read`)."""
        shape, full = tuple(shape), tuple(self.manifest.params[name].shape)
        slices = self.slices[name]
        if (not self.verify_checksums or not storage.has_local_files(self.dir)  # (a store: no file copies)
                or len(slices) != 1 or len(slices[0].pieces) != 1
                or shape[1:] != full[1:] or not 0 < shape[0] <= full[0]):
            return None
        sl, pc = slices[0], slices[0].pieces[0]
        if (pc.start, tuple(pc.offset), tuple(pc.shape), tuple(pc.strides)) != (
                0, (0,) * len(full), full, contiguous_strides(full)):
            return None
        n = math.prod(shape)
        frags = sorted((f for f in sl.fragments if f.start < n), key=lambda f: f.start)
        if [f.start for f in frags] != [0] + [f.end for f in frags[:-1]] or frags[-1].end < n:
            return None  # (not a tiling: `read` names the fault)
        self._check_interleaved(name, sl)
        key = f"{name}/{state}"
        # (path, elements of the fragment in the box, its header's crc32): index and header
        # checked against each other before any byte is copied
        used = [(self.files[f.file], min(f.end, n) - f.start, self._expected_crc(name, state, sl, f))
                for f in frags]
        runs = [self.reader.byte_run(path, key)._replace(nbytes=4 * k) for path, k, _ in used]

        def checked_crc() -> int:
            crc = 0
            for path, k, expected in used:
                crc = crc32_combine(crc, self._checked_prefix_crc(path, key, k, expected), 4 * k)
            return crc
        return runs, checked_crc

    def _checked_prefix_crc(self, path: Path, key: str, used: int, expected: int) -> int:
        """crc32 of a fragment's first `used` elements, its whole crc32 checked on the way."""
        raw = tensor_bytes(self.reader.read(path, key))
        crc = zlib.crc32(raw[:4 * used])
        if zlib.crc32(raw[4 * used:], crc) != expected:
            raise _checksum_mismatch(path, key)
        return crc

    def _check_cover(self, name: str, shape: tuple[int, ...],
                     boxes: list[tuple[list[int], list[int]]]) -> None:
        """The boxes (each the part of the request one piece holds) tile the request: no two
        overlap, and their volumes add up to it. Box arithmetic, not a mask over the elements."""
        if len(boxes) > 1:  # (one piece holding the whole request, the common case, cannot overlap)
            lo = torch.tensor([b[0] for b in boxes], dtype=torch.int64).reshape(len(boxes), len(shape))
            hi = torch.tensor([b[1] for b in boxes], dtype=torch.int64).reshape(len(boxes), len(shape))
            for i in range(0, len(boxes), 1024):  # (a block of rows at a time: bounded memory)
                meet = (torch.maximum(lo[i:i + 1024, None], lo[None]) <
                        torch.minimum(hi[i:i + 1024, None], hi[None])).all(-1)
                meet[torch.arange(meet.shape[0]), torch.arange(i, i + meet.shape[0])] = False
                if bool(meet.any()):
                    j = i + int(meet.any(1).nonzero()[0])
                    raise UCPError(f"{self.dir}: parameter {name}: two saved slices hold the same "
                                   f"elements (at {boxes[j][0]}); {DAMAGED_INDEX}")
        held = sum(math.prod(h - lo_ for lo_, h in zip(lo_b, hi_b)) for lo_b, hi_b in boxes)
        if held != math.prod(shape):
            raise UCPError(f"{self.dir}: parameter {name}: {math.prod(shape) - held} of "
                           f"{math.prod(shape)} requested elements are saved by no rank; {DAMAGED_INDEX}")

    def _check_interleaved(self, name: str, sl: SliceEntry) -> None:
        """Pieces that interleave (not intervals) are checked element by element, once, when
        their slice is first read (the manifest parser checks the others)."""
        if id(sl) in self._tiled:
            return
        if not tiles_exactly(sl.pieces, math.prod(sl.local_shape)):
            raise UCPError(f"{self.dir}: parameter {name}: the pieces of a saved slice do not "
                           f"cover its local tensor exactly once; {DAMAGED_INDEX}")
        self._tiled.add(id(sl))

    def rng_ranks(self) -> range:
        return range(self.manifest.layout_world_size)

    def rng(self, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
        return read_rng(self.reader, self.files[rank])
