"""Megatron-LM checkpoints of the GPT-OSS shape and of Qwen3 (dense), written by stock Megatron-LM
core_v0.19.0 on CPU (tests/fixtures/megatron_lm_v019/README.md, "Model families"):

* GPT-OSS: learnable attention sinks, a sliding window on every other layer, YaRN RoPE, the
  clamped SwiGLU (quick GEGLU), GQA with biases, every layer MoE with biases on the experts and the
  router, EP2 (`torch_dist` dp_reshardable and fully_reshardable, `--ckpt-format torch`); the
  same attention with a dense MLP at TP2 (the sinks split over TP; torch_dist dp_reshardable,
  Megatron-LM's default) and at DP2 (`--ckpt-format torch`);
* Qwen3: QK-norm, GQA, SwiGLU, no biases, TP2 (torch_dist dp_reshardable).

(1) Read: every universal tensor (master weight, both Adam moments) equals the fixture's own
    optimizer state bitwise and its bf16 model tensor is the master cast to bf16 (tests/oracles.py
    assembles the files by hand; the MoE dp_reshardable set: the same run's fully_reshardable
    files, see SAME_RUN); the manifest records what makes the family what it is.
(2) Written at another layout as torch_dist and as torch: the hand assembly of the written files
    holds the universal tensors, and reading them back gives the first universal bitwise.

Fixtures pickle megatron-core 0.19 enums in their args: run on megatron-core 0.19 (TESTS_MCORE19).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import READS_CORE_V019_FILES, REPORT
from helpers import assert_same_tensors
from oracles import (
    assert_holds_universal,
    dist_common,
    dp_reshardable_full,
    fully_reshardable_full,
    legacy_full,
    universal_tensors,
)

from megatron_ucp.conversion import convert_legacy, convert_torch_dist, reshard
from megatron_ucp.formats.megatron_common import YARN_FROM_ARGS
from megatron_ucp.layout import Layout

pytestmark = READS_CORE_V019_FILES

FIXTURES = Path(__file__).parent / "fixtures" / "megatron_lm_v019"
SETS = ("torch_dist_gptoss_ep2_fully", "torch_gptoss_ep2", "torch_dist_gptoss_ep2",
        "torch_dist_gptoss_dense_tp2", "torch_gptoss_dense_dp2", "torch_dist_qwen3_tp2")
OSS_ATTENTION = ["decoder.layers.0.self_attention.core_attention.softmax_offset",
                 "decoder.layers.3.self_attention.linear_qkv.bias",
                 "decoder.layers.2.self_attention.linear_proj.bias", "output_layer.weight"]
EXPECTED = {  # parameters that make each family what it is (universal names)
    "torch_dist_gptoss_ep2_fully": OSS_ATTENTION + [
        "decoder.layers.1.mlp.router.bias", "decoder.layers.3.mlp.experts.experts.3.linear_fc1.bias",
        "decoder.layers.0.mlp.experts.experts.2.linear_fc2.bias"],
    "torch_dist_gptoss_dense_tp2": OSS_ATTENTION + ["decoder.layers.1.mlp.linear_fc1.bias"],
    "torch_dist_qwen3_tp2": ["decoder.layers.0.self_attention.q_layernorm.weight",
                             "decoder.layers.2.self_attention.k_layernorm.weight", "output_layer.weight"],
}
EXPECTED["torch_gptoss_ep2"] = EXPECTED["torch_dist_gptoss_ep2"] = EXPECTED["torch_dist_gptoss_ep2_fully"]
EXPECTED["torch_gptoss_dense_dp2"] = EXPECTED["torch_dist_gptoss_dense_tp2"]
OSS_CONFIG = {"softmax_type": "learnable", "window_size": [7, 0], "window_attn_skip_freq": 2,
              "position_embedding_type": "yarn", "yarn_rotary_scaling_factor": 4.0,
              "yarn_original_max_position_embeddings": 8, "glu_linear_offset": 1.0,
              "activation_func_clamp_value": 7.0, "add_bias_linear": True,
              "activation_func": "megatron.core.fusions.fused_bias_geglu.quick_gelu"}
CONFIG = {"torch_dist_gptoss_ep2_fully": OSS_CONFIG, "torch_gptoss_ep2": OSS_CONFIG,
          "torch_dist_gptoss_ep2": OSS_CONFIG,
          "torch_dist_gptoss_dense_tp2": OSS_CONFIG, "torch_gptoss_dense_dp2": OSS_CONFIG,
          "torch_dist_qwen3_tp2": {"qk_layernorm": True, "num_query_groups": 2, "add_bias_linear": False}}


class Converted(dict):
    """set -> its fixture converted to universal, on first use."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def __missing__(self, name: str) -> Path:
        read = convert_legacy if name.startswith("torch_") and not name.startswith("torch_dist") \
            else convert_torch_dist
        self[name] = read(FIXTURES / name / "ckpt", self.root / name, progress=False)
        return self[name]


