"""Universal -> Megatron-LM `--ckpt-format torch_dist` checkpoints (megatron_dist.write_torch_dist).

(1) Same layout: the fully_reshardable fixture -> universal -> torch_dist at the fixture's layout
    reproduces the fixture's key set, every model / optimizer.state tensor bitwise (dtype included),
    every ShardedObject (`_extra_state`, rng shards) and common.pt (args included).
(2) Another layout: torch_dist at the target -> universal again equals the first universal bitwise;
    only args and the rng shards depend on the target.
(3) A legacy (`--ckpt-format torch`) source through reshard(target_format="torch_dist").

Not covered (cannot run here): loading with Megatron-LM's own training loader (Megatron-LM is not
installed in CI), and megatron-core 0.16.1's fully_reshardable optimizer load, which raises
KeyError('step') with torch AdamW (the local fallback when Apex/TE are absent; upstream bug).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from megatron_ucp import UCPError
from megatron_ucp.formats.megatron_dist import iteration_dir as resolve_iter_dir
from megatron_ucp.formats.megatron_dist import run_fields as torch_dist_source_fields
from megatron_ucp.formats.megatron_dist.layout import DistReader
from megatron_ucp.layout import Layout
from megatron_ucp.reshard import convert_legacy, convert_torch_dist, reshard, write_torch_dist

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "megatron_lm"
FULLY = FIXTURES / "torch_dist_pp2_fullyreshardable" / "ckpt"


def assert_same(a, b, where: str) -> None:
    """Bitwise equality of nested checkpoint objects (types, key order, tensors, numpy states)."""
    assert type(a) is type(b), (where, type(a), type(b))
    if torch.is_tensor(a):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), (where, list(a), list(b))
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    else:
        assert a == b, (where, a, b)


def common(ckpt: Path) -> dict:
    return torch.load(resolve_iter_dir(ckpt) / "common.pt", map_location="cpu", weights_only=False)


def universal_tensors(udir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    manifest = json.loads((udir / "manifest.json").read_text())
    tensors = {}
    for name, p in manifest["params"].items():
        for state, e in p["tensors"].items():
            with safe_open(str(udir / e["file"]), "pt") as f:
                tensors[f"{name}/{state}"] = f.get_tensor(e["key"])
    return manifest, tensors


def assert_same_universal(u1: Path, u2: Path, layout: Layout) -> None:
    m1, t1 = universal_tensors(u1)
    m2, t2 = universal_tensors(u2)
    assert t1.keys() == t2.keys()
    for k, t in t1.items():
        assert t.dtype == t2[k].dtype and torch.equal(t, t2[k]), k
    assert Layout.from_json({k: v for k, v in m2["layout"].items()}) == layout
    assert {n: p["step"] for n, p in m1["params"].items()} == \
        {n: p["step"] for n, p in m2["params"].items()}
    for k in ("optimizer", "scheduler", "iteration", "extra"):  # "model" records layout sizes
        assert m2[k] == m1[k], k


@pytest.fixture(scope="module")
def universal(tmp_path_factory) -> Path:
    return convert_torch_dist(FULLY, tmp_path_factory.mktemp("u") / "fully", progress=False)


def test_same_layout_round_trip_is_bitwise(universal, tmp_path):
    f = torch_dist_source_fields(FULLY)
    args = f["args"]
    out = write_torch_dist(universal, tmp_path / "out", f["layout"], args, rng_state=f["rng_state"],
                           num_floating_point_operations_so_far=f["num_floating_point_operations_so_far"],
                           first_stage_layers=args.decoder_first_pipeline_num_layers,
                           last_stage_layers=args.decoder_last_pipeline_num_layers, progress=False)
    assert (out / "latest_checkpointed_iteration.txt").read_text() == \
        (FULLY / "latest_checkpointed_iteration.txt").read_text()
    src_iter, out_iter = resolve_iter_dir(FULLY), resolve_iter_dir(out)
    assert out_iter.name == src_iter.name
    assert {".metadata", "common.pt", "metadata.json", "__0_0.distcp"} <= \
        {p.name for p in out_iter.iterdir()}
    assert json.loads((out_iter / "metadata.json").read_text()) == \
        json.loads((src_iter / "metadata.json").read_text())
    a, b = DistReader(src_iter), DistReader(out_iter)
    assert set(a.meta) == set(b.meta)
    tensors = set(a.tensor_keys())
    assert set(b.tensor_keys()) == tensors
    assert sum(k.startswith("optimizer.state.") for k in tensors) == 3 * sum(
        not k.startswith("optimizer.") for k in tensors)
    for k in sorted(tensors):
        assert_same(a.tensor(k), b.tensor(k), k)
    for k in sorted(set(a.meta) - tensors):  # _extra_state and rng_state ShardedObjects
        assert_same(a.obj(k), b.obj(k), k)
    ca, cb = common(FULLY), common(out)
    assert_same(vars(ca.pop("args")), vars(cb.pop("args")), "args")
    assert_same(ca, cb, "common.pt")
    assert cb["iteration"] == 6
    assert {g["step"] for g in cb["optimizer"]["optimizer"]["param_groups"]} == {6.0}


@pytest.mark.parametrize("target", ["tp1pp1dp2", "tp2pp1dp1"])
def test_other_layout_back_to_universal_is_bitwise(universal, target, tmp_path):
    lay = Layout.parse(target)
    f = torch_dist_source_fields(FULLY)
    rng = f["rng_state"][(0, 0)]
    out = write_torch_dist(universal, tmp_path / "out", lay, f["args"], rng_state=rng,
                           progress=False)
    c = common(out)
    a = c["args"]
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.data_parallel_size,
            a.world_size, a.decoder_first_pipeline_num_layers,
            a.decoder_last_pipeline_num_layers, a.ckpt_format,
            a.dist_ckpt_optim_fully_reshardable) == (lay.tp, lay.pp, lay.dp, lay.world_size, None,
                                                     None, "torch_dist", True)
    assert c["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    reader = DistReader(resolve_iter_dir(out))
    rng_keys = sorted(k for k in reader.meta if k.startswith("rng_state/"))
    assert rng_keys == sorted(f"rng_state/shard_0.{t}_1.{lay.tp}" for t in range(lay.tp))
    assert_same(reader.obj(rng_keys[0]), [rng], "rng_state")
    again = convert_torch_dist(out, tmp_path / "u2", progress=False)
    assert_same_universal(universal, again, lay)


def test_legacy_source_reshard_to_torch_dist(tmp_path):
    src = FIXTURES / "torch_tp2_pp2" / "ckpt"
    u1 = convert_legacy(src, tmp_path / "u1", progress=False)
    lay = Layout(tp=1, pp=2, dp=2)
    s = reshard(src, tmp_path / "out", lay, target_format="torch_dist", progress=False,
                first_stage_layers=2)
    assert s.target_format == "torch_dist" and s.params > 0 and s.bytes_written > 0
    assert not (tmp_path / ".out.universal").exists()
    c = common(tmp_path / "out")
    assert c["args"].decoder_first_pipeline_num_layers == 2
    again = convert_torch_dist(tmp_path / "out", tmp_path / "u2", progress=False)
    assert_same_universal(u1, again, lay)


def test_reshard_torch_dist_refusals(universal, tmp_path):
    with pytest.raises(UCPError, match=r"needs a Megatron-LM checkpoint \(torch or torch_dist\) source"):
        reshard(universal, tmp_path / "x", Layout(dp=2), target_format="torch_dist",
                progress=False)
    with pytest.raises(UCPError, match="target layout"):
        reshard(FULLY, tmp_path / "y", None, target_format="torch_dist", progress=False)
