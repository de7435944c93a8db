"""Megatron-LM torch_dist and torch targets of stock core_v0.19.0 Muon and Lion runs (megatron-core
0.19.2's LayerWiseDistributedOptimizer: Muon or Lion for the weight matrices, Adam for the rest;
fixtures tests/fixtures/megatron_lm_v019/torch_dist_muon_dp2, torch_muon_dp2, torch_dist_lion_dp2,
DP2).

(1) torch_dist: each is resharded (`conversion.reshard`) to another layout, then loaded at that
    layout by megatron-core's OWN `dist_checkpointing.load`, strict (StrictHandling.RETURN_ALL: no
    requested key missing from the files, no optimizer key of the files left unrequested), into a
    LayerWise optimizer built there (the tiny GPT of the fixtures, bf16, `--optimizer muon|lion`),
    then `load_state_dict` as Megatron-LM's load_checkpoint does.
    At the saved layout (DP2) every tensor and the common state equal stock's save, bitwise.
(2) torch: at the saved layout (DP2) the written `layer_wise_optimizer_<dp>.pt` files and the model
    file's `optimizer` equal stock's, bitwise (from the torch and from the torch_dist Muon run: one
    training); at other layouts megatron-core's own `load_state_dict_from_file` (what Megatron-LM's
    load_checkpoint calls for this optimizer) loads each DP rank's file.
Every weight, fp32 master and state the optimizer then holds equals, bitwise, the fixture's
universal conversion (TP shards put together by the hand rule of tests/oracles.py), each held by
one DP rank; Adam's step is 6 and the run trains on.
(3) Args of another optimizer than the state's are refused by name, nothing written.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

import pytest
import torch
from conftest import READS_CORE_V019_FILES, RELEASE_SKIP
from helpers import FIXTURE_MODEL, assert_same
from oracles import (
    dist_common,
    full_tensor,
    load,
    load_keys,
    local_to_universal,
    tensor_keys,
    universal_tensors,
)

from megatron_ucp.conversion import convert, reshard
from megatron_ucp.layout import Layout
from megatron_ucp.testing.launch import launch

pytestmark = [READS_CORE_V019_FILES, pytest.mark.skipif(
    importlib.util.find_spec("emerging_optimizers") is None,
    reason=f"{RELEASE_SKIP}Muon and Lion come with emerging-optimizers (Python >= 3.12, the "
           "megatron-core 0.19 venv)")]

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "megatron_lm_v019"
RANK_PATH = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
FAMILY_STATES = {"adam": ("exp_avg", "exp_avg_sq"), "muon": ("momentum_buffer",), "lion": ("exp_avg",)}
# the fixtures' run (README "Common settings"): Megatron-LM's min_lr 0; LayerWise on its legacy
# path as stock pretrain_gpt.py builds it (no param layout: every parameter in the one LayerWise
# optimizer, Adam's too; with a layout megatron-core gives Adam's to a DistributedOptimizer)
LAYER_WISE = {"min_lr": 0.0, "layer_wise_param_layout": False,
              "optimizer_extra": {"use_layer_wise_distributed_optimizer": True}}
CFG = {f: {**FIXTURE_MODEL, "optimizer": f, **LAYER_WISE} for f in ("muon", "lion")}
# (fixture, its matrix family, target layout, first-stage layers)
CASES = [("torch_dist_muon_dp2", "muon", "tp1dp1", None),
         ("torch_muon_dp2", "muon", "tp1pp2dp1", 2),
         ("torch_dist_lion_dp2", "lion", "tp2dp1", None),
         # another DP size: megatron-core assigns whole parameters to DP ranks by size
         ("torch_dist_muon_dp2", "muon", "tp1dp4", None),
         ("torch_dist_lion_dp2", "lion", "tp2dp2", None)]


def _layer_wise_run(layout: str, cfg: dict, load_dir: str):
    """(train state, layout, checkpoint iteration directory): the tiny GPT with megatron-core's
    LayerWise optimizer at `layout`, on gloo, and the Megatron-LM checkpoint to load into it."""
    from megatron_ucp.testing import gloo_all_gather
    from megatron_ucp.testing import tiny_gpt as tg

    gloo_all_gather.install()  # LayerWise's step at DP > 1 on gloo (the fixtures' harness)
    lay = Layout.parse(layout)
    tg.init_distributed(lay)
    st = tg.build(tg.TinyGPTConfig(**cfg), lay)
    root = Path(load_dir)
    return st, lay, root / f"iter_{int((root / 'latest_checkpointed_iteration.txt').read_text()):07d}"


def load_layer_wise_rank(layout: str, cfg: dict, load_dir: str, dump_dir: str) -> dict:
    """Rank function: the tiny GPT with megatron-core's LayerWise optimizer at `layout`, the
    torch_dist checkpoint loaded as Megatron-LM's load_checkpoint does (model and optimizer
    sharded_state_dict with the checkpoint's content_metadata, dist_checkpointing.load, strict,
    load_state_dict), the local state dumped, one step trained. Returns the keys the strict load
    found missing (in the files, not requested) or unexpected (requested, not in the files)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from megatron.core.utils import unwrap_model

    st, lay, ckpt = _layer_wise_run(layout, cfg, load_dir)
    common = torch.load(ckpt / "common.pt", map_location="cpu", weights_only=False)
    metadata = common["content_metadata"]
    module = unwrap_model(st.model[0])
    model_sd = module.sharded_state_dict(metadata=metadata)
    sd = {"model": model_sd,
          "optimizer": st.optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)}
    loaded, missing, unexpected = dist_checkpointing.load(sd, str(ckpt), strict=StrictHandling.RETURN_ALL)
    module.load_state_dict(loaded["model"], strict=True)
    st.optimizer.load_state_dict(loaded["optimizer"])
    from helpers import dump_step_and_finish

    out = dump_step_and_finish(st, dump_dir, loaded["iteration"])
    return {**out, "missing": sorted(missing), "unexpected": sorted(unexpected)}


