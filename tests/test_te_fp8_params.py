"""FP8 parameters (`fp8_param=True`, Megatron-LM `--fp8-param-gather`): TE weights held as
Float8Tensor (delayed scaling; current scaling, megatron's `fp8_recipe="tensorwise"`) or
MXFP8Tensor (`fp8_recipe="mxfp8"`), trained and saved at one layout, loaded at another (`make test`
runs this file in .venvte; TE's quantize kernels run as te_cpu's pure-torch stand-ins,
megatron_ucp.testing.te_quantize_cpu and te_mxfp8_cpu).

A save writes the fp32 master weights (never the FP8 bytes); a load writes the masters into the
DistributedOptimizer and lets megatron-core derive the FP8 weights from them
(`_copy_main_params_to_model_params` -> fp8_utils.quantize_param_shard -> TE's
cast_master_weights_to_fp8; MXFP8: the param buffer, all-gathered, then re-quantized) with the
saved FP8 scales (delayed scaling; current scaling and MXFP8 derive their scales from the
masters). The reference is megatron-core's own derivation in the saving run, from the same masters
and scales, after its save, and TE's scale and cast of each TP slice of the saved masters.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from conftest import TE_SKIP
from reference import _join_tp, assemble, global_key, tp_slice
from test_transitions import universal_tensors

from megatron_ucp.testing.launch import launch

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
if os.environ.get("UCP_REQUIRE_TE") == "1":  # the TE run of make test: a missing TE is an error
    assert HAVE_TE, "UCP_REQUIRE_TE=1 but transformer_engine is not importable"
pytestmark = pytest.mark.skipif(not HAVE_TE, reason=f"{TE_SKIP}make test runs this file in .venvte")

T = "megatron_ucp.testing.te_scenarios"
# the model's recipe (megatron-core's get_fp8_recipe of the config) is the one the FP8 metadata is
# filled under (te_cpu.fill_fp8_meta): the weights' quantizers keep the module's scale tensors
FP8_PARAM = {"transformer_impl": "transformer_engine", "dtype": "bf16",
             "extra": {"fp8": "hybrid", "fp8_param": True, "fp8_amax_history_len": 16,
                       "fp8_amax_compute_algo": "max"}}
DELAYED = {"recipe": "delayed", "format": "HYBRID", "amax_history_len": 16}
# current scaling (megatron's fp8_recipe="tensorwise", TE's Float8CurrentScalingQuantizer): no FP8
# state to save; each weight's scale comes from the amax of its master, all-reduced over DP
TENSORWISE_PARAM = {**FP8_PARAM, "extra": {"fp8": "hybrid", "fp8_param": True,
                                           "fp8_recipe": "tensorwise"}}
TENSORWISE = {"recipe": "tensorwise"}
# MXFP8 (fp8_recipe="mxfp8", TE's MXFP8Quantizer: 1x32 / 32x1 blocks, E8M0 scales): megatron-core
# 0.19 all-gathers MXFP8 parameters through the grad buffer and re-quantizes them
# (--reuse-grad-buf-for-mxfp8-param-ag); the scenarios report compute capability 10.0
MXFP8_PARAM = {**FP8_PARAM, "extra": {"fp8": "e4m3", "fp8_param": True, "fp8_recipe": "mxfp8"},
               "optimizer_extra": {"reuse_grad_buf_for_mxfp8_param_ag": True,
                                   "fp8_recipe": "mxfp8"}}
MXFP8 = {"recipe": "mxfp8"}
CFGS = {"delayed": (FP8_PARAM, DELAYED), "tensorwise": (TENSORWISE_PARAM, TENSORWISE),
        "mxfp8": (MXFP8_PARAM, MXFP8)}
STEPS = 2


def fp8_weights(dump_dir: Path) -> dict[str, dict]:
    """global key -> {"data": full FP8 bytes (TP shards joined; MXFP8: the rowwise copy),
    "columnwise_data" (MXFP8), "scale_inv": [one per TP rank], "shards": [(coords, dump entry)
    per TP rank]} from the dumps."""
    coords = {int(p.stem.removeprefix("rank")): torch.load(p, weights_only=False)["coords"]
              for p in Path(dump_dir).glob("rank*.pt")}
    by_key: dict[str, dict] = {}
    for r, c in sorted(coords.items()):
        for e in torch.load(Path(dump_dir) / f"fp8params_rank{r}.pt", weights_only=False):
            key = global_key(e["name"], c, e["chunk"])
            slot = by_key.setdefault(key, {})
            if c["tp"] in slot:  # a DP replica: megatron-core's all-gather leaves them equal
                for k, v in e.items():
                    if torch.is_tensor(v):
                        assert torch.equal(slot[c["tp"]][1][k], v), f"{key}: DP replicas differ ({k})"
            slot[c["tp"]] = (c, e)
    out = {}
    for k, s in by_key.items():
        shards = [s[t] for t in sorted(s)]
        out[k] = {"data": _join_tp(k, [e["data"] for _, e in shards], False, shards[0][0]),
                  "scale_inv": [e["scale_inv"] for _, e in shards], "shards": shards}
        if "columnwise_data" in shards[0][1]:
            out[k]["columnwise_data"] = _join_tp(k, [e["columnwise_data"] for _, e in shards],
                                                 False, shards[0][0])
    return out


@pytest.mark.parametrize("src,dst,recipe", [("tp2", "dp2", "delayed"), ("dp2", "tp2", "delayed"),
                                            ("tp2", "dp2", "tensorwise"),
                                            ("dp2", "tp2", "tensorwise"),
                                            ("dp2", "dp1", "tensorwise"),
                                            ("tp2", "dp2", "mxfp8"), ("dp2", "tp2", "mxfp8")])
def test_fp8_weights_are_rederived_from_the_saved_masters(src, dst, recipe, tmp_path):
    """TP2 -> DP2 and DP2 -> TP2 (the masters sharded over DP: partial casts, then the uint8
    buffer all-gathered): after the load every FP8 weight's raw bytes and scale_inv equal those that
    megatron-core derives in the saving run from the same fp32 masters (and, delayed scaling, FP8
    scales); masters and Adam moments equal the saved ones bitwise. Delayed scaling: before, the
    load derived the FP8 weights before it restored the FP8 scales (with the fresh model's scale 1):
    bytes and scale_inv differed. Current scaling (tensorwise): each TP rank's weight has its own
    scale, TE's from the amax of that rank's whole master, the amaxes of the DP shards all-reduced
    (at DP2 each rank holds part of a weight): at another TP the FP8 weights differ from the saving
    run's by design, and are checked against TE's scale and cast of each TP slice of the masters;
    at the same TP (DP2 -> DP1) they equal the saving run's bitwise."""
    cfg, fp8 = CFGS[recipe]
    _install_stand_ins()  # (this process reads the dumps' MXFP8 tensors: TE's dequantize)
    a = launch(2, f"{T}:train_and_save",
               {"layout": src, "cfg": cfg, "steps": STEPS, "save_dir": str(tmp_path / "a"),
                "fp8": fp8, "dump_dir": str(tmp_path / "a-dump")}, timeout=400)
    assert all(r["error"] is None for r in a) and all(r["fp8_weights"] == 16 for r in a), a
    b = launch(int(dst[-1]) if dst.startswith("dp") else 2, f"{T}:load",
               {"layout": dst, "cfg": cfg, "load_dir": str(tmp_path / "a"),
                "dump_dir": str(tmp_path / "b-dump"), "resave_dir": str(tmp_path / "b-resave")},
               timeout=400)
    assert all(r["iteration"] == STEPS and r["fp8_modules"] > 0 for r in b), b

    # the save wrote the fp32 masters: float32 fragments, equal to the DistributedOptimizer's
    saved, loaded = assemble(tmp_path / "a-dump"), assemble(tmp_path / "b-dump")
    assert saved.keys() == loaded.keys()
    n = 0
    for key, s in saved.items():
        for state in ("param", "exp_avg", "exp_avg_sq"):
            if state in s:
                assert s[state].dtype == torch.float32 and torch.equal(s[state], loaded[key][state]), \
                    (key, state)
                n += 1
        assert s.get("step") == loaded[key].get("step"), key
    assert n > 100

    # what the checkpoint holds for an FP8 weight: the fp32 master (and moments), never FP8 bytes
    u = universal_tensors(tmp_path / "a", tmp_path / "universal")
    for key in (k for k in saved if k.endswith(("linear_qkv.weight", "linear_proj.weight",
                                                "linear_fc1.weight", "linear_fc2.weight"))):
        assert u[f"{key}/param"].dtype == torch.float32, key
        assert torch.equal(u[f"{key}/param"], saved[key]["param"]), key
        assert torch.equal(u[f"{key}/exp_avg_sq"], saved[key]["exp_avg_sq"]), key

    ref, got = fp8_weights(tmp_path / "a-dump"), fp8_weights(tmp_path / "b-dump")
    assert len(ref) == 16 and ref.keys() == got.keys()
    from megatron_ucp.testing import te_quantize_cpu

    same_tp = src.startswith("dp") == dst.startswith("dp")
    for key in ref:
        assert got[key]["data"].dtype == torch.uint8, key
        if recipe == "mxfp8":  # 32-element blocks inside every TP shard: the bytes are TP-invariant
            _check_mxfp8(key, saved[key]["param"], ref[key], got[key])
            continue
        if recipe == "delayed" or same_tp:  # megatron-core's derivation in the saving run
            assert torch.equal(ref[key]["scale_inv"][0], got[key]["scale_inv"][0]), (key, "scale_inv")
            assert torch.equal(ref[key]["data"], got[key]["data"]), (key, "data")
        for run in (ref, got):
            for coords, e in run[key]["shards"]:
                data, scale_inv = e["data"], e["scale_inv"]
                # the bytes are TE's cast of the saved master (as bf16; its TP slice) with the scale
                master = tp_slice(key, saved[key]["param"], coords, False).to(torch.bfloat16)
                if recipe == "delayed":  # the filled FP8 scales (not 1), restored
                    assert not torch.equal(scale_inv, torch.ones(1)), key
                    assert torch.equal(scale_inv, ref[key]["scale_inv"][0]), key
                    scale = torch.reciprocal(scale_inv)
                else:  # TE's current scaling: 448 / amax of the weight's (bf16) master
                    scale = torch.tensor([448.0]) / master.abs().max().float()
                    assert torch.equal(scale_inv, torch.reciprocal(scale)), key
                cast = te_quantize_cpu.cast_to_fp8_bytes(master, scale, _te_dtype())
                assert torch.equal(cast, data), key
    if recipe == "tensorwise" and dst == "tp2":  # a TP rank's scale is its slice's, not the weight's
        assert any(len({float(v) for v in got[k]["scale_inv"]}) > 1 for k in got)
    if src == "tp2" and recipe == "delayed":
        _check_hf_export(tmp_path, saved, ref)


def _check_mxfp8(key: str, master: torch.Tensor, ref: dict, got: dict) -> None:
    """MXFP8 weights after the load: rowwise and columnwise bytes equal the saving run's
    (megatron-core's re-quantization there), and each TP rank's bytes and E8M0 scales are TE's
    MXFP8 quantize of its slice of the saved master (as bf16)."""
    from megatron_ucp.testing import te_mxfp8_cpu

    assert torch.equal(ref["data"], got["data"]), (key, "rowwise data")
    assert torch.equal(ref["columnwise_data"], got["columnwise_data"]), (key, "columnwise data")
    assert not torch.equal(got["data"], got["columnwise_data"]), key  # 1x32 vs 32x1 blocks
    for run in (ref, got):
        for coords, e in run["shards"]:
            q = te_mxfp8_cpu.quantize_2d(tp_slice(key, master, coords, False).to(torch.bfloat16),
                                         _tex().DType.kFloat8E4M3)
            assert torch.equal(q["rowwise_data"], e["data"]), key
            assert torch.equal(q["rowwise_e8m0"], e["scale_inv"]), key
            assert torch.equal(q["columnwise_data"], e["columnwise_data"]), key
            assert torch.equal(q["columnwise_e8m0"], e["columnwise_scale_inv"]), key


def _check_hf_export(tmp_path: Path, saved: dict, fp8: dict) -> None:
    """export-hf of the FP8-parameter run: the MLP weights (FP8 in the model) are the fp32 masters
    (GPT-2's Conv1D: transposed), not the FP8 bytes dequantized; no TE extra state reaches HF."""
    from safetensors.torch import load_file

    from megatron_ucp.conversion import export_hf

    out = export_hf(tmp_path / "a", tmp_path / "hf", "gpt2", dtype="fp32", progress=False)
    hf = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert not [k for k in hf if "extra_state" in k or "fp8" in k.lower()]
    for layer in range(2):
        for ours, theirs in (("linear_fc1", "c_fc"), ("linear_fc2", "c_proj")):
            key = f"decoder.layers.{layer}.mlp.{ours}.weight"
            got = hf[f"transformer.h.{layer}.mlp.{theirs}.weight"]
            assert torch.equal(got, saved[key]["param"].t()), key
            dequantized = fp8[key]["data"].view(torch.float8_e4m3fn).float() * fp8[key]["scale_inv"][0]
            assert not torch.equal(got, dequantized.t()), key


def _tex():
    """transformer_engine_torch, imported after the CPU CUDA shim (TE refuses to import without)."""
    from megatron_ucp.testing import cpu_shim  # noqa: F401

    return importlib.import_module("transformer_engine_torch")


def _install_stand_ins() -> None:
    _tex()
    from megatron_ucp.testing import te_cpu

    te_cpu.install_quantize_stand_ins()


def _te_dtype():
    return _tex().DType.kFloat8E4M3  # the HYBRID format's forward (weights) type


def test_stand_in_cast_matches_torch_float8_rounding():
    """The stand-in cast (TE's `__nv_fp8_*` conversion: scale, saturate, round to nearest even)
    on values at and past the format's max, halfway points and NaN."""
    from megatron_ucp.testing import te_quantize_cpu

    tex = _tex()
    x = torch.tensor([0.0, -0.0, 1.0, 1.0625, 1.1875, 448.0, 464.0, 480.0, 1e6, -1e6, float("nan"),
                      2.0 ** -9, 2.0 ** -10])
    b = te_quantize_cpu.cast_to_fp8_bytes(x, torch.ones(1), tex.DType.kFloat8E4M3)
    v = b.view(torch.float8_e4m3fn).float()
    # 1.0625 is halfway between 1.0 and 1.125 (even: 1.0); 1.1875 between 1.125 and 1.25 (even: 1.25)
    assert v[:5].tolist() == [0.0, -0.0, 1.0, 1.0, 1.25]
    assert v[5:10].tolist() == [448.0, 448.0, 448.0, 448.0, -448.0]  # saturated, never NaN
    assert torch.isnan(v[10])
    assert v[11].item() == 2.0 ** -9 and v[12].item() == 0.0  # smallest subnormal; half of it: even 0
    e5 = te_quantize_cpu.cast_to_fp8_bytes(torch.tensor([1e9, 57344.0]), torch.ones(1),
                                           tex.DType.kFloat8E5M2).view(torch.float8_e5m2).float()
    assert e5.tolist() == [57344.0, 57344.0]


def test_stand_in_current_scaling_scale_and_quantize():
    """TE's current-scaling scale (recipe_common.cuh `compute_scale_from_amax`: epsilon floor; 0,
    inf and NaN amax -> 1; an infinite quotient -> FLT_MAX; power-of-2 scales keep the exponent) and
    the stand-in quantize of a Float8CurrentScalingQuantizer (amax of the tensor, NaN ignored)."""
    from megatron_ucp.testing import te_cpu, te_quantize_cpu

    tex = _tex()
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    te_cpu.install_quantize_stand_ins()
    ref = te_quantize_cpu.compute_scale_from_amax_reference
    amax = torch.tensor([0.0, float("inf"), float("nan"), 3.0, 1e-45, 448.0])
    s = ref(amax, 448.0, False, 0.0)
    fmax = torch.finfo(torch.float32).max
    assert s.tolist() == [1.0, 1.0, 1.0, torch.tensor(448.0 / 3.0).item(), fmax, 1.0]
    assert ref(amax, 448.0, True, 0.0).tolist() == [1.0, 1.0, 1.0, 128.0, 2.0 ** 127, 1.0]
    assert ref(torch.tensor([1e-10, 0.0]), 448.0, False, 1e-4).tolist() == \
        [(torch.tensor(448.0) / torch.tensor(1e-4)).item()] * 2  # epsilon floors a zero amax too
    assert ref(torch.tensor([2.0]), 57344.0, False, 0.0).tolist() == [28672.0]

    x = torch.tensor([[0.5, -3.0, float("nan"), 1.0], [2.0, 0.25, -1.5, 0.0]], dtype=torch.bfloat16)
    q = Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device=torch.device("cpu"),
                                      force_pow_2_scales=True)
    t = q(x)
    assert t._scale_inv.tolist() == [1.0 / 128.0]  # 448 / 3 = 149.3 -> 2^7
    expect = te_quantize_cpu.cast_to_fp8_bytes(x, torch.tensor([128.0]), tex.DType.kFloat8E4M3)
    assert torch.equal(t._data, expect)
    amax_out = torch.zeros(1)
    tex.compute_amax(x, amax_out)
    assert amax_out.tolist() == [3.0]


