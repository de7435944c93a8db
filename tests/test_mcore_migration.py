"""Checkpoints cross megatron-core releases: saved under 0.16 (Python 3.11), resumed under 0.19
(Python 3.12) at another layout, and the other way round.

Each side runs in its own venv's interpreter (`launch(python=...)`): `.venv` (0.16) and `.venv312`
(0.19), as `make test` builds them, or UCP_PYTHON_MCORE16 / UCP_PYTHON_MCORE19. After the load,
every model tensor and optimizer shard (fp32 master weight, both Adam moments, step) equals,
bitwise, the saving run's state assembled independently (tests/reference.py); the loss continues.
The model is a MoE GPT (SequentialMLP experts, EP2 with TP2 and SP -> EP1) so expert renumbering crosses
the releases too.
"""

from __future__ import annotations

import itertools
import os
import subprocess
from pathlib import Path

import pytest
from conftest import MCORE_RELEASES, SCENARIOS
from reference import assemble, compare_to_reference

from megatron_ucp.testing.launch import launch

ROOT = Path(__file__).resolve().parent.parent
# each tested release's interpreter: its venv (configs/mcore_releases.json), or its `python_env`
PYTHONS = {r["series"]: os.environ.get(r["python_env"], str(ROOT / r["venv"] / "bin" / "python"))
           for r in MCORE_RELEASES["releases"]}
CFG = {"num_experts": 4, "add_bias_linear": False, "num_layers": 2}
SRC_CFG = {**CFG, "sequence_parallel": True}  # megatron-core wants SP with MoE and TP
STEPS = 2


def _release(python: str) -> str | None:
    """megatron-core's major.minor in `python`'s environment, None if it has none."""
    if not Path(python).exists():
        return None
    r = subprocess.run([python, "-c", "import megatron.core as m; print(m.__version__)"],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    return ".".join(r.stdout.strip().splitlines()[-1].split(".")[:2]) if r.returncode == 0 else None


@pytest.fixture(scope="module")
def pythons() -> dict[str, str]:
    found = {want: _release(py) for want, py in PYTHONS.items()}
    wrong = {want: (PYTHONS[want], got) for want, got in found.items() if got != want}
    if wrong:
        pytest.skip("needs both venvs (`make test` builds .venv with megatron-core 0.16 and .venv312 "
                    "with 0.19; or set UCP_PYTHON_MCORE16 / UCP_PYTHON_MCORE19); found "
                    + ", ".join(f"{py}: megatron-core {got}" for py, got in wrong.values()))
    return PYTHONS


@pytest.mark.parametrize("src,dst", list(itertools.permutations(PYTHONS, 2)))
def test_checkpoint_crosses_releases_at_another_layout(src, dst, pythons, tmp_path):
    # as cpu_shim sets it, but before torch is imported: on 0.19 a MoE router function is compiled,
    # and dynamo's device probe cannot handle the shim's CPU "current device"
    env = {"PYTHONPATH": str(ROOT), "TORCHDYNAMO_DISABLE": "1"}
    save = launch(4, f"{SCENARIOS}:train_and_save",
                  {"layout": "tp2ep2dp2", "cfg": SRC_CFG, "steps": STEPS, "save_dir": str(tmp_path / "ckpt"),
                   "continue_steps": STEPS, "dump_dir": str(tmp_path / "src_dump")},
                  python=pythons[src], env=env)
    res = launch(2, f"{SCENARIOS}:load_and_train",
                 {"layout": "dp2", "cfg": CFG, "load_dir": str(tmp_path / "ckpt"), "steps": STEPS,
                  "dump_dir": str(tmp_path / "dst_dump")}, python=pythons[dst], env=env)
    assert res[0]["iteration"] == STEPS
    expected = assemble(tmp_path / "src_dump", False)
    assert compare_to_reference(tmp_path / "dst_dump", expected, False) > len(expected)
    ref, got = save[0]["continued"], res[0]["losses"]
    assert all(abs(g - r) <= 1e-5 * abs(r) for g, r in zip(got, ref)), (ref, got)
