"""No checkpoint file runs code when read.

megatron-ucp's own forms are safetensors + JSON: reading them never unpickles. Megatron-LM's
`.pt` files and torch_dist objects are unpickled with torch's restricted unpickler and an explicit
allowlist of what Megatron-LM writes; anything else is refused unless the caller trusts the file.
"""

from __future__ import annotations

import argparse
import enum
import pathlib
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from oracles import assert_holds_universal, assert_universal_is_dump, legacy_full

from megatron_ucp import UCPError
from megatron_ucp.checks import diff, verify
from megatron_ucp.conversion import convert, convert_legacy, convert_torch_dist, reshard
from megatron_ucp.formats import open_source
from megatron_ucp.formats.megatron_common import torch_load
from megatron_ucp.layout import Layout
from megatron_ucp.mcore_compat import has_core_v019_enums

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "megatron_lm"
LEGACY = FIXTURES / "torch_tp2_pp2" / "ckpt"


def _poison(args_owner: Path) -> None:
    """Put a value of a type outside the allowlist into a rank file's args (as a run that kept a
    pathlib.Path in its args would)."""
    state = torch.load(args_owner, map_location="cpu", weights_only=False)
    state["args"].tokenizer_model = pathlib.PurePosixPath("/data/tokenizer.model")
    torch.save(state, args_owner)


def test_unexpected_type_is_refused_and_trust_pickle_allows_it(tmp_path):
    ckpt = Path(shutil.copytree(LEGACY, tmp_path / "ckpt"))
    for f in ckpt.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        _poison(f)
    with pytest.raises(UCPError) as ei:
        convert_legacy(ckpt, tmp_path / "u", progress=False)
    msg = str(ei.value)
    assert "model_optim_rng.pt: refusing to unpickle pathlib.PurePosixPath" in msg, msg
    assert "--trust-pickle" in msg
    assert not (tmp_path / "u").exists()
    out = convert_legacy(ckpt, tmp_path / "u", progress=False, trust_pickle=True)
    assert all(d.max_abs == 0 for d in diff(LEGACY, out))
    assert assert_holds_universal(legacy_full(LEGACY), out, torch.bfloat16, step=6.0) > 0


def test_megatron_files_load_with_the_allowlist(tmp_path):
    """Every fixture (args with enums and dtypes, numpy RNG state, torch_dist objects) reads with
    the restricted unpickler: the allowlist covers what Megatron-LM core_v0.16.1 writes."""
    for name in ("torch_moe_grouped_ep2", "torch_vpp"):
        convert_legacy(FIXTURES / name / "ckpt", tmp_path / name, progress=False)
    convert_torch_dist(FIXTURES / "torch_dist_tp2_dp2" / "ckpt", tmp_path / "dist", progress=False)


@pytest.fixture
def no_unpickling(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a megatron-ucp checkpoint read tried to unpickle")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)


def test_own_formats_never_unpickle(source_runs, tmp_path, no_unpickling, monkeypatch):
    source = source_runs.get("tp2", {"dtype": "fp32"})
    saved = source["ckpt"]
    udir = convert(saved, tmp_path / "u", progress=False)
    for path in (saved, udir):
        assert verify(path).startswith("OK")
        src = open_source(path)
        name = "decoder.final_layernorm.weight"
        assert src.read(name, "exp_avg", (0,), (64,)).shape == (64,)
        assert src.rng(0) is not None
    assert all(d.max_abs == 0 for d in diff(saved, udir))
    monkeypatch.undo()  # the saving run's dump is a pickle: the independent check reads it
    assert assert_universal_is_dump(udir, source["dump"]) > 0


class _NewerScope(enum.Enum):  # an enum a newer megatron-core added (0.19's InferenceCudaGraphScope)
    none = 0
    block = 2


def test_enum_of_a_newer_megatron_core_reads_as_its_value(tmp_path, monkeypatch):
    """args that pickle an enum this megatron-core lacks read with the member's value in its place;
    anything else outside the allowlist is still refused (the test above)."""
    import megatron.core.transformer.enums as enums

    name = "NewerScopeForUnpicklingTest"
    _NewerScope.__module__, _NewerScope.__qualname__ = enums.__name__, name
    with monkeypatch.context() as m:  # pickled by reference while the class exists
        m.setattr(enums, name, _NewerScope, raising=False)
        torch.save({"args": argparse.Namespace(scope=_NewerScope.block, layers=3)}, tmp_path / "f.pt")
    assert not hasattr(enums, name)
    args = torch_load(tmp_path / "f.pt", "")["args"]
    assert (args.scope, args.layers) == (2, 3)


@pytest.mark.skipif(has_core_v019_enums(), reason="megatron-core 0.19 has the enum")
def test_core_v0_19_checkpoint_converts_under_0_16_for_0_16_to_load(tmp_path):
    """Megatron-LM core_v0.19.0's args pickle InferenceCudaGraphScope (absent from 0.16): its
    checkpoints read under megatron-core 0.16, and what is written there unpickles with plain
    torch.load, as Megatron-LM 0.16 loads it (it resumes: tools/mlm_resume)."""
    v019 = FIXTURES.parent / "megatron_lm_v019"
    src = open_source(v019 / "torch_dp2" / "ckpt")
    assert src.step(next(iter(src.manifest.params))) == 6.0
    out = reshard(v019 / "torch_dist_tp2_dp2" / "ckpt", tmp_path / "out", Layout(tp=1, pp=1, dp=2),
                  "torch", progress=False)
    saved = torch.load(Path(out.output) / "iter_0000006" / "mp_rank_00" / "model_optim_rng.pt",
                       map_location="cpu", weights_only=False)
    assert saved["args"].inference_cuda_graph_scope == 1 and saved["args"].tensor_model_parallel_size == 1
    assert all(d.max_abs == 0 for d in diff(v019 / "torch_dist_tp2_dp2" / "ckpt", out.output))
