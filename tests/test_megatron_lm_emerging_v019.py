"""Stock Megatron-LM core_v0.19.0 runs with `--optimizer muon` and `--optimizer lion`
(megatron-core 0.19.2's LayerWiseDistributedOptimizer: Muon or Lion for the weight matrices,
Adam for the rest), as megatron-ucp sources (tests/fixtures/megatron_lm_v019: torch_dist_muon_dp2,
torch_muon_dp2, torch_dist_lion_dp2, written by the unchanged pretrain_gpt.py on CPU).

(1) torch_dist: every universal tensor equals the stored `chained_<i>.optimizer.state.<state>.<key>`
    tensor read with torch.distributed.checkpoint, the key built here by hand (fp32_param = the
    master weight), and its family is the hand rule: Muon/Lion for 2-D weights other than the word
    embedding, Adam for the rest; Adam's step is the common state's `common_step`.
(2) torch: each universal tensor is, bitwise, one DP rank's `layer_wise_optimizer_<dp>.pt` entry
    (found by value here, exactly once, with its states), and the whole universal form equals the
    torch_dist set's: the two runs are the same training (identical losses in their logs).
(3) megatron-ucp's live load (megatron_ucp.load) of the universal form at DP1 restores every
    state into megatron-core's LayerWise optimizer.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from conftest import READS_CORE_V019_FILES, RELEASE_SKIP, SCENARIOS
from helpers import FIXTURE_MODEL
from oracles import load, load_keys, local_to_universal, model_key, universal_tensors

from megatron_ucp.conversion import convert
from megatron_ucp.testing.launch import launch

pytestmark = [READS_CORE_V019_FILES, pytest.mark.skipif(
    importlib.util.find_spec("emerging_optimizers") is None,
    reason=f"{RELEASE_SKIP}Muon and Lion come with emerging-optimizers (Python >= 3.12, the "
           "megatron-core 0.19 venv)")]

FIXTURES = Path(__file__).parent / "fixtures" / "megatron_lm_v019"
ITER = "iter_0000006"
DIST = {"torch_dist_muon_dp2": "muon", "torch_dist_lion_dp2": "lion"}
LEGACY = "torch_muon_dp2"
FAMILY_STATES = {"adam": ("exp_avg", "exp_avg_sq"), "muon": ("momentum_buffer",), "lion": ("exp_avg",)}
MUON_CFG = {**FIXTURE_MODEL, "optimizer": "muon", "dtype": "bf16",
            "optimizer_extra": {"use_layer_wise_distributed_optimizer": True}}
LION_CFG = {**FIXTURE_MODEL, "optimizer": "lion", "dtype": "bf16",
            "optimizer_extra": {"use_layer_wise_distributed_optimizer": True}}


def expected_family(name: str, shape: list, matrix_family: str) -> str:
    """megatron-core 0.19's emerging-optimizer default: linear weights (2-D, the position
    embedding too) to Muon/Lion, the word embedding, biases and norms to Adam."""
    return matrix_family if len(shape) == 2 and name != "embedding.word_embeddings.weight" else "adam"


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("emerging_v019")
    return {s: convert(FIXTURES / s / "ckpt", root / s, progress=False) for s in (*DIST, LEGACY)}


@pytest.mark.parametrize("name", DIST)
def test_dist_layer_wise_matches_the_stored_tensors(converted, name):
    manifest, tensors = universal_tensors(converted[name])
    ckpt = FIXTURES / name / "ckpt" / ITER
    params = manifest["params"]
    assert len(params) == 40
    keys, want = [], {}
    for n, p in params.items():
        fam = expected_family(n, p["shape"], DIST[name])
        assert p.get("optimizer", "adam") == fam, n
        assert set(p["tensors"]) == {"param", *FAMILY_STATES[fam]}, n
        assert p["step"] == (6.0 if fam == "adam" else 0.0), n
        chain = 1 if fam == "adam" else 0
        key, index = model_key(n)
        for s in ("param", *FAMILY_STATES[fam]):
            k = f"chained_{chain}.optimizer.state.{'fp32_param' if s == 'param' else s}.{key}"
            keys.append(k)
            want[(n, s)] = (k, index)
        keys.append(key)
        want[(n, "model")] = (key, index)
    stored = load_keys(ckpt, sorted(set(keys)))
    for (n, s), (k, index) in want.items():
        if s == "model":
            assert torch.equal(tensors[f"{n}/param"].to(torch.bfloat16), stored[k][index]), n
        else:
            assert torch.equal(tensors[f"{n}/{s}"], stored[k][index]), (n, s)
    assert manifest["iteration"] == 6 and manifest["scheduler"]["num_steps"] == 24
    groups = manifest["optimizer"]["param_groups"]
    # the identity keys megatron-core pairs groups by, per chained optimizer, in order
    assert [(g["optimizer"], g["wd_mult"], g["lr_mult"], g["is_decoupled_lr"], g["is_expert_parallel"],
             g["max_lr"], g["min_lr"]) for g in groups] == [
        (0, 1.0, 1.0, False, False, 1e-3, 0.0), ("adam", 1.0, 1.0, False, False, 1e-3, 0.0),
        ("adam", 0.0, 1.0, False, False, 1e-3, 0.0)]


def test_legacy_layer_wise_matches_the_rank_files(converted):
    manifest, tensors = universal_tensors(converted[LEGACY])
    rank_dir = FIXTURES / LEGACY / "ckpt" / ITER / "mp_rank_00"
    model = load(rank_dir / "model_optim_rng.pt")["model"]
    entries = []  # (dp, chain, fp32 master, states) of every parameter any rank's file holds
    for dp in (0, 1):
        saved = load(rank_dir / f"layer_wise_optimizer_{dp}.pt")
        for chain, entry in enumerate(saved):
            opt = entry["optimizer"]
            for g, group in enumerate(opt["param_groups"]):
                for j, pid in enumerate(group["params"]):
                    entries.append((dp, chain, entry["fp32_from_fp16_params"][g][j], opt["state"][pid]))
    assert len(entries) == 40 == len(manifest["params"])
    used = set()
    for n, p in manifest["params"].items():
        fam = expected_family(n, p["shape"], "muon")
        assert p.get("optimizer", "adam") == fam and p["step"] == (6.0 if fam == "adam" else 0.0), n
        master = tensors[f"{n}/param"]
        hits = [i for i, (_, _, m, _) in enumerate(entries)
                if m.shape == master.shape and torch.equal(m, master)]
        assert len(hits) == 1, (n, hits)
        dp, chain, _, state = entries[hits[0]]
        assert chain == (1 if fam == "adam" else 0), n
        assert set(state) - {"step"} == set(FAMILY_STATES[fam]), n
        for s in FAMILY_STATES[fam]:
            assert torch.equal(tensors[f"{n}/{s}"], state[s]), (n, s)
        local = n.replace("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm.").replace(
            "self_attention.linear_qkv.layer_norm_", "input_layernorm.")  # the local spec's names
        assert torch.equal(master.to(torch.bfloat16), model[local]), n
        used.add(hits[0])
    assert len(used) == 40


def test_legacy_and_dist_muon_runs_are_the_same_universal_form(converted):
    """The torch and torch_dist Muon runs are one training (same losses, logged): bitwise the same
    universal tensors, families and steps from the two readers."""
    log = {s: re.findall(r"lm loss: (\S+)", (FIXTURES / s / "log.txt").read_text())
           for s in (LEGACY, "torch_dist_muon_dp2")}
    assert len(log[LEGACY]) == 6 and log[LEGACY] == log["torch_dist_muon_dp2"]
    m1, t1 = universal_tensors(converted[LEGACY])
    m2, t2 = universal_tensors(converted["torch_dist_muon_dp2"])
    assert set(t1) == set(t2)
    for k in t1:
        assert torch.equal(t1[k], t2[k]), k
    for n in m1["params"]:
        for f in ("optimizer", "step", "shape"):
            assert m1["params"][n].get(f) == m2["params"][n].get(f), (n, f)


@pytest.mark.parametrize("name,cfg", [("torch_dist_muon_dp2", MUON_CFG), (LEGACY, MUON_CFG),
                                      ("torch_dist_lion_dp2", LION_CFG)])
def test_live_load_at_dp1_restores_the_state(converted, name, cfg, tmp_path):
    """megatron_ucp.load of the universal form into megatron-core's LayerWise optimizer at DP1
    (the run saved DP2): every weight and every state the optimizer holds is the universal one."""
    manifest, tensors = universal_tensors(converted[name])
    res = launch(1, f"{SCENARIOS}:load_and_train",
                 {"layout": "dp1", "cfg": cfg, "load_dir": str(converted[name]), "steps": 1,
                  "dump_dir": str(tmp_path / "dump")})
    assert res[0]["iteration"] == 6
    dump = load(tmp_path / "dump" / "rank0.pt")
    seen = set()
    for e in dump["params"]:
        n = local_to_universal(e["name"], 0, None)
        assert torch.equal(e["model"], tensors[f"{n}/param"].to(torch.bfloat16)), n
        fam = manifest["params"][n].get("optimizer", "adam")
        assert e["states"] == ["param", *sorted(FAMILY_STATES[fam])], (n, e["states"])
        assert e["step"] == manifest["params"][n]["step"], n
        for s in e["states"]:
            assert torch.equal(e[s], tensors[f"{n}/{s}"].reshape(-1)), (n, s)
        seen.add(n)
    assert seen == set(manifest["params"])
    assert all(x == x and x < 10 for x in res[0]["losses"])  # it trains on


def test_sgd_state_into_a_megatron_lm_target_is_refused_by_name(converted, tmp_path):
    """megatron-ucp writes Megatron-LM optimizer files for Adam, Muon and Lion state (Muon/Lion:
    tests/test_megatron_lm_layer_wise_out.py), not SGD's: a source whose momentum_buffer state is
    SGD's (the Muon universal form relabelled) is refused by name for both formats."""
    import json
    import shutil

    from megatron_ucp.conversion import write_legacy, write_torch_dist
    from megatron_ucp.errors import UCPError
    from megatron_ucp.formats.megatron_dist import run_fields
    from megatron_ucp.layout import Layout

    sgd = tmp_path / "sgd"
    shutil.copytree(converted["torch_dist_muon_dp2"], sgd)
    manifest = json.loads((sgd / "manifest.json").read_text())
    for p in manifest["params"].values():
        if p.get("optimizer") == "muon":
            p["optimizer"] = "sgd"
    (sgd / "manifest.json").write_text(json.dumps(manifest, sort_keys=True, separators=(",", ":")))
    args = run_fields(FIXTURES / "torch_dist_muon_dp2" / "ckpt").args
    for fmt, write in (("torch_dist", write_torch_dist), ("torch", write_legacy)):
        with pytest.raises(UCPError, match=rf"holds sgd optimizer state; megatron-ucp writes "
                                           rf"Megatron-LM --ckpt-format {fmt} optimizer state for "
                                           r"adam / muon / lion only"):
            write(sgd, tmp_path / fmt, Layout(dp=1), args, progress=False)
        assert not (tmp_path / fmt).exists()
