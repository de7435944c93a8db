"""The precision-aware optimizer (`--use-precision-aware-optimizer`: Transformer Engine's FusedAdam
inside megatron-core's DistributedOptimizer, state in bf16 / fp16 / fp8, fp32 or fp16 masters, bf16
weights over int16 remainders) saved at one layout and loaded at another (`make test` runs this file
in .venvte). TE's FusedAdam trains on the CPU with its kernels' stand-ins
(megatron_ucp.testing.te_fused_adam_cpu); every scale, unscale and quantisation is TE's own Python.

- bf16 moments and remainders (megatron-core's default with `--exp-avg-dtype bf16`), and fp32
  state: every model tensor and optimizer shard after the load equals the independent assembly of
  the saved run (tests/reference.py; the master rebuilt from weight and remainder by the test's own
  rule) bitwise, at another TP, PP and DP size;
- the same layout: a step after the load equals the uninterrupted run's step bitwise (the remainders
  and the bias correction's step come back as TE keeps them);
- fp16 and fp8 moments (one scale per shard): the loaded state equals TE's rescaling of the
  assembled fp32 values over the new shard (written out in the test), bitwise;
- precision-aware <-> torch Adam (the TE venv without it) both ways: the universal tensors agree.
Before, every save of such a run was refused ("not supported by megatron-ucp yet").
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from reference import assemble, compare_to_reference
from test_transformer_engine import TE, assert_same_universal, load, nprocs, save
from test_transformer_engine import pytestmark as TE_ONLY

from megatron_ucp.formats import manifest as mf
from megatron_ucp.inspector import inspect
from megatron_ucp.testing.launch import launch

pytestmark = TE_ONLY  # (the TE venv of make test; skipped elsewhere)

T = "megatron_ucp.testing.te_scenarios"


def precision_aware(**dtypes) -> dict:
    return {**TE, "dtype": "bf16", "optimizer_extra": {"use_precision_aware_optimizer": True, **dtypes}}


BF16_STATE = precision_aware(exp_avg_dtype="bfloat16", exp_avg_sq_dtype="bfloat16")
FP32_MASTER = precision_aware(exp_avg_dtype="bfloat16", exp_avg_sq_dtype="bfloat16",
                              store_param_remainders=False)
FP16_STATE = precision_aware(exp_avg_dtype="float16", exp_avg_sq_dtype="float16")
# (no zero-initialised parameter: the synthetic gradient sin(3p) of a zero bias is 0 at the first
# step, and TE 2.20.2's FusedAdam gives an all-zero fp8 moment the scale 0 / 448 and its quantiser
# 1 / 0 = inf, so 0 * inf = NaN, on a GPU as here)
FP8_STATE = {**precision_aware(exp_avg_dtype="uint8", exp_avg_sq_dtype="uint8"),
             "normalization": "RMSNorm", "add_bias_linear": False}


@pytest.mark.parametrize("cfg,src,dst", [
    pytest.param(BF16_STATE, "tp2", "dp2", id="bf16-remainders-tp2->dp2"),
    pytest.param(BF16_STATE, "pp2dp2", "tp2", id="bf16-remainders-pp2dp2->tp2"),
    pytest.param(FP32_MASTER, "dp2", "tp2pp2", id="bf16-fp32-master-dp2->tp2pp2"),
])
def test_precision_aware_across_layouts(cfg, src, dst, tmp_path):
    a = save(tmp_path, "a", src, cfg)
    assert all(r["error"] is None for r in a["res"]), a["res"]
    expected = assemble(a["dump"])
    b = load(tmp_path, "b", dst, cfg, a["ckpt"])
    assert compare_to_reference(b["dump"], expected) > 40
    assert assert_same_universal(tmp_path, a["ckpt"], b["resave"]) > 10
    # what FusedAdam holds after the load, in its own dtypes
    master = "int16" if cfg is BF16_STATE else "float32"
    assert all(r["state_dtypes"] == ["exp_avg:bfloat16", "exp_avg_sq:bfloat16", f"master_param:{master}"]
               for r in b["res"]), b["res"]


def test_precision_aware_same_layout_continues_bitwise(tmp_path):
    """Save at step 2, train on (the uninterrupted run); load at the same layout, one step: the
    weights, remainders and moments equal the uninterrupted run's bitwise."""
    res = launch(nprocs("dp2"), f"{T}:continue_after_load",
                 {"layout": "dp2", "cfg": BF16_STATE, "steps": 2, "save_dir": str(tmp_path / "ck")},
                 timeout=400)
    assert res[0]["compared"] > 20 and all(r["mismatch"] == [] for r in res), res


