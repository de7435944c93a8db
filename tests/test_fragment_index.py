"""The fragment index (format 3): built and checked by rank 0 at save time, used by every load.

- a model built for the wrong layout (megatron-core's own example style: TransformerConfig
  without pipeline_model_parallel_size under PP2, so both stages hold layers 0..3) is refused by
  the save on every rank, with nothing committed;
- a load opens only the rank files that hold its bytes;
- a format-2 checkpoint (no index: the rank file headers list the fragments) still loads bitwise;
- the index builder rejects gaps, overlaps and mixed steps, naming the tensor and the ranks.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil

import pytest
import torch
from conftest import SCENARIOS, STEPS
from reference import assemble, compare_to_reference

import megatron_ucp as ucp
from megatron_ucp.formats import open_source
from megatron_ucp.formats.fragments import build_index
from megatron_ucp.local_slice import flat_range_boxes
from megatron_ucp.testing.launch import LaunchError, launch


def test_model_built_for_another_layout_is_refused_before_commit(tmp_path):
    root = tmp_path / "ckpt"
    with pytest.raises(LaunchError) as ei:
        launch(2, f"{SCENARIOS}:train_and_save",
               {"layout": "pp2", "cfg": {"extra": {"pipeline_model_parallel_size": 1}}, "steps": 1,
                "save_dir": str(root)})
    msg = str(ei.value)
    assert "saved twice (ranks [0, 1])" in msg, msg[-3000:]
    assert "pipeline_model_parallel_size" in msg and "nothing was committed" in msg
    assert root.is_dir() and list(root.iterdir()) == []  # no latest, no iter_*, no .partial


def test_save_root_that_is_a_file_is_refused(tmp_path):
    root = tmp_path / "not_a_dir"
    root.write_text("x")
    with pytest.raises(LaunchError) as ei:
        launch(2, f"{SCENARIOS}:train_and_save",
               {"layout": "tp2", "cfg": {}, "steps": 1, "save_dir": str(root)}, timeout=120)
    # (the launcher kills the other rank once one fails, so exit codes do not show that both
    # raised; each rank checks the root itself before any collective)
    assert f"{root}: the save root is a file; pass a directory" in str(ei.value)


def test_load_opens_only_the_files_holding_its_bytes(source_runs):
    source = source_runs.get("tp2", {"dtype": "fp32"})
    same = launch(2, f"{SCENARIOS}:load_and_train",
                  {"layout": "tp2", "cfg": {"dtype": "fp32"}, "load_dir": str(source["ckpt"]), "steps": 1})
    # TP rank 0: its own file; TP rank 1: its own and rank 0's, which alone holds the parameters
    # replicated over TP (layer norms, row-parallel biases: saved once, by TP rank 0)
    assert [r["files_opened"] for r in same] == [1, 2]
    merged = launch(1, f"{SCENARIOS}:load_and_train",
                    {"layout": "tp1", "cfg": {"dtype": "fp32"}, "load_dir": str(source["ckpt"]),
                     "steps": 1})
    assert merged[0]["files_opened"] == 2


def test_format_2_checkpoint_without_index_still_loads_bitwise(source_runs, tmp_path):
    source = source_runs.get("tp2", {"dtype": "fp32"})
    old = tmp_path / "v2"
    ckpt = open_source(source["ckpt"]).dir
    shutil.copytree(ckpt, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["version"] = 2
    for p in manifest["params"].values():
        del p["slices"], p["step"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    res = launch(1, f"{SCENARIOS}:load_and_train",
                 {"layout": "tp1", "cfg": {"dtype": "fp32"}, "load_dir": str(old), "steps": 1,
                  "dump_dir": str(tmp_path / "dump")})
    assert res[0]["iteration"] == STEPS
    assert compare_to_reference(tmp_path / "dump", assemble(source["dump"], False), False) > 0


SPEC = {"w": {"name": "w", "shape": [4, 2], "dtype": "float32", "tp_axis": 0}}
ROWS = [[0, [0, 0], [2, 2], [2, 1]]]  # rows 0-1 of a [2, 2] local slice
ROWS_2 = [[0, [2, 0], [2, 2], [2, 1]]]  # rows 2-3


def test_index_builder_accepts_an_exact_tiling():
    out = build_index(SPEC, [[("w", [2, 2], ROWS, 0, 3, 5.0)], [("w", [2, 2], ROWS, 3, 4, 5.0),
                                                                ("w", [2, 2], ROWS_2, 0, 4, 5.0)]])
    assert out["w"].to_json()["step"] == 5.0
    assert [s["fragments"] for s in out["w"].to_json()["slices"]] == [[[0, 0, 3], [1, 3, 4]], [[1, 0, 4]]]


@pytest.mark.parametrize("records,expected", [
    ([[("w", [2, 2], ROWS, 0, 4, 1.0)]], "cover 4 of 8 elements"),  # a TP slice nobody saved
    ([[("w", [2, 2], ROWS, 0, 2, 1.0)], [("w", [2, 2], ROWS_2, 0, 4, 1.0)]], "ends at element 2"),
    ([[("w", [2, 2], ROWS, 1, 4, 1.0)], [("w", [2, 2], ROWS_2, 0, 4, 1.0)]], "saved by no rank"),
    ([[("w", [2, 2], ROWS, 0, 4, 1.0)], [("w", [2, 2], ROWS, 0, 4, 1.0)]], "saved twice (ranks [0, 1])"),
    ([[("w", [2, 2], ROWS, 0, 4, 1.0)], [("w", [2, 2], ROWS_2, 0, 4, 2.0)]], "mixes iterations"),
    ([[("w", [2, 2], ROWS, 0, 4, 1.0), ("w", [4, 1], [[0, [0, 1], [4, 1], [1, 1]]], 0, 4, 1.0)],
      [("w", [2, 2], ROWS_2, 0, 4, 1.0)]], "saved overlapping slices"),
    ([[("v", [2, 2], ROWS, 0, 4, 1.0)]], "which no rank declared"),
])
def test_index_builder_rejects_bad_tilings(records, expected):
    with pytest.raises(ucp.UCPError) as ei:
        build_index(SPEC, records)
    assert expected in str(ei.value) and ("parameter w" in str(ei.value) or "of v" in str(ei.value))


def test_flat_range_boxes_cover_exactly_the_range():
    for shape in [(7,), (3, 5), (2, 3, 4), (4, 1, 3)]:
        n = math.prod(shape)
        t = torch.arange(n).reshape(shape)
        for lo, hi in itertools.combinations(range(n + 1), 2):
            boxes = flat_range_boxes(shape, lo, hi)
            got = torch.cat([t[tuple(slice(o, o + k) for o, k in zip(off, sh))].reshape(-1)
                             for off, sh in boxes])
            assert torch.equal(got, torch.arange(lo, hi)), (shape, lo, hi)
            assert len(boxes) <= 2 * len(shape) - 1
