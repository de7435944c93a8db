"""Universal -> Megatron-LM `--ckpt-format torch_dist` checkpoints (megatron_dist.write_torch_dist).

(1) Same layout: the fully_reshardable fixture -> universal -> torch_dist at the fixture's layout
    reproduces the fixture's key set, every model / optimizer.state tensor bitwise (dtype included),
    every ShardedObject (`_extra_state`, rng shards) and common.pt (args included).
(2) Another layout: torch_dist at the target -> universal again equals the first universal bitwise;
    only args and the rng shards depend on the target.
(3) A legacy (`--ckpt-format torch`) source through reshard(target_format="torch_dist").
(4) dp_reshardable targets (Megatron-LM's default): at the same layout every flat bucket equals
    Megatron-LM's own save at every parameter element; at other layouts back to universal bitwise.
(5) MoE targets (fully_reshardable): bitwise equal to Megatron-LM's own MoE save; EP4 and TP2 EP2
    ETP1 targets back to universal bitwise.
(6) Every export is read back before its commit.
Every written checkpoint is also assembled by hand (tests/oracles.py: torch.distributed.checkpoint's
own FileSystemReader, Megatron-LM's key names and flat-bucket rule, no megatron_ucp reader) and must
hold the universal tensors it was written from, so a bug shared by the torch_dist reader and
writer (a state stored under another state's key, a wrong stacked index) cannot cancel out.

Stock Megatron-LM resuming these files is measured by tools/mlm_resume/resume_table.py (needs a
Megatron-LM checkout, so not in CI); megatron-core 0.16.1's own fully_reshardable optimizer load
raises KeyError('step') with torch AdamW (the local fallback when Apex/TE are absent; upstream).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import assert_same, assert_same_tensors
from oracles import assert_holds_universal, dp_reshardable_full, fully_reshardable_full, universal_tensors

from megatron_ucp import UCPError
from megatron_ucp.conversion import convert_legacy, convert_torch_dist, reshard, write_torch_dist
from megatron_ucp.formats.dcp_reader import DistReader
from megatron_ucp.formats.megatron_dist import iteration_dir as resolve_iter_dir
from megatron_ucp.formats.megatron_dist import run_fields as torch_dist_source_fields
from megatron_ucp.layout import Layout

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "megatron_lm"
FULLY = FIXTURES / "torch_dist_pp2_fullyreshardable" / "ckpt"


def common(ckpt: Path) -> dict:
    return torch.load(resolve_iter_dir(ckpt) / "common.pt", map_location="cpu", weights_only=False)


def assert_written_holds(out: Path, udir: Path) -> int:
    """The hand assembly of torch_dist checkpoint `out` holds the universal tensors of `udir`."""
    manifest, _ = universal_tensors(udir)
    if common(out)["content_metadata"]["distrib_optim_sharding_type"] == "dp_reshardable":
        full = dp_reshardable_full(out, {n: tuple(p["shape"]) for n, p in manifest["params"].items()})
    else:
        full = fully_reshardable_full(out, list(manifest["params"]))
    return assert_holds_universal(full, udir, torch.bfloat16)


def assert_same_universal(u1: Path, u2: Path, layout: Layout) -> None:
    m1, t1 = universal_tensors(u1)
    m2, t2 = universal_tensors(u2)
    assert_same_tensors(t1, t2)
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
    args = f.args
    out = write_torch_dist(universal, tmp_path / "out", f.layout, args, rng_state=f.rng_state,
                           num_floating_point_operations_so_far=f.num_floating_point_operations_so_far,
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
    assert assert_written_holds(out, universal) == 3 * len(universal_tensors(universal)[0]["params"])


@pytest.mark.parametrize("target", ["tp1pp1dp2", "tp2pp1dp1"])
def test_other_layout_back_to_universal_is_bitwise(universal, target, tmp_path):
    lay = Layout.parse(target)
    f = torch_dist_source_fields(FULLY)
    rng = f.rng_state[(0, 0)]
    out = write_torch_dist(universal, tmp_path / "out", lay, f.args, rng_state=rng,
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
    assert_written_holds(out, universal)
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
    assert_written_holds(tmp_path / "out", u1)
    again = convert_torch_dist(tmp_path / "out", tmp_path / "u2", progress=False)
    assert_same_universal(u1, again, lay)


def test_reshard_torch_dist_refusals(universal, tmp_path):
    with pytest.raises(UCPError, match=r"needs a Megatron-LM checkpoint \(torch, torch_dist, "
                                       r"fsdp_dtensor or torch_dcp\) source"):
        reshard(universal, tmp_path / "x", Layout(dp=2), target_format="torch_dist",
                progress=False)
    with pytest.raises(UCPError, match="target layout"):
        reshard(FULLY, tmp_path / "y", None, target_format="torch_dist", progress=False)


# ---- dp_reshardable targets (Megatron-LM's default optimizer form) -----------------------------

DP_RESHARDABLE = FIXTURES / "torch_dist_tp2_dp2" / "ckpt"


def parameter_ranges(ckpt: Path) -> dict[str, torch.Tensor]:
    """flat bucket key -> mask of the elements that belong to a parameter (the 64-alignment gaps
    of a Megatron-written bucket hold uninitialised memory), from megatron-core's DDP rebuilt at
    each model-parallel rank of the checkpoint's layout (every parameter, replicas included)."""
    from megatron.core import parallel_state as ps

    from megatron_ucp.formats.megatron_dist.layout import bucket_key
    from megatron_ucp.formats.megatron_rebuild import build_chunks, source_rank, wrap_ddp

    args = torch_dist_source_fields(ckpt).args
    masks: dict[str, torch.Tensor] = {}
    for rank in range(args.tensor_model_parallel_size):  # TP ranks at DP rank 0 (PP1 here)
        with source_rank(args, rank):
            mp = ps.get_model_parallel_group().rank()
            for g, buf in enumerate(b for c in wrap_ddp(build_chunks(args), args) for b in c.buffers):
                for start, end, b in buf.param_index_map.values():
                    key = bucket_key(mp, g, (buf.param_dtype, buf.grad_dtype), b)
                    m = masks.setdefault(key, torch.zeros(buf.buckets[b].numel_unpadded, dtype=torch.bool,
                                                          device="cpu"))
                    m[start - buf.buckets[b].offset:end - buf.buckets[b].offset] = True
    return masks


