"""The read planner: a load's reads run once on a planning copy of its source (`_RecordingReader`
returns placeholders and records byte ranges), then the objects fetch those ranges in merged,
parallel ranged GETs. Backends whose files are local read through the page cache and need no plan."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from megatron_ucp.storage.reader import Reader
from megatron_ucp.storage.store_reads import PREFETCH_OBJECTS
from megatron_ucp.storage.urls import Location, backend, location


class ReadsFiles:
    """What a checkpoint source reports of its reads: bytes and files (through `self.reader`)."""

    reader: Reader

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read

    @property
    def files_opened(self) -> int:
        return len(self.reader.handles)

    @property
    def requests(self) -> int:
        """GET requests issued to an object store (0 for local files)."""
        return sum(h.requests for h in self.reader.handles.values() if h is not None)

    def planning_copy(self, reader: Reader):
        """A copy of this source whose reads go to `reader` and check no checksum (its values are
        placeholders): `plan_reads` runs a load's reads through it to learn their byte ranges."""
        planner = copy.copy(self)
        planner.reader = reader
        planner.verify_checksums = False
        return planner


class _RecordingReader(Reader):
    """The reader of a planning pass: headers come from (and stay in) the real reader; each read
    records the byte range it would fetch and returns an uninitialized tensor of the right shape."""

    def __init__(self, real: Reader):
        super().__init__()
        self.real = real
        self.checked = real.checked
        self.ranges: dict[Location, list[tuple[int, int]]] = {}

    def open(self, path: Location):
        return self.real.open(path)

    def read_into(self, path: Location, key: str, out: torch.Tensor, start: int = 0,
                  checksum: bool = False, crc: int = 0) -> int | None:
        begin = self.open(path).entries[key][2] + start * out.element_size()
        self.ranges.setdefault(location(path), []).append((begin, begin + out.nbytes))
        return None  # (out keeps its values: a planning pass reads nothing)

    def read(self, path: Location, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        obj = self.open(path)
        dtype, shape = obj.entries[key][:2]
        if index is not None:
            shape = tuple(torch.empty(shape, dtype=dtype, device="meta")[index].shape)
        self.ranges.setdefault(location(path), []).append(obj.row_range(key, index))
        return torch.empty(shape, dtype=dtype)  # (placeholder values: no memset of the rank's share)


def plan_reads(source: ReadsFiles, reads: Callable[[ReadsFiles], None]) -> None:
    """Planner apart from storage: run `reads(source)` once on a planning copy of an object-store
    source to learn the byte ranges each object must give, and hand them to the objects, which then
    fetch them in merged, parallel ranged GETs (`SafetensorsObject.plan`) instead of one request
    per tensor. Local sources read through the page cache and need no plan."""
    where = getattr(source, "dir", None)
    if where is None or backend(where).local_files:
        return
    planner = source.planning_copy(_RecordingReader(source.reader))
    reads(planner)
    # the first objects the load reads start coming at once (a window each, in the background);
    # the others at their first read, so memory holds a few windows, not one per object
    for i, (path, ranges) in enumerate(planner.reader.ranges.items()):
        source.reader.open(path).plan(ranges, start=i < PREFETCH_OBJECTS)

