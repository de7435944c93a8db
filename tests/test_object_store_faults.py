"""Faults of checkpoints in object stores, for every store (real servers on 127.0.0.1,
tests/store_servers.py: SeaweedFS s3://, fake-gcs-server gs://, Azurite az://), and for a local
directory where the fault means something there.

A rank SIGKILLed while its rank file is going up as a multipart upload (synchronous save, and
asynchronous: the background writer dies): `latest` still names the previous checkpoint, the
prefix without a manifest is never loaded, `verify` reports it (and on S3 the incomplete upload),
and the next save removes what was left and commits. Wrong credentials, a missing bucket, an
unreachable endpoint (each message naming the variables of that store), a `latest` naming a
missing prefix, a truncated object: a clear error naming the URL, nothing committed. (A local
directory's kill -9 mid-write is tests/test_fault.py's.)

gs:// cases that need megatron-ucp to write, or the server to check credentials, are expected
skips naming why (fake-gcs-server takes neither obstore's XML API writes nor any credential check).
"""

from __future__ import annotations

import base64
import re
import signal
import time

import pytest
import torch
from store_servers import STORE_SKIP
from test_fault import _dump

import megatron_ucp as ucp
from megatron_ucp import storage
from megatron_ucp.checks import verify
from megatron_ucp.formats import manifest as mf
from megatron_ucp.formats import open_source
from megatron_ucp.storage import location, object_store
from megatron_ucp.testing.launch import LaunchError, free_port, launch

LAYOUT = "tp2"
# Per store: the variable that sets its endpoint (a test points it at a closed port), the one that
# holds its secret (a test sets a wrong one), and the prefixes of the other stores' variables (an
# error about this store never names them)
ENDPOINT_VARIABLE = {"s3": "AWS_ENDPOINT_URL", "gcs": "GOOGLE_BASE_URL", "azure": "AZURITE_BLOB_STORAGE_URL"}
WRONG_SECRET = {"s3": ("AWS_SECRET_ACCESS_KEY", "not-the-secret"),
                "azure": ("AZURE_STORAGE_ACCOUNT_KEY", base64.b64encode(b"not-the-secret" * 4).decode())}
OTHER_STORES_VARIABLES = {"s3": ("GOOGLE_", "AZURE"), "gcs": ("AWS_", "AZURE"), "azure": ("AWS_", "GOOGLE_")}
NO_CREDENTIAL_CHECK = f"{STORE_SKIP}gs:// credentials: fake-gcs-server checks none (any are accepted)"


def _stores(*kinds: str):
    """Run a test for these stores (the module-scoped `store` fixture, tests/store_servers.py)."""
    return pytest.mark.parametrize("store", kinds, indirect=True)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def crashed(request, store, tmp_path_factory):
    store.skip_writes()
    if request.param and store.kind != "s3":  # (what the async writer adds is the store's same writes)
        pytest.skip(f"{STORE_SKIP}async kill -9 runs on s3:// only (test time): the background "
                    "writer's death is store-independent, its writes are the sync case's")
    tmp = tmp_path_factory.mktemp("storefault")
    run = {"root": store.fresh("fault-"), "marker": tmp / "stalled", "dump_saved": tmp / "dump_at_save",
           "tmp": tmp, "kind": store.kind}
    with pytest.raises(LaunchError) as ei:
        launch(2, "megatron_ucp.testing.faults:save_then_die",
               {"layout": LAYOUT, "cfg": {}, "save_dir": str(run["root"]), "marker": str(run["marker"]),
                "victim": 1, "steps": 2, "dump_dir": str(run["dump_saved"]),
                "async_save": request.param},
               timeout=240, kill_rank_after=(1, str(run["marker"])))
    run["error"] = str(ei.value)
    return run


