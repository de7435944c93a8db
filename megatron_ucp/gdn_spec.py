"""The layer specs of megatron-core's Gated DeltaNet GPT model (Qwen3-Next:
`experimental_attention_variant="gated_delta_net"`) with megatron-core's local layers: what
megatron-ucp rebuilds such a model with where Transformer Engine is not usable.

megatron-core builds this model only from Transformer Engine's modules
(`get_transformer_block_with_experimental_attention_variant_spec` asserts
transformer_impl == "transformer_engine"), and its local norm (`WrappedTorchNorm`) refuses
`layernorm_zero_centered_gamma`, which Qwen3-Next's norms need. This spec is megatron-core's own
per-layer choice (`get_linear_attention_pattern`, `get_moe_layer_pattern`) over the local GPT layer
spec: megatron-core's `GatedDeltaNet` (in_proj, conv1d, A_log, dt_bias, out_norm, out_proj) in the
linear-attention layers, its `SelfAttention` elsewhere, MoE or dense MLPs; the norms are
`ZeroCenteredRMSNorm`. As the local GPT spec does for the norms TE fuses into the next linear, the
input norm of a linear-attention layer is declared under the TE spec's name
(`self_attention.in_proj.layer_norm_weight`), so a checkpoint names every tensor as TE's does.

`gdn_buildable` lets megatron-core build `GatedDeltaNet` without the `fla` package (its kernels
need CUDA; a rebuild on the meta device never runs them): GatedDeltaNet raises ImportError at
construction while `HAVE_FLA` is false, and asserts it has a kernel (`chunk_gated_delta_rule`,
None without fla: a function that raises stands in while building).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

GDN = "gated_delta_net"


def is_gdn_model(config_or_args) -> bool:
    return getattr(config_or_args, "experimental_attention_variant", None) == GDN


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm scaling by 1 + weight when `config.layernorm_zero_centered_gamma` (weight starting
    at 0), else by the weight (starting at 1), computed in fp32: Transformer Engine's RMSNorm with
    zero_centered_gamma, and HF Qwen3-Next's Qwen3NextRMSNorm. A norm megatron-core's local spec
    lacks (its WrappedTorchNorm refuses zero-centered gamma)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__()
        self.eps, self.zero_centered = eps, bool(config.layernorm_zero_centered_gamma)
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float()
        return (h * (1.0 + w if self.zero_centered else w)).to(x.dtype)


@contextlib.contextmanager
def gdn_buildable() -> Iterator[None]:
    """megatron-core's GatedDeltaNet may be constructed without `fla` while inside (see above)."""
    from megatron_ucp.mcore_compat import gdn_modules

    flags, kernel, base = gdn_modules()
    saved = flags.HAVE_FLA, kernel.chunk_gated_delta_rule, base.reset_parameters
    flags.HAVE_FLA = True
    if kernel.chunk_gated_delta_rule is None:  # (0.19's GatedDeltaNet asserts it has a kernel)
        kernel.chunk_gated_delta_rule = _no_kernel
    # its initial values (drawn under the CUDA RNG tracker, which a rebuild has not) are none of a
    # structure's; its parallel attributes are set outside reset_parameters
    base.reset_parameters = lambda self: None
    try:
        yield
    finally:
        flags.HAVE_FLA, kernel.chunk_gated_delta_rule, base.reset_parameters = saved


def _no_kernel(*_: object, **__: object):
    raise RuntimeError("megatron-ucp built this Gated DeltaNet without the fla package, for its "
                       "structure: it has no forward")


def gdn_block_spec(config, te: bool, vp_stage: int | None, args=None):
    """The rebuild's decoder block spec: Megatron-LM's gpt_builders' (Transformer Engine's) where TE
    is usable (`te`), else the local one. Refuses MTP layers (`args.mtp_num_layers`)."""
    from megatron_ucp.errors import UCPError

    if getattr(args, "mtp_num_layers", None):
        raise UCPError("mtp_num_layers: a Gated DeltaNet model's multi-token prediction layers are not "
                       "rebuilt by megatron-ucp yet")
    if not te:
        return gdn_local_block_spec(config, vp_stage=vp_stage)
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_block_with_experimental_attention_variant_spec,
    )

    return get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage=vp_stage)


def gdn_local_block_spec(config, vp_stage: int | None = None, norm=ZeroCenteredRMSNorm):
    """The decoder block spec (this pipeline stage's layers) of a Gated DeltaNet GPT model with
    local layers (see above); `norm`: every norm's class."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_linear_attention_pattern,
        get_moe_layer_pattern,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules  # (both releases)
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    linear = get_linear_attention_pattern(config)
    moe = get_moe_layer_pattern(config) if config.num_moe_experts else [0] * config.num_layers
    gdn = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=norm, out_proj=RowParallelLinear))
    specs = []
    for i in range(config.num_layers):
        spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts if moe[i] else None,
                                        moe_grouped_gemm=config.moe_grouped_gemm,
                                        qk_layernorm=config.qk_layernorm, normalization=config.normalization)
        sub, old = spec.submodules, WrappedTorchNorm
        attention = dataclasses.replace(sub.self_attention, submodules=_norms(sub.self_attention.submodules,
                                                                              old, norm))
        sub = dataclasses.replace(_norms(sub, old, norm), self_attention=attention)
        if linear[i]:
            sub = dataclasses.replace(sub, self_attention=gdn, sharded_state_dict_keys_map={
                **sub.sharded_state_dict_keys_map, "input_layernorm.": "self_attention.in_proj.layer_norm_"})
        spec = dataclasses.replace(spec, submodules=sub)
        specs.append(spec)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=specs[offset:offset + count], layer_norm=norm)


def _norms(submodules, old: type, new):
    """`submodules` (a dataclass of layer parts) with every `old` norm class replaced by `new`."""
    return dataclasses.replace(submodules, **{f.name: new for f in dataclasses.fields(submodules)
                                              if getattr(submodules, f.name) is old})


def mark_split_dims(model: torch.nn.Module) -> None:
    """megatron-core 0.16's GatedDeltaNet marks conv1d, dt_bias and A_log `tensor_model_parallel`
    without a `partition_dim` (0.19 sets 0); its sharded_state_dict splits them on dim 0, the dim
    said here before a rebuild's attribute defaults (partition_dim -1) would say otherwise."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    for module in model.modules():
        if isinstance(module, GatedDeltaNet):
            for p in (*module.parameters(recurse=False), *module.conv1d.parameters()):
                if getattr(p, "tensor_model_parallel", False) and not hasattr(p, "partition_dim"):
                    p.partition_dim = 0
