"""Every user-facing failure raises UCPError whose message names the culprit and says what to do.

One real checkpoint (megatron-core GPT on the CPU shim, TP2, 2 steps) is made per module; each
corruption case works on its own copy. Checks that live in `load` (layout, model config, parameter
sets) go through launched ranks, where the LaunchError carries the failing rank's log tail; checks
in the readers run in-process through open_source / convert, which need no process group.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import megatron_ucp as ucp
from megatron_ucp.formats import open_source
from megatron_ucp.layout import Layout
from megatron_ucp.storage import Reader
from megatron_ucp.testing.launch import LaunchError, launch
from megatron_ucp.validation import check_layout, check_load_layout, check_model_config

ITER = "iter_0000002"
FINAL_LN = "decoder.final_layernorm.weight"  # replicated: held by rank 0, read by every rank


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """Save root of a TP2 checkpoint of the default tiny GPT after 2 steps (do not modify)."""
    root = tmp_path_factory.mktemp("errors_src") / "ckpt"
    launch(2, "megatron_ucp.testing.scenarios:train_and_save",
           {"layout": "tp2", "cfg": {}, "steps": 2, "save_dir": str(root)}, timeout=300)
    return root


@pytest.fixture
def ckpt(source, tmp_path) -> Path:
    """A private copy of the save root, free to corrupt."""
    return Path(shutil.copytree(source, tmp_path / "ckpt"))


def edit_manifest(root: Path, fn) -> None:
    path = root / ITER / "manifest.json"
    m = json.loads(path.read_text())
    fn(m)
    path.write_text(json.dumps(m))


def tensor_region(path: Path, key: str) -> tuple[int, int]:
    """Absolute byte range of tensor `key` in a safetensors file."""
    run = Reader().byte_run(path, key)
    return run.offset, run.offset + run.nbytes


def flip_bytes(path: Path, key: str) -> None:
    begin, end = tensor_region(path, key)
    pos = (begin + end) // 2
    with open(path, "r+b") as f:
        f.seek(pos)
        old = f.read(4)
        f.seek(pos)
        f.write(bytes(b ^ 0xFF for b in old))


def raises_ucp(fn) -> str:
    with pytest.raises(ucp.UCPError) as ei:
        fn()
    return str(ei.value)


def failed_load(load_dir: Path, cfg: dict, layout: str = "tp2") -> str:
    """Launch a load at `layout` with a model built from `cfg`; returns the failing rank's log."""
    with pytest.raises(LaunchError) as ei:
        launch(2, "megatron_ucp.testing.scenarios:load_and_train",
               {"layout": layout, "cfg": cfg, "load_dir": str(load_dir), "steps": 0}, timeout=300)
    text = str(ei.value)
    assert "megatron_ucp.errors.UCPError" in text, text
    return text


def saved_model(source: Path) -> dict:
    return json.loads((source / ITER / "manifest.json").read_text())["model"]


# ---- target layout cannot hold the model ------------------------------------------------------


def test_tp_not_dividing_heads_and_groups(source):
    msg = raises_ucp(lambda: check_layout(saved_model(source), Layout(tp=3)))
    for part in ("num_attention_heads=4 is not divisible by TP=3",
                 "num_query_groups=4 is not divisible by TP=3",
                 "TP3xPP1xDP1", "Choose parallel sizes"):
        assert part in msg, msg
    assert "num_layers" not in msg


def test_pp_not_dividing_layers(source):
    msg = raises_ucp(lambda: check_layout(saved_model(source), Layout(pp=3)))
    assert "num_layers=4 is not divisible by PP=3" in msg and "TP1xPP3xDP1" in msg, msg
    assert "num_attention_heads" not in msg and "num_query_groups" not in msg


def test_load_layout_takes_the_models_pipeline_split():
    """A load checks the target against the built model's own pipeline split: 3 layers saved
    without one load into PP2 stages of 2 + 1 (stock Megatron-LM core_v0.19.0 with
    --decoder-first-pipeline-num-layers 2 was refused: "num_layers=3 is not divisible by PP=2")."""
    saved = {"num_attention_heads": 4, "num_layers": 3, "num_layers_in_first_pipeline_stage": None}
    split = {**saved, "num_layers_in_first_pipeline_stage": 2}
    check_load_layout(saved, split, Layout(pp=2))
    check_load_layout(split, split, Layout(pp=1))
    msg = raises_ucp(lambda: check_load_layout(split, saved, Layout(pp=2)))
    assert "num_layers=3 is not divisible by PP=2" in msg, msg


