"""Transformer Engine layers and FP8 state (`make test` runs this file in .venvte: TE 2.20.2 over
megatron-core 0.19; TE's kernels never run, steps are `te_cpu.synthetic_step`).

- TE <-> local spec both ways, per family, at another layout: the universal tensors of the load's
  re-save equal the source's bitwise (model, fp32 master weights, Adam moments and step);
- TE -> TE at another layout: every model tensor and optimizer shard after the load equals the
  independent assembly of the saved run's dumps (tests/reference.py);
- FP8 delayed scaling saved at TP2xPP2 (TP2xEP2 for MoE) and loaded at DP2: every module's scales,
  amax histories and recipe equal the saved ones bitwise, read back through TE's own
  get_extra_state; stateless recipes keep their recipe; copies that differ are refused by name;
- the three payload forms TE releases write decode without unpickling anything but tensors.
"""

from __future__ import annotations

import importlib.util
import io
import os
import pickle
from pathlib import Path

import pytest
import torch
from conftest import TE_SKIP
from reference import assemble, compare_to_reference
from test_transitions import universal_tensors

from megatron_ucp.errors import UCPError
from megatron_ucp.formats import manifest as mf
from megatron_ucp.testing.launch import launch

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
if os.environ.get("UCP_REQUIRE_TE") == "1":  # the TE run of make test: a missing TE is an error
    assert HAVE_TE, "UCP_REQUIRE_TE=1 but transformer_engine is not importable"
pytestmark = pytest.mark.skipif(not HAVE_TE, reason=f"{TE_SKIP}make test runs this file in .venvte")

T = "megatron_ucp.testing.te_scenarios"
TE = {"transformer_impl": "transformer_engine"}
LLAMA = {"swiglu": True, "num_query_groups": 2, "normalization": "RMSNorm", "position_embedding_type": "rope",
         "untie_embeddings": True, "add_bias_linear": False, "qk_layernorm": True}
