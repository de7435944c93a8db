"""The fragment index (format 3): built and checked by rank 0 at save time, used by every load.

- a model built for the wrong layout (megatron-core's own example style: TransformerConfig
  without pipeline_model_parallel_size under PP2, so both stages hold layers 0..3) is refused by
  the save on every rank, with nothing committed;
- a load opens only the rank files that hold its bytes;
- a format-2 checkpoint (no index: the rank file headers list the fragments) still loads bitwise;
- the index builder rejects gaps, overlaps and mixed steps, naming the tensor and the ranks.
"""

from __future__ import annotations

import copy
import gc
import itertools
import json
import math
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from conftest import SCENARIOS, STEPS
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import assemble, compare_to_reference
from safetensors.torch import load_file

import megatron_ucp as ucp
from megatron_ucp.formats import manifest as mf
from megatron_ucp.formats import open_source
from megatron_ucp.formats.fragments import (
    Fragment,
    FragmentSource,
    build_index,
    check_tiling,
    index_part,
    merge_specs,
    write_rank_file,
)
from megatron_ucp.formats.fragments.index import tiling_suspects
from megatron_ucp.formats.manifest import Manifest, ParamEntry, _Check
from megatron_ucp.gc_pause import paused_gc
from megatron_ucp.layout import Layout
from megatron_ucp.local_slice import flat_range_boxes
from megatron_ucp.spec import STATES, ParamSpec, Piece
from megatron_ucp.storage import SafetensorsWriter
from megatron_ucp.testing.launch import LaunchError, launch


def test_model_built_for_another_layout_is_refused_before_commit(tmp_path):
    root = tmp_path / "ckpt"
    with pytest.raises(LaunchError) as ei:
        launch(2, f"{SCENARIOS}:train_and_save",
               {"layout": "pp2", "cfg": {"extra": {"pipeline_model_parallel_size": 1}}, "steps": 1,
                "save_dir": str(root)})
    msg = str(ei.value)
    assert "saved twice (ranks [0, 1])" in msg, msg[-3000:]
    assert "pipeline_model_parallel_size" in msg and "nothing was committed" in msg
    assert root.is_dir() and list(root.iterdir()) == []  # no latest, no iter_*, no .partial


def test_save_root_that_is_a_file_is_refused(tmp_path):
    root = tmp_path / "not_a_dir"
    root.write_text("x")
    with pytest.raises(LaunchError) as ei:
        launch(2, f"{SCENARIOS}:train_and_save",
               {"layout": "tp2", "cfg": {}, "steps": 1, "save_dir": str(root)}, timeout=120)
    # (the launcher kills the other rank once one fails, so exit codes do not show that both
    # raised; each rank checks the root itself before any collective)
    assert f"{root}: the save root is a file; pass a directory" in str(ei.value)


def test_load_opens_only_the_files_holding_its_bytes(source_runs):
    source = source_runs.get("tp2", {"dtype": "fp32"})
    same = launch(2, f"{SCENARIOS}:load_and_train",
                  {"layout": "tp2", "cfg": {"dtype": "fp32"}, "load_dir": str(source["ckpt"]), "steps": 1})
    # TP rank 0: its own file; TP rank 1: its own and rank 0's, which alone holds the parameters
    # replicated over TP (layer norms, row-parallel biases: saved once, by TP rank 0)
    assert [r["files_opened"] for r in same] == [1, 2]
    merged = launch(1, f"{SCENARIOS}:load_and_train",
                    {"layout": "tp1", "cfg": {"dtype": "fp32"}, "load_dir": str(source["ckpt"]),
                     "steps": 1})
    assert merged[0]["files_opened"] == 2


