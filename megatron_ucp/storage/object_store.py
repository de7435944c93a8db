"""The object-store client (S3; GCS and Azure through obstore's stores): the one place that talks
to a bucket. The store backend (`store_backend`, `store_reads`, `s3_multipart`) is built on it;
everything outside `megatron_ucp.storage` sees `ObjectPath`, a path-like URL (`s3://bucket/key`),
and the few path operations the library uses on it (`/`, `name`, `parent`, `exists`, `read_text`,
`iterdir`).

An object store has no rename: a checkpoint's data objects are written at their final keys, and
the checkpoint exists once its writer's marker is written (a create-only conditional put, last,
`store_backend.StagedPrefix`). Large objects go up as multipart uploads (obstore's buffered writer,
parts of `PART_BYTES`), aborted when the write fails; a process killed mid-upload leaves an
incomplete upload, which `s3_multipart.incomplete_uploads` lists and the next save aborts. Reads
are byte ranges (`get_ranges`; `store_reads` merges nearby ones and runs them in parallel).

Credentials and endpoint come from each store's standard variables (`ENDPOINT_VARIABLES`,
`CREDENTIAL_VARIABLES`: AWS_* for S3, GOOGLE_* for GCS, AZURE_* and AZURITE_BLOB_STORAGE_URL for
Azure) and are never logged. obstore retries throttling (503 SlowDown), 5xx and connection errors
with bounded exponential backoff; what still fails is raised as a UCPError naming the URL and the
variables of its store.
"""

from __future__ import annotations

import datetime
import fnmatch
import functools
import os
import re
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from megatron_ucp.errors import UCPError
from megatron_ucp.storage.backend import AlreadyExists, ByteRun

SCHEMES = {"s3": "s3", "gs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}
PART_BYTES = 32 * 2**20  # multipart part size (and the writer's buffer): S3 needs >= 5 MiB parts
UPLOAD_STREAMS = 8  # parts of one object uploaded concurrently
MAX_RETRIES = int(os.environ.get("MEGATRON_UCP_S3_MAX_RETRIES", "5"))
RETRY_SECONDS = float(os.environ.get("MEGATRON_UCP_S3_RETRY_SECONDS", "60"))


@dataclass(frozen=True, order=True)
class ObjectPath:
    """`scheme://bucket/key`: a key prefix ("directory") or an object, with the path operations the
    library uses. It is deliberately not os.PathLike: no local file call can take it by mistake."""

    scheme: str
    bucket: str
    key: str = ""  # no leading or trailing "/"

    @classmethod
    def parse(cls, url: str) -> ObjectPath:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme == "msc":  # Megatron-LM's --ckpt-format torch_dist writes these
            raise UCPError(f"{url}: msc:// (a multi-storage-client profile) is not read or written by "
                           "megatron-ucp; use the store URL the profile points to (s3://BUCKET/PREFIX, "
                           "gs://, az://) with its endpoint and credentials in the environment "
                           "(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)")
        if parts.scheme not in SCHEMES:
            raise UCPError(f"{url}: unsupported URL scheme {parts.scheme!r}; megatron-ucp reads and "
                           f"writes local paths and {', '.join(s + '://' for s in SCHEMES)} URLs")
        if not parts.netloc:
            raise UCPError(f"{url}: no bucket in the URL; write {parts.scheme}://BUCKET/PREFIX")
        if parts.query or parts.fragment:
            kind = SCHEMES[parts.scheme]
            raise UCPError(f"{url}: a checkpoint URL takes no query or fragment; write "
                           f"{parts.scheme}://BUCKET/PREFIX and set the endpoint and credentials "
                           f"in the environment ({ENDPOINT_HINTS[kind]}; {CREDENTIAL_VARIABLES[kind]})")
        return cls(parts.scheme, parts.netloc, parts.path.strip("/"))

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}"

    def __truediv__(self, name: str) -> ObjectPath:
        name = str(name).strip("/")
        return ObjectPath(self.scheme, self.bucket, f"{self.key}/{name}" if self.key else name)

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> ObjectPath:
        return ObjectPath(self.scheme, self.bucket, self.key.rsplit("/", 1)[0] if "/" in self.key else "")

    @property
    def parents(self) -> list[ObjectPath]:
        out, p = [], self
        while p.key:
            p = p.parent
            out.append(p)
        return out

    def with_name(self, name: str) -> ObjectPath:
        return self.parent / name

    @property
    def prefix(self) -> str:
        """The key prefix of the objects "in" this path."""
        return f"{self.key}/" if self.key else ""

    # --- path operations on the store ---------------------------------------------------------
    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def is_file(self) -> bool:
        return head(self) is not None

    def is_dir(self) -> bool:
        return any(True for _ in _list(self, limit=1))

    def read_bytes(self) -> bytes:
        return get(self)

    def read_text(self) -> str:
        return get(self).decode()

    def iterdir(self) -> Iterator[ObjectPath]:
        """The objects and sub-prefixes directly under this prefix."""
        objects, prefixes = list_dir(self)
        yield from (ObjectPath(self.scheme, self.bucket, k) for k in [*prefixes, *objects])

    def glob(self, pattern: str) -> Iterator[ObjectPath]:
        """Objects below matching `pattern` relative to this prefix (fnmatch, `*` stays in a level)."""
        depth = pattern.count("/")
        for key, _size in _list(self):
            rel = key[len(self.prefix):]
            if rel.count("/") == depth and fnmatch.fnmatchcase(rel, pattern):
                yield ObjectPath(self.scheme, self.bucket, key)

    def size(self) -> int:
        meta = head(self)
        if meta is None:
            raise UCPError(f"{self}: object is missing; the checkpoint is incomplete, re-save it or "
                           "point to another iteration")
        return meta


