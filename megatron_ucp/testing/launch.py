"""Run a function on N local processes with a gloo process group (a small torchrun).

`launch(4, "pkg.module:function", {"arg": 1})` starts 4 Python processes with RANK, WORLD_SIZE,
MASTER_ADDR/PORT set, calls `function(**kwargs)` in each and returns the per-rank JSON results.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class LaunchError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nprocs: int, target: str, kwargs: dict, timeout: float = 600.0, env: dict | None = None,
           kill_rank_after: tuple[int, str] | None = None, python: str | None = None) -> list:
    """Run `target(**kwargs)` on `nprocs` ranks; returns each rank's JSON-able return value.

    python: the interpreter of the ranks (default this one's), e.g. another venv's with another
    megatron-core release (migration tests).

    kill_rank_after=(rank, marker_file): SIGKILL that rank as soon as `marker_file` exists (fault
    tests); then the other ranks are killed too and LaunchError is raised.
    """
    for attempt in range(3):
        try:
            return _launch_once(nprocs, target, kwargs, timeout, env, kill_rank_after, python)
        except LaunchError as e:
            # free_port() closes its socket before the ranks bind it: another process (a parallel
            # test) may take the port in between. Nothing ran yet, so start again on another port.
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _launch_once(nprocs: int, target: str, kwargs: dict, timeout: float, env: dict | None,
                 kill_rank_after: tuple[int, str] | None, python: str | None) -> list:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ucp_launch_") as tmp:
        procs, logs = [], []
        for rank in range(nprocs):
            penv = dict(os.environ, **(env or {}))
            penv.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            # megatron-core's jit fusions run eagerly (cpu_shim sets this too, but a rank may import
            # megatron.core, whose torch.compile decorators read it, before the shim): 0.19's
            # compiled MoE router otherwise fails dynamo's device check under the shim
            penv.setdefault("TORCHDYNAMO_DISABLE", "1")
            log = open(Path(tmp) / f"log{rank}.txt", "w+")
            logs.append(log)
            cmd = [python or sys.executable, "-m", "megatron_ucp.testing.launch", target,
                   json.dumps(kwargs), str(Path(tmp) / f"result{rank}.json")]
            procs.append(subprocess.Popen(cmd, env=penv, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        killed = False
        while any(p.poll() is None for p in procs):
            if kill_rank_after and not killed and Path(kill_rank_after[1]).exists():
                procs[kill_rank_after[0]].kill()
                killed = True
            if killed or time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                time.sleep(0.5 if killed else 0)
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.05)
        codes = [p.wait() for p in procs]
        texts = []
        for log in logs:
            log.seek(0)
            texts.append(log.read())
            log.close()
        if any(codes):
            # a rank that failed by itself, not one killed (-9) because another had failed
            first_bad = next((r for r, c in enumerate(codes) if c > 0), None)
            if first_bad is None:
                first_bad = next(r for r, c in enumerate(codes) if c)
            raise LaunchError(f"{target} failed, exit codes {codes}; rank {first_bad} log tail:\n"
                              + texts[first_bad][-6000:])
        return [json.loads((Path(tmp) / f"result{r}.json").read_text()) for r in range(nprocs)]


def cli(argv: list[str]) -> int:
    """`megatron-ucp ARGV` in a launched rank (as under torchrun: RANK, WORLD_SIZE, MASTER_* set)."""
    from megatron_ucp.cli import main

    code = main(argv)
    if code:
        raise SystemExit(code)
    return code


def _worker(target: str, kwargs_json: str, result_path: str) -> None:
    import importlib

    module_name, fn_name = target.split(":")
    fn = getattr(importlib.import_module(module_name), fn_name)
    result = fn(**json.loads(kwargs_json))
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    _worker(*sys.argv[1:4])
