"""Hugging Face export and import against real megatron-core and real transformers (CPU, tiny).

One launch trains a tiny megatron-core GPT per architecture at TP2 for 2 steps, saves it with
megatron_ucp.save and dumps its logits for fixed tokens. Each save is exported with export-hf
and loaded with transformers: same logits. Each export is imported back with import-hf and loaded
by megatron_ucp.load at TP1xDP2 in a second launch: same logits again, and training starts from
it. Nothing is downloaded: HF models are built from configs here.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from conftest import REPORT

from megatron_ucp.mcore_compat import local_mla_qk_norm_without_q_lora

transformers = pytest.importorskip("transformers")

from megatron_ucp.conversion import import_hf  # noqa: E402
from megatron_ucp.formats import open_source  # noqa: E402
from megatron_ucp.formats.hf import archs, export  # noqa: E402
from megatron_ucp.formats.hf.archs.nemotron_h import NO_DT_CLAMP  # noqa: E402
from megatron_ucp.testing.launch import launch  # noqa: E402

HF_SCENARIOS = "megatron_ucp.testing.hf_scenarios"
TOL = 1e-4  # fp32 logits, max abs difference
REL_TOL = 1e-5  # Mistral, DeepSeek-V2/V3, GLM-4.5, GPT-OSS, Nemotron-H, Qwen3-Next: max abs / max abs logit
REL_ARCHS = ("mistral", "deepseek_v2", "deepseek_v3", "glm4_moe", "nemotron_h", "qwen3_next")
TRUE_VOCAB = 250  # the model pads it to 256 (vocab rows 250..255 must not be exported)
BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
            vocab_size=256, unpadded_vocab_size=TRUE_VOCAB, seq_length=32, micro_batch_size=2,
            global_batch_size=4)
ROTARY = dict(swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
              add_bias_linear=False, num_query_groups=2)
DEEPSEEK_V3_MEGATRON = {"num_experts": 4, "qk_layernorm": True, "num_query_groups": None, "extra": {
    "moe_layer_freq": [0, 1], "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
    "moe_router_topk_scaling_factor": 2.5, "moe_shared_expert_intermediate_size": 64,
    "moe_ffn_hidden_size": 32, "multi_latent_attention": True, "q_lora_rank": 32, "kv_lora_rank": 16,
    "qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 16, "rope_type": "yarn",
    "rotary_scaling_factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0,
    "mscale_all_dim": 1.0, "layernorm_epsilon": 1e-6}}
# megatron-core's hybrid model (MambaModel; Mamba math on CPU: megatron_ucp.testing.mamba_cpu):
# Mamba-2 (8 heads of 16, 2 groups of state 8), a MoE layer (sigmoid routing with expert bias, a
# shared expert, top-2 of 4 scaled by 2.5), attention (GQA, no position embedding), a relu2 MLP
NEMOTRON_H_MEGATRON = {
    "hybrid_pattern": "ME*-", "normalization": "RMSNorm", "add_bias_linear": False, "num_query_groups": 2,
    "position_embedding_type": "none", "activation": "squared_relu", "num_experts": 4, "extra": {
        "mamba_state_dim": 8, "mamba_head_dim": 16, "mamba_num_groups": 2, "moe_ffn_hidden_size": 32,
        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "moe_router_topk_scaling_factor": 2.5, "moe_shared_expert_intermediate_size": 64}}
# GLM-4.5: GQA with q/k/v biases (none on o_proj), QK-norm, RoPE on half of each head
# (rotary_percent), the first layer dense, sigmoid routing with expert bias over 2 expert groups
# (top-1 group), 2 shared experts, top-2 of 4 scaled by 2.5
GLM4_MOE_MEGATRON = {"qk_layernorm": True, "num_experts": 4, "rotary_percent": 0.5, "extra": {
    "add_qkv_bias": True, "kv_channels": 16, "moe_layer_freq": [0, 1], "moe_router_score_function": "sigmoid",
    "moe_router_enable_expert_bias": True, "moe_router_topk_scaling_factor": 2.5,
    "moe_shared_expert_intermediate_size": 64, "moe_ffn_hidden_size": 32, "moe_router_num_groups": 2,
    "moe_router_group_topk": 1}}
# megatron-core's Gated DeltaNet GPT (Qwen3-Next; the fla math on CPU: megatron_ucp.testing.gdn_cpu):
# linear attention (2 key heads of 16 serving 4 value heads of 16) and gated attention with QK-norm
# and partial rotary (a quarter of head_dim 16) alternating, zero-centered norms, MoE layers (top-2
# of 4, a gated shared expert) and a dense third layer
QWEN3_NEXT_MEGATRON = {
    "num_layers": 4, "qk_layernorm": True, "num_experts": 4, "rotary_percent": 0.25, "extra": {
        "kv_channels": 16, "layernorm_epsilon": 1e-6, "layernorm_zero_centered_gamma": True,
        "attention_output_gate": True, "experimental_attention_variant": "gated_delta_net",
        "linear_attention_freq": [1, 0, 1, 0], "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "moe_layer_freq": [1, 1, 0, 1], "moe_ffn_hidden_size": 32, "moe_shared_expert_intermediate_size": 64,
        "moe_shared_expert_gate": True}}
# the test table: the megatron-core model trained per architecture (GPT-OSS: NATIVE_NEW only)
CFGS = {
    "llama": {**BASE, **ROTARY, "untie_embeddings": True},  # GQA, untied, no biases
    "qwen2": {**BASE, **ROTARY, "extra": {"add_qkv_bias": True}},  # q/k/v biases, tied
    # a sliding window on every layer: megatron-core's (4, 0), transformers' sliding_window 5
    "mistral": {**BASE, **ROTARY, "untie_embeddings": True, "extra": {"window_size": [4, 0]}},
    "gpt2": dict(BASE),  # megatron's default GPT: learned positions, GELU, biases, LayerNorm, tied
    # top-2 of 4 experts; megatron-core's MoE wants sequence parallelism with TP
    "mixtral": {**BASE, **ROTARY, "untie_embeddings": True, "num_experts": 4,
                "sequence_parallel": True},
    "qwen3": {**BASE, **ROTARY, "qk_layernorm": True},  # QK-norm, GQA, tied
    # QK-norm, top-2 of 4 experts, no shared expert; expert FFN narrower than the dense one
    "qwen3_moe": {**BASE, **ROTARY, "qk_layernorm": True, "untie_embeddings": True, "num_experts": 4,
                  "sequence_parallel": True, "extra": {"moe_ffn_hidden_size": 96}},
    # MLA with a query LoRA rank and YaRN, the first layer dense, sigmoid routing with expert bias,
    # shared experts, scaled top-2 of 4, one MTP layer (exported as model.layers.2)
    "deepseek_v3": {**BASE, **ROTARY, **DEEPSEEK_V3_MEGATRON, "untie_embeddings": True,
                    "sequence_parallel": True,
                    "extra": {**DEEPSEEK_V3_MEGATRON["extra"], "mtp_num_layers": 1}},
    # with one MTP layer (exported as model.layers.2)
    "glm4_moe": {**BASE, **ROTARY, **GLM4_MOE_MEGATRON, "untie_embeddings": True, "sequence_parallel": True,
                 "extra": {**GLM4_MOE_MEGATRON["extra"], "mtp_num_layers": 1}},
    # tied: transformers' Nemotron-H never ties, the export stores the embedding as lm_head too
    "nemotron_h": {**BASE, **NEMOTRON_H_MEGATRON, "sequence_parallel": True},
    # Gated DeltaNet and gated attention layers at TP2 (in_proj's six sections split per rank)
    "qwen3_next": {**BASE, **ROTARY, **QWEN3_NEXT_MEGATRON, "untie_embeddings": True,
                   "sequence_parallel": True},
}
# a transformers Llama built here (biases everywhere, tied, head_dim != hidden / heads) and the
# megatron-core model of the same architecture (vocabulary 100 padded to 128)
NATIVE_HF = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, attention_bias=True,
                 mlp_bias=True, tie_word_embeddings=True, max_position_embeddings=32,
                 rms_norm_eps=1e-5)
NATIVE_CFG = {**BASE, **ROTARY, "add_bias_linear": True, "vocab_size": 128,
              "unpadded_vocab_size": 100, "extra": {"kv_channels": 32}}
# GPT-OSS's own YaRN (gpt-oss-20b's config.json but rope_theta): the correction range not rounded
GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0, "beta_fast": 32.0,
                "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False}
# transformers-made DeepSeek-V3 and GPT-OSS (every tensor random, the expert bias included) and
# the megatron-core models they import as (vocabulary 100 padded to 128). GPT-OSS: not trained in
# megatron-core, which cannot backpropagate through experts with biases at EP1, the layout here
# (0.16.1 and 0.19.2; at EP > 1 it can: tests/fixtures/megatron_lm_v019/README.md)
# DeepSeek-V2-Lite's MLA (no query LoRA) where megatron-core builds it (0.16), else a query LoRA
# rank (0.19's local spec cannot build it: import-hf refuses it there, tests/test_hf_import.py)
V2_Q_LORA = None if local_mla_qk_norm_without_q_lora() else 32
NATIVE_NEW = {
    # Mistral with sliding_window 5 on every layer (16 tokens), head_dim != hidden / heads
    "mistral": ("MistralConfig", dict(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=5, max_position_embeddings=32,
        rms_norm_eps=1e-5, tie_word_embeddings=False),
        {**BASE, **ROTARY, "untie_embeddings": True, "vocab_size": 128, "unpadded_vocab_size": 100,
         "extra": {"window_size": [4, 0], "kv_channels": 32}}),
    "deepseek_v3": ("DeepseekV3Config", dict(
        vocab_size=100, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=4,
        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=1,
        topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
        max_position_embeddings=32, rms_norm_eps=1e-6, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "mscale": 1.0, "mscale_all_dim": 1.0}),
        {**BASE, **ROTARY, **DEEPSEEK_V3_MEGATRON, "untie_embeddings": True, "vocab_size": 128,
         "unpadded_vocab_size": 100}),
    # DeepSeek-V2-Lite's attention (no query LoRA: linear_q_proj) with DeepSeek-V2's routing:
    # softmax top-3 of 6 scaled by 1.5 within the best 2 of 3 expert groups (group_limited_greedy:
    # 3 experts of 3 groups may be the best), 2 shared experts; YaRN with DeepSeek's
    # mscale = mscale_all_dim (the softmax scaled, cos/sin not)
    "deepseek_v2": ("DeepseekV2Config", dict(
        vocab_size=100, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=6,
        kv_lora_rank=16, q_lora_rank=V2_Q_LORA, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
        topk_method="group_limited_greedy", n_group=3, topk_group=2, num_experts_per_tok=3,
        first_k_dense_replace=1, routed_scaling_factor=1.5, max_position_embeddings=32, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "mscale": 0.707, "mscale_all_dim": 0.707}),
        {**BASE, **ROTARY, **DEEPSEEK_V3_MEGATRON, "num_experts": 6, "untie_embeddings": True,
         "vocab_size": 128, "unpadded_vocab_size": 100, "extra": {
             **DEEPSEEK_V3_MEGATRON["extra"], "moe_router_score_function": "softmax",
             "moe_router_pre_softmax": True, "moe_router_enable_expert_bias": False,
             "moe_router_topk": 3, "moe_router_topk_scaling_factor": 1.5, "q_lora_rank": V2_Q_LORA,
             "mscale": 0.707, "mscale_all_dim": 0.707, "moe_router_num_groups": 3,
             "moe_router_group_topk": 2}}),
    "glm4_moe": ("Glm4MoeConfig", dict(
        vocab_size=100, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True, use_qk_norm=True,
        n_shared_experts=2, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=32, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        {**BASE, **ROTARY, **GLM4_MOE_MEGATRON, "untie_embeddings": True, "vocab_size": 128,
         "unpadded_vocab_size": 100}),
    "gpt_oss": ("GptOssConfig", dict(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
        max_position_embeddings=32, rope_parameters=GPT_OSS_YARN),
        {**BASE, **ROTARY, "add_bias_linear": True, "untie_embeddings": True, "activation": "quick_gelu",
         "num_experts": 4, "vocab_size": 128, "unpadded_vocab_size": 100, "position_embedding_type": "yarn",
         "extra": {
             "add_qkv_bias": True, "softmax_type": "learnable", "window_size": [4, 0],
             "window_attn_skip_freq": 2, "glu_linear_offset": 1.0, "activation_func_clamp_value": 7.0,
             "kv_channels": 16, "yarn_rotary_scaling_factor": 32.0,
             "yarn_original_max_position_embeddings": 4096, "yarn_correction_range_round_to_int": False}}),
    "nemotron_h": ("NemotronHConfig", dict(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=32, layers_block_type=["linear_attention", "moe",
                                                                    "full_attention", "mlp"],
        ssm_state_size=8, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=64,
        routed_scaling_factor=2.5, time_step_min=NO_DT_CLAMP),
        {**BASE, **NEMOTRON_H_MEGATRON, "untie_embeddings": True, "vocab_size": 128,
         "unpadded_vocab_size": 100}),
    "qwen3_next": ("Qwen3NextConfig", dict(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=32,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        mlp_only_layers=[2], rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.25}),
        {**BASE, **ROTARY, **QWEN3_NEXT_MEGATRON, "untie_embeddings": True, "vocab_size": 128,
         "unpadded_vocab_size": 100}),
}
# the architectures trained in megatron-core here, in the registry's order
ARCHS = tuple(a for a in archs.ARCHS if a in CFGS)
NATIVE_TOKENS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(8)).tolist()
TOKENS = torch.randint(0, TRUE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(7)).tolist()
SHARD_BYTES = 200_000  # several shards per tiny model


# architectures whose megatron-core model is another's, under another config.json: the run of that
# one exported as this (transformers has no kimi_k2 class: `test_kimi_k2_export_gives_megatron_logits`)
SAME_MODEL_AS = {"kimi_k2": "deepseek_v3"}


def test_every_arch_is_tested():
    """An architecture of the registry is trained in megatron-core here, or made by transformers."""
    assert set(CFGS) | set(NATIVE_NEW) | set(SAME_MODEL_AS) == set(archs.ARCHS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Per arch: `<arch>/ckpt` (megatron_ucp.save at TP2 after 2 steps), `<arch>/megatron.pt`
    (its logits for TOKENS), `<arch>/hf` (export-hf of it)."""
    root = tmp_path_factory.mktemp("hf")
    todo = [{"cfg": CFGS[a], "save_dir": str(root / a / "ckpt"), "logits": str(root / a / "megatron.pt")}
            for a in ARCHS]
    launch(2, f"{HF_SCENARIOS}:train_save_logits", {"layout": "tp2", "runs": todo, "steps": 2,
                                                      "tokens": TOKENS})
    for a in ARCHS:
        export(open_source(root / a / "ckpt"), root / a / "hf", a, max_shard_bytes=SHARD_BYTES,
               progress=False)
    return root

