"""`megatron_fsdp`: Megatron-LM's FSDP checkpoint formats (megatron-core 0.19): `--ckpt-format
fsdp_dtensor` (Megatron-FSDP) and `--ckpt-format torch_dcp` (torch FSDP2), data-parallel runs,
read as universal tensors. Not written (convert to universal, torch or torch_dist)."""

from __future__ import annotations

from pathlib import Path

from megatron_ucp.formats.megatron_common import holds_checkpoint, resolve_iteration
from megatron_ucp.formats.megatron_fsdp.layout import is_iteration, kind_of_keys
from megatron_ucp.formats.megatron_fsdp.reader import (
    FsdpDtensorSource,
    TorchDcpSource,
    open_fsdp_source,
    run_fields,
)
from megatron_ucp.progress import Progress
from megatron_ucp.storage import dcp_reader

NAME = "megatron_fsdp"
SOURCES = (FsdpDtensorSource, TorchDcpSource)


def detect(path: Path) -> bool:
    """A DCP directory without torch_dist's metadata.json whose keys are Megatron-LM's FSDP forms
    (or a save root whose tracker names one)."""
    if not holds_checkpoint(path, is_iteration):
        return False
    try:
        ckpt, _ = resolve_iteration(path, is_iteration, "--ckpt-format fsdp_dtensor / torch_dcp")
        keys = dcp_reader(ckpt).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 - an unreadable .metadata: left to the torch_dist reader's message
        return False
    return kind_of_keys(keys) is not None


def open_source(path: str | Path, progress: Progress = True, trust_pickle: bool = False,
                **_: object) -> FsdpDtensorSource | TorchDcpSource:
    return open_fsdp_source(path, trust_pickle)


__all__ = ["NAME", "SOURCES", "detect", "open_source", "run_fields", "FsdpDtensorSource", "TorchDcpSource"]
