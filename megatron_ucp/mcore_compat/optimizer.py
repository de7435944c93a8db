"""megatron-core's DistributedOptimizer and param groups: the private accessors megatron-ucp uses.

megatron-core has no public API for one parameter's optimizer shard, so megatron-ucp calls the
accessors the optimizer's own checkpoint code uses. They are underscore names, the likeliest to
change in a new release: every call goes through here (tests/test_mcore_release.py enforces it).
Checked the same in 0.16 and 0.19.
"""

from __future__ import annotations

import torch


def param_range(optimizer, param) -> tuple[int, int]:
    """[start, end) of `param`'s flattened elements this rank's DistributedOptimizer shard holds
    (`_get_model_param_range_map(param)["param"]`; empty when end <= start)."""
    r = optimizer._get_model_param_range_map(param)["param"]
    return r.start, r.end


def main_param_and_optimizer_states(optimizer, param) -> dict:
    """{"param": fp32 main shard, "exp_avg": ..., "exp_avg_sq": ...} of `param` on this rank
    (`_get_main_param_and_optimizer_states`): views into the optimizer's own tensors."""
    return optimizer._get_main_param_and_optimizer_states(param)


def init_optimizer_states(optimizer) -> None:
    """Allocate the Adam states before the first step (`_init_optimizer_states_with_dummy_values`),
    so that a load can write into them."""
    optimizer._init_optimizer_states_with_dummy_values()


def copy_main_params_to_model_params(optimizer) -> None:
    """Write the fp32 main shards into the model's parameters (`_copy_main_params_to_model_params`),
    as megatron-core's `step` does: with `reuse_grad_buf_for_mxfp8_param_ag` (MXFP8 parameters,
    0.19) the shards go into the DDP param buffer instead (`_copy_main_params_to_param_buffer`),
    and the next param all-gather re-quantizes the model's MXFP8 weights from it
    (`_post_param_sync`); a plain copy would leave that buffer stale and the all-gather would
    overwrite the weights with it."""
    if getattr(optimizer.config, "reuse_grad_buf_for_mxfp8_param_ag", False) and hasattr(
            optimizer, "_copy_main_params_to_param_buffer"):
        optimizer._copy_main_params_to_param_buffer()
        return
    optimizer._copy_main_params_to_model_params()


def wrap_ddp_coalescing_manager(wrap) -> None:
    """Replace the `_coalescing_manager` megatron-core's DDP param/grad buffers use by
    `wrap(original)`, once (test stand-ins: see testing/te_cpu)."""
    import megatron.core.distributed.param_and_grad_buffer as pgb

    if not getattr(pgb._coalescing_manager, "_ucp_uncoalesced", False):
        pgb._coalescing_manager = wrap(pgb._coalescing_manager)


def megatron_param_groups(model_chunks: list, args) -> list[dict]:
    """The optimizer param groups megatron-core builds for `model_chunks` of the run `args`
    describe, in its order ({'params': [...], 'wd_mult': ..., ...}), as Megatron-LM's training
    builds them (OptimizerConfig from the args' fields, the standard overrides: no weight decay
    on biases and 1-D parameters, decoupled LR). The private `_get_param_groups(model_chunks,
    config, config_overrides)` and `get_standard_config_overrides` are the same in 0.16 and 0.19.
    Call inside `megatron_rebuild.source_rank` (it all-gathers the group keys)."""
    import dataclasses

    from megatron.core.optimizer import (
        OptimizerConfig,
        _get_param_groups,
        get_standard_config_overrides,
    )

    names = {f.name for f in dataclasses.fields(OptimizerConfig)}
    config = OptimizerConfig(**{k: v for k, v in vars(args).items() if k in names})
    return _get_param_groups(model_chunks, config, get_standard_config_overrides(config))


def replace_hybrid_param_split(split) -> None:
    """Replace `HybridDeviceOptimizer._get_sub_optimizer_param_groups(self, offload_fraction)`,
    the private method that splits the main params between CPU offload's host and device
    optimizers (the same in 0.16 and 0.19): the CPU stand-in of its device side
    (`megatron_ucp.testing.hybrid_offload_cpu`) installs itself through here."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    HybridDeviceOptimizer._get_sub_optimizer_param_groups = split


def torch_adam_resume_fixes() -> None:
    """Two megatron-core 0.19.2 DistributedOptimizer load steps on the torch-Adam path (taken only
    without TE and Apex: a CPU run, e.g. Megatron-Bridge's own training loop under
    `testing.bridge_cpu`; with TE's or Apex's Adam on a GPU the step lives in the param
    groups). sharded_state_dict(is_loading=True) first calls
    its state_dict(), which asserts one Adam step over the optimizer's states: a fresh optimizer has
    none, so every resume fails before anything is read. The states are allocated first, as
    megatron-core's own dummy initialisation does."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.sharded_state_dict

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, *args, **kwargs):
        if is_loading and not self.optimizer.state:
            init_optimizer_states(self)
        return original(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    DistributedOptimizer.sharded_state_dict = sharded_state_dict

    # ... and on that path a dp_reshardable load first sets each parameter's `step` tensor from the
    # loaded param groups, then copies every state tensor of the bucket over it, `step` included,
    # from the sharded state dict made before the load (the dummy step): every resume restarts Adam's
    # bias correction at step 1. The step the param groups hold is kept.
    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def keep_loaded_step(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state.get(self.optimizer.param_groups[group_index]["params"][group_order], {})
        step = state.get("step")
        kept = step.clone() if isinstance(step, torch.Tensor) else None
        set_states(self, model_param, tensors)
        if kept is not None:
            state["step"].copy_(kept)

    DistributedOptimizer._set_main_param_and_optimizer_states = keep_loaded_step
