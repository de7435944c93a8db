"""The one commit sequence of every writer: stage, check, make durable, publish, each writer naming
its own marker file (the file whose appearance commits its output: a manifest, a tracker file, a
config.json). Locally a directory is written as `.<name>.partial` and renamed into place; in an
object store the data objects go to their final keys and the marker's create-only put commits.

- `staged_dir(final, marker, check)`: one process writes a directory (a context manager);
- `staged(final, marker)`, `group_staged`, `commit_group_job`: the steps, for writers whose steps
  run on different ranks (`save`, the distributed conversions);
- `publish(path, data)`: a marker written by its create-only put (`save_root` sets `latest`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from megatron_ucp.errors import UCPError
from megatron_ucp.storage.backend import Staged
from megatron_ucp.storage.urls import Location, backend, location


def refuse_non_empty(path: str | Path | Location) -> None:
    """An output directory must be new or empty (and creatable: no file where it or a parent goes)."""
    path = location(path)
    backend(path).refuse_non_empty(path)


def file_in_the_way(path: str | Path | Location) -> Location | None:
    """`path` itself or the nearest existing parent when that is not a directory (the directory
    `path` cannot be created), else None. (A store has no directories: always None there.)"""
    path = location(path)
    return backend(path).file_in_the_way(path)


def fsync_path(path: Location) -> None:
    """fsync a file or a directory (a directory: its entries, e.g. a rename into it). An object is
    durable once its upload completed: nothing to do."""
    path = location(path)
    backend(path).fsync(path)


def publish(path: Location, data: bytes) -> None:
    """Write a writer's marker file, the commit of its directory: a create-only put in a store (a
    second writer fails with `AlreadyExists`), an atomic write into the staged directory locally."""
    path = location(path)
    backend(path).put(path, data, create_only=True)


def staged(final: str | Path | Location, marker: str) -> Staged:
    """The commit of a checkpoint written by several ranks: a directory renamed into place, or in
    a store a prefix committed by its `marker` object (`store_backend.StagedPrefix`)."""
    final = location(final)
    return backend(final).staged(final, marker)


@contextlib.contextmanager
def staged_dir(final: str | Path | Location, marker: str,
               check: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """Write a new directory atomically: yields the (local) partial directory to write into; on
    success `check(partial)` validates what was written (it raises to refuse), it is made durable
    and published at `final`, its `marker` file last; on any error nothing appears. A non-empty
    `final` is refused before anything is written."""
    final = location(final)
    with backend(final).staged_tree(final, marker, check) as partial:
        yield partial


def group_staged(out: Location, marker: str) -> Staged:
    """The staged directory (or store prefix, committed by `marker`) of a job of the
    torch.distributed process group, every process writing its files into it: rank 0 creates it;
    every rank gets it, or raises rank 0's error. A directory must be one every process sees (a
    shared filesystem); a store prefix is seen by every host."""
    import torch.distributed as dist

    job = staged(out, marker)
    problem: list = [None]
    if dist.get_rank() == 0:
        try:
            job.create()
        except (UCPError, OSError) as e:
            problem = [str(e)]
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise UCPError(problem[0])
    return job


def commit_group_job(staged: Staged, what: str, result, error: str | None,
                     finish: Callable[[list], None]) -> None:
    """End a job of the process group: rank 0 gathers every rank's (result, error); when none
    failed it runs `finish(results)` (metadata, checks, `staged.commit`), else it aborts. Every
    rank returns, or raises the one outcome, so the job ends alike everywhere."""
    import torch.distributed as dist

    gathered: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((result, error), gathered, dst=0)
    outcome: list = [None]
    if dist.get_rank() == 0:
        try:
            failed = [e for _, e in gathered if e]
            if failed:
                raise UCPError(f"{what} failed ({'; '.join(failed)}); nothing was committed")
            finish([r for r, _ in gathered])
        except (UCPError, OSError) as e:
            staged.abort()
            outcome = [str(e)]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0]:
        raise UCPError(outcome[0])