# Llama 3.1-3.3's RoPE scaling (rope_type llama3, Llama-3.1-8B's values but a small model) and the
# megatron-core model it imports as (GPTModel rope_scaling, its factor); exported as llama
LLAMA_3_1 = ("LlamaConfig", dict(
    vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=32, tie_word_embeddings=False,
    rms_norm_eps=1e-5, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    {**BASE, **ROTARY, "untie_embeddings": True, "vocab_size": 128, "unpadded_vocab_size": 100,
     "rotary_base": 500000, "rope_scaling": True, "rope_scaling_factor": 8.0})
# linear and YaRN RoPE scaling for the llama-likes (issue 34), run for 32 tokens past an original
# context of 8: transformers-made models and the megatron-core models they import as, whose RoPE
# settings are the import's run record (Megatron-LM's flags: `rope_from_record`)
SMALL_ROTARY = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=32,
                    tie_word_embeddings=False, rms_norm_eps=1e-5)
SMALL_ROTARY_CFG = {**BASE, **ROTARY, "untie_embeddings": True, "vocab_size": 128, "unpadded_vocab_size": 100}
ROPE_VARIANTS = {
    "llama_linear": ("LlamaConfig", dict(**SMALL_ROTARY, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}), SMALL_ROTARY_CFG),
    # an explicit attention_factor (megatron-core's mscale that gives it), the range not rounded
    "qwen2_yarn": ("Qwen2Config", dict(**SMALL_ROTARY, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "attention_factor": 1.25, "beta_fast": 8.0, "beta_slow": 2.0, "truncate": False}),
        {**SMALL_ROTARY_CFG, "extra": {"add_qkv_bias": True}}),
    # transformers' inferred attention factor mscale(factor) / mscale(factor, mscale_all_dim)
    "qwen3_yarn": ("Qwen3Config", dict(**SMALL_ROTARY, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 8,
        "mscale": 1.0, "mscale_all_dim": 0.5}), {**SMALL_ROTARY_CFG, "qk_layernorm": True}),
}
NATIVE_MODELS = {**NATIVE_NEW, "llama3.1": LLAMA_3_1, **ROPE_VARIANTS}
NATIVE_ARCH = {"llama3.1": "llama", "llama_linear": "llama", "qwen2_yarn": "qwen2", "qwen3_yarn": "qwen3"}
LONG_TOKENS = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(9)).tolist()


