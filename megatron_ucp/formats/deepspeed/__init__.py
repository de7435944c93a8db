"""`deepspeed`: DeepSpeed universal checkpoint folders (`ds_to_universal` output), read as a source
with their optimizer state (fp32 master weights, both Adam moments, step).

DeepSpeed trains arbitrary torch modules, so a name map (YAML, `configs/deepspeed/`) says which
megatron-core model the run is and where each DeepSpeed parameter goes (`name_map`), in which
element order (`layouts`). `megatron_ucp.conversion.import_deepspeed` writes the universal form;
this format is not a target.
"""

from __future__ import annotations

from pathlib import Path

from megatron_ucp.formats.deepspeed.name_map import NameMap
from megatron_ucp.formats.deepspeed.source import (
    RECORD,
    DeepSpeedSource,
    DSUniversalDir,
    is_ds_universal,
)

NAME = "deepspeed"
SOURCES = (DeepSpeedSource,)


def detect(path: Path) -> bool:
    return is_ds_universal(path)


def open_source(path: str | Path, name_map: str | Path | None = None, **options) -> DeepSpeedSource:
    return DeepSpeedSource(path, name_map, **options)


__all__ = ["NAME", "SOURCES", "RECORD", "detect", "open_source", "DeepSpeedSource",
           "DSUniversalDir", "NameMap"]
