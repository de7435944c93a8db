"""`megatron_torch_dist`: Megatron-LM `--ckpt-format torch_dist` checkpoints (distributed
optimizer, `dp_reshardable` or `fully_reshardable`), read at any layout; written at any layout
in the `fully_reshardable` form."""

from __future__ import annotations

from pathlib import Path

from megatron_ucp.formats.megatron_common import holds_checkpoint, resolve_iteration
from megatron_ucp.formats.megatron_dist.layout import is_iteration
from megatron_ucp.formats.megatron_dist.reader import TorchDistSource, run_fields
from megatron_ucp.formats.megatron_dist.writer import write
from megatron_ucp.progress import Progress

NAME = "megatron_torch_dist"
SOURCES = (TorchDistSource,)


def detect(path: Path) -> bool:
    return holds_checkpoint(path, is_iteration)


def iteration_dir(path: str | Path) -> Path:
    """The iteration directory of a torch_dist save root (its tracker names it) or the directory."""
    return resolve_iteration(path, is_iteration, "--ckpt-format torch_dist")[0]


def open_source(path: str | Path, progress: Progress = True, trust_pickle: bool = False,
                **_: object) -> TorchDistSource:
    return TorchDistSource(path, progress, trust_pickle)


__all__ = ["NAME", "SOURCES", "detect", "iteration_dir", "open_source", "write", "run_fields",
           "TorchDistSource"]
