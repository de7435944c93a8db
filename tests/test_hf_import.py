"""import-hf and export-hf round trips on random tiny transformers models, and bad inputs.

No process group and no training: models are built from configs with random weights (every
tensor, biases and norms included, drawn at random so a misplaced element shows), saved with
save_pretrained, imported to a universal checkpoint and exported again, which must give the same
tensors bit for bit.
"""

from __future__ import annotations

import inspect
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import oracles  # noqa: E402
from conftest import RELEASE_SKIP  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from megatron_ucp import mcore_compat  # noqa: E402
from megatron_ucp.cli import main  # noqa: E402
from megatron_ucp.conversion import import_hf  # noqa: E402
from megatron_ucp.errors import UCPError  # noqa: E402
from megatron_ucp.formats import open_source  # noqa: E402
from megatron_ucp.formats.hf import archs, export  # noqa: E402
from megatron_ucp.formats.hf.archs.nemotron_h import NO_DT_CLAMP  # noqa: E402
from megatron_ucp.formats.hf.source import HFSource  # noqa: E402
from megatron_ucp.spec import ParamSpec  # noqa: E402

ROTARY = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              bos_token_id=1, eos_token_id=2)
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
             "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False}
# the test table: every architecture of the registry (archs.ARCHS) has a model here
# the installed transformers' own spelling of the layer types (5.12.1: mamba / attention, 5.23.0:
# linear_attention / full_attention): the importer reads both
NEMOTRON_H_LAYERS = transformers.NemotronHConfig._pattern_to_list("ME*-")
# and of its embedding (5.12.1 saves `backbone.embedding.weight`)
NEMOTRON_H_EMBEDDING = ("backbone.embedding.weight" if "mamba" in NEMOTRON_H_LAYERS else
                        "backbone.embeddings.weight")
