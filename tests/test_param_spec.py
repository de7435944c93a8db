"""Universal names from megatron-core sharded keys: local spec, TE spec and experts agree.

The sharded keys below are the ones megatron-core 0.16.1 declares (read from the layers'
sharded_state_dict on CPU for the local spec; for the TE spec, TELayerNormColumnParallelLinear
holds the norm as `linear_qkv.layer_norm_weight` and declares the same key)."""

import pytest
from conftest import NEEDS_LEGACY_GROUPED_MLP, SCENARIOS

from megatron_ucp.errors import UCPError
from megatron_ucp.param_spec import universal_name
from megatron_ucp.testing.launch import launch

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


def test_transformer_engine_grouped_experts_name_like_sequential_mlp():
    """TEGroupedMLP's TEGroupedLinear holds expert k as `linear_fc1.weight<k>` and declares it under
    SequentialMLP's key with (layer, expert) prepended (megatron-core 0.16.1,
    `_sharded_state_dict_grouped` + TEGroupedMLP.sharded_state_dict)."""
    key = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    te = universal_name("decoder.layers.1.mlp.experts.linear_fc1.weight3", key, (3, 7))
    sequential = universal_name("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight", key, (3, 7))
    assert te == sequential == "decoder.layers.3.mlp.experts.experts.7.linear_fc1.weight"
    assert (universal_name("decoder.layers.0.mlp.experts.linear_fc2.bias1",
                           "decoder.layers.mlp.experts.experts.linear_fc2.bias", (0, 5))
            == "decoder.layers.0.mlp.experts.experts.5.linear_fc2.bias")


def test_unmappable_names_are_errors():
    with pytest.raises(UCPError, match="decoder.layers.0.foo.weight"):
        universal_name("decoder.layers.0.foo.weight", "decoder.layers.foo.weight", (1, 2))
    with pytest.raises(UCPError, match="no rule maps it"):
        universal_name("decoder.layers.0.a.1.b", "decoder.layers.x.y", (0, 1))


@NEEDS_LEGACY_GROUPED_MLP
def test_grouped_and_sequential_experts_have_the_same_universal_specs():
    """GroupedMLP (one fused weight per EP rank, transposed experts) and SequentialMLP declare the
    same tensors: every universal name, shape and split rule agrees, with expert TP and EP."""
    cfg = {"num_experts": 4, "add_bias_linear": False, "swiglu": True, "dtype": "bf16",
           "sequence_parallel": True}

    def specs(grouped: bool) -> dict:
        res = launch(4, f"{SCENARIOS}:param_specs",
                     {"layout": "tp2ep2dp2", "cfg": {**cfg, "moe_grouped_gemm": grouped}})
        return {s["name"]: s for rank in res for s in rank}

    sequential, grouped = specs(False), specs(True)
    assert sequential == grouped
    fc1 = grouped["decoder.layers.3.mlp.experts.experts.2.linear_fc1.weight"]
    assert (fc1["shape"], fc1["tp_axis"], fc1["tp_blocks"]) == ([256, 64], 0, 2)
    fc2 = grouped["decoder.layers.3.mlp.experts.experts.2.linear_fc2.weight"]
    assert (fc2["shape"], fc2["tp_axis"], fc2["tp_blocks"]) == ([64, 128], 1, 1)