def test_tp_not_dividing_query_groups_only():
    msg = raises_ucp(lambda: check_layout({"num_attention_heads": 8, "num_query_groups": 2,
                                           "num_layers": 4}, Layout(tp=4)))
    assert "num_query_groups=2 is not divisible by TP=4" in msg, msg
    assert "num_attention_heads" not in msg


def test_layout_with_experts_not_dividing_ep_is_rejected():
    cfg = {"num_attention_heads": 4, "num_layers": 4, "num_moe_experts": 4}
    msg = raises_ucp(lambda: check_layout(cfg, Layout(ep=3)))
    assert "num_moe_experts=4 is not divisible by EP=3" in msg, msg


def test_load_rejects_layout_not_dividing_saved_query_groups(ckpt):
    # megatron-core 0.16 builds a TP2 model with 1 query group (groups may divide TP), so the
    # check must come from load, from the checkpoint's own model description.
    edit_manifest(ckpt, lambda m: m["model"].update(num_query_groups=1))
    log = failed_load(ckpt, {})
    assert "num_query_groups=1 is not divisible by TP=2" in log, log
    assert "target layout TP2xPP1xDP1 cannot hold this model" in log and ITER in log


# ---- model does not match the checkpoint ------------------------------------------------------


def test_model_config_mismatch_names_each_field(source):
    log = failed_load(source, {"hidden_size": 32, "num_layers": 2, "vocab_size": 128,
                               "add_bias_linear": False})
    for part in ("hidden_size: checkpoint 64, model 32", "num_layers: checkpoint 4, model 2",
                 "vocab_size: checkpoint 256, model 128",
                 "add_bias_linear: checkpoint True, model False",
                 "build the model with the checkpoint's architecture"):
        assert part in log, log


def test_model_config_mismatch_message(source):
    saved = saved_model(source)
    msg = raises_ucp(lambda: check_model_config(saved, {**saved, "num_layers": 8}, "ckpt/iter_x"))
    assert msg.startswith("ckpt/iter_x:") and "num_layers: checkpoint 4, model 8" in msg, msg
    assert "hidden_size" not in msg
    check_model_config(saved, {**saved, "tensor_model_parallel_size": 1}, "layout may change")


# ---- parameter sets differ --------------------------------------------------------------------


def test_missing_parameter_is_named(ckpt):
    # A model with QK-norm, a checkpoint without (the flag dropped from the saved config so that the
    # parameter-set check, not the config check, decides). (A manifest that lost an entry whose
    # fragments the rank files still hold is refused before: test_bad_input's manifest-lost-param.)
    edit_manifest(ckpt, lambda m: m["model"].pop("qk_layernorm"))
    log = failed_load(ckpt, {"qk_layernorm": True})
    name = "decoder.layers.0.self_attention.q_layernorm.weight"
    assert f"the model's parameter {name} (local name" in log, log
    assert "is not in the checkpoint" in log


def test_extra_parameters_are_named(ckpt):
    # A checkpoint with linear biases, a model without (the bias flags dropped from the saved
    # config so that the parameter-set check, not the config check, decides).
    edit_manifest(ckpt, lambda m: [m["model"].pop(k) for k in ("add_bias_linear", "add_qkv_bias")])
    log = failed_load(ckpt, {"add_bias_linear": False})
    assert "the checkpoint has parameters the model lacks" in log, log
    assert "'decoder.layers.0.mlp.linear_fc1.bias'" in log
    assert "(16 in all)" in log and "strict=False" in log


def test_parameter_in_manifest_but_in_no_rank_file(ckpt):
    fake = "decoder.layers.0.mlp.extra_proj.weight"
    # the index (format 3) points at fragments the rank file does not have: found when read
    edit_manifest(ckpt, lambda m: m["params"].__setitem__(
        fake, {**m["params"][FINAL_LN], "name": fake}))
    msg = raises_ucp(lambda: open_source(ckpt).verify())
    assert "rank_00000.safetensors: has no fragment of " + fake in msg, msg
    assert "from another save" in msg
    # a manifest without the index (format 2): the rank file headers decide, at open
    edit_manifest(ckpt, lambda m: [p.pop("slices") for p in m["params"].values()])
    msg = raises_ucp(lambda: open_source(ckpt))
    assert f"no rank file holds parameter {fake}" in msg and str(ckpt / ITER) in msg, msg
    assert "incomplete" in msg


def test_index_entry_out_of_range(ckpt):
    edit_manifest(ckpt, lambda m: m["params"][FINAL_LN]["slices"][0]["fragments"][0].__setitem__(0, 99))
    msg = raises_ucp(lambda: open_source(ckpt))
    assert f"parameter {FINAL_LN}: bad fragment entry" in msg and "manifest.json" in msg, msg


# ---- damaged files ----------------------------------------------------------------------------


