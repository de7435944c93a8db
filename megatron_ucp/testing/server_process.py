"""What the store emulators' starters share (`s3_server`, `gcs_server`, `azure_server`): the
server's credential variables set for this process and its children while it runs, and the server
stopped by its process group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterable, Iterator


@contextlib.contextmanager
def only_these_variables(keys: Iterable[str], **values: str) -> Iterator[None]:
    """Every variable of `keys` unset except `values` (so no other credential of that store is
    used, never a default credential chain), restored on exit."""
    keys = tuple(keys) + tuple(k for k in values if k not in keys)
    saved = {k: os.environ.get(k) for k in keys}
    for k in keys:
        os.environ.pop(k, None)
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's own session (it was started with start_new_session=True: the
    server and nothing else), SIGKILL after 20 s."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
