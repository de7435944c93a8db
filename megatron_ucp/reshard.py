"""Offline reshard on a CPU box: any supported checkpoint -> universal, checked against a target layout,
or (target_format="torch") a Megatron-LM legacy checkpoint -> a Megatron-LM legacy checkpoint at the target.

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
            last_stage_layers: int | None = None) -> ReshardSummary:
    """Convert `load` to `target_format` at `target`.

    target_format "torch": a stock Megatron-LM `--ckpt-format torch` checkpoint at `target`; the
    source must be a Megatron-LM legacy checkpoint (its args describe the run). first/last_stage_
    layers set an uneven pipeline split at the target (default: the source's when PP is unchanged,
    else an even split)."""
    t0 = time.perf_counter()
    if target_format not in TARGET_FORMATS:
        raise UCPError(f"--target-format {target_format}: unknown; choose one of {TARGET_FORMATS}")
    if target_format == "torch_dist":
        raise UCPError("--target-format torch_dist: writing Megatron-LM torch_dist checkpoints is "
                       "not implemented yet; use --target-format torch or universal")
    kind = detect(load)
    if target_format == "torch":
        return _reshard_to_legacy(load, Path(save), target, kind, progress, first_stage_layers,
                                  last_stage_layers, t0)
    out = Path(save)
    if kind == "fragments":
        from megatron_ucp.consolidate import convert

        convert(load, out, progress=progress)
    elif kind == "universal":
        if out.exists():
            raise UCPError(f"{out} exists; choose a new directory")
        shutil.copytree(mf.resolve(load), out)
    elif kind == "megatron_torch":
        from megatron_ucp.megatron_legacy import convert_legacy

        convert_legacy(load, out, progress=progress)
    else:
        from megatron_ucp.megatron_dist import convert_torch_dist

        convert_torch_dist(load, out, progress=progress)
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


def _reshard_to_legacy(load, out: Path, target: Layout | None, kind: str, progress: bool,
                       first: int | None, last: int | None, t0: float) -> ReshardSummary:
    """Megatron-LM legacy -> universal (in a scratch directory next to `out`) -> legacy at target."""
    from megatron_ucp.megatron_legacy import convert_legacy, legacy_source_fields, write_legacy

    if kind != "megatron_torch":
        raise UCPError(f"{load}: --target-format torch needs a Megatron-LM `--ckpt-format torch` "
                       f"source, this is a {kind} checkpoint. A Megatron-LM checkpoint stores the "
                       "run's args (model architecture, optimizer and run settings) that every "
                       f"legacy rank file must carry; a {kind} checkpoint has no Megatron-LM args. "
                       "Convert the original Megatron-LM checkpoint instead, or call "
                       "megatron_ucp.megatron_legacy.write_legacy with an args template")
    if target is None:
        raise UCPError("--target-format torch: writing Megatron-LM torch checkpoints needs a "
                       "target layout (the rank directories and flat buffers depend on it); pass "
                       "target=Layout(...) (CLI: --target-tp/--target-pp/--target-dp ...)")
    if out.exists() and any(out.iterdir()):
        raise UCPError(f"{out} exists and is not empty; choose a new directory")
    src = legacy_source_fields(load)
    same = src["layout"] == target
    if first is None and last is None and src["layout"].pp == target.pp:
        first = getattr(src["args"], "decoder_first_pipeline_num_layers", None)
        last = getattr(src["args"], "decoder_last_pipeline_num_layers", None)
    rng = src["rng_state"]
    if rng and not same:  # per-rank generator states belong to the source ranks: keep rank 0's
        rng = next(iter(rng.values()))
    scratch = out.with_name(f".{out.name}.universal")
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        convert_legacy(load, scratch, progress=progress)
        manifest = mf.read(scratch)
        write_legacy(scratch, out, target, src["args"], rng_state=rng,
                     num_floating_point_operations_so_far=src["num_floating_point_operations_so_far"],
                     first_stage_layers=first, last_stage_layers=last, progress=progress)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    files = list(out.rglob("*.pt"))
    return ReshardSummary(kind, out, len(manifest["params"]),
                          sum(math.prod(p["shape"]) for p in manifest["params"].values()),
                          sum(f.stat().st_size for f in files), time.perf_counter() - t0,
                          target_format="torch")
