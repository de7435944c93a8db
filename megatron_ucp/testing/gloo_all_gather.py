"""CPU stand-in for NCCL's all-gather of uneven sizes, which gloo refuses.

megatron-core 0.19's LayerWiseDistributedOptimizer on its legacy path (no shard-aligned param
layout: what stock Megatron-LM core_v0.19.0 `pretrain_gpt.py --optimizer muon` builds) all-gathers
each rank's updated parameters flattened, with the ranks' real, uneven sizes
(`layer_wise_optimizer._allgather_helper`): NCCL accepts that, gloo raises `ProcessGroupGloo::
allgather: invalid tensor size`. The stand-in replaces `torch.distributed.all_gather`: with outputs
of different sizes it pads every rank's input to the largest, gathers, and copies each output's own
elements back (the elements NCCL's all-gather brings); an all-gather of equal sizes, every other
caller's, is passed through unchanged. Installed by `tiny_gpt.build` for that path on CPU, and by
the core_v0.19.0 fixture harness (tests/fixtures/megatron_lm_v019/harness).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_ALL_GATHER = dist.all_gather


def all_gather_uneven(tensor_list, tensor, group=None, async_op=False):
    sizes = {t.numel() for t in tensor_list}
    if len(sizes) <= 1 and tensor.numel() in sizes:
        return _ALL_GATHER(tensor_list, tensor, group=group, async_op=async_op)
    assert not async_op, "the stand-in gathers synchronously"
    n = max(sizes | {tensor.numel()})
    src = torch.zeros(n, dtype=tensor.dtype, device=tensor.device)
    src[:tensor.numel()] = tensor.reshape(-1)
    padded = [torch.empty(n, dtype=tensor.dtype, device=tensor.device) for _ in tensor_list]
    _ALL_GATHER(padded, src, group=group)
    for out, got in zip(tensor_list, padded):
        if out is not tensor:
            out.view(-1).copy_(got[:out.numel()])
    return None


def install() -> None:
    dist.all_gather = all_gather_uneven
