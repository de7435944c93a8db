"""`megatron-ucp verify` and `megatron-ucp diff` on real checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from oracles import assert_holds_universal, assert_universal_is_dump, fully_reshardable_full

import megatron_ucp as ucp
from megatron_ucp.checks import diff, verify
from megatron_ucp.cli import main
from megatron_ucp.formats import detect
from megatron_ucp.formats import manifest as mf

FIXTURES = Path(__file__).parent / "fixtures" / "megatron_lm"


@pytest.fixture(scope="module")
def saved(source_runs):
    return source_runs.get("tp2", {"dtype": "fp32"})["ckpt"]


def test_verify_fragments_and_universal(saved, tmp_path, capsys):
    assert verify(saved).startswith("OK ")
    udir = ucp.convert(saved, tmp_path / "u", progress=False)
    assert "universal" in verify(udir)
    assert main(["verify", str(udir)]) == 0
    assert "tensors verified" in capsys.readouterr().out


def test_verify_finds_a_flipped_byte(saved, tmp_path):
    ckpt = shutil.copytree(mf.resolve(saved), tmp_path / "c")
    path = ckpt / "rank_00001.safetensors"
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    key = next(k for k in header if k.endswith("linear_fc2.weight/exp_avg"))
    raw[8 + n + header[key]["data_offsets"][0] + 5] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(ucp.UCPError, match=r"rank_00001\.safetensors: checksum mismatch in tensor"):
        verify(ckpt)


def test_diff_same_state_across_forms_is_zero(saved, source_runs, tmp_path):
    udir = ucp.convert(saved, tmp_path / "u", progress=False)
    rows = diff(saved, udir)
    assert rows and all(r.max_abs == 0.0 for r in rows)
    # diff reads both sides with megatron_ucp's readers: the conversion against the saving
    # run's own dump, assembled without them
    assert assert_universal_is_dump(udir, source_runs.get("tp2", {"dtype": "fp32"})["dump"]) > 0


def test_diff_names_the_changed_tensor(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    udir = ucp.convert(saved, tmp_path / "u", progress=False)
    m = mf.read(udir).to_json()
    entry = m["params"]["decoder.final_layernorm.weight"]["tensors"]["exp_avg"]
    tensors = load_file(udir / entry["file"])
    tensors[entry["key"]][3] += 0.5
    save_file(tensors, udir / entry["file"])
    rows = {(r.name, r.state): r for r in diff(saved, udir)}
    assert rows[("decoder.final_layernorm.weight", "exp_avg")].max_abs == pytest.approx(0.5)
    assert sum(r.max_abs > 0 for r in rows.values()) == 1


def test_diff_megatron_torch_dist_against_its_import(tmp_path):
    src = FIXTURES / "torch_dist_pp2_fullyreshardable" / "ckpt"
    assert detect(src) == "megatron_torch_dist"
    from megatron_ucp.conversion import convert_torch_dist

    udir = convert_torch_dist(src, tmp_path / "u", progress=False)
    rows = diff(src, udir)
    # per parameter: its step and three states; plus the iteration
    n_params = len(mf.read(udir).params)
    assert len(rows) == 1 + 4 * n_params and all(r.max_abs == 0 for r in rows)
    full = fully_reshardable_full(src, list(mf.read(udir).params))
    assert assert_holds_universal(full, udir, torch.bfloat16) == 3 * n_params


def test_detect_rejects_unknown(tmp_path):
    with pytest.raises(ucp.UCPError, match="unknown checkpoint format"):
        detect(tmp_path)


def _edit_universal(udir: Path, edit) -> None:
    path = udir / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


@pytest.fixture(scope="module")
def universal(saved, tmp_path_factory) -> Path:
    return ucp.convert(saved, tmp_path_factory.mktemp("diff") / "u", progress=False)


def test_diff_identical_exits_zero(saved, universal, capsys):
    assert main(["diff", str(saved), str(universal)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("; identical")


def test_diff_sees_states_missing_everywhere(saved, universal, tmp_path, capsys):
    """A conversion that lost every Adam moment (each parameter stored like a buffer, weights
    only): two `missing` rows per parameter, exit status 1."""
    u = Path(shutil.copytree(universal, tmp_path / "u"))

    def drop(m):
        for p in m["params"].values():
            p["buffer"] = True
            del p["tensors"]["exp_avg"], p["tensors"]["exp_avg_sq"]
    _edit_universal(u, drop)
    rows = diff(saved, u)
    names = set(mf.read(universal).params)
    missing = {(r.name, r.state) for r in rows if r.missing}
    assert missing == {(n, s) for n in names for s in ("exp_avg", "exp_avg_sq")}
    assert all(r.missing == "B" and r.differs() for r in rows if r.missing)
    assert main(["diff", str(saved), str(u)]) == 1
    out = capsys.readouterr().out
    assert f"missing in B ({2 * len(names)}): " in out and "/exp_avg_sq" in out
    assert main(["diff", str(u), str(saved)]) == 1  # the other way round: missing in A
    assert f"missing in A ({2 * len(names)}): " in capsys.readouterr().out


def test_diff_sees_a_reset_step_and_iteration(saved, universal, tmp_path, capsys):
    u = Path(shutil.copytree(universal, tmp_path / "u"))
    name = "decoder.final_layernorm.weight"

    def reset(m):
        m["params"][name]["step"] = 0
        m["iteration"] = 0
    _edit_universal(u, reset)
    rows = {(r.name, r.state): r for r in diff(saved, u)}
    saved_step = mf.read(universal).params[name].step
    assert saved_step > 0
    assert rows[(name, "step")].max_abs == saved_step and rows[(name, "step")].differs()
    assert rows[("(checkpoint)", "iteration")].max_abs == mf.read(universal).iteration
    assert sum(r.differs() for r in rows.values()) == 2
    assert main(["diff", str(saved), str(u)]) == 1
    assert "2 rows differ" in capsys.readouterr().out


def test_diff_sees_a_missing_parameter_and_tolerances(saved, universal, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    u = Path(shutil.copytree(universal, tmp_path / "u"))
    lost = "decoder.layers.0.mlp.linear_fc2.bias"
    changed = "decoder.final_layernorm.weight"
    entry = mf.read(u).params[changed].tensors["param"]
    tensors = load_file(u / entry.file)
    tensors[entry.key] *= 1 + 1e-3
    save_file(tensors, u / entry.file)
    _edit_universal(u, lambda m: m["params"].pop(lost))
    rows = diff(saved, u)
    assert [(r.name, r.missing) for r in rows if r.missing] == [(lost, "B")]
    assert main(["diff", str(saved), str(u), "--rtol", "1e-2"]) == 1  # the lost parameter still counts
    assert f"missing in B (1): {lost}" in capsys.readouterr().out
    _edit_universal(u, lambda m: m["params"].update({lost: mf.read(universal).to_json()["params"][lost]}))
    assert main(["diff", str(saved), str(u)]) == 1
    assert main(["diff", str(saved), str(u), "--rtol", "2e-3"]) == 0
    assert "within tolerance" in capsys.readouterr().out.splitlines()[-1]
