"""Which megatron-core release is installed, and optional names that only some releases have.

The supported releases (Python, torch, the tests each runs) are listed once, as data, in
`configs/mcore_releases.json`, which the Makefile, tests/conftest.py and the README table read.
This module is the only place in the library that looks at megatron-core's version; the rest asks
the predicates of the sibling modules instead (tests/test_mcore_release.py enforces it).
"""

from __future__ import annotations

import importlib

import megatron.core


def parse_version(text: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version string such as "0.16.1" or "0.19.0rc1+local"."""
    parts = []
    for word in text.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in word if c.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


MCORE_VERSION: tuple[int, int, int] = parse_version(megatron.core.__version__)


def release_name() -> str:
    return f"megatron-core {megatron.core.__version__}"


def release_series() -> str:
    """The installed release's "major.minor", as `configs/mcore_releases.json` names releases."""
    return f"{MCORE_VERSION[0]}.{MCORE_VERSION[1]}"


def since(major: int, minor: int) -> bool:
    """Whether the installed release is `major.minor` or later (for the sibling modules' tables)."""
    return MCORE_VERSION[:2] >= (major, minor)


def optional(module: str, name: str | None = None):
    """`module` (or its attribute `name`) when this release has it, else None."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None
    return mod if name is None else getattr(mod, name, None)
