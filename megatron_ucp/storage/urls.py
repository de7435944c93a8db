"""Where a checkpoint is: every path the library is given goes through `location`, and `backend`
says which storage backend serves it. The URL scheme -> backend table is here and only here."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from megatron_ucp.storage.backend import Backend
from megatron_ucp.storage.object_store import SCHEMES, ObjectPath, is_url

Location = Path | ObjectPath  # where a checkpoint or one of its files is: local or in an object store


@functools.cache
def _backends() -> dict[str, Backend]:
    """URL scheme -> backend ("file" for local paths). A new store adds its schemes here."""
    from megatron_ucp.storage.local import LocalBackend
    from megatron_ucp.storage.store_backend import ObjectStoreBackend

    store = ObjectStoreBackend()
    return {"file": LocalBackend(), **{scheme: store for scheme in SCHEMES}}


def location(path: str | os.PathLike | ObjectPath) -> Location:
    """A local path (a plain path or file://) or an object-store URL (s3://, gs://, az://, see
    `object_store`). Any other scheme is an error, never a local directory named `s3:`."""
    if isinstance(path, ObjectPath):
        return path
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    if text.startswith("file://"):
        return Path(text.removeprefix("file://"))
    if is_url(text):
        if "://" not in text:  # a pathlib.Path made from a URL: `s3:/bucket/key`
            text = text.replace(":/", "://", 1)
        scheme = text.split(":", 1)[0]
        served = _backends().get(scheme) if scheme != "file" else None
        # (an unknown scheme: ObjectPath.parse raises the UCPError that names the ones served)
        return served.parse(text) if served is not None else ObjectPath.parse(text)
    return Path(text)


def backend(path: str | os.PathLike | ObjectPath) -> Backend:
    """The backend that serves `path`."""
    path = location(path)
    return _backends()["file" if isinstance(path, Path) else path.scheme]