@_stores("s3", "gcs", "azure")
def test_killed_mid_upload(crashed):
    assert crashed["marker"].exists(), "rank 1 never got half-way into its upload:\n" + crashed["error"]
    codes = [int(c) for c in re.search(r"exit codes \[([^\]]*)\]", crashed["error"]).group(1).split(",")]
    assert codes[1] == -signal.SIGKILL, crashed["error"]
    root = crashed["root"]
    # the victim's rank file is not an object; on S3 it is a listed incomplete multipart upload
    # (Azure's uncommitted blocks and GCS's parts are not listed: those stores expire them)
    uploads = storage.incomplete_uploads(root)
    expected = ["rank_00001.safetensors"] if crashed["kind"] == "s3" else []
    assert [u.path.name for u in uploads] == expected, uploads
    assert not (root / "iter_0000003" / "rank_00001.safetensors").is_file()


@_stores("s3", "gcs", "azure")
def test_latest_names_previous_and_partial_is_not_loadable(crashed):
    root = crashed["root"]
    assert (root / storage.LATEST).read_text().strip() == "iter_0000002"
    assert not (root / "iter_0000003" / mf.MANIFEST).is_file()
    assert open_source(root).dir == root / "iter_0000002"
    if not (root / "iter_0000003").exists():
        return  # (rank 0's file had not gone up either: nothing of iteration 3 is there)
    for attempt in (lambda: open_source(root / "iter_0000003"),
                    lambda: ucp.convert(root / "iter_0000003", crashed["tmp"] / "out", progress=False)):
        with pytest.raises(ucp.UCPError) as ei:
            attempt()
        msg = str(ei.value)
        assert f"{root}/iter_0000003" in msg and "never committed" in msg, msg


@_stores("s3", "gcs", "azure")
def test_verify_reports_leftovers_then_the_next_save_removes_them(crashed):
    """Runs last for its run: the retry loads iteration 2 (bitwise the state saved) and saves
    iteration 3 into the crashed root, removing the leftovers first."""
    root, tmp = crashed["root"], crashed["tmp"]
    report = verify(root)
    assert report.startswith(f"OK {root}/iter_0000002"), report
    if (root / "iter_0000003").exists():
        assert "interrupted save(s)" in report and "iter_0000003" in report, report
    if crashed["kind"] == "s3":
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


@pytest.fixture(scope="module")
def committed_local(tmp_path_factory):
    """A committed two-rank checkpoint (a save root with `latest`), saved once to a local
    directory; `committed` lays a copy of it into each store."""
    root = tmp_path_factory.mktemp("committed") / "ckpt"
    launch(2, "megatron_ucp.testing.scenarios:train_and_save",
           {"layout": LAYOUT, "cfg": {}, "steps": 1, "save_dir": str(root)}, timeout=240)
    return root


@pytest.fixture
def committed(store, committed_local):
    """A fresh copy of `committed_local` in the store (laid by the store's own means)."""
    return store.place(committed_local, store.fresh("good-"))


@_stores("s3", "gcs", "azure")
def test_wrong_credentials_save_commits_nothing(store, committed_local, monkeypatch, fresh_client):
    """A save (S3: the training ranks' own; the others: a conversion's upload, in this process)
    with a wrong secret fails naming the URL and commits nothing."""
    if store.kind == "gcs":
        pytest.skip(NO_CREDENTIAL_CHECK)
    root = store.fresh("badkeys-")
    variable, wrong = WRONG_SECRET[store.kind]
    if store.kind == "s3":
        with pytest.raises(LaunchError) as ei:
            launch(2, "megatron_ucp.testing.scenarios:train_and_save",
                   {"layout": LAYOUT, "cfg": {}, "steps": 1, "save_dir": str(root)},
                   env={variable: wrong}, timeout=240)
    else:
        monkeypatch.setenv(variable, wrong)
        with pytest.raises(ucp.UCPError) as ei:
            ucp.convert(str(committed_local), str(root), progress=False)
        monkeypatch.undo()
        object_store.store.cache_clear()
    msg = str(ei.value)
    assert str(root) in msg and "refused the credentials" in msg, msg[-3000:]
    assert variable.split("_KEY")[0] in msg or variable in msg, msg[-3000:]  # names its variables
    assert wrong not in msg  # the secret is never printed
    assert object_store.list_objects(location(root)) == []


