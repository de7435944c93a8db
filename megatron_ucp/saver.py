"""Save: every rank writes its own fragments; only metadata crosses ranks; the commit is atomic.

One path for synchronous and asynchronous saves:
1. `save` stages the rank's fragment tensors on the host (`staging.HostStager`: pinned buffers and
   one synchronize on a GPU) and starts writing its rank file into
   `<root>/.iter_XXXXXXX.partial/` (fsynced), inline or in the process's background writer
   thread. No collective but one barrier, after the copies (rank 0 has prepared the directory
   meanwhile). An asynchronous save blocks training only for what makes the saved state that of
   the call: the copies, the Adam steps, the RNG states, rank 0's scheduler and hyper-parameters.
2. `finalize` (the commit; collective) checks with one small all-reduce that every rank's file is
   written, gathers every rank's fragment records (metadata, compressed) to rank 0, which builds
   the fragment index (`build_index`: every element saved exactly once, or nothing is committed), writes
   manifest.json, fsyncs, renames the directory to `iter_XXXXXXX` and atomically replaces
   `<root>/latest`; the outcome is broadcast. A synchronous save finalizes before returning; an
   asynchronous one when the next save starts, when `finalize()` is called (Megatron-LM calls it
   each iteration through `maybe_finalize_async_save`), or at interpreter exit.
A failed write or a broken index is raised on every rank by the finalize that sees it, once, and
nothing is committed; a crash at any point leaves `latest` on the previous checkpoint, and a
`.partial` directory is never loaded.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_ucp import rng, storage, te_state
from megatron_ucp.errors import UCPError
from megatron_ucp.formats import manifest as mf
from megatron_ucp.formats.fragments import (
    Fragment,
    build_index,
    index_part,
    merge_specs,
    part_records,
    rank_file_name,
    write_rank_file,
)
from megatron_ucp.formats.manifest import Manifest
from megatron_ucp.gc_pause import paused_gc
from megatron_ucp.layout import Layout
from megatron_ucp.mcore_compat.schedules import have_transformer_engine
from megatron_ucp.optimizer_state import OptimizerIndex
from megatron_ucp.param_spec import first_replica, local_params
from megatron_ucp.staging import HostStager, collective_device, steps_to_floats
from megatron_ucp.storage import Location, location
from megatron_ucp.validation import model_config

log = logging.getLogger(__name__)
STAGER = HostStager()  # one per process: its host buffer is reused by every save
WRITER = ThreadPoolExecutor(1, thread_name_prefix="megatron-ucp-save")  # asynchronous saves' writes


@dataclass
class PendingSave:
    """A save whose rank file is being (or has been) written and which is not committed yet."""

    iteration: int
    root: Location
    staged: storage.Staged  # .iter_X.partial -> iter_X, or a store prefix
    manifest: Manifest | None  # rank 0 only: everything but the parameters' index and the byte count
    specs: list[dict]  # the specs this rank contributes to the index at commit (maybe none)
    fragments: list[Fragment]  # its fragments: their records go into the index at commit
    started: float
    stage_seconds: float
    background: Future | None = None  # the write, when asynchronous
    nbytes: int = 0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def write(self, fragments: list[Fragment], rng_tensors: dict, rng_meta: dict, coords: dict) -> None:
        try:
            if self.background is not None and before_background_write is not None:
                before_background_write(self)
            self.nbytes = write_rank_file(self.staged.partial / rank_file_name(dist.get_rank()),
                                          fragments, rng_tensors, rng_meta, coords)
        except BaseException as e:  # kept for finalize: a background error must not be lost
            self.error = e
        finally:
            self.done.set()


_PENDING: PendingSave | None = None
# Called in the background writer before it writes (tests hold the writer while training goes on).
before_background_write: Callable[[PendingSave], None] | None = None


def save(model_chunks: list, optimizer, scheduler, path: str | Path, iteration: int, *,
         extra: dict | None = None, seed: int = 1234, vocab_size: int | None = None,
         async_save: bool = False) -> Location:
    """Save a fragment checkpoint of model + DistributedOptimizer + scheduler under `path`.

    extra: JSON-able training state (consumed samples, ...) returned by `load`.
    seed: the run's base seed, used to re-derive RNG streams when resuming at another layout.
    vocab_size: the true (unpadded) vocabulary size. With it, a load may change the vocab padding
        (Megatron-LM pads to a multiple of make_vocab_size_divisible_by x TP) and the universal
        form keeps only the true rows. Without it the padded size must stay the same.
    async_save: return as soon as the state is copied to host memory; a background thread writes
        the rank file and the commit happens in a later `finalize` (see the module docstring).
    Returns the directory `path/iter_XXXXXXX` (committed when the call returns, unless async).
    Collective: call on every rank.
    """
    finalize(blocking=True)  # the previous asynchronous save commits (or raises) first
    t0 = time.perf_counter()
    root = location(path)  # a local directory or an object-store URL (never `s3:` as a directory)
    # every rank sees the root (one filesystem), so all raise, before any collective
    blocker = storage.file_in_the_way(root)
    if blocker is not None:
        what = "is a file" if blocker == root else f"is under {blocker}, which is a file"
        raise UCPError(f"{root}: the save root {what}; pass a directory")
    rank = dist.get_rank()
    layout = Layout.current()
    target = storage.staged(root / mf.iteration_dir_name(iteration), mf.MANIFEST)
    final = target.final
    prepare_error = _prepare_root(root, target, iteration) if rank == 0 else None
    index = OptimizerIndex(optimizer)
    index.refuse_unreshardable_save()  # (every rank alike, before any collective)
    params, specs = _model_specs(model_chunks)
    fragments, mine = _capture(params, specs, index, async_save)
    rng_tensors, rng_meta = rng.capture()
    fp8_states = _gather_te_state(model_chunks)
    from megatron.core import parallel_state as ps

    coords = {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
              "dp": ps.get_data_parallel_rank()}
    manifest = None
    if rank == 0:  # the state at the save: the scheduler and optimizer hyper-parameters move on
        manifest = Manifest.fragments(
            iteration=iteration, layout=layout, world_size=dist.get_world_size(),
            model={**model_config(model_chunks), "unpadded_vocab_size": vocab_size},
            optimizer={"param_groups": index.param_groups(), "grad_scaler": index.grad_scaler(),
                       "optimizers": index.optimizers()},
            scheduler=scheduler.state_dict() if scheduler is not None else None,
            extra=extra or {}, seed=seed)
    # Rank 0 has prepared the directory once every rank is here: the one barrier, after the
    # copies, so that its file-system work and the ranks' copies overlap. It carries rank 0's
    # outcome (a store can refuse the preparation).
    outcome: list = [prepare_error]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0]:
        raise UCPError(outcome[0])
    if fp8_states:  # rank 0: a small file (scales and amax histories), written before the commit
        manifest.te_state = te_state.write(target.partial, fp8_states)
    global _PENDING
    _PENDING = PendingSave(iteration, root, target, manifest, mine, fragments, t0,
                           time.perf_counter() - t0)
    job = (fragments, rng_tensors, rng_meta, coords)
    if async_save:
        # one writer thread for the process, started by the first save: starting a thread per save
        # would stall each by the wait for it to run
        _PENDING.background = WRITER.submit(_PENDING.write, *job)
        if rank == 0:
            log.info("staged iteration %d at %s in %.3fs; writing %s in the background", iteration,
                     layout, _PENDING.stage_seconds, final)
    else:
        _PENDING.write(*job)
        finalize(blocking=True)
    return final


def _gather_te_state(model_chunks: list) -> dict:
    """Every module's FP8 state (Transformer Engine `_extra_state`), checked and gathered on rank 0
    (empty elsewhere, and where TE is not installed)."""
    if not have_transformer_engine():
        return {}
    mine = te_state.capture(model_chunks)
    everyone: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    return {name: st for states in everyone or [] for name, st in states.items()}


def _prepare_root(root: Location, target: storage.Staged, iteration: int) -> str | None:
    """Rank 0, once: remove what interrupted saves left under the save root (never loadable; the
    previous save is finalized), then create the staged directory; re-saving an iteration replaces
    it at the commit (a store refuses a committed one: no atomic replace). A store's refusal is
    returned, to be raised on every rank."""
    try:
        storage.clean_save_root(root, mf.MANIFEST)
        target.create(replace=True)
    except UCPError as e:
        return (f"saving iteration {iteration} to {target.final} failed before any rank wrote: "
                f"{e}; nothing was committed")
    return None


def _capture(params: list, specs: list[dict], index: OptimizerIndex,
             async_save: bool) -> tuple[list[Fragment], list[dict]]:
    """The state at this call, captured before returning (training may change it right after):
    the optimizer shard's bytes and the Adam steps, as fragments in host memory; and the specs
    this rank adds to the fragment index at commit. Everything else (the index records, the file)
    is derived later."""
    fragments, steps = [], []
    for lp in params:
        if lp.spec.buffer and lp.canonical:
            fragments.append(Fragment(lp.spec.name, lp.local_shape, lp.pieces, 0, lp.numel, 0.0,
                                      {"param": lp.region(lp.param.detach()).float()}))
            steps.append(0.0)
            continue
        region = index.region_range(lp, save=True) if lp.canonical else None
        if region is None:
            continue
        shard, a, b = region
        tensors, step = index.get(lp.param)
        if (a, b) != shard:  # (usually the whole shard: no slicing)
            tensors = {s: t[a - shard[0]:b - shard[0]] for s, t in tensors.items()}
        fragments.append(Fragment(lp.spec.name, lp.local_shape, lp.pieces, a - lp.base, b - lp.base,
                                  0.0, tensors, family=index.family(lp.param)))
        steps.append(step)
    for f, step in zip(fragments, steps_to_floats(steps)):
        f.step = step
    # Device state -> host, once. A synchronous save on the CPU writes the optimizer's own tensors
    # (training waits for it); an asynchronous one writes copies while training goes on.
    flat = [t for f in fragments for t in f.tensors.values()]
    staged = iter(STAGER.stage(flat, copy=async_save))
    for f in fragments:  # (the precision-aware optimizer's bf16 moments widen here, on the host)
        f.tensors = {s: t if (t := next(staged)).dtype == torch.float32 else t.float() for s in f.tensors}
    # The specs this rank adds to the fragment index at commit: the first data-parallel replica of
    # its model-parallel position (DP replicas hold the same).
    holds = first_replica()
    mine = [spec for lp, spec in zip(params, specs) if holds(lp)]
    return fragments, mine


_SPECS: dict[tuple, tuple[list, list[dict]]] = {}  # model identity -> (local params, their specs)


def _model_specs(model_chunks: list) -> tuple[list, list[dict]]:
    """`local_params` and their JSON specs, derived once per model: the derivation walks
    megatron-core's sharded_state_dict (tens of ms), which would otherwise stall every save."""
    # (megatron DDP has a `buffers` attribute: its grad buffers, so call the Module method)
    key = tuple(id(t) for m in model_chunks for t in [m, *m.parameters(), *torch.nn.Module.buffers(m)])
    if key not in _SPECS:
        _SPECS.clear()  # one model per process; a rebuilt model gets a fresh derivation
        params = local_params(model_chunks)
        _SPECS[key] = (params, [lp.spec.to_json() for lp in params])
    return _SPECS[key]


