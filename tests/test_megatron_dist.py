"""Megatron-LM torch_dist checkpoints (real files from Megatron-LM core_v0.16.1) -> universal.

The expected values are computed here independently of the converter: fully_reshardable moments
are compared with `optimizer.state.<state>.<key>[layer]`; dp_reshardable moments are sliced out of
the per-TP-rank flat buffers with the rule documented in the fixtures' README (parameters in
reverse state-dict order, starts rounded up to 64, TP shards concatenated along the split axis),
not with megatron-core's DDP as the converter does (tests/oracles.py).
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import FIXTURE_MODEL
from oracles import assert_dumps_hold, dp_reshardable_full, load_keys, model_key, universal_tensors

from megatron_ucp.conversion import convert_torch_dist
from megatron_ucp.errors import UCPError
from megatron_ucp.testing.launch import launch

FIXTURES = Path(__file__).parent / "fixtures" / "megatron_lm"
SETS = ("torch_dist_tp2_dp2", "torch_dist_pp2_fullyreshardable")
STATES = ("param", "exp_avg", "exp_avg_sq")
CFG = FIXTURE_MODEL  # the fixtures' model (README "Common settings")


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("torch_dist")
    return {s: convert_torch_dist(FIXTURES / s / "ckpt", root / s, progress=False) for s in SETS}


def read_universal(path: Path) -> tuple[dict, dict]:
    manifest, tensors = universal_tensors(path)
    return manifest, {tuple(k.rsplit("/", 1)): t for k, t in tensors.items()}


@pytest.mark.parametrize("name", SETS)
def test_model_tensors_and_step(converted, name):
    manifest, tensors = read_universal(converted[name])
    ckpt = FIXTURES / name / "ckpt" / "iter_0000006"
    params = manifest["params"]
    assert len(params) == 2 + 3 * 12 + 2  # tied output layer is the word embedding
    stored = load_keys(ckpt, sorted({model_key(n)[0] for n in params}))
    for n, spec in params.items():
        key, index = model_key(n)
        model = stored[key][index]
        assert list(model.shape) == spec["shape"], n
        master = tensors[(n, "param")]
        assert master.dtype == torch.float32
        assert torch.equal(master.to(torch.bfloat16), model), n  # bitwise
        assert spec["step"] == 6.0
    assert manifest["iteration"] == 6 and manifest["kind"] == "universal"
    assert manifest["scheduler"]["num_steps"] == 24
    assert manifest["model"]["vocab_size"] == 256 and manifest["model"]["num_layers"] == 3
    assert params["decoder.layers.0.self_attention.linear_qkv.weight"]["tp_axis"] == 0
    assert params["decoder.layers.0.mlp.linear_fc2.weight"]["tp_axis"] == 1
    assert params["decoder.layers.0.mlp.linear_fc2.bias"]["tp_axis"] is None
    assert params["embedding.word_embeddings.weight"]["vocab_rows"] is True


def test_moments_fully_reshardable(converted):
    name = "torch_dist_pp2_fullyreshardable"
    manifest, tensors = read_universal(converted[name])
    ckpt = FIXTURES / name / "ckpt" / "iter_0000006"
    keys = sorted({f"optimizer.state.{s}.{model_key(n)[0]}" for n in manifest["params"] for s in STATES})
    stored = load_keys(ckpt, keys)
    for n in manifest["params"]:
        key, index = model_key(n)
        for s in STATES:
            assert torch.equal(tensors[(n, s)], stored[f"optimizer.state.{s}.{key}"][index]), (n, s)


def test_moments_dp_reshardable(converted):
    name = "torch_dist_tp2_dp2"
    manifest, tensors = read_universal(converted[name])
    ckpt = FIXTURES / name / "ckpt" / "iter_0000006"
    full = dp_reshardable_full(ckpt, {n: tuple(p["shape"]) for n, p in manifest["params"].items()})
    assert set(full) == set(manifest["params"])
    for n, states in full.items():
        for s in STATES:
            assert torch.equal(tensors[(n, s)], states[s]), (n, s)
    steps = load_keys(ckpt, ["optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"])
    groups = next(iter(steps.values()))[0]["param_groups"]
    assert {g["step"] for g in groups} == {6.0}


def test_resume_tp1(converted, tmp_path):
    """The TP2 DP2 run's conversion resumed at TP1 in a real megatron-core run: every loaded model
    weight, master weight, Adam moment and step is the universal one (itself checked against the
    fixture's files above), the constant LR of the run is restored, and two more steps train.
    (The loss cannot be compared with Megatron-LM's log: the tiny GPT's data is not its mock
    stream; test_megatron_legacy_out resumes through megatron-core's own load for that.)"""
    udir = converted["torch_dist_tp2_dp2"]
    res = launch(1, "megatron_ucp.testing.scenarios:load_and_train",
                 {"layout": "tp1", "cfg": CFG, "load_dir": str(udir), "steps": 2,
                  "dump_dir": str(tmp_path / "dump")})
    r = res[0]
    assert r["iteration"] == 6 and r["extra"] == {"consumed_samples": 24}
    assert r["lr"] == [1e-3] * len(r["lr"])
    manifest, tensors = universal_tensors(udir)
    assert_dumps_hold(tmp_path / "dump", manifest, tensors, None, ranks=1)
    losses = r["losses"]
    assert len(losses) == 2 and all(math.isfinite(x) and x < 6.0 for x in losses), losses


def test_missing_distcp_is_named(tmp_path):
    src = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "torch_dist_pp2_fullyreshardable" / "ckpt", src)
    (src / "iter_0000006" / "__1_0.distcp").unlink()
    with pytest.raises(UCPError, match=r"__1_0\.distcp"):
        convert_torch_dist(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_args_and_tensors_must_agree():
    """The TP1 model built from args and the stored tensors are matched both ways, by name."""
    import argparse

    from megatron_ucp.formats.dcp_reader import DistReader
    from megatron_ucp.formats.megatron_dist.layout import plan_model as _plan_model
    from megatron_ucp.formats.megatron_dist.reader import check_names as _check_names

    ckpt = FIXTURES / "torch_dist_pp2_fullyreshardable" / "ckpt" / "iter_0000006"
    reader = DistReader(ckpt)
    args = torch.load(ckpt / "common.pt", weights_only=False)["args"]
    untied = argparse.Namespace(**{**vars(args), "untie_embeddings_and_output_weights": True})
    with pytest.raises(UCPError, match=r"'output_layer\.weight'.*no such tensor"):
        _check_names(reader, _plan_model(untied)[0], "fully_reshardable")
    fewer = argparse.Namespace(**{**vars(args), "num_layers": 2})
    with pytest.raises(UCPError, match=r"decoder\.layers\..*has 3 stacked entries but the model uses 2"):
        _check_names(reader, _plan_model(fewer)[0], "fully_reshardable")


def test_cli(tmp_path):
    out = tmp_path / "u"
    src = FIXTURES / "torch_dist_pp2_fullyreshardable" / "ckpt"
    r = subprocess.run([sys.executable, "-m", "megatron_ucp", "import-torch-dist", str(src), str(out),
                        "--no-progress"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "manifest.json").exists()
    r = subprocess.run([sys.executable, "-m", "megatron_ucp", "import-torch-dist",
                        str(tmp_path / "nope"), str(tmp_path / "u2")], capture_output=True, text=True)
    assert r.returncode == 2 and "does not exist" in r.stderr
