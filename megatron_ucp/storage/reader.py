"""`Reader`: whole tensors, slices and byte ranges of safetensors files in any backend, each file
opened once (`Backend.open_tensor_file`), the bytes read counted."""

from __future__ import annotations

import torch

from megatron_ucp.errors import UCPError
from megatron_ucp.storage.backend import ByteRun, TensorFile
from megatron_ucp.storage.safetensors_codec import tensor_bytes
from megatron_ucp.storage.urls import Location, backend, location


class Reader:
    """Reads whole tensors or slices from safetensors files, opening each file once, counting bytes."""

    def __init__(self) -> None:
        self.handles: dict[Location, TensorFile] = {}
        self.checked: set[tuple[Location, str]] = set()  # (file, key) whose header entry `check` passed
        self.bytes_read = 0

    def open(self, path: Location) -> TensorFile:
        path = location(path)
        if path not in self.handles:
            self.handles[path] = backend(path).open_tensor_file(path)
        return self.handles[path]

    def metadata(self, path: Location) -> dict[str, str]:
        return self.open(path).metadata() or {}

    def check(self, path: Location, key: str, dtype: str, shape: tuple[int, ...]) -> None:
        """Tensor `key`'s header entry says `dtype` (safetensors name) and `shape`, checked once per
        key before its bytes are used: a header edited to another dtype of the same width or
        another shape of the same size reads the same bytes, passes the checksum (which covers
        the bytes only) and would mean other numbers."""
        if (path, key) in self.checked:
            return
        try:
            view = self.open(path).get_slice(key)
            got = (view.get_dtype(), tuple(view.get_shape()))
        except UCPError:
            raise
        except Exception as e:
            raise UCPError(f"{path}: cannot read tensor {key!r} ({e}); the file is truncated "
                           "or corrupt, restore it or use another iteration") from e
        if got != (dtype, tuple(shape)):
            raise UCPError(f"{path}: tensor {key!r} is {got[0]} {list(got[1])} in the file's header, "
                           f"the checkpoint expects {dtype} {list(shape)}; the file is corrupt or "
                           "from another checkpoint: restore it or use another iteration")
        self.checked.add((path, key))

    def byte_run(self, path: Location, key: str) -> ByteRun:
        """Where tensor `key`'s bytes are in the file (from its header, read once per file)."""
        return self.open(path).byte_run(key)

    def read_into(self, path: Location, key: str, out: torch.Tensor, start: int = 0,
                  checksum: bool = False, crc: int = 0) -> int | None:
        """Elements [start, start + out.numel()) of tensor `key`, flattened, into the contiguous host
        tensor `out` (of the file's dtype); with `checksum`, their crc32 is returned, continuing
        `crc` (the crc32 of the bytes before them: a tensor read in consecutive parts). The file
        copies them straight into `out` (a local file: pread; an object: its fetched windows)."""
        width = out.element_size()
        got = self.open(path).read_into(key, start * width, tensor_bytes(out), crc if checksum else None)
        self.bytes_read += out.numel() * width
        return got

    def read(self, path: Location, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        f = self.open(path)
        try:
            t = f.get_tensor(key) if index is None else f.get_slice(key)[index]
        except Exception as e:
            raise UCPError(f"{path}: cannot read tensor {key!r} ({e}); the file is truncated "
                           "or corrupt, restore it or use another iteration") from e
        self.bytes_read += t.numel() * t.element_size()
        return t

