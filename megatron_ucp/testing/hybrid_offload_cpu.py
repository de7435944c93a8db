"""CPU stand-in for the device side of megatron-core's optimizer CPU offload (HybridDeviceOptimizer).

Replaces `HybridDeviceOptimizer._get_sub_optimizer_param_groups`, which splits the main params
into those its CPU optimizer updates (a pinned host copy of each offloaded CUDA param) and those
its GPU optimizer updates, by whether a param `is_cuda`. On a CPU-only host every param is a host
tensor, so megatron-core's split puts them all in the CPU groups without a host copy and its step
then fails looking the copy up (`cpu_copys_map_gpu_param`). The stand-in treats each param as the
device tensor and gives every one (offload fraction 1, the only one a CPU host can mean) a host
copy, mapped both ways as on a GPU host: the CPU optimizer updates the copies and megatron-core's
own hook copies them back after each step, the state a checkpoint must restore. Installed by
`tiny_gpt.build` for `optimizer_cpu_offload` runs when no GPU is present.
"""

from __future__ import annotations

from megatron_ucp.mcore_compat import optimizer as mcore_optimizer


def _host_copies(self, offload_fraction: float):
    """(cpu_param_groups, gpu_param_groups, gpu_params_map_cpu_copy, cpu_copys_map_gpu_param,
    param_to_fp32_param): megatron-core's contract, every param offloaded to a host copy."""
    cpu_groups, to_copy, to_param = [], {}, {}
    for group in self.param_groups:
        copies = []
        for param in group["params"]:
            copy = param.detach().clone().float()  # (fp32: the main params already are)
            to_copy[param], to_param[copy] = copy, param
            copies.append(copy)
        if copies:
            cpu_groups.append({**group, "params": copies})
    return cpu_groups, [], to_copy, to_param, {}


def install() -> None:
    mcore_optimizer.replace_hybrid_param_split(_host_copies)
