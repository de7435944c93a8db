"""Read boxes of universal tensors from a consolidated directory (sliced reads)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_ucp import storage
from megatron_ucp.errors import UCPError
from megatron_ucp.formats.base import HF_FILES, Source
from megatron_ucp.formats.manifest import Manifest
from megatron_ucp.spec import ParamSpec, contiguous_strides, states_of
from megatron_ucp.storage import DTYPE_TO_ST, NAME_TO_DTYPE, Reader, ReadsFiles, crc32, location

RNG_FILE = "rng.safetensors"


DATA_FILES = "params_*.safetensors"  # (a glob of `data_file_name`s)


def data_file_name(i: int) -> str:
    return f"params_{i:05d}.safetensors"


def rng_prefix(rank: int) -> str:
    return f"rank{rank:05d}"


def stored_tensors(spec: ParamSpec, weights_only: bool) -> dict[str, torch.dtype]:
    """The tensors a universal checkpoint holds for a parameter, state -> dtype: every state of its
    optimizer family in fp32; in a weights-only checkpoint its weight alone, in the weight's own
    dtype (`spec.dtype`: an import's bf16 weights as their bf16 bytes, which a read casts back to
    exactly the fp32 master a full checkpoint holds)."""
    if weights_only:
        return {"param": NAME_TO_DTYPE[spec.dtype]}
    return dict.fromkeys(states_of(spec), torch.float32)


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

    def hf_files(self) -> dict[str, bytes]:
        """Its `hf_files/` (import-hf's copies), carried by a conversion to a new universal one."""
        return {n: storage.read_bytes(self.dir / HF_FILES / n)
                for n in sorted(storage.names_in(self.dir / HF_FILES))}

    def _fresh(self, name: str, state: str) -> bool:
        """A state a weights-only checkpoint does not store: the fresh optimizer's, zero."""
        p = self.manifest.params[name]
        return self.manifest.weights_only and state not in p.tensors and state in p.states

    def read(self, name: str, state: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        p = self.manifest.params[name]
        if self._fresh(name, state):
            return torch.zeros(shape, dtype=torch.float32)
        if state not in p.tensors:
            raise KeyError(f"{name} has no state {state!r}")
        entry = p.tensors[state]
        path = self.dir / entry.file
        dtype = stored_tensors(p.spec, self.manifest.weights_only)[state]
        self.reader.check(path, entry.key, DTYPE_TO_ST[dtype], p.shape)  # as the manifest says
        if tuple(offset) == (0,) * len(offset) and tuple(shape) == p.shape:
            t = self.reader.read(path, entry.key)
            if self.verify_checksums and crc32(t) != entry.crc32:  # (of the stored bytes)
                raise UCPError(f"{path}: checksum mismatch in tensor {entry.key!r}; the file is "
                               "corrupt: restore it or re-run `megatron-ucp convert`")
            return t.to(torch.float32)
        box = tuple(slice(o, o + n) for o, n in zip(offset, shape))
        return self.reader.read(path, entry.key, box).to(torch.float32)

    def read_into(self, name: str, state: str, offset: tuple[int, ...], shape: tuple[int, ...],
                  out: torch.Tensor) -> None:
        """`read` into `out` (a contiguous fp32 tensor of `shape`): a box that is one row-major run
        of a local file's tensor is read straight into it (`Reader.read_into`), a whole tensor
        checked against its crc32 on the way."""
        p = self.manifest.params[name]
        if self._fresh(name, state):
            out.zero_()
            return
        full, offset, shape = p.shape, tuple(offset), tuple(shape)
        # one run: the dims after the first partial one are whole, those before it are single rows
        k = next((i for i, (n, m) in enumerate(zip(shape, full)) if n != m), len(full))
        run = all(n == 1 for n in shape[:k]) and shape[k + 1:] == full[k + 1:]
        # (a weight stored in another dtype than fp32 is read and cast)
        if (state not in p.tensors or not storage.has_local_files(self.dir) or not run
                or stored_tensors(p.spec, self.manifest.weights_only)[state] != torch.float32):
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
        every tensor of the data files (a weights-only checkpoint: its weights). Returns tensors
        checked."""
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
