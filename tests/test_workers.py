"""--workers: universal data files written by forked workers hold exactly the same tensors."""

from __future__ import annotations

from pathlib import Path

import torch
from oracles import assert_holds_universal, assert_universal_is_dump, legacy_full

import megatron_ucp as ucp
from megatron_ucp.checks import diff, verify
from megatron_ucp.conversion import convert_legacy
from megatron_ucp.formats import manifest as mf

LEGACY = Path(__file__).parent / "fixtures" / "megatron_lm" / "torch_tp2_pp2" / "ckpt"


def test_consolidate_with_workers_matches_one_process(source_runs, tmp_path):
    source = source_runs.get("tp2", {"dtype": "fp32"})
    saved = source["ckpt"]
    one = ucp.convert(saved, tmp_path / "one", progress=False)
    two = ucp.convert(saved, tmp_path / "two", progress=False, workers=2)
    for out in (one, two):  # read with safetensors, against the saving run's own dump
        assert assert_universal_is_dump(out, source["dump"]) > 0
    assert len(list(one.glob("params_*.safetensors"))) == 1
    assert len(list(two.glob("params_*.safetensors"))) >= 2
    assert verify(two).startswith("OK")
    assert all(d.max_abs == 0 for d in diff(one, two))
    assert mf.read(one).params.keys() == mf.read(two).params.keys()


def test_legacy_import_with_workers(tmp_path):
    one = convert_legacy(LEGACY, tmp_path / "one", progress=False)
    two = convert_legacy(LEGACY, tmp_path / "two", progress=False, workers=2)
    assert len(list(two.glob("params_*.safetensors"))) >= 2
    assert all(d.max_abs == 0 for d in diff(one, two))
    full = legacy_full(LEGACY)  # torch.load and the flat-buffer rule, no megatron_ucp reader
    for out in (one, two):
        assert assert_holds_universal(full, out, torch.bfloat16, step=6.0) > 0
