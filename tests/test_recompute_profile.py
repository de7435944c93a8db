"""megatron_ucp.recompute.profiler: a Profile measured on real megatron-core layers (CPU shim, gloo).

One launched process profiles two models and counts what one whole layer keeps for backward with a
plain ActivationCounter (no hooks), with and without megatron-core's selective recompute:
- A: the tiny GPT (MHA, GeLU, biases, learned positions), links measured on two spawned ranks;
- B: grouped-query attention, SwiGLU, RoPE, no biases (megatron-core 0.16.1's selective "mlp"
  recompute hangs with biases).
Bytes are asserted exactly: the modules add up to the whole layer, each module equals the tensors
its rule gives it (computed here from the shapes), and a selective recompute frees exactly the
bytes attributed to the recomputed module. Times are only checked to be positive.
"""

from __future__ import annotations

import pytest

from megatron_ucp.recompute import links, profiler
from megatron_ucp.recompute.profile import MODULES, Profile, load, save
from megatron_ucp.testing.launch import launch

MODEL_A = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128,
           "seq_length": 32, "vocab_size": 256, "micro_batch_size": 2, "dtype": "fp32"}
MODEL_B = {**MODEL_A, "num_query_groups": 2, "swiglu": True, "ffn_hidden_size": 96,
           "position_embedding_type": "rope", "add_bias_linear": False}
LINK_SIZES = [4096, 65536, 1048576]
FP32 = 4


@pytest.fixture(scope="module")
def checks() -> dict:
    out = launch(1, "megatron_ucp.testing.recompute_profile:layer_checks",
                 {"models": [MODEL_A, MODEL_B],
                  "saved_cases": [[0, None], [0, ["core_attn"]], [1, None], [1, ["mlp"]]],
                  "link_sizes": LINK_SIZES})[0]
    out["profiles"] = [Profile.from_json(p, f"profile {i}") for i, p in enumerate(out["profiles"])]
    return out


def _act(profile: Profile) -> dict[str, int]:
    return {m.name: m.act_bytes for m in profile.layer}


def test_modules_in_order_with_positive_times(checks):
    for profile in checks["profiles"]:
        assert tuple(m.name for m in profile.layer) == MODULES
        assert all(m.fwd_s > 0 and m.bwd_s > 0 for m in profile.layer)
        ends = profile.ends
        assert min(ends.embedding_fwd_s, ends.embedding_bwd_s, ends.output_fwd_s, ends.output_bwd_s) > 0
        assert profile.source == "measured" and profile.device == "cpu-gloo" and profile.tp == 1
        assert profile.compute_slots >= 1


def test_module_bytes_add_up_to_the_whole_layer_exactly(checks):
    whole_a, _, whole_b, _ = checks["saved"]
    a, b = checks["profiles"]
    assert a.layer_act_bytes == whole_a
    assert b.layer_act_bytes == whole_b


def test_module_bytes_are_the_tensor_sizes(checks):
    a, b = checks["profiles"]
    s, mb, h, heads, f, vocab = 32, 2, 64, 4, 128, 256
    sbh = s * mb * h * FP32
    stats = 2 * s * mb * FP32  # a LayerNorm's mean and rstd
    assert a.layer_input_bytes == sbh
    assert _act(a) == {
        "input_layernorm": sbh + stats,  # its output (qkv's input) and statistics
        "qkv": sbh + s * s + 3 * sbh,  # the layer input, the bool causal mask, q/k/v (one tensor)
        "core_attn": mb * heads * s * s * FP32,  # softmax probabilities
        "proj": sbh + sbh,  # its input (attention context) and the residual entering pre_mlp_layernorm
        "pre_mlp_layernorm": sbh + stats,
        "mlp": 2 * s * mb * f * FP32,  # GeLU input (fc1 output + bias) and fc2 input
    }
    tokens = mb * s * 8
    assert a.ends.embedding_act_bytes == tokens + s * 8  # token ids, position ids (one expanded row)
    # final layernorm input + statistics + output-layer input, fp32 logits, CE's target mask and ids
    assert a.ends.output_act_bytes == sbh + stats + sbh + s * mb * vocab * FP32 + s * mb * (1 + 8)
    # B: grouped-query attention repeats k and v inside core attention; SwiGLU without biases
    groups, head_dim, f = 2, h // heads, 96
    assert _act(b)["core_attn"] == (mb * heads * s * s + 2 * s * mb * heads * head_dim) * FP32
    # fc1 output [s, b, 2f] (silu's input is its first half), x2 + glu_linear_offset, silu output,
    # fc2 input (silu(x1) * (x2 + offset))
    assert _act(b)["mlp"] == (2 + 1 + 1 + 1) * s * mb * f * FP32
    assert groups < heads


