"""The format contract: what a checkpoint source provides, what a format package declares.

A *source* (`Source`) is one opened checkpoint read as universal tensors: every parameter's full
fp32 master weight and Adam moments, boxed on demand, plus the run state in its `manifest`. Every
reader subclasses `Source`, so the optional members below exist on every source with a declared
default; callers use them without probing (`hasattr` / `getattr`).

A *format package* (`megatron_ucp.formats.<package>`) is described by its registry entry
(`FormatInfo`, in `formats.FORMATS`: the only list of formats; the CLI and the conversions derive
their choices from it) and provides the members that entry declares (`FormatPackage`;
`check_package` is the test of it). No format package imports another: conventions several
formats share live in shared modules (`megatron_common`, `tensor_transforms`, `manifest`).

Every writer reads back what it wrote before its commit (`storage.staged_dir(..., check=...)`);
`not_committed` is the error of that check, `check_same_params` the part all writers share.

This module imports neither torch nor megatron-core: the CLI builds its parser from the registry
without them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from megatron_ucp.errors import UCPError

if TYPE_CHECKING:
    import argparse

    import torch

    from megatron_ucp.formats.manifest import Manifest
    from megatron_ucp.layout import Layout


HF_FILES = "hf_files"  # a universal checkpoint's copies of its HF model's files (`formats.hf.files`)


class Source:
    """A checkpoint read as universal tensors (the base class of every reader).

    Required, set by every reader:
      format: its registry name (class attribute, = its package's NAME)
      manifest: run state, every parameter's spec (`ParamSpec`) and Adam step
      dir: where it was read from (a local path or a store prefix)
      origin: {"kind": ..., "path": ...}: what it was converted from (kept in written manifests)
      bytes_read: bytes read from its files so far
      read(name, state, offset, shape): a box of a full fp32 tensor
      step(name): the Adam step of a parameter
      rng_ranks(): ranks whose generator states it holds (may be empty)

    Optional, with the default here:
      args: the Megatron-LM run args (Megatron-LM sources); None
      lora: a Megatron-Bridge LoRA checkpoint's adapters (`megatron_dist.bridge.lora.LoRAAdapters`), read
        merged into its base checkpoint; None
      read_into(...): `read` into a caller's buffer; through `read`
      read_order(names): the order reading is cheapest (front to back in its files); as given
      leading_runs(...): a whole tensor as byte runs of its files (copied, never decoded); None
      check_files(part, parts): check its data files against the manifest; nothing to check
      rng(rank): rank's generator states; only called for a rank of `rng_ranks()`
      hf_files(): {name: bytes} of the Hugging Face model files (tokenizer, configs) a universal
        checkpoint stores in `hf_files/` (`formats.hf.files`); {}
      te_states(): Transformer Engine FP8 state by universal module name
        (`decoder.layers.3.self_attention.linear_proj._extra_state` -> `te_state.ModuleState`); the
        manifest's `te_state` (megatron-ucp's forms), {} where it has none; Megatron-LM sources
        decode their `_extra_state` entries
    Optional without a default (declared by the sources that have them): `verify()` (megatron-ucp
    formats: every checksum), `files_opened`, `requests` and `planning_copy(reader)` (sources
    reading safetensors files through `storage.ReadsFiles`, whose reads can be planned).
    """

    format: ClassVar[str]
    manifest: Manifest
    dir: Path | Any  # a `storage.Location`
    origin: dict
    bytes_read: int
    args: argparse.Namespace | None = None
    lora: Any = None

    def read(self, name: str, state: str, offset: tuple[int, ...],
             shape: tuple[int, ...]) -> torch.Tensor:
        raise NotImplementedError

    def step(self, name: str) -> float:
        raise NotImplementedError

    def rng_ranks(self) -> Sequence[int]:
        raise NotImplementedError

    def rng(self, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
        raise NotImplementedError(f"{type(self).__name__} holds no generator states")

    def read_into(self, name: str, state: str, offset: tuple[int, ...], shape: tuple[int, ...],
                  out: torch.Tensor) -> None:
        """Box [offset, offset + shape) into `out` (contiguous fp32 of that shape)."""
        out.copy_(self.read(name, state, offset, shape))

    def read_order(self, names: list[str]) -> list[str]:
        return names

    def leading_runs(self, name: str, state: str, shape: tuple[int, ...]) -> Any:
        return None

    def check_files(self, part: int = 0, parts: int = 1) -> None:
        return None

    def hf_files(self) -> dict[str, bytes]:
        return {}

    def te_states(self) -> dict[str, Any]:
        field = getattr(self.manifest, "te_state", None)
        if not field:
            return {}
        from megatron_ucp import te_state
        from megatron_ucp.storage import Reader

        return te_state.read(Reader(), self.dir, field, list(field["modules"]))


@dataclass(frozen=True)
class RunFields:
    """What a Megatron-LM writer takes from a Megatron-LM source run (`run_fields`)."""

    args: argparse.Namespace  # the run's args: the target's template
    layout: Layout  # the layout it was saved at
    # the per-rank `rng_state` lists: by rank directory name (torch) or (PP rank, TP rank)
    rng_state: dict | None
    rng_by_position: dict | None  # {(PP rank, TP rank): rng_state list}
    num_floating_point_operations_so_far: float | None


@dataclass(frozen=True)
class FormatInfo:
    """A format's registry entry: its name and what its package provides, declared once.

    own: megatron-ucp's own format (its manifest.json names it): opened with `from_manifest`,
        never detected; else the package has `detect` and `open_source`.
    target: the `reshard --target-format` spelling where reshard writes it (its package's `write`
        takes `write(source, out, target_layout, args_template, **options)`; universal's
        `write(source, out, **options)`).
    writes: its package has a `write` (a reshard target, or another writer such as `hf.write`).
    run_args: its checkpoints hold the Megatron-LM run args: a source for the Megatron-LM
        targets (its package has `run_fields`), and as a target it needs them.
    import_command: the CLI command that converts it to universal (`import-<...>`).
    """

    name: str
    package: str
    own: bool = False
    target: str | None = None
    writes: bool = False
    run_args: bool = False
    import_command: str | None = None

    def __post_init__(self) -> None:
        if self.target is not None and not self.writes:
            raise ValueError(f"format {self.name}: a reshard target writes")


class FormatPackage(Protocol):
    """A format package's members (a module; `check_package` checks one against its entry)."""

    NAME: str
    SOURCES: tuple[type[Source], ...]  # the reader classes its sources are

    # not own: detect(path) -> bool, open_source(path, **options) -> Source
    # own: from_manifest(ckpt, manifest, **options) -> Source
    # writes: write(source, out, ...) -> Path
    # run_args: run_fields(load, trust_pickle=False) -> RunFields