def finalize(blocking: bool = True) -> bool:
    """Commit the pending asynchronous save once every rank has written its file.

    Collective when a save is pending (every rank must call it at the same point, as Megatron-LM's
    `maybe_finalize_async_save` does). blocking=False returns False at once if some rank is still
    writing. Raises UCPError on every rank if any rank's write failed; then nothing is committed and
    `latest` stays where it was. Returns True when nothing is left pending.
    """
    global _PENDING
    p = _PENDING
    if p is None:
        return True
    if blocking:
        p.done.wait()
    failed = p.error is not None
    status = torch.tensor([0 if p.done.is_set() else 1, int(failed), p.nbytes], dtype=torch.int64,
                          device=collective_device())
    dist.all_reduce(status)  # [ranks still writing, ranks that failed, bytes written]
    running, n_failed, nbytes = (int(x) for x in status.cpu().tolist())
    if running and not n_failed:
        return False
    if running:  # a rank failed while others still write: wait for them, then clean up
        p.done.wait()
    _PENDING = None
    if p.background is not None:
        p.background.result()  # (its errors are in p.error)
    problem = [None]
    if not n_failed:
        # Metadata only, O(fragments + tensors) at rank 0. Rank 0 builds the fragment index, checks
        # that it tiles every tensor exactly and commits; every rank then learns the outcome.
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(index_part(p.specs, [f.record() for f in p.fragments]), gathered, dst=0)
        if dist.get_rank() == 0:
            try:
                with paused_gc():  # each rank's records parsed only while they are indexed
                    indexed = build_index(merge_specs([g[0] for g in gathered]),
                                          (part_records(g[1]) for g in gathered),
                                          where=f"saving iteration {p.iteration} to {p.staged.final}")
                _commit(p, indexed, nbytes)
            except UCPError as e:
                problem = [f"{e}; nothing was committed ({p.root / storage.LATEST} is unchanged)"]
            except OSError as e:  # disk full at the commit: its OSError names no file; say which
                landed = p.staged.final.exists() and not p.staged.partial.exists()
                problem = [f"saving iteration {p.iteration} to {p.staged.final} failed at the commit "
                           f"({e}); " + (f"{p.staged.final} is complete but " if landed else
                                         "nothing was committed and ")
                           + f"{p.root / storage.LATEST} still names the previous checkpoint. Fix the "
                           "cause (disk space, permissions) and save again"]
        dist.broadcast_object_list(problem, src=0)  # every rank returns after rank 0's commit
    if dist.get_rank() == 0 and (n_failed or problem[0]):
        p.staged.abort()
    if n_failed:
        # every rank names every failing rank's cause (ENOSPC on rank 5 must show in rank 0's log)
        causes = [None] * dist.get_world_size()
        dist.all_gather_object(causes, f"{type(p.error).__name__}: {p.error}" if failed else None)
        mine = "; ".join(f"rank {r}: {c}" for r, c in enumerate(causes) if c is not None)
        raise UCPError(f"saving iteration {p.iteration} to {p.staged.final} failed on {n_failed} rank(s) "
                       f"({mine}); nothing was committed and {p.root / storage.LATEST} still names the "
                       "previous checkpoint. Fix the cause (disk space, permissions) and save again"
                       ) from p.error
    if problem[0]:
        raise UCPError(problem[0])
    if dist.get_rank() == 0:
        blocked = p.stage_seconds if p.background is not None else time.perf_counter() - p.started
        log.info("saved iteration %d to %s (%.1f MiB) in %.2fs, training blocked %.2fs", p.iteration,
                 p.staged.final, nbytes / 2**20, time.perf_counter() - p.started, blocked)
    return True


def _commit(p: PendingSave, params: dict, nbytes: int) -> None:
    """Manifest last, fsync, rename into place, then move `latest` (rank 0). Each rank fsynced its
    own file before reporting it written."""
    p.manifest.params, p.manifest.bytes = params, nbytes
    mf.write(p.staged.partial, p.manifest)
    p.staged.commit(fsync_files=False)
    storage.write_latest(p.root, p.staged.final.name)


def pending() -> int | None:
    """The iteration of the save that is written but not committed yet, if any."""
    return None if _PENDING is None else _PENDING.iteration


@atexit.register
def _finalize_at_exit() -> None:
    """Interpreter exit waits for the background writer; it commits if the process group is up."""
    p = _PENDING
    if p is None:
        return
    p.done.wait()
    if dist.is_available() and dist.is_initialized():
        try:
            finalize(blocking=True)
            return
        except Exception as e:  # at exit nobody can catch it: say it loudly
            log.error("the asynchronous save of iteration %d failed at exit: %s", p.iteration, e)
            return
    log.warning("the asynchronous save of iteration %d was written but not committed (the process "
                "group was destroyed first: call megatron_ucp.finalize() before "
                "destroy_process_group); %s still names the previous checkpoint", p.iteration,
                p.root / storage.LATEST)

