"""Universal names from megatron-core sharded keys: local spec, TE spec and experts agree.

The sharded keys below are the ones megatron-core 0.16.1 declares (read from the layers'
sharded_state_dict on CPU for the local spec; for the TE spec, TELayerNormColumnParallelLinear
holds the norm as `linear_qkv.layer_norm_weight` and declares the same key)."""

import pytest

from megatron_ucp.errors import UCPError
from megatron_ucp.param_spec import universal_name

LAYER = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"


def test_local_and_te_layer_norm_names_agree():
    local = universal_name("decoder.layers.1.input_layernorm.weight", LAYER, (3,))
    te = universal_name("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight", LAYER, (3,))
    assert local == te == "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    key = "decoder.layers.mlp.linear_fc1.layer_norm_weight"
    assert (universal_name("decoder.layers.0.pre_mlp_layernorm.weight", key, (2,))
            == universal_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", key, (2,))
            == "decoder.layers.2.mlp.linear_fc1.layer_norm_weight")


def test_global_layer_and_expert_numbers():
    assert (universal_name("decoder.layers.0.self_attention.linear_qkv.weight",
                           "decoder.layers.self_attention.linear_qkv.weight", (5,))
            == "decoder.layers.5.self_attention.linear_qkv.weight")
    assert (universal_name("decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight",
                           "decoder.layers.mlp.experts.experts.linear_fc1.weight", (3, 6))
            == "decoder.layers.3.mlp.experts.experts.6.linear_fc1.weight")
    assert universal_name("output_layer.weight", "embedding.word_embeddings.weight", ()) == \
        "embedding.word_embeddings.weight"


def test_unmappable_names_are_errors():
    with pytest.raises(UCPError, match="decoder.layers.0.foo.weight"):
        universal_name("decoder.layers.0.foo.weight", "decoder.layers.foo.weight", (1, 2))
    with pytest.raises(UCPError, match="no rule maps it"):
        universal_name("decoder.layers.0.a.1.b", "decoder.layers.x.y", (0, 1))