@pytest.fixture(scope="module")
def dp_universal(tmp_path_factory) -> Path:
    return convert_torch_dist(DP_RESHARDABLE, tmp_path_factory.mktemp("u") / "dp", progress=False)


def test_dp_reshardable_same_layout_matches_megatron_lm(dp_universal, tmp_path):
    """Megatron-LM's own dp_reshardable save (TP2 DP2) -> universal -> dp_reshardable at TP2 DP2:
    the same keys, model tensors bitwise, every bucket bitwise at every parameter element (zeros
    in the gaps), the same per-bucket sizes, param groups (step 6) and common.pt."""
    f = torch_dist_source_fields(DP_RESHARDABLE)
    s = reshard(DP_RESHARDABLE, tmp_path / "out", f.layout, target_format="torch_dist",
                optim_sharding="dp_reshardable", progress=False)
    out = s.output
    a, b = DistReader(resolve_iter_dir(DP_RESHARDABLE)), DistReader(resolve_iter_dir(out))
    assert set(a.meta) == set(b.meta)
    masks = parameter_ranges(DP_RESHARDABLE)
    assert len(masks) == 2 and all(m.sum() > 0 for m in masks.values())  # one bucket per TP rank
    for k in sorted(a.tensor_keys()):
        ta, tb = a.tensor(k), b.tensor(k)
        bucket = k.rsplit(".", 1)[0]
        if bucket in masks:
            m = masks[bucket]
            assert ta.dtype == tb.dtype and ta.shape == tb.shape, k
            assert torch.equal(ta[m], tb[m]), k
            assert not tb[~m].any(), k  # our gaps are zero
        else:
            assert_same(ta, tb, k)
    for k in sorted(set(a.meta) - set(a.tensor_keys())):  # per-bucket sizes, param groups, rng
        assert_same(a.obj(k), b.obj(k), k)
    ca, cb = common(DP_RESHARDABLE), common(out)
    args_a, args_b = vars(ca.pop("args")), vars(cb.pop("args"))
    assert args_b["dist_ckpt_optim_fully_reshardable"] is False
    assert {k: v for k, v in args_b.items() if k not in ("save", "load")} == \
        {k: v for k, v in args_a.items() if k not in ("save", "load")}
    assert_same(ca, cb, "common.pt")
    assert assert_written_holds(out, dp_universal) > 0


