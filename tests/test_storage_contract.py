"""The storage backend contract: the same tests over a local directory and every store the README
names, each against a real server on 127.0.0.1 (tests/store_servers.py: SeaweedFS for s3://,
fake-gcs-server for gs://, Azurite for az://), through the storage layer's public names only.

What one backend must do: list and size files, write safetensors files (streamed tensor by tensor)
and read them back whole, sliced, by ranges into a buffer (with their crc32) and by planned merged
reads; fetch a pickle and a torch.distributed.checkpoint directory; commit a directory whole with
its marker last, refuse a non-empty target, list and remove what an interrupted save left; and a
real save at TP2 loaded at TP1xDP2, bitwise against the independent reference.

gs:// runs every read case; its write cases are expected skips (`gcs_server.WRITES_UNSUPPORTED`:
fake-gcs-server does not take the XML API writes obstore sends), so its checkpoints are laid
through the emulator's JSON API and read through megatron-ucp's client.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from conftest import SCENARIOS, STEPS, nprocs
from test_transitions import check_transition

import megatron_ucp as ucp
from megatron_ucp import storage
from megatron_ucp.formats import manifest as mf
from megatron_ucp.formats.megatron_common import torch_load
from megatron_ucp.testing.launch import launch

TENSORS = {"w": torch.arange(24, dtype=torch.float32).reshape(6, 4),
           "b": torch.arange(5, dtype=torch.bfloat16),
           "n": torch.tensor([7, -3], dtype=torch.int64)}
STREAMED = [("x", torch.float16, (3, 5)), ("y", torch.float32, (2,))]


def _streamed(i: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return (torch.arange(torch.Size(shape).numel(), dtype=torch.float32) * (i + 1)).reshape(shape).to(dtype)


def _write_files(directory) -> None:
    """Two safetensors files, one whole (`write_tensors`), one streamed (`SafetensorsWriter`)."""
    storage.write_tensors(directory / "whole.safetensors", TENSORS, {"kind": "whole"})
    w = storage.SafetensorsWriter(directory / "streamed.safetensors", STREAMED, {"kind": "streamed"})
    for i, (name, dtype, shape) in enumerate(STREAMED):
        w.write(name, _streamed(i, dtype, shape))
    w.close()


@pytest.fixture(scope="module")
def files(store, tmp_path_factory):
    """A directory of the backend holding `_write_files`' files: written by the storage layer
    itself, or (gs://) written locally and laid by the emulator's JSON API."""
    root = store.fresh("files-")
    if store.writes:
        if store.kind == "local":
            root.mkdir(parents=True)
        _write_files(root)
    else:
        local = tmp_path_factory.mktemp("files")
        _write_files(local)
        store.place(local, root)
    return root


def test_writes(store):
    """The write side against the server (gs://: the expected skip that names why)."""
    store.skip_writes()
    root = store.fresh("w-")
    if store.kind == "local":
        root.mkdir(parents=True)
    _write_files(root)
    assert sorted(storage.names_in(root)) == ["streamed.safetensors", "whole.safetensors"]
    # a writer that fails half-way leaves nothing visible (an aborted upload, a closed file)
    w = storage.SafetensorsWriter(root / "aborted.safetensors", STREAMED)
    w.write("x", _streamed(0, *STREAMED[0][1:]))
    w.abort()
    if store.kind != "local":  # (a local writer's caller removes its directory)
        assert "aborted.safetensors" not in storage.names_in(root)


def test_names_and_sizes(store, files):
    assert sorted(storage.names_in(files)) == ["streamed.safetensors", "whole.safetensors"]
    assert storage.names_in(files / "nothing-here") == []
    for name in ("whole.safetensors", "streamed.safetensors"):
        assert storage.size_of(files / name) == len((files / name).read_bytes()) > 8


def test_reader_whole_sliced_and_into(store, files):
    reader = storage.Reader()
    whole, streamed = files / "whole.safetensors", files / "streamed.safetensors"
    assert reader.metadata(whole) == {"kind": "whole"} and reader.metadata(streamed) == {"kind": "streamed"}
    for key, t in TENSORS.items():
        assert torch.equal(reader.read(whole, key), t), key
    assert torch.equal(reader.read(whole, "w", (slice(2, 5), slice(1, 3))), TENSORS["w"][2:5, 1:3])
    for i, (name, dtype, shape) in enumerate(STREAMED):
        assert torch.equal(reader.read(streamed, name), _streamed(i, dtype, shape)), name
    # ranged reads straight into a buffer, with the crc32 of their bytes continued across parts
    flat = TENSORS["w"].flatten()
    first, second = torch.empty(10, dtype=torch.float32), torch.empty(14, dtype=torch.float32)
    crc = reader.read_into(whole, "w", first, start=0, checksum=True)
    crc = reader.read_into(whole, "w", second, start=10, checksum=True, crc=crc)
    assert torch.equal(torch.cat([first, second]), flat)
    assert crc == zlib.crc32(flat.numpy().tobytes())
    reader.check(whole, "w", "F32", (6, 4))
    with pytest.raises(ucp.UCPError, match="expects F16"):
        reader.check(whole, "n", "F16", (2,))
    assert reader.bytes_read > 0


class _Files(storage.ReadsFiles):
    """The least a checkpoint source is for `plan_reads`: its directory and its reader."""

    def __init__(self, directory):
        self.dir, self.reader, self.verify_checksums = directory, storage.Reader(), True


def test_planned_reads(store, files):
    """A load's reads planned first (object stores: fetched as merged ranged GETs), then served."""
    source = _Files(files)
    out = {}

    def reads(src: _Files) -> None:
        out["w"] = torch.empty(12, dtype=torch.float32)
        src.reader.read_into(src.dir / "whole.safetensors", "w", out["w"], start=6)
        out["y"] = src.reader.read(src.dir / "streamed.safetensors", "y")

    storage.plan_reads(source, reads)
    reads(source)
    assert torch.equal(out["w"], TENSORS["w"].flatten()[6:18])
    assert torch.equal(out["y"], _streamed(1, torch.float32, (2,)))
    if store.kind != "local":  # per object a HEAD, its header and one merged window at most
        assert 0 < source.requests <= 3 * source.files_opened, source.requests


def test_pickle_and_dcp_directory(store, tmp_path):
    """A pickle fetched whole (`torch_load`) and a torch.distributed.checkpoint directory read
    through `dcp_reader`, both laid by the store's own means."""
    import torch.distributed.checkpoint as dcp

    state = {"a": torch.arange(10, dtype=torch.float32), "b": {"c": torch.ones(3, 2, dtype=torch.bfloat16)}}
    local = tmp_path / "dir"
    local.mkdir()
    torch.save({"iteration": 7, "t": state["a"]}, local / "model_optim_rng.pt")
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(local / "dcp")), no_dist=True)
    root = store.place(local, store.fresh("dcp-"))
    loaded = torch_load(root / "model_optim_rng.pt", "a test pickle")
    assert loaded["iteration"] == 7 and torch.equal(loaded["t"], state["a"])
    into = {"a": torch.zeros(10), "b": {"c": torch.zeros(3, 2, dtype=torch.bfloat16)}}
    dcp.load(into, storage_reader=storage.dcp_reader(root / "dcp"), no_dist=True)
    assert torch.equal(into["a"], state["a"]) and torch.equal(into["b"]["c"], state["b"]["c"])


