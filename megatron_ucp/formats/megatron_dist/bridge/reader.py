"""Megatron-Bridge torch_dist checkpoints as a source: the torch_dist reader over the Megatron-LM
style args of the Bridge run (`config`)."""

from __future__ import annotations

import re
from pathlib import Path

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.dcp_reader import DistReader
from megatron_ucp.formats.megatron_common import resolve_iteration
from megatron_ucp.formats.megatron_dist.bridge.config import (
    BRIDGE_RUN,
    RUN_CONFIG,
    read_run_config,
    read_train_state,
    run_args,
)
from megatron_ucp.formats.megatron_dist.bridge.lora import MergedReader, base_dir, lora_of
from megatron_ucp.formats.megatron_dist.layout import UCP_COMMON_KEY
from megatron_ucp.formats.megatron_dist.layout import is_iteration as is_torch_dist
from megatron_ucp.formats.megatron_dist.model_only import model_only
from megatron_ucp.formats.megatron_dist.reader import TorchDistSource, check_names, load_common
from megatron_ucp.progress import Progress

NAME = "megatron_bridge"
WRITER_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")  # one per saving rank (and writer thread)
EMBEDDING_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def is_iteration(path: Path) -> bool:
    return is_torch_dist(path) and (path / RUN_CONFIG).is_file()


def read_common(load_dir: str | Path, trust_pickle: bool = False) -> tuple[Path, dict, object]:
    """(iteration directory, the common state, Megatron-LM style args of the Bridge run)."""
    ckpt, _ = resolve_iteration(load_dir, is_iteration, "Megatron-Bridge torch_dist")
    common, _ = load_common(ckpt, trust_pickle)
    reader = DistReader(ckpt, trust_pickle=trust_pickle)
    vocab = next((reader.shape(k)[0] for k in EMBEDDING_KEYS if k in reader.meta), None)
    # the world size: megatron-ucp's writer records it; in Bridge's own saves every rank of a
    # distributed-optimizer run owns an optimizer shard and writes a file (`__<rank>_<n>.distcp`)
    world = (common.get(UCP_COMMON_KEY) or {}).get("world_size") or 1 + max(
        (int(m.group(1)) for p in ckpt.iterdir() if (m := WRITER_FILE.match(p.name))), default=-1)
    if not world or vocab is None:
        raise UCPError(f"{ckpt}: no .distcp files or no embedding / output layer tensor; the "
                       "checkpoint is incomplete")
    train_state = read_train_state(ckpt, trust_pickle)
    iteration = int(common.get("iteration", train_state.get("step", 0)))
    run_config = read_run_config(ckpt)
    args = run_args(run_config, train_state, world_size=world,
                    padded_vocab_size=vocab, iteration=iteration, where=ckpt)
    # what a Bridge target written from this run carries over (`writer`)
    setattr(args, BRIDGE_RUN, {"run_config": run_config, "train_state": train_state, "dir": str(ckpt)})
    return ckpt, common, args


class BridgeSource(TorchDistSource):
    """A Megatron-Bridge torch_dist checkpoint read as universal tensors (a save root or iter dir).
    A LoRA fine-tuning checkpoint (adapters only) reads as its base checkpoint's weights with the
    adapters merged (`lora`; `lora_base` overrides the base checkpoint the run recorded), weights
    only: the adapters' optimizer state has no place in the merged model."""

    format = NAME
    saved_by = "megatron-bridge"
    read_common = staticmethod(read_common)

    def __init__(self, load_dir: str | Path, progress: Progress = True, trust_pickle: bool = False,
                 lora_base: str | Path | None = None):
        ckpt, _ = resolve_iteration(load_dir, is_iteration, "Megatron-Bridge torch_dist")
        self.lora = lora_of(read_run_config(ckpt), ckpt)
        if self.lora is None:
            if lora_base is not None:
                raise UCPError(f"--base {lora_base}: {ckpt} is not a LoRA checkpoint (run_config.yaml "
                               "has no peft section); drop --base")
            return super().__init__(load_dir, progress, trust_pickle)
        base = base_dir(self.lora, lora_base)
        base_ckpt, _ = resolve_iteration(base, is_iteration, "Megatron-Bridge torch_dist (the LoRA base)")
        if read_run_config(base_ckpt).get("peft"):
            raise UCPError(f"{base_ckpt}: the base checkpoint of {ckpt} is itself a LoRA checkpoint; "
                           "name the full pretrained checkpoint with --base")
        base_ckpt, common, args = read_common(base_ckpt, trust_pickle)
        self.dir, self.args, self.base_dir = ckpt, args, base_ckpt
        self.reader = MergedReader(DistReader(base_ckpt, trust_pickle=trust_pickle),
                                   DistReader(ckpt, trust_pickle=trust_pickle), self.lora)
        model_only(self, common, args, check_names)
        self.origin = {"kind": f"{self.saved_by} torch_dist LoRA (merged into the base)",
                       "path": str(ckpt), "base": str(base_ckpt)}


