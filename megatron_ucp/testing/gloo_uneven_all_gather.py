"""gloo stand-in for an all-gather of uneven sizes, which megatron-core 0.19.2's
LayerWiseDistributedOptimizer does on its legacy path (stock `pretrain_gpt.py --optimizer
muon|lion --use-distributed-optimizer`): after each step every DP rank's updated parameters are
all-gathered flattened with the ranks' real sizes (`optimizer/layer_wise_optimizer.py:772`).
NCCL takes that, gloo refuses it (`ProcessGroupGloo::allgather: invalid tensor size`).

The same stand-in as the fixtures' harness (tests/fixtures/megatron_lm_v019/harness/
run_pretrain_gpt_layerwise.py, which wrote the Muon/Lion fixtures): pad every input to the largest
size, gather, copy each output's own elements back; an all-gather of equal sizes passes through
unchanged. Nothing that decides what is saved or loaded is touched.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_all_gather = dist.all_gather


def all_gather_uneven(tensor_list, tensor, group=None, async_op=False):
    sizes = {t.numel() for t in tensor_list}
    if len(sizes) <= 1 and tensor.numel() in sizes:
        return _all_gather(tensor_list, tensor, group=group, async_op=async_op)
    n = max(sizes | {tensor.numel()})
    src = torch.zeros(n, dtype=tensor.dtype, device=tensor.device)
    src[:tensor.numel()] = tensor.reshape(-1)
    padded = [torch.empty(n, dtype=tensor.dtype, device=tensor.device) for _ in tensor_list]
    _all_gather(padded, src, group=group)
    for out, got in zip(tensor_list, padded):
        if out is not tensor:
            out.view(-1).copy_(got[:out.numel()])
    assert not async_op, "the stand-in gathers synchronously"
    return None


def install() -> None:
    dist.all_gather = all_gather_uneven
