"""The format contract (`megatron_ucp.formats.base`): every registered format provides what its
registry entry declares, no format package imports another, and the registry (which the CLI
reads to build its parser) imports no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ucp import formats
from megatron_ucp.formats.base import Source, check_package

ROOT = Path(__file__).resolve().parent.parent
FORMATS_DIR = ROOT / "megatron_ucp" / "formats"
PACKAGES = sorted(p.name for p in FORMATS_DIR.iterdir() if (p / "__init__.py").exists())


@pytest.mark.parametrize("name", list(formats.FORMATS))
def test_every_registered_format_satisfies_the_contract(name):
    assert check_package(formats.FORMATS[name], formats.get(name)) == []


def test_every_format_package_is_registered():
    """Every top-level format package is registered; a flavour of one format's files is a
    subpackage of it (megatron_dist.bridge: Megatron-Bridge's torch_dist saves)."""
    registered = {f.package.split(".")[2] for f in formats.FORMATS.values()}
    assert registered == set(PACKAGES)


def test_registry_derives_the_targets():
    assert formats.TARGETS == {"universal": "universal", "torch": "megatron_torch",
                               "torch_dist": "megatron_torch_dist", "bridge": "megatron_bridge"}
    assert set(formats.MEGATRON_SOURCES) == {"megatron_torch", "megatron_torch_dist", "megatron_fsdp",
                                             "megatron_bridge"}
    assert set(formats.writable()) == {"universal", "megatron_torch", "megatron_torch_dist", "hf",
                                       "megatron_bridge"}


SHARED = sorted(p.stem for p in FORMATS_DIR.glob("*.py") if p.stem != "__init__")
ABOVE = ("megatron_ucp.formats", "megatron_ucp.conversion")  # the registry, the conversions


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in `path`; `from a import b`: a.b (b may be a module)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def test_no_format_package_imports_another_or_the_registry():
    """Shared conventions live in shared modules (`formats/<module>.py`), never in another
    format's package; neither a format package nor a shared module reaches up into the registry
    or the conversions (they sit above the formats), and shared modules import no format package."""
    offenders = []
    for path in sorted(FORMATS_DIR.rglob("*.py")):
        parts = path.relative_to(FORMATS_DIR).parts
        if parts == ("__init__.py",):
            continue  # the registry itself
        own = parts[0] if len(parts) > 1 else None
        for line, module in _imports(path):
            name = module.split(".")
            if not module.startswith(ABOVE):
                continue
            if name[:2] == ["megatron_ucp", "formats"] and len(name) > 2 and (
                    name[2] in SHARED or name[2] == own):
                continue  # a shared module, or its own package
            offenders.append(f"{path.relative_to(ROOT)}:{line} {module}")
    assert offenders == []


def test_every_reader_is_a_source():
    for name in formats.FORMATS:
        for cls in formats.get(name).SOURCES:
            assert issubclass(cls, Source), cls
            assert cls.format == name


def test_registry_imports_no_torch():
    code = ("import sys; from megatron_ucp import formats; from megatron_ucp.cli import build_parser; "
            "build_parser(); print(formats.TARGETS); assert 'torch' not in sys.modules, 'torch'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_sources_are_used_through_declared_members():
    """No library module probes a source with hasattr/getattr: its optional members are declared
    (with defaults) by `formats.base.Source`. (The storage layer's read planner is being moved
    onto the storage interface, issue 31 item 1, and is left out until then.)"""
    offenders = []
    for path in sorted((ROOT / "megatron_ucp").rglob("*.py")):
        if path.stem == "storage" or "storage" in path.relative_to(ROOT / "megatron_ucp").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args
                    and isinstance(node.args[0], ast.Name) and node.args[0].id in ("source", "src")):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []
