"""The package works on the installed megatron-core release, whichever supported one it is.

megatron-core 0.19 removed classes the package used to import by name (GroupedMLP), so a release
difference shows up first as an import failure of every command, the offline ones included. These
tests import every module in a fresh interpreter and run the offline CLI end to end on a
Megatron-LM torch_dist fixture, checking the converted values against the source.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MCORE_RELEASES

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "megatron_lm" / "torch_dist_tp2_dp2" / "ckpt"

pytestmark = pytest.mark.mcore_release

IMPORT_ALL = r"""
import importlib, pkgutil, sys
import megatron_ucp
failed = []
for m in pkgutil.walk_packages(megatron_ucp.__path__, "megatron_ucp."):
    if m.name == "megatron_ucp.__main__":  # runs the CLI
        continue
    try:
        importlib.import_module(m.name)
    except Exception as e:  # report every module, not only the first
        failed.append(f"{m.name}: {type(e).__name__}: {e}")
print("\n".join(failed))
sys.exit(1 if failed else 0)
"""


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_ucp", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)


def test_every_module_imports():
    r = subprocess.run([sys.executable, "-c", IMPORT_ALL], capture_output=True, text=True, cwd=ROOT,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_mcore_compat_names_the_release():
    import megatron.core

    from megatron_ucp import mcore_compat

    assert mcore_compat.MCORE_VERSION[:2] == tuple(int(x) for x in megatron.core.__version__.split(".")[:2])
    # the installed release is one the matrix tests (configs/mcore_releases.json)
    assert mcore_compat.release_series() in [r["series"] for r in MCORE_RELEASES["releases"]]


def test_offline_cli_reshard_inspect_verify_diff(tmp_path):
    out = tmp_path / "u"
    r = _cli("reshard", "--load", str(FIXTURE), "--save", str(out), "--target-tp", "1",
             "--target-dp", "4", "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    r = _cli("inspect", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "iteration    6" in r.stdout and "saved at     TP2xPP1xDP2" in r.stdout, r.stdout[:2000]
    assert "decoder.layers.2.self_attention.linear_qkv.weight" in r.stdout
    r = _cli("verify", str(out))
    assert r.returncode == 0 and "40 parameters, 120 tensors verified" in r.stdout, r.stdout + r.stderr
    # every value (weights and both Adam moments) equals the torch_dist source's
    r = _cli("diff", str(FIXTURE), str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1].endswith("rows; largest abs difference 0.000e+00; identical"), \
        r.stdout[-2000:]


# ------------------------------------------------------------- the release matrix, read by all

def _tool():
    spec = importlib.util.spec_from_file_location("mcore_releases", ROOT / "tools" / "mcore_releases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_table_is_the_matrix():
    table = _tool().readme_table(MCORE_RELEASES)
    assert table in (ROOT / "README.md").read_text(), \
        "README's 'Supported megatron-core releases' table differs from configs/mcore_releases.json: " \
        "write it with `python3 tools/mcore_releases.py readme`"


def test_setup_py_accepts_the_matrix_releases():
    assert f'"{MCORE_RELEASES["install_requires"]}"' in (ROOT / "setup.py").read_text()


def test_makefile_reads_the_matrix():
    makefile = (ROOT / "Makefile").read_text()
    for r in MCORE_RELEASES["releases"]:
        assert f"$(call RELEASE,{r['series']},pip)" in makefile, r["series"]
        if r["tests"] != "all":
            assert all((ROOT / t).is_file() for t in r["tests"]), r["tests"]


# ------------------------------------ release comparisons and private megatron-core names: only
# in megatron_ucp/mcore_compat (and this file, which tests it)

# megatron-core's private names the library calls today (all through mcore_compat); a name that is
# not imported from megatron-core directly (a method of one of its objects) is caught by this list
KNOWN_PRIVATE = frozenset({
    "_get_model_param_range_map", "_get_main_param_and_optimizer_states",
    "_set_main_param_and_optimizer_states", "_init_optimizer_states_with_dummy_values",
    "_copy_main_params_to_model_params", "_get_param_groups", "_set_checkpointing",
    "_unset_checkpointing", "_fork_rng", "_set_all_rng_states", "_get_all_rng_states",
    "_batched_p2p_ops", "_p2p_ops", "_communicate_shapes", "_communicate",
    "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", "_GDNBase",
})
RELEASE_TEXT = re.compile(r"^\d+\.\d+")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _mentions_version(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and "version" in n.id.lower() or
               isinstance(n, ast.Attribute) and "version" in n.attr.lower() for n in ast.walk(node))


def _release_literal(node: ast.AST) -> bool:
    if isinstance(node, ast.Tuple):
        return bool(node.elts) and all(isinstance(e, ast.Constant) and type(e.value) is int
                                       for e in node.elts)
    return (isinstance(node, ast.Constant) and isinstance(node.value, str)
            and bool(RELEASE_TEXT.match(node.value)))


def _megatron_modules(tree: ast.AST) -> set[str]:
    """The names `tree` binds to megatron modules or their members by importing them."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names
                      if a.name.startswith("megatron.")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron."):
            names |= {a.asname or a.name for a in node.names}
    return names


