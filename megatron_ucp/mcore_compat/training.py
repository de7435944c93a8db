"""Megatron-LM (`megatron.training`) differences between the releases the hooks support.

* `save_checkpoint` / `load_checkpoint` take more parameters after `checkpointing_context` with
  each release (core_v0.16.1 ends at dp_cp_group; core_v0.19.0 adds dp_group, expt_dp_group,
  rng_state_key_prefix): `SAVE_PARAMS` / `LOAD_PARAMS` list them in order, and the hooks forward
  them as they came, so one hook serves every release.
* core_v0.16.1's `initialize` imported `parse_args` by name; core_v0.19.0's has none (its
  `parse_and_validate_args` calls `arguments.parse_args`): `modules_holding`.
* Whether the micro-batch calculator is set up: megatron-core keeps it in a private global.
"""

from __future__ import annotations

import types

SAVE_PARAMS = ("pipeline_rank", "expert_rank", "tensor_rank", "pipeline_parallel", "expert_parallel",
               "non_persistent_ckpt", "train_data_iterator", "preprocess_common_state_dict_fn",
               "release", "tp_group", "pp_group", "dp_cp_group", "dp_group", "expt_dp_group",
               "rng_state_key_prefix")
LOAD_PARAMS = ("skip_load_to_model_and_opt", "tp_group", "pp_group", "dp_cp_group", "dp_group",
               "expt_dp_group", "rng_state_key_prefix")


def modules_holding(name: str, modules: tuple[types.ModuleType, ...]) -> list[types.ModuleType]:
    """Those of `modules` that hold `name` in this release (imported it by name, or define it)."""
    return [m for m in modules if hasattr(m, name)]


def microbatches_calculator_initialized() -> bool:
    """Whether megatron-core's global micro-batch calculator is set up (Megatron-LM's
    initialize does it; megatron-core's own getter asserts instead of answering)."""
    from megatron.core import num_microbatches_calculator as nmc

    return nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None