def check_package(info: FormatInfo, package: ModuleType) -> list[str]:
    """What `package` lacks, or has undeclared, against its registry entry `info` (empty: it
    satisfies the contract)."""
    problems = []
    if getattr(package, "NAME", None) != info.name:
        problems.append(f"NAME is {getattr(package, 'NAME', None)!r}, registered as {info.name!r}")
    sources = getattr(package, "SOURCES", ())
    if not sources:
        problems.append("no SOURCES")
    for cls in sources:
        if not (isinstance(cls, type) and issubclass(cls, Source)):
            problems.append(f"{cls!r} is not a formats.base.Source")
        elif getattr(cls, "format", None) != info.name:
            problems.append(f"{cls.__name__}.format is {getattr(cls, 'format', None)!r}")
    wanted = {"from_manifest": info.own, "detect": not info.own, "open_source": not info.own,
              "write": info.writes, "run_fields": info.run_args}
    for member, declared in wanted.items():
        has = callable(getattr(package, member, None))
        if has != declared:
            problems.append(f"{member}: {'declared, missing' if declared else 'present, undeclared'}")
    return problems


def not_committed(out: Path, what: str) -> UCPError:
    """The error of a writer whose read-back check of `out` (before the commit) failed."""
    return UCPError(f"{out}: internal error, the written checkpoint {what}; nothing was committed. "
                    "Please report it with the source checkpoint's manifest")


def check_same_params(out: Path, have: Iterable[str], want: Iterable[str]) -> None:
    """A written checkpoint holds exactly the source's parameters (`not_committed` otherwise)."""
    have, want = set(have), set(want)
    missing, extra = sorted(want - have), sorted(have - want)
    if missing or extra:
        raise not_committed(out, f"lacks parameter(s) {missing[:3]} / has unexpected {extra[:3]}")
