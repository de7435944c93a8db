"""Write the universal form from any source: each parameter's states as full fp32 tensors.

`params_XXXXX.safetensors` files hold `<name>/param`, `<name>/exp_avg`, `<name>/exp_avg_sq` at
their full global shape; the manifest's `params[name].tensors[state]` gives file, key and crc32.
`rng.safetensors` keeps the saving ranks' generator states (used only at the same layout).
A weights-only source (`manifest.weights_only`: an import-hf) is written as `<name>/param` alone,
in the weight's own dtype (`stored_tensors`), and no optimizer state.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import torch

from megatron_ucp import storage, te_state
from megatron_ucp.errors import UCPError
from megatron_ucp.formats import group_job
from megatron_ucp.formats import manifest as mf
from megatron_ucp.formats.base import HF_FILES, check_same_params, not_committed
from megatron_ucp.formats.manifest import Manifest, ParamEntry, TensorEntry
from megatron_ucp.formats.universal.source import RNG_FILE, data_file_name, rng_prefix, stored_tensors
from megatron_ucp.progress import Progress, bar
from megatron_ucp.spec import ParamSpec
from megatron_ucp.storage import (
    DTYPE_TO_ST,
    ByteRun,
    Location,
    Reader,
    SafetensorsWriter,
    crc32,
    location,
    staged_dir,
    write_tensors,
)

log = logging.getLogger(__name__)
# (name, state) -> the full tensor; or the runs of source-file bytes that hold it in order, with a
# function that checks them once copied and returns their crc32 (`leading_runs`)
FullTensor = torch.Tensor | tuple[list[ByteRun], Callable[[], int]]
ReadFull = Callable[[str, str], FullTensor]
_CHECK_ELEMENTS = 1 << 24  # a weight's lossless-cast check goes this many elements at a time


def _bytes(spec: ParamSpec, weights_only: bool) -> int:
    """Bytes of a parameter's tensors in a data file."""
    return sum(math.prod(spec.shape) * d.itemsize for d in stored_tensors(spec, weights_only).values())


