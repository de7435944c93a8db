"""A Megatron-Bridge run's `run_config.yaml` and `train_state.pt` as the Megatron-LM style args the
torch_dist reader and writers take.

Why args: Bridge's torch_dist checkpoints are megatron-core `dist_checkpointing` saves with the same
keys as Megatron-LM's (`model`, `optimizer`, `opt_param_scheduler`, `rng_state`), written by the same
megatron-core DistributedOptimizer; only the run's description differs. Bridge keeps no Megatron-LM
`args` in the common state: its ConfigContainer is `run_config.yaml` (the model section is the
GPTModelProvider, i.e. megatron-core's TransformerConfig fields by their own names; `ddp`, `optimizer`
are megatron-core's DDP and optimizer configs) and its counters are `train_state.pt`. This module
translates those into the names `megatron_rebuild` and the torch_dist reader read, so megatron-core
rebuilds the model and its DDP buffers exactly as Bridge's `provide()` did.

The YAML is read with `yaml.safe_load`: plain data, nothing instantiated (its `_target_` entries
name classes and functions; only their names are read).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.megatron_common import torch_load

RUN_CONFIG = "run_config.yaml"
TRAIN_STATE = "train_state.pt"
TRACKER_STATE = "latest_train_state.pt"
BRIDGE_HOLDS = "Megatron-Bridge train state (tensors)"
BRIDGE_RUN = "megatron_bridge_run"  # args attribute: the source run's config, train state and directory

# model.activation_func `_target_` (with gated_linear_unit) -> the Megatron-LM flag that builds it
ACTIVATIONS = {("torch.nn.functional.silu", True): "swiglu",
               ("megatron.core.activations.squared_relu", False): "squared_relu",
               ("megatron.core.fusions.fused_bias_geglu.quick_gelu", True): "quick_geglu",
               ("torch.nn.functional.gelu", False): None}  # None: megatron-core's default (GELU)
# Bridge spec functions that build megatron-core's local layers (the others build TE's)
LOCAL_SPECS = re.compile(r"(^|\.)local_layer_spec$|get_gpt_layer_local_spec$")
DTYPES = {"torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16}
# Bridge runs whose optimizer state is read: Adam in megatron-core's DistributedOptimizer (a Muon /
# Lion run's LayerWise optimizer is mapped for Megatron-LM's args only)
OPTIMIZERS_READ = ("adam",)


def read_run_config(ckpt: Path) -> dict:
    import yaml

    where = ckpt / RUN_CONFIG
    try:
        cfg = yaml.safe_load(where.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise UCPError(f"{where}: cannot read Megatron-Bridge's run config ({e}); the checkpoint is "
                       "incomplete: copy run_config.yaml back from the run") from e
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict):
        raise UCPError(f"{where}: not a Megatron-Bridge ConfigContainer (no `model` section)")
    return cfg


def read_train_state(ckpt: Path, trust_pickle: bool = False) -> dict:
    """Bridge's TrainState.state_dict() (`step`, `consumed_train_samples`, ...) as Python numbers."""
    where = ckpt / TRAIN_STATE
    if not where.exists():
        return {}
    state = torch_load(where, "Bridge writes it next to run_config.yaml", trust_pickle, holds=BRIDGE_HOLDS)
    if not isinstance(state, dict):
        raise UCPError(f"{where}: not a Megatron-Bridge train state (a {type(state).__name__})")
    return {k: v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v for k, v in state.items()}


def target_name(value) -> str | None:
    """The `_target_` of a serialised callable or type (`{'_target_': 'torch.bfloat16', ...}`)."""
    return value.get("_target_") if isinstance(value, dict) else None


def run_args(cfg: dict, train_state: dict, *, world_size: int, padded_vocab_size: int,
             iteration: int, where: Path) -> argparse.Namespace:
    """Megatron-LM style args of the Bridge run `cfg` (see the module doc)."""
    model, ddp = cfg["model"], cfg.get("ddp") or {}
    optimizer = cfg.get("optimizer") or {}
    args: dict = {}
    for section in (optimizer, ddp, model):  # (the model's own values last: they win)
        args.update({k: v for k, v in section.items() if not isinstance(v, dict) and k != "_target_"})
    for k in ("params_dtype", "pipeline_dtype", "autocast_dtype"):
        if target_name(model.get(k)) in DTYPES:
            args[k] = DTYPES[target_name(model[k])]
    activation = (target_name(model.get("activation_func")), bool(model.get("gated_linear_unit")))
    if activation not in ACTIVATIONS:
        raise UCPError(f"{where / RUN_CONFIG}: model.activation_func {activation[0]} (gated_linear_unit="
                       f"{activation[1]}) is not one megatron-ucp rebuilds (SwiGLU, GELU, squared ReLU, "
                       "quick GeGLU)")
    if ACTIVATIONS[activation]:
        args[ACTIVATIONS[activation]] = True
    spec = target_name(model.get("transformer_layer_spec")) or ""
    args["transformer_impl"] = ("local" if LOCAL_SPECS.search(spec)
                                else model.get("transformer_impl", "transformer_engine"))
    name = optimizer.get("optimizer", "adam")
    if name not in OPTIMIZERS_READ:
        raise UCPError(f"{where / RUN_CONFIG}: optimizer.optimizer={name!r}: Megatron-Bridge runs with "
                       f"{', '.join(OPTIMIZERS_READ)} are read (a Bridge {name} run is not mapped yet)")
    heads, groups = model["num_attention_heads"], model.get("num_query_groups")
    tp, pp = model.get("tensor_model_parallel_size", 1), model.get("pipeline_model_parallel_size", 1)
    cp = model.get("context_parallel_size", 1) or 1
    if world_size % (tp * pp * cp):
        raise UCPError(f"{where}: {world_size} ranks wrote the checkpoint, which TP{tp} x PP{pp} x CP{cp} "
                       "does not divide; the run config does not describe this checkpoint")
    args.update(
        num_experts=model.get("num_moe_experts"),
        group_query_attention=groups is not None and groups != heads,
        num_query_groups=groups or heads,
        untie_embeddings_and_output_weights=not model.get("share_embeddings_and_output_weights", True),
        padded_vocab_size=padded_vocab_size,
        vocab_size=(cfg.get("tokenizer") or {}).get("vocab_size") or model.get("vocab_size"),
        max_position_embeddings=model.get("seq_length"),
        seq_length=model.get("seq_length"),
        use_rope_scaling=bool(model.get("rope_scaling")),
        rope_scaling_factor=model.get("rope_scaling_factor"),
        decoder_first_pipeline_num_layers=model.get("num_layers_in_first_pipeline_stage"),
        decoder_last_pipeline_num_layers=model.get("num_layers_in_last_pipeline_stage"),
        use_distributed_optimizer=bool(optimizer.get("use_distributed_optimizer")),
        accumulate_allreduce_grads_in_fp32=bool(ddp.get("grad_reduce_in_fp32")),
        ddp_bucket_size=ddp.get("bucket_size"),
        ddp_pad_buckets_for_high_nccl_busbw=bool(ddp.get("pad_buckets_for_high_nccl_busbw")),
        ddp_average_in_collective=bool(ddp.get("average_in_collective")),
        bf16=bool(model.get("bf16")), fp16=bool(model.get("fp16")),
        world_size=world_size, data_parallel_size=world_size // (tp * pp * cp),
        iteration=iteration,
        consumed_train_samples=int(train_state.get("consumed_train_samples", 0) or 0),
        seed=int((cfg.get("rng") or {}).get("seed", 1234)),
        optimizer=name,
    )
    return argparse.Namespace(**args)
