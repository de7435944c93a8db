"""Checkpoints in an object store (S3 on a real SeaweedFS server, tests/seaweed.py).

A URL is never a local path: an unsupported scheme is an error at every entry point. A save to
`s3://` writes its rank files as objects (multipart), commits with a create-only put of the
manifest, then `latest`; a load at another layout reads byte ranges of them and must equal,
bitwise, the independent reference assembled from the saving run (tests/reference.py), as the
disk transitions do: that load runs for every store in tests/test_storage_contract.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import SCENARIOS, STEPS, nprocs
from test_transitions import universal_tensors

import megatron_ucp as ucp
from megatron_ucp import storage
from megatron_ucp.cli import main as cli
from megatron_ucp.formats import manifest as mf
from megatron_ucp.formats import open_source
from megatron_ucp.storage import location, object_store
from megatron_ucp.storage.object_store import ObjectPath
from megatron_ucp.testing.launch import launch


# ------------------------------------------------------------------ URLs (no server needed)
def test_locations():
    assert location("s3://ckpt/run7") == ObjectPath("s3", "ckpt", "run7")
    assert location(Path("s3://ckpt/run7/")) == ObjectPath("s3", "ckpt", "run7")  # Path() ate a "/"
    assert str(location("s3://ckpt/run7") / "iter_0000003" / "manifest.json") == \
        "s3://ckpt/run7/iter_0000003/manifest.json"
    assert location("gs://b/k").scheme == "gs"
    assert location("file:///tmp/x") == Path("/tmp/x")
    assert location("relative/dir") == Path("relative/dir")


@pytest.mark.parametrize("url", ["hdfs://namenode/ckpt", "http://host/ckpt", "msc://profile/ckpt",
                                 "s3:///no-bucket"])
def test_unsupported_url_is_an_error_not_a_directory(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ucp.UCPError) as ei:
        location(url)
    assert url.split(":")[0] in str(ei.value)
    if url.startswith("msc:"):  # names what to use instead
        assert "multi-storage-client" in str(ei.value) and "s3://BUCKET/PREFIX" in str(ei.value)
    for argv in (["verify", url], ["inspect", url], ["convert", url, "out"],
                 ["convert", str(tmp_path / "missing"), url], ["diff", url, url],
                 ["import-hf", url, "out"], ["export-hf", url, "out", "--arch", "llama"],
                 ["reshard", "--load", url, "--save", "out"]):
        assert cli(argv) == 2, argv
    assert list(tmp_path.iterdir()) == []  # nothing was written locally (no `hdfs:` directory)


def test_megatron_lm_load_hook_does_not_read_a_bad_url_as_no_checkpoint():
    """Megatron-LM's --load with an unserved scheme must fail, not train from scratch."""
    from megatron_ucp.megatron_lm import _find_checkpoint

    with pytest.raises(ucp.UCPError, match="unsupported URL scheme"):
        _find_checkpoint("hdfs://nn/ckpt")


# ------------------------------------------------------------------ the store primitives
def test_store_primitives(s3_prefix):
    root = location(s3_prefix)
    obj = root / "a" / "x.bin"
    object_store.put(obj, b"hello")
    with pytest.raises(object_store.AlreadyExists):
        object_store.put(obj, b"again", create_only=True)  # the commit's conditional put
    assert obj.read_bytes() == b"hello" and obj.is_file() and (root / "a").is_dir()
    assert [bytes(b) for b in object_store.get_ranges(obj, [0, 3], [2, 5])] == [b"he", b"lo"]
    assert not (root / "nothing").exists()
    # a big object goes up in parts; an aborted one leaves nothing, not even an upload
    w = object_store.ObjectWriter(root / "big")
    w.write(b"x" * (object_store.PART_BYTES + 1))
    w.abort()
    assert not (root / "big").exists() and storage.incomplete_uploads(root) == []
    w = object_store.ObjectWriter(root / "big")
    w.write(b"y" * (object_store.PART_BYTES + 7))
    w.close()
    assert (root / "big").size() == object_store.PART_BYTES + 7


