"""Property test of the manifest and piece parser: a mutated manifest is refused with UCPError or,
if it still parses, reads exactly the saved parameters, states, steps, iteration and values
(never anything else, never another error).

The checkpoint is a real two-rank fragment checkpoint of two tensors written by the library's own
writer (`write_rank_file`, `build_index`); each example mutates one value of its manifest JSON
(replace, delete, add an unknown key) and opens and reads the result.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_ucp import UCPError
from megatron_ucp.formats.fragments import Fragment, FragmentSource, build_index, write_rank_file
from megatron_ucp.formats.manifest import Manifest
from megatron_ucp.layout import Layout
from megatron_ucp.spec import ParamSpec, Piece

STATES = ("param", "exp_avg", "exp_avg_sq")
ITERATION, STEP = 5, 5.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict, dict[str, dict[str, torch.Tensor]]]:
    """w [4, 3] split over TP2 by rows (rank r holds rows 2r..2r+1), b [3] replicated (rank 0);
    returns (directory, manifest JSON, name -> state -> full tensor)."""
    d = tmp_path_factory.mktemp("fuzz") / "iter_0000005"  # as a save names it
    d.mkdir()
    g = torch.Generator().manual_seed(0)
    full = {"w": {s: torch.randn(4, 3, generator=g) for s in STATES},
            "b": {s: torch.randn(3, generator=g) for s in STATES}}
    specs = {"w": ParamSpec("w", (4, 3), "float32", 0).to_json(),
             "b": ParamSpec("b", (3,), "float32", None).to_json()}
    records = []
    for rank in range(2):
        frags = [Fragment("w", (2, 3), [Piece.rows(0, (2 * rank, 0), (2, 3))], 0, 6, 5.0,
                          {s: full["w"][s][2 * rank:2 * rank + 2].reshape(-1).clone() for s in STATES})]
        if rank == 0:
            frags.append(Fragment("b", (3,), [Piece.rows(0, (0,), (3,))], 0, 3, 5.0,
                                  {s: full["b"][s].clone() for s in STATES}))
        write_rank_file(d / f"rank_{rank:05d}.safetensors", frags, {}, {}, {"tp": rank})
        records.append([f.record() for f in frags])
    m = Manifest.fragments(iteration=5, layout=Layout(tp=2), world_size=2, model={"num_layers": 1},
                           optimizer={"param_groups": [{"optimizer": 0, "lr": 0.1}]},
                           scheduler=None, extra={}, seed=1)
    m.params = build_index(specs, records)
    return d, m.to_json(), full


def _paths(x, prefix=()) -> list[tuple]:
    out = [prefix]
    if isinstance(x, dict):
        for k, v in x.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            out += _paths(v, (*prefix, i))
    return out


VALUES = st.one_of(st.integers(-2**63, 2**64), st.floats(allow_nan=True), st.text(max_size=8),
                   st.none(), st.booleans(), st.just([]), st.just({}),
                   st.lists(st.integers(-3, 40), max_size=4), st.just("../rank_00000.safetensors"),
                   st.just("/etc/passwd"))


def _mutate(m: dict, choice: int, action: int, value) -> dict:
    m = copy.deepcopy(m)
    paths = [p for p in _paths(m) if p]
    path = paths[choice % len(paths)]
    parent = m
    for k in path[:-1]:
        parent = parent[k]
    if action == 0 or not isinstance(parent, dict):
        parent[path[-1]] = value
    elif action == 1:
        del parent[path[-1]]
    else:
        parent["unknown_field"] = value
    return m


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(choice=st.integers(0, 10**6), action=st.integers(0, 2), value=VALUES)
def test_mutated_manifest_is_refused_or_reads_the_saved_values(checkpoint, choice, action, value):
    d, manifest, full = checkpoint
    mutated = _mutate(manifest, choice, action, value)
    try:
        m = Manifest.from_json(json.loads(json.dumps(mutated)), str(d / "manifest.json"))
        src = FragmentSource(d, m)
        src.check_files()  # as verify, convert, reshard and load do: the rank files vs the manifest
        got = {n: {s: src.read(n, s, (0,) * len(p.shape), p.shape) for s in p.states}
               for n, p in m.params.items()}
    except UCPError:
        return
    # parsed: then it must be exactly the saved checkpoint (nothing lost, nothing else read)
    assert m.iteration == ITERATION, mutated
    assert got.keys() == full.keys(), mutated
    for n, states in got.items():
        assert states.keys() == full[n].keys(), (n, mutated)
        assert src.step(n) == STEP, (n, mutated)
        for s, t in states.items():
            assert t.dtype == full[n][s].dtype and torch.equal(t, full[n][s]), (n, s, mutated)


def test_unmutated_manifest_reads_back(checkpoint):
    d, manifest, full = checkpoint
    src = FragmentSource(d, Manifest.from_json(manifest, "m"))
    assert src.verify() == 9  # w: 2 fragments, b: 1; 3 states each
    assert torch.equal(src.read("w", "exp_avg", (1, 0), (2, 3)), full["w"]["exp_avg"][1:3])
