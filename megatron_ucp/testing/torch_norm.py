"""A norm for CPU runs with sequence parallelism, shared by the tiny GPT's layers (`tiny_gpt`) and
the hybrid stack's final norm (`mamba_cpu`): its own module so that neither imports the other.

No megatron-core import at module level: `cpu_shim` must be imported before megatron.core.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig


class SequenceParallelTorchNorm:
    """megatron-core's WrappedTorchNorm without its "no sequence parallel" assert.

    Without Apex/TE, megatron-core 0.16 has no norm that allows sequence parallelism. Like Apex's
    FusedLayerNorm, this marks the weights `sequence_parallel` so finalize_model_grads all-reduces
    their gradients over TP (each TP rank sees only its sequence shard).
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused):
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm
