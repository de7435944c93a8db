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
from megatron_ucp.storage import write_text_atomic

FORMAT = "megatron-ucp"
VERSION = 1
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
            raise UCPError(f"{path / LATEST} points to {target.name}, which has no {MANIFEST}; "
                           "the save did not complete: point --load at an earlier iter_* directory")
        return target
    if path.exists() and any(path.glob("iter_*/" + MANIFEST)):
        raise UCPError(f"{path} has no '{LATEST}' file; pass one of its iter_* directories")
    raise UCPError(f"{path} is not a megatron-ucp checkpoint (no {MANIFEST} and no {LATEST}); "
                   "for Megatron-LM torch/torch_dist checkpoints use `megatron-ucp reshard`")


def read(ckpt_dir: Path) -> dict:
    path = Path(ckpt_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UCPError(f"{path}: cannot read the manifest ({e}); the checkpoint is damaged") from e
    if manifest.get("format") != FORMAT:
        raise UCPError(f"{path}: not a {FORMAT} manifest")
    if manifest.get("version", 0) > VERSION:
        raise UCPError(f"{path}: format version {manifest['version']} is newer than this "
                       f"megatron-ucp understands ({VERSION}); upgrade megatron-ucp")
    return manifest


def write(ckpt_dir: Path, manifest: dict) -> None:
    write_text_atomic(Path(ckpt_dir) / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))


def write_latest(root: Path, ckpt_name: str) -> None:
    write_text_atomic(Path(root) / LATEST, ckpt_name + "\n")
