"""Asynchronous save and host staging, with real megatron-core on the CPU shim.

- The background writer is held until training has changed every parameter and Adam moment in
  place, so the committed files can only come from the staged host copies: the load must equal,
  bitwise, the state dumped at the save, and the same-layout resume must replay the next step.
- Two asynchronous saves in a row: the second commits the first; `finalize` commits the last.
- A background write that fails (ENOSPC on one rank) raises on every rank at the next finalize,
  once; nothing is committed, `latest` stays, and the next save works.
A crash before the commit is in tests/test_fault.py (the async case).
"""

from __future__ import annotations

import pytest
import torch
from conftest import SCENARIOS, STEPS
from reference import assemble, compare_to_reference

from megatron_ucp import storage
from megatron_ucp.formats import manifest as mf
from megatron_ucp.staging import HostStager, steps_to_floats
from megatron_ucp.storage import tensor_bytes
from megatron_ucp.testing.launch import launch


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("async")
    res = launch(2, f"{SCENARIOS}:train_and_save",
                 {"layout": "tp2", "cfg": {}, "steps": STEPS, "save_dir": str(d / "ckpt"),
                  "continue_steps": STEPS, "dump_dir": str(d / "dump"), "async_save": True})
    return {"dir": d, "res": res}


def test_async_save_is_pending_while_training(async_run):
    # the save returned before its files were written and stayed uncommitted for STEPS steps
    assert [r["pending_while_training"] for r in async_run["res"]] == [STEPS, STEPS]
    root = async_run["dir"] / "ckpt"
    assert (root / storage.LATEST).read_text().strip() == mf.iteration_dir_name(STEPS)
    assert not list(root.glob(".*.partial"))
    assert async_run["res"][0]["optimizer"] == "torch.optim.adamw.AdamW"


def test_async_save_holds_the_state_at_the_save(async_run, tmp_path):
    """Load at TP1: bitwise equal to the state dumped before the save, not the trained-on state."""
    d = async_run["dir"]
    res = launch(1, f"{SCENARIOS}:load_and_train",
                 {"layout": "tp1", "cfg": {}, "load_dir": str(d / "ckpt"), "steps": 1,
                  "dump_dir": str(tmp_path / "dump")})
    assert res[0]["iteration"] == STEPS
    assert compare_to_reference(tmp_path / "dump", assemble(d / "dump", False), False) > 0


def test_async_save_resumes_bitwise_at_the_same_layout(async_run):
    d = async_run["dir"]
    res = launch(2, f"{SCENARIOS}:load_and_train",
                 {"layout": "tp2", "cfg": {}, "load_dir": str(d / "ckpt"), "steps": STEPS})
    assert res[0]["rng_restored"]
    assert res[0]["losses"] == async_run["res"][0]["continued"]


def test_async_saves_in_a_row_and_a_background_error(tmp_path):
    root = tmp_path / "ckpt"
    res = launch(2, f"{SCENARIOS}:async_saves",
                 {"layout": "tp2", "cfg": {}, "save_dir": str(root), "dump_dir": str(tmp_path / "dump"),
                  "fail_rank": 1})
    for r in res:
        assert r["pending_after_save"] == 2
        assert r["committed"] == ["iter_0000002", "iter_0000004"]
        assert r["pending_after_finalize"] is None
        assert "saving iteration 5" in r["error"] and "failed on 1 rank(s)" in r["error"]
        assert "nothing was committed" in r["error"]
        assert r["latest_after_error"] == "iter_0000004"
        assert r["second_finalize"] is True  # raised once, not again
        assert r["latest_after_retry"] == "iter_0000006"
    assert "No space left on device" in res[1]["error"]  # the failing rank names the cause
    assert not (root / "iter_0000005").exists() and not (root / ".iter_0000005.partial").exists()
    assert sorted(p.name for p in root.iterdir()) == [
        "iter_0000002", "iter_0000003", "iter_0000004", "iter_0000006", "latest"]
    # the first of the saves in a row holds the state at step 2, bitwise
    out = launch(1, f"{SCENARIOS}:load_and_train",
                 {"layout": "tp1", "cfg": {}, "load_dir": str(root / "iter_0000002"), "steps": 1,
                  "dump_dir": str(tmp_path / "loaded")})
    assert out[0]["iteration"] == 2
    assert compare_to_reference(tmp_path / "loaded", assemble(tmp_path / "dump", False), False) > 0


def test_stager_copies_reuses_its_buffer_and_keeps_host_views():
    stager = HostStager()
    a, b = torch.randn(1000), torch.arange(7, dtype=torch.float32)
    copies = stager.stage([a, b], copy=True)
    assert [torch.equal(x, y) for x, y in zip(copies, [a, b])] == [True, True]
    assert copies[0].data_ptr() != a.data_ptr()
    a.add_(1.0)  # the source changes after staging: the copy does not
    assert not torch.equal(copies[0], a)
    again = stager.stage([b, a], copy=True)
    assert stager.allocations == 1 and torch.equal(again[1], a)
    views = stager.stage([a], copy=False)  # host tensors, synchronous save: no copy
    assert views[0] is a
    for stager_batched in (HostStager(batched=True),):
        assert torch.equal(stager_batched.stage([a], copy=True)[0], a)


def test_step_conversion_and_host_only_writer():
    assert steps_to_floats([3, 4.0, torch.tensor(5.0), torch.tensor([6], dtype=torch.int32)]) == \
        [3.0, 4.0, 5.0, 6.0]
    meta = torch.empty(4, device="meta")
    with pytest.raises(ValueError, match="stage it to host memory"):
        tensor_bytes(meta)
