"""The manifest of megatron-ucp's own formats (`fragments`, `universal`): the schema.

One JSON file, `manifest.json`, makes a directory a checkpoint. It is written last, so a save that
died half-way is never loaded. Both kinds carry the same top-level fields; the per-parameter
storage differs: `fragments` (written by `save`) indexes which rank file holds which range of
each saved slice (`slices`), `universal` (written by conversions) names the file and key of each
state's full tensor (`tensors`). docs/FORMAT.md is the specification; the dataclasses below
are its only reader and writer, and `from_json` refuses what the specification does not allow.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import NamedTuple

from megatron_ucp import storage, te_state
from megatron_ucp.errors import UCPError
from megatron_ucp.gc_pause import paused_gc
from megatron_ucp.layout import Layout
from megatron_ucp.spec import OPTIMIZER_FAMILIES, STATES, ParamSpec, Piece, cover_once_cheap, states_of
from megatron_ucp.storage import Location, location
from megatron_ucp.storage.save_root import NotACheckpoint

FORMAT = "megatron-ucp"
# 5: `weights_only` (universal: the weights alone, no optimizer state; written as 5 only then);
# 4: `te_state` (written as 4 only when present, else 3); 3: the manifest indexes every fragment;
# 2: fragment pieces carry strides; 1: blocks of rows. All are still read.
VERSION = 5
MANIFEST = "manifest.json"
KINDS = ("fragments", "universal")


# ----------------------------------------------------------------------------------- validation


class _Check:
    """Type checks for one JSON object; errors name the manifest file and the field's path."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, path: str, problem: str) -> UCPError:
        return UCPError(f"{self.where}: {path}: {problem}; the manifest is damaged or from an "
                        "incompatible writer: restore it or load another iteration")

    def obj(self, d, path: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
        if not isinstance(d, dict):
            raise self.fail(path, f"expected an object, got {type(d).__name__}")
        missing = [k for k in required if k not in d]
        if missing:
            raise self.fail(path, f"required field(s) {missing} missing")
        unknown = sorted(set(d) - set(required) - set(optional))
        if unknown:
            raise self.fail(path, f"unknown field(s) {unknown} (this megatron-ucp reads format "
                                  f"version {VERSION}; a newer writer must raise the version)")
        return d

    def typed(self, v, path: str, types: type | tuple, none: bool = False):
        if (v is None and none) or (isinstance(v, types) and not (isinstance(v, bool)
                                                                    and bool not in _tuple(types))):
            return v
        raise self.fail(path, f"expected {_names(types)}{' or null' if none else ''}, got {v!r}")

    def ints(self, v, path: str, n: int | None = None) -> list[int]:
        if not isinstance(v, list) or (n is not None and len(v) != n) or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
            raise self.fail(path, f"expected a list of {n or ''} non-negative integers, got {v!r}")
        return v

    def choice(self, v, path: str, choices: tuple[str, ...]) -> str:
        if not isinstance(v, str) or v not in choices:
            raise self.fail(path, f"{v!r} is not {', '.join(choices[:-1])} or {choices[-1]}")
        return v

    def name(self, v, path: str) -> str:
        self.typed(v, path, str)
        if not v or "/" in v or "\\" in v or ".." in v or v.startswith("."):
            raise self.fail(path, f"{v!r} is not a plain name (no '/', '..' or leading '.')")
        return v


def _tuple(t) -> tuple:
    return t if isinstance(t, tuple) else (t,)


def _names(types) -> str:
    return " or ".join(t.__name__ for t in _tuple(types))


# ------------------------------------------------------------------------------------- entries


@dataclass(slots=True)
class TensorEntry:
    """universal: where one state's full tensor is (a safetensors file and key) and its crc32."""

    file: str
    key: str
    crc32: int

    def to_json(self) -> dict:
        return {"file": self.file, "key": self.key, "crc32": self.crc32}


class FragmentEntry(NamedTuple):
    """fragments: elements [start, end) of a saved slice are in file `files[file]`."""

    file: int
    start: int
    end: int

    def to_json(self) -> list:
        return list(self)


@dataclass(slots=True)
class SliceEntry:
    """fragments: one saved local tensor (a TP slice) of a parameter, the pieces that place it in
    the universal tensor, and the fragments that hold its flattened elements in order."""

    local_shape: tuple[int, ...]
    pieces: list[Piece]
    fragments: list[FragmentEntry]

    def to_json(self) -> dict:
        return {"local_shape": list(self.local_shape), "pieces": [p.to_json() for p in self.pieces],
                "fragments": [list(f) for f in self.fragments]}


_SPEC_REQUIRED = ("name", "shape", "dtype", "tp_axis")
_SPEC_OPTIONAL = ("tp_blocks", "aliases", "vocab_rows", "buffer", "tp_sections", "optimizer")


@dataclass
class ParamEntry:
    """One universal tensor: its layout-free spec, its Adam step and where its bytes are."""

    spec: ParamSpec
    step: float | None = None  # None only in fragment manifests of versions 1 and 2
    tensors: dict[str, TensorEntry] | None = None  # universal
    # fragments, version 3: the slice entries as JSON, as written; `slices` parses them
    slices_json: list | None = None
    # how `slices` checks them: (the manifest's checker, number of rank files); None: entries
    # built by the save itself (`build_index`), which checks their tiling before anything is
    # committed
    parse_check: tuple[_Check, int] | None = field(default=None, repr=False, compare=False)
    _slices: list[SliceEntry] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def slices(self) -> list[SliceEntry] | None:
        """The saved slices (fragments, version 3), parsed and checked on first use: a load reads
        a few of the thousands of tensors an index holds (the fragment source checks in bulk
        that every tensor's fragments tile its slices when it opens the checkpoint)."""
        if self._slices is None and self.slices_json is not None:
            if self.parse_check is None:
                self._slices = [SliceEntry(tuple(s["local_shape"]), [Piece.from_json(p) for p in s["pieces"]],
                                           [FragmentEntry(*f) for f in s["fragments"]])
                                for s in self.slices_json]
            else:
                check, n_files = self.parse_check
                self._slices = [_slice_from_json(s, n_files, check, f"params[{self.name!r}].slices[{i}]",
                                                 self.name) for i, s in enumerate(self.slices_json)]
        return self._slices

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.spec.shape

    @property
    def states(self) -> tuple[str, ...]:
        return states_of(self.spec)

    def to_json(self) -> dict:
        # (`ParamSpec.to_json` without dataclasses.asdict's deep copy: 20k specs in an index)
        d = ParamSpec.omit_defaults({**vars(self.spec), "shape": list(self.spec.shape),
                                     "aliases": list(self.spec.aliases)})
        if self.step is not None:
            d["step"] = self.step
        if self.tensors is not None:
            d["tensors"] = {s: t.to_json() for s, t in self.tensors.items()}
        if self.slices_json is not None:
            d["slices"] = self.slices_json
        return d

    @classmethod
    def from_json(cls, d, kind: str, n_files: int, check: _Check, path: str,
                  weights_only: bool = False) -> ParamEntry:
        """weights_only: a weights-only universal manifest's entry (its `param` alone, step 0)."""
        if kind == "fragments" and _plain_fragment_entry(d):  # the common case, checked in one go
            spec = ParamSpec(d["name"], tuple(d["shape"]), d["dtype"], d["tp_axis"], d.get("tp_blocks", 1),
                             list(d.get("aliases", [])), d.get("vocab_rows", False), d.get("buffer", False),
                             d.get("tp_sections"), d.get("optimizer", "adam"))
            return cls(spec, d.get("step"), slices_json=d.get("slices"), parse_check=(check, n_files))
        storage = ("tensors",) if kind == "universal" else ("slices",)
        check.obj(d, path, _SPEC_REQUIRED + (("step",) + storage if kind == "universal" else ()),
                  _SPEC_OPTIONAL + ("step",) + storage)
        check.name(d["name"], f"{path}.name")
        shape = check.ints(d["shape"], f"{path}.shape")
        check.choice(d["dtype"], f"{path}.dtype", _DTYPES)
        tp_axis = check.typed(d["tp_axis"], f"{path}.tp_axis", int, none=True)
        if tp_axis is not None and not 0 <= tp_axis < len(shape):
            raise check.fail(f"{path}.tp_axis", f"{tp_axis} is not a dimension of shape {shape}")
        blocks = check.typed(d.get("tp_blocks", 1), f"{path}.tp_blocks", int)
        aliases = d.get("aliases", [])
        for i, a in enumerate(check.typed(aliases, f"{path}.aliases", list)):
            check.typed(a, f"{path}.aliases[{i}]", str)
        spec = ParamSpec(d["name"], tuple(shape), d["dtype"], tp_axis, blocks, list(aliases),
                         check.typed(d.get("vocab_rows", False), f"{path}.vocab_rows", bool),
                         check.typed(d.get("buffer", False), f"{path}.buffer", bool),
                         _sections(d.get("tp_sections"), shape, tp_axis, blocks, check,
                                   f"{path}.tp_sections"),
                         check.choice(d.get("optimizer", "adam"), f"{path}.optimizer", OPTIMIZER_FAMILIES))
        step = d.get("step")
        if step is not None:
            step = check.typed(step, f"{path}.step", (int, float))
        if weights_only and step != 0:  # (no optimizer state: nothing has stepped)
            raise check.fail(f"{path}.step", f"{step} in a weights-only checkpoint, whose steps are 0")
        entry = cls(spec, step)
        if "tensors" in d:
            check.obj(d["tensors"], f"{path}.tensors", ("param",) if weights_only else states_of(spec))
            entry.tensors = {}
            for s, t in d["tensors"].items():
                check.obj(t, f"{path}.tensors.{s}", ("file", "key", "crc32"))
                entry.tensors[s] = TensorEntry(check.name(t["file"], f"{path}.tensors.{s}.file"),
                                               check.typed(t["key"], f"{path}.tensors.{s}.key", str),
                                               check.typed(t["crc32"], f"{path}.tensors.{s}.crc32", int))
                if t["key"] != f"{spec.name}/{s}":  # the key names the tensor: no other's bytes
                    raise check.fail(f"{path}.tensors.{s}.key", f"{t['key']!r} is not "
                                     f"'{spec.name}/{s}'")
        if "slices" in d:  # parsed when used (`slices`)
            entry.slices_json = check.typed(d["slices"], f"{path}.slices", list)
            entry.parse_check = (check, n_files)
        return entry


_FRAGMENT_ENTRY_FIELDS = frozenset(_SPEC_REQUIRED + _SPEC_OPTIONAL + ("step", "slices"))
_DTYPES = ("float32", "bfloat16", "float16")


def _plain_fragment_entry(d) -> bool:
    """Whether `d` is a valid fragments param entry, in one expression (an index at thousands of
    ranks has tens of thousands); False sends it through the field-by-field checks, which name
    what is wrong. Its slices are checked when parsed (`ParamEntry.slices`)."""
    if type(d) is not dict or not d.keys() <= _FRAGMENT_ENTRY_FIELDS:
        return False
    name, shape, tp_axis = d.get("name"), d.get("shape"), d.get("tp_axis", False)
    step, aliases = d.get("step", 0), d.get("aliases", [])
    return (type(name) is str and name != "" and "/" not in name and "\\" not in name
            and ".." not in name and name[0] != "."
            and type(shape) is list and all(type(n) is int and n >= 0 for n in shape)
            and type(d.get("dtype")) is str and d["dtype"] in _DTYPES
            and (tp_axis is None or (type(tp_axis) is int and 0 <= tp_axis < len(shape)))
            and type(d.get("tp_blocks", 1)) is int
            and type(aliases) is list and all(type(a) is str for a in aliases)
            and type(d.get("vocab_rows", False)) is bool and type(d.get("buffer", False)) is bool
            and d.get("tp_sections") is None and d.get("optimizer", "adam") in OPTIMIZER_FAMILIES
            and type(step) in (int, float) and type(d.get("slices", [])) is list)


def _sections(sections, shape: list[int], tp_axis: int | None, blocks: int, check: _Check,
              path: str) -> list[int] | None:
    """tp_sections: None, or tp_blocks positive sizes that add up to the TP axis."""
    if sections is None:
        return None
    sizes = check.ints(sections, path)
    if tp_axis is None or len(sizes) != blocks or sum(sizes) != shape[tp_axis] or 0 in sizes:
        raise check.fail(path, f"{sizes} are not {blocks} sections of dim {tp_axis} of shape {shape}")
    return list(sizes)


def _slice_from_json(d, n_files: int, check: _Check, path: str, name: str) -> SliceEntry:
    # (parsed when its tensor is first read: `ParamEntry.slices`)
    if type(d) is not dict or len(d) != 3:
        check.obj(d, path, ("local_shape", "pieces", "fragments"))
    try:
        local = tuple(d["local_shape"])
        size = math.prod(local)
        pieces = [Piece(p[0], tuple(p[1]), tuple(p[2]), tuple(p[3])) for p in d["pieces"]]
        if any(len(p) != 4 for p in d["pieces"]):
            raise ValueError("a piece is not [start, offset, shape, strides]")
        frags = [FragmentEntry(*f) for f in d["fragments"]]
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise check.fail(path, f"malformed slice entry ({type(e).__name__}: {e}); expected "
                         "{local_shape: [int], pieces: [[start, offset, shape, strides]], "
                         "fragments: [[file, start, end]]}") from e
    # the common case first (every number a non-negative int, not a bool, a float or a string;
    # every piece and fragment inside the local tensor); only a failure pays for finding the entry
    ints = _nonneg_ints(chain(local, *((pc.start, *pc.offset, *pc.shape, *pc.strides) for pc in pieces),
                              chain.from_iterable(frags)))
    if ints and all(f.file < n_files and f.start < f.end <= size for f in frags):
        # each piece a one-to-one view, together exactly the local tensor (pieces that
        # interleave are checked element by element when the slice is first read)
        if cover_once_cheap(pieces, size):
            return SliceEntry(local, pieces, frags)
        raise check.fail(f"{path}.pieces", f"{[pc.to_json() for pc in pieces]} do not cover the "
                         f"local shape {list(local)} exactly once")
    if not _nonneg_ints(local):
        raise check.fail(f"{path}.local_shape", f"expected non-negative integers, got {list(local)}")
    for i, pc in enumerate(pieces):
        n = len(pc.shape)
        if not (len(pc.offset) == n == len(pc.strides) and _nonneg_ints((pc.start, *pc.offset,
                                                                        *pc.shape, *pc.strides))
                and pc.span((0,) * n, pc.shape)[1] < size):
            raise check.fail(f"{path}.pieces[{i}]", f"{pc.to_json()} is not [start, offset, "
                             f"shape, strides] inside the local shape {list(local)}")
    for i, (file, start, end) in enumerate(frags):
        if not (_nonneg_ints((file, start, end)) and file < n_files and start < end <= size):
            raise check.fail(f"parameter {name}", f"bad fragment entry {[file, start, end]} at "
                             f"{path}.fragments[{i}] (expected [file index < {n_files}, start, "
                             "end] inside the local shape)")
    raise check.fail(path, "malformed slice entry")


def _nonneg_ints(values) -> bool:
    return all(type(x) is int and x >= 0 for x in values)


# ------------------------------------------------------------------------------------ manifest

_REQUIRED = ("format", "version", "kind", "iteration", "layout", "layout_world_size", "model",
             "params", "optimizer", "scheduler", "extra", "seed")
_OPTIONAL = {"fragments": ("files", "bytes", "te_state"),
             "universal": ("converted_from", "te_state", "weights_only")}


@dataclass
class Manifest:
    kind: str  # "fragments" | "universal"
    iteration: int
    layout: Layout  # the saving run's layout
    layout_world_size: int  # ranks of the saving run (= rank files of a fragment checkpoint)
    model: dict  # TransformerConfig fields (`validation.model_config`), GPT fields; `unpadded_vocab_size`
    params: dict[str, ParamEntry]
    optimizer: dict  # {"param_groups": [...], "grad_scaler": {...} | None}
    scheduler: dict | None  # OptimizerParamScheduler.state_dict()
    extra: dict = field(default_factory=dict)  # the caller's JSON training state
    seed: int = 1234
    files: list[str] | None = None  # fragments: the rank files, by index
    bytes: int | None = None  # fragments: bytes of all rank files
    converted_from: dict | None = None  # universal: {"kind": ..., "path": ..., ...}
    version: int = VERSION
    te_state: dict | None = None  # Transformer Engine FP8 state (`te_state.write`), if any
    weights_only: bool = False  # universal: each `param` alone, in its `dtype` (a load starts fresh)

    @classmethod
    def fragments(cls, *, iteration: int, layout: Layout, world_size: int, model: dict,
                  optimizer: dict, scheduler: dict | None, extra: dict, seed: int) -> Manifest:
        """What `save` commits, before its params (the fragment index) are known."""
        return cls("fragments", iteration, layout, world_size, model, {}, optimizer, scheduler,
                   extra, seed, files=[f"rank_{r:05d}.safetensors" for r in range(world_size)])

    @classmethod
    def universal(cls, header: Manifest, params: dict[str, ParamEntry],
                  converted_from: dict) -> Manifest:
        """A universal manifest with the run state of `header` (any source's manifest)."""
        return cls("universal", header.iteration, header.layout, header.layout_world_size,
                   header.model, params, header.optimizer, header.scheduler, header.extra,
                   header.seed, converted_from=converted_from, te_state=header.te_state,
                   weights_only=header.weights_only)

    @property
    def true_vocab(self) -> int | None:
        return self.model.get("unpadded_vocab_size")

    def to_json(self) -> dict:
        # the lowest version that has every field written, so older readers read what they can
        v = 5 if self.weights_only else min(self.version, 4 if self.te_state else 3)
        d = {"format": FORMAT, "version": v, "kind": self.kind, "iteration": self.iteration,
             "layout": self.layout.to_json(), "layout_world_size": self.layout_world_size,
             "model": self.model, "params": {n: p.to_json() for n, p in self.params.items()},
             "optimizer": self.optimizer, "scheduler": self.scheduler, "extra": self.extra,
             "seed": self.seed}
        for k in _OPTIONAL[self.kind]:
            if getattr(self, k) is not None and (k != "weights_only" or self.weights_only):
                d[k] = getattr(self, k)
        return d

    @classmethod
    def from_json(cls, d, where: str) -> Manifest:
        check = _Check(where)
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            found = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise UCPError(f"{where}: not a {FORMAT} manifest (format {found!r}); restore the file "
                           "or pass a checkpoint written by megatron_ucp.save or `megatron-ucp convert`")
        version = check.typed(d.get("version"), "version", int)
        if version > VERSION:
            raise UCPError(f"{where}: format version {version} is newer than this megatron-ucp "
                           f"understands ({VERSION}); upgrade megatron-ucp")
        if version < 1:
            raise check.fail("version", f"{version} is not a format version")
        if d.get("kind") not in KINDS:
            raise UCPError(f"{where}: unknown checkpoint kind {d.get('kind')!r} (expected one of "
                           f"{list(KINDS)}); the manifest is damaged: restore it or load another "
                           "iteration")
        kind = d["kind"]
        check.obj(d, "manifest", _REQUIRED, _OPTIONAL[kind])
        layout = check.obj(d["layout"], "layout", (), tuple(f.name for f in
                                                              Layout.__dataclass_fields__.values()))
        for k, v in layout.items():
            check.typed(v, f"layout.{k}", int, none=k == "vpp")
            if v is not None and v < 1:
                raise check.fail(f"layout.{k}", f"{v} is not a parallel size")
        world = check.typed(d["layout_world_size"], "layout_world_size", int)
        sizes = Layout(**layout)
        if sizes.world_size != world:  # rank files and RNG states are found by saving rank
            raise check.fail("layout", f"{sizes} is {sizes.world_size} ranks but layout_world_size "
                             f"is {world}")
        files = d.get("files")
        if files is not None:
            for i, f in enumerate(check.typed(files, "files", list)):
                check.name(f, f"files[{i}]")
            if len(files) != world:
                raise check.fail("files", f"{len(files)} rank files for layout_world_size {world}")
        n_files = len(files) if files is not None else world  # default: rank_XXXXX per rank
        weights_only = check.typed(d.get("weights_only", False), "weights_only", bool)
        if weights_only and version < 5:
            raise check.fail("weights_only", f"is a field of format version 5, the manifest says {version}")
        params = {}
        for name, p in check.typed(d["params"], "params", dict).items():
            entry = ParamEntry.from_json(p, kind, n_files, check, f"params[{name!r}]", weights_only)
            if entry.name != name:
                raise check.fail(f"params[{name!r}].name", f"{entry.name!r} differs from its key")
            params[name] = entry
        optimizer = check.obj(d["optimizer"], "optimizer", ("param_groups",), ("grad_scaler", "optimizers"))
        for i, g in enumerate(check.typed(optimizer["param_groups"], "optimizer.param_groups", list)):
            check.typed(g, f"optimizer.param_groups[{i}]", dict)
        for i, o in enumerate(check.typed(optimizer.get("optimizers", []), "optimizer.optimizers", list)):
            check.obj(o, f"optimizer.optimizers[{i}]", ("class", "family"), ("hyperparameters", "note"))
        return cls(kind, check.typed(d["iteration"], "iteration", int), sizes, world,
                   check.typed(d["model"], "model", dict), params, optimizer,
                   check.typed(d["scheduler"], "scheduler", dict, none=True),
                   check.typed(d["extra"], "extra", dict), check.typed(d["seed"], "seed", int),
                   files, check.typed(d.get("bytes"), "bytes", int, none=True),
                   check.typed(d.get("converted_from"), "converted_from", dict, none=True), version,
                   None if d.get("te_state") is None else te_state.check_field(d["te_state"], check, version),
                   weights_only)


def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


# `extra` flag of an imported checkpoint without optimizer hyper-parameters (its param_groups are
# []): a load keeps the run's own groups and LR schedule instead of refusing
RUN_HYPERPARAMETERS = "run_hyperparameters"


def resolve(path: str | Path | Location) -> Location:
    """A checkpoint directory itself, or a save root whose `latest` names one (local or a URL):
    the save-root protocol (`storage.save_root`) with this format's marker."""
    return storage.resolve(path, MANIFEST)


def is_checkpoint(path: str | Path | Location) -> bool:
    """A megatron-ucp checkpoint directory or save root (it may still fail to resolve)."""
    return storage.is_checkpoint(path, MANIFEST)


def read(ckpt_dir: Location) -> Manifest:
    path = location(ckpt_dir) / MANIFEST
    try:
        with paused_gc():  # a fragment index is millions of small lists
            return Manifest.from_json(json.loads(path.read_text()), str(path))
    except (OSError, json.JSONDecodeError, RecursionError) as e:
        raise UCPError(f"{path}: cannot read the manifest ({e}); the checkpoint is damaged: "
                       "restore the file or load another iteration") from e


def read_checkpoint(path: str | Path) -> tuple[Location, Manifest]:
    """(checkpoint directory, its manifest) for a checkpoint directory or a save root."""
    return (ckpt := resolve(path)), read(ckpt)


def encode(manifest: Manifest) -> str:
    """Compact JSON: a fragment index at thousands of ranks is tens of MB (`python -m json.tool`
    or `megatron-ucp inspect` show it readably). The manifest is a tree, so the encoder's cycle
    bookkeeping (a fifth of its time) is skipped: a cyclic `extra` fails as RecursionError."""
    with paused_gc():
        return json.dumps(manifest.to_json(), sort_keys=True, separators=(",", ":"), check_circular=False)


def write(ckpt_dir: Location, manifest: Manifest) -> None:
    """The commit of a checkpoint: its manifest, published last (in a store a create-only put,
    after every data object; locally an atomic write into the staged directory)."""
    storage.publish(location(ckpt_dir) / MANIFEST, encode(manifest).encode())


__all__ = ["FORMAT", "VERSION", "MANIFEST", "STATES", "Manifest", "ParamEntry", "SliceEntry", "FragmentEntry",
           "TensorEntry", "read", "write", "resolve", "is_checkpoint", "NotACheckpoint", "encode",
           "iteration_dir_name"]
