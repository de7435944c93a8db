"""Every optimizer path megatron-core builds, saved at one layout and loaded at another.

Each case is a transition test (tests/test_transitions.check_transition): after the load, every
model tensor and every optimizer state the optimizer holds (Adam's moments and step, SGD's and
Muon's momentum buffers, Lion's momentum) equals bitwise an independent assembly of the saved run
(megatron-core's own structures, tests/reference.py), a re-save consolidates to the same universal
tensors, and the loss continues the uninterrupted run's. SOAP, whose state has no universal form,
is tested for what is true of it: its save refused by name, its run loading weights with
reset_optimizer.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from conftest import RELEASE_SKIP, SCENARIOS, STEPS, nprocs
from test_transitions import check_transition, universal_tensors

from megatron_ucp.formats import manifest as mf
from megatron_ucp.inspector import inspect
from megatron_ucp.testing.launch import LaunchError, launch

HAS_EMERGING = importlib.util.find_spec("emerging_optimizers") is not None
NEEDS_EMERGING = pytest.mark.skipif(
    not HAS_EMERGING, reason=f"{RELEASE_SKIP}Muon, Lion and SOAP come with emerging-optimizers, "
                             "which needs Python >= 3.12 (the megatron-core 0.19 venv)")

SGD = {"optimizer": "sgd", "optimizer_extra": {"sgd_momentum": 0.9}}
LION = {"optimizer": "lion"}
PLAIN_DDP = {"use_distributed_optimizer": False}
# (bf16: HybridDeviceOptimizer cannot take fp32 runs' main params, views into the model's buffer:
# "can't optimize a non-leaf Tensor"; on CPU its device side is testing/hybrid_offload_cpu)
CPU_OFFLOAD = {"dtype": "bf16", "optimizer_extra": {
    "optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0,
    "use_torch_optimizer_for_cpu_offload": True, "pin_cpu_grads": False, "pin_cpu_params": False}}
MUON = {"optimizer": "muon", "optimizer_extra": {"use_layer_wise_distributed_optimizer": True}}


def _muon(tp_mode: str = "duplicated", **kw) -> dict:
    extra = {**kw.pop("optimizer_extra", MUON["optimizer_extra"]), "muon_tp_mode": tp_mode}
    return {**MUON, "dtype": "bf16", "optimizer_extra": extra, **kw}


BF16 = (5e-5, 2e-4)  # tests/test_transitions.RTOL's bf16 reduction-order floor
MUON_TP = (1e-3, 1e-3)


# id, source layout, target layout, config (the same at both), loss tolerances (first, later)
CASES = [
    # (megatron-core's DistributedOptimizer takes no SGD: "Only Adam, HybridDeviceOptimizer, and
    # optimizers with an init_state_fn (e.g., Lion)"; SGD runs in plain DDP or under CPU offload)
    ("adam-plain-ddp-fp32", "dp2", "tp2", PLAIN_DDP, (1e-5, 1e-5), []),
    ("adam-plain-ddp-bf16", "tp2", "dp2", {**PLAIN_DDP, "dtype": "bf16"}, BF16, []),
    # (plain DDP at PP2 trains apart from PP1 from its first step in megatron-core 0.16 and 0.19,
    # before any save: a PP change has no uninterrupted run to continue here)
    ("sgd-plain-ddp", "tp2", "dp2", {**SGD, **PLAIN_DDP}, (1e-5, 1e-5), []),
    ("sgd-plain-ddp-bf16", "dp2", "tp2", {**SGD, **PLAIN_DDP, "dtype": "bf16"}, BF16, []),
    ("adam-cpu-offload", "dp2", "tp2", CPU_OFFLOAD, BF16, []),
    ("sgd-cpu-offload", "tp2", "dp2", {**CPU_OFFLOAD, "optimizer": "sgd",
                                       "optimizer_extra": {**CPU_OFFLOAD["optimizer_extra"],
                                                           "sgd_momentum": 0.9}}, BF16, []),
    # Lion's update is a sign: another DP size's reduction order flips the sign of near-zero
    # updates (fresh runs at DP1 and DP2 part at step 3 by 7e-4), so its layout change keeps DP
    # (at DP1, TP2 and TP1 train bitwise alike)
    ("lion-distopt", "tp2", "tp1", LION, (1e-5, 1e-5), [NEEDS_EMERGING]),
    # Muon: megatron-core 0.19.2 builds LayerWise in bf16 only (fp32: its chain's config check
    # fails on the layout path, "'TensorParallelMuon' object has no attribute 'get_loss_scale'"
    # on the legacy one). At another TP, fresh bf16 runs part by up to 3.7e-4 in 5 steps.
    ("muon-layerwise", "dp2", "dp1", _muon(), BF16, [NEEDS_EMERGING]),
    ("muon-layerwise", "tp2", "dp2", _muon(), MUON_TP, [NEEDS_EMERGING]),
    ("muon-layerwise", "tp2pp2", "dp2", _muon(), MUON_TP, [NEEDS_EMERGING]),
    # the legacy LayerWise path (no shard-aligned param layout; what stock Megatron-LM
    # core_v0.19.0's pretrain_gpt.py builds): every parameter in LayerWise, Adam's too; its
    # uneven all-gather runs on gloo through testing/gloo_all_gather
    ("muon-legacy-pingpong", "dp2", "dp1", _muon(layer_wise_param_layout=False), BF16,
     [NEEDS_EMERGING]),
    ("muon-legacy-pingpong", "tp2", "dp2", _muon(layer_wise_param_layout=False), MUON_TP,
     [NEEDS_EMERGING]),
    # blockwise: each TP shard orthogonalised on its own, so at another TP the state continues
    # exactly (checked bitwise) but the update rule is another one: the loss is held to the
    # first resumed step (before any update) and to a bound, not to the uninterrupted run
    ("muon-blockwise", "tp2", "dp2", _muon("blockwise"), (1e-3, 5e-2), [NEEDS_EMERGING]),
    ("muon-lion-scalar", "tp2", "tp1",
     _muon(optimizer_extra={**MUON["optimizer_extra"], "muon_scalar_optimizer": "lion"}), MUON_TP,
     [NEEDS_EMERGING]),
    ("muon-distributed-tp", "tp2", "tp1", _muon("distributed"), MUON_TP, [NEEDS_EMERGING]),
]


@pytest.mark.parametrize("case,src,dst,cfg,rtol", [
    pytest.param(*c[:5], id=f"{c[0]}-{c[1]}->{c[2]}", marks=c[5]) for c in CASES])
def test_optimizer_transition(case, src, dst, cfg, rtol, source_runs, tmp_path):
    check_transition(source_runs, tmp_path, src, dst, cfg, rtol=rtol, name=f"{case}:{src}->{dst}")


def test_cpu_offload_step_and_weights(source_runs, tmp_path):
    """Adam under --optimizer-cpu-offload (HybridDeviceOptimizer): before the fix the per-parameter
    step came back as 1 (the dummy initial step) and the optimizer's own copy of the weights kept
    the dummy step's values, which its next step copied over the loaded weights."""
    src = source_runs.get("dp2", CPU_OFFLOAD)
    res = launch(nprocs("dp2"), f"{SCENARIOS}:load_and_train",
                 {"layout": "dp2", "cfg": CPU_OFFLOAD, "load_dir": str(src["ckpt"]), "steps": STEPS,
                  "dump_dir": str(tmp_path / "dump")})
    dumps = [torch.load(p, weights_only=False) for p in sorted((tmp_path / "dump").glob("rank*.pt"))]
    steps = {e["step"] for d in dumps for e in d["params"] if e["range"] is not None}
    assert steps == {float(STEPS)}
    assert res[0]["losses"] == src["continued"]  # at the saving layout: the same run, bitwise


