"""A real Azure Blob Storage emulator for tests: Microsoft's Azurite (`azurite-blob`, from npm;
`make install` puts it under AZURITE_HOME) on 127.0.0.1 with a free port, stopped by its pid
(tests/store_servers.py). The well-known development account devstoreaccount1 and its published
key are the explicit credentials; the container is created with one Shared Key signed request."""

from __future__ import annotations

import base64
import contextlib
import datetime
import hashlib
import hmac
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from megatron_ucp.testing.launch import free_port
from megatron_ucp.testing.server_process import only_these_variables, stop

AZURITE_VERSION = "3.37.0"  # (the Makefile's AZURITE_VERSION)
# Where `make install` puts it; MEGATRON_UCP_AZURITE (the azurite-blob executable) overrides
AZURITE_HOME = Path.home() / ".cache" / "megatron-ucp" / f"azurite-{AZURITE_VERSION}"
CONTAINER = "ckpt"
# Azurite's documented development account (public; the emulator accepts no other by default)
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
ENV_KEYS = ("AZURE_STORAGE_USE_EMULATOR", "AZURITE_BLOB_STORAGE_URL", "AZURE_STORAGE_ACCOUNT_NAME",
            "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_ACCESS_KEY", "AZURE_STORAGE_MASTER_KEY",
            "AZURE_STORAGE_ENDPOINT", "AZURE_ENDPOINT", "AZURE_STORAGE_SAS_KEY", "AZURE_STORAGE_TOKEN",
            "AZURE_CLIENT_ID", "AZURE_CLIENT_SECRET", "AZURE_TENANT_ID", "AZURE_FEDERATED_TOKEN_FILE",
            "AZURE_USE_AZURE_CLI", "AZURE_CREDENTIAL_TYPE")


class ServerError(RuntimeError):
    pass


def azurite_binary() -> str:
    candidates = [os.environ.get("MEGATRON_UCP_AZURITE"),
                  str(AZURITE_HOME / "node_modules" / ".bin" / "azurite-blob"), shutil.which("azurite-blob")]
    for c in candidates:
        if c and Path(c).exists():
            return c
    raise ServerError(f"Azurite is not installed: `make install` puts azurite@{AZURITE_VERSION} under "
                      f"{AZURITE_HOME} (npm install --prefix DIR azurite@{AZURITE_VERSION}; needs Node), or "
                      "set MEGATRON_UCP_AZURITE to an azurite-blob executable")


def _shared_key_request(endpoint: str, method: str, resource: str, query: dict[str, str]) -> int:
    """One request signed with the account key (Shared Key, path-style emulator URL); its status."""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%a, %d %b %Y %H:%M:%S GMT")
    headers = {"x-ms-date": date, "x-ms-version": "2021-08-06", "Content-Type": "application/octet-stream"}
    canonical_headers = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()) if k.startswith("x-ms-"))
    canonical_resource = f"/{ACCOUNT}/{ACCOUNT}/{resource}" + "".join(
        f"\n{k}:{v}" for k, v in sorted(query.items()))
    # VERB, then Content-Encoding, -Language, -Length, -MD5, -Type, Date, If-Modified-Since,
    # If-Match, If-None-Match, If-Unmodified-Since, Range (empty but the type)
    to_sign = (f"{method}\n\n\n\n\napplication/octet-stream\n\n\n\n\n\n\n"
               f"{canonical_headers}{canonical_resource}")
    signature = base64.b64encode(hmac.new(base64.b64decode(ACCOUNT_KEY), to_sign.encode(),
                                          hashlib.sha256).digest()).decode()
    headers["Authorization"] = f"SharedKey {ACCOUNT}:{signature}"
    url = f"{endpoint}/{ACCOUNT}/{resource}?" + "&".join(f"{k}={v}" for k, v in query.items())
    req = urllib.request.Request(url, method=method, headers=headers, data=b"" if method == "PUT" else None)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def create_container(endpoint: str, name: str = CONTAINER) -> None:
    status = _shared_key_request(endpoint, "PUT", name, {"restype": "container"})
    if status not in (201, 409):  # 409: it exists
        raise ServerError(f"creating container {name} at {endpoint} answered {status}")


def _wait_up(endpoint: str, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(f"azurite-blob exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(endpoint, timeout=2)
            return
        except urllib.error.HTTPError:  # (it answers: up)
            return
        except OSError:
            time.sleep(0.1)
    raise ServerError(f"azurite-blob did not come up at {endpoint}:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def azurite(workdir: Path) -> Iterator[tuple[str, str]]:
    """(endpoint URL, `az://ckpt`) of a fresh Azurite blob service with the container `ckpt`; the
    standard AZURE_* variables (emulator mode, the development account and key) point at it
    (this process and its children) until it stops, and no other AZURE_* credential is left."""
    workdir = Path(workdir)
    (workdir / "data").mkdir(parents=True, exist_ok=True)
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = workdir / "azurite.log"
    cmd = [azurite_binary(), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location",
           str(workdir / "data"), "--skipApiVersionCheck", "--disableTelemetry", "--silent"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_up(endpoint, proc, log)
        create_container(endpoint)
        with only_these_variables(ENV_KEYS, AZURE_STORAGE_USE_EMULATOR="true",
                                  AZURITE_BLOB_STORAGE_URL=endpoint, AZURE_STORAGE_ACCOUNT_NAME=ACCOUNT,
                                  AZURE_STORAGE_ACCOUNT_KEY=ACCOUNT_KEY):
            yield endpoint, f"az://{CONTAINER}"
    finally:
        stop(proc)