@_stores("s3", "gcs", "azure")
def test_wrong_credentials_read(store, committed, monkeypatch, fresh_client):
    if store.kind == "gcs":
        pytest.skip(NO_CREDENTIAL_CHECK)
    variable, wrong = WRONG_SECRET[store.kind]
    monkeypatch.setenv(variable, wrong)
    with pytest.raises(ucp.UCPError) as ei:
        verify(str(committed))
    msg = str(ei.value)
    assert str(committed) in msg and "refused the credentials" in msg, msg
    assert wrong not in msg
    assert not any(v in msg for v in OTHER_STORES_VARIABLES[store.kind]), msg


@_stores("s3", "gcs", "azure")
def test_missing_bucket(store, monkeypatch, tmp_path, fresh_client):
    monkeypatch.setattr(object_store, "MAX_RETRIES", 1)  # (fake-gcs-server answers it with a 500)
    url = f"{store.base.scheme}://no-such-bucket-here/run"
    with pytest.raises(ucp.UCPError) as ei:
        verify(url)
    msg = str(ei.value)
    assert url in msg, msg
    if store.kind != "gcs":
        assert "does not exist" in msg, msg
    assert not any(v in msg for v in OTHER_STORES_VARIABLES[store.kind]), msg
    if store.writes:  # and a conversion into it commits nothing anywhere (its local staging is removed)
        with pytest.raises(ucp.UCPError) as ei:
            ucp.convert(str(tmp_path / "absent"), f"{store.base.scheme}://no-such-bucket-here/out",
                        progress=False)


@_stores("s3", "gcs", "azure")
def test_missing_bucket_on_write(store, committed, fresh_client):
    store.skip_writes()
    url = f"{store.base.scheme}://no-such-bucket-here/out"
    with pytest.raises(ucp.UCPError) as ei:
        ucp.convert(str(committed), url, progress=False)
    msg = str(ei.value)
    assert url in msg and "does not exist" in msg, msg


@_stores("s3", "gcs", "azure")
def test_unreachable_endpoint(store, monkeypatch, fresh_client):
    """The error names the endpoint variables of the store it is about (gs://: GOOGLE_BASE_URL,
    an http one allowed as given; never S3's variables for a GCS URL)."""
    monkeypatch.setenv(ENDPOINT_VARIABLE[store.kind], f"http://127.0.0.1:{free_port()}")
    monkeypatch.setattr(object_store, "MAX_RETRIES", 2)
    monkeypatch.setattr(object_store, "RETRY_SECONDS", 3.0)
    url = str(store.base / "anything")
    t0 = time.monotonic()
    with pytest.raises(ucp.UCPError) as ei:
        open_source(url)
    msg = str(ei.value)
    assert url in msg and "cannot be reached" in msg, msg
    assert ENDPOINT_VARIABLE[store.kind] in msg, msg
    assert not any(v in msg for v in OTHER_STORES_VARIABLES[store.kind]), msg
    assert time.monotonic() - t0 < 30  # bounded retries


def test_latest_naming_a_missing_prefix(store, committed):
    root = committed
    store.put_bytes(root / storage.LATEST, b"iter_0000009\n")
    with pytest.raises(ucp.UCPError) as ei:
        open_source(root)
    msg = str(ei.value)
    assert f"{root}/latest" in msg and "iter_0000009" in msg and "does not exist" in msg, msg
    assert "iter_0000001" in msg  # names the complete checkpoint to use instead


def test_truncated_object(store, committed):
    root = committed
    victim = root / "iter_0000001" / "rank_00001.safetensors"
    data = victim.read_bytes()
    store.put_bytes(victim, data[:len(data) - 1000])
    with pytest.raises(ucp.UCPError) as ei:
        verify(root)
    msg = str(ei.value)
    assert str(victim) in msg and "truncated" in msg, msg


@_stores("s3")  # (the refusal is the commit protocol's, the same for every store: test time)
def test_resaving_a_committed_iteration_is_refused_and_latest_stays_loadable(store, committed):
    """A store has no atomic replace: re-saving iteration 1 over a committed iter_0000001 must not
    take its manifest away first (for the whole save `latest` would name an uncommitted prefix, and
    nothing loadable if that save failed). It is refused on every rank before any rank writes, and
    the committed checkpoint is left byte for byte as it was."""
    root = committed
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
