"""`hf`: Hugging Face transformers model directories (`config.json` + safetensors) of the
architectures in the `archs` registry (`ARCHS`).

Read as a source (weights as fp32 master weights, fresh optimizer state, a weights-only manifest:
`source.HFSource`;
`megatron_ucp.conversion.import_hf`) and written from any source (`export.export`;
`megatron_ucp.conversion.export_hf`). Each architecture's name map, refusals and config translation
in both directions are its module in `archs`; the element order of fused tensors, which they share,
in `formats.tensor_transforms`.
"""

from __future__ import annotations

from pathlib import Path

from megatron_ucp.formats.hf.archs import ARCHS
from megatron_ucp.formats.hf.export import export
from megatron_ucp.formats.hf.source import FRESH, HFSource, is_hf_dir

NAME = "hf"
SOURCES = (HFSource,)


def detect(path: Path) -> bool:
    return is_hf_dir(path)


def open_source(path: str | Path, weights_only: bool = True, **_: object) -> HFSource:
    return HFSource(path, weights_only=weights_only)


write = export  # write(source, out, arch, ...): this format as a target

__all__ = ["NAME", "SOURCES", "ARCHS", "FRESH", "detect", "open_source", "write", "export", "HFSource"]
