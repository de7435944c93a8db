"""`universal`: the consolidated, layout-free form. Each parameter as full fp32 tensors (master
weight and Adam moments) plus the spec that says how any layout slices it."""

from __future__ import annotations

from pathlib import Path

from megatron_ucp.formats import manifest as mf
from megatron_ucp.formats.universal.source import UniversalSource
from megatron_ucp.formats.universal.writer import write, write_params

NAME = "universal"
SOURCES = (UniversalSource,)


def from_manifest(ckpt: Path, manifest: mf.Manifest, verify_checksums: bool = True,
                  **_: object) -> UniversalSource:
    return UniversalSource(ckpt, manifest, verify_checksums)


__all__ = ["NAME", "SOURCES", "from_manifest", "write", "write_params", "UniversalSource"]
