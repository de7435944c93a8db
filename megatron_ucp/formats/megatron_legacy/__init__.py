"""`megatron_torch`: Megatron-LM `--ckpt-format torch` checkpoints with the distributed optimizer
(`mp_rank_*/model_optim_rng.pt` + `distrib_optim.pt`), read and written at any layout."""

from __future__ import annotations

from pathlib import Path

from megatron_ucp.formats.megatron_common import holds_checkpoint
from megatron_ucp.formats.megatron_legacy.layout import is_iteration
from megatron_ucp.formats.megatron_legacy.reader import LegacySource, run_fields
from megatron_ucp.formats.megatron_legacy.writer import write
from megatron_ucp.progress import Progress

NAME = "megatron_torch"
SOURCES = (LegacySource,)


def detect(path: Path) -> bool:
    return holds_checkpoint(path, is_iteration)


def open_source(path: str | Path, progress: Progress = True, trust_pickle: bool = False,
                **_: object) -> LegacySource:
    return LegacySource(path, progress, trust_pickle)


__all__ = ["NAME", "SOURCES", "detect", "open_source", "write", "run_fields", "LegacySource"]
