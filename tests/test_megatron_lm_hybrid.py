"""Megatron-LM core_v0.19.0's own checkpoints of a hybrid Mamba model (issue 22): written by its
unchanged pretrain_hybrid.py on CPU (tests/fixtures/megatron_lm_v019, `*hybrid*` sets;
megatron_ucp.testing.mamba_cpu in place of mamba_ssm's kernels) -> universal -> Megatron-LM
targets at other layouts.

(1) Every universal tensor (master weight, both Adam moments) equals the fixture's own optimizer
    state sliced by hand (tests/oracles.py `hybrid_*`: flat buffers in registration order, Mamba's
    in_proj [z, x, B, C, dt] and conv1d [x, B, C] sections put together section by section).
(2) Written at another layout in torch_dist and torch, then read back: the same tensors, bitwise,
    and the written files hold them by hand too.

The files pickle megatron-core 0.19 enums in their args, so they are read on megatron-core 0.19
(the Makefile's TESTS_MCORE19).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from conftest import READS_CORE_V019_FILES
from oracles import (
    hybrid_dp_reshardable_full,
    hybrid_legacy_full,
    hybrid_sections,
    universal_tensors,
)
from test_megatron_lm_v019 import written_back

from megatron_ucp.conversion import convert_legacy, convert_torch_dist
from megatron_ucp.errors import UCPError
from megatron_ucp.formats.megatron_common import check_supported
from megatron_ucp.layout import Layout

pytestmark = READS_CORE_V019_FILES

FIXTURES = Path(__file__).parent / "fixtures" / "megatron_lm_v019"
SETS = {"torch_dist_hybrid_tp2": (convert_torch_dist, hybrid_dp_reshardable_full),
        "torch_hybrid_pp2": (convert_legacy, hybrid_legacy_full)}
STATES = ("param", "exp_avg", "exp_avg_sq")
MAMBA = ("mixer.in_proj.weight", "mixer.conv1d.weight", "mixer.conv1d.bias", "mixer.A_log", "mixer.D",
         "mixer.dt_bias", "mixer.norm.weight", "mixer.out_proj.weight", "mixer.in_proj.layer_norm_weight")


def holds_assembly(universal: Path, full: dict[str, dict]) -> dict:
    """The universal conversion of a 6-iteration fixture holds the hand assembly `full` of its
    files bitwise; returns its manifest."""
    manifest, tensors = universal_tensors(universal)
    assert set(full) == set(manifest["params"]), sorted(set(full) ^ set(manifest["params"]))
    for n, states in full.items():
        assert manifest["params"][n]["step"] == 6.0, n
        for s in STATES:
            assert torch.equal(tensors[f"{n}/{s}"], states[s]), f"{n}/{s}"
        # the master weights cast to bf16 are the stored model weights (the offsets are right)
        assert torch.equal(tensors[f"{n}/param"].to(torch.bfloat16), states["model"]), n
    assert manifest["iteration"] == 6 and manifest["scheduler"]["num_steps"] == 24
    return manifest


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid019")
    return {s: fn(FIXTURES / s / "ckpt", root / s, progress=False) for s, (fn, _) in SETS.items()}


@pytest.mark.parametrize("name", SETS)
def test_hybrid_sets_match_independent_assembly(converted, name):
    manifest = holds_assembly(converted[name], SETS[name][1](FIXTURES / name / "ckpt"))
    # every Mamba piece of both Mamba layers, in_proj and conv1d with their sections
    pattern = manifest["model"]["hybrid_layer_pattern"]
    mamba_layers = [i for i, c in enumerate(pattern.replace("|", "")) if c == "M"]
    assert len(mamba_layers) == 2 and "E" in pattern or "*" in pattern
    args = argparse.Namespace(**{k: manifest["model"][k] for k in (
        "hidden_size", "mamba_num_heads", "mamba_head_dim", "mamba_num_groups", "mamba_state_dim")})
    for i in mamba_layers:
        for rest in MAMBA:
            assert f"decoder.layers.{i}.{rest}" in manifest["params"], (i, rest)
        for rest, sizes in hybrid_sections(args).items():
            assert manifest["params"][f"decoder.layers.{i}.{rest}"]["tp_sections"] == sizes


# (source set, target format, target layout, torch_dist optimizer form)
ROUND_TRIPS = [
    ("torch_dist_hybrid_tp2", "torch_dist", Layout(tp=1, pp=1, dp=2), "dp_reshardable"),
    ("torch_dist_hybrid_tp2", "torch", Layout(tp=1, pp=1, dp=2), None),
    ("torch_dist_hybrid_tp2", "torch_dist", Layout(tp=1, pp=2, dp=1), "fully_reshardable"),
    ("torch_hybrid_pp2", "torch", Layout(tp=1, pp=1, dp=2), None),
    ("torch_hybrid_pp2", "torch_dist", Layout(tp=1, pp=1, dp=2), "fully_reshardable"),
    ("torch_hybrid_pp2", "torch_dist", Layout(tp=1, pp=1, dp=2), "dp_reshardable"),
]


@pytest.mark.parametrize("src,fmt,lay,sharding", ROUND_TRIPS,
                         ids=lambda v: str(v) if isinstance(v, (str, Layout)) else "")
def test_hybrid_written_at_another_layout_reads_back_bitwise(converted, tmp_path, src, fmt, lay, sharding):
    out, m1, t1 = written_back(FIXTURES / src / "ckpt", converted[src], tmp_path, fmt, lay, sharding)
    if fmt == "torch" or sharding == "dp_reshardable":  # the written files by hand, too
        full = (hybrid_legacy_full if fmt == "torch" else hybrid_dp_reshardable_full)(out)
        assert set(full) == set(m1["params"])
        for n, states in full.items():
            assert all(torch.equal(states[s], t1[f"{n}/{s}"]) for s in STATES), n
            assert torch.equal(states["model"], t1[f"{n}/param"].to(torch.bfloat16)), n


def test_a_hybrid_run_with_another_spec_is_refused():
    """Megatron-LM's pretrain_hybrid.py takes its stack from `--spec`; megatron-ucp rebuilds the
    local layers (megatron_ucp.testing.mamba_cpu's spec builds the same), so another spec is
    refused by name, and a GPT run's `--spec` as before."""
    args = argparse.Namespace(hybrid_layer_pattern="M*", spec=["megatron_ucp.testing.mamba_cpu",
                                                             "hybrid_stack_spec_local"],
                              use_distributed_optimizer=True, world_size=1, tensor_model_parallel_size=1,
                              pipeline_model_parallel_size=1)
    check_supported(args, "ckpt")
    args.spec = ["my.module", "my_spec"]
    with pytest.raises(UCPError, match="--spec my.module my_spec is set .*hybrid_stack_spec_local"):
        check_supported(args, "ckpt")
    args.hybrid_layer_pattern = None
    with pytest.raises(UCPError, match="--spec my.module my_spec is set$"):
        check_supported(args, "ckpt")
