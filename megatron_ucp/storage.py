"""Bytes in and out: streaming safetensors writer, sliced reader that counts bytes, fsync helpers.

safetensors layout (https://github.com/huggingface/safetensors): 8-byte little-endian header length
N, N bytes of JSON header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__":
{str: str}}, then the raw little-endian tensor bytes. Writing the header first from the known
shapes lets us stream one tensor at a time instead of holding the whole file in memory.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open

from megatron_ucp.errors import UCPError

DTYPE_TO_ST = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
}
ST_TO_DTYPE = {v: k for k, v in DTYPE_TO_ST.items()}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
NAME_TO_DTYPE = {v: k for k, v in DTYPE_NAMES.items()}


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's raw bytes without a copy (a copy only if it is not contiguous). Host tensors
    only: device state reaches files through `megatron_ucp.staging`."""
    if t.device.type != "cpu":
        raise ValueError(f"a {t.device} tensor reached the file writer; stage it to host memory "
                         "first (megatron_ucp.staging.HostStager)")
    t = t.detach().contiguous()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


def crc32(t: torch.Tensor) -> int:
    return zlib.crc32(tensor_bytes(t))


def crc32_many(tensors: list[torch.Tensor], workers: int | None = None) -> list[int]:
    """crc32 of each tensor, computed by a few threads (zlib releases the GIL on large buffers):
    a rank file's checksums go into its header, so they are all needed before its first byte."""
    workers = workers or min(8, os.cpu_count() or 1)
    if workers <= 1 or len(tensors) <= 1:
        return [crc32(t) for t in tensors]
    with ThreadPoolExecutor(workers, thread_name_prefix="megatron-ucp-crc") as pool:
        return list(pool.map(crc32, tensors))


class SafetensorsWriter:
    """Write a safetensors file tensor by tensor, in the order given to the constructor."""

    def __init__(self, path: Path, entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.order: list[str] = []
        self.expected: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        header: dict = {"__metadata__": metadata} if metadata else {}
        offset = 0
        for name, dtype, shape in entries:
            nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": DTYPE_TO_ST[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            self.order.append(name)
            self.expected[name] = (dtype, tuple(shape))
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.file = open(self.path, "wb")
        self.file.write(struct.pack("<Q", len(raw)) + raw)
        self.next = 0
        self.nbytes = 8 + len(raw) + offset

    def write(self, name: str, t: torch.Tensor) -> None:
        if self.next >= len(self.order) or name != self.order[self.next]:
            expected = self.order[self.next:self.next + 1]
            raise ValueError(f"{self.path}: expected tensor {expected}, got {name}")
        dtype, shape = self.expected[name]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"{self.path}: {name} is {t.dtype}{tuple(t.shape)}, header says {dtype}{shape}")
        self.file.write(tensor_bytes(t))
        self.next += 1

    def close(self, fsync: bool = True) -> None:
        if self.next != len(self.order):
            raise ValueError(f"{self.path}: {len(self.order) - self.next} tensors not written")
        self.file.flush()
        if fsync:
            os.fsync(self.file.fileno())
        self.file.close()


def write_tensors(path: Path, tensors: dict[str, torch.Tensor],
                  metadata: dict[str, str] | None = None) -> None:
    w = SafetensorsWriter(path, [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], metadata)
    for k, v in tensors.items():
        w.write(k, v)
    w.close()


class Reader:
    """Reads whole tensors or slices from safetensors files, opening each file once, counting bytes."""

    def __init__(self) -> None:
        self.handles: dict[Path, object] = {}
        self.bytes_read = 0

    def open(self, path: Path):
        path = Path(path)
        if path not in self.handles:
            if not path.exists():
                raise UCPError(f"{path}: file is missing; the checkpoint is incomplete, "
                               "re-save it or point to another iteration")
            try:
                self.handles[path] = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise UCPError(f"{path}: not a readable safetensors file ({e}); the file is "
                               "truncated or corrupt, restore it or use another iteration") from e
        return self.handles[path]

    def metadata(self, path: Path) -> dict[str, str]:
        return self.open(path).metadata() or {}

    def read(self, path: Path, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        f = self.open(path)
        try:
            t = f.get_tensor(key) if index is None else f.get_slice(key)[index]
        except Exception as e:
            raise UCPError(f"{path}: cannot read tensor {key!r} ({e}); the file is truncated "
                           "or corrupt, restore it or use another iteration") from e
        self.bytes_read += t.numel() * t.element_size()
        return t


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Write, fsync, rename over `path`, fsync the directory: readers see the old or the new."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
