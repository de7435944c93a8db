"""tools/reshard.py on real Megatron-LM checkpoints and on megatron-ucp saves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from oracles import assert_holds_universal, assert_universal_is_dump, legacy_full

import megatron_ucp as ucp
from megatron_ucp.checks import diff, verify
from megatron_ucp.conversion import reshard
from megatron_ucp.formats import manifest as mf
from megatron_ucp.layout import Layout

ROOT = Path(__file__).resolve().parent.parent
LEGACY = ROOT / "tests" / "fixtures" / "megatron_lm" / "torch_tp2_pp2" / "ckpt"


def test_reshard_tool_legacy_checkpoint(tmp_path):
    out = tmp_path / "u"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "reshard.py"), "--load", str(LEGACY),
                        "--save", str(out), "--target-tp", "1", "--target-pp", "1", "--target-dp", "2",
                        "--workers", "2", "--no-progress"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "resharded megatron_torch -> universal" in r.stdout and "MiB/s" in r.stdout
    m = mf.read(out).to_json()
    assert m["kind"] == "universal" and m["iteration"] == 6
    assert len(list(out.glob("params_*.safetensors"))) >= 2  # --workers 2: files split for 2 writers
    assert verify(out).startswith("OK")
    assert all(d.max_abs == 0 for d in diff(LEGACY, out))
    assert assert_holds_universal(legacy_full(LEGACY), out, torch.bfloat16, step=6.0) > 0


def test_reshard_fragments_and_impossible_target(source_runs, tmp_path):
    source = source_runs.get("tp2", {"dtype": "fp32"})
    s = reshard(source["ckpt"], tmp_path / "ok", Layout(tp=4), progress=False)
    assert s.source_kind == "fragments" and s.params == len(mf.read(tmp_path / "ok").params)
    assert assert_universal_is_dump(tmp_path / "ok", source["dump"]) > 0
    with pytest.raises(ucp.UCPError, match="num_attention_heads=4 is not divisible by TP=3"):
        reshard(source["ckpt"], tmp_path / "bad", Layout(tp=3), progress=False)
    assert not (tmp_path / "bad").exists()


def test_reshard_to_torch_needs_a_target_layout(tmp_path):
    with pytest.raises(ucp.UCPError, match="--target-format torch: .* needs a target layout"):
        reshard(LEGACY, tmp_path / "x", target_format="torch")


def test_universal_read_into_equals_read_for_every_box_kind(tmp_path):
    """The load's in-place read of a universal checkpoint (`UniversalSource.read_into`: pread for a
    box that is one row-major run, a whole tensor checked against its crc32) gives `read`'s values
    bitwise for whole tensors, row ranges, single rows' parts and column blocks; a corrupted byte
    in a whole-tensor read is refused naming the file."""
    from megatron_ucp.formats import open_source
    out = tmp_path / "u"
    reshard(LEGACY, out, progress=False)
    src = open_source(out)
    n = 0
    for name, p in src.manifest.params.items():
        shape = tuple(p.shape)
        boxes = [((0,) * len(shape), shape)]
        if len(shape) == 2 and shape[0] > 2:
            r, c = shape
            boxes += [((1, 0), (r - 2, c)), ((r // 2, 1), (1, c - 1)), ((0, c // 2), (r, c - c // 2))]
        for state in p.states:
            for offset, box in boxes:
                got = torch.empty(box, dtype=torch.float32)
                src.read_into(name, state, offset, box, got)
                assert torch.equal(got, src.read(name, state, offset, box)), (name, state, offset, box)
                n += 1
    assert n > 50
    name, p = next((k, v) for k, v in src.manifest.params.items() if len(v.shape) == 2)
    entry = p.tensors["param"]
    run = src.reader.byte_run(out / entry.file, entry.key)
    with open(out / entry.file, "r+b") as f:
        f.seek(run.offset + 8)
        byte = f.read(1)
        f.seek(run.offset + 8)
        f.write(bytes([byte[0] ^ 0xFF]))
    fresh = open_source(out)
    with pytest.raises(ucp.UCPError, match=rf"{entry.file}: checksum mismatch in tensor"):
        fresh.read_into(name, "param", (0, 0), tuple(p.shape), torch.empty(tuple(p.shape)))
