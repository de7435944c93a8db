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