def test_format_2_checkpoint_without_index_still_loads_bitwise(source_runs, tmp_path):
    source = source_runs.get("tp2", {"dtype": "fp32"})
    old = tmp_path / "v2"
    ckpt = open_source(source["ckpt"]).dir
    shutil.copytree(ckpt, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["version"] = 2
    for p in manifest["params"].values():
        del p["slices"], p["step"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    res = launch(1, f"{SCENARIOS}:load_and_train",
                 {"layout": "tp1", "cfg": {"dtype": "fp32"}, "load_dir": str(old), "steps": 1,
                  "dump_dir": str(tmp_path / "dump")})
    assert res[0]["iteration"] == STEPS
    assert compare_to_reference(tmp_path / "dump", assemble(source["dump"], False), False) > 0


SPEC = {"w": {"name": "w", "shape": [4, 2], "dtype": "float32", "tp_axis": 0}}
ROWS = [[0, [0, 0], [2, 2], [2, 1]]]  # rows 0-1 of a [2, 2] local slice
ROWS_2 = [[0, [2, 0], [2, 2], [2, 1]]]  # rows 2-3


def test_index_builder_accepts_an_exact_tiling():
    out = build_index(SPEC, [[("w", [2, 2], ROWS, 0, 3, 5.0)], [("w", [2, 2], ROWS, 3, 4, 5.0),
                                                                ("w", [2, 2], ROWS_2, 0, 4, 5.0)]])
    assert out["w"].to_json()["step"] == 5.0
    assert [s["fragments"] for s in out["w"].to_json()["slices"]] == [[[0, 0, 3], [1, 3, 4]], [[1, 0, 4]]]


@pytest.mark.parametrize("records,expected", [
    ([[("w", [2, 2], ROWS, 0, 4, 1.0)]], "cover 4 of 8 elements"),  # a TP slice nobody saved
    ([[("w", [2, 2], ROWS, 0, 2, 1.0)], [("w", [2, 2], ROWS_2, 0, 4, 1.0)]], "ends at element 2"),
    ([[("w", [2, 2], ROWS, 1, 4, 1.0)], [("w", [2, 2], ROWS_2, 0, 4, 1.0)]], "saved by no rank"),
    ([[("w", [2, 2], ROWS, 0, 4, 1.0)], [("w", [2, 2], ROWS, 0, 4, 1.0)]], "saved twice (ranks [0, 1])"),
    ([[("w", [2, 2], ROWS, 0, 4, 1.0)], [("w", [2, 2], ROWS_2, 0, 4, 2.0)]], "mixes iterations"),
    ([[("w", [2, 2], ROWS, 0, 4, 1.0), ("w", [4, 1], [[0, [0, 1], [4, 1], [1, 1]]], 0, 4, 1.0)],
      [("w", [2, 2], ROWS_2, 0, 4, 1.0)]], "saved overlapping slices"),
    ([[("v", [2, 2], ROWS, 0, 4, 1.0)]], "which no rank declared"),
])
def test_index_builder_rejects_bad_tilings(records, expected):
    with pytest.raises(ucp.UCPError) as ei:
        build_index(SPEC, records)
    assert expected in str(ei.value) and ("parameter w" in str(ei.value) or "of v" in str(ei.value))


def test_flat_range_boxes_cover_exactly_the_range():
    for shape in [(7,), (3, 5), (2, 3, 4), (4, 1, 3)]:
        n = math.prod(shape)
        t = torch.arange(n).reshape(shape)
        for lo, hi in itertools.combinations(range(n + 1), 2):
            boxes = flat_range_boxes(shape, lo, hi)
            got = torch.cat([t[tuple(slice(o, o + k) for o, k in zip(off, sh))].reshape(-1)
                             for off, sh in boxes])
            assert torch.equal(got, torch.arange(lo, hi)), (shape, lo, hi)
            assert len(boxes) <= 2 * len(shape) - 1


def test_a_different_slice_at_the_same_place_is_its_own_slice():
    # the builder keys slices by where their first piece sits, confirmed by comparing them whole:
    # a slice with the same first offset but another local shape must not join the first one
    records = [[("w", [2, 2], ROWS, 0, 4, 1.0)], [("w", [4, 1], [[0, [0, 0], [4, 1], [1, 1]]], 0, 4, 1.0)],
               [("w", [2, 2], ROWS_2, 0, 4, 1.0)]]
    with pytest.raises(ucp.UCPError, match="parameter w: ranks .* saved overlapping slices"):
        build_index(SPEC, records)


def test_slices_cut_along_different_dims_that_overlap_are_refused():
    # rows [2, 4) and columns [0, 2) of a [4, 4] tensor: the volumes add up (8 + 8), the boxes
    # overlap in [2, 4) x [0, 2) and leave [0, 2) x [2, 4) unsaved
    spec = {"w": ParamSpec("w", (4, 4), "float32", 0).to_json()}
    records = [[("w", [2, 4], [[0, [2, 0], [2, 4], [4, 1]]], 0, 8, 1.0)],
               [("w", [4, 2], [[0, [0, 0], [4, 2], [2, 1]]], 0, 8, 1.0)]]
    with pytest.raises(ucp.UCPError, match="parameter w: ranks .* saved overlapping slices"):
        build_index(spec, records)


def test_ranks_that_disagree_on_a_spec_are_refused():
    spec = ParamSpec("w", (4, 2), "float32", 0, aliases=["v"]).to_json()
    other = {**spec, "tp_axis": 1}
    same = index_part([spec], [])[0]
    assert merge_specs([same, None, same]) == {"w": spec}
    with pytest.raises(ucp.UCPError, match="parameter w: ranks disagree on its spec"):
        merge_specs([same, index_part([other], [])[0]])


# ---- the bulk check: every tensor the exact check could refuse is among its suspects

# (name, shape, slices as [local_shape, pieces, fragment cuts]); the rank of a fragment is its index
BULK_MODEL = [
    ("qkv", [8, 4], [([4, 4], [[0, [0, 0], [4, 4], [4, 1]]], [0, 10, 16]),
                     ([4, 4], [[0, [4, 0], [4, 4], [4, 1]]], [0, 16])]),
    ("fc1", [8, 2], [([4, 2], [[0, [0, 0], [2, 2], [2, 1]], [4, [4, 0], [2, 2], [2, 1]]], [0, 3, 8]),
                     ([4, 2], [[0, [2, 0], [2, 2], [2, 1]], [4, [6, 0], [2, 2], [2, 1]]], [0, 8])]),
    ("proj", [2, 6], [([2, 3], [[0, [0, 0], [2, 3], [3, 1]]], [0, 6]),
                      ([2, 3], [[0, [0, 3], [2, 3], [3, 1]]], [0, 1, 6])]),
    ("expert", [3, 2], [([6], [[0, [0, 0], [3, 2], [1, 3]]], [0, 6])]),  # a transposed piece
    ("norm", [5], [([5], [[0, [0], [5], [1]]], [0, 5])]),
]


def _bulk_index() -> dict:
    params = {}
    for name, shape, slices in BULK_MODEL:
        entries = [{"fragments": [[i % 3, a, b] for i, (a, b) in enumerate(zip(cuts, cuts[1:]))],
                    "local_shape": list(local), "pieces": copy.deepcopy(pieces)}
                   for local, pieces, cuts in slices]
        params[name] = {"name": name, "shape": shape, "dtype": "float32", "tp_axis": 0, "step": 1.0,
                        "slices": entries}
    return params


def _refused(entry: ParamEntry, overlap: bool) -> str | None:
    """What the exact path says of a tensor: the parse of its slices, then check_tiling."""
    try:
        if not entry.slices:
            return "no slices"
        check_tiling("t", entry.name, entry.shape, entry.slices, overlap=overlap)
    except Exception as e:  # (a save's own entries are not parsed: garbage fails as it may)
        return f"{type(e).__name__}: {e}"
    return None


def _numbers(x, path=()) -> list[tuple]:
    if isinstance(x, list):
        return [p for i, v in enumerate(x) for p in _numbers(v, (*path, i))]
    if isinstance(x, dict):
        return [p for k, v in x.items() for p in _numbers(v, (*path, k))]
    return [path]


def _edited(edits: list[tuple[int, object]], drop: int, where: str | None) -> dict:
    """The bulk model with numbers under `where` (None: any) replaced, and the list holding
    number `drop` (a fragment, a piece, a shape) shortened."""
    raw = _bulk_index()
    numbers = [(n, path) for n in raw for path in _numbers(raw[n]["slices"], ("slices",))
               if where is None or where in path]
    for choice, value in edits:
        name, path = numbers[choice % len(numbers)]
        parent = raw[name]
        for k in path[:-1]:
            parent = parent[k]
        parent[path[-1]] = value
    if drop < len(numbers):
        name, path = numbers[drop]
        container = raw[name]
        for k in path[:-2]:
            container = container[k]
        if isinstance(container, list) and container:
            container.pop(0)
    return raw


INTS = [0, 1, 2, 3, 4, 5, 6, 8, 16, -1, 2**41]
# (a bool is a number to the bulk check, True == 1: the parse refuses it when the tensor is read,
# test_a_number_that_is_not_an_int_is_refused_when_read)
ANY_VALUE = st.sampled_from([*INTS, 2**70, 1.5, "x", None, [], [1, 2, 3]])


@settings(max_examples=300, deadline=None)
@given(edits=st.lists(st.tuples(st.integers(0, 10**6), ANY_VALUE), min_size=1, max_size=3),
       drop=st.integers(0, 60))
def test_bulk_check_at_open_suspects_every_tensor_with_a_broken_fragment(edits, drop):
    raw = _edited(edits, drop, "fragments")
    check = _Check("m")
    params = {n: ParamEntry.from_json(d, "fragments", 3, check, f"params[{n!r}]") for n, d in raw.items()}
    suspects = set(tiling_suspects(params, 3, whole=False))
    for name, entry in params.items():
        why = _refused(entry, overlap=False)
        assert why is None or name in suspects, (name, why, raw[name]["slices"])


@settings(max_examples=300, deadline=None)
@given(edits=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(INTS)), min_size=1, max_size=3),
       drop=st.integers(0, 120))