def load_layer_wise_torch_rank(layout: str, cfg: dict, load_dir: str, dump_dir: str) -> dict:
    """Rank function: the tiny GPT with megatron-core's LayerWise optimizer at `layout`, a
    `--ckpt-format torch` checkpoint loaded as Megatron-LM's load_checkpoint does for it (the rank
    directory's model_optim_rng.pt model, this DP rank's layer_wise_optimizer_<dp>.pt through
    `load_state_dict_from_file`), the local state dumped, one step trained."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import unwrap_model

    st, lay, ckpt = _layer_wise_run(layout, cfg, load_dir)
    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    rank_dir = ckpt / (f"mp_rank_{tp:02d}" if lay.pp == 1 else f"mp_rank_{tp:02d}_{pp:03d}")
    saved = torch.load(rank_dir / "model_optim_rng.pt", map_location="cpu", weights_only=False)
    unwrap_model(st.model[0]).load_state_dict(saved["model"], strict=True)
    st.optimizer.load_state_dict_from_file(
        str(rank_dir / f"layer_wise_optimizer_{ps.get_data_parallel_rank()}.pt"))
    from helpers import dump_step_and_finish

    return dump_step_and_finish(st, dump_dir, saved["iteration"])


@pytest.fixture(scope="module")
def universal(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lw_universal")
    return {f: convert(FIXTURES / f / "ckpt", root / f, progress=False)
            for f in dict.fromkeys(c[0] for c in CASES)}


def assert_loaded_is_universal(dump_dir: Path, ranks: int, manifest: dict, tensors: dict,
                               first: int | None) -> None:
    """Every parameter's model weight (bf16 of the master), fp32 master and states, as the
    LayerWise optimizer of the loading ranks holds them, put together over TP, equal the universal
    ones bitwise; each exactly once over the ranks' DP owners; Adam's step 6, Muon/Lion none."""
    copies: dict[tuple[str, str], list] = {}
    for rank in range(ranks):
        dump = load(dump_dir / f"rank{rank}.pt")
        tp, pp = dump["coords"]["tp"], dump["coords"]["pp"]
        for e in dump["params"]:
            name = local_to_universal(e["name"], pp, first)
            if e["name"] == "output_layer.weight":
                continue  # the tied copy on the last stage
            copies.setdefault((name, "model"), []).append((tp, e["model"]))
            if e["range"] is None:
                continue
            fam = manifest["params"][name].get("optimizer", "adam")
            assert e["states"] == ["param", *sorted(FAMILY_STATES[fam])], (name, e["states"])
            assert e["step"] == (6.0 if fam == "adam" else 0.0), name
            for s in e["states"]:
                copies.setdefault((name, s), []).append((tp, e[s].view(e["model"].shape)))
    for name, p in manifest["params"].items():
        states = ("param", *FAMILY_STATES[p.get("optimizer", "adam")])
        model = full_tensor(name, copies[(name, "model")], False)
        assert torch.equal(model, tensors[f"{name}/param"].to(torch.bfloat16)), name
        for s in states:
            tps = [tp for tp, _ in copies[(name, s)]]
            assert len(tps) == len(set(tps)), (name, s, "held by two DP ranks")
            assert torch.equal(full_tensor(name, copies[(name, s)], False), tensors[f"{name}/{s}"]), (name, s)


@pytest.mark.parametrize("fixture,family,target,first", CASES)
def test_torch_dist_target_loads_strictly_in_megatron_core(universal, tmp_path, fixture, family,
                                                           target, first):
    """The fixture (DP2) -> torch_dist at `target` -> megatron-core's strict dist_checkpointing
    load of a LayerWise optimizer at `target`: every key there, none left over, every value the
    source's."""
    lay = Layout.parse(target)
    out = tmp_path / "out"
    reshard(FIXTURES / fixture / "ckpt", out, lay, "torch_dist", progress=False,
            first_stage_layers=first)
    cfg = {**CFG[family], "micro_batch_size": min(2, 4 // lay.dp),  # global batch 4
           **({"extra": {"num_layers_in_first_pipeline_stage": first}} if first else {})}
    res = launch(lay.world_size, "test_megatron_lm_layer_wise_out:load_layer_wise_rank",
                 {"layout": target, "cfg": cfg, "load_dir": str(out), "dump_dir": str(tmp_path / "dump")},
                 env={"PYTHONPATH": RANK_PATH})
    for r in res:
        assert r["unexpected"] == [], r["unexpected"]
        # in the files, asked for by no rank: the rng and rerun-state objects only (the tiny GPT
        # run keeps none), never a tensor
        assert set(r["missing"]) <= {"rng_state", "rerun_state_machine_state"}, r["missing"]
        assert r["iteration"] == 6 and math.isfinite(r["loss"]) and r["loss"] < 6.0, r
    manifest, tensors = universal_tensors(universal[fixture])
    assert_loaded_is_universal(tmp_path / "dump", lay.world_size, manifest, tensors, first)


@pytest.mark.parametrize("fixture", ["torch_dist_muon_dp2", "torch_dist_lion_dp2"])
def test_torch_dist_target_at_the_saved_layout_is_stock_bitwise(tmp_path, fixture):
    """torch_dist Muon / Lion run -> torch_dist at DP2 (the saved layout): the same tensor keys
    and shapes as stock core_v0.19.0's save, every value bitwise (dtype included), and the same
    common state optimizer (chains, param groups, Adam's common_step), content_metadata,
    scheduler and iteration (stock keeps them in the `common_state` object, megatron-ucp in
    common.pt; megatron-core reads either)."""
    out = tmp_path / "out"
    reshard(FIXTURES / fixture / "ckpt", out, Layout(dp=2), "torch_dist", progress=False)
    stock = FIXTURES / fixture / "ckpt"
    keys = tensor_keys(stock)
    assert tensor_keys(out) == keys
    want, got = load_keys(stock, sorted(keys)), load_keys(out, sorted(keys))
    for k in keys:
        assert want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]), k
    common = dist_common(stock), dist_common(out)
    for k in ("optimizer", "content_metadata", "opt_param_scheduler", "iteration"):
        assert_same(common[1][k], common[0][k], k)


