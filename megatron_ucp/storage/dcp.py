"""torch.distributed.checkpoint's FileSystemReader for a local directory or a store prefix (the
Megatron-LM torch_dist and FSDP forms): `.metadata` parsed once; in a store, each load's items
fetched as merged ranged GETs first (`store_reads.DcpObjectReader`)."""

from __future__ import annotations

import contextlib
import functools
import io
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_ucp.storage.object_store import ObjectPath
from megatron_ucp.storage.store_reads import DcpObjectReader

if TYPE_CHECKING:  # (urls imports the backends, which import this module)
    from megatron_ucp.storage.urls import Location


@functools.cache
def _dcp_reader_class() -> type:
    """FileSystemReader for a local directory or a store prefix (built on first use: importing
    torch.distributed.checkpoint is not free)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem

    class StoreFiles(FileSystem):
        """FileSystemReader's file calls, answered by the store for object paths: a data object is
        a handle whose items `DcpReader.read_data` fetched; `.metadata` is read whole."""

        def __init__(self, objects: DcpObjectReader):
            self.objects = objects

        @contextlib.contextmanager
        def create_stream(self, path, mode: str):
            if not isinstance(path, ObjectPath):
                with super().create_stream(path, mode) as stream:
                    yield stream
            elif path in self.objects.fetched:
                yield path
            else:
                yield io.BytesIO(path.read_bytes())

        def concat_path(self, path, suffix: str):
            return path / suffix if isinstance(path, ObjectPath) else super().concat_path(path, suffix)

    class DcpReader(FileSystemReader):
        """`.metadata` parsed once (a source loads key by key); in a store, each load's items are
        fetched as merged ranged GETs first (`object_store.DcpObjectReader`)."""

        def __init__(self, directory: Location):
            super().__init__(directory if isinstance(directory, Path) else ".")
            self._metadata = None
            self.objects = None
            if isinstance(directory, ObjectPath):
                self.objects = DcpObjectReader(directory)
                self.fs, self.path = StoreFiles(self.objects), directory

        def read_metadata(self, *args, **kwargs):
            if self._metadata is None:
                self._metadata = super().read_metadata(*args, **kwargs)
            return self._metadata

        def read_data(self, plan, planner):
            if self.objects is None:
                return super().read_data(plan, planner)
            items: dict[str, list[tuple[int, int]]] = {}
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                items.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length))
            self.objects.fetch(items)
            try:
                return super().read_data(plan, planner)
            finally:
                self.objects.fetched = {}

        def _slice_file(self, file, sinfo):
            if isinstance(file, ObjectPath):
                return io.BytesIO(self.objects.slice(file, sinfo.offset, sinfo.length))
            return super()._slice_file(file, sinfo)

    return DcpReader


def dcp_reader(directory: Location):
    """torch.distributed.checkpoint's reader of a checkpoint directory, local or in a store."""
    return _dcp_reader_class()(directory)
