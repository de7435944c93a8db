"""Universal -> Megatron-LM `--ckpt-format torch` checkpoints (megatron_ucp.conversion.write_legacy).

(1) Same layout: fixture -> universal -> legacy at the fixture's own layout reproduces every tensor
    of every file bitwise (model weights, flat buffers including their zero gaps, rng states) and
    every non-tensor field (iteration, step, param groups, scheduler, flops); args differ only in
    the saving rank.
    Every written file is also assembled by hand (tests/oracles.py: torch.load, Megatron-LM's
    flat-buffer rule, no megatron_ucp reader) and must hold the universal tensors it was written
    from, so a bug shared by the legacy reader and writer cannot cancel out.
(2) Another layout: legacy at the target -> universal again equals the first universal bitwise,
    and the hand assembly of the target holds the universal tensors.
(3) The written files load through megatron-core's own legacy path (model load_state_dict,
    DistributedOptimizer.load_state_dict + load_parameter_state) in a launched run at the target
    layout, hold the universal values, and training goes on.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from conftest import NEEDS_LEGACY_GROUPED_MLP
from helpers import FIXTURE_MODEL, assert_same, assert_same_tensors, dump_step_and_finish
from oracles import assert_dumps_hold, assert_holds_universal, legacy_full, load, universal_tensors

from megatron_ucp import UCPError
from megatron_ucp.conversion import convert_legacy, convert_torch_dist, reshard, write_legacy
from megatron_ucp.formats.megatron_legacy import run_fields as legacy_source_fields
from megatron_ucp.layout import Layout
from megatron_ucp.mcore_compat import has_legacy_grouped_mlp
from megatron_ucp.testing.launch import launch

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "megatron_lm"
ITER = "iter_0000006"
STATES = ("param", "exp_avg", "exp_avg_sq")
# fixture -> its uneven first pipeline stage (decoder_first_pipeline_num_layers)
SAME_LAYOUT = {"torch_tp2_pp2": 2, "torch_dp2": None, "torch_llama_tp2": None, "torch_vpp": None,
               "torch_moe_ep2": None, "torch_tp2_fp32": None}
if has_legacy_grouped_mlp():  # saved by the legacy GroupedMLP, which megatron-core 0.19 no longer has
    SAME_LAYOUT["torch_moe_grouped_ep2"] = None


def training_dtype(ckpt: Path) -> torch.dtype:
    args = load(next((ckpt / ITER).iterdir()) / "model_optim_rng.pt")["args"]
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


@pytest.fixture(scope="module")
def universal(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("u")
    return {s: convert_legacy(FIXTURES / s / "ckpt", root / s, progress=False) for s in SAME_LAYOUT}


@pytest.mark.parametrize("name", list(SAME_LAYOUT))
def test_same_layout_round_trip_is_bitwise(universal, name, tmp_path):
    src = FIXTURES / name / "ckpt"
    f = legacy_source_fields(src)
    out = write_legacy(universal[name], tmp_path / "out", f.layout, f.args,
                       rng_state=f.rng_state,
                       num_floating_point_operations_so_far=f.num_floating_point_operations_so_far,
                       first_stage_layers=SAME_LAYOUT[name], progress=False)
    assert (out / "latest_checkpointed_iteration.txt").read_text() == \
        (src / "latest_checkpointed_iteration.txt").read_text().strip()
    dirs = sorted(p.name for p in (src / ITER).iterdir())
    assert sorted(p.name for p in (out / ITER).iterdir()) == dirs
    for d in dirs:
        for fn in ("model_optim_rng.pt", "distrib_optim.pt"):
            a, b = load(src / ITER / d / fn), load(out / ITER / d / fn)
            if fn == "model_optim_rng.pt":
                sa, sb = vars(a.pop("args")), vars(b.pop("args"))
                assert sa.keys() == sb.keys()
                # the saving rank: we record the writer rank; local_rank depends on the node
                assert {k for k in sa if sa[k] != sb[k]} <= {"local_rank"}, d
                assert b["optimizer"] is not None and b["checkpoint_version"] == 3.0
            assert_same(a, b, f"{d}/{fn}")
    assert assert_holds_universal(legacy_full(out), universal[name], training_dtype(out), step=6.0) > 0


@pytest.mark.parametrize("name,target,first", [
    ("torch_tp2_pp2", "tp1pp1dp2", None),
    ("torch_tp2_pp2", "tp1pp2dp1", 2),
    ("torch_vpp", "tp2pp2dp1", None),
    ("torch_llama_tp2", "tp1pp1dp2", None),
    # GroupedMLP EP2 -> EP1: fused weights regrouped
    pytest.param("torch_moe_grouped_ep2", "tp1pp1dp2", None, marks=NEEDS_LEGACY_GROUPED_MLP),
])
def test_other_layout_back_to_universal_is_bitwise(universal, name, target, first, tmp_path):
    lay = Layout.parse(target)
    f = legacy_source_fields(FIXTURES / name / "ckpt")
    rng = next(iter(f.rng_state.values()))
    out = write_legacy(universal[name], tmp_path / "out", lay, f.args, rng_state=rng,
                       first_stage_layers=first, progress=False)
    m = load(next((out / ITER).iterdir()) / "model_optim_rng.pt")
    a = m["args"]
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.data_parallel_size,
            a.world_size, a.virtual_pipeline_model_parallel_size,
            a.decoder_first_pipeline_num_layers) == (lay.tp, lay.pp, lay.dp, lay.world_size,
                                                     lay.vpp, first)
    assert_same(m["rng_state"], rng, "rng_state")
    assert assert_holds_universal(legacy_full(out), universal[name], training_dtype(out), step=6.0) > 0
    again = convert_legacy(out, tmp_path / "u2", progress=False)
    m1, t1 = universal_tensors(universal[name])
    m2, t2 = universal_tensors(again)
    assert t1.keys() == t2.keys()
    for k, t in t1.items():
        assert torch.equal(t, t2[k]), k
    assert Layout.from_json(m2["layout"]) == lay
    assert {p["step"] for p in m2["params"].values()} == {6.0}
    for k in ("scheduler", "iteration", "extra"):
        assert m2[k] == m1[k], k
    # the same hyperparameter groups; at EP1 megatron puts expert weights in the dense optimizer

    def groups(m: dict) -> set[str]:
        return {json.dumps({k: v for k, v in g.items() if k not in ("optimizer", "is_expert_parallel")},
                           sort_keys=True) for g in m["optimizer"]["param_groups"]}
    assert groups(m2) == groups(m1)
    assert m2["optimizer"].get("grad_scaler") == m1["optimizer"].get("grad_scaler")
    if name != "torch_moe_grouped_ep2":
        assert m2["optimizer"] == m1["optimizer"]


def test_reshard_target_format_torch(universal, tmp_path):
    s = reshard(FIXTURES / "torch_tp2_pp2" / "ckpt", tmp_path / "out", Layout(tp=1, pp=1, dp=2),
                target_format="torch", progress=False)
    assert s.target_format == "torch" and s.params > 0 and s.bytes_written > 0
    assert sorted(p.name for p in (tmp_path / "out" / ITER).iterdir()) == ["mp_rank_00"]
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # scratch removed
    # same layout: the source's uneven split and per-rank rng states are kept
    reshard(FIXTURES / "torch_tp2_pp2" / "ckpt", tmp_path / "same", Layout(tp=2, pp=2),
            target_format="torch", progress=False)
    src = load(FIXTURES / "torch_tp2_pp2" / "ckpt" / ITER / "mp_rank_01_001" / "model_optim_rng.pt")
    got = load(tmp_path / "same" / ITER / "mp_rank_01_001" / "model_optim_rng.pt")
    assert got["args"].decoder_first_pipeline_num_layers == 2
    assert_same(got["rng_state"], src["rng_state"], "rng_state")
    for out in (tmp_path / "out", tmp_path / "same"):
        assert_holds_universal(legacy_full(out), universal["torch_tp2_pp2"], torch.bfloat16, step=6.0)


def test_reshard_torch_needs_megatron_source(universal, tmp_path):
    with pytest.raises(UCPError, match=r"needs a Megatron-LM checkpoint \(torch, torch_dist, "
                       r"fsdp_dtensor or torch_dcp\) source, this is a universal checkpoint"
                       r".*no Megatron-LM args"):
        reshard(universal["torch_dp2"], tmp_path / "x", Layout(dp=2), target_format="torch",
                progress=False)
    with pytest.raises(UCPError, match="needs a target layout"):
        reshard(FIXTURES / "torch_dp2" / "ckpt", tmp_path / "y", None, target_format="torch")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_uneven_target_needs_split(universal, tmp_path):
    f = legacy_source_fields(FIXTURES / "torch_dp2" / "ckpt")
    with pytest.raises(UCPError, match=r"num_layers=3 is not divisible by PP=2"):
        write_legacy(universal["torch_dp2"], tmp_path / "x", Layout(pp=2), f.args, progress=False)
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------- megatron-core's own legacy load


# the ranks import this module as tests.test_megatron_legacy_out, which imports tests/oracles.py
RANK_PATH = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])


def patch_distopt_step_load() -> None:
    """In a launched rank: the opt-in load-only workaround of the fixture harness (README
    "Resuming"): megatron-core 0.16.1 with torch AdamW raises KeyError: 'step' when the optimizer
    state it loads has no step (keep the one load_state_dict restored) and shares one step tensor
    among all params."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as DO

    orig_set, orig_load = DO._set_main_param_and_optimizer_states, DO.load_state_dict

    def set_keep_step(self, model_param, tensors):
        if "step" not in tensors:
            gi, go = self.model_param_group_index_map[model_param]
            st = self.optimizer.state[self.optimizer.param_groups[gi]["params"][go]]
            if "step" in st:
                tensors = dict(tensors, step=st["step"].clone())
        return orig_set(self, model_param, tensors)

    def load_unshare_step(self, state_dict):
        r = orig_load(self, state_dict)
        for s in self.optimizer.state.values():
            if "step" in s and torch.is_tensor(s["step"]):
                s["step"] = s["step"].detach().clone()
        return r

    DO._set_main_param_and_optimizer_states, DO.load_state_dict = set_keep_step, load_unshare_step


