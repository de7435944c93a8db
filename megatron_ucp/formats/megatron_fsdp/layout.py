"""The files of Megatron-LM's two FSDP checkpoint formats (megatron-core 0.19 / core_v0.19.0).

Both are plain torch.distributed.checkpoint directories (`.metadata`, `__<rank>_0.distcp`) that
`save_checkpoint` writes with `torch.distributed.checkpoint.save` of the whole state dict:
no `metadata.json` (which every `--ckpt-format torch_dist` directory has), no `common.pt`; the
args, iteration, scheduler, rng states and `num_floating_point_operations_so_far` are objects in
the .distcp files, nested dicts flattened to dotted keys.

* `--ckpt-format fsdp_dtensor` (Megatron-FSDP, `--use-megatron-fsdp`): `model.<prefix><name>` is
  each parameter's fp32 main weight (the DTensor of Megatron-FSDP's main-weight buffer, one
  chunk per rank at global shape), `optimizer.state.<prefix><name>.<exp_avg|exp_avg_sq|step>`
  its Adam state, `optimizer.param_to_group_meta.<prefix><name>.<field>` its param group's
  hyper-parameters; `<prefix>` is one `module.` per wrapper (Megatron-FSDP, Float16Module).
* `--ckpt-format torch_dcp` (torch FSDP2, `--use-torch-fsdp2`): `model.<name>` the training-dtype
  weights, `optimizer.fp32_from_fp16_params.<group>.<i>` the fp32 master weights and
  `optimizer.optimizer.state.<position>.<state>` the Adam state, addressed by the parameter's
  position in the optimizer's param groups, not by name.
"""

from __future__ import annotations

from pathlib import Path

from megatron_ucp.storage import location

METADATA_FILE = ".metadata"
DIST_METADATA_JSON = "metadata.json"  # what makes a DCP directory megatron-core's torch_dist
FSDP_DTENSOR = "fsdp_dtensor"
TORCH_DCP = "torch_dcp"
STATE_PREFIX = "optimizer.state."
GROUP_META_PREFIX = "optimizer.param_to_group_meta."
FSDP2_MASTER_PREFIX = "optimizer.fp32_from_fp16_params."
FSDP2_STATE_PREFIX = "optimizer.optimizer.state."
FSDP2_GROUP_PREFIX = "optimizer.optimizer.param_groups."


def is_iteration(path: Path) -> bool:
    """A torch.distributed.checkpoint directory that is not megatron-core's torch_dist."""
    path = location(path)
    return (path / METADATA_FILE).exists() and not (path / DIST_METADATA_JSON).exists()


def kind_of_keys(keys) -> str | None:
    """Which of the two forms the stored keys are (None: neither, e.g. some other DCP save)."""
    keys = list(keys)
    if "args" not in keys or not any(k.startswith("model.") for k in keys):
        return None
    if any(k.startswith(GROUP_META_PREFIX) for k in keys):
        return FSDP_DTENSOR
    if any(k.startswith((FSDP2_MASTER_PREFIX, FSDP2_STATE_PREFIX)) for k in keys):
        return TORCH_DCP
    if any(k.startswith("model.module.") for k in keys):  # saved without optimizer
        return FSDP_DTENSOR
    return TORCH_DCP


def strip_wrappers(name: str) -> str:
    """`module.module.decoder.x` -> `decoder.x`: the names megatron-core's wrappers (DDP / FSDP
    adapters, Float16Module) put in front of the model's own parameter names."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name
