"""Megatron-LM torch_dist checkpoints of the model families labs train now, written by stock
Megatron-LM core_v0.16.1 (tests/fixtures/megatron_lm/README.md): Qwen3-MoE (QK-norm, GQA, EP2),
DeepSeek-style MoE (first layer dense, sigmoid router with expert bias, gated shared expert, top-k
scaling, narrower expert FFN) and MTP (one multi-token prediction layer on the last of 2 stages);
and the DeepSeek-V3 shape (MLA with q LoRA and latent norms, the DeepSeek-style MoE at EP1, MTP, PP2;
dp_reshardable), written with megatron_ucp.testing.mla_attention's core attention (local MLA).

(1) Read: every universal tensor (master weight, both Adam moments) equals the fixture's own
    `optimizer.state.<state>.<key>[stacked index]` bitwise, and its bf16 model tensor equals the
    master cast to bf16 (tests/oracles.py reads the files with torch.distributed.checkpoint alone;
    it also asserts the checkpoint holds no tensor the universal names do not account for).
(2) Written back as torch_dist at another layout: the hand assembly of the written files holds
    the universal tensors, and reading them back gives the first universal bitwise.
Single process, a few seconds each (the model is rebuilt on a fake process group, meta tensors).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_same_tensors
from oracles import (
    assert_holds_universal,
    fully_reshardable_full,
    mla_moe_dp_reshardable_full,
    universal_tensors,
)
from test_megatron_dist_out import assert_same_universal, common

from megatron_ucp.conversion import convert, convert_torch_dist, reshard
from megatron_ucp.layout import Layout

FIXTURES = Path(__file__).parent / "fixtures" / "megatron_lm"
# family -> (fixture, target layout of the export, its expert TP, its first-stage layers)
FAMILIES = {
    "qwen3-moe": ("torch_dist_qwen3moe_ep2_fully", Layout(tp=2, ep=2, dp=1), 1, None),
    "deepseek-moe": ("torch_dist_dsmoe_ep2_fully", Layout(pp=2, ep=2, dp=2), None, 1),
    "mtp": ("torch_dist_mtp_pp2_fully", Layout(tp=2, dp=1), None, None),
}


class Converted(dict):
    """family -> its fixture converted to universal, on first use."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def __missing__(self, family: str) -> Path:
        self[family] = convert_torch_dist(FIXTURES / FAMILIES[family][0] / "ckpt", self.root / family,
                                          progress=False)
        return self[family]


@pytest.fixture(scope="module")
def universal(tmp_path_factory) -> Converted:
    return Converted(tmp_path_factory.mktemp("families"))


# parameters that make each family what it is (the universal names; the layer-1 entries of the
# DeepSeek-style run are MoE, its layer 0 dense)
EXPECTED = {
    "qwen3-moe": ["decoder.layers.0.self_attention.q_layernorm.weight",
                  "decoder.layers.2.self_attention.k_layernorm.weight",
                  "decoder.layers.1.mlp.experts.experts.3.linear_fc1.weight", "output_layer.weight"],
    "deepseek-moe": ["decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.1.mlp.router.expert_bias",
                     "decoder.layers.1.mlp.shared_experts.gate_weight",
                     "decoder.layers.2.mlp.shared_experts.linear_fc2.weight",
                     "decoder.layers.2.mlp.experts.experts.0.linear_fc2.weight"],
    "mtp": ["mtp.layers.0.eh_proj.weight", "mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight",
            "mtp.layers.0.final_layernorm.weight",
            "mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight", "output_layer.weight"],
}


def oracle(ckpt: Path, manifest: dict) -> dict[str, dict]:
    """tests/oracles.py's hand assembly of a fully_reshardable checkpoint; layers that differ
    (moe_layer_freq) are stored per layer, not stacked."""
    args = common(ckpt)["args"]
    freq = getattr(args, "moe_layer_freq", 1)
    stacked = not (isinstance(freq, list) and len(set(freq)) > 1)
    buffers = tuple(n for n, p in manifest["params"].items() if p.get("buffer"))
    return fully_reshardable_full(ckpt, list(manifest["params"]), buffers, stacked_layers=stacked)


