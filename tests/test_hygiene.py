"""The library leaves the process as it found it, and never imports its own test helpers.

The offline APIs rebuild Megatron-LM models on a fake process group; whatever they patch for that
(torch.cuda placement, megatron-core's grouped-GEMM handle) must be scoped to the rebuild, so a
GPU job that calls them (or `diff` inside an evaluation script) is not silently altered.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "megatron_lm"

SCRIPT = r"""
import json, sys
import torch
from megatron_ucp.mcore_compat import GROUPED_GEMM_UTIL as gg  # None from megatron-core 0.19 on

def snapshot():
    return {"cuda": {k: id(getattr(torch.cuda, k)) for k in dir(torch.cuda)},
            "tensor_cuda": id(torch.Tensor.cuda),
            "gg": (id(gg.grouped_gemm), id(gg.ops)) if gg is not None else None,
            "modules": {k: id(v) for k, v in sys.modules.items()}}

before = snapshot()
from megatron_ucp.checks import diff, verify
from megatron_ucp.inspector import inspect
from megatron_ucp.layout import Layout
from megatron_ucp.conversion import convert, reshard
out, fx = sys.argv[1], sys.argv[2]
moe = "/torch_moe_grouped_ep2/ckpt" if gg is not None else "/torch_moe_ep2/ckpt"  # MoE rebuild
u = convert(fx + moe, out + "/u", progress=False)
reshard(fx + "/torch_tp2_pp2/ckpt", out + "/d", Layout(dp=4), target_format="torch_dist",
        progress=False)
reshard(fx + "/torch_tp2_pp2/ckpt", out + "/t", Layout(tp=1, pp=2, dp=2), target_format="torch",
        progress=False)
verify(u); inspect(u); diff(fx + "/torch_dist_tp2_dp2/ckpt", out + "/d")
after = snapshot()
changed = sorted(k for k in before["cuda"] if after["cuda"].get(k) != before["cuda"][k])
replaced = sorted(k for k, v in before["modules"].items() if after["modules"].get(k) != v)
added = sorted(k for k in after["modules"] if k not in before["modules"])
print(json.dumps({"cuda_changed": changed,
                  "tensor_cuda_changed": after["tensor_cuda"] != before["tensor_cuda"],
                  "grouped_gemm_changed": after["gg"] != before["gg"],
                  "modules_replaced": replaced,
                  "suspicious_added": [m for m in added if m.startswith(("megatron_ucp.testing",
                                                                         "grouped_gemm"))]}))
"""


def test_offline_apis_leave_the_process_unchanged(tmp_path):
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), str(FIXTURES)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report == {"cuda_changed": [], "tensor_cuda_changed": False,
                      "grouped_gemm_changed": False, "modules_replaced": [],
                      "suspicious_added": []}, report


def test_library_never_imports_its_test_helpers():
    offenders = []
    for path in sorted((ROOT / "megatron_ucp").rglob("*.py")):
        if "testing" in path.relative_to(ROOT / "megatron_ucp").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                          if n.startswith("megatron_ucp.testing")]
    assert offenders == []


def _package_imports() -> dict[str, set[str]]:
    """megatron_ucp's modules -> the megatron_ucp modules each imports, at module level or inside a
    function (a deferred import is still a dependency). `from pkg import name` counts as an import
    of `pkg.name` where that is a module, else of `pkg`; the implicit import of a module's own
    parent packages is left out (every submodule has it)."""
    paths = {}
    for path in (ROOT / "megatron_ucp").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def module_of(name: str) -> str | None:  # the longest prefix of `name` that is a module
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in paths.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        names = []
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package `level - 1` levels above this one's
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                names += [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
        graph[mod] = {m for n in names if n.split(".")[0] == "megatron_ucp"
                      for m in [module_of(n)] if m and m != mod}
    return graph


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` except those under `if TYPE_CHECKING:` (imports for annotations only,
    never run, so never part of a cycle)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and getattr(test, "id", getattr(test, "attr", None)) == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def test_no_import_cycles_in_the_package():
    """No two megatron_ucp modules import each other, directly or through others (a cycle works
    only while every import in it stays deferred or in the right order, and makes the layers'
    one-way flow a loop). Found by a depth-first search over the import graph."""
    graph = _package_imports()
    assert "megatron_ucp.testing.tiny_gpt" in graph and graph["megatron_ucp.testing.tiny_gpt"]
    cycles, state = [], {}  # state: 1 on the current path, 2 done

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = 1
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)


IMPORT_TESTS = r"""
import importlib, sys
import torch
from torch.overrides import _get_current_function_mode_stack

def snapshot():  # torch.cuda's functions (submodules imported later are no change)
    return ({k: id(v) for k, v in vars(torch.cuda).items() if callable(v) and not isinstance(v, type(torch))},
            id(torch.Tensor.cuda), id(torch.Tensor.type), len(_get_current_function_mode_stack()))