@pytest.fixture(scope="module")
def universal(tmp_path_factory) -> Converted:
    return Converted(tmp_path_factory.mktemp("families019"))


# the MoE run saved with the dp_reshardable optimizer (a ChainedOptimizer's `chained_0.` dense and
# `chained_1.` expert buckets, which tests/oracles.py does not slice): the same run (flags, seed,
# data; the same six losses) was saved in the fully_reshardable form, whose files are assembled by
# hand instead: every tensor must be equal, bitwise
SAME_RUN = {"torch_dist_gptoss_ep2": "torch_dist_gptoss_ep2_fully"}


def hand_assembly(ckpt: Path, manifest: dict) -> dict[str, dict]:
    """tests/oracles.py's assembly of a Megatron-LM checkpoint of either format and form."""
    if not (Path(ckpt) / "iter_0000006").exists() or any(
            (Path(ckpt) / "iter_0000006").glob("mp_rank_*")):
        return legacy_full(ckpt)
    sharding = dist_common(ckpt)["content_metadata"]["distrib_optim_sharding_type"]
    if sharding == "fully_reshardable":
        return fully_reshardable_full(ckpt, list(manifest["params"]))
    return dp_reshardable_full(ckpt, {n: tuple(p["shape"]) for n, p in manifest["params"].items()})


@pytest.mark.parametrize("name", SETS)
def test_read_is_bitwise(universal, name):
    manifest, tensors = universal_tensors(universal[name])
    full = hand_assembly(FIXTURES / SAME_RUN.get(name, name) / "ckpt", manifest)
    assert set(full) == set(manifest["params"])
    assert assert_holds_universal(full, universal[name], torch.bfloat16) == 3 * len(full)
    for n in EXPECTED[name]:
        assert n in manifest["params"], n
    for key, value in CONFIG[name].items():
        assert manifest["model"][key] == value, key
    assert {p["step"] for p in manifest["params"].values()} == {6.0}
    assert manifest["iteration"] == 6 and manifest["scheduler"]["num_steps"] == 24
    if name != "torch_dist_qwen3_tp2":  # the sinks, the expert and router biases were trained
        for n in EXPECTED[name]:
            assert tensors[f"{n}/exp_avg_sq"].abs().min() > 0, n


# (set, target format, target layout, expert TP, optimizer sharding of a torch_dist target)
TARGETS = [
    # the sinks from DP to TP2 (MoE at TP2 with expert TP1, as GPT-OSS's expert biases want)
    ("torch_dist_gptoss_ep2_fully", "torch_dist", Layout(tp=2, dp=1), 1, "fully_reshardable"),
    ("torch_gptoss_ep2", "torch", Layout(tp=1, dp=2), None, None),  # EP2 -> EP1
    ("torch_dist_gptoss_ep2", "torch", Layout(tp=1, dp=2, ep=2), None, None),
    # the sinks from TP2 to DP2, both formats
    ("torch_dist_gptoss_dense_tp2", "torch", Layout(tp=1, dp=2), None, None),
    ("torch_dist_gptoss_dense_tp2", "torch_dist", Layout(tp=1, dp=2), None, "dp_reshardable"),
    ("torch_gptoss_dense_dp2", "torch_dist", Layout(tp=2, dp=1), None, "dp_reshardable"),
    ("torch_dist_qwen3_tp2", "torch", Layout(tp=1, dp=2), None, None),
]


