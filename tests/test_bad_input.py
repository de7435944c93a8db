"""The bad-input table: every damaged or wrong input ends in a UCPError that names the file, the
tensor or parameter (where there is one) and what to do; none loads silently.

One row per corruption (`CASES`): which checkpoint it starts from (a private copy of it), the
corruption, the call that must fail, and the substrings its message must contain. The bases are a
real TP2 fragment checkpoint (shared with the other modules through `source_runs`), its universal
conversion, and Megatron-LM fixtures; readers run in-process (no process group) except the one
load of another model's checkpoint, which needs ranks. `pytest -v` lists the rows by id.
Reader checks that need a live model (layout, model config, parameter sets) are in test_errors.py.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import megatron_ucp as ucp
from megatron_ucp import UCPError
from megatron_ucp.checks import verify
from megatron_ucp.conversion import convert, reshard
from megatron_ucp.formats import open_source
from megatron_ucp.layout import Layout
from megatron_ucp.testing.launch import LaunchError, launch

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "megatron_lm"
LN = "decoder.final_layernorm.weight"  # [64], replicated: saved whole by TP rank 0 (rank_00000)
PROJ = "decoder.layers.0.self_attention.linear_proj.weight"  # split over TP (one slice per rank)
HIDDEN = 64


# ------------------------------------------------------------------------------ checkpoints


@dataclass
class Ckpt:
    """A private copy of a base checkpoint: what the call gets (`root`) and its files."""

    root: Path  # passed to the reader: a save root, a universal directory, a Megatron-LM save root
    dir: Path  # the directory holding the files (the iteration directory of a save root)
    data: Path  # the data file holding LN (rank_00000 / params_00000 / Megatron-LM rank 0 file)
    out: Path  # a fresh output path for conversions

    @property
    def manifest(self) -> Path:
        return self.dir / "manifest.json"

    def expand(self, text: str) -> str:
        for key in ("root", "dir", "data", "manifest", "out"):
            text = text.replace(f"<{key}>", str(getattr(self, key)))
        return text


class Bases:
    """The base checkpoints, made on first use (a row that needs none launches nothing)."""

    def __init__(self, source_runs, tmp: Path):
        self.source_runs, self.tmp = source_runs, tmp
        self.made: dict[str, Path] = {}

    def path(self, base: str) -> Path:
        if base not in self.made:
            if base == "fragments":
                self.made[base] = self.source_runs.get("tp2", {"dtype": "fp32"})["ckpt"]
            elif base == "universal":
                self.made[base] = convert(self.path("fragments"), self.tmp / "universal", progress=False)
            else:
                self.made[base] = FIXTURES / base / "ckpt"
        return self.made[base]

    def copy(self, base: str, tmp_path: Path) -> Ckpt:
        out = tmp_path / "out"
        if base == "none":
            return Ckpt(tmp_path, tmp_path, tmp_path / "file", out)
        root = Path(shutil.copytree(self.path(base), tmp_path / "ckpt"))
        if base == "fragments":
            d = root / (root / "latest").read_text().strip()
            return Ckpt(root, d, d / "rank_00000.safetensors", out)
        if base == "universal":
            return Ckpt(root, root, root / "params_00000.safetensors", out)
        d = next(root.glob("iter_*"))  # Megatron-LM
        data = d / "mp_rank_00" / "model_optim_rng.pt" if (d / "mp_rank_00").exists() else d / "__0_0.distcp"
        return Ckpt(root, d, data, out)


@pytest.fixture(scope="module")
def bases(source_runs, tmp_path_factory) -> Bases:
    return Bases(source_runs, tmp_path_factory.mktemp("bad_input"))


# ------------------------------------------------------------------------------ corruptions


def header(path: Path) -> tuple[int, dict]:
    """(length, JSON) of a safetensors header: 8-byte LE length, then that many bytes of JSON."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return n, json.loads(f.read(n))


def rewrite_header(path: Path, fn: Callable[[dict], None]) -> None:
    """Edit the JSON header in place (re-padded to 8 bytes); the data bytes stay as they are."""
    n, h = header(path)
    data = path.read_bytes()[8 + n:]
    fn(h)
    raw = json.dumps(h).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def edit_records(path: Path, fn: Callable[[list], None]) -> None:
    """Edit the `fragments` records in a rank file's header metadata."""
    def edit(h: dict) -> None:
        records = json.loads(h["__metadata__"]["fragments"])
        fn(records)
        h["__metadata__"]["fragments"] = json.dumps(records)

    rewrite_header(path, edit)


