"""The save-root protocol: a save root holds one directory per saved iteration (`iter_XXXXXXX`),
each committed by its writer's marker file, and a `latest` file naming the last committed one.
`resolve` finds the checkpoint a path names, `interrupted_saves` what died before its commit,
`write_latest` moves the pointer (atomically: readers see the old name or the new)."""

from __future__ import annotations

from pathlib import Path

from megatron_ucp.errors import UCPError
from megatron_ucp.storage.urls import Location, backend, location

LATEST = "latest"


class NotACheckpoint(UCPError):
    """A directory with nothing of a megatron-ucp checkpoint in it."""


def resolve(path: str | Path | Location, marker: str) -> Location:
    """A checkpoint directory itself (it holds its writer's `marker` file), or a save root whose
    `latest` names one (local or a URL)."""
    path = location(path)
    if (path / marker).exists():
        return path
    if (path / LATEST).exists():
        try:
            name = (path / LATEST).read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise UCPError(f"{path / LATEST}: cannot read it ({e}); write the name of a complete "
                           f"checkpoint into it or pass one directly ({_complete(path, marker)})") from e
        # a plain directory name: `latest` never sends a load outside its save root
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            raise UCPError(f"{path / LATEST} says {name!r}, which is not the name of a checkpoint "
                           "directory in this save root; write the name of a complete checkpoint "
                           f"into it or pass one directly ({_complete(path, marker)})")
        target = path / name
        if not (target / marker).exists():
            why = ("does not exist" if not target.exists()
                   else f"has no {marker} (its save did not complete)")
            raise UCPError(f"{path / LATEST} points to {target.name}, which {why}; "
                           f"pass a complete checkpoint directory instead ({_complete(path, marker)})")
        return target
    if not path.exists():
        raise UCPError(f"{path} does not exist; pass a save root (the directory given to save, with "
                       f"a '{LATEST}' file) or one of its iter_* directories")
    if not backend(path).local_files and path.name.startswith("iter_"):  # (a store: no rename)
        raise UCPError(f"{path} holds no {marker}: a save that never committed (or is still being "
                       f"written), never loaded; pass its save root {path.parent}, whose '{LATEST}' "
                       "names the last complete checkpoint")
    if path.name.startswith(".iter_") and path.name.endswith(".partial"):
        raise UCPError(f"{path} is an interrupted save (no {marker}: it was never committed) and "
                       f"cannot be loaded; pass its save root {path.parent}, whose '{LATEST}' names "
                       "the last complete checkpoint")
    if any(path.glob("iter_*/" + marker)):
        raise UCPError(f"{path} has no '{LATEST}' file; pass one of its iter_* directories "
                       f"({_complete(path, marker)})")
    raise NotACheckpoint(f"{path} is not a megatron-ucp checkpoint (no {marker} and no '{LATEST}' "
                         "file in it); pass a directory written by megatron_ucp.save (or one of its "
                         "iter_* directories) or by `megatron-ucp convert`")


def interrupted_saves(root: str | Path | Location, marker: str) -> list[Location]:
    """Saves under a save root that never committed (locally `.iter_*.partial` directories; in a
    store the iter_* prefixes without their marker)."""
    root = location(root)
    return backend(root).interrupted_saves(root, marker)


def is_checkpoint(path: str | Path | Location, marker: str) -> bool:
    """A megatron-ucp checkpoint directory or save root (it may still fail to resolve)."""
    path = location(path)
    return (path / marker).is_file() or (path / LATEST).is_file()


def _complete(root: Location, marker: str) -> str:
    """The committed iter_* checkpoints under `root`, for error messages."""
    names = sorted(p.parent.name for p in root.glob("iter_*/" + marker))
    return (f"complete checkpoints under {root}: {', '.join(names)}" if names
            else f"there is no complete checkpoint under {root}")


def write_latest(root: Location, ckpt_name: str) -> None:
    """Point `latest` at a committed directory: one atomic write (a store: one PUT, old or new)."""
    root = location(root)
    backend(root).put(root / LATEST, (ckpt_name + "\n").encode())


def clean(root: Location, marker: str) -> None:
    """Remove what writers that died left under a save root (never a committed directory)."""
    root = location(root)
    backend(root).clean_save_root(root, marker)


def incomplete_uploads(root: str | Path | Location) -> list:
    """Uploads started under a save root and never completed (a store's; none locally)."""
    root = location(root)
    return backend(root).incomplete_uploads(root)
