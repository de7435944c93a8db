"""torch_dist checkpoints of megatron-core 0.14/0.15 in the old `flattened_range` optimizer form
(`fully_sharded_model_space`), which later releases no longer load, read and written out for
megatron-core 0.19.

The fixtures (tests/fixtures/megatron_lm_v015) were written by Megatron-LM's own training loop at
tags core_v0.15.3 (`--dist-ckpt-save-pre-mcore-014`) and core_v0.14.0 (its default), TP2 DP2.
(1) The universal conversion equals, bitwise, every parameter's fp32 master weight and both Adam
    moments assembled by hand from the DCP files (tests/oracles.py `flattened_full`: .metadata
    unpickled, every DP range torch.load'ed on its own, ranges tiling each TP chunk), and
    bf16(master) is the stored model weight.
(2) The universal checkpoint loads at TP1 DP2 in a real megatron-core run (the release this test
    runs on) with every model weight, master weight, moment and step in place (dumped, compared).
(3) Written as a Megatron-LM torch_dist checkpoint (our writer) at another layout, it loads through
    megatron-core's OWN dist_checkpointing load (the release this test runs on: 0.16 in `make
    test`'s first pass, 0.19 in the TESTS_MCORE19 pass) with the universal values, and trains.
(4) Holes and damage are named: a DP range missing from .metadata, a truncated data file.
"""

from __future__ import annotations

import math
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from helpers import FIXTURE_MODEL, dump_step_and_finish
from oracles import assert_dumps_hold, assert_holds_universal, flattened_full, universal_tensors

from megatron_ucp.conversion import convert_torch_dist
from megatron_ucp.errors import UCPError
from megatron_ucp.testing.launch import launch

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "megatron_lm_v015"
SETS = ("v015_tp2_dp2_flat", "v014_tp2_dp2_flat")
ITER = "iter_0000006"
STATES = ("param", "exp_avg", "exp_avg_sq")
RANK_PATH = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
CFG = FIXTURE_MODEL  # the fixtures' model (README "Common settings")


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("flat")
    return {s: convert_torch_dist(FIXTURES / s / "ckpt", root / s, progress=False) for s in SETS}


@pytest.mark.parametrize("name", SETS)
def test_universal_is_the_flattened_state_bitwise(converted, name):
    manifest, _ = universal_tensors(converted[name])
    assert manifest["converted_from"]["kind"] == "megatron-lm torch_dist (fully_sharded_model_space)"
    full = flattened_full(FIXTURES / name / "ckpt", list(manifest["params"]))
    assert len(full) == 2 + 3 * 12 + 2  # tied output layer is the word embedding
    # every state of every parameter, bitwise; bf16(master) == the stored model weight
    assert assert_holds_universal(full, converted[name], torch.bfloat16) == 3 * len(full)
    assert {p["step"] for p in manifest["params"].values()} == {6.0}
    assert manifest["iteration"] == 6 and manifest["scheduler"]["num_steps"] == 24
    assert [g["weight_decay"] for g in manifest["optimizer"]["param_groups"]] == [0.01, 0.0]


def test_universal_loads_at_another_layout(converted, tmp_path):
    """TP2 DP2 (0.15) -> universal -> a TP1 DP2 megatron-core run of this test's release."""
    udir = converted["v015_tp2_dp2_flat"]
    res = launch(2, "megatron_ucp.testing.scenarios:load_and_train",
                 {"layout": "tp1dp2", "cfg": CFG, "load_dir": str(udir), "steps": 1,
                  "dump_dir": str(tmp_path / "dump")})
    assert all(r["iteration"] == 6 and r["lr"] == [1e-3] * len(r["lr"]) for r in res)
    manifest, tensors = universal_tensors(udir)
    assert_dumps_hold(tmp_path / "dump", manifest, tensors, None, ranks=2)
    assert all(math.isfinite(x) and x < 6.0 for r in res for x in r["losses"]), res


