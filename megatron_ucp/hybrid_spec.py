"""The hybrid (Mamba) stack spec with megatron-core's local layers: what megatron-ucp rebuilds a
hybrid model with, and the `--spec` a Megatron-LM hybrid run without Transformer Engine trains with.

Megatron-LM's pretrain_hybrid.py (pretrain_mamba.py runs it) builds the stack from the spec named by
`--spec MODULE NAME` (hybrid_builders.py: `import_module(args.spec)`, a ModuleSpec object, not a
function); megatron-core 0.19 ships only Transformer Engine's `hybrid_stack_spec`, 0.16 none.
Megatron-LM core_v0.16.1's pretrain_mamba.py takes the same `--spec` (mamba_builders.py, which
raises without one) and builds its MambaStack from this spec unchanged. This is the local one:
`--spec megatron_ucp.hybrid_spec hybrid_stack_spec_local` (on a CPU host, where the Mamba kernels
need stand-ins, the test harness's `megatron_ucp.testing.mamba_cpu hybrid_stack_spec_local` is the
same spec with them installed). Its norm class is the local spec's RMSNorm choice, megatron-core's
WrappedTorchNorm, which follows `config.normalization` (LayerNorm or RMSNorm); the MoE layer's local
experts (SequentialMLP) take their count from the config (8 here only selects MoE, as in
megatron-core's TE spec). It is built on first access (module `__getattr__`), so importing this
module imports no megatron-core model code.
"""

from __future__ import annotations

import functools
from typing import Any

from megatron_ucp.mcore_compat import mamba_modules


def hybrid_stack_spec(normalization: str, num_experts: int | None, moe_grouped_gemm: bool = False,
                      norm=None):
    """The hybrid stack (MambaStack) with megatron-core's local layers: megatron-core's
    `mamba_stack_spec` with the local GPT layer spec's modules in place of Transformer Engine's
    (megatron-core 0.16 ships no such spec).

    As the local GPT spec does for the norms TE fuses into the next linear, the Mamba layer's
    input norm is declared under the TE spec's name (`mixer.in_proj.layer_norm_weight`), and so
    are the attention and MLP layers' norms, so a checkpoint names them the same whichever spec
    trained it. `norm`: the norm class (default: the local spec's for `normalization`)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    mamba_mixer, mamba_block = mamba_modules()
    dense = get_gpt_layer_local_spec(normalization=normalization).submodules
    layer_norm = norm or dense.input_layernorm
    attention = TransformerLayerSubmodules(
        input_layernorm=layer_norm, self_attention=dense.self_attention, self_attn_bda=dense.self_attn_bda,
        sharded_state_dict_keys_map={"input_layernorm.": "self_attention.linear_qkv.layer_norm_"})
    mlp = TransformerLayerSubmodules(
        pre_mlp_layernorm=layer_norm, mlp=dense.mlp, mlp_bda=dense.mlp_bda,
        sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"})
    moe_layer = None
    if num_experts:
        moe = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                       normalization=normalization)
        moe_layer = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=layer_norm, mlp=moe.submodules.mlp, mlp_bda=get_bias_dropout_add))
    return ModuleSpec(module=mamba_block.MambaStack, submodules=mamba_block.MambaStackSubmodules(
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            norm=layer_norm,
            mixer=ModuleSpec(module=mamba_mixer.MambaMixer, submodules=mamba_mixer.MambaMixerSubmodules(
                in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)),
            mamba_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"})),
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=mlp),
        moe_layer=moe_layer or IdentityOp))


@functools.cache
def _local_spec() -> Any:
    return hybrid_stack_spec("RMSNorm", num_experts=8)


def __getattr__(name: str) -> Any:
    if name == "hybrid_stack_spec_local":
        return _local_spec()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
