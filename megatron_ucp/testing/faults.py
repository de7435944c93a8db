"""Fault-injection scenarios run through `launch` (see tests/test_fault.py).

`save_then_die` trains, commits one checkpoint normally, trains on, and starts a second save in
which one rank stops half-way through writing its rank file, touches a marker file and waits to be
SIGKILLed by `launch(..., kill_rank_after=(victim, marker))`. Only that process's own reference to
`write_rank_file` (as imported by megatron_ucp.saver) is replaced; megatron-core is untouched.

The fault matrix (tests/test_fault_matrix.py) uses the rest: `KillSwitch` SIGKILLs its process at
the N-th write/fsync/rename point of a save or a conversion (or raises ENOSPC there),
`save_kill_trial` / `convert_kill_trial` / `resume_and_save` are the launched bodies, and
`ForkLauncher` forks the ranks of each launch from one process that has imported torch and
megatron-core once.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch.distributed as dist

from megatron_ucp.formats.fragments import rank_file as fragments


def _save_module():
    return importlib.import_module("megatron_ucp.saver")  # imported after the shim


def _training():
    """(scenarios, tiny_gpt), imported on first use: they install the CPU shim before megatron.core,
    which the conversion trials (plain CPU processes, like the CLI) must not get."""
    from megatron_ucp.testing import scenarios
    from megatron_ucp.testing import tiny_gpt as tg

    return scenarios, tg


def _wait_for_upload(writer, timeout: float = 60.0) -> None:
    """An object writer's bytes so far are in parts of an incomplete multipart upload (S3: until
    the store lists it; Azure's uncommitted blocks and GCS's parts cannot be listed)."""
    from megatron_ucp import object_store

    writer._w.flush()  # (obstore's writer: the parts filled so far go up)
    if object_store.store_kind(writer.path) != "s3":
        return
    deadline = time.monotonic() + timeout
    while not object_store.incomplete_uploads(writer.path.parent):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{writer.path}: no multipart upload started")
        time.sleep(0.1)


def _dying_write_rank_file(marker: str):
    """write_rank_file that writes the header and half of the tensors, then stalls forever."""
    real = _save_module().write_rank_file

    class StallingWriter(fragments.SafetensorsWriter):
        def write(self, name, t):
            if self.next == len(self.order) // 2:
                self.file.flush()
                if hasattr(self.file, "fileno"):
                    os.fsync(self.file.fileno())
                else:  # an object: wait until its multipart upload has parts in the store
                    _wait_for_upload(self.file)
                Path(marker).touch()  # the launcher SIGKILLs this process now
                time.sleep(300)
                raise RuntimeError("stalled rank was not killed")
            super().write(name, t)

    def dying(path, frags, rng_tensors, rng_meta, coords):
        if not isinstance(path, Path):  # in a store: parts small enough that half a file has some
            from megatron_ucp import object_store

            object_store.PART_BYTES = 64 * 2**10  # (never completed, so S3's 5 MiB minimum is moot)
        fragments.SafetensorsWriter = StallingWriter  # this process only; it never returns
        return real(path, frags, rng_tensors, rng_meta, coords)

    return dying


def _save(save_module, st, save_dir: str, async_save: bool = False) -> None:
    save_module.save(st.model, st.optimizer, st.scheduler, save_dir, st.iteration, seed=st.config.seed,
                     extra={"consumed_samples": st.iteration * st.config.global_batch_size},
                     async_save=async_save)


def save_then_die(layout: str, cfg: dict, save_dir: str, marker: str, victim: int = 1,
                  steps: int = 2, dump_dir: str | None = None, record: str | None = None,
                  async_save: bool = False) -> dict:
    """Train `steps`, save iteration `steps`, train one more step, then save again while rank
    `victim` dies mid-write. dump_dir: raw local state at the first save (scenarios.dump_local_state).
    record: JSON file (rank 0) with the losses, including the step after the good checkpoint.
    async_save: the second save is asynchronous: the victim's background writer stalls while every
    rank goes on to train and then waits in `finalize` (the commit never happens)."""
    scenarios, tg = _training()
    save_module = _save_module()
    st = scenarios.setup(layout, cfg)
    losses = [tg.train_step(st) for _ in range(steps)]
    if dump_dir:
        scenarios.dump_local_state(st, dump_dir)
    _save(save_module, st, save_dir)
    losses.append(tg.train_step(st))
    if record and dist.get_rank() == 0:
        Path(record).write_text(json.dumps({"losses": losses}))
    if dist.get_rank() == victim:
        save_module.write_rank_file = _dying_write_rank_file(marker)
    _save(save_module, st, save_dir, async_save)
    if async_save:
        tg.train_step(st)  # training goes on while the writer works
        save_module.finalize()
    raise RuntimeError("the second save completed although a rank was meant to die in it")


# ------------------------------------------------------------------------------ fault matrix
# tests/test_fault_matrix.py: SIGKILL (or ENOSPC) at the N-th write/fsync/rename/commit point of a
# save or a conversion. Library code never imports this module: the switch patches the low-level
# functions the writers call, in the victim process only, and counts only paths under `watch`.

def _base(path) -> str:
    return re.sub(r"\.tmp\d+$", ".tmp<pid>", os.path.basename(os.fspath(path)))


class KillSwitch:
    """Counts every write/fsync/rename/mkdir/rmtree/copy point under `watch` while armed and, at
    point `at` (1-based, before the call runs), SIGKILLs this process (action "kill") or raises
    OSError(ENOSPC) from it (action "enospc", as a full disk would from write or fsync)."""

    def __init__(self, watch: list[str], at: int | None = None, action: str = "kill"):
        self.watch = [os.path.realpath(w) for w in watch]
        self.at, self.action = at, action
        self.points: list[str] = []
        self.armed = False
        self.lock = threading.RLock()  # the async writer thread and the main thread both write
        self._undo: list[tuple[object, str, object]] = []

    def _where(self, path) -> str | None:
        """`path` relative to the first watched directory containing it, else None (not counted)."""
        try:
            p = os.path.realpath(os.fspath(path))
        except TypeError:
            return None
        for w in self.watch:
            if p == w or p.startswith(w + os.sep):
                rel = os.path.relpath(p, os.path.dirname(w))
                return re.sub(r"\.tmp\d+$", ".tmp<pid>", rel)  # write_text_atomic's pid suffix
        return None

    def hit(self, kind: str, path, detail: str = "") -> None:
        with self.lock:
            if not self.armed:
                return
            rel = self._where(path)
            if rel is None:
                return
            self.points.append(f"{kind} {rel}{detail}")
            if len(self.points) != self.at:
                return
            if self.action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)  # the signal is delivered at once; never run the call
            self.armed = False  # one disk-full error, like a real one, then the caller's handling
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def _patch(self, owner, name: str, kind: str, path_of: Callable) -> None:
        real = getattr(owner, name)
        switch = self

        @functools.wraps(real)
        def wrapped(*args, **kwargs):
            switch.hit(kind, *path_of(*args, **kwargs))
            return real(*args, **kwargs)

        self._undo.append((owner, name, real))
        setattr(owner, name, wrapped)

    def install(self) -> KillSwitch:
        """Patch the points of every writer: safetensors files (header, each tensor), torch.save,
        text files, fsync, os.replace/rename (Path.rename calls os.rename: one point, not two),
        Path.mkdir, shutil.rmtree/copyfile."""
        import pathlib
        import shutil

        import torch

        from megatron_ucp import storage

        def fd_path(fd, *a, **k):
            try:
                return (os.readlink(f"/proc/self/fd/{fd}"),)
            except OSError:
                return (None,)

        def save_path(obj, f, *a, **k):
            return (f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None),)

        p = self._patch
        p(os, "fsync", "fsync", fd_path)
        p(os, "replace", "replace", lambda src, dst, *a, **k: (dst, f" <- {_base(src)}"))
        p(os, "rename", "rename", lambda src, dst, *a, **k: (dst, f" <- {_base(src)}"))
        p(pathlib.Path, "mkdir", "mkdir", lambda self, *a, **k: (self,))
        p(pathlib.Path, "write_text", "write", lambda self, *a, **k: (self,))
        p(shutil, "rmtree", "rmtree", lambda path, *a, **k: (path,))
        p(shutil, "copyfile", "copy", lambda src, dst, *a, **k: (dst,))
        p(torch, "save", "torch.save", save_path)
        p(storage.SafetensorsWriter, "__init__", "create", lambda self, path, *a, **k: (path,))
        p(storage.SafetensorsWriter, "write", "write",
          lambda self, name, t: (self.path, f":{name}"))
        return self

    def uninstall(self) -> None:
        for owner, name, real in reversed(self._undo):
            setattr(owner, name, real)
        self._undo.clear()

    @contextlib.contextmanager
    def armed_for(self) -> Iterator[KillSwitch]:
        with self.lock:
            self.armed = True
        try:
            yield self
        finally:
            with self.lock:
                self.armed = False


def save_kill_trial(layout: str, cfg: dict, root: str, dump_dir: str, async_save: bool,
                    victim: int, at: int | None, action: str = "kill") -> dict:
    """Train 2 steps, save iteration 2 (committed), train a 3rd step and save iteration 3 with the
    switch armed in rank `victim` (at=None: no fault, the points are counted on every rank).
    dump_dir/iter_000000N: each rank's raw state at save N (scenarios.dump_local_state).
    Returns the points seen (up to the fault) and the UCPError the fault raised, if any."""
    from megatron_ucp.errors import UCPError

    scenarios, tg = _training()
    save_module = _save_module()
    st = scenarios.setup(layout, cfg)
    for _ in range(2):
        tg.train_step(st)
    scenarios.dump_local_state(st, str(Path(dump_dir) / "iter_0000002"))
    scenarios._save(st, root, async_save)
    save_module.finalize()  # iteration 2 is committed before the faulty save starts
    tg.train_step(st)
    scenarios.dump_local_state(st, str(Path(dump_dir) / "iter_0000003"))
    switch = KillSwitch([root], at if dist.get_rank() == victim or at is None else None, action)
    switch.install()
    error = None
    try:
        with switch.armed_for():
            scenarios._save(st, root, async_save)
            if async_save:
                tg.train_step(st)  # training goes on while the writer works
                save_module.finalize()
    except UCPError as e:  # the disk-full case: every rank raises it from finalize
        error = str(e)
    finally:
        switch.uninstall()
    dist.barrier()
    latest = (Path(root) / "latest").read_text().strip()
    tg.destroy()
    return {"points": switch.points, "error": error, "latest": latest}


def resume_and_save(layout: str, cfg: dict, loads: list[str], dump_dir: str, save_dir: str,
                    iteration: int) -> dict:
    """Load each of `loads` in turn (a checkpoint directory, or a save root: through `latest`),
    dumping the loaded raw state to dump_dir/<i>, then save `iteration` into `save_dir` (the next
    save after a fault: it must clean up what the fault left). Returns the iterations loaded."""
    import megatron_ucp as ucp

    scenarios, tg = _training()
    st = scenarios.setup(layout, cfg)
    loaded = []
    for i, load_dir in enumerate(loads):
        r = ucp.load(st.model, st.optimizer, st.scheduler, load_dir)
        scenarios.dump_local_state(st, str(Path(dump_dir) / str(i)))
        loaded.append({"iteration": r.iteration, "rng_restored": r.rng_restored})
    st.iteration = iteration
    scenarios._save(st, save_dir)
    tg.destroy()
    return {"loaded": loaded}


CONVERSIONS = ("convert", "reshard_universal", "reshard_torch", "reshard_torch_dist")


def run_conversion(kind: str, source: str, out: str) -> None:
    """One conversion of the matrix (the same call in the faulty child and in the retry)."""
    from megatron_ucp.layout import Layout
    from megatron_ucp.reshard import convert, reshard

    if kind == "convert":  # fragment save root -> universal
        convert(source, out, progress=False)
    elif kind == "reshard_universal":  # universal -> universal checked for TP1 (a copy)
        reshard(source, out, Layout(tp=1), progress=False)
    elif kind == "reshard_torch":  # Megatron-LM torch tp2pp2 -> torch at tp1 dp2
        reshard(source, out, Layout(tp=1, pp=1, dp=2), target_format="torch", progress=False)
    elif kind == "reshard_torch_dist":  # Megatron-LM torch tp2pp2 -> torch_dist at pp2 dp2
        reshard(source, out, Layout(tp=1, pp=2, dp=2), target_format="torch_dist",
                progress=False, first_stage_layers=2)
    else:
        raise ValueError(f"unknown conversion {kind!r}; one of {CONVERSIONS}")


def convert_kill_trial(kind: str, source: str, out: str, at: int | None,
                       action: str = "kill") -> dict:
    """`run_conversion` with the switch armed over the output's parent directory (scratch and
    `.partial` directories included). Returns the points seen and the error a fault raised."""
    switch = KillSwitch([str(Path(out).parent)], at, action).install()
    error = None
    try:
        with switch.armed_for():
            run_conversion(kind, source, out)
    except Exception as e:  # ENOSPC: reported as the caller would see it
        error = f"{type(e).__name__}: {e}"
    finally:
        switch.uninstall()
    return {"points": switch.points, "error": error}


# ----------------------------------------------------------------------------- fork launcher
# A torchrun-like launch costs ~9 s here, almost all of it importing torch and megatron-core. The
# matrix runs ~100 short launches, so one server process imports once and forks each rank.

class ForkLauncher:
    """`launch`, but every rank is forked from a server that has imported `preload` (before any
    torch op or thread: the children start with a clean process). A rank that dies of a signal
    or fails ends the launch: the others are SIGKILLed after a short grace, as torchrun does."""

    def __init__(self, preload: str = "megatron_ucp.testing.scenarios"):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "megatron_ucp.testing.faults", preload],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env, text=True)

    def launch(self, nprocs: int, target: str, kwargs: dict, timeout: float = 120.0) -> dict:
        """Returns {"codes": exit code per rank (-9: SIGKILLed), "results": JSON results (None for
        a rank that did not finish), "logs": each rank's output tail}."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"the fork server exited ({self.proc.returncode})")
        self.proc.stdin.write(json.dumps({"nprocs": nprocs, "target": target, "kwargs": kwargs,
                                          "timeout": timeout}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server died ({self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        """SIGKILL the idle server (its children are all reaped; exiting torch cleanly takes ~5 s)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


def _forked_rank(rank: int, nprocs: int, port: int, target: str, kwargs: dict, log: str,
                 result: str) -> None:
    """The body of one forked rank; never returns."""
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        module_name, fn_name = target.split(":")
        out = getattr(importlib.import_module(module_name), fn_name)(**kwargs)
        Path(result).write_text(json.dumps(out))
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no atexit handlers of the server (its save hooks, its temp dirs)


def _serve_one(nprocs: int, target: str, kwargs: dict, timeout: float) -> dict:
    from megatron_ucp.testing.launch import free_port

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ucp_fork_") as tmp:
        logs = [os.path.join(tmp, f"log{r}.txt") for r in range(nprocs)]
        results = [os.path.join(tmp, f"result{r}.json") for r in range(nprocs)]
        pids = []
        for rank in range(nprocs):
            pid = os.fork()
            if pid == 0:
                _forked_rank(rank, nprocs, port, target, kwargs, logs[rank], results[rank])
            pids.append(pid)
        codes: dict[int, int] = {}
        deadline, ending = time.monotonic() + timeout, None
        while len(codes) < nprocs:
            for pid in pids:
                if pid not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[pid] = os.waitstatus_to_exitcode(status)
            if ending is None and (any(codes.values()) or time.monotonic() > deadline):
                ending = time.monotonic() + 0.5  # the others get the peer's death, then SIGKILL
            if ending is not None and time.monotonic() > ending:
                for pid in pids:
                    if pid not in codes:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)
        out = {"codes": [codes[p] for p in pids], "results": [], "logs": []}
        for log, res in zip(logs, results):
            out["results"].append(json.loads(Path(res).read_text()) if os.path.exists(res) else None)
            out["logs"].append(Path(log).read_text()[-4000:] if os.path.exists(log) else "")
        return out


def _serve(preload: str) -> None:
    """Read one JSON launch request a line from stdin, answer one JSON line."""
    answer = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # stray prints of the imports must not reach the answers
    for name in preload.split(","):
        importlib.import_module(name)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            out = _serve_one(req["nprocs"], req["target"], req["kwargs"], req["timeout"])
        except Exception as e:  # the request is answered whatever happens
            out = {"codes": [], "results": [], "logs": [traceback.format_exc()], "error": str(e)}
        answer.write(json.dumps(out) + "\n")
        answer.flush()


if __name__ == "__main__":
    _serve(sys.argv[1])
