"""Random-number generators across a resume, with dropout on (hidden and attention).

- Same layout: every generator a rank holds right after the load (torch CPU, the "CUDA" generator,
  each model-parallel tracker stream, Python, numpy) equals, bitwise, what it held when the save
  returned, `rng_restored` names them all, and the resumed losses equal the uninterrupted run's
  bitwise. A load whose torch generator is re-seeded afterwards misses them (the losses depend on it).
- Another layout: nothing is restored (`rng_restored` is empty); Python's, numpy's and torch's
  generators are seeded with `rng.rederived_seed(seed, iteration, pp_rank)` (checked against
  generators seeded here), and two resumes at the same target train bitwise alike.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import SCENARIOS, STEPS, nprocs

from megatron_ucp.layout import Layout
from megatron_ucp.rng import rederived_seed
from megatron_ucp.testing.launch import launch

DROPOUT = {"dtype": "fp32", "hidden_dropout": 0.1, "attention_dropout": 0.1}
SEED = 1234  # TinyGPTConfig's default


def _rng(path) -> dict:
    return torch.load(path, weights_only=False)


def _load(source, layout: str, tmp_path, name: str, **kw) -> list[dict]:
    return launch(nprocs(layout), f"{SCENARIOS}:load_and_train",
                  {"layout": layout, "cfg": DROPOUT, "load_dir": str(source["ckpt"]), "steps": STEPS,
                   "rng_dir": str(tmp_path / name), **kw})


@pytest.fixture(scope="module")
def source(source_runs):
    return source_runs.get("tp2", DROPOUT)


def test_dropout_changes_the_losses(source, source_runs):
    """The model really draws from the generators: without dropout the same run trains otherwise."""
    plain = source_runs.get("tp2", {"dtype": "fp32"})
    assert source["continued"] != plain["continued"]


def test_same_layout_restores_every_generator_bitwise(source, tmp_path):
    res = _load(source, "tp2", tmp_path, "rng")
    assert res[0]["losses"] == source["continued"]  # bitwise: same state, same streams
    for rank in range(2):
        saved, loaded = _rng(source["rng"] / f"rank{rank}.pt"), _rng(tmp_path / "rng" / f"rank{rank}.pt")
        assert saved["tensors"].keys() == loaded["tensors"].keys()
        assert {"torch_cpu", "cuda", "tracker.model-parallel-rng"} <= saved["tensors"].keys()
        for k, t in saved["tensors"].items():
            assert torch.equal(t, loaded["tensors"][k]), (rank, k)
        assert saved["meta"] == loaded["meta"], rank  # Python and numpy
        assert sorted(res[rank]["rng_restored"]) == sorted([*saved["tensors"], "python", "numpy"])
    # the tracker streams differ by TP rank (what a cross-rank mix-up would break)
    r0, r1 = (_rng(source["rng"] / f"rank{r}.pt")["tensors"]["tracker.model-parallel-rng"] for r in (0, 1))
    assert not torch.equal(r0, r1)


def test_losses_depend_on_the_restored_generator(source, tmp_path):
    """Negative control: the same resume with torch's generator re-seeded after the load."""
    res = _load(source, "tp2", tmp_path, "rng", sabotage="rng")
    assert res[0]["losses"] != source["continued"]


def test_other_layout_rederives_deterministically(source, tmp_path):
    first = _load(source, "pp2", tmp_path, "a")
    second = _load(source, "pp2", tmp_path, "b")
    assert first[0]["losses"] == second[0]["losses"]  # bitwise: the re-derived streams are fixed
    lay = Layout.parse("pp2")
    for rank in range(lay.world_size):
        assert first[rank]["rng_restored"] == []
        got = _rng(tmp_path / "a" / f"rank{rank}.pt")
        assert all(torch.equal(t, _rng(tmp_path / "b" / f"rank{rank}.pt")["tensors"][k])
                   for k, t in got["tensors"].items())
        pp_rank = rank  # pp2 alone: rank r is stage r
        s = rederived_seed(SEED, STEPS, pp_rank)
        assert torch.equal(got["tensors"]["torch_cpu"], torch.Generator().manual_seed(s).get_state())
        version, mt, gauss = random.Random(s).getstate()
        assert got["meta"]["python"] == [version, list(mt), gauss]
        _, keys, pos, has_gauss, cached = np.random.RandomState(s % 2**32).get_state()
        assert got["meta"]["numpy"][1:] == [keys.tolist(), pos, has_gauss, cached]
    # the stages draw different streams
    assert not torch.equal(_rng(tmp_path / "a" / "rank0.pt")["tensors"]["torch_cpu"],
                           _rng(tmp_path / "a" / "rank1.pt")["tensors"]["torch_cpu"])