@pytest.mark.parametrize("cfg,dtypes", [
    pytest.param(FP16_STATE, ["exp_avg:float16", "exp_avg_sq:float16", "master_param:int16"],
                 id="fp16-moments"),
    pytest.param(FP8_STATE, ["exp_avg:float32", "exp_avg_sq:float32", "master_param:int16"],
                 id="fp8-moments"),  # (a Float8Tensor's dtype is its fake dtype)
])
def test_scaled_state_rescaled_over_new_shards(cfg, dtypes, tmp_path):
    """fp16 and fp8 moments have one scale per shard: the load gives TE's rescaling of the saved
    fp32 values over the target's shards (FusedAdam._apply_scale, written out in `_te_rescale`),
    bitwise; the masters and weights are exact. inspect and the manifest say so."""
    a = save(tmp_path, "a", "dp2", cfg)
    assert all(r["error"] is None for r in a["res"]), a["res"]
    expected = assemble(a["dump"])
    b = load(tmp_path, "b", "tp2", cfg, a["ckpt"])
    dtype = cfg["optimizer_extra"]["exp_avg_dtype"]
    rescale = {k: partial(_te_rescale, dtype=dtype) for k in ("exp_avg", "exp_avg_sq")}
    assert compare_to_reference(b["dump"], expected, want_of=rescale) > 40
    assert all(r["state_dtypes"] == dtypes for r in b["res"]), b["res"]
    manifest = mf.read(a["ckpt"] / (a["ckpt"] / "latest").read_text().strip())
    notes = [o.get("note", "") for o in manifest.optimizer["optimizers"]]
    assert any("one scale per tensor shard" in n for n in notes), notes
    assert f"'exp_avg_dtype': '{dtype}'" in inspect(a["ckpt"])


def _te_rescale(unscaled: torch.Tensor, dtype: str) -> torch.Tensor:
    """What TE's get_unscaled_state gives after set_scaled_state(unscaled): one scale over the
    shard, absmax / range (fp16: its max / 2; fp8 E4M3: 448); fp16 stores unscaled * (1 / scale)
    and reads it back times the scale; fp8 quantises with 1 / scale and dequantises with its
    reciprocal."""
    absmax = unscaled.abs().max()
    if dtype == "float16":
        scale = absmax / torch.tensor(torch.finfo(torch.float16).max / 2.0, dtype=torch.float32)
        rscale = torch.where(scale > 0, scale.reciprocal(), 0.0)
        return (unscaled * rscale).to(torch.float16).float() * scale
    scale = absmax / torch.tensor(448.0, dtype=torch.float32)
    quant_scale = 1 / scale
    fp8 = (unscaled * quant_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return fp8.float() * torch.reciprocal(quant_scale)


def test_fp16_masters_rescaled_and_weights_rederived(tmp_path):
    """fp16 master weights (`--main-params-dtype fp16`, one scale per shard): the masters are TE's
    rescaling of the saved fp32 values over the new shards, the bf16 weights their cast (as TE's
    kernel writes them after a step), the bf16 moments exact; the manifest says both."""
    cfg = precision_aware(exp_avg_dtype="bfloat16", exp_avg_sq_dtype="bfloat16",
                          main_params_dtype="float16")
    a = save(tmp_path, "a", "tp2", cfg)
    assert all(r["error"] is None for r in a["res"]), a["res"]
    expected = assemble(a["dump"])
    for e in expected.values():
        if "param" in e:
            e["model"] = e["param"].bfloat16()
    b = load(tmp_path, "b", "dp2", cfg, a["ckpt"])
    assert compare_to_reference(b["dump"], expected,
                                want_of={"param": partial(_te_rescale, dtype="float16")}) > 40
    assert all(r["state_dtypes"] == ["exp_avg:bfloat16", "exp_avg_sq:bfloat16", "master_param:float16"]
               for r in b["res"]), b["res"]
    manifest = mf.read(a["ckpt"] / (a["ckpt"] / "latest").read_text().strip())
    notes = " ".join(o.get("note", "") for o in manifest.optimizer["optimizers"])
    assert "one scale per tensor shard" in notes and "fp16 master weights" in notes, notes


@pytest.mark.parametrize("direction", ["precision-aware->adam", "adam->precision-aware"])
def test_precision_aware_and_torch_adam_load_each_other(direction, tmp_path):
    plain = {**TE, "dtype": "bf16"}
    a_cfg, b_cfg = (BF16_STATE, plain) if direction == "precision-aware->adam" else (plain, FP32_MASTER)
    a = save(tmp_path, "a", "tp2", a_cfg)
    assert all(r["error"] is None for r in a["res"]), a["res"]
    b = load(tmp_path, "b", "dp2", b_cfg, a["ckpt"])
    if direction == "precision-aware->adam":  # bf16 moments widen exactly into fp32 Adam
        assert assert_same_universal(tmp_path, a["ckpt"], b["resave"]) > 10
    else:  # fp32 moments into bf16 ones: TE's cast; masters and weights exact
        expected = assemble(a["dump"])
        for e in expected.values():
            for k in ("exp_avg", "exp_avg_sq"):
                if k in e:
                    e[k] = e[k].bfloat16().float()
        assert compare_to_reference(b["dump"], expected) > 40
