"""The package works on the installed megatron-core release, whichever supported one it is.

megatron-core 0.19 removed classes the package used to import by name (GroupedMLP), so a release
difference shows up first as an import failure of every command, the offline ones included. These
tests import every module in a fresh interpreter and run the offline CLI end to end on a
Megatron-LM torch_dist fixture, checking the converted values against the source.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
    assert mcore_compat.MCORE_VERSION >= (0, 16)


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