def load_legacy_rank(layout: str, cfg: dict, load_dir: str, dump_dir: str) -> dict:
    """Rank function: build the tiny GPT at `layout`, load a legacy checkpoint as Megatron-LM's
    load_checkpoint does for `--ckpt-format torch` (model load_state_dict on each chunk's module,
    optimizer.load_state_dict(state['optimizer']), optimizer.load_parameter_state(distrib_optim.pt),
    scheduler), dump the local state, train one step."""
    from megatron.core import parallel_state as ps

    from megatron_ucp.testing import tiny_gpt as tg

    patch_distopt_step_load()

    lay = Layout.parse(layout)
    tg.init_distributed(lay)
    st = tg.build(tg.TinyGPTConfig(**cfg), lay)
    root = Path(load_dir)
    it = int((root / "latest_checkpointed_iteration.txt").read_text())
    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if lay.pp > 1:
        name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
    rank_dir = root / f"iter_{it:07d}" / name
    state = torch.load(rank_dir / "model_optim_rng.pt", map_location="cpu", weights_only=False)
    keys = ["model"] if len(st.model) == 1 else [f"model{i}" for i in range(len(st.model))]
    for k, chunk in zip(keys, st.model):
        chunk.module.load_state_dict(state[k], strict=True)
    st.optimizer.load_state_dict(state["optimizer"])
    st.optimizer.load_parameter_state(str(rank_dir / "distrib_optim.pt"))
    st.scheduler.use_checkpoint_opt_param_scheduler = True
    st.scheduler.load_state_dict(state["opt_param_scheduler"])
    st.iteration = state["iteration"]
    return dump_step_and_finish(st, dump_dir, it)


