"""Megatron-LM core_v0.16.1's own checkpoint of a hybrid Mamba model (issue 22): written by its
unchanged pretrain_mamba.py on CPU (tests/fixtures/megatron_lm/torch_dist_hybrid_tp2; TP2,
torch_dist, the default dp_reshardable optimizer, pattern `M*M-` given as
`--hybrid-override-pattern`; megatron_ucp.testing.mamba_cpu in place of mamba_ssm's kernels)
-> universal -> Megatron-LM targets at another layout.

(1) Every universal tensor (master weight, both Adam moments) equals the fixture's own flat
    buckets sliced by hand (tests/oracles.py `hybrid_dp_reshardable_full`), and the master weights
    cast to bf16 are the stored model weights.
(2) Written at TP1 DP2 as torch_dist (dp_reshardable) and torch, then read back: the same tensors,
    bitwise, and the written files hold them by hand too.

(3) core_v0.19.0's hybrid set of the same model converts under this release too, and so does a
    `--ckpt-format torch` save in the other release's form (conv1d named and ordered as there).

The 0.16.1 suite's counterpart of tests/test_megatron_lm_hybrid.py (core_v0.19.0's hybrid sets);
it runs on megatron-core 0.19 as well (the Makefile's TESTS_MCORE19): the two releases' Mamba
mixers register their parameters in other orders (megatron_ucp.mcore_compat), so each reads the
other's dp_reshardable buffers in the saving release's order.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from helpers import assert_same_tensors
from oracles import (
    WORD,
    args_hybrid_pattern,
    flat_layout,
    hybrid_dp_reshardable_full,
    hybrid_layer_params,
    hybrid_legacy_full,
    hybrid_universal_name,
    universal_tensors,
)
from test_megatron_lm_hybrid import STATES, holds_assembly
from test_megatron_lm_v019 import written_back

from megatron_ucp.conversion import convert_legacy, convert_torch_dist, reshard
from megatron_ucp.layout import Layout

CKPT = Path(__file__).parent / "fixtures" / "megatron_lm" / "torch_dist_hybrid_tp2" / "ckpt"
V019 = Path(__file__).parent / "fixtures" / "megatron_lm_v019"


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    return convert_torch_dist(CKPT, tmp_path_factory.mktemp("hybrid16") / "u", progress=False)


def test_hybrid_016_matches_independent_assembly(converted):
    full = hybrid_dp_reshardable_full(CKPT)
    assert len(full) == 27  # embedding, 2 x 9 Mamba, 3 attention, 3 MLP, final norm, output
    manifest = holds_assembly(converted, full)
    assert manifest["model"]["hybrid_layer_pattern"] == "M*M-"
    assert [manifest["layout"][k] for k in ("tp", "pp", "dp")] == [2, 1, 1]


@pytest.mark.parametrize("fmt,sharding", [("torch_dist", "dp_reshardable"), ("torch", None)])
def test_hybrid_016_written_at_tp1_dp2_reads_back_bitwise(converted, tmp_path, fmt, sharding):
    out, m1, t1 = written_back(CKPT, converted, tmp_path, fmt, Layout(tp=1, pp=1, dp=2), sharding)
    full = (hybrid_legacy_full if fmt == "torch" else hybrid_dp_reshardable_full)(out)
    assert set(full) == set(m1["params"])
    for n, states in full.items():
        assert all(torch.equal(states[s], t1[f"{n}/{s}"]) for s in STATES), n
        assert torch.equal(states["model"], t1[f"{n}/param"].to(torch.bfloat16)), n


def test_hybrid_019_set_converts_under_this_release(tmp_path):
    """core_v0.19.0's hybrid set (tests/fixtures/megatron_lm_v019/torch_dist_hybrid_tp2, the same
    model) converted under this release: its Mamba layers' buffers are in megatron-core 0.19's
    order (conv1d first), which megatron-core 0.16 does not register (it was refused: master weight
    of `mixer.A_log` differs from the stored model tensor). Every tensor bitwise against the
    hand-sliced buckets; the fields of its common state the slicing needs are its flags
    (../megatron_lm_v019/torch_dist_hybrid_tp2/cmd.txt), as 0.16 cannot unpickle its args."""
    ckpt = V019 / "torch_dist_hybrid_tp2" / "ckpt"
    manifest, tensors = universal_tensors(convert_torch_dist(ckpt, tmp_path / "u", progress=False))
    args = argparse.Namespace(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
        num_experts=None, untie_embeddings_and_output_weights=True, hybrid_layer_pattern="M*M-",
        hidden_size=32, mamba_num_heads=None, mamba_head_dim=16, mamba_num_groups=2, mamba_state_dim=8,
        bf16=True)
    full = hybrid_dp_reshardable_full(ckpt, common={"args": args})  # no common.pt: 0.19's order
    assert set(full) == set(manifest["params"]) and len(full) == 27
    for n, states in full.items():
        assert all(torch.equal(tensors[f"{n}/{s}"], states[s]) for s in STATES), n
        assert torch.equal(tensors[f"{n}/param"].to(torch.bfloat16), states["model"]), n


def other_release_legacy(src: Path, dst: Path) -> bool:
    """The `--ckpt-format torch` save `src` (one rank directory: TP1, PP1, a hybrid model without
    experts) as the other megatron-core release writes it, into `dst`: the Mamba conv1d named
    `mixer.conv1d.weight` (<= 0.18) or `mixer.conv1d_weight` (0.19), the state dict and the
    distrib_optim.pt buffer in that release's registration order (oracles.hybrid_layer_params),
    re-laid out with oracles.flat_layout. Returns the form written (True: conv1d submodule)."""
    import shutil

    shutil.copytree(src, dst)
    (rank_dir,) = (p for p in dst.glob("iter_*/mp_rank_*") if p.is_dir())
    m = torch.load(rank_dir / "model_optim_rng.pt", weights_only=False)
    optim = torch.load(rank_dir / "distrib_optim.pt", weights_only=False)
    sd = m["model"]
    to_module = any(k.endswith(".mixer.conv1d_weight") for k in sd)  # the other form
    pattern = args_hybrid_pattern(m["args"])
    order = [WORD] + [f"decoder.layers.{i}.{n}" for i, sym in enumerate(pattern)
                      for n in hybrid_layer_params(sym, 0, to_module)]
    order += ["decoder.final_norm.weight", "output_layer.weight"]
    tensors = {k: v for k, v in sd.items() if torch.is_tensor(v)}
    new_keys = sorted(tensors, key=lambda k: order.index(hybrid_universal_name(k, pattern, 0)))

    def renamed(k: str) -> str:
        for param_form, module_form in ((".mixer.conv1d_weight", ".mixer.conv1d.weight"),
                                        (".mixer.conv1d_bias", ".mixer.conv1d.bias")):
            old, new = (param_form, module_form) if to_module else (module_form, param_form)
            if k.endswith(old):
                return k[: -len(old)] + new
        return k

    old_at, _ = flat_layout([(k, v.numel()) for k, v in tensors.items()], set())
    new_at, total = flat_layout([(k, tensors[k].numel()) for k in new_keys], set())
    (key,) = optim[0]
    flat = optim[0][key]
    for s in STATES:
        t = torch.zeros(total, dtype=flat[s].dtype)
        for k in new_keys:
            n = tensors[k].numel()
            t[new_at[k]:new_at[k] + n] = flat[s][old_at[k]:old_at[k] + n]
        flat[s] = t
    flat["numel_unpadded"] = total
    m["model"] = {**{renamed(k): tensors[k] for k in new_keys},
                  **{k: v for k, v in sd.items() if not torch.is_tensor(v)}}
    torch.save(m, rank_dir / "model_optim_rng.pt")
    torch.save(optim, rank_dir / "distrib_optim.pt")
    return to_module


def test_hybrid_legacy_save_of_the_other_release_converts(converted, tmp_path):
    """A hybrid `--ckpt-format torch` save in the other release's Mamba form (its conv1d names and
    parameter order, made from this release's by hand) converts to the same universal tensors,
    bitwise (before: refused, "saved only: [...mixer.conv1d.bias, ...]")."""
    reshard(CKPT, tmp_path / "ours", Layout(tp=1, pp=1, dp=2), "torch", progress=False)
    to_module = other_release_legacy(tmp_path / "ours", tmp_path / "other")
    saved = torch.load(next((tmp_path / "other").glob("iter_*/mp_rank_*/model_optim_rng.pt")),
                       weights_only=False)["model"]
    assert ("decoder.layers.0.mixer.conv1d.weight" in saved) == to_module
    _, t1 = universal_tensors(converted)
    _, t2 = universal_tensors(convert_legacy(tmp_path / "other", tmp_path / "u", progress=False))
    assert_same_tensors(t1, t2)
