"""The GPU check (tools/gpu/), prepared here for a GPU machine that has no network: its scripts
parse, its wheel list is consistent (and the wheel folder matches it, when `make gpu-wheels` has
filled it), its dry run passes on this host (the offline install of this Python's wheels included,
when they are here), and the dump comparison it runs on the GPU finds a one-bit difference.
Needs neither a GPU nor the downloaded wheels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools" / "gpu"
sys.path.insert(0, str(TOOLS))
import gpu_check  # noqa: E402  (tools/gpu is no package)
import wheels  # noqa: E402


def test_scripts_parse():
    subprocess.run(["bash", "-n", str(TOOLS / "gpu_check.sh")], check=True)
    for f in ("gpu_check.py", "wheels.py"):
        compile((TOOLS / f).read_text(), f, "exec")


def test_wheel_list_is_consistent():
    _, rows = wheels.read_list()
    assert wheels.list_problems(rows) == []
    # each carried Python gets the megatron-core release configs/mcore_releases.json tests with it
    matrix = json.loads((ROOT / "configs" / "mcore_releases.json").read_text())
    tested = {r["series"]: r["tested"] for r in matrix["releases"]}
    for py in wheels.PYTHONS:
        (mc,) = [r for r in rows if r.dist == "megatron-core" and py in r.pythons()]
        assert mc.version == tested["0.19" if int(py.split(".")[1]) >= 12 else "0.16"], (py, mc.version)
        assert mc.need == "always"
    assert not any(r.dist in ("torch", "numpy") for r in rows)  # the image's own
    assert sum(r.nbytes for r in rows) < wheels.WHEEL_BUDGET_MIB * wheels.MIB
    if wheels.WHEEL_DIR.is_dir():
        assert wheels.folder_problems(rows, wheels.WHEEL_DIR) == []


def test_wheel_tags():
    assert wheels.fits("safetensors-0.8.0-cp310-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", "3.12")
    assert wheels.fits("tqdm-4.70.1-py3-none-any.whl", "3.10")
    mc312 = "megatron_core-0.19.2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"
    assert wheels.fits(mc312, "3.12") and not wheels.fits(mc312, "3.11")
    assert not wheels.fits("x-1.0-cp312-cp312-manylinux_2_28_aarch64.whl", "3.12")
    bad = wheels.Row("3.12", "tqdm", "4.70.1", "tqdm", "sometimes", 1, "0" * 64, mc312)
    problems = wheels.list_problems([bad])
    assert any("need must be" in p for p in problems) and any("is not tqdm" in p for p in problems)


def test_needed_reads_this_python():
    row = wheels.Row("any", "packaging", "26.4", "packaging", ">=999", 1, "0" * 64, "p.whl")
    assert wheels.needed(row)[0]  # older than 999
    assert not wheels.needed(wheels.Row("any", "tqdm", "4", "tqdm", "present", 1, "0" * 64, "t.whl"))[0]
    absent = wheels.Row("any", "x", "1", "no_such_module_xyz", "present", 1, "0" * 64, "x.whl")
    assert wheels.needed(absent)[0]


def _dump(path: Path, exp_avg: torch.Tensor) -> None:
    path.mkdir()
    entry = {"chunk": 0, "name": "w", "model": torch.ones(4, dtype=torch.bfloat16), "range": (0, 4),
             "step": 3.0, "states": ["param", "exp_avg"], "param": torch.ones(4), "exp_avg": exp_avg}
    torch.save({"coords": {}, "params": [entry]}, path / "rank0.pt")


def test_dump_comparison_finds_one_bit(tmp_path):
    x = torch.tensor([0.1, 0.2, 0.3, 0.4])
    _dump(tmp_path / "a", x)
    _dump(tmp_path / "b", x.clone())
    flipped = x.clone()
    flipped.view(torch.int32)[2] ^= 1  # the last mantissa bit
    _dump(tmp_path / "c", flipped)
    same = gpu_check.compare_dumps(tmp_path / "a", tmp_path / "b")
    assert same["mismatches"] == [] and same["optimizer_tensors"] == 2 and same["steps"] == [3.0]
    assert gpu_check.compare_dumps(tmp_path / "a", tmp_path / "c")["mismatches"] == ["rank0.pt w: exp_avg"]


def test_figures_name_every_step_and_the_verdict():
    results = {"probe": {"status": "pass", "torch": "2.11.0", "cuda_available": False},
               "bitwise_ws2_one_gpu": {"status": "refused", "reason": "NCCL refuses two ranks on one GPU"},
               "staging": {"status": "timeout", "reason": "killed after 150 s"}}
    text = gpu_check.figures(results, 12.0, 390.0, rehearsal=False, dry=False)
    assert "REFUSED" in text and "TIMEOUT" in text and "RESULT                FAIL" in text


@pytest.mark.skipif(sys.platform != "linux", reason="the GPU machine runs Linux; bash and timeout")
def test_dry_run(tmp_path):
    """The dry run as the GPU session would start it, with this Python: with the wheel folder
    present it also installs this Python's wheels offline and imports megatron-core from there."""
    env = dict(os.environ, GPU_CHECK_PYTHON=sys.executable)
    env.pop("OUT", None)
    r = subprocess.run(["bash", str(TOOLS / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "gpu_check: dry run ok" in r.stdout and "GPU CHECK FIGURES (DRY RUN" in r.stdout
    if wheels.WHEEL_DIR.is_dir() and wheels.this_python() in wheels.selected(wheels.WHEEL_DIR):
        assert "megatron.core from /tmp/ucp_gpu_dry_site." in r.stdout


def test_install_without_pip_unzips(tmp_path, monkeypatch):
    """A Python without pip: the wheel's packages (and its .data/purelib) are unzipped."""
    import zipfile

    whl = tmp_path / "demo_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("demo_pkg/__init__.py", "X = 1\n")
        z.writestr("demo_pkg-1.0.data/purelib/demo_extra.py", "Y = 2\n")
        z.writestr("demo_pkg-1.0.data/scripts/tool", "#!/bin/sh\n")
        z.writestr("demo_pkg-1.0.dist-info/METADATA", "Name: demo-pkg\n")
    real = wheels.importlib.util.find_spec
    monkeypatch.setattr(wheels.importlib.util, "find_spec",
                        lambda name: None if name == "pip" else real(name))
    wheels.install_files([whl], tmp_path / "site")
    site = tmp_path / "site"
    assert (site / "demo_pkg" / "__init__.py").read_text() == "X = 1\n"
    assert (site / "demo_extra.py").is_file() and not (site / "tool").exists()
    assert (site / "demo_pkg-1.0.dist-info" / "METADATA").is_file()