@pytest.mark.parametrize("target,first", [("tp1pp1dp2", None), ("tp1pp2dp1", 2)])
def test_written_checkpoint_loads_in_megatron_core(universal, tmp_path, target, first):
    """torch_tp2_pp2 -> legacy at the target -> megatron-core's own legacy optimizer load."""
    lay = Layout.parse(target)
    f = legacy_source_fields(FIXTURES / "torch_tp2_pp2" / "ckpt")
    out = write_legacy(universal["torch_tp2_pp2"], tmp_path / "out", lay, f.args,
                       rng_state=next(iter(f.rng_state.values())), first_stage_layers=first,
                       progress=False)
    cfg = {**FIXTURE_MODEL, "min_lr": f.args.min_lr,
           "extra": {"add_qkv_bias": True,
                     **({"num_layers_in_first_pipeline_stage": first} if first else {})}}
    env = {"PYTHONPATH": RANK_PATH}
    res = launch(2, "tests.test_megatron_legacy_out:load_legacy_rank",
                 {"layout": target, "cfg": cfg, "load_dir": str(out),
                  "dump_dir": str(tmp_path / "dump")}, timeout=300, env=env)
    assert all(r["iteration"] == 6 and r["num_steps"] == 28 for r in res)  # 24 samples + 4
    assert all(lr == 1e-3 for r in res for lr in r["lr"])  # the checkpoint's constant schedule
    assert all(math.isfinite(r["loss"]) and r["loss"] < 6.0 for r in res), res

    manifest, tensors = universal_tensors(universal["torch_tp2_pp2"])
    assert_dumps_hold(tmp_path / "dump", manifest, tensors, first, ranks=2)