def test_bulk_check_at_save_suspects_every_tensor_check_tiling_refuses(edits, drop):
    raw = _edited(edits, drop, None)
    params = {n: ParamEntry(ParamSpec(n, tuple(d["shape"]), "float32", 0), 1.0, slices_json=d["slices"])
              for n, d in raw.items()}  # as build_index makes them
    suspects = set(tiling_suspects(params, 3, whole=True))
    for name, entry in params.items():
        why = _refused(entry, overlap=True)
        assert why is None or name in suspects, (name, why, raw[name]["slices"])


def test_unmodified_bulk_index_has_no_suspects():
    check = _Check("m")
    params = {n: ParamEntry.from_json(d, "fragments", 3, check, f"params[{n!r}]")
              for n, d in _bulk_index().items()}
    assert tiling_suspects(params, 3, whole=True) == [] and tiling_suspects(params, 3, whole=False) == []
    assert all(_refused(p, overlap=True) is None for p in params.values())


# ---- the open checks every tensor's fragments; a tensor's slices are parsed when first read

def _three_tensor_checkpoint(d: Path) -> dict:
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(4, 3, generator=g) for n in "abc"}
    records = [[], []]
    for rank in range(2):
        frags = [Fragment(n, (2, 3), [Piece.rows(0, (2 * rank, 0), (2, 3))], 0, 6, 5.0,
                          {s: full[n][2 * rank:2 * rank + 2].reshape(-1).clone() for s in STATES})
                 for n in "abc"]
        write_rank_file(d / f"rank_{rank:05d}.safetensors", frags, {}, {}, {"tp": rank})
        records[rank] = [f.record() for f in frags]
    m = Manifest.fragments(iteration=5, layout=Layout(tp=2), world_size=2, model={}, optimizer={
        "param_groups": []}, scheduler=None, extra={}, seed=1)
    m.params = build_index({n: ParamSpec(n, (4, 3), "float32", 0).to_json() for n in "abc"}, records)
    return {"manifest": json.loads(mf.encode(m)), "full": full}


