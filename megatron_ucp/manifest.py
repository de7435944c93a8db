"""The manifest: one JSON file that makes a directory a checkpoint, and the `latest` pointer.

Both forms (`fragments`, written by `save`, and `universal`, written by `convert`) carry the same
top-level fields; only `kind` and the per-parameter storage entries differ (docs/FORMAT.md).
A directory without manifest.json is not a checkpoint: the manifest is written last, so a save
that died half-way is never loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_ucp.errors import UCPError
from megatron_ucp.fragment_index import paused_gc
from megatron_ucp.storage import write_text_atomic

FORMAT = "megatron-ucp"
# 3: the manifest indexes every fragment (which file holds which range); 2: fragment pieces carry
# strides; 1: blocks of rows. Versions 1 and 2 are still read (their index is in the rank files).
VERSION = 3
MANIFEST = "manifest.json"
LATEST = "latest"


def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def resolve(path: str | Path) -> Path:
    """A checkpoint directory itself, or a save root whose `latest` names one."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return path
    if (path / LATEST).exists():
        target = path / (path / LATEST).read_text().strip()
        if not (target / MANIFEST).exists():
            why = ("does not exist" if not target.exists()
                   else f"has no {MANIFEST} (its save did not complete)")
            raise UCPError(f"{path / LATEST} points to {target.name}, which {why}; "
                           f"pass a complete checkpoint directory instead ({_complete(path)})")
        return target
    if not path.exists():
        raise UCPError(f"{path} does not exist; pass a save root (the directory given to save, with "
                       f"a '{LATEST}' file) or one of its iter_* directories")
    if path.name.startswith(".iter_") and path.name.endswith(".partial"):
        raise UCPError(f"{path} is an interrupted save (no {MANIFEST}: it was never committed) and "
                       f"cannot be loaded; pass its save root {path.parent}, whose '{LATEST}' names "
                       "the last complete checkpoint")
    if any(path.glob("iter_*/" + MANIFEST)):
        raise UCPError(f"{path} has no '{LATEST}' file; pass one of its iter_* directories "
                       f"({_complete(path)})")
    raise UCPError(f"{path} is not a megatron-ucp checkpoint (no {MANIFEST} and no '{LATEST}' file "
                   "in it); pass a directory written by megatron_ucp.save (or one of its iter_* "
                   "directories) or by `megatron-ucp convert`")


def _complete(root: Path) -> str:
    """The committed iter_* checkpoints under `root`, for error messages."""
    names = sorted(p.parent.name for p in root.glob("iter_*/" + MANIFEST))
    return (f"complete checkpoints under {root}: {', '.join(names)}" if names
            else f"there is no complete checkpoint under {root}")


def read(ckpt_dir: Path) -> dict:
    path = Path(ckpt_dir) / MANIFEST
    try:
        with paused_gc():  # a fragment index is millions of small lists
            manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UCPError(f"{path}: cannot read the manifest ({e}); the checkpoint is damaged: "
                       "restore the file or load another iteration") from e
    if manifest.get("format") != FORMAT:
        raise UCPError(f"{path}: not a {FORMAT} manifest")
    if manifest.get("version", 0) > VERSION:
        raise UCPError(f"{path}: format version {manifest['version']} is newer than this "
                       f"megatron-ucp understands ({VERSION}); upgrade megatron-ucp")
    return manifest


def encode(manifest: dict) -> str:
    """Compact JSON: a fragment index at thousands of ranks is tens of MB (`python -m json.tool`
    or `megatron-ucp inspect` show it readably)."""
    with paused_gc():
        return json.dumps(manifest, sort_keys=True, separators=(",", ":"))


def write(ckpt_dir: Path, manifest: dict) -> None:
    write_text_atomic(Path(ckpt_dir) / MANIFEST, encode(manifest))


def write_latest(root: Path, ckpt_name: str) -> None:
    write_text_atomic(Path(root) / LATEST, ckpt_name + "\n")
