"""Megatron-LM core_v0.19.0's own checkpoints (tests/fixtures/megatron_lm_v019, written by its
unchanged pretrain_gpt.py on CPU) -> universal -> Megatron-LM targets at other layouts.

(1) Every universal tensor of a `--ckpt-format torch` set equals the reference assembled
    independently of megatron-core and megatron_ucp (tests/oracles.py, the flat-buffer rule of
    distrib_optim.pt); torch_dist sets: the model tensors bitwise, fully_reshardable moments from
    `optimizer.state.<state>.<key>`, dp_reshardable moments sliced from the flat buckets by hand.
(2) Written at another layout and format, then read back: the same universal tensors, bitwise.
(3) megatron-core 0.19's own legacy load resumes such a conversion at another layout.

The files pickle megatron-core 0.19 enums in their args (InferenceCudaGraphScope), so they are read
on megatron-core 0.19 (the Makefile's TESTS_MCORE19).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import FULL, READS_CORE_V019_FILES
from helpers import FIXTURE_MODEL, assert_same_tensors
from oracles import (
    assert_dumps_hold,
    assert_holds_universal,
    dist_common,
    dist_iteration,
    dist_shapes,
    dp_reshardable_full,
    fsdp_dtensor_full,
    full_tensor,
    fully_reshardable_full,
    legacy_full,
    load,
    mla_moe_dp_reshardable_full,
    mla_moe_legacy_full,
    torch_dcp_full,
    universal_tensors,
)
from oracles import legacy_reference as reference

from megatron_ucp import formats
from megatron_ucp.conversion import convert, convert_legacy, convert_torch_dist, reshard
from megatron_ucp.layout import Layout
from megatron_ucp.testing.launch import launch

pytestmark = READS_CORE_V019_FILES

FIXTURES = Path(__file__).parent / "fixtures" / "megatron_lm_v019"
LEGACY = ("torch_dp2", "torch_tp2_pp2", "torch_llama_tp2", "torch_moe_ep2")
DIST = ("torch_dist_tp2_dp2", "torch_dist_pp2_fullyreshardable", "torch_dist_llama_tp2",
        "torch_dist_moe_ep2_fully")
FSDP = ("fsdp_dtensor_dp2", "torch_dcp_fsdp2_dp2")  # --ckpt-format fsdp_dtensor / torch_dcp
# the DeepSeek-V3 shape (MLA, first layer dense, sigmoid-routed MoE with expert bias and a shared
# expert, MTP) at PP2 EP1: torch_dist dp_reshardable with q_lora_rank, legacy torch without
DSV3 = ("torch_dist_dsv3_pp2", "torch_dsv3_pp2")
STATES = ("param", "exp_avg", "exp_avg_sq")
ITER = "iter_0000006"


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("v019")
    out = {s: convert_legacy(FIXTURES / s / "ckpt", root / s, progress=False) for s in LEGACY}
    out.update({s: convert_torch_dist(FIXTURES / s / "ckpt", root / s, progress=False) for s in DIST})
    out.update({s: convert(FIXTURES / s / "ckpt", root / s, progress=False) for s in FSDP})
    out.update({s: convert(FIXTURES / s / "ckpt", root / s, progress=False) for s in DSV3})
    return out


@pytest.mark.parametrize("name", LEGACY)
def test_legacy_sets_match_independent_assembly(converted, name):
    manifest, tensors = universal_tensors(converted[name])
    args = load(next((FIXTURES / name / "ckpt" / ITER).iterdir()) / "model_optim_rng.pt")["args"]
    ref = reference(FIXTURES / name / "ckpt")
    assert set(manifest["params"]) == set(ref)
    for pname, copies in ref.items():
        weight = full_tensor(pname, copies["weight"], args.swiglu)
        assert manifest["params"][pname]["step"] == 6.0 and copies["step"] == {6.0}, pname
        for state in STATES:
            got = tensors[f"{pname}/{state}"]
            assert torch.equal(got, full_tensor(pname, copies[state], args.swiglu)), f"{pname}/{state}"
        assert torch.equal(tensors[f"{pname}/param"].to(weight.dtype), weight), pname
    assert manifest["iteration"] == 6 and manifest["scheduler"]["num_steps"] == 24


@pytest.mark.parametrize("name", DIST)
def test_dist_sets_match_the_stored_tensors(converted, name):
    manifest, tensors = universal_tensors(converted[name])
    ckpt = FIXTURES / name / "ckpt" / ITER
    common = dist_common(ckpt)
    sharding = common["content_metadata"]["distrib_optim_sharding_type"]
    assert sharding == ("fully_reshardable" if "fully" in name else "dp_reshardable")
    params = manifest["params"]
    if sharding == "fully_reshardable":
        full = fully_reshardable_full(ckpt, list(params))
    else:
        full = dp_reshardable_full(ckpt, {n: tuple(p["shape"]) for n, p in params.items()})
    assert set(full) == set(params)
    for n, states in full.items():
        assert params[n]["step"] == 6.0, n
        assert torch.equal(tensors[f"{n}/param"].to(torch.bfloat16), states["model"]), n  # bitwise
        for s in STATES:
            assert torch.equal(tensors[f"{n}/{s}"], states[s]), (n, s)
    assert manifest["iteration"] == 6 and manifest["scheduler"]["num_steps"] == 24
    if name == "torch_dist_tp2_dp2":
        assert set(dist_shapes(ckpt)) == set(params) - {"output_layer.weight"}


@pytest.mark.parametrize("name", FSDP)
def test_fsdp_sets_match_the_stored_tensors(converted, name):
    """Megatron-FSDP's fsdp_dtensor save (fp32 main weights and Adam state named per parameter)
    and torch FSDP2's torch_dcp save (state by position in the param groups): every universal
    tensor is the stored one, bitwise; torch_dcp's master weights cast to bf16 are its model."""
    ckpt = FIXTURES / name / "ckpt" / ITER
    assert formats.detect(FIXTURES / name / "ckpt") == "megatron_fsdp"
    manifest, tensors = universal_tensors(converted[name])
    full = fsdp_dtensor_full(ckpt) if name.startswith("fsdp") else torch_dcp_full(ckpt, layers=3)
    assert set(full) == set(manifest["params"])
    for n, states in full.items():
        assert manifest["params"][n]["step"] == states["step"] == 6.0, n
        for s in STATES:
            assert torch.equal(tensors[f"{n}/{s}"], states[s]), (n, s)
        if "model" in states:
            assert torch.equal(tensors[f"{n}/param"].to(torch.bfloat16), states["model"]), n
    assert manifest["iteration"] == 6 and manifest["scheduler"]["num_steps"] == 24
    assert [g["wd_mult"] for g in manifest["optimizer"]["param_groups"]] == [1.0, 0.0]


