"""Read boxes of universal tensors from a consolidated directory (sliced reads)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_ucp import storage
from megatron_ucp.errors import UCPError
from megatron_ucp.formats.base import Source
from megatron_ucp.formats.manifest import Manifest
from megatron_ucp.spec import contiguous_strides
from megatron_ucp.storage import Reader, ReadsFiles, crc32, location

RNG_FILE = "rng.safetensors"


DATA_FILES = "params_*.safetensors"  # (a glob of `data_file_name`s)


def data_file_name(i: int) -> str:
    return f"params_{i:05d}.safetensors"


def rng_prefix(rank: int) -> str:
    return f"rank{rank:05d}"


class UniversalSource(ReadsFiles, Source):
    """Reads boxes of universal tensors from a consolidated directory (sliced reads)."""

    format = "universal"  # its name in the `formats` registry

    def __init__(self, ckpt_dir: Path, manifest: Manifest, verify_checksums: bool = True):
        self.dir = location(ckpt_dir)
        self.manifest = manifest
        self.origin = manifest.converted_from or {"kind": "universal", "path": str(self.dir)}
        self.reader = Reader()
        self.verify_checksums = verify_checksums

    def step(self, name: str) -> float:
        return self.manifest.params[name].step

    def read(self, name: str, state: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        p = self.manifest.params[name]
        if state not in p.tensors:
            raise KeyError(f"{name} has no state {state!r}")
        entry = p.tensors[state]
        path = self.dir / entry.file
        self.reader.check(path, entry.key, "F32", p.shape)  # full fp32 tensors, as the manifest says
        if tuple(offset) == (0,) * len(offset) and tuple(shape) == p.shape:
            t = self.reader.read(path, entry.key)
            if self.verify_checksums and crc32(t) != entry.crc32:
                raise UCPError(f"{path}: checksum mismatch in tensor {entry.key!r}; the file is "
                               "corrupt: restore it or re-run `megatron-ucp convert`")
            return t
        return self.reader.read(path, entry.key, tuple(slice(o, o + n) for o, n in zip(offset, shape)))

    def read_into(self, name: str, state: str, offset: tuple[int, ...], shape: tuple[int, ...],
                  out: torch.Tensor) -> None:
        """`read` into `out` (a contiguous fp32 tensor of `shape`): a box that is one row-major run
        of a local file's tensor is read straight into it (`Reader.read_into`), a whole tensor
        checked against its crc32 on the way."""
        p = self.manifest.params[name]
        full, offset, shape = p.shape, tuple(offset), tuple(shape)
        # one run: the dims after the first partial one are whole, those before it are single rows
        k = next((i for i, (n, m) in enumerate(zip(shape, full)) if n != m), len(full))
        run = all(n == 1 for n in shape[:k]) and shape[k + 1:] == full[k + 1:]
        if state not in p.tensors or not storage.has_local_files(self.dir) or not run:
            out.copy_(self.read(name, state, offset, shape))
            return
        entry = p.tensors[state]
        path = self.dir / entry.file
        self.reader.check(path, entry.key, "F32", full)
        start = sum(o * st for o, st in zip(offset, contiguous_strides(full)))
        whole = shape == full
        crc = self.reader.read_into(path, entry.key, out.view(-1), start,
                                    checksum=whole and self.verify_checksums)
        if whole and self.verify_checksums and crc != entry.crc32:
            raise UCPError(f"{path}: checksum mismatch in tensor {entry.key!r}; the file is "
                           "corrupt: restore it or re-run `megatron-ucp convert`")

    def check_files(self, part: int = 0, parts: int = 1) -> None:
        """Every tensor in the data files is in the manifest: a manifest that lost a parameter's
        entry would otherwise read, verify and convert without it. Headers only; data files part,
        part + parts, ... (in name order), so the ranks of a load share the work."""
        listed: dict[str, set[str]] = {}
        for p in self.manifest.params.values():
            for entry in p.tensors.values():
                listed.setdefault(entry.file, set()).add(entry.key)
        files = sorted({*listed, *(f.name for f in self.dir.glob(DATA_FILES))})
        for name in files[part::parts]:
            path = self.dir / name
            unlisted = sorted(set(self.reader.open(path).keys()) - listed.get(name, set()))
            if unlisted:
                raise UCPError(f"{path}: holds tensor {unlisted[0]!r}"
                               f"{f' (and {len(unlisted) - 1} more)' if len(unlisted) > 1 else ''}, "
                               "which the manifest does not list; the manifest is damaged or from "
                               "another conversion (a checkpoint read through it would silently lack "
                               "the parameter): restore it or re-run `megatron-ucp convert`")

    def verify(self) -> int:
        """Read every tensor whole and check its crc32 and shape, and that the manifest lists
        every tensor of the data files. Returns tensors checked."""
        self.check_files()
        n = 0
        for name, p in self.manifest.params.items():
            for state in p.tensors:
                t = self.read(name, state, (0,) * len(p.shape), p.shape)
                if tuple(t.shape) != p.shape:
                    raise UCPError(f"{self.dir}: {name}/{state} has shape {list(t.shape)}, the "
                                   f"manifest says {list(p.shape)}; re-run `megatron-ucp convert`")
                n += 1
        return n

    def rng_ranks(self) -> list[int]:
        """The saving ranks whose generator states are kept."""
        if not (self.dir / RNG_FILE).exists():
            return []
        return sorted(int(k.removeprefix("rank")) for k in self.reader.metadata(self.dir / RNG_FILE))

    def rng(self, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
        path = self.dir / RNG_FILE
        if not path.exists():
            return {}, {}
        f = self.reader.open(path)
        prefix = rng_prefix(rank) + "/"
        tensors = {k.removeprefix(prefix): f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
        return tensors, json.loads(self.reader.metadata(path).get(rng_prefix(rank), "{}"))