@pytest.mark.parametrize("family", FAMILIES)
def test_read_is_bitwise(universal, family):
    ckpt = FIXTURES / FAMILIES[family][0] / "ckpt"
    manifest, _ = universal_tensors(universal[family])
    full = oracle(ckpt, manifest)
    buffers = [n for n, p in manifest["params"].items() if p.get("buffer")]
    assert assert_holds_universal(full, universal[family], torch.bfloat16) == \
        3 * len(full) - 2 * len(buffers)
    for name in EXPECTED[family]:
        assert name in manifest["params"], name
    assert {p["step"] for p in manifest["params"].values() if not p.get("buffer")} == {6.0}
    assert manifest["iteration"] == 6 and manifest["scheduler"]["num_steps"] == 24


@pytest.mark.parametrize("family", FAMILIES)
def test_written_at_another_layout_back_to_universal_is_bitwise(universal, family, tmp_path):
    name, target, etp, first = FAMILIES[family]
    out = tmp_path / "out"
    reshard(FIXTURES / name / "ckpt", out, target, target_format="torch_dist",
            expert_tensor_parallel=etp, first_stage_layers=first, progress=False)
    args = common(out)["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.expert_model_parallel_size, args.data_parallel_size) == \
        (target.tp, target.pp, target.ep, target.dp)
    manifest, _ = universal_tensors(universal[family])
    full = oracle(out, manifest)
    for n, p in manifest["params"].items():  # Megatron-LM keeps the router's expert_bias in fp32
        assert full[n]["model"].dtype == (torch.float32 if p.get("buffer") else torch.bfloat16), n
    assert_holds_universal(full, universal[family], torch.bfloat16)
    again = convert_torch_dist(out, tmp_path / "u2", progress=False)
    assert_same_universal(universal[family], again, target)


DSV3 = FIXTURES / "torch_dist_dsv3_pp2" / "ckpt"


@pytest.mark.parametrize("fmt,lay,sharding", [("torch", Layout(dp=2), None),
                                              ("torch_dist", Layout(ep=2, dp=2), "fully_reshardable")],
                         ids=["torch-dp2", "torch_dist-ep2dp2"])
def test_dsv3_read_bitwise_and_written_at_another_layout(tmp_path, fmt, lay, sharding):
    """core_v0.16.1's DeepSeek-V3-shape save (dp_reshardable; EP1, so the experts are in the dense
    buffers): every universal tensor is tests/oracles.py's hand assembly of its flat buckets; the
    conversion to the other format at DP2 / EP2 (its expert optimizer's groups: the dense ones)
    reads back bitwise."""
    u1 = convert_torch_dist(DSV3, tmp_path / "u1", progress=False)
    full = mla_moe_dp_reshardable_full(DSV3)
    manifest, _ = universal_tensors(u1)
    buffers = [n for n, p in manifest["params"].items() if p.get("buffer")]
    assert len(buffers) == 3 and assert_holds_universal(full, u1, torch.bfloat16) == 3 * len(full) - 6
    assert "decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight" in manifest["params"]
    assert manifest["model"]["q_lora_rank"] == 16 and manifest["model"]["mtp_num_layers"] == 1
    out = tmp_path / "out"
    reshard(DSV3, out, lay, fmt, progress=False, optim_sharding=sharding)
    m2, t2 = universal_tensors(convert(out, tmp_path / "u2", progress=False))
    _, t1 = universal_tensors(u1)
    assert_same_tensors(t1, t2)
    assert {n: p["step"] for n, p in m2["params"].items()} == \
        {n: p["step"] for n, p in manifest["params"].items()}
    groups = m2["optimizer"]["param_groups"]  # EP2: the expert optimizer's, the dense copied
    dense = [g for g in groups if g["optimizer"] == 0]
    assert [{**g, "optimizer": 0, "is_expert_parallel": False} for g in groups if g["optimizer"] == 1] \
        == (dense if lay.ep > 1 else [])
    assert dense == manifest["optimizer"]["param_groups"]