def _base_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def release_checks(tree: ast.AST) -> list[tuple[int, str]]:
    """Where `tree` looks at megatron-core's release: MCORE_VERSION, a `__version__` of megatron,
    `packaging.version`, or a comparison of a version with a release literal ((0, 19), "0.19")."""
    found, modules = [], _megatron_modules(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "MCORE_VERSION" or \
                isinstance(node, ast.Attribute) and node.attr == "MCORE_VERSION":
            found.append((node.lineno, "MCORE_VERSION"))
        elif isinstance(node, ast.Attribute) and node.attr == "__version__" and \
                ("megatron" in ast.unparse(node) or _base_name(node) in modules):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [(node.lineno, f"import {n}") for n in names if n.startswith("packaging")]
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name == "MCORE_VERSION"]
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_release_literal(s) for s in sides) and any(_mentions_version(s) for s in sides):
                found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def private_megatron_names(tree: ast.AST) -> list[tuple[int, str]]:
    """Where `tree` uses a private megatron name: imported (`from megatron.core.x import _y`), an
    underscore attribute of a megatron module it imported, or one of KNOWN_PRIVATE."""
    found, modules = [], _megatron_modules(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron."):
            found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names
                      if _private(a.name)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if node.attr in KNOWN_PRIVATE or _base_name(node.value) in modules:
                found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def offenders(root: Path) -> dict[str, list[str]]:
    """Release checks (library, tests, tools, bench) and private megatron-core names (library)
    outside megatron_ucp/mcore_compat. (tools/ and bench/ patch a private DistributedOptimizer
    method of stock Megatron-LM for their resume checks: scripts about megatron-core, not the
    library.)"""
    out: dict[str, list[str]] = {"release checks": [], "private megatron-core names": []}
    files = [*(root / "megatron_ucp").rglob("*.py"), *(root / "tests").glob("*.py"),
             *(root / "tools").rglob("*.py"), *(root / "bench").rglob("*.py")]
    for path in sorted(files):
        rel = path.relative_to(root)
        if rel.parts[:2] == ("megatron_ucp", "mcore_compat") or rel == Path("tests/test_mcore_release.py"):
            continue
        tree = ast.parse(path.read_text())
        out["release checks"] += [f"{rel}:{line} {what}" for line, what in release_checks(tree)]
        if rel.parts[0] == "megatron_ucp":
            out["private megatron-core names"] += [f"{rel}:{line} {what}"
                                                   for line, what in private_megatron_names(tree)]
    return out


def test_release_differences_and_private_names_only_in_mcore_compat():
    """A release comparison or a private megatron-core name outside megatron_ucp/mcore_compat: ask
    a predicate of mcore_compat (or add one there) instead."""
    assert offenders(ROOT) == {"release checks": [], "private megatron-core names": []}


def test_the_scan_finds_what_it_looks_for():
    tree = ast.parse("import megatron.core as mc\n"
                     "from megatron.core.tensor_parallel import random as tp_random\n"
                     "from megatron.core.optimizer import _get_param_groups\n"
                     "from megatron_ucp.mcore_compat import MCORE_VERSION\n"
                     "a = MCORE_VERSION >= (0, 19)\n"
                     "b = mc.__version__ < '0.19'\n"
                     "tp_random._fork_rng()\n"
                     "opt._get_main_param_and_optimizer_states(p)\n"
                     "self._own_thing()\n"
                     "c = float(ckpt_version) < 3.0\n")
    assert [line for line, _ in release_checks(tree)] == [4, 5, 5, 6, 6]
    assert [line for line, _ in private_megatron_names(tree)] == [3, 7, 8]