def test_torch_dist_to_legacy_at_another_layout(tmp_path):
    """A torch_dist run (dp_reshardable, TP2 DP2) -> legacy `--ckpt-format torch` at TP1 DP2 with
    the args from its common.pt: the same universal tensors bitwise, and megatron-core's own legacy
    load resumes it."""
    src = FIXTURES / "torch_dist_tp2_dp2" / "ckpt"
    s = reshard(src, tmp_path / "out", Layout(tp=1, pp=1, dp=2), target_format="torch", progress=False)
    assert s.source_kind == "megatron_torch_dist" and s.target_format == "torch"
    m = load(tmp_path / "out" / ITER / "mp_rank_00" / "model_optim_rng.pt")
    assert (m["args"].ckpt_format, m["args"].use_dist_ckpt, m["args"].tensor_model_parallel_size) == \
        ("torch", False, 1)
    u1 = convert_torch_dist(src, tmp_path / "u1", progress=False)
    m1, t1 = universal_tensors(u1)
    assert_holds_universal(legacy_full(tmp_path / "out"), u1, torch.bfloat16, step=6.0)
    _, t2 = universal_tensors(convert_legacy(tmp_path / "out", tmp_path / "u2", progress=False))
    assert_same_tensors(t1, t2)
    cfg = {**FIXTURE_MODEL, "min_lr": m["args"].min_lr, "extra": {"add_qkv_bias": True}}
    env = {"PYTHONPATH": RANK_PATH}
    res = launch(2, "tests.test_megatron_legacy_out:load_legacy_rank",
                 {"layout": "tp1pp1dp2", "cfg": cfg, "load_dir": str(tmp_path / "out"),
                  "dump_dir": str(tmp_path / "dump")}, timeout=300, env=env)
    assert all(r["iteration"] == 6 and r["num_steps"] == 28 for r in res), res
    assert all(math.isfinite(r["loss"]) and r["loss"] < 6.0 for r in res), res
    assert_dumps_hold(tmp_path / "dump", m1, t1, None, ranks=2)


# ---- every conversion is validated before its commit -------------------------------------------

def test_legacy_export_is_validated_before_commit(tmp_path, monkeypatch):
    """A legacy writer that loses a model tensor is caught by reading the written checkpoint back
    before the commit: a UCPError naming the tensor, no output directory, no partial left."""
    import megatron_ucp.formats.megatron_legacy.writer as legacy_writer

    target_files = legacy_writer._target_files

    def lossy(t, source, model_keys, *fp8):
        models, optim = target_files(t, source, model_keys, *fp8)
        models[0].pop("decoder.final_layernorm.bias", None)
        return models, optim

    monkeypatch.setattr(legacy_writer, "_target_files", lossy)
    with pytest.raises(UCPError, match="final_layernorm.bias"):
        reshard(FIXTURES / "torch_dp2" / "ckpt", tmp_path / "out", Layout(tp=2),
                target_format="torch", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("fault", ["drop_param", "stray_tensor", "wrong_step"])
def test_universal_conversion_is_validated_before_commit(fault, tmp_path, monkeypatch):
    """convert checks what it wrote before renaming it into place: a parameter missing from the
    manifest, a data-file tensor no manifest entry names, a step that is not the source's."""
    import megatron_ucp.formats.universal.writer as universal_writer
    from megatron_ucp.storage import write_tensors

    write_params, param_entry = universal_writer.write_params, universal_writer.ParamEntry
    write_manifest = universal_writer.mf.write

    def lossy_manifest(out_dir, manifest):
        manifest.params.pop("decoder.final_layernorm.bias")
        return write_manifest(out_dir, manifest)

    def faulty_write_params(out_dir, params, read_full, *a, **k):
        entries = write_params(out_dir, params, read_full, *a, **k)
        if fault == "stray_tensor":
            write_tensors(out_dir / "params_00000.safetensors",
                          {**{f"{n}/{s}": read_full(n, s) for n in params for s in entries[n]},
                           "stray/param": torch.zeros(3)}, {})
        return entries

    def faulty_entry(spec, step, **k):
        return param_entry(spec, step + 1, **k)

    monkeypatch.setattr(universal_writer, "write_params", faulty_write_params)
    if fault == "drop_param":
        monkeypatch.setattr(universal_writer.mf, "write", lossy_manifest)
    if fault == "wrong_step":
        monkeypatch.setattr(universal_writer, "ParamEntry", faulty_entry)
    with pytest.raises(UCPError, match="nothing was committed") as ei:
        convert_legacy(FIXTURES / "torch_dp2" / "ckpt", tmp_path / "u", progress=False)
    assert {"drop_param": "lacks parameter(s) ['decoder.final_layernorm.bias']",
            "stray_tensor": "holds tensor(s) ['stray/param']",
            "wrong_step": "at Adam step 7.0, the source at 6.0"}[fault] in str(ei.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_megatron_target_reshard_writes_no_scratch(tmp_path):
    """A Megatron-LM -> Megatron-LM reshard streams: the target writer reads the source directly,
    so beside the output nothing is written (no universal scratch copy), and a refused retry into
    the complete output leaves it alone."""
    src = FIXTURES / "torch_dp2" / "ckpt"
    out = tmp_path / "out"
    reshard(src, out, Layout(tp=2), target_format="torch", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with pytest.raises(UCPError, match="exists and is not empty"):
        reshard(src, out, Layout(tp=2), target_format="torch", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