def dsv3_full(ckpt: Path) -> dict[str, dict]:
    """tests/oracles.py's hand assembly of a DeepSeek-V3-shape save (either format)."""
    if (dist_iteration(ckpt) / ".metadata").exists():
        return mla_moe_dp_reshardable_full(ckpt)
    return mla_moe_legacy_full(ckpt)


# what makes each set the DeepSeek-V3 shape (universal names: MLA's latent norms fused into the
# up projections as in the TE spec; layer 0 dense, layers 1-2 and the MTP layer MoE)
DSV3_EXPECTED = {
    "torch_dist_dsv3_pp2": [
        "decoder.layers.0.self_attention.linear_q_down_proj.weight",
        "decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight",
        "decoder.layers.2.self_attention.linear_kv_up_proj.layer_norm_weight",
        "mtp.layers.0.transformer_layer.self_attention.linear_q_up_proj.weight"],
    "torch_dsv3_pp2": ["decoder.layers.0.self_attention.linear_q_proj.weight",
                       "mtp.layers.0.transformer_layer.self_attention.linear_q_proj.weight"],
}
DSV3_COMMON = ["decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
               "decoder.layers.1.pre_mlp_layernorm.weight", "decoder.layers.1.mlp.router.expert_bias",
               "decoder.layers.2.mlp.experts.experts.3.linear_fc2.weight",
               "decoder.layers.2.mlp.shared_experts.linear_fc1.weight",
               "decoder.layers.1.self_attention.linear_kv_down_proj.weight",
               "mtp.layers.0.eh_proj.weight", "mtp.layers.0.transformer_layer.mlp.router.expert_bias",
               "mtp.layers.0.transformer_layer.mlp.experts.experts.0.linear_fc1.weight",
               "output_layer.weight"]