def test_stand_in_mxfp8_e8m0_and_sharded_cast():
    """TE's E8M0 rounding (`ptx::float_to_e8m0`: up to the next power of two, saturated at
    0xFE; NaN 0xFF; 0 -> 0), the MXFP8 quantize's layout (rowwise [M, K/32] and columnwise
    [M/32, K] scales in buffers padded to [128, 4] / [4, 128]), and TE's DP-sharded path
    (partial amax per shard, MAX over the shards, E8M0 scales, partial casts) giving the same bytes
    and scales as the quantize of the whole weight, for shards that cut through blocks."""
    from megatron_ucp.testing import te_mxfp8_cpu as mx

    tex = _tex()
    _install_stand_ins()
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

    from megatron_ucp.testing import cpu_shim

    if not cpu_shim.REAL_CUDA:  # compute capability 10.0 only inside the MXFP8 scenarios
        assert torch.cuda.get_device_capability() == (9, 0)
    v = torch.tensor([0.0, 1.0, 1.5, 2.0 ** -127, 2.0 ** -128, 3.0 * 2.0 ** -128, 2.0 ** 127 * 1.5,
                      float("inf"), float("nan")])
    assert mx.float_to_e8m0(v).tolist() == [0, 127, 128, 0, 0, 1, 254, 254, 255]
    assert mx.exp2f_rcp(torch.tensor([0, 127, 130], dtype=torch.uint8)).tolist() == \
        [1.0, 1.0, 0.125]

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 96, generator=g) * torch.logspace(-3, 1, 96)).to(torch.bfloat16)
    t = MXFP8Quantizer(tex.DType.kFloat8E4M3)(w)
    assert t._rowwise_scale_inv.shape == (128, 4) and t._columnwise_scale_inv.shape == (4, 128)
    q = mx.quantize_2d(w, tex.DType.kFloat8E4M3)
    assert torch.equal(t._rowwise_data, q["rowwise_data"])
    assert torch.equal(t._rowwise_scale_inv[:64, :3], q["rowwise_e8m0"])
    assert torch.equal(t._columnwise_scale_inv[:2, :96], q["columnwise_e8m0"])
    assert len(q["rowwise_e8m0"].unique()) > 5  # the blocks' scales differ
    # every value within the E4M3 range of its block, the block amax at most 448 x scale
    deq = t.dequantize(dtype=torch.float32)
    assert torch.allclose(deq, w.float(), rtol=0.07, atol=0.0)

    flat = w.float().reshape(-1)
    cuts = [0, 1000, 3077, flat.numel()]  # three DP shards, mid-row and mid-block
    amax_r = torch.zeros(128, 4, dtype=torch.bfloat16)
    amax_c = torch.zeros(4, 128, dtype=torch.bfloat16)
    for a, b in zip(cuts, cuts[1:]):
        part_r, part_c = torch.zeros_like(amax_r), torch.zeros_like(amax_c)
        mx.mxfp8_scaling_compute_partial_amax(flat[a:b].to(torch.bfloat16), part_r, part_c, 64, 96, a)
        amax_r, amax_c = torch.maximum(amax_r, part_r), torch.maximum(amax_c, part_c)  # all-reduce
    s_r, s_c = torch.empty(128, 4, dtype=torch.uint8), torch.empty(4, 128, dtype=torch.uint8)
    mx.multi_tensor_compute_scale_inv_e8m0(0, None, [[amax_r, amax_c], [s_r, s_c]])
    assert torch.equal(s_c[:2, :96], q["columnwise_e8m0"])
    assert torch.equal(s_r[:64, :3], q["rowwise_e8m0"])
    row, col = torch.empty(64 * 96, dtype=torch.uint8), torch.empty(64 * 96, dtype=torch.uint8)
    for a, b in zip(cuts, cuts[1:]):
        mx.mxfp8_scaling_partial_cast(flat[a:b].to(torch.bfloat16), row[a:b], col[a:b], s_r, s_c,
                                      64, 96, a)
    assert torch.equal(row.reshape(64, 96), q["rowwise_data"])
    assert torch.equal(col.reshape(64, 96), q["columnwise_data"])