def native_tokens(name: str) -> list:
    return LONG_TOKENS if name in ROPE_VARIANTS else NATIVE_TOKENS


def rope_from_record(cfg: dict, imported: Path) -> dict:
    """`cfg` with the RoPE settings the import recorded as Megatron-LM flags (`hf_import.megatron`)
    as the tiny GPT takes them: GPTModel's seq_len_interpolation_factor, its YaRN config.yarn_*."""
    from megatron_ucp.formats.megatron_common import YARN_FROM_ARGS

    run = open_source(imported).manifest.extra["hf_import"]["megatron"]
    out = {**cfg, "extra": dict(cfg.get("extra", {}))}
    if run.get("rotary_seq_len_interpolation_factor") is not None:
        out["seq_len_interpolation_factor"] = run["rotary_seq_len_interpolation_factor"]
    if run.get("position_embedding_type") == "yarn":
        out["position_embedding_type"] = "yarn"
        out["extra"].update({attr: run[arg] for attr, arg, _ in YARN_FROM_ARGS})
    return out


@pytest.fixture(scope="module")
def reloaded(runs) -> list[list[dict]]:
    """import-hf of every export, loaded at TP1xDP2 (logits in `<arch>/reloaded.pt`), then one
    training step from the fresh optimizer."""
    todo = []
    for a in ARCHS:
        import_hf(runs / a / "hf", runs / a / "imported", progress=False)
        # (sequence parallelism needs TP > 1)
        todo.append({"cfg": {**CFGS[a], "sequence_parallel": False},
                     "load_dir": str(runs / a / "imported"),
                     "logits": str(runs / a / "reloaded.pt")})
    torch.manual_seed(0)
    native = transformers.LlamaForCausalLM(transformers.LlamaConfig(**NATIVE_HF))
    with torch.no_grad():  # nothing at its init value (zero biases, unit norms)
        for p in native.parameters():
            p.normal_(0, 0.2)
        torch.save(native.eval()(torch.tensor(NATIVE_TOKENS)).logits, runs / "native_hf.pt")
    native.save_pretrained(runs / "native_hf")
    import_hf(runs / "native_hf", runs / "native_imported", progress=False)
    todo.append({"cfg": NATIVE_CFG, "load_dir": str(runs / "native_imported"),
                 "logits": str(runs / "native_megatron.pt"), "tokens": NATIVE_TOKENS,
                 "resave_dir": str(runs / "native_resaved")})
    for a, (config_class, kwargs, cfg) in NATIVE_MODELS.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**kwargs))
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.2)
            for n, b in model.named_buffers():  # DeepSeek-V3's expert bias is a saved buffer
                if n.endswith("e_score_correction_bias"):
                    b.normal_(0, 0.2)
            # Qwen3-Next's gated norm around its initial 1, in [0.5, 2): megatron-core holds it
            # zero-centered, w - 1, exact there (tensor_transforms `plus_one`)
            for n, p in model.named_parameters():
                if n.endswith("linear_attn.norm.weight"):
                    p.add_(1).clamp_(0.5, 1.99)
            torch.save(model.eval()(torch.tensor(native_tokens(a))).logits, runs / f"native_{a}.pt")
        model.save_pretrained(runs / f"native_{a}")
        import_hf(runs / f"native_{a}", runs / f"native_{a}_imported", progress=False)
        if a in ROPE_VARIANTS:
            cfg = rope_from_record(cfg, runs / f"native_{a}_imported")
        todo.append({"cfg": cfg, "load_dir": str(runs / f"native_{a}_imported"),
                     "logits": str(runs / f"native_{a}_megatron.pt"), "tokens": native_tokens(a),
                     "resave_dir": str(runs / f"native_{a}_resaved"),
                     "train_steps": 0 if a == "gpt_oss" else 1})
    # the same Llama in bf16, imported weights-only (the default) and in the full form (zero fp32
    # moments on disk), each loaded into a bf16 run at TP1xDP2 and trained a step; weights-only
    # also into runs of other optimizers, which the full form's Adam state refuses
    native.to(torch.bfloat16).save_pretrained(runs / "native_bf16_hf")
    import_hf(runs / "native_bf16_hf", runs / "native_bf16_weights_only", progress=False)
    import_hf(runs / "native_bf16_hf", runs / "native_bf16_full", progress=False, weights_only=False)
    for form, cfg in WEIGHTS_ONLY_RUNS.items():
        src = "native_bf16_full" if form == "full" else "native_bf16_weights_only"
        todo.append({"cfg": cfg, "load_dir": str(runs / src), "tokens": NATIVE_TOKENS,
                     "logits": str(runs / f"{form}_logits.pt"), "weights": str(runs / f"{form}_weights.pt"),
                     "resave_dir": str(runs / f"{form}_resaved")})
    return launch(2, f"{HF_SCENARIOS}:load_logits", {"layout": "tp1dp2", "runs": todo,
                                                     "tokens": TOKENS})