MODELS = {  # name -> (arch, config class, kwargs)
    "llama": ("llama", "LlamaConfig", {**ROTARY, "rope_theta": 50000.0}),
    # biases on every linear, tied embeddings, head_dim != hidden / heads
    "llama_bias": ("llama", "LlamaConfig", {**ROTARY, "attention_bias": True, "mlp_bias": True,
                                            "tie_word_embeddings": True, "head_dim": 16}),
    "qwen2": ("qwen2", "Qwen2Config", {**ROTARY, "tie_word_embeddings": True}),
    # a sliding window of 4 on every layer (12 tokens: it masks), head_dim != hidden / heads;
    # tied and without a window (Mistral's current releases: sliding_window null)
    "mistral": ("mistral", "MistralConfig", {**ROTARY, "sliding_window": 4, "head_dim": 16}),
    "mistral_tied": ("mistral", "MistralConfig", {**ROTARY, "sliding_window": None,
                                                  "tie_word_embeddings": True}),
    "mixtral": ("mixtral", "MixtralConfig", {**ROTARY, "num_local_experts": 3,
                                             "num_experts_per_tok": 2}),
    # QK-norm; Qwen3's head_dim defaults to 128, not hidden / heads
    "qwen3": ("qwen3", "Qwen3Config", {**ROTARY, "head_dim": 8}),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeConfig", {**ROTARY, "head_dim": 8, "num_experts": 3,
                                                  "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                                                  "norm_topk_prob": True}),
    # MLA with a query LoRA rank, YaRN, first layer dense, sigmoid routing with
    # e_score_correction_bias, 2 shared experts, top-2 of 4 scaled by 2.5
    "deepseek_v3": ("deepseek_v3", "DeepseekV3Config", {
        **ROTARY, "num_key_value_heads": 4, "moe_intermediate_size": 16, "n_shared_experts": 2,
        "n_routed_experts": 4, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "qk_nope_head_dim": 16, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "rms_norm_eps": 1e-6, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}}),
    # DeepSeek-V2 (V2, V2.5): MLA with a query LoRA rank, YaRN (mscale / mscale_all_dim as
    # DeepSeek's own), the first layer dense, softmax routing (top-3 of 6 scaled by 1.5) within the
    # best 2 of 3 expert groups (group_limited_greedy), 2 shared experts
    "deepseek_v2": ("deepseek_v2", "DeepseekV2Config", {
        **ROTARY, "num_key_value_heads": 4, "moe_intermediate_size": 16, "n_shared_experts": 2,
        "n_routed_experts": 6, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "qk_nope_head_dim": 16, "topk_method": "group_limited_greedy", "n_group": 3,
        "topk_group": 2, "num_experts_per_tok": 3, "routed_scaling_factor": 1.5, "first_k_dense_replace": 1,
        "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0}}),
    # DeepSeek-V2-Lite: no query LoRA (q_proj), greedy top-3 of 4 unscaled, every layer MoE, tied
    "deepseek_v2_lite": ("deepseek_v2", "DeepseekV2Config", {
        **ROTARY, "num_key_value_heads": 4, "moe_intermediate_size": 16, "n_shared_experts": 1,
        "n_routed_experts": 4, "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "qk_nope_head_dim": 16, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "num_experts_per_tok": 3, "first_k_dense_replace": 0, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}}),
    # GLM-4.5: q/k/v biases, QK-norm, RoPE on half of each head (transformers' default
    # partial_rotary_factor 0.5), the first layer dense, sigmoid routing with
    # e_score_correction_bias over 2 expert groups (top-1 group), 2 shared experts, top-2 of 4 x 2.5
    "glm4_moe": ("glm4_moe", "Glm4MoeConfig", {
        **ROTARY, "head_dim": 8, "attention_bias": True, "use_qk_norm": True, "moe_intermediate_size": 16,
        "n_shared_experts": 2, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2,
        "topk_group": 1, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1}),
    # GLM-4.5-Air's shape: no QK-norm; a quarter of each head rotated, every layer MoE, one shared
    # expert, top-1 (not normalized), tied embeddings
    "glm4_moe_air": ("glm4_moe", "Glm4MoeConfig", {
        **ROTARY, "head_dim": 16, "attention_bias": True, "use_qk_norm": False, "moe_intermediate_size": 16,
        "tie_word_embeddings": True,
        "n_routed_experts": 3, "num_experts_per_tok": 1, "norm_topk_prob": False, "first_k_dense_replace": 0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.25}}),
    # Kimi-K2: the same DeepSeek-V3 saved under Kimi-K2's own config.json (`as_kimi_k2`)
    "kimi_k2": ("kimi_k2", "DeepseekV3Config", {
        **ROTARY, "num_key_value_heads": 4, "moe_intermediate_size": 16, "n_shared_experts": 1,
        "n_routed_experts": 4, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "qk_nope_head_dim": 16, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "rms_norm_eps": 1e-6, "routed_scaling_factor": 2.827, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 1.0, "beta_slow": 1.0}}),
    # sinks, a sliding window on every other layer, fused experts with biases, clamped SwiGLU
    "gpt_oss": ("gpt_oss", "GptOssConfig", {
        **ROTARY, "intermediate_size": 24, "head_dim": 8, "num_local_experts": 3, "num_experts_per_tok": 2,
        "sliding_window": 4, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    # GPT-OSS's own YaRN: factor 32 of 4096 positions, the correction range not rounded
    "gpt_oss_yarn": ("gpt_oss", "GptOssConfig", {
        **ROTARY, "intermediate_size": 24, "head_dim": 8, "num_local_experts": 3, "num_experts_per_tok": 2,
        "sliding_window": 4, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "original_max_position_embeddings": 4096, "truncate": False}}),
    # linear RoPE scaling (megatron-core's seq_len_interpolation_factor) and a llama-like's YaRN
    # (GPTModel's yarn: every field other than transformers' defaults, mscale / mscale_all_dim ratio)
    "llama_linear": ("llama", "LlamaConfig", {**ROTARY, "rope_parameters": {
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
    # (transformers' YaRN needs a head_dim: Mixtral's default None fails it)
    "mixtral_yarn": ("mixtral", "MixtralConfig", {**ROTARY, "num_local_experts": 3, "num_experts_per_tok": 2,
                                                  "head_dim": 8, "rope_parameters": YARN_ROPE}),
    # hybrid: Mamba-2 (2 groups of state 8, 8 heads of 8), a MoE layer (sigmoid routing with
    # e_score_correction_bias, a shared expert, top-2 of 3 scaled by 2.5), attention, a relu2 MLP
    "nemotron_h": ("nemotron_h", "NemotronHConfig", dict(
        vocab_size=100, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
        layers_block_type=NEMOTRON_H_LAYERS, ssm_state_size=8,
        mamba_num_heads=8, mamba_head_dim=8, n_groups=2, n_routed_experts=3, num_experts_per_tok=2,
        moe_intermediate_size=24, moe_shared_expert_intermediate_size=16, routed_scaling_factor=2.5,
        time_step_min=NO_DT_CLAMP, chunk_size=8)),
    # linear attention (Gated DeltaNet: 2 key heads of 8 serving 4 value heads of 8) and gated
    # attention with QK-norm and partial rotary (a quarter of head_dim 16), MoE layers (top-2 of 3,
    # a gated shared expert) and a dense one (mlp_only_layers), zero-centered norms
    "qwen3_next": ("qwen3_next", "Qwen3NextConfig", {
        **ROTARY, "num_hidden_layers": 4, "head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "num_experts": 3, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24, "mlp_only_layers": [2],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}),
    "gpt2": ("gpt2", "GPT2Config", dict(vocab_size=100, n_embd=32, n_layer=2, n_head=4,
                                        n_positions=64, activation_function="gelu")),
    "gpt2_untied": ("gpt2", "GPT2Config", dict(vocab_size=100, n_embd=32, n_layer=2, n_head=4,
                                               n_positions=64, tie_word_embeddings=False)),
}
TOKENS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3))
# megatron-core 0.19 builds no MLA without a query LoRA rank on its local spec (mcore_compat.config)
NO_Q_LORA_MLA = mcore_compat.local_mla_qk_norm_without_q_lora()
# transformers 5.12.1's DeepSeek-V2 MoE cannot run group-limited routing (its router reads a
# `num_experts` only its experts module has): the model, not the import, fails there
V2_GROUP_ROUTING_RUNS = "self.num_experts" not in inspect.getsource(
    transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe)


def skip_unbuildable(name: str, runs_in_transformers: bool = False) -> None:
    """Skip (as a release's) a test model this megatron-core or transformers cannot build."""
    if name == "deepseek_v2_lite" and not NO_Q_LORA_MLA:
        pytest.skip(f"{RELEASE_SKIP}{mcore_compat.release_name()} has no local-spec MLA "
                    "without q_lora_rank (import-hf refuses it: test_deepseek_v2_lite_is_refused_on_0_19)")
    if runs_in_transformers and name == "deepseek_v2" and not V2_GROUP_ROUTING_RUNS:
        pytest.skip(f"{RELEASE_SKIP}transformers {transformers.__version__}'s DeepseekV2Moe cannot run "
                    "group_limited_greedy (no num_experts attribute)")


def build(name: str, dtype: torch.dtype = torch.float32):
    arch, cfg_cls, kw = MODELS[name]
    cfg = getattr(transformers, cfg_cls)(**kw)
    torch.manual_seed(0)
    model = getattr(transformers, archs.get(arch).hf_class)(cfg)
    with torch.no_grad():  # nothing left at its init value (zero biases, unit norms)
        for p in model.parameters():
            p.normal_(0, 0.2)
        for n, b in model.named_buffers():  # DeepSeek-V3's expert bias is a (saved) buffer
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.2)
        # Qwen3-Next's gated norm around its initial 1, in [0.5, 2): megatron-core holds it
        # zero-centered, w - 1, exact there (tensor_transforms `plus_one`)
        for n, p in model.named_parameters():
            if n.endswith("linear_attn.norm.weight"):
                p.add_(1).clamp_(0.5, 1.99)
    return model.to(dtype).eval()


def tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


KIMI_K2_REMOTE = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
                  "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                               "AutoModel": "modeling_deepseek.DeepseekV3Model",
                               "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
                  "topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1, "ep_size": 1,
                  "seq_aux": True, "aux_loss_alpha": 0.001, "num_nextn_predict_layers": 0}


def as_kimi_k2(hf_dir: Path) -> None:
    """A transformers DeepSeek-V3 directory's config.json rewritten as Kimi-K2's own (its remote
    code's DeepseekV3Config: transformers 4's rope_scaling, top-level rope_theta, no rope_parameters)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg.pop("rope_interleave", None)
    cfg.update(KIMI_K2_REMOTE, rope_theta=rope.pop("rope_theta"),
               rope_scaling={"type": rope.pop("rope_type"), **rope})
    (hf_dir / "config.json").write_text(json.dumps(cfg))


def as_deepseek_v3(hf_dir: Path, dst: Path) -> Path:
    """A Kimi-K2 directory with model_type deepseek_v3 and no auto_map: transformers has no kimi_k2
    class, its DeepseekV3ForCausalLM is the model Kimi-K2's remote code runs."""
    shutil.copytree(hf_dir, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("auto_map")
    (dst / "config.json").write_text(json.dumps({**cfg, "model_type": "deepseek_v3"}))
    return dst


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Each model of MODELS saved with save_pretrained (fp32), plus llama in bf16."""
    root = tmp_path_factory.mktemp("hf_models")
    out = {}
    for name in MODELS:
        build(name).save_pretrained(root / name)
        if MODELS[name][0] == "kimi_k2":
            as_kimi_k2(root / name)
        out[name] = root / name
    build("llama", torch.bfloat16).save_pretrained(root / "llama_bf16")
    out["llama_bf16"] = root / "llama_bf16"
    return out


def with_mtp(src: Path, dst: Path, differ: bool = False) -> Path:
    """DeepSeek-V3 (or GLM-4.5) `src` with one MTP layer as their checkpoints store it: decoder layer
    num_hidden_layers (a MoE layer like the last), enorm, hnorm, eh_proj, shared_head and copies
    of the embedding and the output layer (`differ`: a shared_head.head that is not lm_head)."""
    t = tensors(src)
    g = torch.Generator().manual_seed(5)
    mtp = {k.replace("model.layers.1.", "model.layers.2."): torch.randn(v.shape, generator=g)
           for k, v in t.items() if k.startswith("model.layers.1.")}
    hidden = t["model.norm.weight"].shape[0]
    mtp.update({"model.layers.2.enorm.weight": torch.randn(hidden, generator=g),
                "model.layers.2.hnorm.weight": torch.randn(hidden, generator=g),
                "model.layers.2.eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=g),
                "model.layers.2.shared_head.norm.weight": torch.randn(hidden, generator=g),
                "model.layers.2.embed_tokens.weight": t["model.embed_tokens.weight"].clone(),
                "model.layers.2.shared_head.head.weight": t["lm_head.weight"] + differ})
    return copy_with(src, dst, add=mtp)


def test_every_arch_has_a_model():
    """An architecture in the registry is tested here (and export-hf offers it: tests/test_cli.py)."""
    assert sorted({arch for arch, _, _ in MODELS.values()}) == sorted(archs.ARCHS)


@pytest.mark.parametrize("name", [*MODELS, "llama_bf16", "deepseek_v3_mtp", "glm4_moe_mtp"])
def test_round_trip_is_bitwise(saved, tmp_path, name):
    skip_unbuildable(name)
    if name.endswith("_mtp"):
        saved = {name: with_mtp(saved[name.removesuffix("_mtp")], tmp_path / "mtp")}
    arch = MODELS[name.removesuffix("_bf16").removesuffix("_mtp")][0]
    universal = import_hf(saved[name], tmp_path / "universal", progress=False)
    u = open_source(universal)
    assert u.manifest.extra["fresh_optimizer"] is True and u.manifest.iteration == 0
    some = next(iter(u.manifest.params))
    assert u.step(some) == 0.0
    assert not u.read(some, "exp_avg", (0,) * len(u.manifest.params[some].shape),
                      u.manifest.params[some].shape).any()
    # the import against the HF tensors split by hand (tests/oracles.py; the round trip below
    # shares megatron_ucp's q/k/v, gate/up and Conv1D transforms in both directions)
    manifest, universal_read = oracles.universal_tensors(universal)
    cfg = json.loads((saved[name] / "config.json").read_text())
    heads = cfg.get("num_attention_heads") or cfg["n_head"]
    want = oracles.hf_expected({n: universal_read[f"{n}/param"] for n in manifest["params"]}, arch,
                               heads, cfg.get("num_key_value_heads") or heads, cfg["vocab_size"],
                               linear_key_heads=cfg.get("linear_num_key_heads") or 0)
    if arch == "nemotron_h":  # (the oracle spells the embedding as transformers 5.23.0 saves it)
        want[NEMOTRON_H_EMBEDDING] = want.pop("backbone.embeddings.weight")
    a = tensors(saved[name])
    assert sorted(want) == sorted(a)
    for k, t in want.items():
        assert torch.equal(t.to(a[k].dtype), a[k]), k
    out = export(u, tmp_path / "hf", arch, max_shard_bytes=20_000, progress=False)
    b = tensors(out)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    original = json.loads((saved[name] / "config.json").read_text())
    exported = json.loads((out / "config.json").read_text())
    same = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "intermediate_size", "rms_norm_eps", "max_position_embeddings",
            "tie_word_embeddings", "rope_parameters", "attention_bias", "mlp_bias", "bos_token_id",
            "eos_token_id", "num_local_experts", "num_experts_per_tok", "n_embd", "n_layer",
            "n_head", "n_positions", "n_inner", "layer_norm_epsilon", "dtype", "head_dim",
            "moe_intermediate_size", "norm_topk_prob", "n_routed_experts", "n_shared_experts",
            "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
            "qk_nope_head_dim", "first_k_dense_replace", "rope_interleave", "sliding_window", "topk_method",
            "use_qk_norm", "n_group", "topk_group",
            "layer_types", "swiglu_limit", "swiglu_alpha", "layers_block_type", "ssm_state_size",
            "mamba_num_heads", "mamba_head_dim", "n_groups", "conv_kernel", "time_step_min",
            "moe_shared_expert_intermediate_size", "mlp_hidden_act", "use_conv_bias", "chunk_size",
            # (lost before: 0.001 -> 0.0, GPT-2's 0.1 -> 0.0)
            "router_aux_loss_coef", "resid_pdrop", "embd_pdrop", "attn_pdrop")
    for k in same:
        if k in original and original[k] is not None:
            assert exported[k] == original[k], k


@pytest.mark.parametrize("name", ["llama_bias", "mistral", "mistral_tied", "mixtral", "gpt2_untied",
                                  "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v2_lite", "deepseek_v3",
                                  "glm4_moe", "glm4_moe_air",
                                  "gpt_oss", "gpt_oss_yarn",
                                  "nemotron_h", "qwen3_next"])
def test_exported_model_computes_the_same(saved, tmp_path, name):
    """The round trip through the universal form loads in transformers with the same logits."""
    skip_unbuildable(name, runs_in_transformers=True)
    import_hf(saved[name], tmp_path / "u", progress=False)
    out = export(open_source(tmp_path / "u"), tmp_path / "hf", MODELS[name][0], progress=False)
    with torch.no_grad():
        want = build(name)(TOKENS).logits
        got = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(TOKENS).logits
    assert torch.equal(want, got)


def test_kimi_k2(saved, tmp_path):
    """Kimi-K2's config.json imports as DeepSeek-V3 recording kimi_k2; export-hf --arch kimi_k2
    writes Kimi-K2's config.json (model_type, architectures, auto_map, the remote code's fields);
    transformers' DeepseekV3ForCausalLM computes the same logits from it (model_type rewritten)
    as from the source, and an export --arch deepseek_v3 holds the same tensors."""
    u = import_hf(saved["kimi_k2"], tmp_path / "u", progress=False)
    src = open_source(u)
    assert src.manifest.extra["hf_import"]["arch"] == "kimi_k2"
    assert src.manifest.model["moe_router_score_function"] == "sigmoid"
    out = export(src, tmp_path / "hf", "kimi_k2", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    original = json.loads((saved["kimi_k2"] / "config.json").read_text())
    for k in (*KIMI_K2_REMOTE, "rope_theta", "rope_scaling", "routed_scaling_factor", "n_group",
              "topk_group", "first_k_dense_replace", "norm_topk_prob", "q_lora_rank", "kv_lora_rank"):
        assert cfg[k] == original[k], k
    with torch.no_grad():
        want = build("kimi_k2")(TOKENS).logits
        got = transformers.DeepseekV3ForCausalLM.from_pretrained(
            as_deepseek_v3(out, tmp_path / "as_v3"), dtype=torch.float32).eval()(TOKENS).logits
    assert torch.equal(want, got)
    v3 = export(src, tmp_path / "v3", "deepseek_v3", progress=False)
    a, b = tensors(out), tensors(v3)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((v3 / "config.json").read_text())["model_type"] == "deepseek_v3"


@pytest.mark.parametrize("field, value", [("scoring_func", "softmax"), ("topk_method", "greedy"),
                                          ("moe_layer_freq", 2)])
def test_kimi_k2_import_refuses_by_field(saved, tmp_path, field, value):
    bad = copy_with(saved["kimi_k2"], tmp_path / "bad", config={field: value})
    with pytest.raises(UCPError, match=f"cannot import HF kimi_k2: config.json {field}="):
        import_hf(bad, tmp_path / "u", progress=False)


def test_hf_directory_is_a_source(saved, tmp_path):
    """The registry opens an HF directory directly: export-hf from it is the identity."""
    src = open_source(saved["qwen2"])
    assert src.format == "hf" and src.manifest.true_vocab == 100
    out = export(src, tmp_path / "hf", "qwen2", progress=False)
    a, b = tensors(saved["qwen2"]), tensors(out)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_cli(saved, tmp_path, capsys):
    assert main(["import-hf", str(saved["llama"]), str(tmp_path / "u"), "--no-progress"]) == 0
    assert main(["export-hf", str(tmp_path / "u"), str(tmp_path / "hf"), "--arch", "llama",
                 "--dtype", "bf16", "--no-progress"]) == 0
    got = tensors(tmp_path / "hf")
    want = tensors(saved["llama"])
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k].bfloat16()) for k in want)
    assert main(["export-hf", str(tmp_path / "u"), str(tmp_path / "bad"), "--arch", "gpt2",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "position_embedding_type" in err and not (tmp_path / "bad").exists()


# ------------------------------------------------------------------------------- bad inputs


def copy_with(src: Path, dst: Path, drop: str | None = None, add: dict | None = None,
              config: dict | None = None) -> Path:
    """A copy of an HF directory with one tensor dropped or some added (one safetensors file),
    or config.json fields changed."""
    dst.mkdir()
    t = tensors(src)
    if drop:
        del t[drop]
    t.update(add or {})
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **(config or {})}))
    return dst


@pytest.mark.parametrize("change, message", [
    (dict(drop="model.layers.1.mlp.up_proj.weight"), "model.layers.1.mlp.up_proj.weight' is missing"),
    (dict(config={"intermediate_size": 64}), "config.json implies"),
    (dict(add={"model.layers.0.self_attn.q_norm.weight": torch.ones(8)}), "have no place"),
    (dict(config={"hidden_act": "gelu"}), "hidden_act"),
    # (the refusal names the real field and its value: it said rope_type=None before)
    (dict(config={"rope_parameters": {"rope_type": "dynamic", "rope_theta": 5e5, "factor": 8.0}}),
     r"config.json rope_parameters.rope_type='dynamic': 'dynamic' RoPE scaling is not imported: "
     "megatron-core has no dynamic NTK scaling"),
    (dict(config={"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}),
     r"config.json rope_parameters.rope_type='dynamic'"),  # (transformers 4's spelling)
    (dict(config={"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4,
                                      "long_factor": [2.0] * 4, "original_max_position_embeddings": 16}}),
     r"config.json rope_parameters.rope_type='longrope': 'longrope' RoPE scaling is not imported: "
     "megatron-core has no LongRoPE"),
    (dict(config={"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 0.0}}),
     r"config.json rope_parameters.factor=0.0: linear RoPE scaling divides the positions by a positive"),
    # transformers' llama cannot apply a partial rotary (its default RoPE ignores the factor):
    # megatron-core's rotary_percent would be another model
    (dict(config={"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                      "partial_rotary_factor": 0.5}}),
     r"config.json rope_parameters.partial_rotary_factor=0.5: transformers' llama rotates whole heads"),
    (dict(config={"partial_rotary_factor": 0.5}),
     r"config.json partial_rotary_factor=0.5: transformers' llama rotates whole heads"),
    (dict(config={"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0}}),
     # (transformers' original context: max_position_embeddings, not megatron-core's 8192)
     r"config.json rope_parameters.original_max_position_embeddings=64: megatron-core's Llama 3"),
    (dict(config={"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                      "low_freq_factor": 2.0}}),
     r"config.json rope_parameters.low_freq_factor=2.0: megatron-core's Llama 3 RoPE scaling has "
     "low_freq_factor=1 fixed"),
    (dict(config={"attention_bias": True}), "attention_bias"),
    (dict(config={"model_type": "bert"}), "model_type 'bert' is not supported"),
    # families megatron-core has no model of are refused with what it lacks (before: "not supported")
    (dict(config={"model_type": "gemma2"}), "model_type 'gemma2' is not imported: megatron-core has no "
     "model with an RMSNorm of weight 1 \\+ w .* post_feedforward_layernorm"),
    (dict(config={"model_type": "falcon_h1"}), "model_type 'falcon_h1' is not imported: .*side by side"),
])
def test_import_refuses(saved, tmp_path, change, message):
    bad = copy_with(saved["llama"], tmp_path / "bad", **change)
    with pytest.raises(UCPError, match=message):
        import_hf(bad, tmp_path / "u", progress=False)
    assert not (tmp_path / "u").exists()


def test_import_refuses_pickled_weights(saved, tmp_path):
    (tmp_path / "bin").mkdir()
    shutil.copy(saved["llama"] / "config.json", tmp_path / "bin")
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(UCPError, match="only safetensors"):
        import_hf(tmp_path / "bin", tmp_path / "u", progress=False)


@pytest.mark.parametrize("name, arch, field", [
    ("gpt2", "llama", "position_embedding_type"),  # a non-rotary model as llama
    ("llama", "gpt2", "position_embedding_type"),
    ("llama", "qwen2", "add_qkv_bias"),  # qwen2 needs q/k/v biases
    ("qwen2", "llama", "add_qkv_bias"),  # llama's attention_bias also covers o_proj
    ("llama_bias", "qwen2", "add_bias_linear"),  # biases where the arch has none
    ("llama_bias", "mixtral", "add_bias_linear"),
    ("llama", "mixtral", "num_moe_experts"),
    ("mixtral", "llama", "num_moe_experts"),
    ("llama", "qwen3", "qk_layernorm"),  # Qwen3 always normalizes q and k
    ("mixtral", "qwen3_moe", "qk_layernorm"),
    ("llama_bias", "mistral", "add_bias_linear"),  # Mistral has no biases
    ("qwen2", "mistral", "add_qkv_bias"),
    ("mixtral", "mistral", "num_moe_experts"),
    ("gpt_oss", "llama", "window_size"),  # a sliding window where the arch has none
    ("gpt_oss", "mistral", "window_attn_skip_freq"),  # Mistral's window is on every layer
])
def test_export_refuses_what_the_arch_cannot_represent(saved, tmp_path, name, arch, field):
    with pytest.raises(UCPError, match=f"cannot export as HF {arch}: model config {field}"):
        export(HFSource(saved[name]), tmp_path / "hf", arch, progress=False)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("arch, change, field", [
    ("qwen3", {"add_bias_linear": True}, "add_bias_linear"),  # Qwen3's MLP has no biases
    ("qwen3", {"add_qkv_bias": True}, "add_qkv_bias"),
    ("qwen3", {"num_moe_experts": 4}, "num_moe_experts"),
    ("qwen3_moe", {}, "num_moe_experts"),  # a dense model
    ("qwen3_moe", {"num_moe_experts": 4, "moe_shared_expert_intermediate_size": 64},
     "moe_shared_expert_intermediate_size"),
    ("qwen3_moe", {"num_moe_experts": 4, "moe_router_enable_expert_bias": True},
     "moe_router_enable_expert_bias"),
    ("qwen3_moe", {"num_moe_experts": 4, "moe_layer_freq": [0, 1]}, "moe_layer_freq"),
])
def test_qwen3_export_refuses_by_field(saved, tmp_path, arch, change, field):
    src = HFSource(saved["llama"])
    src.manifest.model.update(qk_layernorm=True, **change)
    with pytest.raises(UCPError, match=f"cannot export as HF {arch}: model config {field}="):
        export(src, tmp_path / "hf", arch, progress=False)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("window, field", [([4, 2], "window_size"), ([-1, 0], "window_size")])
def test_mistral_export_refuses_by_field(saved, tmp_path, window, field):
    src = HFSource(saved["mistral"])
    src.manifest.model["window_size"] = window
    with pytest.raises(UCPError, match=f"cannot export as HF mistral: model config {field}="):
        export(src, tmp_path / "hf", "mistral", progress=False)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("window", [0, 2.5, True])
def test_mistral_import_refuses_a_bad_window(saved, tmp_path, window):
    bad = copy_with(saved["mistral"], tmp_path / "bad", config={"sliding_window": window})
    with pytest.raises(UCPError, match="config.json sliding_window="):
        import_hf(bad, tmp_path / "u", progress=False)


def test_mistral_window_is_megatron_cores(saved, tmp_path):
    """transformers' sliding_window 4 (the token and 3 before) is megatron-core's (3, 0) on every
    layer; null is no window."""
    for name, want in (("mistral", [3, 0]), ("mistral_tied", None)):
        model = open_source(import_hf(saved[name], tmp_path / name, progress=False)).manifest.model
        assert model.get("window_size") == want and model.get("window_attn_skip_freq") is None


def test_export_refuses_bad_models(saved, tmp_path):
    with pytest.raises(UCPError, match="unknown HF architecture 'bert'"):
        export(HFSource(saved["llama"]), tmp_path / "a", "bert", progress=False)
    src = HFSource(saved["llama"])
    src.manifest.model["qk_layernorm"] = True
    with pytest.raises(UCPError, match="qk_layernorm=True: HF llama has no QK-norm"):
        export(src, tmp_path / "b", "llama", progress=False)
    src = HFSource(saved["llama"])  # a parameter the config does not announce: never dropped
    name = "decoder.layers.0.self_attention.q_layernorm.weight"
    src.manifest.params[name] = type(src.manifest.params["decoder.final_layernorm.weight"])(
        ParamSpec(name, (8,), "float32", None), 0.0)
    with pytest.raises(UCPError, match=r"q_layernorm.weight'\] have no place in HF llama"):
        export(src, tmp_path / "c", "llama", progress=False)
    src = HFSource(saved["llama"])
    del src.manifest.params["decoder.layers.1.mlp.linear_fc2.weight"]
    with pytest.raises(UCPError, match="lacks parameter.*linear_fc2"):
        export(src, tmp_path / "d", "llama", progress=False)
    with pytest.raises(UCPError, match="does not fit"):
        export(HFSource(saved["llama"]), tmp_path / "e", "llama", vocab_size=101, progress=False)
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "x").write_text("")
    with pytest.raises(UCPError, match="not empty"):
        export(HFSource(saved["llama"]), tmp_path / "f", "llama", progress=False)
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())


def test_activation_the_checkpoint_does_not_record(saved, tmp_path):
    """megatron_ucp.save does not record the MLP activation: import-hf's record or the caller
    says it; a wrong one for the architecture is refused."""
    out = export(HFSource(saved["gpt2_untied"]), tmp_path / "a", "gpt2", progress=False)
    assert json.loads((out / "config.json").read_text())["activation_function"] == "gelu_new"
    # (another activation than the HF model's: not with that model's config.json as the template)
    out = export(HFSource(saved["gpt2"]), tmp_path / "b", "gpt2", activation="openai_gelu",
                 progress=False, hf_template=False)
    assert json.loads((out / "config.json").read_text())["activation_function"] == "gelu_new"
    with pytest.raises(UCPError, match="model config activation='swiglu'"):
        export(HFSource(saved["gpt2"]), tmp_path / "c", "gpt2", activation="swiglu", progress=False)


FIXTURES = Path(__file__).parent / "fixtures" / "megatron_lm"


@pytest.mark.parametrize("fixture, arch", [("torch_llama_tp2", "llama"),
                                           ("torch_dist_tp2_dp2", "gpt2")])
def test_megatron_lm_checkpoint_exports(tmp_path, fixture, arch):
    """Megatron-LM checkpoints (torch and torch_dist, trained at TP2) export too: every exported
    tensor (read with safetensors) is the source's master weight in the export dtype, split into
    HF's tensors by hand from the source files (tests/oracles.py: no megatron_ucp reader and none
    of its q/k/v, gate/up or Conv1D transforms), and transformers runs the model."""
    from megatron_ucp.conversion import export_hf

    src = FIXTURES / fixture / "ckpt"
    out = export_hf(src, tmp_path / "hf", arch, progress=False)
    config = transformers.AutoConfig.from_pretrained(out)
    dtype = config.dtype
    assert config.vocab_size == 251  # NullTokenizer --vocab-size 250 + EOD; Megatron pads to 256
    if fixture.startswith("torch_dist"):
        full = oracles.dp_reshardable_full(src, oracles.dist_shapes(src))
    else:
        full = oracles.legacy_full(src)
    master = {n: s["param"] for n, s in full.items()}
    heads = config.num_attention_heads
    want = oracles.hf_expected(master, arch, heads, getattr(config, "num_key_value_heads", heads), 251)
    got = tensors(out)
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        assert got[k].dtype == dtype and torch.equal(got[k], t.to(dtype)), k
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        assert torch.isfinite(model(TOKENS[:, :8]).logits).all()


def test_export_streams_one_tensor_at_a_time(saved, tmp_path):
    """Each universal tensor is read once, whole, and only its master weight; progress goes
    through the factory it is given (the CLI's tqdm)."""
    src = HFSource(saved["mixtral"])
    reads: list[tuple[str, str]] = []
    real = src.read

    def read(name, state, offset, shape):
        reads.append((name, state))
        assert offset == (0,) * len(shape)
        return real(name, state, offset, shape)

    src.read = read
    bars = []

    class Bar:
        def __init__(self, total, desc, unit):
            self.total, self.done = total, 0
            bars.append(self)

        def update(self, n=1):
            self.done += n

        def close(self):
            pass

    export(src, tmp_path / "hf", "mixtral", progress=Bar)
    assert sorted(reads) == sorted((n, "param") for n in src.manifest.params)
    assert len(bars) == 1 and bars[0].total == bars[0].done == len(src.manifest.params)


@pytest.mark.parametrize("name, change, message", [
    ("deepseek_v3", dict(config={"rope_interleave": False}), "config.json rope_interleave=False"),
    ("deepseek_v3", dict(config={"rms_norm_eps": 1e-5}), "config.json rms_norm_eps=1e-05"),
    ("deepseek_v3", dict(config={"norm_topk_prob": False}), "config.json norm_topk_prob=False"),
    ("deepseek_v3", dict(config={"n_group": 2, "topk_group": 2}), "config.json topk_group=2"),
    ("deepseek_v3", dict(config={"attention_bias": True}), "config.json attention_bias=True"),
    # DeepSeek-V2: transformers ignores norm_topk_prob (the remote code does not); a group scored by
    # its best expert is megatron-core's only where num_experts_per_tok // topk_group == 1 (V2's own
    # 6 // 3 is not); the remote code's fields transformers does not read
    ("deepseek_v2", dict(config={"norm_topk_prob": True}), "config.json norm_topk_prob=True"),
    ("deepseek_v2", dict(config={"topk_group": 1}), "config.json topk_group=1: transformers' DeepSeek-V2 "
     "scores an expert group by its best expert"),
    ("deepseek_v2", dict(config={"topk_method": "noaux_tc"}), "config.json topk_method='noaux_tc'"),
    ("deepseek_v2", dict(config={"moe_layer_freq": 2}), "config.json moe_layer_freq=2"),
    ("deepseek_v2", dict(config={"scoring_func": "sigmoid"}), "config.json scoring_func='sigmoid'"),
    ("deepseek_v2", dict(config={"n_shared_experts": 0}), "config.json n_shared_experts=0"),
    ("deepseek_v2", dict(config={"mlp_bias": True}), "config.json mlp_bias=True"),
    ("deepseek_v2_lite", dict(config={"rms_norm_eps": 1e-5}),
     "config.json rms_norm_eps=1e-05: HF deepseek_v2 normalizes the q and kv latents with eps 1e-6"),
    ("gpt2", dict(config={"embd_pdrop": 0.0}),
     "config.json embd_pdrop=0.0: megatron-core's hidden_dropout is both the embedding's and the residual's"),
    ("gpt_oss", dict(config={"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}),
     "rope_parameters.rope_type.*'linear' RoPE scaling is not imported for GPT-OSS"),
    ("gpt_oss", dict(config={"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 1.0,
                                                 "attention_factor": 1.2}}),
     "rope_parameters.attention_factor.*does not scale YaRN's cos/sin when factor=1.0"),
    ("gpt_oss", dict(config={"partial_rotary_factor": 0.5}),
     "config.json partial_rotary_factor=0.5: transformers' GPT-OSS rotates whole heads"),
    ("deepseek_v3", dict(config={"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4,
                                                     "factor": 2.0}}),
     "config.json rope_parameters.rope_type='linear': 'linear' RoPE scaling is not imported for DeepSeek-V3"),
    ("gpt_oss", dict(config={"swiglu_alpha": 1.5}), "config.json swiglu_alpha=1.5"),
    ("gpt_oss", dict(config={"attention_bias": False}), "config.json attention_bias=False"),
    # GLM-4.5: megatron-core normalizes sigmoid top-k weights exactly when k > 1
    ("glm4_moe", dict(config={"norm_topk_prob": False}), "config.json norm_topk_prob=False"),
    ("glm4_moe_air", dict(config={"norm_topk_prob": True}), "config.json norm_topk_prob=True"),
    ("glm4_moe", dict(config={"n_group": 2, "topk_group": 2}), "config.json topk_group=2"),
    ("glm4_moe", dict(config={"n_shared_experts": 0}), "config.json n_shared_experts=0"),
    ("glm4_moe", dict(config={"first_k_dense_replace": 2}), "config.json first_k_dense_replace=2"),
    ("glm4_moe", dict(config={"hidden_act": "gelu"}), "config.json hidden_act='gelu'"),
    ("glm4_moe", dict(config={"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                                                  "partial_rotary_factor": 0.5}}),
     "config.json rope_parameters.rope_type='yarn': 'yarn' RoPE scaling is not imported for glm4_moe"),
    # 8 channels x 0.25: a rotary part of 2 channels is fine, of 0.375 x 8 = 3 is not
    ("glm4_moe", dict(config={"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                  "partial_rotary_factor": 0.375}}),
     "config.json rope_parameters.partial_rotary_factor=0.375: the rotary part of a head of 8 channels"),
])
def test_import_refuses_what_megatron_core_cannot_run(saved, tmp_path, name, change, message):
    skip_unbuildable(name)
    bad = copy_with(saved[name], tmp_path / "bad", **change)
    with pytest.raises(UCPError, match=message):
        import_hf(bad, tmp_path / "u", progress=False)
    assert not (tmp_path / "u").exists()


def test_import_refuses_mtp_copies_that_differ(saved, tmp_path):
    """DeepSeek-V3's MTP layer repeats the output layer: a copy that is not lm_head is refused,
    never one of the two silently kept."""
    bad = with_mtp(saved["deepseek_v3"], tmp_path / "bad", differ=True)
    with pytest.raises(UCPError, match="output_layer.weight: the HF checkpoint's copies of this "
                       "tensor differ"):
        import_hf(bad, tmp_path / "u", progress=False)


@pytest.mark.parametrize("name, arch, change, field", [
    ("llama", "deepseek_v3", {}, "num_moe_experts"),
    ("mixtral", "deepseek_v3", {}, "multi_latent_attention"),
    ("deepseek_v3", "mixtral", {}, "multi_latent_attention"),  # the older archs refuse MLA
    ("deepseek_v3", "deepseek_v3", {"moe_shared_expert_gate": True}, "moe_shared_expert_gate"),
    ("deepseek_v3", "deepseek_v3", {"layernorm_epsilon": 1e-5}, "layernorm_epsilon"),
    ("deepseek_v3", "deepseek_v3", {"moe_router_enable_expert_bias": False}, "moe_router_enable_expert_bias"),
    ("deepseek_v3", "deepseek_v3", {"moe_layer_freq": [1, 0]}, "moe_layer_freq"),
    ("deepseek_v3", "deepseek_v3", {"moe_router_score_function": "softmax"}, "moe_router_score_function"),
    ("deepseek_v3", "deepseek_v3", {"moe_shared_expert_intermediate_size": 24},
     "moe_shared_expert_intermediate_size"),
    ("mixtral", "gpt_oss", {}, "softmax_type"),
    ("gpt_oss", "mixtral", {}, "window_size"),
    ("gpt_oss", "gpt_oss", {"activation_func": "torch.nn.functional.silu"}, "activation_func"),
    ("gpt_oss", "gpt_oss", {"activation_func_clamp_value": None}, "activation_func_clamp_value"),
    ("gpt_oss", "gpt_oss", {"glu_linear_offset": 0.0}, "glu_linear_offset"),
    ("gpt_oss", "gpt_oss", {"window_size": [4, 2]}, "window_size"),
    ("gpt_oss", "gpt_oss", {"moe_router_pre_softmax": True}, "moe_router_pre_softmax"),
    ("glm4_moe", "glm4_moe", {"add_bias_linear": True}, "add_bias_linear"),  # q/k/v biases only
    ("glm4_moe", "glm4_moe", {"rotary_interleaved": True}, "rotary_interleaved"),
    ("glm4_moe", "glm4_moe", {"rotary_percent": 0.375}, "rotary_percent"),  # 3 of 8 channels
    ("glm4_moe", "glm4_moe", {"moe_router_score_function": "softmax"}, "moe_router_score_function"),
    ("glm4_moe", "glm4_moe", {"moe_router_enable_expert_bias": False}, "moe_router_enable_expert_bias"),
    ("glm4_moe", "glm4_moe", {"moe_layer_freq": [1, 0]}, "moe_layer_freq"),
    ("glm4_moe", "glm4_moe", {"moe_shared_expert_intermediate_size": None},
     "moe_shared_expert_intermediate_size"),
    ("glm4_moe", "glm4_moe", {"qk_l2_norm": True}, "qk_l2_norm"),
    ("glm4_moe", "glm4_moe", {"seq_len_interpolation_factor": 2.0}, "seq_len_interpolation_factor"),
    ("glm4_moe", "deepseek_v3", {}, "rotary_percent"),  # (DeepSeek-V3 rotates whole rope dims)
    ("deepseek_v3", "glm4_moe", {}, "multi_latent_attention"),
    ("qwen3_moe", "glm4_moe", {}, "moe_router_score_function"),
    ("qwen3", "glm4_moe", {}, "num_moe_experts"),
    ("deepseek_v2", "deepseek_v2", {"mtp_num_layers": 1}, "mtp_num_layers"),  # (none in DeepSeek-V2)
    ("deepseek_v3", "deepseek_v2", {"mtp_num_layers": None}, "moe_router_score_function"),
    ("deepseek_v2", "deepseek_v2", {"moe_router_pre_softmax": False}, "moe_router_pre_softmax"),
    ("deepseek_v2", "deepseek_v2", {"moe_router_group_topk": 1}, "moe_router_group_topk"),  # 3 // 1
    ("deepseek_v2", "deepseek_v2", {"moe_router_enable_expert_bias": True}, "moe_router_enable_expert_bias"),
    ("deepseek_v2", "deepseek_v2", {"moe_layer_freq": [1, 0]}, "moe_layer_freq"),
    ("deepseek_v2_lite", "deepseek_v3", {}, "moe_router_score_function"),
])
def test_new_arch_export_refuses_by_field(saved, tmp_path, name, arch, change, field):
    skip_unbuildable(name)
    _assert_export_refused(saved, tmp_path, name, arch, change, field)


@pytest.mark.skipif(NO_Q_LORA_MLA, reason=f"{RELEASE_SKIP}this megatron-core builds MLA without q_lora_rank")
def test_deepseek_v2_lite_is_refused_on_0_19(saved, tmp_path):
    """megatron-core 0.19 cannot build DeepSeek-V2-Lite's MLA (no query LoRA) on its local spec:
    refused by the field (before: megatron-core's ValueError from inside the rebuild)."""
    with pytest.raises(UCPError, match=r"config.json q_lora_rank=(None|0): null \(no query LoRA rank\) "
                                       r"cannot be built by megatron-core 0\.19"):
        import_hf(saved["deepseek_v2_lite"], tmp_path / "u", progress=False)


@pytest.mark.parametrize("name, arch, change, field", [
    ("qwen3_next", "qwen3_next", {"layernorm_zero_centered_gamma": False}, "layernorm_zero_centered_gamma"),
    ("qwen3_next", "qwen3_next", {"attention_output_gate": False}, "attention_output_gate"),
    ("qwen3_next", "qwen3_next", {"moe_shared_expert_gate": False}, "moe_shared_expert_gate"),
    ("qwen3_next", "qwen3_next", {"moe_router_score_function": "sigmoid"}, "moe_router_score_function"),
    ("qwen3_next", "qwen3_next", {"mtp_num_layers": 1}, "mtp_num_layers"),
    ("qwen3_next", "qwen3_next", {"rotary_interleaved": True}, "rotary_interleaved"),
    ("qwen3_next", "qwen3_next", {"linear_attention_freq": None}, "linear_attention_freq"),
    ("qwen3_next", "qwen3_moe", {}, "attention_output_gate"),  # the older archs refuse it
    ("qwen3_moe", "qwen3_next", {}, "experimental_attention_variant"),
])
def test_qwen3_next_export_refuses_by_field(saved, tmp_path, name, arch, change, field):
    _assert_export_refused(saved, tmp_path, name, arch, change, field)


@pytest.mark.parametrize("change, message", [
    (dict(config={"layer_types": ["linear_attention", "sliding_attention", "linear_attention",
                                  "full_attention"]}), "config.json layer_types="),
    (dict(config={"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}),
     "rope_parameters.rope_type='yarn'"),
    (dict(config={"hidden_act": "gelu"}), "config.json hidden_act='gelu'"),
    (dict(config={"linear_num_value_heads": 3}), "config.json linear_num_value_heads=3: is no multiple"),
    # Hub checkpoints carry an MTP layer transformers ignores: refused, not dropped
    (dict(add={"mtp.fc.weight": torch.zeros(32, 64)}), "holds 1 multi-token prediction tensors"),
])
def test_qwen3_next_import_refuses(saved, tmp_path, change, message):
    bad = copy_with(saved["qwen3_next"], tmp_path / "bad", **change)
    with pytest.raises(UCPError, match=message):
        import_hf(bad, tmp_path / "u", progress=False)
    assert not (tmp_path / "u").exists()


def _assert_export_refused(saved, tmp_path, name: str, arch: str, change: dict, field: str) -> None:
    """Exporting `name` with its model config changed by `change` is refused naming `field`, and
    nothing is written."""
    src = HFSource(saved[name])
    src.manifest.model.update(change)
    with pytest.raises(UCPError, match=f"cannot export as HF {arch}: model config {field}="):
        export(src, tmp_path / "hf", arch, progress=False)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("factor", [0.5, 0.25])
def test_glm4_moe_partial_rotary_is_megatron_cores(tmp_path, monkeypatch, factor):
    """transformers' Glm4Moe RoPE (rotate_half on the first int(head_dim * partial_rotary_factor)
    channels of each head, the rest passed through) is megatron-core's RotaryEmbedding and
    apply_rotary_pos_emb with rotary_percent = partial_rotary_factor and rotary_interleaved=False,
    bit for bit; megatron-core's interleaved convention is another one."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer import TransformerConfig
    from transformers.models.glm4_moe import modeling_glm4_moe as glm

    head_dim, seq, theta = 16, 12, 5e5
    config = transformers.Glm4MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=head_dim, rope_parameters={
                                            "rope_type": "default", "rope_theta": theta,
                                            "partial_rotary_factor": factor})
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, seq, head_dim, generator=g), torch.randn(2, 2, seq, head_dim, generator=g)
    cos, sin = glm.Glm4MoeRotaryEmbedding(config)(q, torch.arange(seq)[None])
    want = glm.apply_rotary_pos_emb(q, k, cos, sin)  # [batch, heads, seq, head_dim]
    rot = int(head_dim * factor)
    assert all(torch.equal(w[..., rot:], x[..., rot:]) for w, x in zip(want, (q, k)))
    # RotaryEmbedding moves its frequencies to torch.cuda.current_device(): the CPU here, as
    # megatron_ucp.testing.cpu_shim places them (only for this test)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        ps.initialize_model_parallel()
        for interleaved in (False, True):
            mc = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                   kv_channels=head_dim, rotary_interleaved=interleaved,
                                   apply_rope_fusion=False)
            freqs = RotaryEmbedding(head_dim, factor, rotary_interleaved=interleaved, rotary_base=theta,
                                    use_cpu_initialization=True)(seq)
            assert freqs.shape[-1] == rot
            # megatron-core's [seq, batch, heads, head_dim]
            got = [apply_rotary_pos_emb(t.permute(2, 0, 1, 3), freqs, mc).permute(1, 2, 0, 3) for t in (q, k)]
            same = [torch.equal(a, b) for a, b in zip(got, want)]
            assert same == ([True, True] if not interleaved else [False, False]), interleaved
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def test_glm4_moe_mtp_layer_without_copies(saved, tmp_path):
    """GLM-4.6 stores its MTP layer without the copies of the embedding and output layer that
    GLM-4.5's (and DeepSeek-V3's) repeat: it imports as the same model, bit for bit, and exports
    in GLM-4.5's layout (the copies written)."""
    full = with_mtp(saved["glm4_moe"], tmp_path / "full")
    bare = copy_with(copy_with(full, tmp_path / "a", drop="model.layers.2.embed_tokens.weight"),
                     tmp_path / "bare", drop="model.layers.2.shared_head.head.weight")
    _, want = oracles.universal_tensors(import_hf(full, tmp_path / "u_full", progress=False))
    manifest, got = oracles.universal_tensors(import_hf(bare, tmp_path / "u_bare", progress=False))
    assert manifest["params"]["mtp.layers.0.eh_proj.weight"] and sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    out = tensors(export(open_source(tmp_path / "u_bare"), tmp_path / "hf", "glm4_moe", progress=False))
    a = tensors(full)
    assert sorted(out) == sorted(a) and all(torch.equal(out[k], a[k]) for k in a)


def test_olmoe_import_refuses_by_name(tmp_path):
    """OLMoE's q_norm / k_norm normalize the whole q and k projections, megatron-core's QK-norm
    each head: import-hf refuses it naming those parameters, and clip_qkv, and writes nothing."""
    config = transformers.OlmoeConfig(**ROTARY, num_experts=4, num_experts_per_tok=2)
    transformers.OlmoeForCausalLM(config).save_pretrained(tmp_path / "olmoe")
    with pytest.raises(UCPError, match=r"cannot import HF olmoe \(OlmoeForCausalLM\): its q_norm / k_norm "
                       r"\(model.layers.<i>.self_attn.q_norm.weight \[num_attention_heads \* head_dim\].*"
                       r"megatron-core's qk_layernorm normalizes each head") as refused:
        import_hf(tmp_path / "olmoe", tmp_path / "u", progress=False)
    assert "clip_qkv" not in str(refused.value) and not (tmp_path / "u").exists()
    clipped = copy_with(tmp_path / "olmoe", tmp_path / "clipped", config={"clip_qkv": 8.0})
    with pytest.raises(UCPError, match="config.json clip_qkv=8.0: megatron-core does not clamp q/k/v"):
        import_hf(clipped, tmp_path / "u", progress=False)
    assert "olmoe" not in archs.ARCHS  # export-hf does not offer it: no megatron-core model is one


def test_deepseek_v3_expert_bias_stays_fp32(saved, tmp_path):
    """A bf16 export keeps the router's expert bias in fp32, as megatron-core and transformers
    both keep it (routing adds it to sigmoid scores)."""
    out = export(HFSource(saved["deepseek_v3"]), tmp_path / "hf", "deepseek_v3", dtype="bf16", progress=False)
    a, b = tensors(saved["deepseek_v3"]), tensors(out)
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert b[name].dtype == torch.float32 and torch.equal(a[name], b[name])
    assert b["model.norm.weight"].dtype == torch.bfloat16


# ------------------------------------------------------------------------------- Nemotron-H


@pytest.mark.parametrize("config, message", [
    ({"time_step_min": 0.001}, "config.json time_step_min=0.001: transformers clamps"),
    ({"conv_kernel": 3}, "config.json conv_kernel=3"),
    ({"layer_norm_epsilon": 1e-6}, "config.json layer_norm_epsilon=1e-06"),
    ({"mlp_hidden_act": "silu"}, "config.json mlp_hidden_act='silu'"),
    ({"mamba_hidden_act": "gelu"}, "config.json mamba_hidden_act='gelu'"),
    ({"use_conv_bias": False}, "config.json use_conv_bias=False"),
    ({"mamba_proj_bias": True}, "config.json mamba_proj_bias=True"),
    ({"mlp_bias": True}, "config.json mlp_bias=True"),
    ({"moe_latent_size": 16}, "config.json moe_latent_size=16"),
    ({"norm_topk_prob": False}, "config.json norm_topk_prob=False"),
    ({"sliding_window": 4}, "config.json sliding_window=4"),
    ({"layers_block_type": ["linear_attention", "moe", "sliding_attention", "mlp"]},
     "layers_block_type.*'sliding_attention'"),
])
def test_nemotron_h_import_refuses_what_megatron_core_cannot_run(saved, tmp_path, config, message):
    bad = copy_with(saved["nemotron_h"], tmp_path / "bad", config=config)
    with pytest.raises(UCPError, match=message):
        import_hf(bad, tmp_path / "u", progress=False)
    assert not (tmp_path / "u").exists()


def test_nemotron_h_legacy_pattern_and_names(saved, tmp_path):
    """An older Nemotron-H config.json (hybrid_override_pattern, mamba_n_groups, mamba_d_conv)
    imports as the same model."""
    cfg = json.loads((saved["nemotron_h"] / "config.json").read_text())
    legacy = {k: v for k, v in cfg.items() if k not in ("layers_block_type", "n_groups", "conv_kernel")}
    legacy.update(hybrid_override_pattern="ME*-", mamba_n_groups=2, mamba_d_conv=4)
    (tmp_path / "legacy").mkdir()
    shutil.copy(saved["nemotron_h"] / "model.safetensors", tmp_path / "legacy")
    (tmp_path / "legacy" / "config.json").write_text(json.dumps(legacy))
    model = HFSource(tmp_path / "legacy").manifest.model
    assert model["hybrid_layer_pattern"] == "ME*-" and model["mamba_num_groups"] == 2


def test_nemotron_h_tied_embedding(saved, tmp_path):
    """transformers' Nemotron-H never ties lm_head: a tie_word_embeddings model stores lm_head.
    When it is the embedding's copy, the model imports tied and exports back the same; when it
    differs, it is an untied model (what transformers computes)."""
    t = tensors(saved["nemotron_h"])
    tied = copy_with(saved["nemotron_h"], tmp_path / "tied", config={"tie_word_embeddings": True},
                     add={"lm_head.weight": t[NEMOTRON_H_EMBEDDING].clone()})
    src = HFSource(tied)
    assert src.manifest.model["share_embeddings_and_output_weights"] is True
    assert "output_layer.weight" not in src.manifest.params
    out = export(src, tmp_path / "hf", "nemotron_h", progress=False)
    b = tensors(out)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert sorted(b) == sorted(t) and all(torch.equal(b[k], tensors(tied)[k]) for k in b)
    untied = copy_with(saved["nemotron_h"], tmp_path / "untied", config={"tie_word_embeddings": True})
    assert HFSource(untied).manifest.model["share_embeddings_and_output_weights"] is False


@pytest.mark.parametrize("name, arch, change, field", [
    ("llama", "nemotron_h", {}, "hybrid_layer_pattern"),  # a GPT model has no layer pattern
    ("nemotron_h", "llama", {}, "hybrid_layer_pattern"),
    ("nemotron_h", "nemotron_h", {"hybrid_layer_pattern": "MG*-"}, "hybrid_layer_pattern"),
    ("nemotron_h", "nemotron_h", {"position_embedding_type": "rope"}, "position_embedding_type"),
    ("nemotron_h", "nemotron_h", {"gated_linear_unit": True}, "gated_linear_unit"),
    ("nemotron_h", "nemotron_h", {"activation_func": "torch.nn.functional.gelu"}, "activation_func"),
    ("nemotron_h", "nemotron_h", {"add_bias_linear": True}, "add_bias_linear"),
    ("nemotron_h", "nemotron_h", {"layernorm_epsilon": 1e-6}, "layernorm_epsilon"),
    ("nemotron_h", "nemotron_h", {"qk_layernorm": True}, "qk_layernorm"),
    ("nemotron_h", "nemotron_h", {"moe_router_score_function": "softmax"}, "moe_router_score_function"),
    ("nemotron_h", "nemotron_h", {"moe_router_enable_expert_bias": False}, "moe_router_enable_expert_bias"),
    ("nemotron_h", "nemotron_h", {"moe_shared_expert_intermediate_size": None},
     "moe_shared_expert_intermediate_size"),
    ("nemotron_h", "nemotron_h", {"moe_shared_expert_gate": True}, "moe_shared_expert_gate"),
    ("nemotron_h", "nemotron_h", {"moe_latent_size": 8}, "moe_latent_size"),
    ("nemotron_h", "nemotron_h", {"moe_expert_capacity_factor": 1.0}, "moe_expert_capacity_factor"),
    ("nemotron_h", "nemotron_h", {"moe_router_num_groups": 3, "moe_router_group_topk": 2},
     "moe_router_group_topk"),
])
def test_nemotron_h_export_refuses_by_field(saved, tmp_path, name, arch, change, field):
    _assert_export_refused(saved, tmp_path, name, arch, change, field)


def test_nemotron_h_export_refuses_per_channel_d(saved, tmp_path):
    """megatron-core's D_has_hdim keeps D per channel; transformers' Nemotron-H per head."""
    import dataclasses

    src = HFSource(saved["nemotron_h"])
    entry = src.manifest.params["decoder.layers.0.mixer.D"]
    src.manifest.params["decoder.layers.0.mixer.D"] = dataclasses.replace(
        entry, spec=dataclasses.replace(entry.spec, shape=(64,)))
    with pytest.raises(UCPError, match="model config D_has_hdim=True: decoder.layers.0.mixer.D has shape"):
        export(src, tmp_path / "hf", "nemotron_h", progress=False)


def test_nemotron_h_expert_bias_stays_fp32(saved, tmp_path):
    out = export(HFSource(saved["nemotron_h"]), tmp_path / "hf", "nemotron_h", dtype="bf16", progress=False)
    a, b = tensors(saved["nemotron_h"]), tensors(out)
    name = "backbone.layers.1.mixer.gate.e_score_correction_bias"
    assert b[name].dtype == torch.float32 and torch.equal(a[name], b[name])
    assert b["backbone.layers.0.mixer.in_proj.weight"].dtype == torch.bfloat16


def test_gpt_oss_yarn_attention_factor_is_kept(saved, tmp_path):
    """An explicit YaRN attention_factor (not the one transformers infers from the factor) becomes
    megatron-core's mscale / mscale_all_dim, and export-hf writes it back: same logits."""
    rope = {**MODELS["gpt_oss_yarn"][2]["rope_parameters"], "attention_factor": 1.5}
    src = copy_with(saved["gpt_oss_yarn"], tmp_path / "af", config={"rope_parameters": rope})
    universal = import_hf(src, tmp_path / "u", progress=False)
    model = open_source(universal).manifest.model
    assert model["position_embedding_type"] == "yarn" and model["yarn_rotary_scaling_factor"] == 32.0
    assert model["yarn_correction_range_round_to_int"] is False
    scale = ((0.1 * model["yarn_mscale"] * math.log(32.0) + 1)
             / (0.1 * model["yarn_mscale_all_dim"] * math.log(32.0) + 1))
    assert math.isclose(scale, 1.5, rel_tol=1e-12)
    out = export(open_source(universal), tmp_path / "hf", "gpt_oss", progress=False)
    exported = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert math.isclose(exported.pop("attention_factor"), 1.5, rel_tol=1e-12)
    assert exported == {k: v for k, v in rope.items() if k != "attention_factor"} | {
        "mscale": model["yarn_mscale"], "mscale_all_dim": 0.0}
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(TOKENS).logits
        got = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(TOKENS).logits
        plain = build("gpt_oss_yarn")(TOKENS).logits
    assert torch.allclose(want, got, rtol=1e-6, atol=1e-6) and not torch.allclose(want, plain, atol=1e-3)


# per RoPE kind: its HF fields (but rope_theta), what the import records in the model config (from
# megatron-core's rebuilt GPTModel) and in the run record (Megatron-LM's flags for the same model)
ROPE_KINDS = {
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192},
               {"rope_scaling": True}, {"use_rope_scaling": True, "rope_scaling_factor": 8.0}),
    "linear": ({"rope_type": "linear", "factor": 2.5}, {"seq_len_interpolation_factor": 2.5},
               {"rotary_seq_len_interpolation_factor": 2.5}),
    "yarn": ({k: v for k, v in YARN_ROPE.items() if k != "rope_theta"},
             {"position_embedding_type": "yarn", "yarn_rotary_scaling_factor": 4.0,
              "yarn_original_max_position_embeddings": 8, "yarn_beta_fast": 16.0, "yarn_beta_slow": 2.0,
              "yarn_mscale": 1.0, "yarn_mscale_all_dim": 0.5, "yarn_correction_range_round_to_int": False},
             {"position_embedding_type": "yarn", "rotary_scaling_factor": 4.0,
              "yarn_original_max_position_embeddings": 8, "yarn_beta_fast": 16.0, "yarn_beta_slow": 2.0,
              "mscale": 1.0, "mscale_all_dim": 0.5, "yarn_correction_range_round_to_int": False}),
}
LONG_TOKENS = torch.randint(0, 100, (1, 24), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("name, kind", [("llama", "llama3"), ("llama", "linear"), ("llama", "yarn"),
                                        ("qwen2", "linear"), ("qwen3", "yarn"), ("mixtral", "linear"),
                                        ("qwen3_moe", "yarn"), ("qwen3_moe", "llama3")])
@pytest.mark.parametrize("spelling", ["transformers 5", "transformers 4"])
def test_rope_scaling_imports_and_exports(saved, tmp_path, name, kind, spelling):
    """Llama 3.1's llama3, linear and YaRN RoPE scaling (each refused before: llama3 as
    `rope_type=None`) import for every llama-like as GPTModel's rope_scaling with its factor,
    seq_len_interpolation_factor and YaRN (config.yarn_*), from transformers 5's rope_parameters or
    4's rope_scaling (`type`) + rope_theta; the manifest records them (model config, run record),
    and export-hf writes back the same rope_parameters, which transformers reads as it read the
    source (the same logits past the original context; megatron-core's: tests/test_hf_export.py)."""
    fields, model_record, run_record = ROPE_KINDS[kind]
    config = ({"rope_parameters": {**fields, "rope_theta": 5e5}} if spelling == "transformers 5" else
              {"rope_parameters": None, "rope_theta": 5e5,
               "rope_scaling": {"type": kind, **{k: v for k, v in fields.items() if k != "rope_type"}}})
    src = copy_with(saved[name], tmp_path / "src", config=config)
    universal = import_hf(src, tmp_path / "u", progress=False)
    manifest = open_source(universal).manifest
    assert {k: manifest.model.get(k) for k in model_record} == model_record
    assert {k: manifest.extra["hf_import"]["megatron"].get(k) for k in run_record} == run_record
    out = export(open_source(universal), tmp_path / "hf", MODELS[name][0], progress=False)
    exported = json.loads((out / "config.json").read_text())
    assert exported["rope_parameters"] == {**fields, "rope_theta": 5e5}, exported["rope_parameters"]
    if spelling == "transformers 4":
        with torch.no_grad():
            want = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(LONG_TOKENS)
            got = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(LONG_TOKENS)
        assert torch.equal(want.logits, got.logits)


@pytest.mark.parametrize("name, arch, change, field", [
    ("llama", "llama", {"rotary_percent": 0.5}, "rotary_percent"),  # transformers rotates whole heads
    ("llama", "llama", {"seq_len_interpolation_factor": 2.0, "rope_scaling": True},
     "seq_len_interpolation_factor"),  # linear on top of Llama 3: no rope_parameters says it
    ("mixtral_yarn", "mixtral", {"seq_len_interpolation_factor": 2.0}, "seq_len_interpolation_factor"),
    ("mixtral_yarn", "mixtral", {"rope_scaling": True}, "rope_scaling"),
    ("mixtral_yarn", "mixtral", {"rotary_percent": 0.5}, "rotary_percent"),
    ("gpt_oss", "gpt_oss", {"seq_len_interpolation_factor": 2.0}, "seq_len_interpolation_factor"),
    ("gpt_oss", "gpt_oss", {"rotary_percent": 0.5}, "rotary_percent"),
    ("deepseek_v3", "deepseek_v3", {"seq_len_interpolation_factor": 2.0}, "seq_len_interpolation_factor"),
])
def test_rope_export_refuses_by_field(saved, tmp_path, name, arch, change, field):
    """What transformers' RoPE cannot say (or megatron-core does not apply) is refused by name,
    never exported as another RoPE."""
    _assert_export_refused(saved, tmp_path, name, arch, change, field)


def test_megatron_lm_linear_rope_exports(saved, tmp_path):
    """A Megatron-LM run's --rotary-seq-len-interpolation-factor (exported as default RoPE before,
    silently): the GPTModel rebuilt from its args records it, export-hf writes linear RoPE scaling;
    the flag alone (`hints_from_args`) says it too."""
    import argparse

    from megatron_ucp.conversion import export_hf

    src = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "torch_llama_tp2" / "ckpt", src)
    for f in src.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = torch.load(f, weights_only=False)
        state["args"].rotary_seq_len_interpolation_factor = 2  # (Megatron-LM's flag is an int)
        torch.save(state, f)
    assert open_source(src).manifest.model["seq_len_interpolation_factor"] == 2.0
    out = export_hf(src, tmp_path / "hf", "llama", progress=False)
    linear = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    assert json.loads((out / "config.json").read_text())["rope_parameters"] == linear
    hints = archs.hints_from_args(argparse.Namespace(swiglu=True, rotary_seq_len_interpolation_factor=2))
    out = export(HFSource(saved["llama"]), tmp_path / "hf2", "llama", hints=hints, progress=False,
                 hf_template=False)  # (another RoPE than the HF model's: not with its config.json)
    rope = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert rope == {**linear, "rope_theta": 50000.0}


def test_llama_3_rope_scaling_without_its_factor_is_not_exported(saved, tmp_path):
    """A live save of a GPTModel with rope_scaling records the flag (its factor is not kept by
    megatron-core): exporting it as default RoPE would be silently wrong, so it is refused by name
    unless the factor is known (an import-hf record or Megatron-LM's --rope-scaling-factor)."""
    import_hf(saved["llama"], tmp_path / "u", progress=False)
    model = {**open_source(tmp_path / "u").manifest.model, "rope_scaling": True}
    with pytest.raises(UCPError, match="model config rope_scaling=True: Llama 3 RoPE scaling's factor "
                                       "is not recorded"):
        archs.get("llama").check_exportable(model, {"activation": "swiglu"})
    archs.get("llama").check_exportable(model, {"activation": "swiglu", "rope_scaling_factor": 8.0})


# --------------------------------------------------------------------- weights-only imports


def _data_bytes(udir: Path) -> int:
    return sum(p.stat().st_size for p in Path(udir).glob("params_*.safetensors"))


def _same_reads(a, b) -> None:
    """Every state of every parameter (a weights-only one's zeros included), read whole and as a
    box of rows (a load's read), is bitwise the same fp32 tensor from both sources; steps too."""
    assert a.manifest.params.keys() == b.manifest.params.keys()
    for name, p in b.manifest.params.items():
        assert a.step(name) == b.step(name) == 0.0
        rows = (p.shape[0] // 2, *p.shape[1:])
        for state in p.states:
            for offset, shape in (((0,) * len(p.shape), p.shape), ((1, *[0] * (len(p.shape) - 1)), rows)):
                x, y = a.read(name, state, offset, shape), b.read(name, state, offset, shape)
                into = torch.empty(shape, dtype=torch.float32)
                a.read_into(name, state, offset, shape, into)
                assert x.dtype == y.dtype == torch.float32, (name, state)
                assert torch.equal(x.view(torch.int32), y.view(torch.int32)), (name, state)
                assert torch.equal(into.view(torch.int32), y.view(torch.int32)), (name, state)


@pytest.mark.parametrize("name, stored", [("llama_bf16", torch.bfloat16), ("llama", torch.float32)])
def test_import_writes_the_weights_only(saved, tmp_path, name, stored):
    """import-hf writes each weight once, in its HF dtype, and no optimizer state: the data
    holds exactly the HF directory's tensor bytes (the full form: 6x for bf16 weights, 3x for
    fp32), the manifest says weights_only (format version 5), and every read gives bitwise what
    the full form gives (fp32 masters; zero moments, step 0)."""
    wo = import_hf(saved[name], tmp_path / "wo", progress=False)
    full = import_hf(saved[name], tmp_path / "full", progress=False, weights_only=False)
    manifest, stored_tensors = oracles.universal_tensors(wo)
    assert manifest["version"] == 5 and manifest["weights_only"] is True
    assert sorted(stored_tensors) == sorted(f"{n}/param" for n in manifest["params"])
    assert {t.dtype for t in stored_tensors.values()} == {stored}
    hf_bytes = sum(t.numel() * t.element_size() for t in tensors(saved[name]).values())
    assert sum(t.numel() * t.element_size() for t in stored_tensors.values()) == hf_bytes
    # (hf_files: the HF directory's other files, here save_pretrained's generation_config.json)
    assert sorted(p.name for p in wo.iterdir()) == ["hf_files", "manifest.json", "params_00000.safetensors"]
    assert hf_bytes < _data_bytes(wo) < hf_bytes + 4096  # (+ the safetensors header)
    width = 6 if stored == torch.bfloat16 else 3
    assert _data_bytes(full) > width * hf_bytes
    full_manifest = json.loads((full / "manifest.json").read_text())
    assert full_manifest["version"] == 3 and "weights_only" not in full_manifest
    _same_reads(open_source(wo), open_source(full))


def test_weights_only_keeps_a_mixed_dtype_tensor_in_fp32(saved, tmp_path):
    """A universal tensor joined from HF tensors of different dtypes (q, v bf16 and k fp32) is
    recorded and stored as float32, which holds each exactly; the rest stays bf16."""
    k = "model.layers.0.self_attn.k_proj.weight"
    src = copy_with(saved["llama_bf16"], tmp_path / "mixed",
                    add={k: tensors(saved["llama_bf16"])[k].float()})
    wo = import_hf(src, tmp_path / "wo", progress=False)
    manifest, stored = oracles.universal_tensors(wo)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert manifest["params"][qkv]["dtype"] == "float32" and stored[f"{qkv}/param"].dtype == torch.float32
    assert {t.dtype for n, t in stored.items() if n != f"{qkv}/param"} == {torch.bfloat16}
    _same_reads(open_source(wo), open_source(import_hf(src, tmp_path / "full", progress=False,
                                                       weights_only=False)))


def test_weights_only_manifest_is_checked(saved, tmp_path, monkeypatch):
    """A reader of format version 4 refuses a weights-only manifest by its version (it cannot
    misread the missing moments); this one refuses weights_only in an older version, optimizer
    state tensors or a step in a weights-only entry, and a header dtype its spec does not say."""
    from megatron_ucp.formats import manifest as mf

    wo = import_hf(saved["llama_bf16"], tmp_path / "wo", progress=False)
    good = json.loads((wo / "manifest.json").read_text())
    with monkeypatch.context() as m:
        m.setattr(mf, "VERSION", 4)
        with pytest.raises(UCPError, match=r"format version 5 is newer than this megatron-ucp "
                                           r"understands \(4\); upgrade megatron-ucp"):
            mf.read(wo)
    ln = "decoder.final_layernorm.weight"

    def edited(fn) -> dict:
        d = json.loads(json.dumps(good))
        fn(d)
        return d

    exp_avg = {**good["params"][ln]["tensors"]["param"], "key": f"{ln}/exp_avg"}
    for bad, match in [
            (edited(lambda d: d.update(version=4)), r"weights_only: is a field of format version 5"),
            (edited(lambda d: d.update(weights_only="yes")), r"weights_only: expected bool"),
            (edited(lambda d: d["params"][ln]["tensors"].update(exp_avg=exp_avg)),
             rf"params\['{ln}'\].tensors: unknown field\(s\) \['exp_avg'\]"),
            (edited(lambda d: d["params"][ln].update(step=3.0)),
             rf"params\['{ln}'\].step: 3.0 in a weights-only checkpoint")]:
        with pytest.raises(UCPError, match=match):
            mf.Manifest.from_json(bad, "manifest.json")
    # the full form has every state: without weights_only its missing moments are refused
    with pytest.raises(UCPError, match=r"required field\(s\) \['exp_avg', 'exp_avg_sq'\] missing"):
        mf.Manifest.from_json(edited(lambda d: d.pop("weights_only")), "manifest.json")
    (wo / "manifest.json").write_text(json.dumps(edited(lambda d: d["params"][ln].update(dtype="float32"))))
    with pytest.raises(UCPError, match=rf"tensor '{ln}/param' is BF16 \[32\] in the file's header, "
                                       r"the checkpoint expects F32 \[32\]"):
        open_source(wo).read(ln, "param", (0,), (32,))


def test_weights_only_consumers(saved, tmp_path, capsys):
    """inspect and verify say weights only; diff against the full form finds nothing (its zero rows
    say why); reshard to universal keeps it weights only; export-hf gives the HF tensors bit for
    bit; the Megatron-LM targets (which need optimizer state and hyper-parameters) refuse it by
    name, before any work."""
    from megatron_ucp.checks import diff, format_diff
    from megatron_ucp.conversion import reshard, write_legacy, write_torch_dist
    from megatron_ucp.layout import Layout

    wo = tmp_path / "wo"
    assert main(["import-hf", str(saved["llama_bf16"]), str(wo), "--no-progress"]) == 0
    full = import_hf(saved["llama_bf16"], tmp_path / "full", progress=False, weights_only=False)
    capsys.readouterr()
    assert main(["inspect", str(wo)]) == 0
    out = capsys.readouterr().out
    assert "universal (format megatron-ucp v5)" in out
    assert "optimizer    weights only, optimizer starts fresh (no optimizer state on disk" in out
    assert main(["verify", str(wo)]) == 0
    n = len(open_source(wo).manifest.params)
    assert f"universal, weights only (no optimizer state), iteration 0, {n} parameters, {n} tensors " \
           "verified" in capsys.readouterr().out
    rows = diff(wo, full)
    assert format_diff(rows).endswith("identical")
    zeros = [r for r in rows if r.state in ("exp_avg", "exp_avg_sq")]
    assert len(zeros) == 2 * n and all(r.note == "zero: weights only in A" for r in zeros)
    summary = reshard(wo, tmp_path / "copy", progress=False)
    assert summary.bytes_written == sum(p.stat().st_size for p in wo.rglob("*") if p.is_file())
    assert open_source(tmp_path / "copy").manifest.weights_only
    a = tensors(export(open_source(wo), tmp_path / "hf", "llama", progress=False))
    b = tensors(saved["llama_bf16"])
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in b)
    for write in (write_legacy, write_torch_dist):
        with pytest.raises(UCPError, match=r"a weights-only checkpoint \(no optimizer state, no "
                                           r"optimizer hyper-parameters; manifest weights_only\).*"
                                           r"Load it with megatron_ucp.load"):
            write(wo, tmp_path / "mlm", Layout(dp=2), None, progress=False)
        assert not (tmp_path / "mlm").exists()


def test_gdn_cpu_is_transformers_gated_delta_rule():
    """The CPU stand-in for fla's chunk_gated_delta_rule (megatron_ucp.testing.gdn_cpu, which runs
    megatron-core's Gated DeltaNet here) computes transformers' Qwen3-Next recurrence bit for bit
    and its chunked form (what its forward runs) to rounding, 70 tokens over two chunks of 64."""
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    from megatron_ucp.testing.gdn_cpu import chunk_gated_delta_rule, l2norm

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 70, 4, 16, generator=g) for _ in range(3))
    decay, beta = -2 * torch.rand(2, 70, 4, generator=g), torch.rand(2, 70, 4, generator=g)
    ours, state = chunk_gated_delta_rule(l2norm(q), l2norm(k), v, decay, beta)
    assert state is None
    # (transformers 5.12.1 wants the states named)
    kw = dict(g=decay, beta=beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
    recurrent, _ = qwen3_next.torch_recurrent_gated_delta_rule(q, k, v, **kw)
    chunked, _ = qwen3_next.torch_chunk_gated_delta_rule(q, k, v, **kw)
    assert torch.equal(ours, recurrent)
    assert (ours - chunked).abs().max() <= 1e-5 * chunked.abs().max()