@pytest.mark.parametrize("target, first", [("tp1pp2dp1", 2), ("tp1pp1dp2", None)])
def test_dp_reshardable_other_layout_back_to_universal_is_bitwise(dp_universal, target, first, tmp_path):
    u1 = dp_universal
    lay = Layout.parse(target)
    reshard(DP_RESHARDABLE, tmp_path / "out", lay, target_format="torch_dist",
            optim_sharding="dp_reshardable", first_stage_layers=first, progress=False)
    c = common(tmp_path / "out")
    assert c["content_metadata"]["distrib_optim_sharding_type"] == "dp_reshardable"
    assert c["optimizer"] == {"param_state_sharding_type": "dp_reshardable"}
    assert_written_holds(tmp_path / "out", u1)
    again = convert_torch_dist(tmp_path / "out", tmp_path / "u2", progress=False)
    assert_same_universal(u1, again, lay)


def test_optim_sharding_only_for_torch_dist(tmp_path):
    with pytest.raises(UCPError, match="--target-optim-sharding applies to --target-format torch_dist"):
        reshard(DP_RESHARDABLE, tmp_path / "x", Layout(dp=2), target_format="torch",
                optim_sharding="dp_reshardable", progress=False)
    with pytest.raises(UCPError, match="choose one of"):
        reshard(DP_RESHARDABLE, tmp_path / "y", Layout(dp=2), target_format="torch_dist",
                optim_sharding="fully_sharded_model_space", progress=False)
    assert not (tmp_path / "y").exists()


# ---- validated before commit -------------------------------------------------------------------

