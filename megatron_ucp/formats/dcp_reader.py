"""Reading a torch.distributed.checkpoint directory without a process group, key by key: shared
by the formats stored as DCP directories (Megatron-LM's torch_dist and its FSDP forms)."""

from __future__ import annotations

import io
import math
from collections import OrderedDict
from pathlib import Path

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.megatron_common import unpickle
from megatron_ucp.storage import dcp_reader, names_in

METADATA_FILE = ".metadata"


class ReadsDcp:
    """What a source reading torch.distributed.checkpoint files through `self.reader` (a
    DistReader) reports of its reads, and its Adam steps (from its manifest): the torch_dist and
    the FSDP sources share it."""

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read

    @property
    def files_opened(self) -> int:
        return len({s.relative_path for s in self.reader.metadata.storage_data.values()})

    def step(self, name: str) -> float:
        return self.manifest.params[name].step


class DistReader:
    """Loads single keys of a torch_dist checkpoint without a process group, with a small cache.

    Why a cache: universal parameters are per layer, but torch_dist stores all layers in one
    stacked tensor (and the dp_reshardable optimizer in one flat bucket per rank), so consecutive
    parameters hit the same stored tensor.
    """

    def __init__(self, ckpt_dir: Path, cache_entries: int = 8, trust_pickle: bool = False):
        self.dir = ckpt_dir
        self.trust_pickle = trust_pickle
        # one reader for every load: .metadata is parsed once, not once per key
        self.storage = dcp_reader(ckpt_dir)
        try:
            self.metadata = self.storage.read_metadata()
        except Exception as e:  # noqa: BLE001 - any unreadable .metadata is the same user error
            raise UCPError(f"{ckpt_dir / '.metadata'}: cannot read torch_dist metadata ({e}); the "
                           "file is damaged: restore it or convert another iteration") from e
        self.meta = self.metadata.state_dict_metadata
        files = sorted({s.relative_path for s in self.metadata.storage_data.values()})
        missing = sorted(set(files) - set(names_in(ckpt_dir)))
        if missing:
            raise UCPError(f"{ckpt_dir}: data file(s) {', '.join(missing)} listed in .metadata are "
                           "missing; the checkpoint is incomplete (copy them back or use another "
                           "iteration)")
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.cache_entries = cache_entries
        self.bytes_read = 0

    def tensor_keys(self) -> list[str]:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        return [k for k, v in self.meta.items() if isinstance(v, TensorStorageMetadata)]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.meta[key].size)

    def tensor(self, key: str) -> torch.Tensor:
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        if key not in self.meta:
            raise UCPError(f"{self.dir}: tensor {key!r} is not in the checkpoint")
        m = self.meta[key]
        self._check_covered(key, m)
        t = torch.empty(tuple(m.size), dtype=m.properties.dtype)
        self._load({key: t})
        self.bytes_read += t.numel() * t.element_size()
        self.cache[key] = t
        while len(self.cache) > self.cache_entries:
            self.cache.popitem(last=False)
        return t

    def files(self, key: str) -> str:
        """The data files holding a key's chunks (for error messages)."""
        return ", ".join(sorted({str(self.dir / v.relative_path)
                                 for k, v in self.metadata.storage_data.items() if k.fqn == key}))

    def _check_covered(self, key: str, m) -> None:
        """A stored tensor's chunks must fill it: DCP loads a hole as whatever torch.empty held,
        which would be a silently wrong tensor (e.g. a flattened_range optimizer state whose
        DP ranges do not add up to the chunk)."""
        size = tuple(m.size)
        covered = 0
        for c in m.chunks:
            if any(o < 0 or o + n > s for o, n, s in zip(c.offsets, c.sizes, size)):
                raise UCPError(f"{self.dir / METADATA_FILE}: tensor {key!r} {list(size)} has a chunk at "
                               f"{list(c.offsets)} of {list(c.sizes)} outside the tensor; the "
                               "metadata is damaged: restore it or convert another iteration")
            covered += math.prod(c.sizes)
        if covered != math.prod(size):
            raise UCPError(f"{self.dir / METADATA_FILE} ({self.files(key) or 'no data file'}): tensor "
                           f"{key!r} {list(size)}: its chunks cover {covered} of {math.prod(size)} "
                           "elements, so part of it was never written (a rank's save missing or "
                           "the files mixed from two saves); restore them or convert another "
                           "iteration")

    def obj(self, key: str):
        if key not in self.meta:
            raise UCPError(f"{self.dir}: object {key!r} is not in the checkpoint")
        sd = {key: io.BytesIO()}
        self._load(sd)
        return sd[key]

    def objs(self, keys: list[str]) -> dict:
        """Many stored objects at once (one pass of torch.distributed.checkpoint's loader)."""
        missing = [k for k in keys if k not in self.meta]
        if missing:
            raise UCPError(f"{self.dir}: object(s) {missing[:3]} not in the checkpoint")
        sd = {k: io.BytesIO() for k in keys}
        self._load(sd)
        return sd

    def _load(self, sd: dict) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            dcp.load(sd, storage_reader=self.storage, planner=_ObjectPlanner(self), no_dist=True)
        except UCPError:
            raise
        # (CheckpointException, which wraps a failed read such as a truncated .distcp file, is a
        # BaseException, not an Exception)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - say which key and files
            files = sorted({str(self.dir / v.relative_path)
                            for k, v in self.metadata.storage_data.items() if k.fqn in sd})
            raise UCPError(f"{', '.join(files) or self.dir}: cannot read {list(sd)} "
                           f"({type(e).__name__}: {_first_line(e)}); the checkpoint files are "
                           "damaged or incomplete: restore them or convert another iteration") from e


def _first_line(e: BaseException) -> str:
    """A CheckpointException's text holds every failing rank's whole traceback: keep the first
    failure's exception ({rank: (exception, traceback)})."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        cause = next(iter(failures.values()))
        cause = cause[0] if isinstance(cause, tuple) else cause
        return f"{type(cause).__name__}: {cause}"
    return str(e)


class _ObjectPlanner(DefaultLoadPlanner):
    """torch.distributed.checkpoint's default load planner, except that stored objects (rng
    states, `_extra_state`, dp_reshardable param groups) go through the restricted unpickler."""

    def __init__(self, reader: DistReader):
        super().__init__()
        self.reader = reader

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn  # DistReader loads flat {key: BytesIO} dicts

        def load(weights_only: bool):
            value.seek(0)  # unpickle may retry (stand-ins for a newer megatron-core's enums)
            return torch.load(value, weights_only=weights_only)

        self.original_state_dict[key] = unpickle(load, f"{self.reader.dir} [{key}]",
                                                 self.reader.trust_pickle)
