"""Every on-disk format, one package each, behind one interface; the registry picks by name.

A format package has `NAME` and opens a source of universal tensors: megatron-ucp's own formats
(`fragments`, `universal`; their manifest names them) with `from_manifest(ckpt, manifest, ...)`,
the others with `detect(path) -> bool` and `open_source(path, ...)`. A source has `.manifest`
(`formats.manifest.Manifest`: the run state and every parameter's spec and Adam step),
`.read(name, state, offset, shape)` (a box of a full fp32 tensor), `.step(name)`,
`.rng_ranks()` / `.rng(rank)`, `.origin`, `.dir`, `.bytes_read` and `.format` (its registry
name). A format that can be written has `write(source, out, ...)`. Data flows one way: a
source's tensors go to a writer (`universal.write`, `megatron_legacy.write`,
`megatron_dist.write`) or into a live run (`load`). Only a format's own package knows its layout
on disk.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from megatron_ucp.errors import UCPError
from megatron_ucp.formats import manifest as mf
from megatron_ucp.storage import location

# name -> package; the first two are megatron-ucp's own, whose manifest.json names the format
FORMATS = {
    "fragments": "megatron_ucp.formats.fragments",
    "universal": "megatron_ucp.formats.universal",
    "megatron_torch": "megatron_ucp.formats.megatron_legacy",
    # before megatron_torch_dist: both are torch.distributed.checkpoint directories
    "megatron_fsdp": "megatron_ucp.formats.megatron_fsdp",  # fsdp_dtensor, torch_dcp (FSDP runs)
    "megatron_torch_dist": "megatron_ucp.formats.megatron_dist",
    "hf": "megatron_ucp.formats.hf",  # Hugging Face transformers model directories
    "deepspeed": "megatron_ucp.formats.deepspeed",  # DeepSpeed universal folders (with a name map)
}


def get(name: str) -> ModuleType:
    if name not in FORMATS:
        raise UCPError(f"unknown checkpoint format {name!r}; choose one of {list(FORMATS)}")
    return importlib.import_module(FORMATS[name])


OWN = ("fragments", "universal")


def detect(path: str | Path) -> str:
    """The name of the format `path` holds (a checkpoint directory or a save root)."""
    path = location(path)  # an unsupported URL scheme is an error here
    if mf.is_checkpoint(path):
        return mf.read_checkpoint(path)[1].kind
    for name in FORMATS:
        if name not in OWN and get(name).detect(path):
            return name
    from megatron_ucp.formats.megatron_common import TRACKER, resolve_iteration

    if (path / TRACKER).exists():  # a Megatron-LM save root whose tracker names no checkpoint:
        resolve_iteration(path, lambda _: False, "Megatron-LM")  # raises, saying what it names
    try:
        mf.resolve(path)  # says what is wrong with a megatron-ucp path (no `latest`, a .partial, ...)
    except mf.NotACheckpoint as e:
        raise UCPError(f"{path}: unknown checkpoint format: {e}; nor is it a Megatron-LM "
                       "checkpoint (no tracker file with mp_rank_* or .metadata)") from None
    raise UCPError(f"{path}: unknown checkpoint format")


def open_source(path: str | Path, fmt: str | None = None, **options):
    """A source of universal tensors for `path`, in format `fmt` (detected when None)."""
    path = location(path)
    if fmt in OWN or (fmt is None and mf.is_checkpoint(path)):
        return open_megatron_ucp(path, **options)
    return get(fmt or detect(path)).open_source(path, **options)


def open_megatron_ucp(path: str | Path, **options):
    """A source for a megatron-ucp checkpoint (save root or directory) of either kind; its
    manifest names the format, so it is parsed once. Anything else is refused (`mf.resolve`)."""
    ckpt, manifest = mf.read_checkpoint(path)
    return get(manifest.kind).from_manifest(ckpt, manifest, **options)


def writable() -> list[str]:
    return [name for name in FORMATS if hasattr(get(name), "write")]
