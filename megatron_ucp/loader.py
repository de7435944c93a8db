"""Load a fragment or universal checkpoint into a run at any TP/PP/DP/CP/EP layout.

Each rank asks its own model which boxes of each universal tensor its local slice is, narrows them
to the elements its distributed-optimizer range covers, and reads only those bytes. Master weights
and Adam moments go straight into the optimizer shard; model weights are then produced by the
optimizer's own main->model copy and DP all-gather, exactly as after a training step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_ucp import rng, storage, te_state
from megatron_ucp.errors import UCPError
from megatron_ucp.formats import manifest as mf
from megatron_ucp.formats import open_megatron_ucp
from megatron_ucp.formats.manifest import RUN_HYPERPARAMETERS
from megatron_ucp.layout import Layout
from megatron_ucp.local_slice import read_local
from megatron_ucp.mcore_compat.schedules import have_transformer_engine
from megatron_ucp.optimizer_state import OptimizerIndex
from megatron_ucp.param_spec import LocalParam, legacy_moe_norm_name, local_params
from megatron_ucp.staging import collective_device, fill
from megatron_ucp.storage import Location, location, plan_reads
from megatron_ucp.validation import check_load_layout, check_model_config, model_config

log = logging.getLogger(__name__)


@dataclass
class LoadResult:
    iteration: int
    extra: dict
    checkpoint: Location
    source_layout: Layout
    # the generators set from the checkpoint (rng.restore's names: torch_cpu, cuda, tracker.<name>,
    # python, numpy); empty when the layout changed and they were re-derived (rng.rederive)
    rng_restored: tuple[str, ...]
    bytes_read: int  # by this rank
    files_opened: int = 0  # checkpoint data files this rank opened
    requests: int = 0  # GET requests this rank issued to an object store (0 for local files)
    # this rank's seconds from the call until every region it holds was read into the optimizer
    # state (open, checks, plan, reads), then in megatron-core's main -> model copy and DP
    # all-gather of the model weights (the param sync every optimizer step ends with)
    read_seconds: float = 0.0
    param_sync_seconds: float = 0.0
    # reset_optimizer=True: the saved optimizer families whose state was dropped (weights kept)
    optimizer_reset: tuple[str, ...] = ()
    # Transformer Engine modules of this rank whose FP8 state (scales, amax histories, recipe) was
    # set from the checkpoint
    fp8_modules: int = 0
    # the checkpoint is weights only (an import-hf): the run's optimizer started fresh, its state
    # zero and its step 0, whatever its family
    fresh_optimizer: bool = False


def _legacy_names(source, params: list[LocalParam]) -> None:
    """Parameters a checkpoint of an earlier megatron-ucp holds under their earlier name (a
    local-spec MoE layer's pre-MLP norm, `param_spec.legacy_moe_norm_name`) read from that name."""
    saved = source.manifest.params
    for lp in params:
        old = legacy_moe_norm_name(lp.spec.name, saved)
        if old is not None:
            lp.spec = replace(lp.spec, name=old)


def _check_params(source, params: list[LocalParam], strict: bool) -> None:
    saved = source.manifest.params
    where = source.dir
    true_vocab = source.manifest.true_vocab
    for lp in params:
        entry = saved.get(lp.spec.name)
        if entry is None:
            raise UCPError(f"{where}: the model's parameter {lp.spec.name} (local name "
                           f"{lp.local_name}) is not in the checkpoint; the model has a module the "
                           "saved run did not have: build the checkpoint's architecture")
        for k in ("shape", "tp_axis", "tp_blocks", "tp_sections"):
            theirs, mine = getattr(entry.spec, k), getattr(lp.spec, k)
            if (k == "tp_axis" and None in (theirs, mine) and entry.spec.tp_blocks == lp.spec.tp_blocks == 1
                    and not (entry.spec.tp_sections or lp.spec.tp_sections)):
                # the same full tensor, split by one spec and not by the other (Transformer Engine's
                # MLA down projections are TP-duplicated, the local spec's column-parallel)
                continue
            if (k == "shape" and lp.spec.vocab_rows and true_vocab and theirs[1:] == mine[1:]
                    and mine[0] >= true_vocab):
                continue  # only the vocab padding differs; read_local re-pads
            if theirs != mine:
                fmt = list if k == "shape" else (lambda x: x)
                raise UCPError(f"{where}: parameter {lp.spec.name}: checkpoint {k}={fmt(theirs)}, "
                               f"model {k}={fmt(mine)}; the model architecture differs")
    # Which saved tensors some rank's model holds: one flag per saved tensor, OR-reduced, so the
    # traffic does not grow with the number of ranks (no all-to-all of names).
    names = sorted(saved)
    order = {name: i for i, name in enumerate(names)}
    held = torch.zeros(len(order), dtype=torch.uint8)
    held[[order[lp.spec.name] for lp in params]] = 1
    held = held.to(collective_device())
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    extra = [name for name, flag in zip(names, held.cpu().tolist()) if not flag]
    if extra and strict:
        raise UCPError(f"{where}: the checkpoint has parameters the model lacks: {extra[:5]}"
                       f"{' ...' if len(extra) > 5 else ''} ({len(extra)} in all); build the same "
                       "architecture or pass strict=False to drop them")


def _load_te_state(source, model_chunks: list, verify_checksums: bool) -> int:
    """The saved FP8 state (Transformer Engine `_extra_state`) into this rank's TE modules. A model
    without TE modules (a local-spec load of a TE run) cannot hold it: said, not silently dropped."""
    field = source.manifest.te_state
    if not field:
        return 0
    entries = te_state.module_entries(model_chunks) if have_transformer_engine() else []
    saved = te_state.read(storage.Reader(), source.dir, field, [e.name for e in entries], verify_checksums)
    restored = te_state.restore(entries, saved, str(source.dir))
    held = torch.tensor([len(entries)], dtype=torch.int64).to(collective_device())
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0 and not int(held.item()):
        log.warning("%s: the FP8 state of %d Transformer Engine modules (%s) is not loaded: the model "
                    "has no Transformer Engine modules", source.dir, len(field["modules"]),
                    ", ".join(te_state.summary(field)))
    return restored


def _check_files(source) -> None:
    """The rank files (or data files) hold no parameter the manifest lost: each rank reads the
    headers of every world-th file; a problem one rank finds is raised on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    problem = ""
    try:
        source.check_files(rank, world)
    except UCPError as e:
        problem = str(e)
    found = torch.tensor([int(bool(problem))], dtype=torch.uint8).to(collective_device())
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    if int(found.item()):
        problems = [""] * world
        dist.all_gather_object(problems, problem)
        raise UCPError(next(p for p in problems if p))


def _set_step(index: OptimizerIndex, source, param, shard: tuple[int, int], steps: dict) -> None:
    """Check that the regions read tile the parameter's optimizer shard at one Adam step, then
    set that step."""
    if sum(n for _, n in steps.values()) != shard[1] - shard[0]:
        raise UCPError(f"internal: the regions of {sorted(steps)} do not tile their parameter's "
                       "optimizer shard")
    if len({st for st, _ in steps.values()}) != 1:
        raise UCPError(f"{source.dir}: {sorted(steps)} share one local parameter but the "
                       f"checkpoint gives them different Adam steps ({steps}); it mixes iterations")
    index.set_step(param, next(iter(steps.values()))[0])


def _check_families(source, params: list[LocalParam], index: OptimizerIndex,
                    reset_optimizer: bool) -> tuple[str, ...]:
    """The run's optimizer keeps, for each parameter, the state family the checkpoint saved
    (Adam's moments into Adam, Muon's momentum into Muon); else the load is refused, or with
    reset_optimizer the saved families are returned (the weights load, the state stays fresh).
    Every rank decides alike: a mismatch one rank sees is raised (or reset) on all."""
    mismatch = ""
    saved_families = set()
    for lp in params:
        if lp.spec.buffer:
            continue
        saved = source.manifest.params[lp.spec.name].spec.optimizer
        saved_families.add(saved)
        live = index.family(lp.param)
        if live is not None and live != saved and not mismatch:
            mismatch = (f"{source.dir}: parameter {lp.spec.name} has {saved} optimizer state in the "
                        f"checkpoint but the run's optimizer is {live}")
    flag = torch.tensor([int(bool(mismatch))], dtype=torch.uint8).to(collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if reset_optimizer:
        families = tuple(sorted(saved_families))
        if dist.get_rank() == 0:
            log.warning("reset_optimizer: loading the weights of %s only; its optimizer state (%s) "
                        "and hyper-parameters are dropped, the run's optimizer starts fresh",
                        source.dir, ", ".join(families))
        return families
    if int(flag.item()):
        problems = [""] * dist.get_world_size()
        dist.all_gather_object(problems, mismatch)
        raise UCPError(next(p for p in problems if p) + "; a conversion between optimizers drops "
                       "the state: pass reset_optimizer=True (Megatron-LM: --no-load-optim) to "
                       "keep the weights and start the optimizer fresh")
    return ()


def _read_regions(source, params: list[LocalParam], index: OptimizerIndex,
                  reset_optimizer: bool, fresh: bool = False) -> None:
    """Read every rank's regions straight into the optimizer's own shard tensors (on a device:
    through one host tensor of one region and state at a time), so a load allocates no copy of
    the rank's optimizer state; then set each parameter's Adam step once its regions tile it.
    fresh: a weights-only checkpoint: the master weights are read, every state of the run's own
    optimizer is zeroed and each step set to the checkpoint's 0."""
    unowned = index.unowned()
    # (lp, region, states): a buffer, or a weight whose state another DP rank owns (LayerWise),
    # has no region: its whole local slice is read into the model tensor
    regions = []
    for lp in params:
        if lp.spec.buffer or lp.param in unowned:
            regions.append((lp, None, ("param",)))
        elif (region := index.region_range(lp)) is not None:
            states = (("param",) if reset_optimizer or fresh
                      else source.manifest.params[lp.spec.name].states)
            regions.append((lp, region, states))

    def reads(src) -> None:  # every read of the loop below, in its order (its plan in a store)
        for lp, region, states in regions:
            if region is None:
                read_local(src, lp, "param", 0, lp.numel)
                continue
            for s in states:
                read_local(src, lp, s, region[1] - lp.base, region[2] - lp.base)

    plan_reads(source, reads)
    # id(param) -> (param, shard range, steps) while its regions are being read
    shards: dict[int, tuple] = {}
    with torch.no_grad():
        for lp, region, states in regions:  # (region: this universal tensor's part of the shard)
            if region is None:  # every holder reads its whole local slice; no optimizer state
                lp.region(lp.param).copy_(read_local(source, lp, "param", 0, lp.numel))
                continue
            shard, a, b = region
            live = index.states(lp.param, weights_only=reset_optimizer, load=True)
            for s in states:
                fill(live[s][a - shard[0]:b - shard[0]],
                     partial(read_local, source, lp, s, a - lp.base, b - lp.base))
            if reset_optimizer:
                continue
            if fresh:  # (the run's family: a weights-only checkpoint has none of its own)
                for s in live:
                    if s != "param":
                        live[s][a - shard[0]:b - shard[0]].zero_()
            steps = shards.setdefault(id(lp.param), (lp.param, shard, {}))[2]
            steps[lp.spec.name] = (source.step(lp.spec.name), b - a)
            if sum(n for _, n in steps.values()) == shard[1] - shard[0]:
                _set_step(index, source, *shards.pop(id(lp.param)))
                index.flush(lp.param)  # (a staged copy is held only until its regions are read)
    for param, shard, steps in shards.values():  # regions that do not tile their shard
        _set_step(index, source, param, shard, steps)
    index.flush()


def _resolve_once(path: str | Path) -> Location:
    """The checkpoint directory `path` names, found by rank 0 alone and broadcast: thousands of
    ranks reading `latest` and probing prefixes of one bucket are what gets a store to answer 503
    SlowDown. Its error, if any, is raised on every rank."""
    where = location(path)  # (every rank: an unsupported URL scheme fails before any collective)
    if storage.has_local_files(where) or not dist.is_initialized() or dist.get_world_size() == 1:
        return where
    found: list = [None]
    if dist.get_rank() == 0:
        try:
            found = [str(mf.resolve(where))]
        except UCPError as e:
            found = [e]
    dist.broadcast_object_list(found, src=0)
    if isinstance(found[0], UCPError):
        raise UCPError(str(found[0]))
    return location(found[0])


def load(model_chunks: list, optimizer, scheduler, path: str | Path, *, strict: bool = True,
         verify_checksums: bool = True, reset_optimizer: bool = False) -> LoadResult:
    """Fill model weights, the optimizer's master weights and state (Adam moments and step, Lion's
    or SGD's or Muon's momentum), scheduler, and RNG from `path` (a save root with `latest`, a
    fragment directory or a universal directory).
    reset_optimizer: load the weights only and keep the optimizer's fresh state (zero, step 0), as
        a run with another optimizer than the checkpoint's must; what was dropped is logged and
        returned (`LoadResult.optimizer_reset`). Without it such a load is refused.
    Collective: call on every rank after building model, optimizer and scheduler."""
    t0 = time.perf_counter()
    source = open_megatron_ucp(_resolve_once(path), verify_checksums=verify_checksums)
    manifest = source.manifest
    layout = Layout.current()
    current = model_config(model_chunks)
    check_load_layout(manifest.model, current, layout, str(source.dir))
    check_model_config(manifest.model, current, str(source.dir))
    params = local_params(model_chunks)
    _legacy_names(source, params)
    _check_files(source)
    _check_params(source, params, strict)

    index = OptimizerIndex(optimizer)
    # an optimizer whose state megatron-ucp cannot hold (SOAP) starts as built from the weights
    # of a weights-only checkpoint; any other checkpoint's state is refused or reset below
    reset_optimizer = reset_optimizer or (manifest.weights_only and bool(index.unreshardable()))
    # a weights-only checkpoint has no optimizer state to match the run's: any optimizer starts fresh
    fresh = manifest.weights_only and not reset_optimizer
    reset = () if manifest.weights_only else _check_families(source, params, index, reset_optimizer)
    if not reset_optimizer:  # (a reset keeps the optimizer as built: no state until its first step)
        index.ensure_state()
    _read_regions(source, params, index, reset_optimizer, fresh)
    # The FP8 state first: with FP8 parameters (fp8_param, --fp8-param-gather) the model's
    # Float8Tensor weights are derived from the masters by megatron-core's own copy (its
    # quantize_param_shard -> TE's cast_master_weights_to_fp8) with the module's FP8 scales, which
    # are the saved ones only once restored (before, the fresh model's scale of 1 was used)
    fp8_modules = _load_te_state(source, model_chunks, verify_checksums)
    t_read = time.perf_counter()
    index.copy_main_to_model(model_chunks)
    t_sync = time.perf_counter()
    if not manifest.extra.get(RUN_HYPERPARAMETERS) and not reset_optimizer:  # (imports keep the run's)
        index.load_param_groups(manifest.optimizer["param_groups"])
    index.load_grad_scaler(manifest.optimizer.get("grad_scaler"))
    if scheduler is not None and manifest.scheduler:
        scheduler.num_steps = 0  # load_state_dict advances by the saved count
        scheduler.load_state_dict(manifest.scheduler)

    source_layout = manifest.layout
    same = source_layout == layout
    if dist.get_rank() == 0 and manifest.weights_only:
        log.warning("%s: weights only (no optimizer state on disk): the optimizer starts fresh "
                    "(zero state, step 0)", source.dir)
    if dist.get_rank() == 0 and not same:
        for o in manifest.optimizer.get("optimizers", []):
            # blockwise Muon (the same state, another update rule) at another TP; scaled fp16 / fp8
            # states (rescaled over the new shards) at any other layout
            if o.get("note") and (o["family"] != "muon" or source_layout.tp != layout.tp):
                log.warning("%s: %s -> %s: %s", o["class"], source_layout, layout, o["note"])
    rng_tensors, rng_meta = source.rng(dist.get_rank()) if same else ({}, {})
    if rng_tensors:
        restored = rng.restore(rng_tensors, rng_meta)
    else:
        restored = ()
        rng.rederive(manifest.seed, manifest.iteration)
    if dist.get_rank() == 0:
        log.info("loaded iteration %d (%s, saved at %s) at %s in %.2fs (reads %.2fs, param "
                 "all-gather %.2fs)", manifest.iteration, manifest.kind, source_layout, layout,
                 time.perf_counter() - t0, t_read - t0, t_sync - t_read)
    return LoadResult(manifest.iteration, manifest.extra, source.dir, source_layout,
                      restored, source.bytes_read, source.files_opened, source.requests,
                      t_read - t0, t_sync - t_read, reset, fp8_modules, manifest.weights_only)
