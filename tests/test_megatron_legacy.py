"""Megatron-LM `--ckpt-format torch` checkpoints -> universal directory (formats.megatron_legacy).

The fixtures in tests/fixtures/megatron_lm/<set>/ckpt are real saves of Megatron-LM core_v0.16.1
(CPU, gloo; /work/shared/fixtures/megatron_lm/README.md describes them), iteration 6 only.

(1) Every universal tensor equals a reference assembled here INDEPENDENTLY of megatron-core and of
    megatron_ucp: plain torch.load, the documented flat-buffer rule of distrib_optim.pt (parameters in
    reverse state-dict order, starts aligned to 64 elements, a tied embedding in a bucket of its own,
    bucket end padding dropped), layer offsets per pipeline stage / virtual chunk, expert offsets per
    EP rank, and concatenation along the known TP dims (SwiGLU: gate halves, then up halves).
(2) A converted checkpoint resumes at another layout in a real megatron-core run.
(3) Damaged or ambiguous inputs raise UCPError naming the file and what to do.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import NEEDS_LEGACY_GROUPED_MLP, RELEASE_SKIP
from helpers import FIXTURE_MODEL
from oracles import full_tensor, load, split_grouped, universal_name, universal_tensors
from oracles import legacy_reference as reference

from megatron_ucp import UCPError, convert
from megatron_ucp.cli import main as cli_main
from megatron_ucp.conversion import convert_legacy
from megatron_ucp.mcore_compat import has_legacy_grouped_mlp
from megatron_ucp.testing.launch import launch

FIXTURES = Path(__file__).parent / "fixtures" / "megatron_lm"
# torch_moe_grouped_ep2 was saved by the legacy GroupedMLP, which megatron-core 0.19 no longer has
SETS = ["torch_tp2_pp2", "torch_dp2", "torch_tp2_fp32", "torch_llama_tp2", "torch_vpp", "torch_moe_ep2",
        *(["torch_moe_grouped_ep2"] if has_legacy_grouped_mlp() else [])]
ITER = "iter_0000006"
STATES = ("param", "exp_avg", "exp_avg_sq")
# lm loss at iteration 6 in each run's log (README losses table)
FINAL_LOSS = {"torch_tp2_pp2": 5.520222, "torch_dp2": 5.525421, "torch_tp2_fp32": 5.513841,
              "torch_llama_tp2": 5.435615, "torch_vpp": 5.522317, "torch_moe_ep2": 5.529915,
              "torch_moe_grouped_ep2": 5.531860}


# ------------------------------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("legacy")
    return {s: convert_legacy(FIXTURES / s / "ckpt", root / s, progress=False) for s in SETS}


@pytest.mark.parametrize("name", SETS)
def test_universal_tensors_match_independent_assembly(converted, name):
    udir = converted[name]
    manifest, tensors = universal_tensors(udir)
    args = load(next((FIXTURES / name / "ckpt" / ITER).iterdir()) / "model_optim_rng.pt")["args"]
    ref = reference(FIXTURES / name / "ckpt")
    assert set(manifest["params"]) == set(ref)
    for pname, copies in ref.items():
        spec = manifest["params"][pname]
        weight = full_tensor(pname, copies["weight"], args.swiglu)
        assert tuple(spec["shape"]) == tuple(weight.shape), pname
        assert spec["step"] == 6.0, pname
        for state in STATES:
            expected = full_tensor(pname, copies[state], args.swiglu)
            got = tensors[f"{pname}/{state}"]
            assert got.dtype == torch.float32 and torch.equal(got, expected), f"{pname}/{state}"
        # the model weights in model_optim_rng.pt are the fp32 master cast to the training dtype
        assert torch.equal(tensors[f"{pname}/param"].to(weight.dtype), weight), pname
    assert manifest["kind"] == "universal" and manifest["iteration"] == 6
    assert manifest["extra"] == {"consumed_samples": 24}
    assert manifest["scheduler"]["num_steps"] == 24  # Megatron-LM counts samples; kept as-is
    lay = manifest["layout"]
    assert (lay["tp"], lay["pp"], lay["dp"], lay["vpp"], lay["ep"]) == (
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size,
        args.virtual_pipeline_model_parallel_size, args.expert_model_parallel_size)
    groups = manifest["optimizer"]["param_groups"]
    assert {g["wd_mult"] for g in groups} == {0.0, 1.0} and all("step" not in g for g in groups)
    assert {g["weight_decay"] for g in groups} == {0.0, 0.01}
    if args.pipeline_model_parallel_size > 1 and not args.untie_embeddings_and_output_weights:
        assert manifest["params"]["embedding.word_embeddings.weight"]["aliases"] == ["output_layer.weight"]


def test_resume_converted_checkpoint_at_another_layout(converted, tmp_path):
    """TP2xPP2 (uneven stages, tied embeddings on both ends) -> TP1 DP2 in a real megatron-core run:
    the loaded model weights, master weights, Adam moments and step are the converted ones, and
    training goes on from them."""
    cfg = {**FIXTURE_MODEL, "extra": {"add_qkv_bias": True}}  # Megatron-LM's --add-qkv-bias
    udir = converted["torch_tp2_pp2"]
    res = launch(2, "megatron_ucp.testing.scenarios:load_and_train",
                 {"layout": "dp2", "cfg": cfg, "load_dir": str(udir), "steps": 2,
                  "dump_dir": str(tmp_path / "dump"), "resave_dir": str(tmp_path / "resave")},
                 timeout=300)
    r = res[0]
    assert r["iteration"] == 6 and r["extra"] == {"consumed_samples": 24}
    assert r["rng_restored"] == []  # another layout: re-derived, nothing restored
    assert r["lr"] == [1e-3] * len(r["lr"])  # constant schedule restored from opt_param_scheduler
    # other data than Megatron's mock stream, so only the scale can be compared with the log
    assert all(math.isfinite(x) and x < 6.0 for x in r["losses"]), r["losses"]
    assert abs(r["losses"][0] - FINAL_LOSS["torch_tp2_pp2"]) < 0.5, r["losses"]

    manifest, tensors = universal_tensors(udir)
    covered = dict.fromkeys(manifest["params"], 0)
    for rank in range(2):
        for e in load(tmp_path / "dump" / f"rank{rank}.pt")["params"]:
            name = universal_name(e["name"], 0, 0)  # TP1 PP1: local names are global
            assert torch.equal(e["model"], tensors[f"{name}/param"].to(torch.bfloat16)), name
            if e["range"] is not None:
                a, b = e["range"]
                assert e["step"] == 6.0
                for state in STATES:
                    assert torch.equal(e[state], tensors[f"{name}/{state}"].reshape(-1)[a:b]), name
                covered[name] += b - a
    # the two DP ranks' distributed-optimizer shards together hold every element of every param
    assert covered == {n: math.prod(p["shape"]) for n, p in manifest["params"].items()}

    # same schema as megatron_ucp.convert: re-saved at DP2 and consolidated, nothing changes
    again, tensors2 = universal_tensors(convert(tmp_path / "resave", tmp_path / "u2", progress=False))
    assert set(again) == set(manifest)
    assert again["params"].keys() == manifest["params"].keys()
    for n, p in manifest["params"].items():  # aliases are layout-bound (no output copy at PP1)
        assert ({k: v for k, v in again["params"][n].items() if k not in ("tensors", "aliases")}
                == {k: v for k, v in p.items() if k not in ("tensors", "aliases")}), n
    assert tensors2.keys() == tensors.keys()
    assert all(torch.equal(tensors2[k], t) for k, t in tensors.items())


@NEEDS_LEGACY_GROUPED_MLP
def test_grouped_gemm_checkpoint_resumes_as_sequential_and_grouped_mlp(converted, tmp_path):
    """Megatron-LM's GroupedMLP run (EP2, fused expert weights) resumed at EP1 DP2 by a real
    megatron-core run built with SequentialMLP experts and with GroupedMLP: both get every expert
    weight bitwise from the converted checkpoint and continue with identical losses."""
    cfg = {**FIXTURE_MODEL, "swiglu": True, "add_bias_linear": False, "num_experts": 4}
    udir = converted["torch_moe_grouped_ep2"]
    _, tensors = universal_tensors(udir)
    losses = {}
    for grouped in (False, True):
        dump = tmp_path / f"dump{int(grouped)}"
        res = launch(2, "megatron_ucp.testing.scenarios:load_and_train",
                     {"layout": "dp2", "cfg": {**cfg, "moe_grouped_gemm": grouped},
                      "load_dir": str(udir), "steps": 2, "dump_dir": str(dump)}, timeout=300)
        assert res[0]["iteration"] == 6
        losses[grouped] = res[0]["losses"]
        local = {e["name"]: e["model"] for e in load(dump / "rank0.pt")["params"]}
        assert any(n.endswith("experts.weight1") for n in local) is grouped
        checked = 0
        for name, weight in split_grouped(local, 4).items():
            moe_norm = universal_name(name, 0, 0, moe=True)  # every layer a MoE layer
            assert torch.equal(weight, tensors[f"{moe_norm}/param"].to(weight.dtype)), name
            checked += "local_experts" in name
        assert checked == 3 * 4 * 2  # layers x experts x (fc1, fc2)
    assert losses[False] == losses[True]
    assert abs(losses[False][0] - FINAL_LOSS["torch_moe_grouped_ep2"]) < 0.5, losses


def test_cli_import_legacy(tmp_path, capsys):
    out = tmp_path / "u"
    assert cli_main(["import-legacy", str(FIXTURES / "torch_dp2" / "ckpt" / ITER), str(out),
                     "--no-progress"]) == 0
    assert json.loads((out / "manifest.json").read_text())["kind"] == "universal"
    assert cli_main(["import-legacy", str(tmp_path / "nope"), str(tmp_path / "u2")]) == 2
    assert "does not exist" in capsys.readouterr().err


# --------------------------------------------------------------------------------- bad inputs


def copy_set(name: str, tmp_path: Path) -> Path:
    dst = Path(shutil.copytree(FIXTURES / name / "ckpt", tmp_path / name))
    for p in dst.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return dst


def edit(path: Path, fn) -> None:
    obj = load(path)
    fn(obj)
    torch.save(obj, path)


def test_missing_rank_dir(tmp_path):
    ckpt = copy_set("torch_tp2_pp2", tmp_path)
    shutil.rmtree(ckpt / ITER / "mp_rank_01_001")
    with pytest.raises(UCPError, match=r"mp_rank_01_001.*missing.*incomplete"):
        convert_legacy(ckpt, tmp_path / "u", progress=False)
    assert not (tmp_path / "u").exists()


def test_rank_files_from_different_iterations(tmp_path):
    ckpt = copy_set("torch_tp2_pp2", tmp_path)
    bad = ckpt / ITER / "mp_rank_01_000" / "model_optim_rng.pt"
    edit(bad, lambda m: m.update(iteration=3))
    with pytest.raises(UCPError, match=re.escape(str(bad)) + r" is from iteration 3.*mix"):
        convert_legacy(ckpt, tmp_path / "u", progress=False)


def test_truncated_file(tmp_path):
    ckpt = copy_set("torch_tp2_pp2", tmp_path)
    bad = ckpt / ITER / "mp_rank_00_001" / "distrib_optim.pt"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    with pytest.raises(UCPError, match=re.escape(str(bad)) + r" cannot be read.*truncated or corrupt"):
        convert_legacy(ckpt, tmp_path / "u", progress=False)


def test_moe_pp_ambiguity_without_args(tmp_path):
    ckpt = copy_set("torch_moe_ep2", tmp_path)
    for d in (ckpt / ITER).iterdir():
        edit(d / "model_optim_rng.pt", lambda m: m.pop("args"))
    with pytest.raises(UCPError, match=r"no Megatron-LM 'args'.*mp_rank_00_000.*ambiguous.*expert rank"):
        convert_legacy(ckpt, tmp_path / "u", progress=False)


def test_model_weight_not_master(tmp_path):
    ckpt = copy_set("torch_dp2", tmp_path)
    bad = ckpt / ITER / "mp_rank_00" / "model_optim_rng.pt"
    edit(bad, lambda m: m["model"]["decoder.layers.1.mlp.linear_fc2.weight"].add_(1.0))
    with pytest.raises(UCPError, match=re.escape(str(bad)) + r": model weight decoder\.layers\.1\.mlp"
                       r"\.linear_fc2\.weight .*not the master weight"):
        convert_legacy(ckpt, tmp_path / "u", progress=False)


def test_tied_copies_must_agree(tmp_path):
    """The last stage's output_layer.weight has its own optimizer state; it must equal the
    embedding's on the first stage (bitwise), or the conversion stops."""
    ckpt = copy_set("torch_tp2_pp2", tmp_path)
    bad = ckpt / ITER / "mp_rank_00_001" / "distrib_optim.pt"
    edit(bad, lambda o: o[0][(torch.bfloat16, torch.float32)]["exp_avg"][:4096].add_(1.0))
    with pytest.raises(UCPError, match=r"exp_avg of output_layer\.weight \(universal embedding\.word_"
                       r"embeddings\.weight\) differs from another rank's copy"):
        convert_legacy(ckpt, tmp_path / "u", progress=False)