def test_factory_pieces_are_probed_and_must_be_strided_views():
    """A factory's pieces are found by probing its build function with element indices: a
    transpose gives strides, anything that is not a strided view of the parameter is an error."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from megatron_ucp.param_spec import sharded_pieces as _sharded_pieces
    from megatron_ucp.param_spec import strided_pieces as _pieces
    from megatron_ucp.spec import Piece

    param = torch.nn.Parameter(torch.randn(4, 6))

    def entry(build):
        def build_fn(key, t, replica_id, flattened_range):
            return [ShardedTensor.from_rank_offsets(key, x.contiguous(), replica_id=replica_id)
                    for x in build(t)]
        return ShardedTensorFactory("w", param, build_fn, lambda x: x, 0)

    halves = entry(lambda t: t.t().chunk(2, dim=0))  # two [3, 4] blocks of the transpose
    pcs = _pieces("w", param, _sharded_pieces("w", param, halves), True)
    assert pcs == [Piece(0, (0, 0), (3, 4), (1, 6)), Piece(3, (0, 0), (3, 4), (1, 6))]
    assert torch.equal(pcs[1].take(param.detach()), param.detach().t()[3:])
    flipped = entry(lambda t: [t.flip(0)])
    with pytest.raises(UCPError, match="not a strided view"):
        _pieces("w", param, _sharded_pieces("w", param, flipped), True)
    twice = entry(lambda t: [t[:2], t[:2], t[2:]])
    with pytest.raises(UCPError, match="overlaps"):
        _pieces("w", param, _sharded_pieces("w", param, twice), True)


def test_version_1_pieces_are_blocks_of_rows():
    from megatron_ucp.spec import Piece

    pc = Piece.from_json([2, [4, 0], [3, 5]])
    assert pc == Piece(10, (4, 0), (3, 5), (5, 1)) and pc.contiguous


def test_empty_transformer_engine_extra_state_is_not_state():
    """TE layers' `_extra_state` is an empty uint8 tensor without FP8 (TE's get_extra_state);
    it carries nothing and must not stop a save. FP8 metadata does carry state: refused."""
    import io

    import torch

    from megatron_ucp.param_spec import carries_extra_state

    assert not carries_extra_state(None)
    assert not carries_extra_state(torch.empty(0, dtype=torch.uint8))
    assert not carries_extra_state(io.BytesIO())
    assert carries_extra_state(torch.tensor([1, 2], dtype=torch.uint8))
    assert carries_extra_state(io.BytesIO(b"fp8"))


def test_local_mla_norms_take_the_transformer_engine_names():
    """MLA: Transformer Engine's spec fuses the q/kv latent norms into linear_q_up_proj /
    linear_kv_up_proj and a dense MLP's norm into linear_fc1 (TELayerNormColumnParallelLinear);
    megatron-core's local MLA spec declares them as separate norms with no keys map. The universal
    names are TE's, for a live local-spec MLA model (DeepSeek-V3 shape: first layer dense, the rest
    MoE with a separate pre-MLP norm in both specs), so either spec loads the other's checkpoint."""
    from test_model_families import DEEPSEEK_V3

    specs = launch(1, f"{SCENARIOS}:param_specs", {"layout": "tp1", "cfg": DEEPSEEK_V3}, timeout=300)[0]
    names = {s["name"] for s in specs}
    assert not any(".q_layernorm." in n or ".kv_layernorm." in n for n in names), sorted(names)
    for layer in range(4):
        for te in ("linear_q_up_proj.layer_norm_weight", "linear_kv_up_proj.layer_norm_weight"):
            assert f"decoder.layers.{layer}.self_attention.{te}" in names, (layer, te)
    # the dense first layer's norm is fused into linear_fc1; the MoE layers keep pre_mlp_layernorm
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names
    assert "decoder.layers.0.pre_mlp_layernorm.weight" not in names
    assert {f"decoder.layers.{i}.pre_mlp_layernorm.weight" for i in (1, 2, 3)} <= names


def test_te_fused_names_leave_other_models_alone():
    from megatron_ucp.param_spec import te_fused_names

    gpt = ["decoder.layers.0.self_attention.q_layernorm.weight",  # QK-norm in GPT attention: TE's too
           "decoder.layers.0.self_attention.linear_qkv.weight",
           "decoder.layers.0.pre_mlp_layernorm.weight",
           "decoder.layers.0.mlp.experts.experts.0.linear_fc1.weight"]
    assert te_fused_names(gpt) == {}
    mla = ["mtp.layers.0.transformer_layer.self_attention.linear_kv_down_proj.weight",
           "mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.weight",
           "mtp.layers.0.transformer_layer.self_attention.kv_layernorm.bias",
           "mtp.layers.0.transformer_layer.self_attention.q_layernorm.weight"]  # no q_lora: no q_up_proj
    assert te_fused_names(mla) == {
        "mtp.layers.0.transformer_layer.self_attention.kv_layernorm.bias":
            "mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.layer_norm_bias"}


def test_a_moe_layers_pre_mlp_norm_takes_transformer_engines_name():
    """megatron-core's local GPT spec declares a MoE layer's pre-MLP norm as
    `mlp.linear_fc1.layer_norm_weight` (its keys map renames `pre_mlp_layernorm.` in every layer);
    Transformer Engine's MoE layer keeps `pre_mlp_layernorm`. The universal name is TE's, so the
    two specs load each other's MoE checkpoints; a dense MLP keeps the fused name. Checkpoints of
    earlier megatron-ucp releases, which kept the local spec's name, are read under it."""
    from megatron_ucp.param_spec import legacy_moe_norm_name, te_fused_names

    names = ["decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "decoder.layers.0.mlp.linear_fc1.weight",
             "decoder.layers.1.mlp.linear_fc1.layer_norm_weight", "decoder.layers.1.mlp.router.weight",
             "decoder.layers.1.mlp.experts.experts.0.linear_fc1.weight",
             "mtp.layers.0.transformer_layer.mlp.linear_fc1.layer_norm_weight",
             "mtp.layers.0.transformer_layer.mlp.experts.experts.0.linear_fc2.weight"]
    assert te_fused_names(names) == {
        "decoder.layers.1.mlp.linear_fc1.layer_norm_weight": "decoder.layers.1.pre_mlp_layernorm.weight",
        "mtp.layers.0.transformer_layer.mlp.linear_fc1.layer_norm_weight":
            "mtp.layers.0.transformer_layer.pre_mlp_layernorm.weight"}
    old = {"decoder.layers.1.mlp.linear_fc1.layer_norm_weight": 0}
    assert legacy_moe_norm_name("decoder.layers.1.pre_mlp_layernorm.weight", old) == \
        "decoder.layers.1.mlp.linear_fc1.layer_norm_weight"
    assert legacy_moe_norm_name("decoder.layers.1.pre_mlp_layernorm.weight",
                                {**old, "decoder.layers.1.pre_mlp_layernorm.weight": 0}) is None
    assert legacy_moe_norm_name("decoder.layers.1.pre_mlp_layernorm.weight",
                                {**old, "decoder.layers.1.mlp.linear_fc1.weight": 0}) is None  # dense
