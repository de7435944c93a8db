"""Open whichever form a checkpoint directory holds, behind one `read(name, state, box)` interface."""

from __future__ import annotations

from pathlib import Path

from megatron_ucp import manifest as mf
from megatron_ucp.errors import UCPError
from megatron_ucp.fragments import FragmentSource
from megatron_ucp.universal import UniversalSource


def open_source(path: str | Path, verify_checksums: bool = True) -> FragmentSource | UniversalSource:
    ckpt = mf.resolve(path)
    manifest = mf.read(ckpt)
    kinds = {"fragments": FragmentSource, "universal": UniversalSource}
    if manifest.get("kind") not in kinds:
        raise UCPError(f"{ckpt / mf.MANIFEST}: unknown checkpoint kind {manifest.get('kind')!r}")
    return kinds[manifest["kind"]](ckpt, manifest, verify_checksums=verify_checksums)
