"""`SafetensorsWriter`: a safetensors file streamed tensor by tensor (header first, from the known
shapes: `safetensors_codec`) into the writer its location's backend opens."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from megatron_ucp.storage.backend import ByteRun, FileWriter
from megatron_ucp.storage.safetensors_codec import encode_header, tensor_bytes
from megatron_ucp.storage.urls import Location, backend, location


class SafetensorsWriter:
    """Write a safetensors file tensor by tensor, in the order given to the constructor, into the
    writer its backend opens (a local file, or a multipart upload that goes up as parts fill)."""

    def __init__(self, path: Location, entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = location(path)
        head, data_bytes, self.order, self.expected = encode_header(entries, metadata)
        self.file: FileWriter = backend(self.path).open_writer(self.path)
        self.file.write(head)
        self.next = 0
        self.nbytes = len(head) + data_bytes

    @property
    def complete(self) -> bool:
        """Every tensor of the header written (`close` may follow)."""
        return self.next == len(self.order)

    def _expect(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        if self.next >= len(self.order) or name != self.order[self.next]:
            expected = self.order[self.next:self.next + 1]
            raise ValueError(f"{self.path}: expected tensor {expected}, got {name}")
        return self.expected[name]

    def write(self, name: str, t: torch.Tensor) -> None:
        dtype, shape = self._expect(name)
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"{self.path}: {name} is {t.dtype}{tuple(t.shape)}, header says {dtype}{shape}")
        self.file.write(tensor_bytes(t))
        self.next += 1

    def copy_runs(self, name: str, runs: list[ByteRun]) -> None:
        """Write tensor `name` as the concatenation of byte runs of other (local) files (its raw
        bytes, in order), copied file to file where the backend can, without reading them into
        this process."""
        dtype, shape = self._expect(name)
        nbytes = math.prod(shape) * dtype.itemsize
        if sum(r.nbytes for r in runs) != nbytes:
            raise ValueError(f"{self.path}: {name} needs {nbytes} bytes, the runs hold "
                             f"{sum(r.nbytes for r in runs)}")
        self.file.copy_runs(runs)
        self.next += 1

    def close(self, fsync: bool = True) -> None:
        if self.next != len(self.order):
            raise ValueError(f"{self.path}: {len(self.order) - self.next} tensors not written")
        self.file.close(fsync=fsync)  # (an upload completes here: the object appears whole)

    def abort(self) -> None:
        """Give up a write that failed: a store's multipart upload is aborted (the caller removes
        a local file's directory)."""
        self.file.abort()


def write_tensors(path: Location, tensors: dict[str, torch.Tensor],
                  metadata: dict[str, str] | None = None) -> None:
    w = SafetensorsWriter(path, [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], metadata)
    for k, v in tensors.items():
        w.write(k, v)
    w.close()

