"""Which optimizer family (`spec.OPTIMIZER_STATES`) a torch optimizer inside megatron-core's wrappers
is, and the settings besides its param groups that change its maths: the classes megatron-ucp knows,
each refused by name when its state has no universal layout (`optimizer_state` indexes the state)."""

from __future__ import annotations

import torch
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

from megatron_ucp.errors import UCPError

SUPPORTED = ("DistributedOptimizer, Float16OptimizerWithFloat16Params, FP32Optimizer or "
             "LayerWiseDistributedOptimizer around torch Adam/AdamW/SGD, TE/Apex FusedAdam, "
             "emerging_optimizers Lion or Muon, or megatron-core's HybridDeviceOptimizer "
             "(--optimizer-cpu-offload) of those")


def _qualname(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def family(torch_optimizer, group: dict) -> str:
    """The optimizer family (`spec.OPTIMIZER_STATES`) of `torch_optimizer`'s param group `group`;
    an optimizer whose state megatron-ucp cannot lay out is refused by its class name."""
    opt = torch_optimizer
    if isinstance(opt, HybridDeviceOptimizer):  # CPU offload: the state is its sub-optimizers'
        subs = opt.sub_optimizers
        if not subs:
            raise UCPError("HybridDeviceOptimizer has no sub-optimizer on this rank")
        return family(subs[0], group)
    name = type(opt).__name__
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)) or name == "FusedAdam":
        return "adam"
    if isinstance(opt, torch.optim.SGD):
        return "sgd" if group.get("momentum", 0) else "plain_sgd"
    module = type(opt).__module__
    if module.startswith(("emerging_optimizers", "megatron.core.optimizer")):
        if name == "Lion":
            return "lion"
        if name.endswith("AdaptiveMuon"):
            # (its default second moment is elementwise, but megatron-core 0.19.2's
            # TensorParallelAdaptiveMuon fails its first step, "no attribute 'scale_mode'": no
            # run to test a layout of its state against)
            raise UCPError(f"optimizer {_qualname(opt)} (--optimizer adaptive_muon) is not "
                           "supported by megatron-ucp yet: megatron-core 0.19.2 cannot train it "
                           "(TensorParallelAdaptiveMuon has no attribute 'scale_mode'); a run "
                           "with it can neither save nor load (not even with reset_optimizer)")
        if name in ("TensorParallelMuon", "Muon"):
            return "muon"
        if name == "SOAP":  # recognised, its state not saved (UNRESHARDABLE_STATES)
            return "soap"
    raise UCPError(f"optimizer {_qualname(opt)} is not supported by megatron-ucp: its state has "
                   f"no layout megatron-ucp can reshard (supported: {SUPPORTED}). Train with one "
                   "of those: a run with it can neither save nor load (not even with "
                   "reset_optimizer)")


def hyperparameters(torch_optimizer) -> dict:
    """What changes an optimizer's maths besides its param groups, and the dtypes its state is
    kept in (recorded, shown by inspect)."""
    out = {}
    attrs = ["tp_mode", "split_qkv"]  # megatron-core's TensorParallelMuon
    if getattr(torch_optimizer, "master_weights", False):  # TE FusedAdam, precision-aware
        attrs += ["exp_avg_dtype", "exp_avg_sq_dtype", "master_weight_dtype", "store_param_remainders"]
    for attr in attrs:
        v = getattr(torch_optimizer, attr, None)
        if isinstance(v, torch.dtype):
            v = str(v).removeprefix("torch.")
        if isinstance(v, (bool, int, float, str)):
            out[attr] = v
    return out