NATIVE_BF16_CFG = {**NATIVE_CFG, "dtype": "bf16"}
# the loads of the bf16 Llama's two import forms (`reloaded`, after the NATIVE_MODELS runs): the
# weights-only one also into an SGD run (plain DDP, momentum) and, where emerging-optimizers is
# installed (megatron-core 0.19's venv), a Muon run (LayerWise: Muon for matrices, Adam for the rest)
WEIGHTS_ONLY_RUNS = {"full": NATIVE_BF16_CFG, "weights_only": NATIVE_BF16_CFG,
                     "weights_only_sgd": {**NATIVE_BF16_CFG, "optimizer": "sgd",
                                          "use_distributed_optimizer": False,
                                          "optimizer_extra": {"sgd_momentum": 0.9}}}
if importlib.util.find_spec("emerging_optimizers") is not None:
    WEIGHTS_ONLY_RUNS["weights_only_muon"] = {**NATIVE_BF16_CFG, "optimizer": "muon", "optimizer_extra": {
        "use_layer_wise_distributed_optimizer": True, "muon_tp_mode": "duplicated"}}
WEIGHTS_ONLY_FAMILIES = {"weights_only": {"adam"}, "weights_only_sgd": {"sgd"},
                         "weights_only_muon": {"muon", "adam"}}


