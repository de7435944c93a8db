"""FP8 parameters (`fp8_param=True`, Megatron-LM `--fp8-param-gather`): TE weights held as
Float8Tensor (delayed scaling), trained and saved at one layout, loaded at another (`make test`
runs this file in .venvte; TE's quantize kernels run as te_cpu's pure-torch stand-ins,
megatron_ucp.testing.te_quantize_cpu).

A save writes the fp32 master weights (never the FP8 bytes); a load writes the masters into the
DistributedOptimizer and lets megatron-core derive the FP8 weights from them
(`_copy_main_params_to_model_params` -> fp8_utils.quantize_param_shard -> TE's
cast_master_weights_to_fp8) with the saved FP8 scales. The reference is megatron-core's own
derivation in the saving run, from the same masters and scales, after its save.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from conftest import TE_SKIP
from reference import _join_tp, assemble, global_key
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
STEPS = 2


def fp8_weights(dump_dir: Path) -> dict[str, dict]:
    """global key -> {"data": full FP8 bytes (TP shards joined), "scale_inv"} from the dumps."""
    coords = {int(p.stem.removeprefix("rank")): torch.load(p, weights_only=False)["coords"]
              for p in Path(dump_dir).glob("rank*.pt")}
    by_key: dict[str, dict] = {}
    for r, c in sorted(coords.items()):
        for e in torch.load(Path(dump_dir) / f"fp8params_rank{r}.pt", weights_only=False):
            key = global_key(e["name"], c, e["chunk"])
            slot = by_key.setdefault(key, {"tp": {}, "scale_inv": e["scale_inv"], "coords": c})
            if c["tp"] in slot["tp"]:  # a DP replica: megatron-core's all-gather leaves them equal
                assert torch.equal(slot["tp"][c["tp"]], e["data"]), f"{key}: DP replicas differ"
            slot["tp"][c["tp"]] = e["data"]
            assert torch.equal(slot["scale_inv"], e["scale_inv"]), f"{key}: scale_inv differs"
    return {k: {"data": _join_tp(k, [s["tp"][t] for t in sorted(s["tp"])], False, s["coords"]),
                "scale_inv": s["scale_inv"]} for k, s in by_key.items()}


@pytest.mark.parametrize("src,dst", [("tp2", "dp2"), ("dp2", "tp2")])
def test_fp8_weights_are_rederived_from_the_saved_masters(src, dst, tmp_path):
    """TP2 -> DP2 and DP2 -> TP2 (the masters sharded over DP: partial casts, then the uint8
    buffer all-gathered): after the load every FP8 weight's raw bytes and scale_inv equal those that
    megatron-core derives in the saving run from the same fp32 masters and FP8 scales; masters and
    Adam moments equal the saved ones bitwise. Before, the load derived the FP8 weights before it
    restored the FP8 scales (with the fresh model's scale 1): bytes and scale_inv differed."""
    a = launch(2, f"{T}:train_and_save",
               {"layout": src, "cfg": FP8_PARAM, "steps": STEPS, "save_dir": str(tmp_path / "a"),
                "fp8": DELAYED, "dump_dir": str(tmp_path / "a-dump")}, timeout=400)
    assert all(r["error"] is None for r in a) and all(r["fp8_weights"] == 16 for r in a), a
    b = launch(2, f"{T}:load",
               {"layout": dst, "cfg": FP8_PARAM, "load_dir": str(tmp_path / "a"),
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
    for key in ref:
        assert got[key]["data"].dtype == torch.uint8, key
        assert torch.equal(ref[key]["scale_inv"], got[key]["scale_inv"]), (key, "scale_inv")
        assert torch.equal(ref[key]["data"], got[key]["data"]), (key, "data")
        # the filled FP8 scales (not 1) are the ones the weights were derived with
        assert not torch.equal(got[key]["scale_inv"], torch.ones(1)), key
    # masters: the bytes are megatron-core's cast of the saved master (as bf16) with its scale
    from megatron_ucp.testing import te_quantize_cpu

    for key in ref:
        master = saved[key]["param"].to(torch.bfloat16)
        scale = torch.reciprocal(ref[key]["scale_inv"])
        assert torch.equal(te_quantize_cpu.cast_to_fp8_bytes(master, scale, _te_dtype()),
                           ref[key]["data"]), key
    if src == "tp2":
        _check_hf_export(tmp_path, saved, ref)


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
            dequantized = fp8[key]["data"].view(torch.float8_e4m3fn).float() * fp8[key]["scale_inv"]
            assert not torch.equal(got, dequantized.t()), key


def _tex():
    """transformer_engine_torch, imported after the CPU CUDA shim (TE refuses to import without)."""
    from megatron_ucp.testing import cpu_shim  # noqa: F401

    return importlib.import_module("transformer_engine_torch")


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
