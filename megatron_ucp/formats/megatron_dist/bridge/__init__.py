"""`megatron_bridge`: NVIDIA Megatron-Bridge `torch_dist` checkpoints (its `pretrain()` and
`save_megatron_model`), read at any layout through the torch_dist reader: the same megatron-core
`dist_checkpointing` keys and DistributedOptimizer forms as Megatron-LM's, the run described by
`run_config.yaml` and `train_state.pt` instead of Megatron-LM's args (`config`)."""

from __future__ import annotations

from pathlib import Path

from megatron_ucp.formats.megatron_common import holds_checkpoint
from megatron_ucp.formats.megatron_dist.bridge.reader import NAME, BridgeSource, is_iteration, read_common
from megatron_ucp.formats.megatron_dist.bridge.writer import write
from megatron_ucp.formats.megatron_dist.reader import run_fields as torch_dist_run_fields
from megatron_ucp.progress import Progress

SOURCES = (BridgeSource,)


def detect(path: Path) -> bool:
    return holds_checkpoint(path, is_iteration)


def open_source(path: str | Path, progress: Progress = True, trust_pickle: bool = False,
                lora_base: str | Path | None = None, **_: object) -> BridgeSource:
    return BridgeSource(path, progress, trust_pickle, lora_base)


def run_fields(load_dir: str | Path, trust_pickle: bool = False):
    return torch_dist_run_fields(load_dir, trust_pickle, read=read_common)


__all__ = ["NAME", "SOURCES", "detect", "open_source", "run_fields", "write", "BridgeSource", "read_common"]