@pytest.mark.parametrize("name", DSV3)
def test_dsv3_sets_match_independent_assembly(converted, name):
    """Every universal tensor (master weight, both Adam moments; the routers' fp32 expert_bias
    buffers: their value) is the fixture's own optimizer state, bitwise, assembled by hand from
    its flat buffers (tests/oracles.py: registration order, 64-element starts, the embedding that
    the first and the MTP stage share in a bucket of its own); its bf16 model tensor is the master
    cast. megatron-core keeps the experts of an EP1 run in the dense buffers, which the reader
    maps (it refused every MoE dp_reshardable save before)."""
    full = dsv3_full(FIXTURES / name / "ckpt")
    manifest, _ = universal_tensors(converted[name])
    params = manifest["params"]
    buffers = [n for n, p in params.items() if p.get("buffer")]
    assert len(buffers) == 3  # layers 1, 2 and the MTP layer
    assert assert_holds_universal(full, converted[name], torch.bfloat16) == 3 * len(full) - 2 * len(buffers)
    for n in DSV3_EXPECTED[name] + DSV3_COMMON:
        assert n in params, n
    assert {p["step"] for n, p in params.items() if n not in buffers} == {6.0}
    assert manifest["iteration"] == 6 and manifest["scheduler"]["num_steps"] == 24
    model = manifest["model"]
    assert (model["multi_latent_attention"], model["kv_lora_rank"], model["qk_head_dim"],
            model["qk_pos_emb_head_dim"], model["v_head_dim"], model["rope_type"]) == \
        (True, 16, 8, 8, 8, "yarn")
    assert model["q_lora_rank"] == (16 if "dist" in name else None)
    assert (model["moe_layer_freq"], model["moe_router_score_function"], model["mtp_num_layers"],
            model["moe_router_enable_expert_bias"]) == ([0, 1, 1], "sigmoid", 1, True)


# (set, target format, layout, torch_dist optimizer form): the other format at another layout;
# the EP1 MoE targets keep the experts in the dense buffers, one DistributedOptimizer; at EP2 they
# get the expert optimizer, whose param groups the EP1 run never had (the dense ones, for experts)
DSV3_TRIPS = [("torch_dist_dsv3_pp2", "torch", Layout(tp=1, pp=1, dp=2), None),
              ("torch_dist_dsv3_pp2", "torch_dist", Layout(tp=2, pp=1, dp=1), "fully_reshardable"),
              ("torch_dsv3_pp2", "torch_dist", Layout(tp=1, pp=1, dp=2), "dp_reshardable"),
              ("torch_dsv3_pp2", "torch_dist", Layout(tp=1, pp=1, dp=2, ep=2), "fully_reshardable")]


@pytest.mark.parametrize("src,fmt,lay,sharding", DSV3_TRIPS,
                         ids=lambda v: str(v) if isinstance(v, (str, Layout)) else "")