@NEEDS_EMERGING
def test_muon_records_optimizers_and_families(source_runs, tmp_path):
    """The manifest says which optimizer manages each parameter (`optimizer` family) and what each
    optimizer is; inspect shows both; blockwise Muon's change of update rule at another TP is said."""
    src = source_runs.get("dp2", _muon("blockwise"))
    manifest = mf.read(src["ckpt"] / (src["ckpt"] / "latest").read_text().strip()).to_json()
    fams = {p.get("optimizer", "adam") for p in manifest["params"].values()}
    assert fams == {"muon", "adam"}, fams
    assert manifest["params"]["decoder.layers.0.mlp.linear_fc1.weight"]["optimizer"] == "muon"
    assert "optimizer" not in manifest["params"]["decoder.layers.0.mlp.linear_fc1.bias"]
    classes = [o["class"] for o in manifest["optimizer"]["optimizers"]]
    assert any("TensorParallelMuon" in c for c in classes), classes
    blockwise = [o for o in manifest["optimizer"]["optimizers"] if o["family"] == "muon"]
    assert blockwise[0]["hyperparameters"]["tp_mode"] == "blockwise" and "TP" in blockwise[0]["note"]
    shown = inspect(src["ckpt"])
    assert "optimizer    state of adam (" in shown and "muon (" in shown
    assert "TensorParallelMuon" in shown and "note: blockwise Muon" in shown
    u = universal_tensors(src["ckpt"], tmp_path / "u")
    assert "decoder.layers.0.mlp.linear_fc1.weight/momentum_buffer" in u
    assert "decoder.layers.0.mlp.linear_fc1.weight/exp_avg" not in u
    assert "decoder.layers.0.mlp.linear_fc1.bias/exp_avg_sq" in u


