"""Byte-level pieces of `megatron_ucp.storage`: checksum combination and file-to-file copies."""

from __future__ import annotations

import errno
import os
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import megatron_ucp as ucp
from megatron_ucp import storage
from megatron_ucp.storage import ByteRun, SafetensorsWriter, crc32_combine
from megatron_ucp.storage import local as local_backend


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=3000), st.binary(max_size=3000))
def test_crc32_combine_equals_the_crc32_of_the_concatenation(a, b):
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def _source(tmp_path):
    data = torch.arange(1000, dtype=torch.float32)
    path = tmp_path / "src.bin"
    path.write_bytes(b"HEAD" + data.numpy().tobytes())
    return path, data


@pytest.mark.parametrize("in_kernel", [True, False])
def test_copy_runs_writes_the_runs_in_order_in_kernel_or_by_reads(tmp_path, monkeypatch, in_kernel):
    path, data = _source(tmp_path)
    if not in_kernel:  # a filesystem pair copy_file_range refuses: the read/write path
        def refuse(*_a, **_k):
            raise OSError(errno.EXDEV, "cross-device")
        monkeypatch.setattr(os, "copy_file_range", refuse, raising=False)
    monkeypatch.setattr(local_backend, "COPY_CHUNK", 1024)  # several calls per run
    runs = [ByteRun(path, 4 + 4 * 600, 4 * 400), ByteRun(path, 4, 4 * 600)]  # out of file order
    out = tmp_path / "out.safetensors"
    w = SafetensorsWriter(out, [("a", torch.float32, (2, 3)), ("t", torch.float32, (10, 100))])
    w.write("a", torch.ones(2, 3))
    w.copy_runs("t", runs)
    w.close()
    got = load_file(out)
    assert torch.equal(got["a"], torch.ones(2, 3))
    assert torch.equal(got["t"].reshape(-1), torch.cat([data[600:], data[:600]]))


def test_copy_runs_refuses_a_wrong_size_and_names_a_truncated_source(tmp_path):
    path, _ = _source(tmp_path)
    w = SafetensorsWriter(tmp_path / "out.safetensors", [("t", torch.float32, (1000,))])
    with pytest.raises(ValueError, match="needs 4000 bytes, the runs hold 3996"):
        w.copy_runs("t", [ByteRun(path, 4, 3996)])
    os.truncate(path, 2000)
    with pytest.raises(ucp.UCPError, match=r"src\.bin: ends before byte 2000 .* truncated"):
        w.copy_runs("t", [ByteRun(path, 4, 4000)])


def test_read_into_preads_a_range_in_chunks_with_its_crc32(tmp_path, monkeypatch):
    """`Reader.read_into` (the load's read path): the elements asked for, bitwise, in several
    chunks, with the crc32 of exactly those bytes; a range past the tensor is refused."""
    from safetensors.torch import save_file
    data = torch.randn(5000, dtype=torch.float32)
    path = tmp_path / "t.safetensors"
    save_file({"pad": torch.zeros(3), "x": data}, str(path))
    monkeypatch.setattr(local_backend, "READ_CHUNK", 1000)  # not a multiple of 4: chunks split elements
    reader = storage.Reader()
    out = torch.empty(4321, dtype=torch.float32)
    crc = reader.read_into(path, "x", out, start=17, checksum=True)
    assert torch.equal(out, data[17:17 + 4321])
    assert crc == zlib.crc32(data[17:17 + 4321].numpy().tobytes())
    assert reader.bytes_read == 4 * 4321
    whole = torch.empty(5000, dtype=torch.float32)
    assert reader.read_into(path, "x", whole) is None and torch.equal(whole, data)
    with pytest.raises(ucp.UCPError, match=r"t.safetensors: tensor 'x' has 5000 elements.*\[4990, 5010\)"):
        reader.read_into(path, "x", torch.empty(20), start=4990)
