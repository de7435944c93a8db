"""The object-store backend (S3; GCS and Azure through obstore's stores): the one place that talks
to a bucket. Everything else sees `ObjectPath`, a path-like URL (`s3://bucket/key`), and the few
path operations the library uses on it (`/`, `name`, `parent`, `exists`, `read_text`, `iterdir`).

An object store has no rename: a checkpoint's data objects are written at their final keys, and
the checkpoint exists once its manifest is written (a create-only conditional put, last); a prefix
without a manifest is never loaded. Large objects go up as multipart uploads (obstore's buffered
writer, parts of `PART_BYTES`), aborted when the write fails; a process killed mid-upload leaves an
incomplete upload, which `incomplete_uploads` lists and the next save aborts (S3's
ListMultipartUploads / AbortMultipartUpload, which obstore does not expose: signed here with AWS
Signature V4). Reads are byte ranges (`get_ranges` merges nearby ones and runs them in parallel).

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
import hashlib
import hmac
import json
import os
import re
import struct
import urllib.error
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from megatron_ucp.errors import UCPError

SCHEMES = {"s3": "s3", "gs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}
PART_BYTES = 32 * 2**20  # multipart part size (and the writer's buffer): S3 needs >= 5 MiB parts
UPLOAD_STREAMS = 8  # parts of one object uploaded concurrently
WINDOW_BYTES = 64 * 2**20  # planned ranges fetched together per object: a load holds two windows
PREFETCH_OBJECTS = 4  # objects whose first window a planned load starts at once (others at their first read)
COALESCE_BYTES = 2**20  # ranges less than this apart are fetched by one GET (obstore's rule too)
STREAM_BYTES = 16 * 2**20  # a merged range longer than this is fetched as pieces of it, in parallel
GET_STREAMS = 8  # ranged GETs of one process in flight at once (one stream each)
HEADER_GUESS = 64 * 2**10  # bytes fetched for a safetensors header before knowing its length
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


class AlreadyExists(UCPError):
    """A create-only put found the object there."""


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

    def close(self) -> None:
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


# --- reading safetensors objects -----------------------------------------------------------------
_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}


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
        if len(first) < 8:
            raise self._bad(f"{size} bytes, shorter than a safetensors header")
        (n,) = struct.unpack("<Q", first[:8])
        if 8 + n > size:
            raise self._bad(f"its header claims {n} bytes but the object holds {size}")
        raw = first[8:8 + n] if 8 + n <= len(first) else bytes(get_ranges(path, [8], [8 + n])[0])
        try:
            header = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise self._bad(f"header is not JSON ({e})") from None
        self._meta = header.pop("__metadata__", None) or {}
        self.start = 8 + n
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for key, e in header.items():
            begin, end = e["data_offsets"]
            if e["dtype"] not in _ST_DTYPES or self.start + end > size or begin > end:
                raise self._bad(f"tensor {key!r} lies outside the object or has dtype {e['dtype']}")
            self.entries[key] = (_ST_DTYPES[e["dtype"]], tuple(e["shape"]), self.start + begin,
                                 self.start + end)
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
        return next(k for k, v in _ST_DTYPES.items() if v == dtype)

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


# --- incomplete multipart uploads (S3 API calls obstore does not expose) -------------------------
def _s3_request(path: ObjectPath, method: str, key: str, query: dict[str, str]) -> bytes:
    """One AWS Signature V4 signed request to the bucket (ListMultipartUploads, AbortMultipartUpload)."""
    endpoint = (os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                or f"https://s3.{os.environ.get('AWS_REGION', 'us-east-1')}.amazonaws.com")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    access, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not access or not secret:
        raise UCPError(f"{path}: listing incomplete uploads needs AWS_ACCESS_KEY_ID and "
                       "AWS_SECRET_ACCESS_KEY in the environment")
    u = urllib.parse.urlsplit(endpoint)
    resource = "/" + urllib.parse.quote(f"{path.bucket}/{key}" if key else path.bucket, safe="/-_.~")
    now = datetime.datetime.now(datetime.timezone.utc)
    stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    q = "&".join(f"{urllib.parse.quote(k, safe='-_.~')}={urllib.parse.quote(v, safe='-_.~')}"
                 for k, v in sorted(query.items()))
    payload = hashlib.sha256(b"").hexdigest()
    headers = {"host": u.netloc, "x-amz-content-sha256": payload, "x-amz-date": stamp}
    if os.environ.get("AWS_SESSION_TOKEN"):
        headers["x-amz-security-token"] = os.environ["AWS_SESSION_TOKEN"]
    signed = ";".join(sorted(headers))
    canonical = "\n".join([method, resource, q, "".join(f"{k}:{headers[k]}\n" for k in sorted(headers)),
                           signed, payload])
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    k = ("AWS4" + secret).encode()
    for part in (day, region, "s3", "aws4_request"):
        k = hmac.new(k, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={access}/{scope}, SignedHeaders={signed}, "
                                f"Signature={signature}")
    req = urllib.request.Request(f"{u.scheme}://{u.netloc}{resource}?{q}", method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.read()
    except (urllib.error.URLError, OSError) as e:
        raise store_error(path, f"{method} ?{'&'.join(query)}", e) from None


@dataclass(frozen=True)
class IncompleteUpload:
    path: ObjectPath
    upload_id: str
    initiated: str


def incomplete_uploads(prefix: ObjectPath) -> list[IncompleteUpload]:
    """Multipart uploads started under the prefix and never completed nor aborted (S3 only; other
    stores expire theirs: Azure's uncommitted blocks after 7 days, GCS's by bucket policy)."""
    if SCHEMES[prefix.scheme] != "s3":
        return []
    out, marker = [], {}
    while True:
        raw = _s3_request(prefix, "GET", "", {"uploads": "", "prefix": prefix.prefix, **marker})
        root = ET.fromstring(raw)
        ns = {"s": root.tag.split("}")[0].strip("{")} if root.tag.startswith("{") else {}
        tag = (lambda t: f"s:{t}") if ns else (lambda t: t)
        for up in root.findall(tag("Upload"), ns):
            key = up.findtext(tag("Key"), "", ns)
            out.append(IncompleteUpload(ObjectPath(prefix.scheme, prefix.bucket, key),
                                        up.findtext(tag("UploadId"), "", ns),
                                        up.findtext(tag("Initiated"), "", ns)))
        if root.findtext(tag("IsTruncated"), "false", ns) != "true":
            return out
        marker = {"key-marker": root.findtext(tag("NextKeyMarker"), "", ns),
                  "upload-id-marker": root.findtext(tag("NextUploadIdMarker"), "", ns)}


def abort_upload(up: IncompleteUpload) -> None:
    _s3_request(up.path, "DELETE", up.path.key, {"uploadId": up.upload_id})


# --- the commit protocol without rename ----------------------------------------------------------
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
    from pathlib import Path

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
                while chunk := f.read(PART_BYTES):
                    w.write(chunk)
            w.close()
    except BaseException:
        if not any((final / name).is_file() for name in last):
            remove([p for p, _ in list_objects(final)], incomplete_uploads(final))
        raise


def download_tree(prefix: ObjectPath, local: str | os.PathLike) -> None:
    """Every object under the prefix into a local directory (a universal checkpoint copied out of a
    store by `reshard`), by ranged GETs of at most one part each."""
    from pathlib import Path

    for obj, size in list_objects(prefix):
        dest = Path(local) / obj.key[len(prefix.prefix):]
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest, "wb") as f:
            for start in range(0, size, PART_BYTES):
                f.write(get_ranges(obj, [start], [min(size, start + PART_BYTES)])[0])


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