def record(records: list, name: str = LN) -> dict:
    return next(r for r in records if r["name"] == name)


def edit_manifest(ck: Ckpt, fn: Callable[[dict], None]) -> None:
    m = json.loads(ck.manifest.read_text())
    fn(m)
    ck.manifest.write_text(json.dumps(m))


def flip(path: Path, pos: int, n: int = 4, mask: int = 0xFF) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        old = f.read(n)
        f.seek(pos)
        f.write(bytes(b ^ mask for b in old))


def flip_tensor(ck: Ckpt, key: str) -> None:
    """Flip 4 bytes in the middle of tensor `key`'s data."""
    n, h = header(ck.data)
    begin, end = h[key]["data_offsets"]
    flip(ck.data, 8 + n + (begin + end) // 2)


def set_header_length(path: Path, n: int) -> None:
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", n))


def truncate_by(path: Path, n: int) -> None:
    os.truncate(path, path.stat().st_size - n)


def rename_param(m: dict, old: str, new: str) -> None:
    entry = m["params"].pop(old)
    entry["name"] = new
    m["params"][new] = entry


def torch_file(path: Path, fn: Callable[[dict], None]) -> None:
    """Rewrite a Megatron-LM .pt file (our own fixture copy: a full unpickle is safe here)."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    fn(state)
    torch.save(state, path)


def set_args(**changes) -> Callable[[dict], None]:
    def edit(state: dict) -> None:
        for k, v in changes.items():
            setattr(state["args"], k, v(getattr(state["args"], k)) if callable(v) else v)
    return edit


# ------------------------------------------------------------------------------ calls that must fail


def read_ln(ck: Ckpt) -> torch.Tensor:
    return open_source(ck.root).read(LN, "param", (0,), (HIDDEN,))


def verify_it(ck: Ckpt) -> str:
    return verify(ck.root)


def open_it(ck: Ckpt):
    return open_source(ck.root)


def convert_it(ck: Ckpt) -> Path:
    """A conversion that fails must leave no output behind."""
    try:
        return convert(ck.root, ck.out, progress=False)
    finally:
        assert not ck.out.exists(), f"{ck.out} was written by a failed conversion"


def reshard_it(ck: Ckpt) -> object:
    """A reshard to the universal form (at TP1) that fails must leave no output behind."""
    try:
        return reshard(ck.root, ck.out, Layout(tp=1), progress=False)
    finally:
        assert not ck.out.exists(), f"{ck.out} was written by a failed reshard"


def load_into_tiny_gpt(ck: Ckpt) -> None:
    """Load into megatron-core's default tiny GPT (1 rank); the rank's UCPError comes back in the
    launcher's log and is raised here again, as the rank raised it."""
    try:
        launch(1, "megatron_ucp.testing.scenarios:load_and_train",
               {"layout": "tp1", "cfg": {}, "load_dir": str(ck.root), "steps": 0}, timeout=300)
    except LaunchError as e:
        marker = "megatron_ucp.errors.UCPError: "
        lines = [line for line in str(e).splitlines() if marker in line]
        assert lines, str(e)[-3000:]
        raise UCPError(lines[-1].split(marker, 1)[1]) from e


# ------------------------------------------------------------------------------ the table


@dataclass(frozen=True)
class Case:
    id: str
    base: str  # "fragments", "universal", a Megatron-LM fixture name, or "none"
    what: str  # the corruption, for the printed table
    corrupt: Callable[[Ckpt], None]
    call: Callable[[Ckpt], object]  # must raise UCPError (never return data)
    expect: tuple[str, ...]  # message substrings; <data>, <dir>, ... are the copy's paths


CASES: list[Case] = []


def case(id: str, base: str, what: str, corrupt: Callable[[Ckpt], None],
         call: Callable[[Ckpt], object], *expect: str) -> None:
    CASES.append(Case(id, base, what, corrupt, call, expect))


def both(id: str, what: str, corrupt: Callable[[Ckpt], None], call: Callable[[Ckpt], object],
         fragments: tuple[str, ...], universal: tuple[str, ...] | None = None) -> None:
    """The same corruption of the fragment checkpoint and of its universal conversion."""
    case(f"fragments-{id}", "fragments", what, corrupt, call, *fragments)
    case(f"universal-{id}", "universal", what, corrupt, call, *(universal or fragments))


DAMAGED_FILE = "restore it or use another iteration"
DAMAGED_MANIFEST = ("the manifest is damaged or from an incompatible writer: restore it or load another "
                    "iteration")
DAMAGED_INDEX = "restore them or load another iteration"

# ---- safetensors files (rank files and universal data files)

both("truncated-data", "data file cut 4 bytes short (last tensor incomplete)",
     lambda ck: truncate_by(ck.data, 4), verify_it,
     ("<data>: not a readable safetensors file", "file not fully covered", DAMAGED_FILE))
both("truncated-header", "data file cut inside its JSON header",
     lambda ck: os.truncate(ck.data, 8 + 16), verify_it,
     ("<data>: not a readable safetensors file", "invalid header length", DAMAGED_FILE))
both("bitflip-data", "4 bytes of LN's exp_avg_sq inverted (crc32 no longer matches)",
     lambda ck: flip_tensor(ck, f"{LN}/exp_avg_sq"), verify_it,
     (f"<data>: checksum mismatch in tensor '{LN}/exp_avg_sq'", "restore it or load an earlier iteration"),
     (f"<data>: checksum mismatch in tensor '{LN}/exp_avg_sq'", "re-run `megatron-ucp convert`"))
both("bitflip-header", "one bit of the header's first byte flipped ('{' -> 'z')",
     lambda ck: flip(ck.data, 8, 1, 0x01), verify_it,
     ("<data>: not a readable safetensors file", "invalid JSON in header", DAMAGED_FILE))
both("huge-header-length", "header length field set to 2**62 (must not be allocated)",
     lambda ck: set_header_length(ck.data, 2**62), verify_it,
     ("<data>: not a readable safetensors file", "header too large", DAMAGED_FILE))
both("header-dtype", "header says I32 for LN/param (same width: same bytes, same crc32)",
     lambda ck: rewrite_header(ck.data, lambda h: h[f"{LN}/param"].update(dtype="I32")), read_ln,
     (f"<data>: tensor '{LN}/param' is I32 [64] in the file's header", "expects F32 [64]", DAMAGED_FILE))
both("header-shape", "header says [32, 2] for LN/param (same size: same bytes, same crc32)",
     lambda ck: rewrite_header(ck.data, lambda h: h[f"{LN}/param"].update(shape=[32, 2])), read_ln,
     (f"<data>: tensor '{LN}/param' is F32 [32, 2] in the file's header", "expects F32 [64]",
      DAMAGED_FILE))
both("header-key-dotdot", "header key LN/param renamed '../LN/param'",
     lambda ck: rewrite_header(ck.data, lambda h: h.__setitem__(f"../{LN}/param", h.pop(f"{LN}/param"))),
     read_ln, (f"<data>: cannot read tensor '{LN}/param'", DAMAGED_FILE))
both("header-key-absolute", "header key LN/param renamed '/abs/LN/param'",
     lambda ck: rewrite_header(ck.data, lambda h: h.__setitem__(f"/abs/{LN}/param", h.pop(f"{LN}/param"))),
     read_ln, (f"<data>: cannot read tensor '{LN}/param'", DAMAGED_FILE))
both("missing-data-file", "the data file holding LN deleted",
     lambda ck: ck.data.unlink(), verify_it,
     ("<data>: file is missing", "the checkpoint is incomplete, re-save it or point to another iteration"))

# ---- manifest.json

both("manifest-shape", "LN's shape edited [64] -> [32]",
     lambda ck: edit_manifest(ck, lambda m: m["params"][LN].update(shape=[32])),
     lambda ck: open_source(ck.root).read(LN, "param", (0,), (32,)),
     (f"<dir>: parameter {LN}: saved slices cover 64 of 32 elements", DAMAGED_INDEX),
     (f"<data>: tensor '{LN}/param' is F32 [64] in the file's header", "expects F32 [32]", DAMAGED_FILE))
both("manifest-dtype", "LN's dtype edited to 'float64'",
     lambda ck: edit_manifest(ck, lambda m: m["params"][LN].update(dtype="float64")), open_it,
     (f"<manifest>: params['{LN}'].dtype: 'float64' is not float32, bfloat16 or float16",
      DAMAGED_MANIFEST))
both("manifest-optimizer-family", "LN's optimizer family edited to 'adagrad' (no such family)",
     lambda ck: edit_manifest(ck, lambda m: m["params"][LN].update(optimizer="adagrad")), open_it,
     (f"<manifest>: params['{LN}'].optimizer: 'adagrad' is not adam, lion, sgd, plain_sgd or muon",
      DAMAGED_MANIFEST))
both("manifest-name-differs", "LN's `name` edited (its key kept)",
     lambda ck: edit_manifest(ck, lambda m: m["params"][LN].update(name="decoder.final_layernorm.scale")),
     open_it, (f"<manifest>: params['{LN}'].name: 'decoder.final_layernorm.scale' differs from its key",
               DAMAGED_MANIFEST),
     # (universal: the tensor keys, which name the tensor too, are checked first)
     (f"<manifest>: params['{LN}'].tensors.", "is not 'decoder.final_layernorm.scale/", DAMAGED_MANIFEST))
both("manifest-param-renamed", "LN renamed (key and name) to a parameter the files do not hold",
     lambda ck: edit_manifest(ck, lambda m: rename_param(m, LN, "decoder.final_layernorm.scale")),
     lambda ck: open_source(ck.root).read("decoder.final_layernorm.scale", "param", (0,), (HIDDEN,)),
     ("<data>: has no fragment of decoder.final_layernorm.scale at element 0",
      "restore this iteration's own file or load another iteration"),
     ("<manifest>: params['decoder.final_layernorm.scale'].tensors.", f"'{LN}/",
      "is not 'decoder.final_layernorm.scale/", DAMAGED_MANIFEST))
both("manifest-param-name-dotdot", "LN renamed '../LN'",
     lambda ck: edit_manifest(ck, lambda m: rename_param(m, LN, f"../{LN}")), open_it,
     (f"<manifest>: params['../{LN}'].name: '../{LN}' is not a plain name", DAMAGED_MANIFEST))
both("manifest-param-name-absolute", "LN renamed '/LN'",
     lambda ck: edit_manifest(ck, lambda m: rename_param(m, LN, f"/{LN}")), open_it,
     (f"<manifest>: params['/{LN}'].name: '/{LN}' is not a plain name", DAMAGED_MANIFEST))
both("manifest-layout-size", "layout.tp edited 2 -> 4 (no longer the saving run's ranks)",
     lambda ck: edit_manifest(ck, lambda m: m["layout"].update(tp=4)), open_it,
     ("<manifest>: layout: TP4xPP1xDP1 is 4 ranks but layout_world_size is 2", DAMAGED_MANIFEST))
both("manifest-layout-type", "layout.tp edited to the string '2'",
     lambda ck: edit_manifest(ck, lambda m: m["layout"].update(tp="2")), open_it,
     ("<manifest>: layout.tp: expected int, got '2'", DAMAGED_MANIFEST))
both("manifest-version-newer", "version edited 3 -> 6 (5 is the newest: weights_only)",
     lambda ck: edit_manifest(ck, lambda m: m.update(version=6)), open_it,
     ("<manifest>: format version 6 is newer than this megatron-ucp understands (5)",
      "upgrade megatron-ucp"))
both("manifest-version-zero", "version edited 3 -> 0",
     lambda ck: edit_manifest(ck, lambda m: m.update(version=0)), open_it,
     ("<manifest>: version: 0 is not a format version", DAMAGED_MANIFEST))
both("manifest-format", "format edited to 'megatron-xyz'",
     lambda ck: edit_manifest(ck, lambda m: m.update(format="megatron-xyz")), open_it,
     ("<manifest>: not a megatron-ucp manifest (format 'megatron-xyz')", "restore the file"))
both("manifest-unknown-field", "top-level field 'compression' added",
     lambda ck: edit_manifest(ck, lambda m: m.update(compression="zstd")), open_it,
     ("<manifest>: manifest: unknown field(s) ['compression']", "a newer writer must raise the version",
      DAMAGED_MANIFEST))
both("manifest-unknown-param-field", "field 'quantized' added to LN's entry",
     lambda ck: edit_manifest(ck, lambda m: m["params"][LN].update(quantized=True)), open_it,
     (f"<manifest>: params['{LN}']: unknown field(s) ['quantized']", DAMAGED_MANIFEST))
both("manifest-unknown-layout-field", "field 'sp' added to layout",
     lambda ck: edit_manifest(ck, lambda m: m["layout"].update(sp=2)), open_it,
     ("<manifest>: layout: unknown field(s) ['sp']", DAMAGED_MANIFEST))
both("manifest-truncated", "manifest.json cut in half",
     lambda ck: truncate_by(ck.manifest, ck.manifest.stat().st_size // 2), open_it,
     ("<manifest>: cannot read the manifest", "restore the file or load another iteration"))

# a manifest that lost one parameter's entry (its data still in the files): nothing may read the
# checkpoint without it, neither a check, a conversion, a reshard nor a load
LOST_FRAGMENTS = (f"<data>: holds fragments of parameter {PROJ}", "which the manifest does not list",
                  "restore it or load another iteration")
LOST_UNIVERSAL = (f"<data>: holds tensor '{PROJ}/exp_avg'", "which the manifest does not list",
                  "re-run `megatron-ucp convert`")
for call_id, call in (("verify", verify_it), ("convert", convert_it), ("reshard", reshard_it),
                      ("load", load_into_tiny_gpt)):
    both(f"manifest-lost-param-{call_id}", f"linear_proj's entry removed from the manifest; {call_id}",
         lambda ck: edit_manifest(ck, lambda m: m["params"].pop(PROJ)), call, LOST_FRAGMENTS,
         LOST_UNIVERSAL)

# ---- fragment checkpoint only: the index and the rank files' own records

case("fragments-wrong-checksum", "fragments", "crc32 of LN/param in the rank file's record changed",
     lambda ck: edit_records(ck.data, lambda rs: record(rs)["crc32"].update(param=12345)),
     read_ln, f"<data>: checksum mismatch in tensor '{LN}/param'", "restore it or load an earlier iteration")
case("fragments-duplicate-fragment", "fragments", "LN's fragment entry listed twice in the index",
     lambda ck: edit_manifest(ck, lambda m: m["params"][LN]["slices"][0]["fragments"].append([0, 0, HIDDEN])),
     open_it, f"<dir>: parameter {LN}: elements [0, 64) of a saved slice are saved twice", DAMAGED_INDEX)
case("fragments-overlapping-fragments", "fragments", "LN's fragment split into [0, 40) and [30, 64)",
     lambda ck: edit_manifest(ck, lambda m: m["params"][LN]["slices"][0].update(
         fragments=[[0, 0, 40], [0, 30, HIDDEN]])),
     open_it, f"<dir>: parameter {LN}: elements [30, 40) of a saved slice are saved twice", DAMAGED_INDEX)
case("fragments-overlapping-slices", "fragments", "TP rank 1's slice of linear_proj moved onto rank 0's",
     lambda ck: edit_manifest(ck, lambda m: m["params"][PROJ]["slices"][1]["pieces"][0].__setitem__(
         1, m["params"][PROJ]["slices"][0]["pieces"][0][1])),
     verify_it, f"<dir>: parameter {PROJ}: ranks [0] and [1] saved overlapping slices", DAMAGED_INDEX)
case("fragments-files-dotdot", "fragments", "files[0] edited to '../rank_00000.safetensors'",
     lambda ck: edit_manifest(ck, lambda m: m["files"].__setitem__(0, "../rank_00000.safetensors")),
     open_it, "<manifest>: files[0]: '../rank_00000.safetensors' is not a plain name", DAMAGED_MANIFEST)
case("fragments-files-absolute", "fragments", "files[0] edited to '/etc/passwd'",
     lambda ck: edit_manifest(ck, lambda m: m["files"].__setitem__(0, "/etc/passwd")),
     open_it, "<manifest>: files[0]: '/etc/passwd' is not a plain name", DAMAGED_MANIFEST)
case("fragments-files-count", "fragments", "the last rank file dropped from `files`",
     lambda ck: edit_manifest(ck, lambda m: m["files"].pop()),
     open_it, "<manifest>: files: 1 rank files for layout_world_size 2", DAMAGED_MANIFEST)
case("fragments-files-swapped", "fragments", "the two rank files swapped in `files`",
     lambda ck: edit_manifest(ck, lambda m: m["files"].reverse()),
     read_ln, f"<dir>/rank_00001.safetensors: has no fragment of {LN} at element 0",
     "restore this iteration's own file or load another iteration")
case("fragments-missing-rank-file", "fragments", "rank_00001.safetensors deleted",
     lambda ck: (ck.dir / "rank_00001.safetensors").unlink(), convert_it,
     "<dir>/rank_00001.safetensors: file is missing", "re-save it or point to another iteration")
case("fragments-records-not-json", "fragments", "the rank file's `fragments` metadata cut short",
     lambda ck: rewrite_header(ck.data, lambda h: h["__metadata__"].update(
         fragments=h["__metadata__"]["fragments"][:-3])),
     read_ln, "<data>: header metadata 'fragments': not JSON", "restore it or load another iteration")
case("fragments-record-missing-field", "fragments", "`range` removed from LN's record in the rank file",
     lambda ck: edit_records(ck.data, lambda rs: record(rs).pop("range")),
     read_ln, "<data>: header metadata 'fragments': record", "expected name, local_shape, pieces, range",
     "restore it or load another iteration")
case("fragments-record-name-dotdot", "fragments", "LN's record in the rank file renamed '../LN'",
     lambda ck: edit_records(ck.data, lambda rs: record(rs).update(name=f"../{LN}")),
     read_ln, f"<data>: has no fragment of {LN} at element 0", "load another iteration")


def _v2_piece_outside(ck: Ckpt) -> None:
    # a version-2 manifest has no index: the rank files' records place the fragments
    def drop_index(m: dict) -> None:
        m["version"] = 2
        for p in m["params"].values():
            del p["slices"], p["step"]
    edit_manifest(ck, drop_index)
    edit_records(ck.data, lambda rs: record(rs)["pieces"][0].__setitem__(1, [10]))


case("fragments-v2-piece-outside", "fragments", "format 2, LN's record places it at [10, 74) of [64]",
     _v2_piece_outside, verify_it,
     f"<dir>: parameter {LN}: ranks [0] saved a slice at [10] of shape [64], outside the tensor's shape",
     DAMAGED_INDEX)

# ---- universal checkpoint only: the manifest names each tensor's file, key and checksum

case("universal-wrong-checksum", "universal", "crc32 of LN/param in the manifest changed",
     lambda ck: edit_manifest(ck, lambda m: m["params"][LN]["tensors"]["param"].update(crc32=12345)),
     read_ln, f"<data>: checksum mismatch in tensor '{LN}/param'", "re-run `megatron-ucp convert`")
case("universal-tensor-key", "universal", "LN/param's key pointed at the bias's tensor",
     lambda ck: edit_manifest(ck, lambda m: m["params"][LN]["tensors"]["param"].update(
         key="decoder.final_layernorm.bias/param")),
     open_it, f"<manifest>: params['{LN}'].tensors.param.key: 'decoder.final_layernorm.bias/param' "
     f"is not '{LN}/param'", DAMAGED_MANIFEST)
case("universal-tensor-file-dotdot", "universal", "LN/param's file edited to '../params_00000.safetensors'",
     lambda ck: edit_manifest(ck, lambda m: m["params"][LN]["tensors"]["param"].update(
         file="../params_00000.safetensors")),
     open_it, f"<manifest>: params['{LN}'].tensors.param.file: '../params_00000.safetensors' is not a "
     "plain name", DAMAGED_MANIFEST)
case("universal-tensor-file-absolute", "universal", "LN/param's file edited to '/etc/passwd'",
     lambda ck: edit_manifest(ck, lambda m: m["params"][LN]["tensors"]["param"].update(file="/etc/passwd")),
     open_it, f"<manifest>: params['{LN}'].tensors.param.file: '/etc/passwd' is not a plain name",
     DAMAGED_MANIFEST)
case("universal-unknown-tensor-field", "universal", "field 'codec' added to LN/param's tensor entry",
     lambda ck: edit_manifest(ck, lambda m: m["params"][LN]["tensors"]["param"].update(codec="lz4")),
     open_it, f"<manifest>: params['{LN}'].tensors.param: unknown field(s) ['codec']", DAMAGED_MANIFEST)

# ---- the save root's `latest`

LATEST_FIX = "write the name of a complete checkpoint into it or pass one directly"
case("latest-missing-iteration", "fragments", "`latest` names iter_0000099, which does not exist",
     lambda ck: (ck.root / "latest").write_text("iter_0000099\n"), verify_it,
     "<root>/latest points to iter_0000099, which does not exist",
     "pass a complete checkpoint directory instead (complete checkpoints under <root>: iter_")
case("latest-dotdot", "fragments", "`latest` says '../elsewhere/iter_0000003'",
     lambda ck: (ck.root / "latest").write_text("../elsewhere/iter_0000003\n"), open_it,
     "<root>/latest says '../elsewhere/iter_0000003', which is not the name of a checkpoint directory",
     LATEST_FIX)
case("latest-absolute", "fragments", "`latest` holds the absolute path of the checkpoint",
     lambda ck: (ck.root / "latest").write_text(f"{ck.dir}\n"), open_it,
     "<root>/latest says '<dir>', which is not the name of a checkpoint directory", LATEST_FIX)
case("latest-binary", "fragments", "`latest` holds bytes that are not text",
     lambda ck: (ck.root / "latest").write_bytes(b"\xff\xfe\x00"), open_it,
     "<root>/latest: cannot read it", LATEST_FIX)

# ---- outputs that are files


def _make_file(ck: Ckpt) -> None:
    ck.data.write_text("not a directory")


case("convert-into-file", "fragments", "convert's output path is a regular file",
     lambda ck: ck.out.write_text("x"), lambda ck: convert(ck.root, ck.out, progress=False),
     "<out> is a file, not a directory; choose a new directory")
case("convert-under-file", "fragments", "convert's output path is under a regular file",
     lambda ck: ck.out.write_text("x"), lambda ck: convert(ck.root, ck.out / "universal", progress=False),
     "<out>/universal: its parent <out> is a file, not a directory; choose a new directory")
case("reshard-to-torch-into-file", "torch_dp2", "reshard's Megatron-LM target path is a regular file",
     lambda ck: ck.out.write_text("x"),
     lambda ck: reshard(ck.root, ck.out, Layout(tp=2), "torch", progress=False),
     "<out> is a file, not a directory; choose a new directory")
case("save-into-file", "none", "megatron_ucp.save's root is a regular file", _make_file,
     lambda ck: ucp.save([], None, None, ck.data, 1),
     "<data>: the save root is a file; pass a directory")
case("save-under-file", "none", "megatron_ucp.save's root is under a regular file", _make_file,
     lambda ck: ucp.save([], None, None, ck.data / "ckpt", 1),
     "<data>/ckpt: the save root is under <data>, which is a file; pass a directory")

# ---- Megatron-LM --ckpt-format torch (legacy) rank files

RESTORE_RANK = "restore the rank directory's files from the original save"
LEGACY = "torch_dp2"  # one rank directory: each conversion rebuilds one rank
case("legacy-tracker-missing-iteration", LEGACY, "latest_checkpointed_iteration.txt says 99",
     lambda ck: (ck.root / "latest_checkpointed_iteration.txt").write_text("99"), convert_it,
     "<root>/latest_checkpointed_iteration.txt names iteration 99, but <root>/iter_0000099 does not "
     "exist", "pass an existing iter_XXXXXXX directory instead")
case("legacy-tracker-binary", LEGACY, "latest_checkpointed_iteration.txt holds bytes that are not text",
     lambda ck: (ck.root / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\xfe"), convert_it,
     "<root>/latest_checkpointed_iteration.txt: cannot read it", "pass the iter_XXXXXXX directory")
case("legacy-tracker-dotdot", LEGACY, "latest_checkpointed_iteration.txt says '../iter_0000006'",
     lambda ck: (ck.root / "latest_checkpointed_iteration.txt").write_text("../iter_0000006"), convert_it,
     "<root>/latest_checkpointed_iteration.txt says '../iter_0000006', not an iteration number",
     "pass the iter_XXXXXXX directory to convert instead")
case("legacy-unexpected-key", LEGACY, "a tensor the model does not have added to model_optim_rng.pt's model",
     lambda ck: torch_file(ck.data, lambda s: s["model"].update({"decoder.layers.0.mlp.extra.weight":
                                                                 torch.zeros(3)})),
     convert_it, "<data> [model]: the model rebuilt from its args does not have the saved modules",
     "saved only: ['decoder.layers.0.mlp.extra.weight']", RESTORE_RANK)
case("legacy-missing-key", LEGACY, "decoder.final_layernorm.weight removed from model_optim_rng.pt's model",
     lambda ck: torch_file(ck.data, lambda s: s["model"].pop(LN)),
     convert_it, "<data> [model]: the model rebuilt from its args does not have the saved modules",
     f"rebuilt only: ['{LN}']", RESTORE_RANK)
case("legacy-no-model", LEGACY, "the 'model' entry removed from model_optim_rng.pt",
     lambda ck: torch_file(ck.data, lambda s: s.pop("model")),
     convert_it, "<data> has no 'model' state dict", RESTORE_RANK)
case("legacy-no-args", LEGACY, "the 'args' entry removed from model_optim_rng.pt",
     lambda ck: torch_file(ck.data, lambda s: s.pop("args")),
     convert_it, "<data> has no Megatron-LM 'args'", "restore this file from the original save")
case("legacy-args-not-namespace", LEGACY, "'args' replaced by a plain dict of the same values",
     lambda ck: torch_file(ck.data, lambda s: s.update(args=vars(s["args"]))),
     convert_it, "<data> has no Megatron-LM 'args'", "restore this file from the original save")
case("legacy-wrong-args-hidden", LEGACY, "args.hidden_size doubled (another model's args)",
     lambda ck: torch_file(ck.data, set_args(hidden_size=lambda h: 2 * h)),
     convert_it, "<dir>/mp_rank_00/distrib_optim.pt: optimizer 0 buffer 0",
     "elements from the model rebuilt from args", "the args do not describe this checkpoint", RESTORE_RANK)
case("legacy-wrong-args-layers", LEGACY, "args.num_layers doubled",
     lambda ck: torch_file(ck.data, set_args(num_layers=lambda n: 2 * n)),
     convert_it, "<data> [model]: the model rebuilt from its args does not have the saved modules",
     "rebuilt only: ['decoder.layers.", RESTORE_RANK)
case("legacy-args-differ-between-ranks", "torch_tp2_fp32", "mp_rank_01's args.num_layers changed",
     lambda ck: torch_file(ck.dir / "mp_rank_01" / "model_optim_rng.pt",
                           set_args(num_layers=lambda n: n + 1)),
     convert_it, "<dir>/mp_rank_01/model_optim_rng.pt: its args differ from <data> in ['num_layers']",
     "restore this directory from the same save")
case("legacy-truncated-pt", LEGACY, "model_optim_rng.pt cut to 1000 bytes",
     lambda ck: os.truncate(ck.data, 1000), convert_it,
     "<data> cannot be read", "restore it from the source or convert another iteration")

# ---- Megatron-LM --ckpt-format torch_dist

DIST = "torch_dist_tp2_dp2"
case("torch-dist-truncated-data", DIST, "__0_0.distcp cut in half",
     lambda ck: truncate_by(ck.data, ck.data.stat().st_size // 2), convert_it,
     "<data>", "cannot read ['optimizer.", "restore them or convert another iteration")
case("torch-dist-truncated-metadata", DIST, ".metadata cut in half",
     lambda ck: truncate_by(ck.dir / ".metadata", (ck.dir / ".metadata").stat().st_size // 2), convert_it,
     "<dir>/.metadata: cannot read torch_dist metadata", "restore it or convert another iteration")

# ---- another model's checkpoint


def _llama_universal(ck: Ckpt) -> None:
    # the copy of the Llama fixture (RMSNorm, SwiGLU, RoPE, GQA, 3 layers of 32) becomes a
    # universal checkpoint, which is then loaded into the default tiny GPT
    ck.root = convert(ck.root, ck.out, progress=False)


case("megatron-llama-into-gpt", "torch_llama_tp2", "Megatron-LM Llama checkpoint loaded into a GPT model",
     _llama_universal, load_into_tiny_gpt,
     "<out>: the model does not match the checkpoint", "num_layers: checkpoint 3, model 4",
     "normalization: checkpoint 'RMSNorm', model 'LayerNorm'",
     "build the model with the checkpoint's architecture")


# ------------------------------------------------------------------------------ tests


def test_the_table_is_complete():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    assert len(CASES) >= 30


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_bad_input(case: Case, bases: Bases, tmp_path: Path):
    ck = bases.copy(case.base, tmp_path)
    case.corrupt(ck)
    with pytest.raises(UCPError) as ei:  # returning anything (data, a path) fails the row
        case.call(ck)
    msg = str(ei.value)
    for part in case.expect:
        assert ck.expand(part) in msg, f"{ck.expand(part)!r} not in:\n{msg}"
