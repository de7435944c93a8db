"""Faults of checkpoints in an object store (a real SeaweedFS server, tests/seaweed.py).

A rank SIGKILLed while its rank file is going up as a multipart upload (synchronous save, and
asynchronous: the background writer dies): `latest` still names the previous checkpoint, the
prefix without a manifest is never loaded, `verify` reports it and the incomplete upload, and the
next save removes both and commits. Wrong credentials, a missing bucket, an unreachable endpoint,
a `latest` naming a missing prefix, a truncated object: a clear error naming the URL, nothing
committed.
"""

from __future__ import annotations

import re
import signal
import time
import uuid

import pytest
import torch
from test_fault import _dump

import megatron_ucp as ucp
from megatron_ucp import storage
from megatron_ucp.checks import verify
from megatron_ucp.formats import manifest as mf
from megatron_ucp.formats import open_source
from megatron_ucp.storage import location, object_store
from megatron_ucp.testing.launch import LaunchError, free_port, launch

LAYOUT = "tp2"


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def crashed(request, s3_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("s3fault")
    run = {"root": location(f"{s3_server[1]}/fault-{uuid.uuid4().hex[:8]}"), "marker": tmp / "stalled",
           "dump_saved": tmp / "dump_at_save", "tmp": tmp}
    with pytest.raises(LaunchError) as ei:
        launch(2, "megatron_ucp.testing.faults:save_then_die",
               {"layout": LAYOUT, "cfg": {}, "save_dir": str(run["root"]), "marker": str(run["marker"]),
                "victim": 1, "steps": 2, "dump_dir": str(run["dump_saved"]),
                "async_save": request.param},
               timeout=240, kill_rank_after=(1, str(run["marker"])))
    run["error"] = str(ei.value)
    return run


def test_killed_mid_upload(crashed):
    assert crashed["marker"].exists(), "rank 1 never got half-way into its upload:\n" + crashed["error"]
    codes = [int(c) for c in re.search(r"exit codes \[([^\]]*)\]", crashed["error"]).group(1).split(",")]
    assert codes[1] == -signal.SIGKILL, crashed["error"]
    root = crashed["root"]
    # the victim's rank file is an incomplete multipart upload, invisible as an object
    uploads = storage.incomplete_uploads(root)
    assert [u.path.name for u in uploads] == ["rank_00001.safetensors"], uploads
    assert not (root / "iter_0000003" / "rank_00001.safetensors").is_file()


def test_latest_names_previous_and_partial_is_not_loadable(crashed):
    root = crashed["root"]
    assert (root / storage.LATEST).read_text().strip() == "iter_0000002"
    assert not (root / "iter_0000003" / mf.MANIFEST).is_file()
    assert open_source(root).dir == root / "iter_0000002"
    for attempt in (lambda: open_source(root / "iter_0000003"),
                    lambda: ucp.convert(root / "iter_0000003", crashed["tmp"] / "out", progress=False)):
        with pytest.raises(ucp.UCPError) as ei:
            attempt()
        msg = str(ei.value)
        assert f"{root}/iter_0000003" in msg and "never committed" in msg, msg


def test_verify_reports_leftovers_then_the_next_save_removes_them(crashed):
    """Runs last for its run: the retry loads iteration 2 (bitwise the state saved) and saves
    iteration 3 into the crashed root, removing the leftovers first."""
    root, tmp = crashed["root"], crashed["tmp"]
    report = verify(root)
    assert report.startswith(f"OK {root}/iter_0000002"), report
    assert "interrupted save(s)" in report and "iter_0000003" in report, report
    assert "1 incomplete multipart upload(s)" in report, report
    res = launch(2, "megatron_ucp.testing.faults:resume_and_save",
                 {"layout": LAYOUT, "cfg": {}, "loads": [str(root)], "dump_dir": str(tmp / "loaded"),
                  "save_dir": str(root), "iteration": 3}, timeout=240)
    assert [r["loaded"][0]["iteration"] for r in res] == [2, 2]
    for rank in range(2):
        saved, loaded = _dump(crashed["dump_saved"], rank), _dump(tmp / "loaded" / "0", rank)
        for key, s in saved.items():
            assert torch.equal(s["model"], loaded[key]["model"]), (rank, key)
            if s["range"] is not None:
                for state in ("param", "exp_avg", "exp_avg_sq"):
                    assert torch.equal(s[state], loaded[key][state]), (rank, key, state)
    assert storage.incomplete_uploads(root) == []
    assert (root / storage.LATEST).read_text().strip() == "iter_0000003"
    report = verify(root)
    assert report.startswith(f"OK {root}/iter_0000003") and "interrupted" not in report, report
    assert "incomplete" not in report, report


# ------------------------------------------------------------------ bad stores, bad objects
@pytest.fixture
def fresh_client():
    """Each test's environment gets its own store client (they are cached per bucket)."""
    object_store.store.cache_clear()
    yield
    object_store.store.cache_clear()


def _copy(src, dst) -> None:
    for obj, _ in object_store.list_objects(src):
        object_store.put(dst / obj.key[len(src.prefix):], obj.read_bytes())


@pytest.fixture(scope="module")
def committed(s3_server):
    """A committed two-rank checkpoint in the bucket (a save root with `latest`)."""
    root = location(f"{s3_server[1]}/good-{uuid.uuid4().hex[:8]}")
    launch(2, "megatron_ucp.testing.scenarios:train_and_save",
           {"layout": LAYOUT, "cfg": {}, "steps": 1, "save_dir": str(root)}, timeout=240)
    return root


def test_wrong_credentials_save_commits_nothing(s3_server, tmp_path, fresh_client):
    root = f"{s3_server[1]}/badkeys-{uuid.uuid4().hex[:8]}"
    with pytest.raises(LaunchError) as ei:
        launch(2, "megatron_ucp.testing.scenarios:train_and_save",
               {"layout": LAYOUT, "cfg": {}, "steps": 1, "save_dir": root},
               env={"AWS_SECRET_ACCESS_KEY": "wrong"}, timeout=240)
    msg = str(ei.value)
    assert root in msg and "refused the credentials" in msg, msg[-3000:]
    assert "wrong" not in msg.replace("went wrong", "")  # the secret is never printed
    assert object_store.list_objects(location(root)) == []


def test_wrong_credentials_read(committed, monkeypatch, fresh_client):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(ucp.UCPError) as ei:
        verify(str(committed))
    msg = str(ei.value)
    assert str(committed) in msg and "refused the credentials" in msg, msg
    assert "not-the-secret" not in msg


def test_missing_bucket(monkeypatch, tmp_path, fresh_client):
    with pytest.raises(ucp.UCPError) as ei:
        verify("s3://no-such-bucket-here/run")
    assert "s3://no-such-bucket-here/run" in str(ei.value)
    # and a conversion into it commits nothing anywhere (its local staging is removed)
    with pytest.raises(ucp.UCPError) as ei:
        ucp.convert(str(tmp_path / "absent"), "s3://no-such-bucket-here/out", progress=False)


def test_missing_bucket_on_write(committed, fresh_client):
    with pytest.raises(ucp.UCPError) as ei:
        ucp.convert(str(committed), "s3://no-such-bucket-here/out", progress=False)
    msg = str(ei.value)
    assert "s3://no-such-bucket-here/out" in msg and "bucket does not exist" in msg, msg


def test_unreachable_endpoint(monkeypatch, fresh_client):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setattr(object_store, "MAX_RETRIES", 2)
    monkeypatch.setattr(object_store, "RETRY_SECONDS", 3.0)
    t0 = time.monotonic()
    with pytest.raises(ucp.UCPError) as ei:
        open_source("s3://ckpt/anything")
    msg = str(ei.value)
    assert "s3://ckpt/anything" in msg and "cannot be reached" in msg, msg
    assert time.monotonic() - t0 < 30  # bounded retries


def test_latest_naming_a_missing_prefix(committed, s3_server):
    root = location(f"{s3_server[1]}/dangling-{uuid.uuid4().hex[:8]}")
    _copy(committed, root)
    object_store.put(root / storage.LATEST, b"iter_0000009\n")
    with pytest.raises(ucp.UCPError) as ei:
        open_source(root)
    msg = str(ei.value)
    assert f"{root}/latest" in msg and "iter_0000009" in msg and "does not exist" in msg, msg
    assert "iter_0000001" in msg  # names the complete checkpoint to use instead


def test_truncated_object(committed, s3_server):
    root = location(f"{s3_server[1]}/truncated-{uuid.uuid4().hex[:8]}")
    _copy(committed, root)
    victim = root / "iter_0000001" / "rank_00001.safetensors"
    data = victim.read_bytes()
    object_store.put(victim, data[:len(data) - 1000])
    with pytest.raises(ucp.UCPError) as ei:
        verify(root)
    msg = str(ei.value)
    assert str(victim) in msg and "truncated" in msg, msg


def test_resaving_a_committed_iteration_is_refused_and_latest_stays_loadable(committed, s3_server):
    """A store has no atomic replace: re-saving iteration 1 over a committed iter_0000001 must not
    take its manifest away first (for the whole save `latest` would name an uncommitted prefix, and
    nothing loadable if that save failed). It is refused on every rank before any rank writes, and
    the committed checkpoint is left byte for byte as it was."""
    root = location(f"{s3_server[1]}/resave-{uuid.uuid4().hex[:8]}")
    _copy(committed, root)
    before = {obj.key: obj.read_bytes() for obj, _ in object_store.list_objects(root)}
    with pytest.raises(LaunchError) as ei:
        launch(2, "megatron_ucp.testing.scenarios:train_and_save",
               {"layout": LAYOUT, "cfg": {}, "steps": 1, "save_dir": str(root)}, timeout=240)
    msg = str(ei.value)
    assert f"{root}/iter_0000001 holds a committed checkpoint" in msg and "another iteration" in msg, \
        msg[-3000:]
    after = {obj.key: obj.read_bytes() for obj, _ in object_store.list_objects(root)}
    assert after == before
    assert storage.incomplete_uploads(root) == []
    assert (root / storage.LATEST).read_text().strip() == "iter_0000001"
    assert verify(root).startswith(f"OK {root}/iter_0000001")  # still committed and whole
    # the protocol's unit: even with replace=True a committed prefix is never uncommitted
    with pytest.raises(ucp.UCPError, match="cannot replace it atomically"):
        storage.staged(root / "iter_0000001", mf.MANIFEST).create(replace=True)
    assert (root / "iter_0000001" / mf.MANIFEST).is_file()