def test_open_refuses_a_broken_fragment_of_any_tensor(tmp_path):
    ck = _three_tensor_checkpoint(tmp_path)
    m = ck["manifest"]
    m["params"]["c"]["slices"][1]["fragments"].append([1, 0, 6])
    with pytest.raises(ucp.UCPError, match=r"parameter c: elements \[0, 6\) of a saved slice are saved tw"):
        FragmentSource(tmp_path, Manifest.from_json(m, "m"))


def test_a_tensor_is_parsed_when_first_read(tmp_path):
    ck = _three_tensor_checkpoint(tmp_path)
    m = ck["manifest"]
    m["params"]["c"]["slices"][0]["pieces"][0][2] = [2, "3"]  # a damaged piece of c only
    source = FragmentSource(tmp_path, Manifest.from_json(m, str(tmp_path / "manifest.json")))
    assert torch.equal(source.read("a", "exp_avg", (1, 0), (2, 3)), ck["full"]["a"][1:3])
    assert source.manifest.params["c"]._slices is None  # not needed by the read of a
    with pytest.raises(ucp.UCPError, match=r"manifest.json: params\['c'\].slices\[0\].pieces\[0\]"):
        source.read("c", "param", (0, 0), (4, 3))


def test_a_read_refuses_slices_that_overlap_or_leave_a_gap(tmp_path):
    # rank 1's slice of c placed over rank 0's: the volume still adds up (the open passes), the
    # read of the whole tensor finds the overlap and the read of the rows nobody holds the gap
    ck = _three_tensor_checkpoint(tmp_path)
    m = ck["manifest"]
    for pc in m["params"]["c"]["slices"][1]["pieces"]:
        pc[1] = [0, 0]
    source = FragmentSource(tmp_path, Manifest.from_json(m, "m"))
    assert torch.equal(source.read("b", "param", (0, 0), (4, 3)), ck["full"]["b"])
    with pytest.raises(ucp.UCPError, match=r"parameter c: two saved slices hold the same elements "
                                           r"\(at \[0, 0\]\)"):
        source.read("c", "param", (0, 0), (4, 3))
    with pytest.raises(ucp.UCPError, match=r"parameter c: 6 of 6 requested elements are saved by no rank"):
        source.read("c", "param", (2, 0), (2, 3))  # nobody holds rows 2-3 now
    assert torch.equal(source.read("a", "exp_avg", (1, 1), (2, 2)), ck["full"]["a"][1:3, 1:])


