"""TransformerConfig and Megatron-LM argument differences between releases.

* Fields that 0.19 deprecated and refuses in combinations that Megatron-LM 0.16's arguments wrote
  by default (`moe_deepep_num_sms=20` with `moe_hybridep_num_sms=16`): `config_kwargs_from_args`
  leaves them out when rebuilding a model from another run's args.
* Megatron-LM 0.19's weight-shard counts (`rederive_weight_shards`).
* MLA's Q/KV norms: 0.19 resolves them in `QKNormConfigResolver`, which wants a Q norm fused into
  `linear_q_proj` when there is no query LoRA rank (only Transformer Engine has that layer); 0.16
  builds no Q norm there: `local_mla_qk_norm_without_q_lora`.
"""

from __future__ import annotations

from megatron_ucp.mcore_compat.release import optional, since

# Fields a newer TransformerConfig accepts only for backward compatibility (it routes them to their
# successor and refuses some combinations of them). They steer runtime kernels and CUDA graphs,
# never parameter names, shapes or splits; a rebuild from an older release's args leaves them out.
_DEPRECATED_CONFIG_FIELDS = {
    (0, 19): ("moe_deepep_num_sms", "moe_hybridep_num_sms", "enable_cuda_graph",
              "external_cuda_graph", "cuda_graph_scope", "moe_enable_deepep",
              "moe_router_topk_limited_devices"),
}
DEPRECATED_CONFIG_FIELDS = frozenset(
    name for release, names in _DEPRECATED_CONFIG_FIELDS.items() if since(*release) for name in names)


def config_kwargs_from_args(kw: dict) -> dict:
    """TransformerConfig keyword arguments taken from a Megatron-LM run's `args` (which may come
    from another release), without the fields this release keeps only as deprecated aliases."""
    return {k: v for k, v in kw.items() if k not in DEPRECATED_CONFIG_FIELDS}


# Megatron-LM 0.19's args record how many shards TP (times GTP) cuts each weight into, resolved from
# the TP sizes at start-up; TransformerConfig refuses fewer shards than TP. A copy of a run's args at
# another TP (a rebuild at TP1, a conversion target) carries them re-derived, GTP's factor kept.
_WEIGHT_SHARD_ARGS = (
    ("tensor_parallel_num_weight_shards", "tensor_model_parallel_size", "gtp_weight_remat_size"),
    ("expert_tensor_parallel_num_weight_shards", "expert_tensor_parallel_size",
     "expert_gtp_weight_remat_size"),
)


def rederive_weight_shards(args) -> None:
    """Set the weight-shard counts of Megatron-LM `args` (0.19; absent before) from its TP sizes."""
    for shards, tp, remat in _WEIGHT_SHARD_ARGS:
        if getattr(args, shards, None) is not None and getattr(args, tp, None):
            setattr(args, shards, getattr(args, tp) * (getattr(args, remat, None) or 1))


# 0.19 resolves MLA's Q/KV norms in QKNormConfigResolver: without a query LoRA rank a Q norm must
# be fused into linear_q_proj (a norm on the hidden states that 0.16 does not have), and only
# Transformer Engine provides that fused layer, so the local spec cannot build such a model with
# qk_layernorm; 0.16 builds it without any Q norm.
MLA_QK_NORM_CONFIG = optional("megatron.core.transformer.mla_qk_norm_config")


def local_mla_qk_norm_without_q_lora() -> bool:
    """Whether the local spec builds MLA with qk_layernorm and no q_lora_rank (0.16: kv norm only)."""
    return MLA_QK_NORM_CONFIG is None