def test_torch_dist_export_is_validated_before_commit(tmp_path, monkeypatch):
    """A writer that loses a tensor (here: dcp.save drops one model tensor) is caught by reading
    the written checkpoint back before the commit: a UCPError, no output, no partial dir."""
    import torch.distributed.checkpoint as dcp

    real_save = dcp.save

    def lossy_save(state_dict, **kw):
        state_dict.pop("decoder.final_layernorm.weight")
        return real_save(state_dict, **kw)

    monkeypatch.setattr(dcp, "save", lossy_save)
    with pytest.raises(UCPError, match="decoder.final_layernorm.weight") as ei:
        reshard(DP_RESHARDABLE, tmp_path / "out", Layout(dp=2), target_format="torch_dist",
                progress=False)
    assert "checkpoint has no such tensor" in str(ei.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# ---- MoE targets (fully_reshardable, chained dense + expert optimizers) -------------------------

MOE_DIST = FIXTURES / "torch_dist_moe_ep2_fully" / "ckpt"  # written by Megatron-LM (EP2, DP2)
MOE_LEGACY = FIXTURES / "torch_moe_ep2" / "ckpt"


def test_moe_same_layout_round_trip_matches_megatron_lm(tmp_path):
    """Megatron-LM's own MoE torch_dist save -> universal -> torch_dist at EP2 DP2: the same keys,
    every tensor (experts stacked [layers, experts, ...]) and object bitwise, and common.pt with
    the ChainedOptimizer's {0: dense, 1: expert} param groups."""
    f = torch_dist_source_fields(MOE_DIST)
    out = reshard(MOE_DIST, tmp_path / "out", f.layout, target_format="torch_dist",
                  progress=False).output
    a, b = DistReader(resolve_iter_dir(MOE_DIST)), DistReader(resolve_iter_dir(out))
    # and the (PP, TP) rng shards, which other releases than core_v0.16.x load with EP
    assert set(b.meta) == set(a.meta) | {"rng_state/shard_0.0_1.1"}
    assert any(k.startswith("rng_state/shard_0.0.1_1.1.2") for k in a.meta)
    for k in sorted(a.tensor_keys()):
        assert_same(a.tensor(k), b.tensor(k), k)
    for k in sorted(set(a.meta) - set(a.tensor_keys())):
        if k.startswith("rng_state/"):  # one rank's generators for every shard (layout may change)
            continue
        assert_same(a.obj(k), b.obj(k), k)
    ca, cb = common(MOE_DIST), common(out)
    ca.pop("args"), cb.pop("args")
    assert_same(ca, cb, "common.pt")
    groups = [g for i in (0, 1) for g in cb["optimizer"][i]["optimizer"]["param_groups"]]
    assert [g["is_expert_parallel"] for g in groups] == [False, False, True, True]
    assert assert_written_holds(out, convert_torch_dist(MOE_DIST, tmp_path / "u", progress=False)) > 0


def test_moe_legacy_and_torch_dist_sources_agree(tmp_path):
    """The two readers on one run saved in both forms give the same parameter set and shapes,
    each reads its file bitwise, and the values of the two runs agree to per-state relative
    limits; and a legacy MoE source exported to torch_dist at
    EP4 and at TP2 EP2 ETP1 converts back to the same universal tensors bitwise."""
    u_legacy = convert_legacy(MOE_LEGACY, tmp_path / "ul", progress=False)
    u_dist = convert_torch_dist(MOE_DIST, tmp_path / "ud", progress=False)
    ml, tl = universal_tensors(u_legacy)
    md, td = universal_tensors(u_dist)
    assert tl.keys() == td.keys() and all(tl[k].shape == td[k].shape for k in tl)
    # each reader bitwise against its file assembled by hand (the legacy one: test_megatron_legacy)
    assert_holds_universal(fully_reshardable_full(MOE_DIST, list(md["params"])), u_dist, torch.bfloat16)
    # The two fixtures are two training runs (lm loss 5.529915 vs 5.529855 at iteration 6), so
    # the readers cannot agree bitwise: relative L2 error per tensor and over each state, limits
    # ~2x the measured (per tensor at most 0.30 / 0.083 / 0.061, the 0.30 on a near-zero qkv
    # bias; per state 8.4e-4 / 1.5e-2 / 7.4e-3). A state read from another state's place gives
    # ~1 on every tensor.
    for state, (each, whole) in {"param": (0.5, 2e-3), "exp_avg": (0.2, 0.03),
                                 "exp_avg_sq": (0.15, 0.015)}.items():
        keys = sorted(k for k in tl if k.endswith(f"/{state}"))
        for k in keys:
            assert (tl[k] - td[k]).norm() <= each * td[k].norm(), k
        a, b = (torch.cat([t[k].flatten() for k in keys]) for t in (tl, td))
        assert (a - b).norm() <= whole * b.norm(), state
    for lay, etp in ((Layout(tp=1, ep=4, dp=4), None), (Layout(tp=2, ep=2, dp=1), 1)):
        out = tmp_path / f"out_{lay}"
        reshard(MOE_LEGACY, out, lay, target_format="torch_dist", expert_tensor_parallel=etp,
                progress=False)
        args = common(out)["args"]
        assert (args.tensor_model_parallel_size, args.expert_model_parallel_size,
                args.expert_tensor_parallel_size, args.data_parallel_size) == \
            (lay.tp, lay.ep, etp or lay.tp, lay.dp)
        assert_written_holds(out, u_legacy)
        rng = sorted(k for k in DistReader(resolve_iter_dir(out)).meta if k.startswith("rng_state/"))
        assert rng == sorted([f"rng_state/shard_0.{t}.{d}_1.{lay.tp}.{lay.dp}"
                              for t in range(lay.tp) for d in range(lay.dp)]
                             + [f"rng_state/shard_0.{t}_1.{lay.tp}" for t in range(lay.tp)])
        again = convert_torch_dist(out, tmp_path / f"u_{lay}", progress=False)
        assert_same_universal(u_legacy, again, lay)


def test_moe_dp_reshardable_export_reads_back_bitwise(tmp_path):
    """A MoE model in Megatron-LM's default optimizer form (the ChainedOptimizer's `chained_0.`
    dense and `chained_1.` expert buckets; megatron-core 0.16 and 0.19 lay them out alike, the
    stock 0.19 save in tests/test_megatron_lm_families_v019.py) reads back bitwise."""
    u = convert_legacy(MOE_LEGACY, tmp_path / "u", progress=False)
    out = tmp_path / "out"
    reshard(MOE_LEGACY, out, Layout(ep=4, dp=4), target_format="torch_dist",
            optim_sharding="dp_reshardable", progress=False)
    keys = DistReader(resolve_iter_dir(out)).meta
    assert any(k.startswith("chained_1.optimizer.distributed.dp_group_idx_3.") for k in keys)
    assert_same_universal(u, convert_torch_dist(out, tmp_path / "u2", progress=False), Layout(ep=4, dp=4))


def test_moe_and_etp_refusals(tmp_path):
    with pytest.raises(UCPError, match="expert-data-parallel rank 0 alone"):
        reshard(MOE_LEGACY, tmp_path / "b", Layout(tp=2, ep=2), target_format="torch",
                expert_tensor_parallel=1, progress=False)
    with pytest.raises(UCPError, match="the model has no experts"):
        reshard(DP_RESHARDABLE, tmp_path / "c", Layout(tp=2), target_format="torch_dist",
                expert_tensor_parallel=1, progress=False)
    with pytest.raises(UCPError, match="do not split into ETP x EP"):
        reshard(MOE_LEGACY, tmp_path / "d", Layout(tp=2, ep=2), target_format="torch_dist",
                expert_tensor_parallel=4, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