def _two_rank_source(tmp_path: Path):
    """Rank 0 holds w whole (4 x 3, row-major); v's flat range is DP-sharded over both ranks."""
    g = torch.Generator().manual_seed(1)
    full = {n: torch.randn(4, 3, generator=g) for n in "wv"}
    frags = [Fragment("w", (4, 3), [Piece.rows(0, (0, 0), (4, 3))], 0, 12, 5.0,
                      {s: full["w"].reshape(-1).clone() for s in STATES})]
    v = [Fragment("v", (4, 3), [Piece.rows(0, (0, 0), (4, 3))], a, b, 5.0,
                  {s: full["v"].reshape(-1)[a:b].clone() for s in STATES}) for a, b in ((0, 5), (5, 12))]
    ranks = [frags + v[:1], v[1:]]
    for rank, held in enumerate(ranks):
        write_rank_file(tmp_path / f"rank_{rank:05d}.safetensors", held, {}, {}, {"dp": rank})
    m = Manifest.fragments(iteration=5, layout=Layout(dp=2), world_size=2, model={}, optimizer={
        "param_groups": []}, scheduler=None, extra={}, seed=1)
    m.params = build_index({n: ParamSpec(n, (4, 3), "float32", 0).to_json() for n in "wv"},
                           [[f.record() for f in held] for held in ranks])
    return FragmentSource(tmp_path, Manifest.from_json(json.loads(mf.encode(m)), "m")), full


def _copied(runs, tmp_path: Path, shape: tuple[int, ...]) -> torch.Tensor:
    out = tmp_path / "copy.safetensors"
    w = SafetensorsWriter(out, [("t", torch.float32, shape)])
    w.copy_runs("t", runs)
    w.close()
    return load_file(out)["t"]


def test_a_conversion_copies_row_major_fragments_as_byte_runs_and_combines_their_checked_crcs(tmp_path):
    # w: one run (its whole fragment); v: one run per DP rank's fragment, in order; w's first three
    # rows (a true vocabulary): a prefix of its fragment. The crc32 returned is the box's own
    import zlib

    source, full = _two_rank_source(tmp_path)
    rank = [tmp_path / f"rank_{r:05d}.safetensors" for r in range(2)]
    for name, shape, files in (("w", (4, 3), [rank[0]]), ("v", (4, 3), rank), ("w", (3, 3), [rank[0]])):
        for state in STATES:
            runs, checked_crc = source.leading_runs(name, state, shape)
            assert [r.path for r in runs] == files
            got = _copied(runs, tmp_path, shape)
            want = full[name][:shape[0]]
            assert torch.equal(got, want)
            assert checked_crc() == zlib.crc32(want.numpy().tobytes())
    # a fragment corrupted on disk: the check after the copy names the file and the tensor
    runs, checked_crc = source.leading_runs("v", "exp_avg", (4, 3))
    raw = bytearray(rank[1].read_bytes())
    raw[runs[1].offset] ^= 0xFF
    rank[1].write_bytes(bytes(raw))
    fresh = FragmentSource(tmp_path, source.manifest)  # (no header or file cached)
    runs, checked_crc = fresh.leading_runs("v", "exp_avg", (4, 3))
    _copied(runs, tmp_path, (4, 3))
    with pytest.raises(ucp.UCPError, match=r"rank_00001\.safetensors: checksum mismatch in tensor 'v/exp"):
        checked_crc()