def test_dsv3_written_at_another_layout_reads_back_bitwise(converted, tmp_path, src, fmt, lay, sharding):
    out = tmp_path / "out"
    reshard(FIXTURES / src / "ckpt", out, lay, fmt, progress=False, optim_sharding=sharding)
    again = convert(out, tmp_path / "u", progress=False)
    m1, t1 = universal_tensors(converted[src])
    m2, t2 = universal_tensors(again)
    assert (m2["layout"]["tp"], m2["layout"]["pp"], m2["layout"]["dp"], m2["layout"]["ep"]) == \
        (lay.tp, lay.pp, lay.dp, lay.ep)
    assert_same_tensors(t1, t2)
    assert {n: p["step"] for n, p in m2["params"].items()} == {n: p["step"] for n, p in m1["params"].items()}
    if lay.tp == lay.ep == 1:  # the written files by hand too (the oracles read TP1 EP1)
        assert assert_holds_universal(dsv3_full(out), converted[src], torch.bfloat16) > 0
    if fmt == "torch_dist":
        (common,) = [load(p) for p in (out / ITER).glob("common.pt")]
        assert common["content_metadata"]["distrib_optim_sharding_type"] == sharding
        opt = common["optimizer"]
        if lay.ep == 1:  # one optimizer: at EP1 megatron-core builds no expert optimizer
            assert not any(isinstance(k, int) for k in opt), sorted(opt)
        else:  # ChainedOptimizer {0: dense, 1: expert}; the expert groups: the dense hyper-parameters
            dense, expert = (opt[i]["optimizer"]["param_groups"] for i in (0, 1))
            flags = [g["is_expert_parallel"] for g in dense + expert]
            assert flags == [False] * len(dense) + [True] * len(dense)
            assert [{**g, "is_expert_parallel": False} for g in expert] == dense


@pytest.mark.parametrize("change,words", [
    ({"tensor_model_parallel_size": 2, "data_parallel_size": 1}, "only data-parallel FSDP runs"),
    ({"swiglu": True}, "--swiglu"), ({"num_experts": 4}, "MoE")])
def test_fsdp_runs_not_covered_are_refused_with_the_way_out(change, words):
    import argparse

    from megatron_ucp.errors import UCPError
    from megatron_ucp.formats.megatron_fsdp.reader import open_reader, training_args

    reader, _, form = open_reader(FIXTURES / "fsdp_dtensor_dp2" / "ckpt", trust_pickle=False)
    args = argparse.Namespace(**{**vars(reader.obj("args")), **change})
    with pytest.raises(UCPError, match=words) as e:
        training_args(args, reader.dir, form)
    assert "--ckpt-format fsdp_dtensor" in str(e.value) and "--ckpt-format torch_dist" in str(e.value)


def test_cli_inspects_the_fsdp_sets(capsys):
    from megatron_ucp.cli import main

    for name, form in zip(FSDP, ("fsdp_dtensor", "torch_dcp")):
        assert main(["inspect", str(FIXTURES / name / "ckpt")]) == 0
        out = capsys.readouterr().out
        assert "kind         megatron_fsdp" in out and "iteration    6" in out, out
        assert "saved at     TP1xPP1xDP2 (2 ranks)" in out, out
        assert "decoder.layers.2.self_attention.linear_qkv.weight" in out, (form, out)


# (source set, target format, target layout, optimizer sharding of a torch_dist target)
ROUND_TRIPS = [
    # TP1 -> TP2: 0.19's args carry tensor_parallel_num_weight_shards, which must follow the TP
    ("torch_dp2", "torch", Layout(tp=2, pp=1, dp=1), None),
    ("torch_tp2_pp2", "torch_dist", Layout(tp=1, pp=1, dp=2), "dp_reshardable"),
    ("torch_dist_tp2_dp2", "torch", Layout(tp=1, pp=3, dp=1), None),
    ("torch_dist_llama_tp2", "torch", Layout(tp=1, pp=1, dp=2), None),
    ("torch_llama_tp2", "torch_dist", Layout(tp=1, pp=1, dp=2), "fully_reshardable"),
    ("torch_moe_ep2", "torch_dist", Layout(tp=1, pp=1, dp=4, ep=4), "fully_reshardable"),
    ("fsdp_dtensor_dp2", "torch_dist", Layout(tp=2, pp=1, dp=1), "fully_reshardable"),
    ("torch_dcp_fsdp2_dp2", "torch", Layout(tp=2, pp=1, dp=1), None),
    # 4 ranks rebuilt for the MoE target: ~25 s on 2 cores, so in the full matrix only
    pytest.param("torch_dist_moe_ep2_fully", "torch", Layout(tp=1, pp=1, dp=4, ep=4), None,
                 marks=pytest.mark.skipif(not FULL, reason="UCP_FULL_MATRIX=1 runs it")),
]