# ------------------------------------------------------------------ save / load transitions
class S3SourceRuns:
    """conftest.SourceRuns, saving to a bucket: train at a layout, dump, save to s3://, continue."""

    def __init__(self, url: str, root: Path):
        self.url, self.root = url, root

    def get(self, layout: str, cfg: dict) -> dict:
        d = self.root / f"src_{layout}"
        res = launch(nprocs(layout), f"{SCENARIOS}:train_and_save",
                     {"layout": layout, "cfg": cfg, "steps": STEPS, "save_dir": self.url,
                      "continue_steps": STEPS, "dump_dir": str(d / "dump")})
        return {"dir": d, "ckpt": self.url, "dump": d / "dump", **res[0]}


@pytest.fixture(scope="module")
def s3_saved(s3_server, tmp_path_factory):
    """A TP2 run saved to s3://ckpt/tp2run (one launch, shared by the tests below)."""
    tmp = tmp_path_factory.mktemp("s3src")
    url = f"{s3_server[1]}/tp2run"
    runs = S3SourceRuns(url, tmp)
    cwd = os.getcwd()
    os.chdir(tmp)  # a save that fell back to a local path would write `s3:` here
    try:
        source = runs.get("tp2", {"dtype": "fp32"})
    finally:
        os.chdir(cwd)
    assert not (tmp / "s3:").exists()
    return runs, source, url


def test_save_writes_objects_and_commits_last(s3_saved):
    _, _, url = s3_saved
    root = location(url)
    assert (root / storage.LATEST).read_text().strip() == f"iter_{STEPS:07d}"
    keys = sorted(p.key.removeprefix(root.prefix) for p, _ in object_store.list_objects(root))
    assert keys == ["iter_0000003/manifest.json", "iter_0000003/rank_00000.safetensors",
                    "iter_0000003/rank_00001.safetensors", "latest"]
    assert storage.incomplete_uploads(root) == []


def test_load_reads_merged_ranges(s3_saved, tmp_path):
    """Each rank of a TP1xDP2 load reads only its byte ranges of the TP2 rank files, planned and
    fetched in merged ranged GETs: per object a HEAD, the header and one window, not one request
    per tensor (the model has ~20 parameters x 3 states per rank file)."""
    _, source, url = s3_saved
    res = launch(2, f"{SCENARIOS}:load_and_train", {"layout": "dp2", "cfg": {"dtype": "fp32"},
                                                    "load_dir": url, "steps": 0})
    saved = sum(n for p, n in object_store.list_objects(location(url) / "iter_0000003")
                if p.name.startswith("rank_"))
    for r in res:
        assert r["files_opened"] == 2
        assert r["requests"] <= 3 * r["files_opened"], r
        assert r["bytes_read"] < saved  # its DP half of the optimizer state, not every byte


def test_verify_inspect_convert_on_urls(s3_saved, tmp_path, capsys):
    _, _, url = s3_saved
    assert cli(["verify", url]) == 0
    assert f"OK {url}/iter_0000003" in capsys.readouterr().out
    assert cli(["inspect", url]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint   {url}/iter_0000003" in out and "2 data files" in out
    # convert from the bucket into the bucket and to disk: the same tensors, bitwise
    assert cli(["convert", url, url + "-universal", "--no-progress"]) == 0
    assert (location(url + "-universal") / mf.MANIFEST).is_file()
    assert cli(["verify", url + "-universal"]) == 0
    local = universal_tensors(url, tmp_path / "u")
    from_bucket = {}
    src = open_source(url + "-universal")
    for name, p in src.manifest.params.items():
        for state in p.tensors:
            from_bucket[f"{name}/{state}"] = src.read(name, state, (0,) * len(p.shape), p.shape)
    for k, t in from_bucket.items():
        assert torch.equal(t, local[k]), k
    # a converted checkpoint is committed once: a second convert to it is refused
    assert cli(["convert", url, url + "-universal", "--no-progress"]) == 2