def test_checksum_mismatch_in_fragment(ckpt, tmp_path):
    key = f"{FINAL_LN}/exp_avg_sq"
    flip_bytes(ckpt / ITER / "rank_00000.safetensors", key)
    expected = f"rank_00000.safetensors: checksum mismatch in tensor {key!r}"
    msg = raises_ucp(lambda: ucp.convert(ckpt, tmp_path / "universal", progress=False))
    assert expected in msg and "restore it or load an earlier iteration" in msg, msg
    assert not (tmp_path / "universal").exists()
    log = failed_load(ckpt, {})  # same layout as saved: each rank reads whole fragments
    assert expected in log, log


def test_checksum_mismatch_in_universal(source, tmp_path):
    uni = ucp.convert(source, tmp_path / "universal", progress=False)
    m = json.loads((uni / "manifest.json").read_text())
    entry = m["params"][FINAL_LN]["tensors"]["param"]
    flip_bytes(uni / entry["file"], entry["key"])
    src = open_source(uni)
    msg = raises_ucp(lambda: src.read(FINAL_LN, "param", (0,), (64,)))
    assert f"{entry['file']}: checksum mismatch in tensor {entry['key']!r}" in msg, msg
    assert "megatron-ucp convert" in msg


def test_truncated_rank_file(ckpt, tmp_path):
    path = ckpt / ITER / "rank_00001.safetensors"
    os.truncate(path, path.stat().st_size // 2)
    # format 3: the manifest indexes the fragments, so a rank file is first opened when read
    for attempt in (lambda: open_source(ckpt).verify(),
                    lambda: ucp.convert(ckpt, tmp_path / "universal", progress=False)):
        msg = raises_ucp(attempt)
        assert str(path) in msg and "truncated or corrupt" in msg, msg
        assert "use another iteration" in msg


def test_missing_rank_file(ckpt):
    path = ckpt / ITER / "rank_00001.safetensors"
    path.unlink()
    msg = raises_ucp(lambda: open_source(ckpt).verify())
    assert f"{path}: file is missing" in msg and "incomplete" in msg, msg


def test_unreadable_manifest(ckpt):
    (ckpt / ITER / "manifest.json").write_text('{"format": ')
    msg = raises_ucp(lambda: open_source(ckpt))
    assert f"{ckpt / ITER / 'manifest.json'}: cannot read the manifest" in msg, msg
    assert "load another iteration" in msg


# ---- the path is not (or no longer) a checkpoint ----------------------------------------------


def test_latest_names_missing_directory(ckpt):
    (ckpt / "latest").write_text("iter_0000009\n")
    msg = raises_ucp(lambda: open_source(ckpt))
    assert f"{ckpt / 'latest'} points to iter_0000009, which does not exist" in msg, msg
    assert f"complete checkpoints under {ckpt}: {ITER}" in msg


def test_latest_names_directory_without_manifest(ckpt):
    (ckpt / ITER / "manifest.json").unlink()
    msg = raises_ucp(lambda: open_source(ckpt))
    assert f"points to {ITER}, which has no manifest.json" in msg, msg
    assert f"there is no complete checkpoint under {ckpt}" in msg


def test_latest_names_unfinished_save(ckpt):
    partial = ckpt / ".iter_0000004.partial"
    partial.mkdir()
    shutil.copy(ckpt / ITER / "rank_00000.safetensors", partial)
    (ckpt / "latest").write_text(partial.name)
    msg = raises_ucp(lambda: open_source(ckpt))
    assert f"points to {partial.name}, which has no manifest.json" in msg, msg
    assert f": {ITER}" in msg


def test_save_root_without_latest(ckpt):
    (ckpt / "latest").unlink()
    msg = raises_ucp(lambda: open_source(ckpt))
    assert f"{ckpt} has no 'latest' file; pass one of its iter_* directories" in msg, msg
    assert ITER in msg
    assert open_source(ckpt / ITER).dir == ckpt / ITER


def test_empty_directory(tmp_path):
    msg = raises_ucp(lambda: ucp.convert(tmp_path, tmp_path / "out", progress=False))
    assert f"{tmp_path} is not a megatron-ucp checkpoint" in msg, msg
    assert "megatron_ucp.save" in msg and "reshard" not in msg


def test_nonexistent_path(tmp_path):
    msg = raises_ucp(lambda: open_source(tmp_path / "nowhere"))
    assert f"{tmp_path / 'nowhere'} does not exist" in msg, msg


def test_convert_into_non_empty_directory(source, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    msg = raises_ucp(lambda: ucp.convert(source, out, progress=False))
    assert f"{out} exists and is not empty" in msg and "new directory" in msg, msg
    assert (out / "keep.txt").read_text() == "x"
