"""Reading objects by byte ranges: merged, parallel ranged GETs (`request_ranges`), safetensors
objects read through planned windows (`SafetensorsObject`), and torch.distributed.checkpoint items
fetched per object (`DcpObjectReader`)."""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from megatron_ucp.errors import UCPError
from megatron_ucp.storage.backend import ByteRun
from megatron_ucp.storage.object_store import ObjectPath, get_ranges, head
from megatron_ucp.storage.safetensors_codec import DTYPE_TO_ST, header_length, parse_header

WINDOW_BYTES = 64 * 2**20  # planned ranges fetched together per object: a load holds two windows
PREFETCH_OBJECTS = 4  # objects whose first window a planned load starts at once (others at their first read)
COALESCE_BYTES = 2**20  # ranges less than this apart are fetched by one GET (obstore's rule too)
STREAM_BYTES = 16 * 2**20  # a merged range longer than this is fetched as pieces of it, in parallel
GET_STREAMS = 8  # ranged GETs of one process in flight at once (one stream each)
HEADER_GUESS = 64 * 2**10  # bytes fetched for a safetensors header before knowing its length

@functools.cache
def _streams() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(GET_STREAMS, thread_name_prefix="megatron-ucp-get")


def request_ranges(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The GETs that fetch these ranges: ranges less than COALESCE_BYTES apart merged into one,
    then each merged range cut into pieces of at most STREAM_BYTES (one stream each: a single
    HTTP stream is slower than several against the same store)."""
    merged: list[list[int]] = []
    for a, b in sorted(ranges):
        if merged and a - merged[-1][1] <= COALESCE_BYTES:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(s, min(s + STREAM_BYTES, b)) for a, b in merged for s in range(a, b, STREAM_BYTES)]


def merged_requests(ranges: Sequence[tuple[int, int]]) -> int:
    """The GETs `fetch_ranges` issues for these ranges."""
    return len(request_ranges(ranges))


def start_ranges(path: ObjectPath, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int, Future]]:
    """The GETs of `request_ranges` started, GET_STREAMS of them in flight at once (obstore
    releases the GIL): (start, end, future of [bytes]) pieces that cover `ranges`, each usable as
    soon as it has come, while the others still come."""
    return [(a, b, _streams().submit(get_ranges, path, [a], [b])) for a, b in request_ranges(ranges)]


def fetch_ranges(path: ObjectPath, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int, memoryview]]:
    """The bytes of `ranges` of one object as (start, end, bytes) pieces that cover them."""
    return [(a, b, f.result()[0]) for a, b, f in start_ranges(path, ranges)]



class SafetensorsObject:
    """A safetensors object read by byte ranges, with the part of `safetensors.safe_open`'s
    interface the library uses (metadata, keys, get_tensor, get_slice). Its header is read with the
    first request; tensors come from `prefetch`ed ranges when they were planned, else one ranged
    GET each."""

    def __init__(self, path: ObjectPath):
        self.path = path
        size = head(path)
        if size is None:
            raise UCPError(f"{path}: object is missing; the checkpoint is incomplete, re-save it or "
                           "point to another iteration")
        self.size = size
        self.requests = 1
        first = bytes(get_ranges(path, [0], [min(size, HEADER_GUESS)])[0]) if size else b""
        self.requests += 1
        n = header_length(first, size, self._bad)
        raw = first[8:8 + n] if 8 + n <= len(first) else bytes(get_ranges(path, [8], [8 + n])[0])
        self._meta, self.entries = parse_header(raw, size, self._bad)
        self.start = 8 + n
        # the current window's pieces, coming or come (start, end, future of [bytes])
        self._cache: list[tuple[int, int, Future]] = []
        self._planned: list[tuple[int, int]] = []  # ranges a planned load will read, in order
        self._next = 0  # the first planned range not fetched yet
        # the next window (its ranges, its pieces), coming
        self._ahead: tuple[list[tuple[int, int]], list[tuple[int, int, Future]]] | None = None

    def _bad(self, why: str) -> UCPError:
        return UCPError(f"{self.path}: not a readable safetensors object ({why}); the object is "
                        "truncated or corrupt, restore it or use another iteration")

    def metadata(self) -> dict[str, str]:
        return self._meta

    def keys(self) -> list[str]:
        return list(self.entries)

    def plan(self, ranges: Sequence[tuple[int, int]], start: bool = True) -> None:
        """The byte ranges (absolute, in the order they will be read) a load needs of this object:
        a read that misses fetches it together with the planned ranges after it, up to
        `WINDOW_BYTES` (nearby ranges merged into one GET, the GETs in parallel), and the window
        after it is fetched in the background while this one is used. A read waits only for the
        GETs it needs: the first pieces of a window are copied out while the rest still come.
        Memory holds two windows per object, not the rank's share of the checkpoint. start: fetch
        the first window now, in the background (else at the first read)."""
        self._planned = [r for r in ranges if r[1] > r[0]]
        self._next = 0
        self._ahead = None
        if start and self._planned:  # the first window comes while the load reads other objects
            window, self._next = self._window_from(0)
            self._ahead = (window, self._get(window))

    def _window_from(self, i: int, first: tuple[int, int] | None = None) -> tuple[list[tuple[int, int]], int]:
        """Planned ranges from index i (after `first`, the read that missed) up to WINDOW_BYTES;
        and the index after them."""
        window = [first] if first else []
        nbytes = first[1] - first[0] if first else 0
        while i < len(self._planned) and nbytes < WINDOW_BYTES:
            r = self._planned[i]
            if not (first and r[0] >= first[0] and r[1] <= first[1]):
                window.append(r)
                nbytes += r[1] - r[0]
            i += 1
        return window, i

    def _get(self, ranges: list[tuple[int, int]]) -> list[tuple[int, int, Future]]:
        self.requests += merged_requests(ranges)
        return start_ranges(self.path, ranges)

    def _cached(self, begin: int, end: int) -> list[memoryview] | None:
        """The bytes begin..end from the window's pieces (several when they span pieces; waiting
        for those still coming), or None."""
        out, at = [], begin
        for a, b, piece in self._cache:  # (pieces are sorted and do not overlap)
            if a <= at < b:
                out.append(piece.result()[0][at - a:min(end, b) - a])
                at = min(end, b)
                if at == end:
                    return out
        return None

    def _bytes(self, begin: int, end: int) -> list[memoryview]:
        found = self._cached(begin, end)
        if found is not None:
            return found
        ahead, self._ahead = self._ahead, None
        if ahead is not None and any(a <= begin and end <= b for a, b in ahead[0]):
            self._cache = ahead[1]  # started while the previous window was used
        else:
            i = self._next
            while i < len(self._planned) and self._planned[i][1] <= begin:
                i += 1  # (ranges before this read were served or are covered by it)
            window, self._next = self._window_from(i, (begin, end))
            self._cache = self._get(window)
        if self._next < len(self._planned):  # the next window comes while this one is used
            window, self._next = self._window_from(self._next)
            self._ahead = (window, self._get(window))
        found = self._cached(begin, end)
        if found is None:
            raise self._bad(f"bytes {begin}-{end} did not come back")
        return found

    def _tensor(self, dtype: torch.dtype, shape: tuple[int, ...], begin: int, end: int) -> torch.Tensor:
        data = bytearray(end - begin)  # the tensor's own memory: one copy out of the fetched pieces
        at = 0
        for piece in self._bytes(begin, end) if end > begin else []:
            data[at:at + len(piece)] = piece
            at += len(piece)
        if at != end - begin:
            raise self._bad(f"bytes {begin}-{end} came back as {at} bytes")
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape) if data else \
            torch.empty(shape, dtype=dtype)

    def get_tensor(self, key: str) -> torch.Tensor:
        dtype, shape, begin, end = self.entries[key]
        return self._tensor(dtype, shape, begin, end)

    def read_into(self, key: str, start: int, out: memoryview, crc: int | None = None) -> int | None:
        """Bytes [start, start + len(out)) of tensor `key` copied from the fetched windows straight
        into `out` (no tensor of their own); with `crc` (the crc32 so far), their crc32 continuing
        it, taken piece by piece as they are copied."""
        _dtype, _shape, begin, end = self.entries[key]
        a, b = begin + start, begin + start + len(out)
        if start < 0 or b > end:
            raise self._bad(f"a read of bytes {start}-{start + len(out)} of tensor {key!r} lies "
                            f"outside its {end - begin} bytes")
        at = 0
        for piece in self._bytes(a, b) if b > a else []:
            out[at:at + len(piece)] = piece
            if crc is not None:
                crc = zlib.crc32(piece, crc)
            at += len(piece)
        if at != b - a:
            raise self._bad(f"bytes {a}-{b} came back as {at} bytes")
        return crc

    def byte_run(self, key: str) -> ByteRun:
        _dtype, _shape, begin, end = self.entries[key]
        return ByteRun(self.path, begin, end - begin)  # (`copy_runs` takes local runs only)

    def get_slice(self, key: str) -> _Slice:
        return _Slice(self, key)

    def row_range(self, key: str, index: tuple[slice, ...] | None) -> tuple[int, int]:
        """The absolute byte range a read of `index` needs: the whole rows of dim 0 it spans."""
        dtype, shape, begin, end = self.entries[key]
        if not index or not shape:
            return begin, end
        r0, r1, _ = index[0].indices(shape[0])
        row = (end - begin) // shape[0] if shape[0] else 0
        return begin + r0 * row, begin + max(r1, r0) * row


class _Slice:
    def __init__(self, obj: SafetensorsObject, key: str):
        self.obj, self.key = obj, key

    def get_dtype(self) -> str:
        dtype = self.obj.entries[self.key][0]
        return DTYPE_TO_ST[dtype]

    def get_shape(self) -> list[int]:
        return list(self.obj.entries[self.key][1])

    def __getitem__(self, index) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        dtype, shape, _, _ = self.obj.entries[self.key]
        if not shape:
            return self.obj.get_tensor(self.key)
        a, b = self.obj.row_range(self.key, index)
        r0, r1, _ = index[0].indices(shape[0])
        rows = self.obj._tensor(dtype, (max(r1 - r0, 0), *shape[1:]), a, b)
        return rows[(slice(None), *index[1:])].contiguous()



# --- torch.distributed.checkpoint directories in a store (Megatron-LM torch_dist, FSDP forms) -----
def _join(pieces: Sequence[tuple[int, int, memoryview]], begin: int, end: int, where: ObjectPath) -> bytes:
    """Bytes [begin, end) of an object from fetched pieces (sorted, not overlapping)."""
    out, at = bytearray(), begin
    for a, b, data in pieces:
        if a <= at < min(b, a + len(data)):  # (a piece past the object's end comes back short)
            piece = data[at - a:min(end, b) - a]
            out += piece
            at += len(piece)
    if at < end:
        raise UCPError(f"{where}: bytes {begin}-{end} did not come back; the object is shorter than "
                       "its .metadata says (truncated): restore it or use another iteration")
    return bytes(out)


class DcpObjectReader:
    """The byte side of torch.distributed.checkpoint's FileSystemReader for a prefix in a store:
    a load's items are fetched per object as merged ranged GETs (several in flight) before the
    loader reads them, so no item becomes a request of its own. Made by `storage.dcp_reader`,
    which wraps it in FileSystemReader's planning and decoding (and reads `.metadata` once)."""

    def __init__(self, prefix: ObjectPath):
        self.prefix = prefix
        self.fetched: dict[ObjectPath, list[tuple[int, int, memoryview]]] = {}
        self.requests = 0
        self.objects_fetched = 0  # (load, object) pairs: merged ranges make one GET of each

    def fetch(self, items: dict[str, list[tuple[int, int]]]) -> None:
        """Fetch these byte ranges of these objects (name relative to the prefix -> ranges)."""
        self.fetched = {}
        for name, ranges in items.items():
            self.requests += merged_requests(ranges)
            self.objects_fetched += 1
            self.fetched[self.prefix / name] = fetch_ranges(self.prefix / name, sorted(ranges))

    def slice(self, path: ObjectPath, offset: int, length: int) -> bytes:
        return _join(self.fetched[path], offset, offset + length, path)
