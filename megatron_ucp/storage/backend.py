"""The one storage interface: what the library asks of a place that holds checkpoint files.

Two implementations: `local.LocalBackend` (a POSIX filesystem) and `object_store.ObjectStoreBackend`
(S3, GCS, Azure through obstore). `urls.backend(location)` picks one; nothing outside this package
knows which it got. Like torch.distributed.checkpoint's StorageReader/StorageWriter, the interface
is small: file queries and reads, a streaming writer, a whole-object put, and the commit pieces
(a staged directory or prefix published by its writer's marker file, leftovers of writers that
died). A new store implements this class and adds its URL schemes to `urls.BACKENDS`.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from megatron_ucp.errors import UCPError

if TYPE_CHECKING:
    from megatron_ucp.storage.urls import Location


class AlreadyExists(UCPError):
    """A create-only put found the file there."""


class ByteRun(NamedTuple):
    """Bytes [offset, offset + nbytes) of file `path`."""

    path: Path
    offset: int
    nbytes: int


class TensorFile(Protocol):
    """An open safetensors file read by byte ranges (the part of `safetensors.safe_open`'s interface
    the library uses, plus the byte-level reads of a load)."""

    requests: int  # requests issued to a store (0 for a local file)

    def metadata(self) -> dict[str, str]: ...

    def keys(self) -> list[str]: ...

    def get_tensor(self, key: str) -> torch.Tensor: ...

    def get_slice(self, key: str) -> Any: ...

    def byte_run(self, key: str) -> ByteRun:
        """Where tensor `key`'s bytes are in the file."""

    def read_into(self, key: str, start: int, out: memoryview, crc: int | None = None) -> int | None:
        """Bytes [start, start + len(out)) of tensor `key` into `out`; with `crc`, their crc32
        continuing it."""


class FileWriter(Protocol):
    """A file being written front to back: it appears whole at `close`, or not at all."""

    def write(self, data) -> int: ...

    def copy_runs(self, runs: Sequence[ByteRun]) -> None:
        """Append byte runs of local files (file to file where the backend can)."""

    def sync(self) -> None:
        """What was written so far is durable (a test kills the writer after it)."""

    def close(self, fsync: bool = True) -> None: ...

    def abort(self) -> None: ...


class Staged(Protocol):
    """A directory (or prefix) written by one or several processes and committed at once: `partial`
    is where its files go, `final` where it appears."""

    final: Location
    partial: Location

    def create(self, replace: bool = False) -> Location: ...

    def commit(self, fsync_files: bool = True) -> None: ...

    def abort(self) -> None: ...


class Backend(ABC):
    """A place that holds checkpoint files (see the module docstring)."""

    # its files are local files: pread, mmap and copy_file_range work on them, metadata calls are
    # cheap (no request), and reads need no plan (the page cache serves them)
    local_files: bool

    def parse(self, url: str) -> Location:
        """The location a URL of one of this backend's schemes names (UCPError if malformed)."""
        raise NotImplementedError(f"{type(self).__name__} serves no URL scheme")

    # --- files ----------------------------------------------------------------------------------
    @abstractmethod
    def size(self, path: Location) -> int:
        """A file's size in bytes."""

    @abstractmethod
    def names_in(self, directory: Location) -> list[str]:
        """The names of the files directly in a directory (none when it does not exist)."""

    @abstractmethod
    def list_files(self, directory: Location) -> list[tuple[Location, int]]:
        """(path, size) of every file below a directory, at any depth."""

    @abstractmethod
    def open_tensor_file(self, path: Location) -> TensorFile:
        """A safetensors file opened for ranged reads (a UCPError names a missing or bad file)."""

    @abstractmethod
    def open_writer(self, path: Location) -> FileWriter:
        """A new file written front to back (its parent exists or is created)."""

    @abstractmethod
    def read_bytes(self, path: Location) -> bytes:
        """A whole file (a pickle, a JSON document)."""

    @abstractmethod
    def local_file(self, path: Location) -> Path | None:
        """The local file to memory-map, or None where its bytes must be fetched (`read_bytes`)."""

    @abstractmethod
    def put(self, path: Location, data: bytes, create_only: bool = False) -> None:
        """Write a whole small file atomically (readers see the old or the new). create_only:
        `AlreadyExists` if it is there (a store's commit: the conditional put of a marker)."""

    @abstractmethod
    def download(self, directory: Location, local: Path) -> None:
        """Every file below `directory` copied into the local directory `local`."""

    @abstractmethod
    def dcp_reader(self, directory: Location):
        """torch.distributed.checkpoint's reader of a checkpoint directory."""

    # --- the commit -----------------------------------------------------------------------------
    @abstractmethod
    def file_in_the_way(self, path: Location) -> Location | None:
        """`path` or its nearest existing parent when that is a file (the directory cannot be made)."""

    @abstractmethod
    def refuse_non_empty(self, path: Location) -> None:
        """An output directory must be new or empty (UCPError otherwise)."""

    @abstractmethod
    def staged(self, final: Location, marker: str) -> Staged:
        """The commit of a directory written by several processes; `marker` is the file whose
        appearance commits it (written by the writer, last)."""

    @abstractmethod
    def staged_tree(self, final: Location, marker: str,
                    check: Callable[[Path], None] | None) -> contextlib.AbstractContextManager[Path]:
        """The commit of a directory written by one process: yields a local directory to write;
        on success `check(it)` validates it, then it is published at `final` (its `marker` last);
        on any error nothing appears."""

    @abstractmethod
    def fsync(self, path: Location) -> None:
        """Make a file or a directory's entries durable (nothing to do where writes are)."""

    @abstractmethod
    def interrupted_saves(self, root: Location, marker: str) -> list[Location]:
        """The directories under a save root that writers left without their marker."""

    @abstractmethod
    def incomplete_uploads(self, root: Location) -> list:
        """Uploads started under `root` and never completed (each with `.path`); none locally."""

    @abstractmethod
    def clean_save_root(self, root: Location, marker: str) -> None:
        """Remove what writers that died left under a save root (interrupted saves, temporaries,
        incomplete uploads); a committed directory is never touched."""