@pytest.mark.parametrize("name,fmt,target,etp,sharding", TARGETS,
                         ids=lambda v: str(v) if isinstance(v, (str, Layout)) else "")
def test_written_at_another_layout_reads_back_bitwise(universal, tmp_path, name, fmt, target, etp, sharding):
    out = tmp_path / "out"
    reshard(FIXTURES / name / "ckpt", out, target, target_format=fmt, expert_tensor_parallel=etp,
            optim_sharding=sharding, progress=False)
    manifest, tensors = universal_tensors(universal[name])
    full = hand_assembly(out, manifest)
    assert set(full) == set(manifest["params"])
    assert_holds_universal(full, universal[name], torch.bfloat16)
    again = (convert_legacy if fmt == "torch" else convert_torch_dist)(out, tmp_path / "u2", progress=False)
    m2, t2 = universal_tensors(again)
    assert (m2["layout"]["tp"], m2["layout"]["ep"], m2["layout"]["dp"]) == (target.tp, target.ep, target.dp)
    assert_same_tensors(tensors, t2)
    assert {p["step"] for p in m2["params"].values()} == {6.0}
    for key, value in CONFIG[name].items():
        assert m2["model"][key] == value, key


def test_moe_written_dp_reshardable_is_megatron_lms_own_form(universal, tmp_path):
    """A MoE model written in Megatron-LM's default optimizer form: at the stock run's own layout
    every stored tensor and bucket equals what stock core_v0.19.0 saved, except the alignment gaps
    between parameters in the flat buckets (stock: uninitialised memory; megatron-ucp: zeros); at
    EP4 DP4 it reads back to the same universal tensors, bitwise."""
    from oracles import load_keys, tensor_keys

    name = "torch_dist_gptoss_ep2"
    src = FIXTURES / name / "ckpt"
    same = tmp_path / "same"
    reshard(src, same, Layout(tp=1, dp=2, ep=2), target_format="torch_dist",
            optim_sharding="dp_reshardable", progress=False)
    stock, ours = src / "iter_0000006", same / "iter_0000006"
    keys = tensor_keys(stock)
    assert set(tensor_keys(ours)) == set(keys)
    assert any(k.startswith("chained_1.optimizer.distributed.dp_group_idx_1.") for k in keys)
    a, b = load_keys(stock, sorted(keys)), load_keys(ours, sorted(keys))
    for k in keys:
        differ = a[k] != b[k]
        assert (k.startswith("chained_") and not b[k][differ].any()) or not differ.any(), k
    ep4 = tmp_path / "ep4"
    reshard(src, ep4, Layout(tp=1, dp=4, ep=4), target_format="torch_dist",
            optim_sharding="dp_reshardable", progress=False)
    assert dist_common(ep4)["content_metadata"]["distrib_optim_sharding_type"] == "dp_reshardable"
    _, tensors = universal_tensors(universal[name])
    m2, t2 = universal_tensors(convert_torch_dist(ep4, tmp_path / "u2", progress=False))
    assert (m2["layout"]["ep"], m2["layout"]["dp"]) == (4, 4)
    assert_same_tensors(tensors, t2)


