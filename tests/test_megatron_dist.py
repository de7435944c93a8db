"""Megatron-LM torch_dist checkpoints (real files from Megatron-LM core_v0.16.1) -> universal.

The expected values are computed here independently of the converter: fully_reshardable moments
are compared with `optimizer.state.<state>.<key>[layer]`; dp_reshardable moments are sliced out of
the per-TP-rank flat buffers with the rule documented in the fixtures' README (parameters in
reverse state-dict order, starts rounded up to 64, TP shards concatenated along the split axis),
not with megatron-core's DDP as the converter does.
"""

from __future__ import annotations

import io
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from megatron_ucp.errors import UCPError
from megatron_ucp.reshard import convert_torch_dist
from megatron_ucp.storage import Reader
from megatron_ucp.testing.launch import launch

FIXTURES = Path(__file__).parent / "fixtures" / "megatron_lm"
SETS = ("torch_dist_tp2_dp2", "torch_dist_pp2_fullyreshardable")
STATES = ("param", "exp_avg", "exp_avg_sq")
# the fixtures' model (README "Common settings")
CFG = {"num_layers": 3, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 128,
       "seq_length": 32, "vocab_size": 256, "dtype": "bf16", "micro_batch_size": 2,
       "global_batch_size": 4}
# one layer's parameters in the legacy state-dict order (linear_proj is registered before
# linear_qkv) with their TP split axis
LAYER = [("self_attention.linear_qkv.layer_norm_weight", None),
         ("self_attention.linear_qkv.layer_norm_bias", None),
         ("self_attention.linear_proj.weight", 1), ("self_attention.linear_proj.bias", None),
         ("self_attention.linear_qkv.weight", 0), ("self_attention.linear_qkv.bias", 0),
         ("mlp.linear_fc1.layer_norm_weight", None), ("mlp.linear_fc1.layer_norm_bias", None),
         ("mlp.linear_fc1.weight", 0), ("mlp.linear_fc1.bias", 0),
         ("mlp.linear_fc2.weight", 1), ("mlp.linear_fc2.bias", None)]


def load_keys(ckpt: Path, keys: list[str]) -> dict:
    """Read the named tensors/objects of a torch_dist directory without a process group."""
    meta = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    sd = {k: torch.empty(tuple(meta[k].size), dtype=meta[k].properties.dtype)
          if hasattr(meta[k], "size") else io.BytesIO() for k in keys}
    dcp.load(sd, checkpoint_id=str(ckpt), no_dist=True)
    return sd


def model_key(name: str) -> tuple[str, tuple[int, ...]]:
    """'decoder.layers.1.x.weight' -> ('decoder.layers.x.weight', (1,))."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"] and parts[2].isdigit():
        return ".".join(parts[:2] + parts[3:]), (int(parts[2]),)
    return name, ()


def readme_flat_layout(tp_size: int) -> list[tuple[str, int, tuple[int, ...]]]:
    """(universal name, start, local shape) of each param in one TP rank's flat buffer (README rule)."""
    full = {"embedding.word_embeddings.weight": ((256, 32), 0),
            "embedding.position_embeddings.weight": ((32, 32), None)}
    order = list(full)
    shapes = {"self_attention.linear_qkv.weight": (96, 32), "self_attention.linear_qkv.bias": (96,),
              "self_attention.linear_proj.weight": (32, 32), "mlp.linear_fc1.weight": (128, 32),
              "mlp.linear_fc1.bias": (128,), "mlp.linear_fc2.weight": (32, 128)}
    for layer in range(3):
        for n, axis in LAYER:
            name = f"decoder.layers.{layer}.{n}"
            full[name] = (shapes.get(n, (32,)), axis)
            order.append(name)
    for n in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias"):
        full[n] = ((32,), None)
        order.append(n)
    out, start = [], 0
    for name in reversed(order):
        shape, axis = full[name]
        local = tuple(s // tp_size if d == axis else s for d, s in enumerate(shape))
        start = -(-start // 64) * 64
        out.append((name, start, local, axis))
        start += math.prod(local)
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("torch_dist")
    return {s: convert_torch_dist(FIXTURES / s / "ckpt", root / s, progress=False) for s in SETS}


def read_universal(path: Path) -> tuple[dict, dict]:
    import json

    manifest = json.loads((path / "manifest.json").read_text())
    reader = Reader()
    tensors = {(n, s): reader.read(path / e["file"], e["key"])
               for n, spec in manifest["params"].items() for s, e in spec["tensors"].items()}
    return manifest, tensors


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
    prefix = ("optimizer.distributed.dp_group_idx_{}.gbuf_idx_0."
              "dtype_(torch.bfloat16, torch.float32).bucket_idx_0.{}")
    flat = load_keys(ckpt, [prefix.format(k, s) for k in range(2) for s in STATES])
    layout = readme_flat_layout(2)
    assert {n for n, *_ in layout} == set(manifest["params"])
    for n, start, local, axis in layout:
        for s in STATES:
            shards = [flat[prefix.format(k, s)][start:start + math.prod(local)].view(local)
                      for k in range(2)]
            want = shards[0] if axis is None else torch.cat(shards, dim=axis)
            assert torch.equal(tensors[(n, s)], want), (n, s)
    steps = load_keys(ckpt, ["optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"])
    groups = next(iter(steps.values()))[0]["param_groups"]
    assert {g["step"] for g in groups} == {6.0}


def test_resume_tp1(converted):
    res = launch(1, "megatron_ucp.testing.scenarios:load_and_train",
                 {"layout": "tp1", "cfg": CFG, "load_dir": str(converted["torch_dist_tp2_dp2"]),
                  "steps": 2})
    losses = res[0]["losses"]
    assert res[0]["iteration"] == 6
    assert all(math.isfinite(x) and x < 6.0 for x in losses), losses


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

    from megatron_ucp.formats.megatron_dist.layout import DistReader
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