def test_commit_refuse_and_leftovers(store):
    """A directory appears whole with its marker (`staged_dir`), a non-empty target is refused,
    an interrupted multi-rank save (`staged` without its marker) is listed and removed."""
    store.skip_writes()
    root = store.fresh("commit-")
    storage.refuse_non_empty(root)  # new: fine
    with storage.staged_dir(root / "one", mf.MANIFEST) as partial:
        storage.write_tensors(partial / "t.safetensors", {"w": TENSORS["w"]})
        (partial / mf.MANIFEST).write_text("{}")
    assert sorted(storage.names_in(root / "one")) == [mf.MANIFEST, "t.safetensors"]
    with pytest.raises(ucp.UCPError, match="choose a new"):
        storage.refuse_non_empty(root / "one")
    with pytest.raises(ucp.UCPError, match="choose a new"):
        with storage.staged_dir(root / "one", mf.MANIFEST):
            pass
    with pytest.raises(RuntimeError, match="writer died"):  # a failed write commits nothing
        with storage.staged_dir(root / "two", mf.MANIFEST) as partial:
            (partial / "half").write_bytes(b"x")
            raise RuntimeError("writer died")
    assert storage.names_in(root / "two") == []
    # a multi-rank save: files into the staged target, the writer's marker commits it
    job = storage.staged(root / "iter_0000001", mf.MANIFEST)
    target = job.create()
    storage.write_tensors(target / "rank_00000.safetensors", {"w": TENSORS["w"]})
    store.put_bytes(target / mf.MANIFEST, b"{}")
    job.commit()
    assert sorted(storage.names_in(root / "iter_0000001")) == [mf.MANIFEST, "rank_00000.safetensors"]
    # an interrupted one (no marker) is listed as left over, and removed by the next create
    job = storage.staged(root / "iter_0000002", mf.MANIFEST)
    storage.write_tensors(job.create() / "rank_00000.safetensors", {"w": TENSORS["w"]})
    assert [p.name for p in storage.interrupted_saves(root, mf.MANIFEST)] == [job.partial.name]
    job.create(replace=True)
    job.abort()
    assert storage.interrupted_saves(root, mf.MANIFEST) == []
    assert sorted(storage.names_in(root / "iter_0000001")) == [mf.MANIFEST, "rank_00000.safetensors"]


def test_save_tp2_load_tp1_dp2(store, source_runs, tmp_path):
    """A real TP2 save into the backend, loaded at TP1xDP2: bitwise against the reference
    assembled from the saving run, the universal round trip bitwise, the loss continuing
    (tests/test_transitions.py). A local directory and gs:// take the session's local TP2 run
    (conftest.source_runs, shared with tests/test_transitions.py); gs:// gets it laid by the
    emulator's JSON API."""
    cfg = {"dtype": "fp32"}
    if store.writes and store.kind != "local":
        saved = store.fresh("tp2-")
        res = launch(nprocs("tp2"), f"{SCENARIOS}:train_and_save",
                     {"layout": "tp2", "cfg": cfg, "steps": STEPS, "save_dir": str(saved),
                      "continue_steps": STEPS, "dump_dir": str(tmp_path / "dump")})
        source = {"dir": tmp_path, "ckpt": saved, "dump": tmp_path / "dump", **res[0]}
    else:
        source = dict(source_runs.get("tp2", cfg))
        if not store.writes:
            source["ckpt"] = store.place(source["ckpt"], store.fresh("tp2-"))
    assert (storage.location(source["ckpt"]) / storage.LATEST).read_text().strip() == f"iter_{STEPS:07d}"

    class Runs:
        def get(self, layout: str, cfg: dict) -> dict:
            return source

    (tmp_path / "load").mkdir()
    check_transition(Runs(), tmp_path / "load", "tp2", "dp2", cfg, name=f"{store.kind}:tp2->dp2")
