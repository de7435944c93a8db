"""The universal (consolidated) form: each parameter as full fp32 tensors, layout-free.

`params_XXXXX.safetensors` files hold `<name>/param`, `<name>/exp_avg`, `<name>/exp_avg_sq` at
their full global shape; manifest.json's `params[name].tensors[state]` gives file, key and crc32.
`rng.safetensors` keeps the saving ranks' generator states (used only at the same layout).
"""

from __future__ import annotations

import json
import math
import multiprocessing
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from megatron_ucp import manifest as mf
from megatron_ucp.errors import UCPError
from megatron_ucp.spec import states_of
from megatron_ucp.storage import Reader, SafetensorsWriter, crc32, fsync_dir, write_tensors

RNG_FILE = "rng.safetensors"


def data_file_name(i: int) -> str:
    return f"params_{i:05d}.safetensors"


def _plan_files(params: dict[str, dict], max_file_bytes: int, workers: int) -> list[list[str]]:
    """Group parameters into data files in order; with workers, into at least `workers` files."""
    sizes = {n: 4 * math.prod(spec["shape"]) * len(states_of(spec)) for n, spec in params.items()}
    limit = max_file_bytes
    if workers > 1:
        limit = min(limit, -(-sum(sizes.values()) // workers))
    files: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if files[-1] and size + nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    return files


def _write_file(out_dir: Path, i: int, names: list[str], params: dict[str, dict],
                read_full: Callable[[str, str], torch.Tensor], progress=None) -> dict[str, dict]:
    fname = data_file_name(i)
    w = SafetensorsWriter(out_dir / fname, [(f"{n}/{s}", torch.float32, tuple(params[n]["shape"]))
                                            for n in names for s in states_of(params[n])])
    entries: dict[str, dict] = {}
    for n in names:
        entries[n] = {}
        for s in states_of(params[n]):
            t = read_full(n, s)
            w.write(f"{n}/{s}", t)
            entries[n][s] = {"file": fname, "key": f"{n}/{s}", "crc32": crc32(t)}
        if progress is not None:
            progress.update(1)
    w.close()
    return entries


_FORKED: tuple | None = None  # what forked workers inherit: (out_dir, files, params, read_full)


def _write_file_in_worker(i: int) -> dict[str, dict]:
    torch.set_num_threads(1)  # as DataLoader workers do: no OpenMP pool inherited across fork
    out_dir, files, params, read_full = _FORKED
    return _write_file(out_dir, i, files[i], params, read_full)


def write_params(out_dir: Path, params: dict[str, dict],
                 read_full: Callable[[str, str], torch.Tensor],
                 max_file_bytes: int = 2**31, progress: Iterator | None = None,
                 workers: int = 1) -> dict[str, dict]:
    """Stream every parameter's states into data files; returns name -> {state: file/key/crc32}.

    Only one tensor is in memory at a time per writer: each file's header is computed from the
    shapes first. workers > 1 writes files in forked processes, which inherit `read_full` and
    its open (memory-mapped) sources, so nothing is pickled or read twice.
    """
    global _FORKED
    files = _plan_files(params, max_file_bytes, workers)
    if workers <= 1 or len(files) == 1:
        entries: dict[str, dict] = {}
        for i, names in enumerate(files):
            entries.update(_write_file(out_dir, i, names, params, read_full, progress))
        return entries
    _FORKED = (out_dir, files, params, read_full)
    try:
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(min(workers, len(files)), mp_context=ctx) as pool:
            entries = {}
            for names, done in zip(files, pool.map(_write_file_in_worker, range(len(files)))):
                entries.update(done)
                if progress is not None:
                    progress.update(len(names))
    finally:
        _FORKED = None
    return entries


def commit(partial: Path, out: Path, manifest: dict) -> None:
    """Manifest last, fsync, then rename into place: a half-written directory is never loaded."""
    mf.write(partial, manifest)
    fsync_dir(partial)
    if out.exists():
        out.rmdir()  # an empty directory the caller allowed
    partial.rename(out)


def write_rng(out_dir: Path, per_rank: dict[int, tuple[dict[str, torch.Tensor], dict]]) -> None:
    tensors = {f"rank{r:05d}/{k}": v for r, (ts, _) in per_rank.items() for k, v in ts.items()}
    meta = {f"rank{r:05d}": json.dumps(m) for r, (_, m) in per_rank.items()}
    write_tensors(out_dir / RNG_FILE, tensors, meta)


class UniversalSource:
    """Reads boxes of universal tensors from a consolidated directory (sliced reads)."""

    def __init__(self, ckpt_dir: Path, manifest: dict, reader: Reader | None = None,
                 verify_checksums: bool = True):
        self.dir = Path(ckpt_dir)
        self.manifest = manifest
        self.reader = reader or Reader()
        self.verify_checksums = verify_checksums

    def step(self, name: str) -> float:
        return self.manifest["params"][name]["step"]

    def read(self, name: str, state: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        entry = self.manifest["params"][name]["tensors"][state]
        path = self.dir / entry["file"]
        full_shape = tuple(self.manifest["params"][name]["shape"])
        whole = tuple(offset) == (0,) * len(offset) and tuple(shape) == full_shape
        if whole:
            t = self.reader.read(path, entry["key"])
            if self.verify_checksums and crc32(t) != entry["crc32"]:
                raise UCPError(f"{path}: checksum mismatch in tensor {entry['key']!r}; the file is "
                               "corrupt: restore it or re-run `megatron-ucp convert`")
            return t
        return self.reader.read(path, entry["key"], tuple(slice(o, o + n) for o, n in zip(offset, shape)))

    def verify(self) -> int:
        """Read every tensor whole and check its crc32 and shape. Returns tensors checked."""
        n = 0
        for name, p in self.manifest["params"].items():
            for state in p["tensors"]:
                t = self.read(name, state, (0,) * len(p["shape"]), tuple(p["shape"]))
                if list(t.shape) != list(p["shape"]):
                    raise UCPError(f"{self.dir}: {name}/{state} has shape {list(t.shape)}, the "
                                   f"manifest says {p['shape']}; re-run `megatron-ucp convert`")
                n += 1
        return n

    def rng(self, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
        path = self.dir / RNG_FILE
        if not path.exists():
            return {}, {}
        f = self.reader.open(path)
        prefix = f"rank{rank:05d}/"
        tensors = {k.removeprefix(prefix): f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
        return tensors, json.loads(self.reader.metadata(path).get(f"rank{rank:05d}", "{}"))