def test_a_tp_split_tensor_has_no_byte_runs_and_is_read(tmp_path):
    # two TP slices of rows: not one row-major slice, so the conversion reads and gathers it
    g = torch.Generator().manual_seed(2)
    full = torch.randn(4, 3, generator=g)
    ranks = [[Fragment("w", (2, 3), [Piece.rows(0, (2 * r, 0), (2, 3))], 0, 6, 5.0,
                       {s: full[2 * r:2 * r + 2].reshape(-1).clone() for s in STATES})] for r in range(2)]
    for rank, held in enumerate(ranks):
        write_rank_file(tmp_path / f"rank_{rank:05d}.safetensors", held, {}, {}, {"tp": rank})
    m = Manifest.fragments(iteration=5, layout=Layout(tp=2), world_size=2, model={}, optimizer={
        "param_groups": []}, scheduler=None, extra={}, seed=1)
    m.params = build_index({"w": ParamSpec("w", (4, 3), "float32", 0).to_json()},
                           [[f.record() for f in held] for held in ranks])
    source = FragmentSource(tmp_path, Manifest.from_json(json.loads(mf.encode(m)), "m"))
    assert source.leading_runs("w", "param", (4, 3)) is None
    assert torch.equal(source.read("w", "param", (0, 0), (4, 3)), full)


def test_a_source_dropped_after_reads_unmaps_its_rank_files_at_once(tmp_path):
    # the rank files stay mapped while anything holds the source; a reference cycle through it
    # would keep them mapped until a full collection (a tmpfs then cannot be unmounted)
    ck = _three_tensor_checkpoint(tmp_path)
    source = FragmentSource(tmp_path, Manifest.from_json(ck["manifest"], "m"))
    assert torch.equal(source.read("b", "param", (0, 0), (4, 3)), ck["full"]["b"])

    def mapped() -> int:
        return sum(str(tmp_path) in line for line in Path("/proc/self/maps").read_text().splitlines())

    gone = weakref.ref(source)
    enabled = gc.isenabled()
    gc.disable()
    try:
        before = mapped() if Path("/proc/self/maps").exists() else None
        del source
        assert gone() is None, "a reference cycle keeps the FragmentSource alive"
        if before is not None:
            assert before > 0 and mapped() == 0
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize("field,index,value", [("pieces", 3, [True, 1]), ("pieces", 1, [0.0, 0]),
                                               ("pieces", 0, False), ("fragments", 0, True)])
def test_a_number_that_is_not_an_int_is_refused_when_read(tmp_path, field, index, value):
    # (True == 1 and 0.0 == 0 in Python: such an entry would pass every comparison and then fail
    # deep in torch, or read another rank's file)
    ck = _three_tensor_checkpoint(tmp_path)
    m = ck["manifest"]
    m["params"]["c"]["slices"][0][field][0][index] = value
    source = FragmentSource(tmp_path, Manifest.from_json(m, str(tmp_path / "manifest.json")))
    expected = (r"params\['c'\].slices\[0\].pieces\[0\]: .* is not \[start" if field == "pieces"
                else r"bad fragment entry \[True, 0, 6\] at params\['c'\].slices\[0\].fragments\[0\]")
    with pytest.raises(ucp.UCPError, match=expected):
        source.read("c", "param", (0, 0), (4, 3))


def test_paused_gc_collects_young_cycles_first_and_leaves_no_young_objects():
    class Node:
        pass

    cycle = Node()
    cycle.me = cycle
    gone = weakref.ref(cycle)
    del cycle
    with paused_gc():
        kept = [[i] for i in range(50_000)]
    assert gone() is None  # collected before the pause: not promoted to the oldest generation
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert gc.get_count()[0] < 1000  # the lists are not waiting for a young collection to walk them
    assert len(kept) == 50_000


def _column_split_checkpoint(d: Path, rows: int, seed: int, vocab_rows: bool = False) -> tuple[dict, dict]:
    """w [rows, 4] saved at TP2 split along dim 1 (each rank a [rows, 2] slice: a row-parallel
    weight): its full states and the manifest (JSON)."""
    g = torch.Generator().manual_seed(seed)
    full = {s: torch.randn(rows, 4, generator=g) for s in STATES}
    ranks = [[Fragment("w", (rows, 2), [Piece(0, (0, 2 * r), (rows, 2), (2, 1))], 0, 2 * rows, 5.0,
                       {s: full[s][:, 2 * r:2 * r + 2].reshape(-1).clone() for s in STATES})]
             for r in range(2)]
    for rank, held in enumerate(ranks):
        write_rank_file(d / f"rank_{rank:05d}.safetensors", held, {}, {}, {"tp": rank})
    m = Manifest.fragments(iteration=5, layout=Layout(tp=2), world_size=2, model={}, optimizer={
        "param_groups": []}, scheduler=None, extra={}, seed=1)
    m.params = build_index({"w": ParamSpec("w", (rows, 4), "float32", 1, vocab_rows=vocab_rows).to_json()},
                           [[f.record() for f in held] for held in ranks])
    return full, json.loads(mf.encode(m))