@pytest.mark.parametrize("fixture", ["torch_muon_dp2", "torch_dist_muon_dp2"])
def test_torch_target_at_the_saved_layout_is_stock_bitwise(tmp_path, fixture):
    """torch / torch_dist Muon run -> torch at DP2 (the saved layout): each DP rank's
    layer_wise_optimizer_<dp>.pt, and the model file's optimizer (DP rank 0's), equal stock
    core_v0.19.0's files bitwise: megatron-core's own parameter ownership, group order, states,
    steps and hyper-parameters."""
    out = tmp_path / "out"
    reshard(FIXTURES / fixture / "ckpt", out, Layout(dp=2), "torch", progress=False)
    stock = FIXTURES / "torch_muon_dp2" / "ckpt" / "iter_0000006" / "mp_rank_00"
    ours = out / "iter_0000006" / "mp_rank_00"
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in stock.iterdir())
    for dp in (0, 1):
        name = f"layer_wise_optimizer_{dp}.pt"
        assert_same(load(ours / name), load(stock / name), name)
    assert_same(load(ours / "model_optim_rng.pt")["optimizer"],
                load(stock / "model_optim_rng.pt")["optimizer"], "optimizer")


@pytest.mark.parametrize("fixture,family,target,first", CASES)
def test_torch_target_loads_in_megatron_core(universal, tmp_path, fixture, family, target, first):
    """The fixture (DP2) -> torch at `target` -> megatron-core's LayerWise
    load_state_dict_from_file at `target`: every value the source's."""
    lay = Layout.parse(target)
    out = tmp_path / "out"
    reshard(FIXTURES / fixture / "ckpt", out, lay, "torch", progress=False, first_stage_layers=first)
    cfg = {**CFG[family], "micro_batch_size": min(2, 4 // lay.dp),  # global batch 4
           **({"extra": {"num_layers_in_first_pipeline_stage": first}} if first else {})}
    res = launch(lay.world_size, "test_megatron_lm_layer_wise_out:load_layer_wise_torch_rank",
                 {"layout": target, "cfg": cfg, "load_dir": str(out), "dump_dir": str(tmp_path / "dump")},
                 env={"PYTHONPATH": RANK_PATH})
    assert all(r["iteration"] == 6 and math.isfinite(r["loss"]) and r["loss"] < 6.0 for r in res), res
    manifest, tensors = universal_tensors(universal[fixture])
    assert_loaded_is_universal(tmp_path / "dump", lay.world_size, manifest, tensors, first)


@pytest.mark.parametrize("target_format", ["torch", "torch_dist"])
def test_args_of_another_optimizer_are_refused_by_name(universal, tmp_path, target_format):
    """Muon state with the args of an Adam (DistributedOptimizer) run, Adam state with the args of
    a Muon run, and an optimizer form that a LayerWise run has not: refused, naming what differs,
    before anything is written."""
    from megatron_ucp.conversion import write_legacy, write_torch_dist
    from megatron_ucp.errors import UCPError
    from megatron_ucp.formats.megatron_dist import run_fields

    write = write_torch_dist if target_format == "torch_dist" else write_legacy
    adam_args = run_fields(FIXTURES / "torch_dist_tp2_dp2" / "ckpt").args
    muon_args = run_fields(FIXTURES / "torch_dist_muon_dp2" / "ckpt").args
    with pytest.raises(UCPError, match=r"holds muon optimizer state, but the args describe a "
                                       r"DistributedOptimizer run \(--optimizer adam\)"):
        write(universal["torch_dist_muon_dp2"], tmp_path / "a", Layout(dp=1), adam_args, progress=False)
    adam_universal = convert(FIXTURES / "torch_dist_tp2_dp2" / "ckpt", tmp_path / "adam", progress=False)
    with pytest.raises(UCPError, match=r"chained optimizer 0 of the LayerWiseDistributedOptimizer "
                                       r"rebuilt from the args is muon, its parameters .* have adam state"):
        write(adam_universal, tmp_path / "b", Layout(dp=1), muon_args, progress=False)
    if target_format == "torch_dist":
        with pytest.raises(UCPError, match=r"sharding 'dp_reshardable': the args describe a "
                                           r"LayerWiseDistributedOptimizer run"):
            write(universal["torch_dist_muon_dp2"], tmp_path / "c", Layout(dp=1), muon_args,
                  sharding="dp_reshardable", progress=False)
    assert not any((tmp_path / d).exists() for d in "abc")


@pytest.mark.parametrize("target_format", ["torch_dist", "torch"])
def test_universal_source_writes_the_same_target(universal, tmp_path, target_format):
    """The megatron-ucp universal checkpoint of the Muon run, written with the run's args
    (`write_torch_dist` / `write_legacy`), gives the same target as the direct reshard of the
    Megatron-LM save: every tensor (torch_dist) / every rank file (torch) equal."""
    from megatron_ucp.conversion import write_legacy, write_torch_dist
    from megatron_ucp.formats.megatron_dist import run_fields

    fixture = FIXTURES / "torch_dist_muon_dp2" / "ckpt"
    f = run_fields(fixture)
    lay, rng = Layout(dp=1), next(iter(f.rng_state.values()))
    direct = tmp_path / "direct"
    reshard(fixture, direct, lay, target_format, progress=False)
    write = write_torch_dist if target_format == "torch_dist" else write_legacy
    via = write(universal["torch_dist_muon_dp2"], tmp_path / "via", lay, f.args, rng_state=rng,
                num_floating_point_operations_so_far=f.num_floating_point_operations_so_far,
                progress=False)
    if target_format == "torch_dist":
        keys = tensor_keys(direct)
        assert tensor_keys(via) == keys
        a, b = load_keys(direct, sorted(keys)), load_keys(via, sorted(keys))
        assert all(torch.equal(a[k], b[k]) for k in keys)
        assert_same(dist_common(via)["optimizer"], dist_common(direct)["optimizer"], "optimizer")
    else:
        rank_dir = Path("iter_0000006") / "mp_rank_00"
        for name in ("layer_wise_optimizer_0.pt", "model_optim_rng.pt"):
            a, b = load(direct / rank_dir / name), load(via / rank_dir / name)
            if name == "model_optim_rng.pt":
                a, b = {k: a[k] for k in ("model", "optimizer")}, {k: b[k] for k in ("model", "optimizer")}
            assert_same(b, a, name)
