"""The object-store backend: S3, GCS and Azure prefixes behind `backend.Backend`.

An object store has no rename: a checkpoint's data objects are written at their final keys, and
the checkpoint exists once its writer's marker object is written (a create-only conditional put,
last); a prefix without its marker is never loaded (`StagedPrefix`). A single-process writer's
directory is written and checked locally, then uploaded with its marker last (`upload_tree`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from megatron_ucp.errors import UCPError
from megatron_ucp.storage import object_store
from megatron_ucp.storage.backend import Backend
from megatron_ucp.storage.object_store import (
    ObjectPath,
    ObjectWriter,
    delete,
    get_ranges,
    list_dir,
    list_objects,
    put,
)
from megatron_ucp.storage.s3_multipart import IncompleteUpload, abort_upload, incomplete_uploads

log = logging.getLogger("megatron_ucp.storage")


class UploadWriter(ObjectWriter):
    """The backend's writer: an `ObjectWriter` whose `sync` returns once the store lists the
    incomplete upload (S3; a test kills the writer right after it)."""

    def sync(self, timeout: float = 60.0) -> None:
        super().sync()
        if object_store.store_kind(self.path) != "s3":  # Azure's uncommitted blocks, GCS's parts
            return  # are not listable
        deadline = time.monotonic() + timeout
        while not incomplete_uploads(self.path.parent):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.path}: no multipart upload started")
            time.sleep(0.1)



def leftovers(prefix: ObjectPath, marker: str) -> tuple[list[ObjectPath], list[IncompleteUpload]]:
    """Under a prefix: objects of the sub-prefixes that hold no `marker` (saves that never
    committed) and incomplete multipart uploads."""
    objects = list_objects(prefix)
    committed = {p.parent for p, _ in objects if p.name == marker}
    stray = [p for p, _ in objects
             if p.parent != prefix and not any(c == p.parent or c in p.parents for c in committed)]
    return stray, incomplete_uploads(prefix)


def remove(objects: Sequence[ObjectPath], uploads: Sequence[IncompleteUpload]) -> None:
    for up in uploads:
        abort_upload(up)
    delete(objects)


class StagedPrefix:
    """`storage.StagedDir` for a store: the data objects go straight to their final keys (there is
    no rename); the writer's create-only put of `marker` (the manifest) is the commit, so `commit`
    has nothing left to do and a prefix without the marker is never loaded. `abort` (and `create`,
    for what a killed writer left) deletes the objects and aborts the incomplete uploads of a
    prefix that holds no marker; a committed checkpoint is never deleted by it."""

    def __init__(self, final: ObjectPath, marker: str):
        self.final = self.partial = final
        self.marker = marker

    def create(self, replace: bool = False) -> ObjectPath:
        """The prefix, emptied of what an uncommitted write left (replace: also when it holds
        such objects). A committed prefix is refused even with replace: a store has no atomic
        replace, and taking its marker away first would leave `latest` naming an uncommitted
        prefix (and no checkpoint at all if the new save failed) until the new marker lands."""
        if (self.final / self.marker).is_file():
            raise UCPError(f"{self.final} holds a committed checkpoint ({self.marker}); an object "
                           "store cannot replace it atomically, so it is never overwritten: save "
                           "at another iteration or under another prefix, or delete this prefix "
                           "first if it is no longer wanted")
        if not replace and self.final.is_dir():
            raise UCPError(f"{self.final} holds objects already; choose a new prefix")
        self.abort()  # a killed writer's objects and uploads
        return self.final

    def commit(self, fsync_files: bool = True) -> None:
        """(The marker's create-only put committed it.)"""

    def abort(self) -> None:
        if (self.final / self.marker).is_file():
            return
        remove([p for p, _ in list_objects(self.final)], incomplete_uploads(self.final))


def upload_tree(local: str | os.PathLike, final: ObjectPath, last: Sequence[str]) -> None:
    """Upload a local directory written by a single-process writer (its `staged_dir` partial):
    every file, then the files named in `last` (the commit markers: manifest, trackers) each with a
    create-only put. On failure what was uploaded is removed and the uploads aborted."""
    root = Path(local)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    files.sort(key=lambda p: (p.name in last, last.index(p.name) if p.name in last else 0))
    try:
        for p in files:
            dest = final / p.relative_to(root).as_posix()
            if p.name in last:
                put(dest, p.read_bytes(), create_only=True)
                continue
            w = ObjectWriter(dest)
            with open(p, "rb") as f:
                while chunk := f.read(object_store.PART_BYTES):
                    w.write(chunk)
            w.close()
    except BaseException:
        if not any((final / name).is_file() for name in last):
            remove([p for p, _ in list_objects(final)], incomplete_uploads(final))
        raise


def download_tree(prefix: ObjectPath, local: str | os.PathLike) -> None:
    """Every object under the prefix into a local directory (a universal checkpoint copied out of a
    store by `reshard`), by ranged GETs of at most one part each."""
    for obj, size in list_objects(prefix):
        dest = Path(local) / obj.key[len(prefix.prefix):]
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest, "wb") as f:
            for start in range(0, size, object_store.PART_BYTES):
                f.write(get_ranges(obj, [start], [min(size, start + object_store.PART_BYTES)])[0])