def test_read_local_writes_a_range_of_column_split_slices_in_place(tmp_path):
    # w [6, 4] saved at TP2 split along dim 1 (each rank a [6, 2] slice: a row-parallel weight),
    # read at TP1 into ranges of a destination that stands for the optimizer's shard: every range
    # bitwise, written in place (the tensor returned is the destination), nothing outside it
    # touched. With a vocabulary padded to 8 rows, the rows the checkpoint lacks come back zero.
    from megatron_ucp.local_slice import read_local
    from megatron_ucp.param_spec import LocalParam

    full, manifest = _column_split_checkpoint(tmp_path, 6, seed=3, vocab_rows=True)
    source = FragmentSource(tmp_path, Manifest.from_json(manifest, "m"))
    for rows in (6, 8):
        spec = ParamSpec("w", (rows, 4), "float32", None, vocab_rows=True)
        lp = LocalParam(spec, torch.nn.Parameter(torch.empty(rows, 4)), 0, "w",
                        [Piece.rows(0, (0, 0), (rows, 4))], True)
        want = {s: torch.cat([full[s], torch.zeros(rows - 6, 4)]).reshape(-1) for s in STATES}
        for a, b in ((0, rows * 4), (3, 17), (5, 6), (8, 12), (13, rows * 4)):
            for s in STATES:
                dest = torch.full((rows * 4 + 2,), -7.0)
                got = read_local(source, lp, s, a, b, out=dest[1:1 + b - a])
                assert got.data_ptr() == dest[1:].data_ptr()
                assert torch.equal(dest[1:1 + b - a], want[s][a:b]), (rows, a, b, s)
                assert torch.equal(read_local(source, lp, s, a, b), want[s][a:b])
                assert (dest[0] == -7.0) and (dest[1 + b - a:] == -7.0).all()


def test_a_column_split_tensor_gathered_in_blocks_is_bitwise_and_checksummed(tmp_path, monkeypatch):
    # w [64, 4] saved at TP2 split along dim 1; read at TP1 in blocks of 2 rows per piece (the
    # scratch bound cut down to 16 bytes): every box bitwise, and a whole read, whose blocks read
    # each fragment front to back, is checked against the fragment's crc32: one flipped byte is
    # refused naming the file; a read of rows the flip is not in does not see it.
    from megatron_ucp.formats.fragments import source as fragment_source
    monkeypatch.setattr(fragment_source, "GATHER_BYTES", 16)
    full, manifest = _column_split_checkpoint(tmp_path, 64, seed=4)
    source = FragmentSource(tmp_path, Manifest.from_json(manifest, "m"))
    for offset, shape in (((0, 0), (64, 4)), ((3, 0), (50, 4)), ((7, 1), (9, 2)), ((63, 0), (1, 4))):
        for s in STATES:
            out = torch.empty(shape)
            source.read_into("w", s, offset, shape, out)
            box = tuple(slice(o, o + n) for o, n in zip(offset, shape))
            assert torch.equal(out, full[s][box]), (offset, shape, s)
    path = tmp_path / "rank_00001.safetensors"
    at = source.reader.byte_run(path, "w/exp_avg").offset + 4 * (2 * 40)  # row 40 of rank 1's slice
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    fresh = FragmentSource(tmp_path, Manifest.from_json(manifest, "m"))
    out = torch.empty(20, 4)
    fresh.read_into("w", "exp_avg", (0, 0), (20, 4), out)  # rows 0-19: the flip is not read
    assert torch.equal(out, full["exp_avg"][:20])
    fresh = FragmentSource(tmp_path, Manifest.from_json(manifest, "m"))
    with pytest.raises(ucp.UCPError, match=r"rank_00001.safetensors: checksum mismatch in tensor "
                                           r"'w/exp_avg'"):
        fresh.read_into("w", "exp_avg", (0, 0), (64, 4), torch.empty(64, 4))