def test_tracker_and_output_dir(tmp_path):
    ckpt = copy_set("torch_dp2", tmp_path)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("9\n")
    with pytest.raises(UCPError, match=r"names iteration 9.*iter_0000009 does not exist"):
        convert_legacy(ckpt, tmp_path / "u", progress=False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(UCPError, match="not empty"):
        convert_legacy(ckpt / ITER, tmp_path / "full", progress=False)


@pytest.mark.skipif(has_legacy_grouped_mlp(), reason=f"{RELEASE_SKIP}this release has the legacy GroupedMLP")
def test_grouped_mlp_checkpoint_on_a_release_without_it_says_how_to_convert(tmp_path):
    """megatron-core 0.19 cannot rebuild a GroupedMLP run: the error names the fused weight and the
    way out (convert with 0.16-0.18, load the universal checkpoint), instead of a key mismatch."""
    with pytest.raises(UCPError, match=r"experts\.weight1.*legacy GroupedMLP.*megatron-core 0\.16-0\.18"):
        convert_legacy(FIXTURES / "torch_moe_grouped_ep2" / "ckpt", tmp_path / "u", progress=False)
    assert not (tmp_path / "u").exists()


@NEEDS_LEGACY_GROUPED_MLP
def test_rebuild_of_a_grouped_gemm_run_names_experts_like_sequential_mlp():
    """A Megatron-LM run with --moe-grouped-gemm (local spec: GroupedMLP, one fused weight per EP
    rank) is rebuilt on CPU, and its experts get the same universal names and split rules as the
    SequentialMLP run's, so checkpoints convert between the two."""
    import argparse

    from megatron_ucp.formats.megatron_legacy import run_fields as legacy_source_fields
    from megatron_ucp.formats.megatron_rebuild import build_chunks, source_rank
    from megatron_ucp.param_spec import local_params

    args = legacy_source_fields(FIXTURES / "torch_moe_ep2" / "ckpt").args

    def specs(grouped: bool) -> dict:
        a = argparse.Namespace(**{**vars(args), "add_bias_linear": False, "moe_grouped_gemm": grouped})
        with source_rank(a, 1):  # EP rank 1 holds experts 2 and 3
            lps = local_params(build_chunks(a))
        return {lp.spec.name: lp.spec for lp in lps}, {lp.local_name for lp in lps}

    (sequential, seq_local), (grouped, grouped_local) = specs(False), specs(True)
    assert "decoder.layers.0.mlp.experts.weight1" in grouped_local  # really the fused GroupedMLP
    assert "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight" in seq_local
    assert sequential == grouped
    experts = {n.split(".experts.experts.")[1].split(".")[0] for n in grouped if ".experts.experts." in n}
    assert sorted(experts) == ["2", "3"]