@contextlib.contextmanager
def staged_tree(final: ObjectPath, marker: str, check: Callable[[Path], None] | None) -> Iterator[Path]:
    """A single-process writer's directory: written and checked locally (under TMPDIR), then
    uploaded, its marker last (`upload_tree`)."""
    if final.is_dir():
        raise UCPError(f"{final} holds objects already; choose a new prefix")
    with tempfile.TemporaryDirectory(prefix="megatron-ucp-upload-") as tmp:
        partial = Path(tmp) / "out"
        partial.mkdir()
        yield partial
        if check is not None:
            check(partial)
        upload_tree(partial, final, [marker])


class ObjectStoreBackend(Backend):
    """S3, GCS and Azure prefixes (see the module docstring and `object_store`)."""

    local_files = False

    def parse(self, url: str) -> ObjectPath:
        return ObjectPath.parse(url)

    def size(self, path: ObjectPath) -> int:
        return path.size()

    def names_in(self, directory: ObjectPath) -> list[str]:
        return [key.rsplit("/", 1)[-1] for key in list_dir(directory)[0]]

    def list_files(self, directory: ObjectPath) -> list[tuple[ObjectPath, int]]:
        return list_objects(directory)

    def open_tensor_file(self, path: ObjectPath):
        from megatron_ucp.storage.store_reads import SafetensorsObject

        return SafetensorsObject(path)  # ranged reads

    def open_writer(self, path: ObjectPath) -> UploadWriter:
        return UploadWriter(path)  # a multipart upload: parts go up as they fill, completed at close

    def read_bytes(self, path: ObjectPath) -> bytes:
        return path.read_bytes()

    def local_file(self, path: ObjectPath) -> None:
        return None

    def put(self, path: ObjectPath, data: bytes, create_only: bool = False) -> None:
        put(path, data, create_only=create_only)

    def download(self, directory: ObjectPath, local: Path) -> None:
        download_tree(directory, local)

    def dcp_reader(self, directory: ObjectPath):
        from megatron_ucp.storage.dcp import dcp_reader

        return dcp_reader(directory)

    def file_in_the_way(self, path: ObjectPath) -> None:
        return None  # (a store has no directories)

    def refuse_non_empty(self, path: ObjectPath) -> None:
        if path.is_dir():
            raise UCPError(f"{path} holds objects already; choose a new prefix")

    def staged(self, final: ObjectPath, marker: str) -> StagedPrefix:
        return StagedPrefix(final, marker)

    def staged_tree(self, final: ObjectPath, marker: str, check: Callable[[Path], None] | None):
        return staged_tree(final, marker, check)

    def fsync(self, path: ObjectPath) -> None:
        """(An object is durable once its upload completed.)"""

    def interrupted_saves(self, root: ObjectPath, marker: str) -> list[ObjectPath]:
        stray, _ = leftovers(root, marker)
        return sorted({p.parent for p in stray}, key=str)

    def incomplete_uploads(self, root: ObjectPath) -> list[IncompleteUpload]:
        return incomplete_uploads(root)

    def clean_save_root(self, root: ObjectPath, marker: str) -> None:
        stray, uploads = leftovers(root, marker)
        if stray or uploads:
            log.warning("removing %d object(s) and aborting %d incomplete upload(s) under %s, left "
                        "by interrupted saves", len(stray), len(uploads), root)
            remove(stray, uploads)
