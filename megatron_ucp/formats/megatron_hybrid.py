"""A hybrid (Mamba) model rebuilt from Megatron-LM args on the meta device (structure only), as
Megatron-LM's hybrid builder makes it: `megatron_rebuild.build_chunks` calls `build_hybrid_chunk`.

megatron-core's Mamba mixer refuses to build without mamba_ssm, and MambaStack's final norm is
Transformer Engine's; the rebuild runs no forward, so while it builds, spec-only stand-ins with the
same parameters take their place (`_mamba_structure_only`, restored on exit).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.megatron_common import hybrid_layer_pattern
from megatron_ucp.hybrid_spec import hybrid_stack_spec
from megatron_ucp.mcore_compat.mamba import build_hybrid_model, mamba_modules, mamba_stack_module


class _GatedNormSpecOnly(torch.nn.Module):
    """The Mamba mixer's gated RMSNorm in a rebuild (structure only, never run), where mamba_ssm,
    which provides it, is not installed: its weight, declared split on dim 0 over TP as
    megatron-core's ExtendedRMSNorm declares it."""

    def __init__(self, hidden_size: int, *_: object, device=None, dtype=None, **__: object):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
        )

        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets,
            tp_group=parallel_state.get_tensor_model_parallel_group(),
            dp_cp_group=ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"])

    def forward(self, *_: object, **__: object):
        raise UCPError("a model rebuilt by megatron-ucp from checkpoint args has no forward")


class _NormSpecOnly(torch.nn.Module):
    """MambaStack's final norm (Transformer Engine's TENorm) in a rebuild without TE: its weight
    (and bias for LayerNorm), replicated."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(hidden_size))
        if config.normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.empty(hidden_size))

    def forward(self, *_: object, **__: object):
        raise UCPError("a model rebuilt by megatron-ucp from checkpoint args has no forward")


@contextlib.contextmanager
def _mamba_structure_only() -> Iterator[None]:
    """While building a hybrid model on the meta device: megatron-core's Mamba mixer without
    mamba_ssm (which it refuses without; its gated norm then is `_GatedNormSpecOnly`), its RNG
    forks without a CUDA RNG tracker (nothing is initialised that matters), and MambaStack's final
    TENorm without Transformer Engine (`_NormSpecOnly`). Everything is restored on exit."""
    from megatron.core.extensions import transformer_engine as te_extensions

    mamba_mixer, _ = mamba_modules()
    stack_module = mamba_stack_module()
    saved = (mamba_mixer.HAVE_MAMBA_SSM, mamba_mixer.ExtendedRMSNorm, mamba_mixer.get_cuda_rng_tracker,
             stack_module.TENorm)
    try:
        if not mamba_mixer.HAVE_MAMBA_SSM:
            mamba_mixer.HAVE_MAMBA_SSM, mamba_mixer.ExtendedRMSNorm = True, _GatedNormSpecOnly
        mamba_mixer.get_cuda_rng_tracker = lambda: types.SimpleNamespace(fork=contextlib.nullcontext)
        if not te_extensions.HAVE_TE:
            stack_module.TENorm = _NormSpecOnly
        yield
    finally:
        (mamba_mixer.HAVE_MAMBA_SSM, mamba_mixer.ExtendedRMSNorm, mamba_mixer.get_cuda_rng_tracker,
         stack_module.TENorm) = saved


def build_hybrid_chunk(args, config):
    """The hybrid model (MambaModel; HybridModel in 0.19) as Megatron-LM's mamba builder makes it,
    with `hybrid_stack_spec`'s local layers (the same parameter names as the TE spec's)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    with _mamba_structure_only():
        model = build_hybrid_model(
            hybrid_layer_pattern(args), config=config,
            mamba_stack_spec=hybrid_stack_spec(args.normalization, getattr(args, "num_experts", None),
                                               getattr(args, "moe_grouped_gemm", False)),
            vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_percent=getattr(args, "rotary_percent", 1.0),
            rotary_base=getattr(args, "rotary_base", 10000))
    for p in model.parameters():
        # the Mamba mixer marks its per-channel parameters `tensor_model_parallel` (split on dim
        # 0) without a partition_dim; the defaults would add partition_dim -1
        if not hasattr(p, "tensor_model_parallel"):
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    return model