def test_other_optimizer_is_refused_then_reset(source_runs, tmp_path):
    """Adam state into an SGD run is refused by name; reset_optimizer=True keeps the weights
    (bitwise the saved master weights) and starts SGD fresh, saying what it dropped."""
    src = source_runs.get("dp2", {})
    sgd = {**SGD, **PLAIN_DDP}
    with pytest.raises(LaunchError, match=r"has adam optimizer state in the checkpoint but the run's "
                                          r"optimizer is sgd.*reset_optimizer=True"):
        launch(2, f"{SCENARIOS}:load_and_train", {"layout": "dp2", "cfg": sgd,
                                                   "load_dir": str(src["ckpt"]), "steps": 1})
    res = launch(2, f"{SCENARIOS}:load_and_train",
                 {"layout": "dp2", "cfg": sgd, "load_dir": str(src["ckpt"]), "steps": 1,
                  "dump_dir": str(tmp_path / "dump"), "reset_optimizer": True})
    assert res[0]["optimizer_reset"] == ["adam"]
    # the same layout: each rank's weights are the ones its saving rank held (fp32: the masters)
    for rank in (0, 1):
        saved = torch.load(src["dump"] / f"rank{rank}.pt", weights_only=False)["params"]
        loaded = torch.load(tmp_path / "dump" / f"rank{rank}.pt", weights_only=False)["params"]
        assert [e["name"] for e in saved] == [e["name"] for e in loaded]
        for a, b in zip(saved, loaded):
            assert torch.equal(a["model"], b["model"]), a["name"]
            if b["range"] is not None:  # SGD as built: its momentum starts at the first step
                assert b["states"] == ["param"], b["states"]


SOAP = {"dtype": "bf16", "optimizer": "soap", "optimizer_extra": MUON["optimizer_extra"]}


@NEEDS_EMERGING
def test_soap_save_is_refused_by_name(tmp_path):
    """SOAP (per TP shard Kronecker factors, eigenbases and moments in that eigenbasis: no
    elementwise layout) is refused at save by its class name, what its state is and what to do,
    before anything is written; never a bare KeyError."""
    with pytest.raises(LaunchError, match=r"optimizer emerging_optimizers\.soap\.soap\.SOAP "
                                          r"\(--optimizer soap\) is not supported by megatron-ucp "
                                          r"saves: SOAP keeps per TP shard.*Kronecker factors.*"
                                          r"reset_optimizer=True"):
        launch(2, f"{SCENARIOS}:train_and_save", {"layout": "dp2", "cfg": SOAP, "steps": 1,
                                                   "save_dir": str(tmp_path / "ckpt")})
    assert not (tmp_path / "ckpt" / "latest").exists()


