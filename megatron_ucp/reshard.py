"""Offline reshard on a CPU box: any supported checkpoint -> universal, checked against a target layout,
or (target_format="torch") a Megatron-LM legacy checkpoint -> a Megatron-LM legacy checkpoint at the target,
or (target_format="torch_dist") a Megatron-LM checkpoint -> a Megatron-LM torch_dist checkpoint at the target.

The universal form is layout-free, so "resharding" offline means consolidating once and checking
that the target layout can hold the model; the target run then loads it directly at its layout
(`megatron_ucp.load`, or Megatron-LM with `--universal-checkpoint`).
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_ucp import manifest as mf
from megatron_ucp.checks import detect
from megatron_ucp.errors import UCPError
from megatron_ucp.layout import Layout
from megatron_ucp.validation import check_layout

TARGET_FORMATS = ("universal", "torch", "torch_dist")


@dataclass
class ReshardSummary:
    source_kind: str
    output: Path
    params: int
    elements: int
    bytes_written: int
    seconds: float
    target_format: str = "universal"

    def __str__(self) -> str:
        mib = self.bytes_written / 2**20
        return (f"[megatron-ucp] resharded {self.source_kind} -> {self.target_format} {self.output}: "
                f"{self.params} parameters, {self.elements:,} elements, {mib:.1f} MiB written in "
                f"{self.seconds:.2f}s ({mib / max(self.seconds, 1e-9):.1f} MiB/s)")


def reshard(load: str | Path, save: str | Path, target: Layout | None = None,
            target_format: str = "universal", progress: bool = True, *,
            first_stage_layers: int | None = None,
            last_stage_layers: int | None = None, workers: int = 1) -> ReshardSummary:
    """Convert `load` to `target_format` at `target`.

    target_format "torch": a stock Megatron-LM `--ckpt-format torch` checkpoint at `target`; the
    source must be a Megatron-LM legacy checkpoint (its args describe the run). first/last_stage_
    layers set an uneven pipeline split at the target (default: the source's when PP is unchanged,
    else an even split).
    target_format "torch_dist": a Megatron-LM `--ckpt-format torch_dist` checkpoint with the
    optimizer in the `fully_reshardable` form (resume with --dist-ckpt-optim-fully-reshardable);
    the source must be a Megatron-LM checkpoint, legacy or torch_dist (its args describe the run).
    workers: processes writing the universal data files (the scratch copy for Megatron targets)."""
    t0 = time.perf_counter()
    if target_format not in TARGET_FORMATS:
        raise UCPError(f"--target-format {target_format}: unknown; choose one of {TARGET_FORMATS}")
    kind = detect(load)
    out = Path(save)
    if target_format != "universal":
        return _reshard_to_megatron(load, out, target, kind, target_format, progress,
                                    first_stage_layers, last_stage_layers, t0, workers)
    if kind == "universal":
        if out.exists():
            raise UCPError(f"{out} exists; choose a new directory")
        shutil.copytree(mf.resolve(load), out)
    else:
        _to_universal(load, out, kind, progress, workers)
    manifest = mf.read(out)
    if target is not None:
        try:
            check_layout(manifest["model"], target, str(out))
        except UCPError:
            shutil.rmtree(out)  # a universal dir the target cannot use is not left behind
            raise
    files = list(out.glob("*.safetensors"))
    return ReshardSummary(kind, out, len(manifest["params"]),
                          sum(math.prod(p["shape"]) for p in manifest["params"].values()),
                          sum(f.stat().st_size for f in files), time.perf_counter() - t0)


def _legacy_rng_by_rank(rng: dict[str, list] | None, args) -> dict | None:
    """Legacy rank-directory name -> rng list, as {(pp_rank, tp_rank): rng list}."""
    if not rng:
        return None
    out = {}
    pp = args.pipeline_model_parallel_size
    for name, value in rng.items():
        parts = [int(x) for x in name.removeprefix("mp_rank_").split("_")]
        out[(parts[1] if pp > 1 else 0, parts[0])] = value
    return out


def _to_universal(load, out: Path, kind: str, progress: bool, workers: int) -> None:
    if kind == "fragments":
        from megatron_ucp.consolidate import convert

        convert(load, out, progress=progress, workers=workers)
    elif kind == "megatron_torch":
        from megatron_ucp.megatron_legacy import convert_legacy

        convert_legacy(load, out, progress=progress, workers=workers)
    else:
        from megatron_ucp.megatron_dist import convert_torch_dist

        convert_torch_dist(load, out, progress=progress, workers=workers)


def _megatron_source(load, kind: str, target_format: str) -> dict:
    """args, per-rank rng states (keyed as the target writer wants them), layout, flops."""
    if target_format == "torch" and kind != "megatron_torch" or kind not in (
            "megatron_torch", "megatron_torch_dist"):
        need = "`--ckpt-format torch`" if target_format == "torch" else "checkpoint (torch or torch_dist)"
        raise UCPError(f"{load}: --target-format {target_format} needs a Megatron-LM {need} source, "
                       f"this is a {kind} checkpoint. A Megatron-LM checkpoint stores the run's "
                       "args (model architecture, optimizer and run settings) that the written "
                       f"checkpoint must carry; a {kind} checkpoint has no Megatron-LM args. "
                       "Convert the original Megatron-LM checkpoint instead, or call "
                       "megatron_ucp.megatron_legacy.write_legacy / megatron_dist.write_torch_dist "
                       "with an args template")
    if kind == "megatron_torch":
        from megatron_ucp.megatron_legacy import legacy_source_fields

        src = legacy_source_fields(load)
        if target_format == "torch_dist":  # rank-dir names -> (pp, tp) shards
            src["rng_state"] = _legacy_rng_by_rank(src["rng_state"], src["args"])
        return src
    from megatron_ucp.megatron_dist import torch_dist_source_fields

    return torch_dist_source_fields(load)


def _reshard_to_megatron(load, out: Path, target: Layout | None, kind: str, target_format: str,
                         progress: bool, first: int | None, last: int | None, t0: float,
                         workers: int) -> ReshardSummary:
    """Megatron-LM -> universal (scratch next to `out`) -> Megatron-LM `target_format` at target."""
    src = _megatron_source(load, kind, target_format)
    if target is None:
        raise UCPError(f"--target-format {target_format}: writing a Megatron-LM checkpoint needs a "
                       "target layout (rank files, flat buffers and args depend on it); pass "
                       "target=Layout(...) (CLI: --target-tp/--target-pp/--target-dp ...)")
    if out.exists() and any(out.iterdir()):
        raise UCPError(f"{out} exists and is not empty; choose a new directory")
    if first is None and last is None and src["layout"].pp == target.pp:
        first = getattr(src["args"], "decoder_first_pipeline_num_layers", None)
        last = getattr(src["args"], "decoder_last_pipeline_num_layers", None)
    rng = src["rng_state"]
    if rng and src["layout"] != target:  # per-rank states belong to the source ranks: rank 0's
        rng = rng.get((0, 0), next(iter(rng.values())))
    if target_format == "torch":
        from megatron_ucp.megatron_legacy import write_legacy as write
    else:
        from megatron_ucp.megatron_dist import write_torch_dist as write
    scratch = out.with_name(f".{out.name}.universal")
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        _to_universal(load, scratch, kind, progress, workers)
        manifest = mf.read(scratch)
        write(scratch, out, target, src["args"], rng_state=rng,
              num_floating_point_operations_so_far=src["num_floating_point_operations_so_far"],
              first_stage_layers=first, last_stage_layers=last, progress=progress)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    files = [f for f in out.rglob("*") if f.is_file()]
    return ReshardSummary(kind, out, len(manifest["params"]),
                          sum(math.prod(p["shape"]) for p in manifest["params"].values()),
                          sum(f.stat().st_size for f in files), time.perf_counter() - t0,
                          target_format=target_format)
