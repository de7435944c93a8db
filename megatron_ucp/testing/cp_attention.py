"""Context-parallel core attention for CPU runs: megatron-core's DotProductAttention over the
keys and values of the whole sequence.

megatron-core 0.16 implements context parallelism only in TEDotProductAttention (CUDA). This
stand-in keeps everything else of a CP run real: megatron-core's CP process groups, DDP gradient
reduction and DistributedOptimizer sharding over DP x CP, RoPE's per-CP-rank positions, and the
load-balanced sequence split (`split_for_cp`: rank r holds chunks r and 2CP-1-r of 2CP). Each
rank all-gathers K and V over the CP group (megatron's sequence-parallel gather, whose backward
reduce-scatters the gradients) and masks by true token positions, so the result equals causal
attention over the full sequence.
"""

from __future__ import annotations

import copy

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.dot_product_attention import DotProductAttention


def cp_positions(seq_length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Token positions held by one CP rank, in the order megatron's CP split lays them out."""
    chunk = seq_length // (2 * cp_size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (cp_rank, 2 * cp_size - 1 - cp_rank)])


def split_for_cp(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This CP rank's share of a [batch, seq] tensor (megatron-LM's get_batch_on_this_cp_rank)."""
    cp = ps.get_context_parallel_world_size()
    if cp == 1:
        return t
    index = cp_positions(t.shape[dim], cp, ps.get_context_parallel_rank())
    return t.index_select(dim, index)


class ContextParallelDotProductAttention(DotProductAttention):
    def __init__(self, config, *args, **kwargs):
        local = copy.copy(config)
        local.context_parallel_size = 1  # the parent asserts it; CP is handled in forward
        super().__init__(local, *args, **kwargs)
        self.cp_group = ps.get_context_parallel_group()

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        cp, rank = self.cp_group.size(), self.cp_group.rank()
        if cp > 1:
            key = gather_from_sequence_parallel_region(key, group=self.cp_group)
            value = gather_from_sequence_parallel_region(value, group=self.cp_group)
        seq = key.shape[0]
        q_pos = cp_positions(seq, cp, rank)
        k_pos = torch.cat([cp_positions(seq, cp, r) for r in range(cp)])
        mask = (k_pos[None, :] > q_pos[:, None])[None, None]  # True = masked (future token)
        return super().forward(query, key, value, mask, attn_mask_type, attention_bias, packed_seq_params)