@pytest.mark.parametrize("src,fmt,lay,sharding", ROUND_TRIPS,
                         ids=lambda v: str(v) if isinstance(v, (str, Layout)) else "")
def test_written_at_another_layout_reads_back_bitwise(converted, tmp_path, src, fmt, lay, sharding):
    out, m1, t1 = written_back(FIXTURES / src / "ckpt", converted[src], tmp_path, fmt, lay, sharding)
    if fmt == "torch":  # the written files by hand, too
        for rank_dir in (out / ITER).iterdir():
            args = load(rank_dir / "model_optim_rng.pt")["args"]
            assert args.tensor_model_parallel_size == lay.tp
            assert args.tensor_parallel_num_weight_shards == lay.tp * args.gtp_weight_remat_size
        full = legacy_full(out)
        assert set(full) == set(m1["params"])
        assert all(torch.equal(full[n][s], t1[f"{n}/{s}"]) for n in full for s in STATES)


def written_back(ckpt: Path, universal: Path, tmp_path: Path, fmt: str, lay: Layout,
                 sharding: str | None) -> tuple[Path, dict, dict]:
    """`ckpt` written as `fmt` at `lay` and converted back: its universal tensors must be those of
    `universal` (the fixture's conversion) bitwise, at the written layout and Adam step 6. Returns
    (the written checkpoint, the fixture's universal manifest and tensors)."""
    out = tmp_path / "out"
    reshard(ckpt, out, lay, fmt, progress=False, optim_sharding=sharding)
    again = (convert_legacy if fmt == "torch" else convert_torch_dist)(out, tmp_path / "u", progress=False)
    m1, t1 = universal_tensors(universal)
    m2, t2 = universal_tensors(again)
    assert [m2["layout"][k] for k in ("tp", "pp", "dp", "ep")] == [lay.tp, lay.pp, lay.dp, lay.ep]
    assert_same_tensors(t1, t2)
    assert {p["step"] for p in m2["params"].values()} == {6.0}
    return out, m1, t1


def test_megatron_core_019_resumes_a_conversion_at_another_layout(converted, tmp_path):
    """core_v0.19.0's torch_dist TP2 DP2 run -> `--ckpt-format torch` at TP1 DP2 -> megatron-core
    0.19's own legacy load (optimizer.load_state_dict, load_parameter_state): every loaded weight,
    master weight, moment and step is the universal one, and it trains on."""
    src = FIXTURES / "torch_dist_tp2_dp2" / "ckpt"
    out = tmp_path / "out"
    reshard(src, out, Layout(tp=1, pp=1, dp=2), "torch", progress=False)
    args = dist_common(src)["args"]
    cfg = {**FIXTURE_MODEL, "min_lr": args.min_lr, "extra": {"add_qkv_bias": True}}
    from test_megatron_legacy_out import RANK_PATH

    res = launch(2, "tests.test_megatron_legacy_out:load_legacy_rank",
                 {"layout": "tp1pp1dp2", "cfg": cfg, "load_dir": str(out),
                  "dump_dir": str(tmp_path / "dump")}, timeout=300, env={"PYTHONPATH": RANK_PATH})
    assert all(r["iteration"] == 6 and r["num_steps"] == 28 for r in res), res
    assert all(lr == 1e-3 for r in res for lr in r["lr"])
    assert all(math.isfinite(r["loss"]) and r["loss"] < 6.0 for r in res), res
    manifest, tensors = universal_tensors(converted["torch_dist_tp2_dp2"])
    assert_dumps_hold(tmp_path / "dump", manifest, tensors, None, ranks=2)
