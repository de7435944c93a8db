"""The FP8 state part of the format (docs/FORMAT.md "Transformer Engine FP8 state") without
Transformer Engine: `te_state.safetensors` round trip with checksums, the manifest field's
validation and version (4 only with `te_state`)."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_ucp import UCPError, te_state
from megatron_ucp.formats.manifest import Manifest
from megatron_ucp.layout import Layout
from megatron_ucp.storage import Reader, location

RECIPE = {"class": "DelayedScaling", "fp8_format": "HYBRID", "amax_history_len": 4, "margin": 0}


def _state(seed: float) -> te_state.ModuleState:
    return te_state.ModuleState(RECIPE, {"num_gemms": 1}, "te2-pickle", {
        "scale_fwd": torch.tensor([1.0, 2.0, seed]), "amax_history_fwd": torch.full((4, 3), seed),
        "scale_bwd": torch.tensor([0.5, seed]), "amax_history_bwd": torch.full((4, 2), -seed)})


def _manifest(field: dict | None) -> Manifest:
    m = Manifest.fragments(iteration=1, layout=Layout(), world_size=1, model={},
                           optimizer={"param_groups": []}, scheduler=None, extra={}, seed=1)
    m.te_state = field
    return m


def test_file_round_trip_and_checksums(tmp_path):
    states = {"decoder.layers.0.self_attention.linear_proj._extra_state": _state(3.0),
              "decoder.layers.1.self_attention.linear_proj._extra_state": _state(7.0)}
    field = te_state.write(location(tmp_path), states)
    back = te_state.read(Reader(), location(tmp_path), field, list(states) + ["absent._extra_state"])
    assert back.keys() == states.keys()
    for name, st in states.items():
        assert back[name].header() == st.header()
        assert all(torch.equal(back[name].tensors[k], t) for k, t in st.tensors.items())
    field["modules"][next(iter(states))]["crc32"]["scale_fwd"] ^= 1
    with pytest.raises(UCPError, match="crc32"):
        te_state.read(Reader(), location(tmp_path), field, list(states))


def test_manifest_version_and_validation():
    plain = _manifest(None).to_json()
    assert plain["version"] == 3 and "te_state" not in plain
    field = {"file": te_state.TE_STATE_FILE, "modules": {"m._extra_state": {
        **_state(1.0).header(), "crc32": {k: 0 for k in te_state.DELAYED_TENSORS}}}}
    d = _manifest(field).to_json()
    assert d["version"] == 4
    assert Manifest.from_json(json.loads(json.dumps(d)), "m").te_state == field
    for bad, match in [({**d, "version": 3}, "field of format version 4"),
                       (_edit(d, recipe={"class": "MyRecipe"}), "MyRecipe"),
                       (_edit(d, crc32={"scale_fwd": 0}), "crc32"),
                       (_edit(d, form="pickle"), "form")]:
        with pytest.raises(UCPError, match=match):
            Manifest.from_json(bad, "m")


def _edit(d: dict, **entry) -> dict:
    d = json.loads(json.dumps(d))
    d["te_state"]["modules"]["m._extra_state"].update(entry)
    return d
