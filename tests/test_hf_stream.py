"""Live weight sync (`megatron_ucp.export_hf_weights`): the HF tensors streamed from a running model
at TP2 x PP2 (llama) and DP2 x EP2 (mixtral) are bitwise export-hf of a checkpoint saved at that step."""

from __future__ import annotations

import pytest
import torch
from conftest import nprocs
from safetensors.torch import load_file
from test_hf_export import CFGS

from megatron_ucp.conversion import export_hf
from megatron_ucp.errors import UCPError
from megatron_ucp.testing.launch import launch

CASES = {"llama": ("tp2pp2", CFGS["llama"]),
         "mixtral": ("dp2ep2", {**CFGS["mixtral"], "sequence_parallel": False})}


@pytest.mark.parametrize("arch", list(CASES))
def test_streamed_weights_are_export_hf_of_a_checkpoint(tmp_path, arch):
    layout, cfg = CASES[arch]
    run = {"cfg": cfg, "arch": arch, "save_dir": str(tmp_path / "ckpt"), "stream": str(tmp_path / "s.st")}
    res = launch(nprocs(layout), "megatron_ucp.testing.hf_scenarios:stream_and_save",
                 {"layout": layout, "runs": [run], "steps": 2})
    streamed = load_file(run["stream"])
    out = export_hf(tmp_path / "ckpt", tmp_path / "hf", arch, dtype="bf16", progress=False)
    exported = {}
    for f in sorted(out.glob("*.safetensors")):
        exported.update(load_file(f))
    assert sorted(streamed) == sorted(exported)
    differ = [n for n, t in exported.items()
              if streamed[n].dtype != t.dtype or not torch.equal(streamed[n], t)]
    assert not differ, differ
    assert res[0][0]["bytes"] == sum(t.numel() * t.element_size() for t in exported.values())


def test_streaming_needs_a_process_group():
    from megatron_ucp import export_hf_weights

    with pytest.raises(UCPError, match="initialise torch.distributed"):
        next(export_hf_weights([], "llama"))
