"""Hybrid Mamba models (Nemotron-H, Jamba style: megatron-core's MambaModel, Mamba-2 layers among
attention, MLP and MoE layers) on megatron-core's own classes (CPU, gloo): save at one layout, load
at another, every model and optimizer tensor bitwise against the independent reassembly
(tests/reference.py), the universal round trip and loss continuity (test_transitions.check_transition).

Mamba's in_proj (z, x, B, C, dt) and conv1d (x, B, C) are declared in sections each split over TP
on its own; A_log, D, dt_bias and the gated norm split with the heads. On CPU the Mamba math is
megatron_ucp.testing.mamba_cpu (mamba_ssm's and causal_conv1d's pure-PyTorch reference). Runs on
megatron-core 0.16 and 0.19 (the Makefile's TESTS_MCORE19), whose Mamba mixers declare the same
sharded keys.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SCENARIOS
from test_transitions import FULL_MARKS, RTOL, check_transition

from megatron_ucp.errors import UCPError
from megatron_ucp.testing.launch import launch
from megatron_ucp.validation import check_model_config

SP = {"sequence_parallel": True}  # megatron-core's MoE wants sequence parallelism with TP > 1
MAMBA = {"mamba_state_dim": 8, "mamba_head_dim": 16, "mamba_num_groups": 2}
# hidden 64, expand 2: d_inner 128 = 8 heads of 16; 2 groups of state size 8. Each pipeline stage
# of PP2 holds a Mamba and an MoE layer.
HYBRID = {"hybrid_pattern": "M*E-ME", "normalization": "RMSNorm", "add_bias_linear": False,
          "untie_embeddings": True, "position_embedding_type": "none", "num_experts": 4, "extra": MAMBA}

CASES = [
    # source layout, target layout, source cfg, target cfg (None: same)
    ("pp2", "tp2", HYBRID, {**HYBRID, **SP}),
    ("tp2", "dp2", {**HYBRID, **SP}, HYBRID),
    ("dp2", "ep2dp2", HYBRID, None),
]
# `make test` runs the first (the suite's time budget: about two minutes on 2 cores); UCP_FULL_MATRIX=1 all
FULL_ONLY = {("tp2", "dp2"), ("dp2", "ep2dp2")}


@pytest.mark.parametrize("src,dst,cfg,dst_cfg", [
    pytest.param(*c, id=f"{c[0]}->{c[1]}", marks=FULL_MARKS if c[:2] in FULL_ONLY else []) for c in CASES])
def test_hybrid_transition(src, dst, cfg, dst_cfg, source_runs, tmp_path):
    check_transition(source_runs, tmp_path, src, dst, cfg, dst_cfg, rtol=RTOL["fp32"],
                     name=f"hybrid-mamba:{src}->{dst}")
    # the manifest records which layer is what and the Mamba sizes (a load checks them)
    ckpt = Path(source_runs.get(src, cfg)["ckpt"])
    model = json.loads(next(ckpt.glob("iter_*/manifest.json")).read_text())["model"]
    assert model["hybrid_layer_pattern"] == cfg["hybrid_pattern"]
    assert {k: model[k] for k in MAMBA} == MAMBA


def test_another_hybrid_pattern_is_refused():
    with pytest.raises(UCPError, match="hybrid_layer_pattern: checkpoint 'M\\*-E', model 'M-\\*E'"):
        check_model_config({"hybrid_layer_pattern": "M*-E"}, {"hybrid_layer_pattern": "M-*E"}, "ckpt")


def test_pipeline_cuts_of_a_hybrid_pattern_are_layout():
    """Megatron-LM 0.19 cuts a hybrid model's pipeline stages at the `|`s of its pattern; the
    same layers at another PP have the pattern without them. The model is the same, so a
    checkpoint of `M*-|ME` (PP2) loads into `M*-ME` (PP1) and back; other layers are refused."""
    check_model_config({"hybrid_layer_pattern": "M*-|ME"}, {"hybrid_layer_pattern": "M*-ME"}, "ckpt")
    check_model_config({"hybrid_layer_pattern": "M*-ME"}, {"hybrid_layer_pattern": "M*|-ME"}, "ckpt")
    with pytest.raises(UCPError, match=r"hybrid_layer_pattern: checkpoint 'M\*-\|ME', model 'M\*-EM'"):
        check_model_config({"hybrid_layer_pattern": "M*-|ME"}, {"hybrid_layer_pattern": "M*-EM"}, "ckpt")


def test_mamba_sections_and_per_head_params():
    """megatron-core's Mamba mixer declares in_proj as sections z, x, B, C, dt and conv1d as x, B,
    C, each split over TP on its own (keys `in_proj.weight.z`, ...), and marks conv1d, A_log, D,
    dt_bias and the gated norm `tensor_model_parallel` without a `partition_dim`. Each is one
    universal tensor, the whole parameter as TP 1 holds it, with its sections recorded."""
    cfg = {"hybrid_pattern": "M", "normalization": "RMSNorm", "add_bias_linear": False,
           "position_embedding_type": "none", "extra": MAMBA}
    res = launch(2, f"{SCENARIOS}:param_specs", {"layout": "tp2", "cfg": cfg})
    specs = {s["name"]: s for s in res[0]}
    for s in res[1]:  # TP rank 1 (canonical for the TP-split tensors) derives the same specs
        assert specs[s["name"]] == s
    assert specs["decoder.layers.0.mixer.in_proj.weight"] in res[1]
    mixer = "decoder.layers.0.mixer."
    # hidden 64, expand 2: d_inner 128 = 8 heads of 16; 2 groups of state 8
    want = {"in_proj.weight": ([296, 64], 0, [128, 128, 16, 16, 8]),
            "conv1d.weight": ([160, 1, 4], 0, [128, 16, 16]), "conv1d.bias": ([160], 0, [128, 16, 16]),
            "A_log": ([8], 0, None), "D": ([8], 0, None), "dt_bias": ([8], 0, None),
            "norm.weight": ([128], 0, None), "out_proj.weight": ([64, 128], 1, None),
            # the layer's input norm under the TE spec's name (TELayerNormColumnParallelLinear)
            "in_proj.layer_norm_weight": ([64], None, None)}
    for k, (shape, axis, sections) in want.items():
        s = specs[mixer + k]
        assert (s["shape"], s["tp_axis"], s.get("tp_sections")) == (shape, axis, sections), k
    assert not [n for n in specs if n.endswith((".z", ".x", ".B", ".C", ".dt"))]
