"""Universal tensors -> a Megatron-Bridge torch_dist checkpoint at any layout, which Bridge's own
`load_checkpoint` resumes with its optimizer state.

The tensors, optimizer forms and commit are the torch_dist writer's (`megatron_dist.writer`);
Bridge reads the same megatron-core `dist_checkpointing` keys. What differs is the run's record:
no Megatron-LM args in the common state; `run_config.yaml` (the source run's, its parallel sizes
set to the target's, and the checkpoint section saying what was written: the optimizer form, whether
RNG states are there) and `train_state.pt` (the iteration and consumed samples of the universal
checkpoint), plus `latest_train_state.pt` at the root, as Bridge's save writes them. Bridge checks
the run config's TP/PP against the resuming run's: with the target's recorded there, a
`dp_reshardable` form (Bridge's default) loads at the target TP/PP and a `fully_reshardable` one at
any.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.megatron_dist import writer as torch_dist
from megatron_ucp.formats.megatron_dist.bridge.config import (
    BRIDGE_RUN,
    RUN_CONFIG,
    TRACKER_STATE,
    TRAIN_STATE,
)
from megatron_ucp.formats.megatron_dist.bridge.reader import BridgeSource
from megatron_ucp.layout import Layout

# model settings that describe the layout, set to the target's (Megatron-LM arg -> Bridge field)
LAYOUT_FIELDS = {"tensor_model_parallel_size": "tensor_model_parallel_size",
                 "pipeline_model_parallel_size": "pipeline_model_parallel_size",
                 "virtual_pipeline_model_parallel_size": "virtual_pipeline_model_parallel_size",
                 "context_parallel_size": "context_parallel_size",
                 "expert_model_parallel_size": "expert_model_parallel_size",
                 "expert_tensor_parallel_size": "expert_tensor_parallel_size",
                 "decoder_first_pipeline_num_layers": "num_layers_in_first_pipeline_stage",
                 "decoder_last_pipeline_num_layers": "num_layers_in_last_pipeline_stage",
                 "sequence_parallel": "sequence_parallel"}
SOURCE_FILES = ("tokenizer",)  # what Bridge's save puts in an iteration directory besides the state


def write(source, save_dir: str | Path, target: Layout, args_template, *, sharding: str | None = None,
          **options) -> Path:
    """Write a Bridge torch_dist checkpoint at `target` (see the module doc). args_template: the
    args of a Megatron-Bridge checkpoint (`megatron_bridge.run_fields`), whose run config the new one
    starts from. sharding: "dp_reshardable" (default, Bridge's own default form) or "fully_reshardable"
    (Bridge's `dist_ckpt_optim_fully_reshardable`; resumes at any TP/PP). Other options: the
    torch_dist writer's."""
    run = getattr(args_template, BRIDGE_RUN, None)
    if run is None:
        raise UCPError("writing a Megatron-Bridge checkpoint needs a Bridge run's config (run_config.yaml: "
                       "the model provider, optimizer, DDP and training settings); convert a "
                       "Megatron-Bridge checkpoint of this model (the args given are Megatron-LM's)")
    sharding = sharding or "dp_reshardable"
    manifest = source.manifest

    def files(iter_dir: Path, root: Path, args, written_sharding: str, rng_written: bool) -> None:
        cfg = copy.deepcopy(run["run_config"])
        for arg, field in LAYOUT_FIELDS.items():
            if field in cfg["model"] or getattr(args, arg, None) is not None:
                cfg["model"][field] = getattr(args, arg, None)
        ckpt = cfg.setdefault("checkpoint", {})
        ckpt.update(save_optim=True, save_rng=rng_written, ckpt_format="torch_dist",
                    dist_ckpt_optim_fully_reshardable=written_sharding == "fully_reshardable")
        import yaml

        (iter_dir / RUN_CONFIG).write_text(yaml.safe_dump(cfg, sort_keys=True))
        state = {**{k: v for k, v in run["train_state"].items()}, "step": int(manifest.iteration),
                 "consumed_train_samples": int(manifest.extra.get("consumed_samples", 0) or 0)}
        state = {k: torch.tensor(v) for k, v in state.items() if isinstance(v, (bool, int, float))}
        torch.save(state, iter_dir / TRAIN_STATE)
        shutil.copyfile(iter_dir / TRAIN_STATE, root / TRACKER_STATE)
        for name in SOURCE_FILES:
            src = Path(run["dir"]) / name
            if src.is_dir():
                shutil.copytree(src, iter_dir / name)

    flavor = torch_dist.Flavor(saved_by="Megatron-Bridge", args_in_common=False, record_world_size=True,
                               reader=BridgeSource,
                               files=files)
    return torch_dist.write(source, save_dir, target, args_template, sharding=sharding, flavor=flavor,
                            **options)
