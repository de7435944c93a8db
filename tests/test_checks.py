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
    from megatron_ucp.reshard import convert_torch_dist

    udir = convert_torch_dist(src, tmp_path / "u", progress=False)
    rows = diff(src, udir)
    assert len(rows) == 3 * len(mf.read(udir).params) and all(r.max_abs == 0 for r in rows)
    full = fully_reshardable_full(src, list(mf.read(udir).params))
    assert assert_holds_universal(full, udir, torch.bfloat16) == len(rows)


def test_detect_rejects_unknown(tmp_path):
    with pytest.raises(ucp.UCPError, match="unknown checkpoint format"):
        detect(tmp_path)