MOE = {"num_experts": 4, "add_bias_linear": False, "swiglu": True}
MLA = {"normalization": "RMSNorm", "position_embedding_type": "rope", "add_bias_linear": False,
       "untie_embeddings": True, "qk_layernorm": True,  # DeepSeek's q / kv latent norms (TE fuses them)
       "extra": {"multi_latent_attention": True, "q_lora_rank": 32, "kv_lora_rank": 16,
                 "qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 16}}
MTP = {**LLAMA, "extra": {"mtp_num_layers": 1}}
HYBRID = {"hybrid_pattern": "M*-M", "normalization": "RMSNorm", "add_bias_linear": False,
          "position_embedding_type": "none", "untie_embeddings": True,
          "extra": {"mamba_num_heads": 8, "mamba_head_dim": 16, "mamba_state_dim": 16, "mamba_num_groups": 2}}
DELAYED = {"recipe": "delayed", "format": "HYBRID", "amax_history_len": 16}
STEPS = 2


def nprocs(layout: str) -> int:
    from megatron_ucp.layout import Layout

    return Layout.parse(layout).world_size


def save(tmp_path: Path, tag: str, layout: str, cfg: dict, fp8: dict | None = None, **kw) -> dict:
    res = launch(nprocs(layout), f"{T}:train_and_save",
                 {"layout": layout, "cfg": cfg, "steps": STEPS, "save_dir": str(tmp_path / tag),
                  "fp8": fp8, "dump_dir": str(tmp_path / f"{tag}-dump"), **kw}, timeout=400)
    return {"ckpt": tmp_path / tag, "dump": tmp_path / f"{tag}-dump", "res": res}


def load(tmp_path: Path, tag: str, layout: str, cfg: dict, ckpt: Path) -> dict:
    res = launch(nprocs(layout), f"{T}:load",
                 {"layout": layout, "cfg": cfg, "load_dir": str(ckpt),
                  "dump_dir": str(tmp_path / f"{tag}-dump"), "resave_dir": str(tmp_path / f"{tag}-resave")},
                 timeout=400)
    assert all(r["iteration"] == STEPS for r in res)
    return {"dump": tmp_path / f"{tag}-dump", "resave": tmp_path / f"{tag}-resave", "res": res}


def assert_same_universal(tmp_path: Path, a_ckpt: Path, b_ckpt: Path) -> int:
    a = universal_tensors(a_ckpt, tmp_path / f"u-{a_ckpt.name}")
    b = universal_tensors(b_ckpt, tmp_path / f"u-{b_ckpt.name}")
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        assert torch.equal(a[k], b[k]), k
    return len(a)


def fp8_dumps(dump_dir: Path) -> dict:
    out = {}
    for p in sorted(dump_dir.glob("fp8_rank*.pt")):
        for name, d in torch.load(p, weights_only=False).items():
            if name in out:  # a copy (TP, DP) of the same module: equal, as TE leaves them
                assert d.keys() == out[name].keys() and all(
                    torch.equal(d[k], out[name][k]) if torch.is_tensor(d[k]) else d[k] == out[name][k]
                    for k in d), name
            out[name] = d
    return out


def assert_same_fp8(saved: dict, loaded: dict) -> int:
    assert saved.keys() == loaded.keys(), sorted(set(saved) ^ set(loaded))
    n = 0
    for name, s in saved.items():
        assert s["recipe"] == loaded[name]["recipe"], name
        assert s.keys() == loaded[name].keys(), name
        for k, t in s.items():
            if torch.is_tensor(t):
                assert torch.equal(t, loaded[name][k]), (name, k)
                n += 1
    return n


# ------------------------------------------------------------------ TE <-> local, every family

FAMILIES = {
    "gpt": ({}, "tp2", "dp2"),
    "llama": (LLAMA, "tp2pp2", "tp1"),
    "moe-sequential": (MOE, "ep2dp2", "tp2"),
    "moe-grouped": ({**MOE, "moe_grouped_gemm": True, "dtype": "bf16"}, "ep2dp2", "dp2"),
    "mla": (MLA, "tp2", "dp2"),
    "mtp": (MTP, "pp2", "tp2"),
    "hybrid-mamba": (HYBRID, "tp2", "dp2"),
}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("direction", ["te->local", "local->te"])
def test_te_and_local_spec_load_each_other(family, direction, tmp_path):
    """A TE run's checkpoint loads into a local-spec model at another layout and the other way:
    the re-save's universal tensors equal the source's bitwise. MoE failed before (the local
    spec named a MoE layer's pre-MLP norm `mlp.linear_fc1.layer_norm_weight`, TE `pre_mlp_layernorm`)."""
    cfg, src, dst = FAMILIES[family]
    te, local = {**cfg, **TE}, {**cfg, "transformer_impl": "local"}
    a_cfg, b_cfg = (te, local) if direction == "te->local" else (local, te)
    a = save(tmp_path, "a", src, a_cfg)
    assert all(r["error"] is None for r in a["res"]), a["res"]
    b = load(tmp_path, "b", dst, b_cfg, a["ckpt"])
    assert assert_same_universal(tmp_path, a["ckpt"], b["resave"]) > 10


ASSEMBLED = {"gpt": ("tp2", "pp2"), "llama": ("tp2pp2", "dp2"), "moe-sequential": ("ep2dp2", "tp2"),
             "moe-grouped": ("ep2dp2", "tp2"), "mtp": ("pp2", "tp2"), "hybrid-mamba": ("tp2", "dp2")}


@pytest.mark.parametrize("family", list(ASSEMBLED))
def test_te_state_after_a_layout_change_equals_an_independent_assembly(family, tmp_path):
    """TE -> TE at another layout: every model tensor and optimizer shard after the load is the
    slice of the saved run's full tensors that tests/reference.py assembles by hand. (MLA is
    checked through the universal form only: TE duplicates its down projections over TP where the
    reference's textbook layout, like the local spec, splits them.)"""
    cfg = {**FAMILIES[family][0], **TE}
    src, dst = ASSEMBLED[family]
    a = save(tmp_path, "a", src, cfg)
    b = load(tmp_path, "b", dst, cfg, a["ckpt"])
    swiglu = cfg.get("swiglu", False)
    assert compare_to_reference(b["dump"], assemble(a["dump"], swiglu), swiglu) > 20


# ------------------------------------------------------------------ FP8 state

GROUPED_TE = {**MOE, **TE, "moe_grouped_gemm": True, "dtype": "bf16"}
FP8_CASES = {
    # dense: TP2 x PP2 -> TP1 x DP2; MoE (TE's grouped linear, per-expert FP8 state): TP2 x EP2 -> DP2
    # (experts split over TP need sequence parallelism, which megatron-core refuses at TP 1)
    "llama-tp2pp2-to-dp2": ({**LLAMA, **TE}, "tp2pp2", "dp2", None),
    "moe-grouped-tp2ep2-to-dp2": ({**GROUPED_TE, "sequence_parallel": True}, "tp2ep2dp2", "dp2", GROUPED_TE),
    "moe-sequential-pp2ep2-to-tp2": ({**MOE, **TE}, "pp2ep2dp2", "tp2", None),
}


@pytest.mark.parametrize("case", list(FP8_CASES))
def test_fp8_delayed_scaling_state_moves_to_another_layout(case, tmp_path):
    """FP8 delayed scaling (megatron-core's default recipe): scales and amax histories of every TE
    module (every expert of a grouped linear) saved at one layout equal, bitwise, what TE's own
    get_extra_state gives after a load at another; the converted universal form keeps them too.
    Before, every such save was refused ("holds extra state")."""
    cfg, src, dst, dst_cfg = FP8_CASES[case]
    dst_cfg = dst_cfg or cfg
    a = save(tmp_path, "a", src, cfg, fp8=DELAYED)
    assert all(r["error"] is None for r in a["res"]), a["res"]
    saved = fp8_dumps(a["dump"])
    assert len(saved) >= 8
    b = load(tmp_path, "b", dst, dst_cfg, a["ckpt"])
    assert sum(r["fp8_modules"] for r in b["res"]) > 0
    assert assert_same_fp8(saved, fp8_dumps(b["dump"])) == 4 * len(saved)
    # the re-save carries the same FP8 state, and so does the universal form
    field = mf.read(mf.resolve(b["resave"])).te_state
    assert field is not None and set(field["modules"]) == set(saved)
    u = tmp_path / "universal"
    universal_tensors(a["ckpt"], u)
    c = load(tmp_path, "c", "dp2", dst_cfg if dst == "dp2" else cfg, u)
    assert assert_same_fp8(saved, fp8_dumps(c["dump"])) == 4 * len(saved)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_stateless_fp8_recipes_are_recorded_and_restored(recipe, tmp_path):
    """Current scaling and block scaling keep no scales (TE >= 2.18 writes an empty payload): the
    recipe itself is recorded from the module and set again at the load. (MXFP8 and NVFP4 are the
    same path; TE refuses to build them below compute capability 10, and the CPU shim reports 9.0.)"""
    cfg = {**LLAMA, **TE}
    a = save(tmp_path, "a", "tp2", cfg, fp8={"recipe": recipe})
    field = mf.read(mf.resolve(a["ckpt"])).te_state
    assert {m["form"] for m in field["modules"].values()} == {"stateless"}
    b = load(tmp_path, "b", "dp2", cfg, a["ckpt"])
    assert assert_same_fp8(fp8_dumps(a["dump"]), fp8_dumps(b["dump"])) == 0
    assert len(fp8_dumps(b["dump"])) == len(field["modules"]) > 0


def test_fp8_copies_that_differ_are_refused_by_module_name(tmp_path):
    """TE reduces amax over TP (and DP): copies of a module's state are equal. One TP rank's copy
    changed by hand: the save refuses, naming the module, on every rank."""
    a = save(tmp_path, "a", "tp2", {**LLAMA, **TE}, fp8=DELAYED, skew_rank=1)
    errors = {r["error"] for r in a["res"]}
    assert len(errors) == 1 and "decoder.layers.0." in next(iter(errors)), errors
    assert "differs between rank 0 and rank 1" in next(iter(errors))
    assert not (a["ckpt"] / "latest").exists()


def test_fp8_state_of_a_te_run_is_said_dropped_by_a_local_load(tmp_path):
    """A local-spec model has nowhere to put FP8 state: the load says so (fp8_modules 0) and keeps
    every weight and optimizer state."""
    cfg = {**LLAMA, **TE}
    a = save(tmp_path, "a", "tp2", cfg, fp8=DELAYED)
    b = load(tmp_path, "b", "dp2", {**LLAMA, "transformer_impl": "local"}, a["ckpt"])
    assert [r["fp8_modules"] for r in b["res"]] == [0, 0]
    assert assert_same_universal(tmp_path, a["ckpt"], b["resave"]) > 10


# ------------------------------------------------------------------ payload forms

def _te_linear(recipe):
    import transformer_engine.pytorch as te

    import megatron_ucp.testing.cpu_shim  # noqa: F401

    m = te.Linear(16, 16, params_dtype=torch.float32)
    with te.autocast(enabled=True, recipe=recipe):
        m.init_fp8_metadata(num_gemms=1)
    return m


def test_payload_forms_decode_without_unpickling_code(tmp_path):
    """TE 2.x (pickled dict with the recipe), TE 1.x (torch.save BytesIO, no recipe), stateless
    (empty): decoded into recipe JSON and tensors; a payload naming any other global is refused
    without running it; a decoded state written back gives TE the same extra state."""
    from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format

    import megatron_ucp.testing.cpu_shim  # noqa: F401
    from megatron_ucp import te_state

    m = _te_linear(DelayedScaling(fp8_format=Format.E4M3, amax_history_len=8, margin=1))
    m.fp8_meta["scaling_fwd"].amax_history.copy_(torch.arange(24.0).view(8, 3))
    m.fp8_meta["scaling_bwd"].scale.copy_(torch.tensor([0.25, 8.0]))
    st = te_state.decode(m.get_extra_state(), "te2")
    assert st.form == "te2-pickle"
    assert st.recipe["class"] == "DelayedScaling" and st.recipe["fp8_format"] == "E4M3"
    assert st.recipe["amax_history_len"] == 8 and st.recipe["margin"] == 1
    assert torch.equal(st.tensors["amax_history_fwd"], torch.arange(24.0).view(8, 3))
    assert torch.equal(st.tensors["scale_bwd"], torch.tensor([0.25, 8.0]))
    # put back into a fresh module without pickle: TE's own payload of it decodes the same
    fresh = _te_linear(DelayedScaling())
    te_state._apply(fresh, [st], "test")
    again = te_state.decode(fresh.get_extra_state(), "again")
    assert again.recipe == st.recipe and all(torch.equal(again.tensors[k], t) for k, t in st.tensors.items())
    recipe = fresh.fp8_meta["recipe"]
    assert type(recipe).__name__ == "DelayedScaling" and recipe.margin == 1

    # TE 1.x: torch.save of a dict, scale_inv included, no recipe
    buf = io.BytesIO()
    torch.save({"scale_fwd": torch.ones(3), "scale_inv_fwd": torch.ones(3),
                "amax_history_fwd": torch.zeros(4, 3), "scale_bwd": torch.ones(2),
                "scale_inv_bwd": torch.ones(2), "amax_history_bwd": torch.full((4, 2), 2.0),
                "extra_fp8_variables": {"num_gemms": 1, "fp8_max_fwd": 448.0}}, buf)
    st1 = te_state.decode(buf, "te1")
    assert st1.form == "te1-bytesio" and st1.recipe == {"class": "DelayedScaling"}
    assert torch.equal(st1.tensors["amax_history_bwd"], torch.full((4, 2), 2.0))
    assert st1.variables["num_gemms"] == 1

    # stateless: empty payload; the recipe comes from the module
    cs = _te_linear(Float8CurrentScaling())
    assert te_state.decode(cs.get_extra_state(), "cs") is None
    rec = te_state._module_state(te_state._Entry("x", cs, 0, True, cs.get_extra_state()))
    assert rec.form == "stateless" and rec.recipe["class"] == "Float8CurrentScaling"

    # a payload that would run code: refused by name, never run
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = torch.frombuffer(bytearray(pickle.dumps({"recipe": Evil()})), dtype=torch.uint8)
    with pytest.raises(UCPError, match=r"refuses to build (posix|os)\.system"):
        te_state.decode(evil, "evil")
    assert not marker.exists()