def same(a, b):
    return a[1:] == b[1:] and all(b[0].get(k) == v for k, v in a[0].items())

before, changed = snapshot(), []
for name in sys.argv[1:]:
    importlib.import_module(name)
    if not same(before, snapshot()):
        changed.append(name)
        before = snapshot()
print(" ".join(changed))
"""


def test_importing_a_test_module_leaves_the_process_alone():
    """pytest imports every test module into one process at collection: one that installs the CPU
    shim there (torch.cuda.is_available() true from then on) silently turns other tests' checks
    into skips."""
    names = sorted(p.stem for p in (ROOT / "tests").glob("test_*.py"))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    run = subprocess.run([sys.executable, "-c", IMPORT_TESTS, *names], capture_output=True, text=True,
                         cwd=ROOT / "tests", env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == [], f"these test modules change the process at import: {run.stdout}"


# The storage seam: only megatron_ucp/storage/ knows which backend holds a path.
STORE_CLIENT_MODULES = ("obstore", "megatron_ucp.object_store", "megatron_ucp.storage.object_store",
                        "megatron_ucp.storage.store_backend", "megatron_ucp.storage.store_reads",
                        "megatron_ucp.storage.s3_multipart")
PATH_TYPES = {"ObjectPath", "Location", "Path", "PurePath", "PosixPath", "PurePosixPath"}


def _imported_modules(node: ast.AST) -> list[str]:
    """The modules an import statement names (`from a import b` names a and a.b: b may be one)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module:
        return [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    return []


def _type_names(node: ast.AST) -> list[str]:
    """The class names an isinstance second argument tests (a name, a.b, or a tuple of them)."""
    if isinstance(node, ast.Tuple):
        return [n for e in node.elts for n in _type_names(e)]
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    return []


def storage_seam_offenders(root: Path) -> list[str]:
    """Library modules outside megatron_ucp/storage/ that import the object-store client (obstore or
    the store backend's modules) or test a path's type (`isinstance(x, ObjectPath)`, `..., Path)`):
    what a new backend would have to edit."""
    offenders = []
    package = root / "megatron_ucp"
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(root)
        if path.relative_to(package).parts[0] == "storage":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            offenders += [f"{rel}:{node.lineno} imports {m}" for m in _imported_modules(node)
                          if m.split(".")[0] == "obstore" or m in STORE_CLIENT_MODULES]
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "isinstance" and len(node.args) == 2):
                offenders += [f"{rel}:{node.lineno} isinstance(..., {n})"
                              for n in _type_names(node.args[1]) if n in PATH_TYPES]
    return offenders


def test_only_the_storage_package_knows_the_backends():
    """A new storage backend touches megatron_ucp/storage/ only: nothing else imports the
    object-store client or branches on a path's type (ask `storage` instead)."""
    assert storage_seam_offenders(ROOT) == []


def test_the_storage_seam_check_sees_what_it_forbids(tmp_path):
    """The scan itself: each forbidden form in a module outside storage/ is reported."""
    lib = tmp_path / "megatron_ucp"
    (lib / "storage").mkdir(parents=True)
    (lib / "storage" / "object_store.py").write_text("import obstore\n")  # allowed in storage/
    (lib / "bad.py").write_text(
        "import obstore\nfrom megatron_ucp.storage import object_store\n"
        "from megatron_ucp.storage.object_store import ObjectPath\nfrom pathlib import Path\n"
        "def f(p):\n    return isinstance(p, ObjectPath) or isinstance(p, (str, Path))\n")
    found = storage_seam_offenders(tmp_path)
    assert [f.split(" ", 1)[1] for f in found] == [
        "imports obstore", "imports megatron_ucp.storage.object_store",
        "imports megatron_ucp.storage.object_store", "isinstance(..., ObjectPath)",
        "isinstance(..., Path)"], found


# Library code a newcomer reads: no module over 500 lines, no function over 80. An exception is
# named here with the reason in docs/ARCHITECTURE.md ("Sizes"); there is none today.
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 80
SIZE_EXCEPTIONS: dict[str, str] = {}


def test_library_modules_and_functions_stay_readable():
    too_long = []
    for path in sorted((ROOT / "megatron_ucp").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES and rel not in SIZE_EXCEPTIONS:
            too_long.append(f"{rel}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES and f"{rel}:{node.name}" not in SIZE_EXCEPTIONS:
                    too_long.append(f"{rel}:{node.lineno} {node.name}: {lines} lines")
    assert too_long == [], ("split these (or name them in SIZE_EXCEPTIONS and say why in "
                            "docs/ARCHITECTURE.md):\n" + "\n".join(too_long))