def test_selective_recompute_frees_the_module_bytes(checks):
    whole_a, core_attn_a, whole_b, mlp_b = checks["saved"]
    a, b = checks["profiles"]
    # megatron's core-attention checkpoint also keeps attn_mask_type as a one-element int32 tensor
    assert core_attn_a == whole_a - _act(a)["core_attn"] + 4
    assert mlp_b == whole_b - _act(b)["mlp"]


def test_profile_json_round_trip(checks, tmp_path):
    for i, profile in enumerate(checks["profiles"]):
        save(profile, tmp_path / f"p{i}.json")
        assert load(tmp_path / f"p{i}.json").to_json() == profile.to_json()


def test_measured_links_are_positive_fits(checks):
    a, b = checks["profiles"]
    for link in (a.p2p, a.tp_allreduce):
        assert [n for n, _ in link.samples] == LINK_SIZES
        assert all(t > 0 for _, t in link.samples)
        assert link.alpha_s >= 0 and link.bytes_per_s > 0
        assert link.time(LINK_SIZES[-1]) >= link.time(LINK_SIZES[0]) > 0
    assert b.tp_allreduce is None and "links not measured" in b.notes


def test_fit_link_is_exact_on_alpha_beta_data():
    alpha, bandwidth = 37e-6, 3.5e9
    sizes = [4096 * 4**i for i in range(7)]
    fit = links.fit_link([[n, alpha + n / bandwidth] for n in sizes])
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-9)
    assert fit.bytes_per_s == pytest.approx(bandwidth, rel=1e-9)
    # latency below what the samples resolve: a bandwidth-only fit, never a negative alpha
    fit = links.fit_link([[1000, 1e-6], [2000, 3e-6], [4000, 7e-6]])
    assert fit.alpha_s == 0.0 and fit.bytes_per_s > 0
    with pytest.raises(profiler.ProfilerError, match="distinct message sizes"):
        links.fit_link([[4096, 1e-4]])


def test_bad_input_is_refused_with_the_field(tmp_path, capsys):
    with pytest.raises(ValueError, match="'vocab_size' is required"):
        profiler.profile_layer({k: v for k, v in MODEL_A.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible by --tp 3"):
        profiler.profile_layer(MODEL_A, tp=3)
    with pytest.raises(profiler.ProfilerError, match="position_embedding_type"):
        profiler.profile_layer({**MODEL_A, "position_embedding_type": "alibi"})
    with pytest.raises(profiler.ProfilerError, match="profile without recompute"):
        profiler.profile_layer({**MODEL_A, "extra": {"recompute_granularity": "full"}})
    bad = tmp_path / "model.yaml"
    bad.write_text("model:\n  hidden_size: 64\n  hidden_sise: 3\n")
    assert profiler.main(["--config", str(bad), "--out", str(tmp_path / "p.json")]) == 2
    assert f"{bad}: unknown field(s) ['hidden_sise']" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_cpu_without_a_cuda_stand_in_is_refused():
    """In a fresh process: this one may hold the CPU shim of an earlier in-process test."""
    import subprocess
    import sys

    from megatron_ucp.testing.devices import has_real_cuda

    if has_real_cuda():
        pytest.skip("a CUDA device is present")
    code = "from megatron_ucp.recompute import profiler; profiler.on_gpu()"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "ProfilerError: no CUDA device and no torch.cuda stand-in" in run.stderr