def load_torch_dist_rank(layout: str, cfg: dict, load_dir: str, dump_dir: str) -> dict:
    """Rank function: build the tiny GPT at `layout` and load a torch_dist checkpoint as Megatron-LM's
    load_checkpoint does (model and DistributedOptimizer sharded_state_dict with the checkpoint's
    content_metadata, megatron.core.dist_checkpointing.load, model / optimizer / scheduler
    load_state_dict), dump the local state, train one step."""
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model
    from test_megatron_legacy_out import patch_distopt_step_load

    from megatron_ucp.layout import Layout
    from megatron_ucp.testing import tiny_gpt as tg

    patch_distopt_step_load()  # torch AdamW's 'step' (megatron-core without Apex/TE; README)
    lay = Layout.parse(layout)
    tg.init_distributed(lay)
    st = tg.build(tg.TinyGPTConfig(**cfg), lay)
    root = Path(load_dir)
    ckpt = root / f"iter_{int((root / 'latest_checkpointed_iteration.txt').read_text()):07d}"
    common = torch.load(ckpt / "common.pt", map_location="cpu", weights_only=False)
    metadata = common["content_metadata"]
    # DistributedOptimizer.state_dict() needs torch AdamW's per-parameter state to exist (it asserts
    # one step); one step creates it, and the load below overwrites every value it touched
    tg.train_step(st)
    module = unwrap_model(st.model[0])  # the GPTModel: its keys are the checkpoint's
    model_sd = module.sharded_state_dict(metadata=metadata)
    sd = {"model": model_sd,
          "optimizer": st.optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)}
    loaded = dist_checkpointing.load(sd, str(ckpt))
    module.load_state_dict(loaded["model"], strict=True)
    st.optimizer.load_state_dict(loaded["optimizer"])
    st.scheduler.use_checkpoint_opt_param_scheduler = True
    st.scheduler.num_steps = 0  # load_state_dict adds the saved count (a fresh run's scheduler is 0)
    st.scheduler.load_state_dict(loaded["opt_param_scheduler"])
    st.iteration = loaded["iteration"]
    return dump_step_and_finish(st, dump_dir, loaded["iteration"])


def test_torch_dist_written_for_target_loads_in_megatron_core(converted, tmp_path):
    """0.15 TP2 DP2 (flattened form) -> universal -> torch_dist (our writer) at TP1 DP2 in the form
    megatron-core >= 0.16 reads -> megatron-core's own dist_checkpointing load at TP1 DP2."""
    from megatron_ucp.conversion import write_torch_dist
    from megatron_ucp.formats.megatron_dist import run_fields
    from megatron_ucp.layout import Layout

    udir = converted["v015_tp2_dp2_flat"]
    f = run_fields(FIXTURES / "v015_tp2_dp2_flat" / "ckpt")
    out = write_torch_dist(udir, tmp_path / "out", Layout.parse("tp1dp2"), f.args,
                           rng_state=next(iter(f.rng_state.values())), sharding="fully_reshardable",
                           progress=False)
    # megatron-core 0.19 pairs saved and current param groups by their settings (min_lr among
    # them): the run's min_lr is Megatron-LM's default 0, not the tiny GPT's
    res = launch(2, "test_megatron_dist_flat:load_torch_dist_rank",
                 {"layout": "tp1dp2", "cfg": {**CFG, "min_lr": 0.0}, "load_dir": str(out),
                  "dump_dir": str(tmp_path / "dump")}, env={"PYTHONPATH": RANK_PATH})
    assert all(r["iteration"] == 6 and r["num_steps"] == 28 for r in res), res  # 24 samples + 4
    assert all(lr == 1e-3 for r in res for lr in r["lr"])
    assert all(math.isfinite(r["loss"]) and r["loss"] < 6.0 for r in res), res
    manifest, tensors = universal_tensors(udir)
    assert_dumps_hold(tmp_path / "dump", manifest, tensors, None, ranks=2)


def _damaged(tmp_path: Path) -> Path:
    src = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "v015_tp2_dp2_flat" / "ckpt", src)
    return src / ITER


def test_missing_dp_range_is_named(tmp_path):
    """A DP rank's range of a flattened chunk is absent from .metadata: DCP would leave that part
    of the tensor as uninitialised memory; the reader names the key and refuses."""
    ckpt = _damaged(tmp_path)
    key = "optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight"
    with open(ckpt / ".metadata", "rb") as f:
        meta = pickle.load(f)
    entry = meta.state_dict_metadata[key]
    dropped = max(entry.chunks, key=lambda c: c.offsets[-1])  # a range that starts inside a chunk
    assert dropped.offsets[-1] > 0
    entry.chunks.remove(dropped)
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    with pytest.raises(UCPError, match=rf"\.metadata.*__\d_\d\.distcp.*'{key}'.*cover 9088 of 9216"):
        convert_torch_dist(ckpt, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_truncated_data_file_is_named(tmp_path):
    ckpt = _damaged(tmp_path)
    path = ckpt / "__0_0.distcp"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(UCPError, match=r"__0_0\.distcp: cannot read \['[^']+'\]"):
        convert_torch_dist(ckpt, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_wrong_flattened_shape_is_named(tmp_path):
    """A flattened state whose shape is no chunk grid of its model tensor is refused by name."""
    ckpt = _damaged(tmp_path)
    key = "optimizer.state.fp32_param.decoder.layers.mlp.linear_fc2.bias"
    with open(ckpt / ".metadata", "rb") as f:
        meta = pickle.load(f)
    meta.state_dict_metadata[key].size = torch.Size([3, 1, 31])
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    with pytest.raises(UCPError, match=rf"'{key}' has shape \[3, 1, 31\], which is no chunk grid"):
        convert_torch_dist(ckpt, tmp_path / "out", progress=False)
