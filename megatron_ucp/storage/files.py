"""Backend-neutral file calls on locations (`urls.location`): each asks the location's backend."""

from __future__ import annotations

from pathlib import Path

from megatron_ucp.storage.urls import Location, backend, location


def size_of(path: Location) -> int:
    """A file's or an object's size in bytes."""
    path = location(path)
    return backend(path).size(path)


def names_in(directory: Location) -> list[str]:
    """The names of the files directly in a local directory or under a store prefix (one listing)."""
    directory = location(directory)
    return backend(directory).names_in(directory)


def list_files(directory: Location) -> list[tuple[Location, int]]:
    """(path, size) of every file below a directory (a store: one listing, sizes included)."""
    directory = location(directory)
    return backend(directory).list_files(directory)


def read_bytes(path: Location) -> bytes:
    """A whole file (a pickle, a JSON document)."""
    path = location(path)
    return backend(path).read_bytes(path)


def local_file(path: Location) -> Path | None:
    """The local file behind `path` (to memory-map), or None where its bytes must be fetched."""
    path = location(path)
    return backend(path).local_file(path)


def has_local_files(path: Location) -> bool:
    """Whether `path`'s files are local files: pread, mmap and kernel copies work on them, metadata
    calls cost no request, and reads need no plan."""
    return backend(path).local_files


def put(path: Location, data: bytes, create_only: bool = False) -> None:
    """Write a whole small file atomically; create_only: `AlreadyExists` if it is there."""
    path = location(path)
    backend(path).put(path, data, create_only=create_only)


def download(directory: Location, local: Path) -> None:
    """Every file below `directory` copied into the local directory `local`."""
    directory = location(directory)
    backend(directory).download(directory, Path(local))


def dcp_reader(directory: Location):
    """torch.distributed.checkpoint's reader of a checkpoint directory, local or in a store."""
    directory = location(directory)
    return backend(directory).dcp_reader(directory)