@NEEDS_EMERGING
def test_soap_run_loads_weights_with_reset(source_runs, tmp_path):
    """What the SOAP refusal offers is true: a SOAP run loads a Muon run's checkpoint with
    reset_optimizer=True, the weights bitwise the saved ones, SOAP's state fresh (it starts at its
    first step) and the dropped families named; without it the load is refused by name. (Before,
    the SOAP run's optimizer was refused at the load too, reset or not.)"""
    src = source_runs.get("dp2", _muon())
    with pytest.raises(LaunchError, match=r"has (muon|adam) optimizer state in the checkpoint but "
                                          r"the run's optimizer is soap.*reset_optimizer=True"):
        launch(2, f"{SCENARIOS}:load_and_train", {"layout": "dp2", "cfg": SOAP,
                                                   "load_dir": str(src["ckpt"]), "steps": 1})
    res = launch(2, f"{SCENARIOS}:load_and_train",
                 {"layout": "dp2", "cfg": SOAP, "load_dir": str(src["ckpt"]), "steps": 1,
                  "dump_dir": str(tmp_path / "dump"), "reset_optimizer": True})
    assert res[0]["optimizer_reset"] == ["adam", "muon"]
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in res)
    for rank in (0, 1):
        saved = torch.load(src["dump"] / f"rank{rank}.pt", weights_only=False)["params"]
        loaded = torch.load(tmp_path / "dump" / f"rank{rank}.pt", weights_only=False)["params"]
        assert [e["name"] for e in saved] == [e["name"] for e in loaded]
        for a, b in zip(saved, loaded):
            assert torch.equal(a["model"], b["model"]), a["name"]


def test_megatron_lm_soap_state_is_refused_by_name():
    """A Megatron-LM LayerWise checkpoint with SOAP's state (its Kronecker factors) is refused
    naming SOAP and what its state is, not as an unknown state."""
    import argparse

    from megatron_ucp.errors import UCPError
    from megatron_ucp.formats.megatron_common import layer_wise_family

    args = argparse.Namespace(optimizer="soap")
    with pytest.raises(UCPError, match=r"ckpt: a LayerWiseDistributedOptimizer state \['L', 'Q_L', "
                                       r"'Q_R', 'R', 'exp_avg', 'exp_avg_sq'\] \(--optimizer soap\), "
                                       r"SOAP's: .*Kronecker"):
        layer_wise_family({"step", "exp_avg", "exp_avg_sq", "L", "R", "Q_L", "Q_R"}, args, "ckpt")


def rank_load_param_groups(cfg: dict) -> list[dict]:
    """Build `cfg`'s optimizer, give load_param_groups saved groups whose Muon group has its own
    weight decay, and return the live groups' weight decays and megatron-core names."""
    from megatron_ucp.optimizer_state import OptimizerIndex
    from megatron_ucp.testing import scenarios, tiny_gpt

    st = scenarios.setup("dp1", cfg)
    index = OptimizerIndex(st.optimizer)
    saved = index.param_groups()
    for g in saved:
        if not isinstance(g.get("optimizer"), str):  # Muon's (its group has no name): distinct
            g["weight_decay"] = 0.5
    index.load_param_groups(saved)
    out = [{"name": g.get("optimizer"), "weight_decay": g["weight_decay"], "wd_mult": g["wd_mult"]}
           for o in (u.torch_optimizer for u in index.units) for g in o.param_groups]
    tiny_gpt.destroy()
    return out


@NEEDS_EMERGING
def test_muon_and_adam_groups_keep_their_own_hyperparameters():
    """A Muon run's Adam group for the embedding has the wd_mult / lr_mult / decoupled-LR identity
    of its Muon group: matched on those alone (before the fix), it took the Muon group's
    hyper-parameters (weight decay 0.5 here), silently."""
    here = str(Path(__file__).resolve().parent)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
    groups = launch(1, "test_optimizers:rank_load_param_groups", {"cfg": _muon()}, env=env)[0]
    muon = [g for g in groups if g["name"] is None]
    adam = [g for g in groups if g["name"] == "adam"]
    assert muon and adam and any(g["wd_mult"] == muon[0]["wd_mult"] for g in adam)
    assert {g["weight_decay"] for g in muon} == {0.5}
    assert 0.5 not in {g["weight_decay"] for g in adam}, groups


def test_megatron_lm_precision_aware_checkpoints_are_refused_by_name():
    """A Megatron-LM checkpoint of a --use-precision-aware-optimizer run keeps TE FusedAdam's own
    state (int16 remainders as `param`): not read or written yet, refused by the flag's name (the
    live save and load of such a run: tests/test_precision_aware.py)."""
    import argparse

    from megatron_ucp.errors import UCPError
    from megatron_ucp.formats.megatron_common import check_supported

    args = argparse.Namespace(use_distributed_optimizer=True, world_size=1,
                              tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    check_supported(args, "ckpt")
    args.use_precision_aware_optimizer = True
    with pytest.raises(UCPError, match="ckpt: cannot import .*--use-precision-aware-optimizer is set"):
        check_supported(args, "ckpt")