def test_gpt_oss_run_exports_to_hf_with_its_yarn(universal, tmp_path):
    """export-hf of Megatron-LM's GPT-OSS run (YaRN RoPE: --rotary-scaling-factor 4.0
    --yarn-original-max-position-embeddings 8) writes transformers' yarn rope_parameters, which
    transformers loads; import-hf of it gives the run's YaRN settings and bf16 weights back."""
    from megatron_ucp.conversion import import_hf
    from megatron_ucp.formats import open_source
    from megatron_ucp.formats.hf import export

    transformers = pytest.importorskip("transformers")
    out = export(open_source(universal["torch_dist_gptoss_ep2"]), tmp_path / "hf", "gpt_oss", progress=False)
    config = transformers.AutoConfig.from_pretrained(out)
    assert config.rope_parameters == {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 8, "beta_fast": 32.0,
                                      "beta_slow": 1.0, "truncate": True}
    transformers.AutoModelForCausalLM.from_pretrained(out)  # every tensor has its place
    back, back_tensors = universal_tensors(import_hf(out, tmp_path / "u", progress=False))
    manifest, tensors = universal_tensors(universal["torch_dist_gptoss_ep2"])
    for key in ["position_embedding_type", *(attr for attr, _, _ in YARN_FROM_ARGS)]:
        assert back["model"][key] == manifest["model"][key], key
    assert set(back["params"]) == set(manifest["params"])
    for n in manifest["params"]:
        want = tensors[f"{n}/param"].to(torch.bfloat16)
        assert torch.equal(back_tensors[f"{n}/param"][:want.shape[0]], want), n


# megatron-core's model of the GPT-OSS runs (tests/fixtures/megatron_lm_v019/README.md, `OSS MOE`)
OSS_MODEL = {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
             "ffn_hidden_size": 64, "vocab_size": 256, "seq_length": 32, "normalization": "RMSNorm",
             "add_bias_linear": True, "untie_embeddings": True, "swiglu": True, "activation": "quick_gelu",
             "num_experts": 4, "position_embedding_type": "yarn", "extra": {
                 "kv_channels": 8, "add_qkv_bias": True, "softmax_type": "learnable", "window_size": [7, 0],
                 "window_attn_skip_freq": 2, "glu_linear_offset": 1.0, "activation_func_clamp_value": 7.0,
                 "moe_ffn_hidden_size": 32, "yarn_rotary_scaling_factor": 4.0,
                 "yarn_original_max_position_embeddings": 8}}


def test_gpt_oss_run_computes_the_same_in_transformers(universal, tmp_path):
    """Stock Megatron-LM's GPT-OSS run (YaRN, sinks, windows, biased MoE) loaded in megatron-core
    at TP1xDP2 and its export-hf (fp32) in transformers: the same logits (fp32, <= 1e-5 of the
    largest)."""
    from megatron_ucp.formats import open_source
    from megatron_ucp.formats.hf import export
    from megatron_ucp.testing.launch import launch

    transformers = pytest.importorskip("transformers")
    src = universal["torch_dist_gptoss_ep2"]
    # (the run's NullTokenizer has 251 ids: export-hf of the Megatron-LM checkpoint itself drops the
    # padding rows from its args; of the universal conversion, which keeps them, --vocab-size does)
    out = export(open_source(src), tmp_path / "hf", "gpt_oss", dtype="float32", vocab_size=251,
                 progress=False)
    tokens = torch.randint(0, 251, (2, 24), generator=torch.Generator().manual_seed(11))
    launch(2, "megatron_ucp.testing.hf_scenarios:load_logits", {
        "layout": "tp1dp2", "tokens": tokens.tolist(), "train_steps": 0,
        "runs": [{"cfg": OSS_MODEL, "load_dir": str(src), "logits": str(tmp_path / "megatron.pt")}]})
    megatron = torch.load(tmp_path / "megatron.pt")[..., :251]
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        hf = model(tokens).logits
    rel = ((hf - megatron).abs().max() / megatron.abs().max()).item()
    print(f"GPT-OSS (stock core_v0.19.0 run): megatron-core vs transformers logits, max rel {rel:.3g}")
    REPORT["hf-export:gpt_oss-megatron-lm-run"] = {"max_abs_logit_diff": (hf - megatron).abs().max().item(),
                                                   "max_rel_logit_diff": rel}
    assert rel <= 1e-5