def is_url(path: object) -> bool:
    """A string (or a path made from one) that starts with a URL scheme: `s3://b/k` (a pathlib.Path
    of it reads `s3:/b/k`). Local paths never do on POSIX systems."""
    return isinstance(path, ObjectPath) or bool(re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:/", str(path)))


# --- the store, errors, retries ------------------------------------------------------------------
def _obstore():
    try:
        import obstore
    except ImportError:
        raise UCPError("object-store URLs (s3://, gs://, az://) need the obstore package: "
                       "pip install obstore==0.12.1") from None
    return obstore


# Each store's standard environment variables (obstore reads them; the endpoint ones are also read
# here to allow plain http): every message about a store names its own.
ENDPOINT_VARIABLES = {"s3": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
                      "gcs": ("GOOGLE_BASE_URL",),
                      "azure": ("AZURE_STORAGE_ENDPOINT", "AZURE_ENDPOINT")}
CREDENTIAL_VARIABLES = {
    "s3": "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (AWS_SESSION_TOKEN)",
    "gcs": "GOOGLE_SERVICE_ACCOUNT / GOOGLE_SERVICE_ACCOUNT_KEY / GOOGLE_APPLICATION_CREDENTIALS "
           "(or GOOGLE_BEARER_TOKEN)",
    "azure": "AZURE_STORAGE_ACCOUNT_NAME / AZURE_STORAGE_ACCOUNT_KEY (or AZURE_STORAGE_SAS_KEY, "
             "AZURE_STORAGE_TOKEN)"}
ENDPOINT_HINTS = {
    "s3": "AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3 (AWS_ALLOW_HTTP=true for plain http)",
    "gcs": "GOOGLE_BASE_URL (an http:// one is allowed as given)",
    "azure": "AZURE_STORAGE_ENDPOINT / AZURE_ENDPOINT, or AZURE_STORAGE_USE_EMULATOR=true with "
             "AZURITE_BLOB_STORAGE_URL for Azurite"}


def store_kind(path: ObjectPath | str) -> str:
    """"s3", "gcs" or "azure": the store an ObjectPath or URL is in."""
    scheme = path.scheme if isinstance(path, ObjectPath) else urllib.parse.urlsplit(str(path)).scheme
    return SCHEMES.get(scheme, "s3")


def _uses_azurite() -> bool:
    return os.environ.get("AZURE_STORAGE_USE_EMULATOR", "").lower() in ("1", "true", "yes")


def configured_endpoint(kind: str) -> str | None:
    """The endpoint URL the environment sets for a store kind (None: the cloud's own)."""
    if kind == "azure" and _uses_azurite():
        return os.environ.get("AZURITE_BLOB_STORAGE_URL") or "http://127.0.0.1:10000"
    return next((os.environ[v] for v in ENDPOINT_VARIABLES[kind] if os.environ.get(v)), None)


@functools.cache
def store(scheme: str, bucket: str):
    """One client per bucket and process (obstore reads the standard environment variables). A
    plain-http endpoint set in the environment is allowed (an S3-compatible server, an emulator):
    obstore refuses http unless told, and would report it as an unreachable endpoint."""
    _obstore()
    from obstore.store import from_url

    retry = {"max_retries": MAX_RETRIES, "retry_timeout": datetime.timedelta(seconds=RETRY_SECONDS),
             "backoff": {"init_backoff": datetime.timedelta(milliseconds=100),
                         "max_backoff": datetime.timedelta(seconds=15), "base": 2}}
    client = {"connect_timeout": datetime.timedelta(seconds=10), "timeout": datetime.timedelta(minutes=30)}
    kwargs: dict = {}
    kind = SCHEMES[scheme]
    endpoint = configured_endpoint(kind)
    if endpoint and endpoint.startswith("http://"):
        client["allow_http"] = True
    if kind == "s3":
        if endpoint:
            kwargs["endpoint"] = endpoint
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            kwargs["region"] = region
    try:
        return from_url(f"{scheme}://{bucket}", client_options=client, retry_config=retry, **kwargs)
    except Exception as e:  # a bad variable (never its value in the message: obstore names keys)
        raise UCPError(f"{scheme}://{bucket}: cannot set up the object-store client ({e}); check "
                       f"{ENDPOINT_HINTS[kind]} and {CREDENTIAL_VARIABLES[kind]}") from None


def _client(path: ObjectPath):
    return store(path.scheme, path.bucket)


class StoreError(UCPError):
    """A store request that failed after its retries (credentials, bucket, endpoint, throttling):
    never to be read as "no checkpoint there"."""


def store_error(path: ObjectPath | str, what: str, e: BaseException) -> StoreError:
    """A clear error for a failed store request, naming the URL (never a credential) and the
    environment variables of that store that would fix it."""
    kind = store_kind(path)
    msg = str(e).split("\n")[0][:300]
    lowered = str(e).lower()
    if _missing_bucket(e):
        hint = f"the {'container' if kind == 'azure' else 'bucket'} does not exist: create it or fix the URL"
    elif (any(code in lowered for code in ("accessdenied", "signaturedoesnotmatch", "invalidaccesskeyid",
                                           "authorizationfailure", "authenticationfailed"))
          or type(e).__name__ in ("PermissionDeniedError", "UnauthenticatedError")):
        hint = (f"the store refused the credentials: check {CREDENTIAL_VARIABLES[kind]} and the "
                f"{'container' if kind == 'azure' else 'bucket'}'s permissions")
    elif "connect" in lowered or "dns" in lowered or "timed out" in lowered or "timeout" in lowered:
        hint = f"the endpoint cannot be reached (after retries): check {ENDPOINT_HINTS[kind]} and the network"
    else:
        hint = (f"retry, or check the store's endpoint ({ENDPOINT_HINTS[kind]}), credentials "
                f"({CREDENTIAL_VARIABLES[kind]}) and bucket")
    return StoreError(f"{path}: {what} failed: {hint} ({type(e).__name__}: {msg})")


def _missing_bucket(e: BaseException) -> bool:
    """S3's and GCS's NoSuchBucket, Azure's ContainerNotFound (a 404 too, never "no object")."""
    lowered = str(e).lower()
    return any(code in lowered for code in ("nosuchbucket", "bucket does not exist", "containernotfound"))


def _missing(e: BaseException) -> bool:
    return isinstance(e, FileNotFoundError) and not _missing_bucket(e)


def head(path: ObjectPath) -> int | None:
    """The object's size, or None when there is no such object."""
    ob = _obstore()
    try:
        return int(ob.head(_client(path), path.key)["size"])
    except Exception as e:
        if _missing(e):
            return None
        raise store_error(path, "HEAD", e) from None


def get(path: ObjectPath) -> bytes:
    ob = _obstore()
    try:
        return bytes(ob.get(_client(path), path.key).bytes())
    except Exception as e:
        if _missing(e):
            raise UCPError(f"{path}: object is missing; the checkpoint is incomplete or the URL is "
                           "wrong: re-save it or point to another iteration") from None
        raise store_error(path, "GET", e) from None


def get_ranges(path: ObjectPath, starts: Sequence[int], ends: Sequence[int]) -> list[memoryview]:
    """Byte ranges of one object: nearby ranges merged into one request, requests in parallel."""
    ob = _obstore()
    try:
        return [memoryview(b) for b in ob.get_ranges(_client(path), path.key, starts=list(starts),
                                                     ends=list(ends))]
    except Exception as e:
        if _missing(e):
            raise UCPError(f"{path}: object is missing; the checkpoint is incomplete, re-save it "
                           "or point to another iteration") from None
        raise store_error(path, "ranged GET", e) from None


def put(path: ObjectPath, data: bytes, create_only: bool = False) -> None:
    """One request: the object appears whole or not at all. create_only: a conditional put
    (If-None-Match: *) that fails if the object exists (`AlreadyExists` UCPError)."""
    ob = _obstore()
    try:
        ob.put(_client(path), path.key, data, mode="create" if create_only else "overwrite",
               use_multipart=False)
    except Exception as e:
        if type(e).__name__ in ("AlreadyExistsError", "PreconditionError"):
            raise AlreadyExists(f"{path} already exists; a checkpoint is committed once, by its "
                                "first writer: save to another prefix or iteration") from None
        raise store_error(path, "PUT", e) from None


def _list(path: ObjectPath, limit: int | None = None) -> Iterator[tuple[str, int]]:
    """(key, size) of every object under the prefix (ListObjectsV2 paging by obstore)."""
    ob = _obstore()
    n = 0
    try:
        for batch in ob.list(_client(path), path.prefix or None, chunk_size=1000):
            for meta in batch:
                yield meta["path"], int(meta["size"])
                n += 1
                if limit is not None and n >= limit:
                    return
    except Exception as e:
        raise store_error(path, "LIST", e) from None


def list_objects(path: ObjectPath) -> list[tuple[ObjectPath, int]]:
    return [(ObjectPath(path.scheme, path.bucket, k), n) for k, n in _list(path)]


def list_dir(path: ObjectPath) -> tuple[list[str], list[str]]:
    """(object keys, sub-prefixes) directly under the prefix."""
    ob = _obstore()
    try:
        out = ob.list_with_delimiter(_client(path), path.prefix or None)
    except Exception as e:
        raise store_error(path, "LIST", e) from None
    return [o["path"] for o in out["objects"]], [p.rstrip("/") for p in out["common_prefixes"]]


def delete(paths: Sequence[ObjectPath]) -> None:
    ob = _obstore()
    for p in paths:  # (obstore batches a list into DeleteObjects per store; a loop keeps errors per key)
        try:
            ob.delete(_client(p), p.key)
        except Exception as e:
            if not _missing(e):
                raise store_error(p, "DELETE", e) from None


# --- writing one object --------------------------------------------------------------------------
class ObjectWriter:
    """A binary file-like object written to the store: buffered, multipart once it outgrows one
    part (parts uploaded concurrently), complete at `close`, aborted by `abort` (or when the
    process dies: then an incomplete upload stays until `abort_incomplete_uploads`)."""

    def __init__(self, path: ObjectPath):
        self.path = path
        try:
            self._w = _obstore().open_writer(_client(path), path.key, buffer_size=PART_BYTES,
                                             max_concurrency=UPLOAD_STREAMS)
        except UCPError:
            raise
        except Exception as e:
            raise store_error(path, "upload", e) from None
        self._pos = 0

    def write(self, data) -> int:
        try:
            self._w.write(data)
        except Exception as e:
            self.abort()
            raise store_error(self.path, "multipart upload", e) from None
        n = memoryview(data).nbytes
        self._pos += n
        return n

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        """(Nothing to do: the parts go up as they fill; `close` completes the object.)"""

    def copy_runs(self, runs: Sequence[ByteRun]) -> None:
        """No kernel copy into a store: the local runs are read and uploaded."""
        for run in runs:
            with open(run.path, "rb") as f:
                f.seek(run.offset)
                self.write(f.read(run.nbytes))

    def sync(self) -> None:
        """The parts filled so far go up (`store_backend.UploadWriter` also waits until S3 lists
        the incomplete upload)."""
        self._w.flush()

    def close(self, fsync: bool = True) -> None:
        """Complete the upload: the object appears whole (durable once it does: no fsync)."""
        try:
            self._w.close()
        except Exception as e:
            self.abort()
            raise store_error(self.path, "completing the upload", e) from None

    def abort(self) -> None:
        """Abort the multipart upload (nothing becomes visible)."""
        if not self._w.closed():
            err = RuntimeError("aborted by megatron-ucp")
            try:
                self._w.__exit__(RuntimeError, err, None)  # obstore aborts on an exception exit
            except Exception:  # noqa: BLE001 (aborting is best effort: `abort_incomplete_uploads` remains)
                pass