def hf_logits(hf_dir: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("arch", ARCHS)
def test_export_gives_megatron_logits(runs, arch):
    megatron = torch.load(runs / arch / "megatron.pt")
    hf = hf_logits(runs / arch / "hf")
    assert hf.shape == (2, 16, TRUE_VOCAB)  # padding rows trimmed
    diff = max_diff(hf, megatron[..., :TRUE_VOCAB])
    print(f"{arch}: megatron TP2 vs transformers logits max abs diff {diff:.3g}")
    REPORT[f"hf-export:{arch}"] = {"max_abs_logit_diff": diff,
                                   "max_rel_logit_diff": rel_diff(hf, megatron[..., :TRUE_VOCAB])}
    assert diff <= TOL and (arch not in REL_ARCHS or rel_diff(hf, megatron[..., :TRUE_VOCAB]) <= REL_TOL)


def test_kimi_k2_export_gives_megatron_logits(runs, tmp_path):
    """The megatron-core DeepSeek-V3 run (MLA, YaRN, sigmoid routing with expert bias, one MTP
    layer) exported as kimi_k2: Kimi-K2's config.json, which transformers' DeepseekV3ForCausalLM
    runs (model_type rewritten: transformers has no kimi_k2 class) to the megatron logits."""
    out = export(open_source(runs / "deepseek_v3" / "ckpt"), tmp_path / "kimi", "kimi_k2", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k2" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_deepseek.DeepseekV3ForCausalLM"
    assert cfg["rope_scaling"]["type"] == "yarn" and cfg["scoring_func"] == "sigmoid"
    assert cfg["num_nextn_predict_layers"] == 1
    del cfg["auto_map"]
    (out / "config.json").write_text(json.dumps({**cfg, "model_type": "deepseek_v3"}))
    megatron = torch.load(runs / "deepseek_v3" / "megatron.pt")[..., :TRUE_VOCAB]
    hf = hf_logits(out)
    rel = rel_diff(hf, megatron)
    print(f"kimi_k2: megatron TP2 (deepseek_v3 run) vs transformers logits max abs diff "
          f"{max_diff(hf, megatron):.3g}, relative {rel:.3g}")
    REPORT["hf-export:kimi_k2"] = {"max_abs_logit_diff": max_diff(hf, megatron), "max_rel_logit_diff": rel}
    assert rel <= REL_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_exported_directory(runs, arch):
    out = runs / arch / "hf"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files
    assert all(f.startswith("model-") and f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == arch and cfg["vocab_size"] == TRUE_VOCAB
    assert cfg["tie_word_embeddings"] == (not CFGS[arch].get("untie_embeddings", False))
    # (transformers' Nemotron-H never ties: a tied embedding is stored as lm_head too)
    assert ("lm_head.weight" in index["weight_map"]) == (CFGS[arch].get("untie_embeddings", False)
                                                         or arch == "nemotron_h")
    assert (out / "generation_config.json").is_file()
    if arch == "nemotron_h":
        assert cfg["layers_block_type"] == ["linear_attention", "moe", "full_attention", "mlp"]
        assert (cfg["mamba_num_heads"], cfg["n_groups"], cfg["conv_kernel"], cfg["num_key_value_heads"]) \
            == (8, 2, 4, 2)
        return
    if arch != "gpt2":  # (multi-latent attention has a key and value per head)
        assert cfg["num_key_value_heads"] == (4 if arch == "deepseek_v3" else 2)
        assert cfg["rope_parameters"]["rope_theta"] == 10000.0
    if arch == "glm4_moe":  # RoPE on half of each head; q/k/v biases, no o_proj bias
        assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.5 and cfg["attention_bias"]
        assert "model.layers.0.self_attn.q_proj.bias" in index["weight_map"]
        assert "model.layers.0.self_attn.o_proj.bias" not in index["weight_map"]
    if arch in ("deepseek_v3", "glm4_moe"):  # the MTP layer as DeepSeek's extra decoder layer
        assert cfg["num_nextn_predict_layers"] == 1 and cfg["first_k_dense_replace"] == 1
        assert {"model.layers.2.eh_proj.weight", "model.layers.2.shared_head.head.weight",
                "model.layers.1.mlp.gate.e_score_correction_bias"} <= set(index["weight_map"])


@pytest.mark.parametrize("arch", ARCHS)
def test_import_loads_at_another_layout(runs, reloaded, arch):
    for rank in reloaded:  # each rank: iteration 0, zero Adam moments at step 0, then a step
        result = rank[ARCHS.index(arch)]
        assert result["iteration"] == 0 and result["fresh_optimizer"] and result["finite"]
    megatron = torch.load(runs / arch / "megatron.pt")
    diff = max_diff(torch.load(runs / arch / "reloaded.pt")[..., :TRUE_VOCAB], megatron[..., :TRUE_VOCAB])
    print(f"{arch}: megatron TP2 vs export -> import-hf -> load at TP1xDP2 logits max abs diff {diff:.3g}")
    rel = rel_diff(torch.load(runs / arch / "reloaded.pt")[..., :TRUE_VOCAB], megatron[..., :TRUE_VOCAB])
    REPORT[f"hf-import:{arch}"] = {"max_abs_logit_diff": diff, "max_rel_logit_diff": rel}
    assert diff <= TOL and (arch not in REL_ARCHS or rel <= REL_TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_imported_specs_are_megatron_cores(runs, arch):
    """import-hf's specs (from megatron-core's model rebuilt for the HF config) equal those
    megatron_ucp.save derived from the trained model, up to the vocabulary padding."""
    saved = open_source(runs / arch / "ckpt").manifest
    src = open_source(runs / arch / "hf")
    assert src.format == "hf" and set(src.manifest.params) == set(saved.params)
    for name, p in saved.params.items():
        mine = src.manifest.params[name].spec
        assert (mine.tp_axis, mine.tp_blocks, mine.tp_sections, mine.vocab_rows, mine.buffer) == \
            (p.spec.tp_axis, p.spec.tp_blocks, p.spec.tp_sections, p.spec.vocab_rows, p.spec.buffer), name
        rows = TRUE_VOCAB if p.spec.vocab_rows else p.spec.shape[0]
        assert mine.shape == (rows, *p.spec.shape[1:]), name
    assert src.manifest.extra["fresh_optimizer"] is True
    assert all(src.step(n) == 0.0 for n in src.manifest.params)


def test_transformers_model_imports_into_megatron(runs, reloaded):
    """A model transformers saved (not one export-hf wrote) computes the same in megatron-core
    after import-hf and megatron_ucp.load at TP1xDP2."""
    assert all(rank[len(ARCHS)]["fresh_optimizer"] for rank in reloaded)
    megatron = torch.load(runs / "native_megatron.pt")[..., :100]
    diff = max_diff(megatron, torch.load(runs / "native_hf.pt"))
    print(f"llama (transformers-made, biases, head_dim 32): import-hf -> megatron TP1xDP2 logits "
          f"max abs diff {diff:.3g}")
    assert diff <= TOL


def test_transformers_model_round_trips_through_megatron(runs, reloaded, tmp_path):
    """transformers -> import-hf -> megatron_ucp.load at TP1xDP2 (vocabulary padded to 128) ->
    megatron_ucp.save -> export-hf: the same tensors, bit for bit, and the same config."""
    from safetensors.torch import load_file

    out = export(open_source(runs / "native_resaved"), tmp_path / "hf", "llama", progress=False)
    want = {k: v for f in (runs / "native_hf").glob("*.safetensors") for k, v in load_file(f).items()}
    got = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert sorted(want) == sorted(got)
    assert all(torch.equal(want[k], got[k]) for k in want)
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in NATIVE_HF} == NATIVE_HF


def test_round_trip_through_tp2pp2(runs, reloaded, tmp_path):
    """The same through megatron_ucp.load at TP2xPP2 (4 ranks; tied embeddings on both stages):
    export-hf of its save gives the transformers tensors bit for bit."""
    from safetensors.torch import load_file

    launch(4, f"{HF_SCENARIOS}:load_logits", {
        "layout": "tp2pp2", "tokens": NATIVE_TOKENS,
        "runs": [{"cfg": NATIVE_CFG, "load_dir": str(runs / "native_imported"),
                  "resave_dir": str(tmp_path / "resaved")}]})
    out = export(open_source(tmp_path / "resaved"), tmp_path / "hf", "llama", progress=False)
    want = {k: v for f in (runs / "native_hf").glob("*.safetensors") for k, v in load_file(f).items()}
    got = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)


def test_weights_only_import_loads_as_the_full_form(runs, reloaded):
    """import-hf's weights-only checkpoint (the bf16 weights alone) loaded at TP1xDP2 into a bf16
    run gives bitwise what the full form (fp32 masters, zero moments on disk) gives: model weights,
    logits, fp32 master weights, zero moments, step 0, and the loss of the first step from them;
    into SGD and Muon runs too (no reset_optimizer: it has no Adam state to refuse), their
    momentum zero."""
    first = len(ARCHS) + 1 + len(NATIVE_MODELS)
    result = {form: [rank[first + i] for rank in reloaded] for i, form in enumerate(WEIGHTS_ONLY_RUNS)}
    assert [r["weights_only"] for r in result["full"]] == [False, False]
    forms = [form for form in WEIGHTS_ONLY_RUNS if form != "full"]
    for form in forms:
        assert all(r["iteration"] == 0 and r["fresh_optimizer"] and r["weights_only"] for r in result[form])
    assert [r["losses"] for r in result["weights_only"]] == [r["losses"] for r in result["full"]]
    for what in ("logits", "weights"):
        full = torch.load(runs / f"full_{what}.pt")
        for form in forms:
            got = torch.load(runs / f"{form}_{what}.pt")
            if what == "logits":
                assert torch.equal(got, full), form
            else:
                assert got.keys() == full.keys() and all(
                    got[k].dtype == torch.bfloat16 and torch.equal(got[k], full[k]) for k in full), form
    full = open_source(runs / "full_resaved")
    for form in forms:
        resaved = open_source(runs / f"{form}_resaved")
        assert resaved.manifest.params.keys() == full.manifest.params.keys()
        for name, p in resaved.manifest.params.items():
            box = ((0,) * len(p.shape), p.shape)
            assert resaved.step(name) == full.step(name) == 0.0, name
            want = full.read(name, "param", *box)
            assert torch.equal(resaved.read(name, "param", *box).view(torch.int32), want.view(torch.int32))
            for state in p.states:
                if state != "param":
                    assert not resaved.read(name, state, *box).any(), (form, name, state)
                    assert form != "weights_only" or not full.read(name, state, *box).any()
        assert {p.spec.optimizer for p in resaved.manifest.params.values()} == WEIGHTS_ONLY_FAMILIES[form]


@pytest.mark.parametrize("arch", NATIVE_MODELS)
def test_transformers_deepseek_v3_and_gpt_oss_in_megatron(runs, reloaded, arch, tmp_path):
    """A transformers-made DeepSeek-V3 / GPT-OSS / Nemotron-H / Qwen3-Next (every tensor random:
    expert bias, sinks, router and expert biases, A_log, D, dt_bias, Gated DeltaNet's projections and
    conv1d, the shared expert's gate) and a Llama 3.1 (llama3 RoPE scaling,
    before refused) and llama-likes with linear and YaRN RoPE scaling (before refused; 32 tokens
    past an original context of 8) compute the same in megatron-core after import-hf and
    megatron_ucp.load at TP1xDP2; megatron_ucp.save of it exports back to the same safetensors bit
    for bit and the same rope_parameters, which transformers runs to the megatron logits."""
    from safetensors.torch import load_file

    result = [rank[len(ARCHS) + 1 + list(NATIVE_MODELS).index(arch)] for rank in reloaded]
    assert all(r["fresh_optimizer"] and r["finite"] for r in result)
    want = torch.load(runs / f"native_{arch}.pt")
    megatron = torch.load(runs / f"native_{arch}_megatron.pt")[..., :100]
    diff = max_diff(megatron, want)
    print(f"{arch} (transformers-made): import-hf -> megatron TP1xDP2 logits max abs diff {diff:.3g}, "
          f"relative {rel_diff(megatron, want):.3g}")
    REPORT[f"hf-import:{arch}-native"] = {"max_abs_logit_diff": diff,
                                         "max_rel_logit_diff": rel_diff(megatron, want)}
    assert rel_diff(megatron, want) <= REL_TOL
    out = export(open_source(runs / f"native_{arch}_resaved"), tmp_path / "hf",
                 NATIVE_ARCH.get(arch, arch), progress=False)
    rope = json.loads((runs / f"native_{arch}" / "config.json").read_text()).get("rope_parameters") or {}
    exported = json.loads((out / "config.json").read_text()).get("rope_parameters") or {}
    assert {k: exported.get(k) for k in rope} == rope, exported  # (defaults may be added)
    original = {k: v for f in (runs / f"native_{arch}").glob("*.safetensors")
                for k, v in load_file(f).items()}
    got = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert sorted(original) == sorted(got) and all(torch.equal(original[k], got[k]) for k in original)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        hf = model(torch.tensor(native_tokens(arch))).logits
    REPORT[f"hf-export:{arch}-native"] = {"max_abs_logit_diff": max_diff(hf, megatron),
                                          "max_rel_logit_diff": rel_diff(hf, megatron)}
    assert rel_diff(hf, megatron) <= REL_TOL