def _as_stored(name: str, full: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A weight (fp32, as every source reads it) in the dtype a weights-only checkpoint stores it
    in, checked bit for bit to cast back to the same fp32 tensor: a load then gets exactly the
    master weight the source gave, never a rounded one."""
    if dtype == torch.float32:
        return full
    stored = full.to(dtype)
    flat, back = full.contiguous().view(-1), stored.view(-1)
    for i in range(0, flat.numel(), _CHECK_ELEMENTS):
        part = slice(i, i + _CHECK_ELEMENTS)
        if not torch.equal(back[part].to(torch.float32).view(torch.int32), flat[part].view(torch.int32)):
            raise UCPError(f"internal error: {name}'s weight is not exactly {dtype} values, which its "
                           "spec dtype says it is; nothing was committed. Please report it")
    return stored


def _plan_files(params: dict[str, ParamSpec], max_file_bytes: int, workers: int,
                weights_only: bool = False) -> list[list[str]]:
    """Group parameters into data files in order; with workers, into at least `workers` files."""
    sizes = {n: _bytes(spec, weights_only) for n, spec in params.items()}
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


def _write_file(out_dir: Path, i: int, names: list[str], params: dict[str, ParamSpec],
                read_full: ReadFull, progress=None,
                weights_only: bool = False) -> dict[str, dict[str, TensorEntry]]:
    """One data file. A writer thread checksums and writes each tensor while the next one is read
    (zlib and file writes release the GIL): at most two tensors are held, the one being written
    and the one just read. Runs of source bytes are copied file to file by the writer and checked
    by a checker thread while the writer copies the next ones (a check reads them from the page
    cache, where the copy left them)."""
    fname = data_file_name(i)
    stored = {n: stored_tensors(params[n], weights_only) for n in names}
    w = SafetensorsWriter(out_dir / fname, [(f"{n}/{s}", dtype, params[n].shape)
                                            for n in names for s, dtype in stored[n].items()])
    crcs: dict[tuple[str, str], int | Future] = {}

    def write_one(n: str, s: str, full: FullTensor) -> None:
        if isinstance(full, torch.Tensor):
            full = _as_stored(n, full, stored[n][s])
            w.write(f"{n}/{s}", full)
            crcs[n, s] = crc32(full)
        else:
            runs, checked_crc = full
            w.copy_runs(f"{n}/{s}", runs)
            crcs[n, s] = checker.submit(checked_crc)  # (a corrupt source raises: nothing commits)

    with ThreadPoolExecutor(1, thread_name_prefix="megatron-ucp-write") as writer, \
            ThreadPoolExecutor(1, thread_name_prefix="megatron-ucp-check") as checker:
        pending: Future | None = None
        for n in names:
            for s in stored[n]:
                full = read_full(n, s)
                if pending is not None:
                    pending.result()  # (its error, if any, raised here)
                pending = writer.submit(write_one, n, s, full)
            if progress is not None:
                progress.update(1)
        if pending is not None:
            pending.result()
        entries: dict[str, dict[str, TensorEntry]] = {n: {} for n in names}
        for (n, s), crc in crcs.items():
            entries[n][s] = TensorEntry(fname, f"{n}/{s}", crc if isinstance(crc, int) else crc.result())
    w.close(fsync=False)  # the commit (`staged_dir`) fsyncs every file: an fsync here would hold
    return entries        # the next file's writes back until this one is on disk


# what forked workers inherit: (out_dir, files, params, read_full, weights_only)
_FORKED: tuple | None = None


def _write_file_in_worker(i: int) -> dict[str, dict[str, TensorEntry]]:
    torch.set_num_threads(1)  # as DataLoader workers do: no OpenMP pool inherited across fork
    out_dir, files, params, read_full, weights_only = _FORKED
    return _write_file(out_dir, i, files[i], params, read_full, weights_only=weights_only)


def write_params(out_dir: Path, params: dict[str, ParamSpec], read_full: ReadFull,
                 max_file_bytes: int = 2**31, progress=None, workers: int = 1,
                 weights_only: bool = False) -> dict[str, dict[str, TensorEntry]]:
    """Stream every parameter's states into data files; returns name -> {state: TensorEntry}.

    Only one tensor is in memory at a time per writer: each file's header is computed from the
    shapes first. workers > 1 writes files in forked processes, which inherit `read_full` and
    its open (memory-mapped) sources, so nothing is pickled or read twice. weights_only: each
    parameter's weight alone, in its spec dtype (`stored_tensors`).
    """
    global _FORKED
    files = _plan_files(params, max_file_bytes, workers, weights_only)
    if workers <= 1 or len(files) == 1:
        entries: dict[str, dict[str, TensorEntry]] = {}
        for i, names in enumerate(files):
            entries.update(_write_file(out_dir, i, names, params, read_full, progress, weights_only))
        return entries
    _FORKED = (out_dir, files, params, read_full, weights_only)
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


def _write_distributed(source, out: Path, specs: dict[str, ParamSpec], max_file_bytes: int,
                       workers: int) -> Path:
    """`write` as one job of the process group (`group_job.run`): the files are planned as
    `--workers N` plans them for N = max(workers, world size), so the output is byte for byte that
    of the single-process `workers=N` conversion; rank 0 writes the RNG file, checks, and commits
    once with the manifest (in a store: its create-only put)."""
    import torch.distributed as dist

    weights_only = source.manifest.weights_only
    files = _plan_files(specs, max_file_bytes, max(workers, dist.get_world_size()), weights_only)
    sizes = [sum(_bytes(specs[n], weights_only) for n in names) for names in files]

    def write_share(partial: Path, mine: list[int]) -> tuple[dict, int]:
        entries: dict[str, dict[str, TensorEntry]] = {}
        for i in mine:
            entries.update(_write_file(partial, i, files[i], specs,
                                       lambda n, s: _read_full(source, n, s, specs[n].shape),
                                       weights_only=weights_only))
        return entries, source.bytes_read

    def finish(staged, results: list[tuple[dict, int]]) -> None:  # rank 0
        entries: dict[str, dict[str, TensorEntry]] = {}
        for rank_entries, _ in results:
            entries.update(rank_entries)
        ranks = source.rng_ranks()
        if ranks:
            write_rng(staged.partial, {r: source.rng(r) for r in ranks})
        write_hf_files(staged.partial, source)
        params = {n: ParamEntry(specs[n], source.step(n), tensors=entries[n])
                  for n in source.manifest.params}
        manifest = Manifest.universal(source.manifest, params, source.origin)
        manifest.te_state = te_state.copy(source, staged.partial)
        check_written(staged.partial, specs, source, manifest)
        mf.write(staged.partial, manifest)
        staged.commit(fsync_files=False)
        log.info("%d parameters, %.1f MiB read by %d processes, written to %s", len(params),
                 sum(r[1] for r in results) / 2**20, len(results), out)

    return group_job.run(out, mf.MANIFEST, sizes, data_file_name, write_share, finish,
                         f"converting to {out}")


def write_rng(out_dir: Path, per_rank: dict[int, tuple[dict[str, torch.Tensor], dict]]) -> None:
    tensors = {f"{rng_prefix(r)}/{k}": v for r, (ts, _) in per_rank.items() for k, v in ts.items()}
    meta = {rng_prefix(r): json.dumps(m) for r, (_, m) in per_rank.items()}
    write_tensors(out_dir / RNG_FILE, tensors, meta)


def write_hf_files(out_dir: Path, source) -> None:
    """The HF model files (tokenizer, configs, code) the source stores (`Source.hf_files`), in
    `hf_files/`: an import-hf checkpoint's, kept by its conversions."""
    stored = source.hf_files()
    if stored and storage.has_local_files(out_dir):  # (a store has no directories to make)
        (out_dir / HF_FILES).mkdir(exist_ok=True)
    for name, data in stored.items():
        storage.put(out_dir / HF_FILES / name, data)


def without_padding(spec: ParamSpec, true_vocab: int | None) -> ParamSpec:
    """Vocab-row params keep only the true vocabulary rows; the loader re-pads for its target."""
    if spec.vocab_rows and true_vocab and spec.shape[0] > true_vocab:
        return ParamSpec(**{**vars(spec), "shape": (true_vocab, *spec.shape[1:])})
    return spec


def check_written(out_dir: Location, specs: dict[str, ParamSpec], source,
                  manifest: Manifest | None = None) -> None:
    """Before a universal directory is committed: its manifest (the one written there, or the one
    about to be, encoded and parsed back) parses (every field validated) and names exactly the
    source's parameters, at their shapes and Adam steps; each state is one full tensor (fp32; a
    weights-only checkpoint's weights in their dtype) in its file's header and no data file holds
    a tensor the manifest does not name. So every element of every universal tensor is written
    exactly once."""
    back = (mf.read(out_dir) if manifest is None else
            Manifest.from_json(json.loads(mf.encode(manifest)), str(out_dir / mf.MANIFEST)))
    written, weights_only = back.params, source.manifest.weights_only
    if back.weights_only != weights_only:
        raise not_committed(out_dir, f"says weights_only {back.weights_only}, the source "
                            f"{weights_only}")
    check_same_params(out_dir, written, specs)
    reader, named = Reader(), {}
    for name, p in written.items():
        want = specs[name]
        stored = stored_tensors(want, weights_only)
        if p.shape != want.shape or set(p.tensors) != set(stored):
            raise not_committed(out_dir, f"has {name!r} as {list(p.shape)} {sorted(p.tensors)}, "
                                f"the source as {list(want.shape)} {sorted(stored)}")
        if p.step != source.step(name):
            raise not_committed(out_dir, f"has {name!r} at Adam step {p.step}, the source at "
                                f"{source.step(name)}")
        for s, e in p.tensors.items():
            reader.check(out_dir / e.file, e.key, DTYPE_TO_ST[stored[s]], p.shape)
            named.setdefault(e.file, set()).add(e.key)
    for file, keys in named.items():
        stray = sorted(set(reader.open(out_dir / file).keys()) - keys)
        if stray:
            raise not_committed(out_dir, f"file {file} holds tensor(s) {stray[:3]} that no "
                                "manifest entry names")


def _read_full(source, name: str, state: str, shape: tuple[int, ...]) -> FullTensor:
    """The whole tensor from the source: as runs of its files' bytes where it can say (a fragment
    source whose layout keeps the tensor row-major: copied like `cp` copies, never read into
    memory), else read."""
    runs = source.leading_runs(name, state, shape)
    return source.read(name, state, (0,) * len(shape), shape) if runs is None else runs


def write(source, out: str | Path, *, progress: Progress = True, max_file_bytes: int = 2**31,
          workers: int = 1, distributed: bool = False) -> Path:
    """Consolidate any source (`formats.open_source`) into a new universal directory; returns it.

    Peak memory is about two parameter states per writer (one being written, the next read), not
    the model. distributed: every process of the initialized process group calls this; each writes
    a disjoint, balanced set of the data files (`_write_distributed`), rank 0 commits once.
    """
    t0 = time.perf_counter()
    out = location(out)
    header: Manifest = source.manifest
    specs = {n: without_padding(p.spec, header.true_vocab) for n, p in header.params.items()}
    # written in the order the source holds them: its files are read front to back
    specs = {n: specs[n] for n in source.read_order(list(specs))}
    if distributed:
        return _write_distributed(source, out, specs, max_file_bytes, workers)
    done = bar(progress, len(specs), f"{source.origin['kind']} -> universal", "param")
    with staged_dir(out, mf.MANIFEST, check=lambda d: check_written(d, specs, source)) as partial:
        try:
            entries = write_params(partial, specs, lambda n, s: _read_full(source, n, s, specs[n].shape),
                                   max_file_bytes, done, workers, header.weights_only)
        finally:
            done.close()
        ranks = source.rng_ranks()
        if ranks:
            write_rng(partial, {r: source.rng(r) for r in ranks})
        write_hf_files(partial, source)
        params = {n: ParamEntry(specs[n], source.step(n), tensors=entries[n]) for n in header.params}
        manifest = Manifest.universal(header, params, source.origin)
        manifest.te_state = te_state.copy(source, partial)
        mf.write(partial, manifest)
    log.info("%d parameters%s, %.1f MiB read, written to %s in %.2fs", len(params),
             " (weights only: no optimizer state)" if header.weights_only else "",
             source.bytes_read / 2**20, out, time.perf_counter() - t0)
    return out
