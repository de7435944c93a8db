"""Every on-disk format, one package each, behind one contract (`formats.base`); the registry
below is the one list of them, and picks a package by name.

A format package opens a source of universal tensors (`base.Source`: `.manifest`, `.read`,
`.step`, `.rng_ranks`/`.rng`, ...): megatron-ucp's own formats (`fragments`, `universal`; their
manifest names them) with `from_manifest(ckpt, manifest, ...)`, the others with `detect(path)`
and `open_source(path, ...)`. A format that can be written has `write(source, out, ...)`; one
whose checkpoints hold Megatron-LM run args has `run_fields(load) -> base.RunFields`. Data flows
one way: a source's tensors go to a writer or into a live run (`load`); the conversions that
join them are in `megatron_ucp.conversion`. Only a format's own package knows its layout on disk.

This module imports no torch (the CLI reads the registry to build its parser); opening a format
imports its package.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.base import FormatInfo, FormatPackage, Source

# Detection order matters: the first two are megatron-ucp's own (their manifest.json names the
# format); megatron_fsdp before megatron_torch_dist (both are torch.distributed.checkpoint
# directories, the FSDP forms recognised by their keys).
_ENTRIES = (
    FormatInfo("fragments", "megatron_ucp.formats.fragments", own=True),
    FormatInfo("universal", "megatron_ucp.formats.universal", own=True, target="universal",
               writes=True),
    FormatInfo("megatron_torch", "megatron_ucp.formats.megatron_legacy", target="torch",
               writes=True, run_args=True, import_command="import-legacy"),
    # fsdp_dtensor, torch_dcp (FSDP runs): read only
    FormatInfo("megatron_fsdp", "megatron_ucp.formats.megatron_fsdp", run_args=True),
    # Megatron-Bridge torch_dist saves (run_config.yaml instead of args): before megatron_torch_dist
    FormatInfo("megatron_bridge", "megatron_ucp.formats.megatron_dist.bridge", target="bridge", writes=True,
               run_args=True),
    FormatInfo("megatron_torch_dist", "megatron_ucp.formats.megatron_dist", target="torch_dist",
               writes=True, run_args=True, import_command="import-torch-dist"),
    # Hugging Face transformers model directories; written by export-hf (an architecture to choose)
    FormatInfo("hf", "megatron_ucp.formats.hf", writes=True),
    # DeepSpeed universal folders (with a name map): read only
    FormatInfo("deepspeed", "megatron_ucp.formats.deepspeed"),
)
FORMATS: dict[str, FormatInfo] = {f.name: f for f in _ENTRIES}
OWN = tuple(name for name, f in FORMATS.items() if f.own)
# --target-format value -> format name
TARGETS = {f.target: name for name, f in FORMATS.items() if f.target}
# the formats whose checkpoints carry Megatron-LM run args (a Megatron-LM target's source)
MEGATRON_SOURCES = tuple(name for name, f in FORMATS.items() if f.run_args)
# CLI import command -> format name
IMPORT_COMMANDS = {f.import_command: name for name, f in FORMATS.items() if f.import_command}


def get(name: str) -> FormatPackage | ModuleType:
    if name not in FORMATS:
        raise UCPError(f"unknown checkpoint format {name!r}; choose one of {list(FORMATS)}")
    return importlib.import_module(FORMATS[name].package)


def detect(path: str | Path) -> str:
    """The name of the format `path` holds (a checkpoint directory or a save root)."""
    from megatron_ucp.formats import manifest as mf
    from megatron_ucp.storage import location

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


def open_source(path: str | Path, fmt: str | None = None, **options) -> Source:
    """A source of universal tensors for `path`, in format `fmt` (detected when None)."""
    from megatron_ucp.formats import manifest as mf
    from megatron_ucp.storage import location

    path = location(path)
    lora_base = options.pop("lora_base", None)  # (--base: a Megatron-Bridge LoRA checkpoint's)
    own = fmt in OWN or (fmt is None and mf.is_checkpoint(path))
    fmt = None if own else fmt or detect(path)
    if lora_base is not None and fmt != "megatron_bridge":
        raise UCPError(f"--base {lora_base}: {path} is not a Megatron-Bridge checkpoint "
                       f"({fmt or 'megatron-ucp'}); --base names a Bridge LoRA checkpoint's base "
                       "checkpoint: drop it")
    if own:
        return open_megatron_ucp(path, **options)
    if lora_base is not None:
        options["lora_base"] = lora_base
    return get(fmt).open_source(path, **options)


def open_megatron_ucp(path: str | Path, **options) -> Source:
    """A source for a megatron-ucp checkpoint (save root or directory) of either kind; its
    manifest names the format, so it is parsed once. Anything else is refused (`mf.resolve`)."""
    from megatron_ucp.formats import manifest as mf

    ckpt, manifest = mf.read_checkpoint(path)
    return get(manifest.kind).from_manifest(ckpt, manifest, **options)


def writable() -> list[str]:
    return [name for name, f in FORMATS.items() if f.writes]
