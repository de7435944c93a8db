"""A rank SIGKILLed in the middle of a save: the previous checkpoint stays the one that loads.

One launch (megatron_ucp.testing.faults:save_then_die, real megatron-core on the CPU shim) trains
2 steps, commits iter_0000002, trains a 3rd step and starts saving iter_0000003; rank 1 writes
half of its rank file and is SIGKILLed by the launcher. The second save is synchronous, or
asynchronous (rank 1's background writer dies while the ranks train on and wait in finalize).
A second launch loads the save root at the same layout and dumps its raw megatron-core state,
which must equal, bit for bit, the state dumped just before iter_0000002 was saved; its first
training step must reproduce the 3rd step's loss.
"""

from __future__ import annotations

import json
import re
import signal

import pytest
import torch

import megatron_ucp as ucp
from megatron_ucp.formats import open_source
from megatron_ucp.storage import Reader
from megatron_ucp.testing.launch import LaunchError, launch

LAYOUT = "tp2"


def _dump(dump_dir, rank: int) -> dict:
    d = torch.load(dump_dir / f"rank{rank}.pt", weights_only=False)
    return {(e["chunk"], e["name"]): e for e in d["params"]}


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def crashed(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fault")
    run = {"root": tmp / "ckpt", "marker": tmp / "rank1_stalled_mid_write",
           "dump_saved": tmp / "dump_at_save", "record": tmp / "record.json", "tmp": tmp}
    with pytest.raises(LaunchError) as ei:
        launch(2, "megatron_ucp.testing.faults:save_then_die",
               {"layout": LAYOUT, "cfg": {}, "save_dir": str(run["root"]), "marker": str(run["marker"]),
                "victim": 1, "steps": 2, "dump_dir": str(run["dump_saved"]), "record": str(run["record"]),
                "async_save": request.param},
               timeout=240, kill_rank_after=(1, str(run["marker"])))
    run["error"] = str(ei.value)
    return run


def test_killed_rank_fails_the_launch(crashed):
    assert crashed["marker"].exists(), "rank 1 never got half-way into its file:\n" + crashed["error"]
    codes = [int(c) for c in re.search(r"exit codes \[([^\]]*)\]", crashed["error"]).group(1).split(",")]
    assert codes[1] == -signal.SIGKILL, crashed["error"]
    assert "second save completed" not in crashed["error"]


def test_latest_still_names_previous_checkpoint(crashed):
    root = crashed["root"]
    assert (root / "latest").read_text().strip() == "iter_0000002"
    assert (root / "iter_0000002" / "manifest.json").exists()
    assert not (root / "iter_0000003").exists()
    assert open_source(root).dir == root / "iter_0000002"


def test_partial_directory_is_not_loadable(crashed):
    root = crashed["root"]
    partial = root / ".iter_0000003.partial"
    assert partial.is_dir()
    assert not (partial / "manifest.json").exists()
    half = partial / "rank_00001.safetensors"
    assert half.exists() and half.stat().st_size < (root / "iter_0000002" / half.name).stat().st_size
    with pytest.raises(ucp.UCPError) as ei:
        Reader().open(half)
    assert "rank_00001.safetensors" in str(ei.value) and "truncated" in str(ei.value)
    for attempt in (lambda: open_source(partial),
                    lambda: ucp.convert(partial, crashed["tmp"] / "from_partial", progress=False)):
        with pytest.raises(ucp.UCPError) as ei:
            attempt()
        msg = str(ei.value)
        assert ".iter_0000003.partial" in msg and "interrupted save" in msg, msg
        assert str(root) in msg  # says what to load instead
    assert not (crashed["tmp"] / "from_partial").exists()


def test_previous_checkpoint_loads_bitwise_and_resumes(crashed):
    root, tmp = crashed["root"], crashed["tmp"]
    dump_loaded = tmp / "dump_after_load"
    res = launch(2, "megatron_ucp.testing.scenarios:load_and_train",
                 {"layout": LAYOUT, "cfg": {}, "load_dir": str(root), "steps": 1,
                  "dump_dir": str(dump_loaded)}, timeout=240)
    assert [r["iteration"] for r in res] == [2, 2]
    assert all(r["rng_restored"] for r in res)
    for rank in range(2):
        saved, loaded = _dump(crashed["dump_saved"], rank), _dump(dump_loaded, rank)
        assert saved.keys() == loaded.keys()
        for key, s in saved.items():
            lo = loaded[key]
            assert torch.equal(s["model"], lo["model"]), (rank, key, "model")
            assert s["range"] == lo["range"], (rank, key)
            if s["range"] is not None:
                assert s["step"] == lo["step"], (rank, key)
                for state in ("param", "exp_avg", "exp_avg_sq"):
                    assert torch.equal(s[state], lo[state]), (rank, key, state)
    recorded = json.loads(crashed["record"].read_text())["losses"]
    assert res[0]["losses"][0] == recorded[2]  # the 3rd step, replayed from iter_0000002, bitwise


def test_interrupted_save_is_reported_then_removed_by_the_next_save(crashed):
    """Runs last: it saves into the crashed root. `verify` names the leftover partial directory;
    the next save removes it and commits."""
    from megatron_ucp.checks import verify

    root = crashed["root"]
    report = verify(root)
    assert report.startswith("OK ") and ".iter_0000003.partial" in report and "interrupted" in report
    launch(2, "megatron_ucp.testing.scenarios:load_and_train",
           {"layout": LAYOUT, "cfg": {}, "load_dir": str(root), "steps": 0,
            "resave_dir": str(root)}, timeout=240)
    assert not (root / ".iter_0000003.partial").exists()
    assert (root / "latest").read_text().strip() == "iter_0000002"
    report = verify(root)
    assert report.startswith("OK ") and "interrupted" not in report, report
