"""The store fixtures of the backend contract and fault tests: one real server per store and test
session, bound to 127.0.0.1 with free ports, every client given explicit credentials (no default
credential chain runs): SeaweedFS for s3:// (tests/seaweed.py), fake-gcs-server for gs://,
Azurite for az:// (megatron_ucp.testing.{s3,gcs,azure}_server). A server that cannot be started
fails its tests (never a skip): `make install` installs all three.

`Store` is what a test sees of one backend, a local directory included: a fresh root per test and
`put_bytes`/`place`, which lay files there by the store's own means (for gs://, the emulator's
JSON API: fake-gcs-server does not take obstore's XML API writes, `WRITES_UNSUPPORTED`).
"""

from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_ucp.storage import Location, location
from megatron_ucp.testing.azure_server import ServerError as AzureServerError
from megatron_ucp.testing.azure_server import azurite
from megatron_ucp.testing.gcs_server import WRITES_UNSUPPORTED, fake_gcs, upload
from megatron_ucp.testing.gcs_server import ServerError as GcsServerError
from megatron_ucp.testing.s3_server import ServerError

STORES = ("local", "s3", "gcs", "azure")
# The prefix of a skip `make test` expects (conftest.EXPECTED_SKIPS): a store case whose emulator
# lacks what the case needs, with the exact reason after it
STORE_SKIP = "store: "
# Markers a writer commits with (uploaded after the other files, as the writers do)
MARKERS = ("manifest.json", "latest", "latest_checkpointed_iteration.txt", "config.json", ".metadata")


def _started(server):
    """Enter a server's context manager; a server that cannot be had fails the test loudly."""
    try:
        return server.__enter__()
    except (ServerError, GcsServerError, AzureServerError, OSError) as e:
        pytest.fail(f"the store server did not start: {e}")


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """(endpoint URL, `gs://ckpt`); GOOGLE_BASE_URL and GOOGLE_BEARER_TOKEN set for this process
    and every launched rank."""
    server = fake_gcs(tmp_path_factory.mktemp("fake-gcs"))
    found = _started(server)
    try:
        yield found
    finally:
        server.__exit__(None, None, None)


@pytest.fixture(scope="session")
def azure_server(tmp_path_factory):
    """(endpoint URL, `az://ckpt`); the AZURE_* emulator variables set for this process and every
    launched rank."""
    server = azurite(tmp_path_factory.mktemp("azurite"))
    found = _started(server)
    try:
        yield found
    finally:
        server.__exit__(None, None, None)


@dataclass
class Store:
    kind: str  # one of STORES
    base: Location  # the bucket (or a directory) this test session's roots are made in
    endpoint: str | None = None

    @property
    def writes(self) -> bool:
        """megatron-ucp's own writes work against this server (not fake-gcs-server's gs://)."""
        return self.kind != "gcs"

    def skip_writes(self) -> None:
        if not self.writes:
            pytest.skip(f"{STORE_SKIP}gs:// writes: {WRITES_UNSUPPORTED}")

    def fresh(self, name: str = "") -> Location:
        """A new, empty root (a directory, or a prefix of the bucket)."""
        return self.base / f"{name}{uuid.uuid4().hex[:10]}"

    def put_bytes(self, path: Location, data: bytes) -> None:
        """One file or object, by the store's own means (overwriting)."""
        path = location(path)
        if self.kind == "local":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        elif self.kind == "gcs":
            upload(self.endpoint, path.key, data, bucket=path.bucket)
        else:
            from megatron_ucp.storage import object_store

            object_store.put(path, data)

    def place(self, local: Path, root: Location) -> Location:
        """Copy a local directory tree to `root` (markers last); returns `root`."""
        root = location(root)
        if self.kind == "local":
            shutil.copytree(local, root)
            return root
        files = sorted((p for p in Path(local).rglob("*") if p.is_file()),
                       key=lambda p: (p.name in MARKERS, str(p)))
        for p in files:
            self.put_bytes(root / p.relative_to(local).as_posix(), p.read_bytes())
        return root


def make_store(kind: str, request, tmp_path_factory) -> Store:
    """The Store of `kind`, starting its server (once per session) when it has one."""
    if kind == "local":
        return Store("local", tmp_path_factory.mktemp("local-store"))
    endpoint, bucket = request.getfixturevalue(f"{kind}_server")
    return Store(kind, location(bucket), endpoint)


@pytest.fixture(scope="module", params=STORES)
def store(request, tmp_path_factory) -> Store:
    """Each backend in turn (a module's tests run for one store, then the next)."""
    return make_store(request.param, request, tmp_path_factory)
