"""Offline reshard on a CPU box: any supported checkpoint -> universal, checked against a target layout.

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

    def __str__(self) -> str:
        mib = self.bytes_written / 2**20
        return (f"[megatron-ucp] resharded {self.source_kind} -> universal {self.output}: "
                f"{self.params} parameters, {self.elements:,} elements, {mib:.1f} MiB written in "
                f"{self.seconds:.2f}s ({mib / max(self.seconds, 1e-9):.1f} MiB/s)")


def reshard(load: str | Path, save: str | Path, target: Layout | None = None,
            target_format: str = "universal", progress: bool = True) -> ReshardSummary:
    t0 = time.perf_counter()
    if target_format != "universal":
        raise UCPError(f"--target-format {target_format}: writing Megatron-LM {target_format} "
                       "checkpoints is not implemented yet; use --target-format universal and "
                       "resume with Megatron-LM --universal-checkpoint (megatron_ucp.megatron_lm)")
    kind = detect(load)
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
