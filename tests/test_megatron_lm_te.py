"""Megatron-LM torch / torch_dist checkpoints of Transformer Engine runs (issue 32 item 5), in .venvte.

Fixtures (tests/fixtures/megatron_lm_v019, README "Transformer Engine runs"): stock core_v0.19.0
`pretrain_gpt.py --transformer-impl transformer_engine`, through harness/run_pretrain_gpt_te.py (TE's
kernels do not run on CPU: torch AdamW, a synthetic gradient in place of TE's forward/backward, FP8
metadata created by TE's own `init_fp8_metadata` under megatron-core's recipe and filled before the
save): `torch_dist_te_fp8_tp2` and `torch_te_fp8_tp2` (`--fp8-format hybrid`, delayed scaling, TP2;
each TE module's `_extra_state` is TE's pickled payload, its recipe megatron-core's
`TEDelayedScaling`), `torch_dist_te_drop_extra_dp2` (no FP8, saved as Megatron-LM main's
`--ckpt-drop-redundant-extra-state` saves: no `_extra_state` object at all).

(1) Reading: every module's FP8 state (recipe, scales, amax histories) equals the payload decoded by
    megatron-core's own restricted unpickler (`megatron.core.safe_globals.SafeUnpickler`, names by
    the hand rule `_extra_state/shard_<layer>_<layers>`), bitwise, from both formats; `convert`
    carries it into the universal `te_state`. Before, the torch_dist reader refused the default
    dp_reshardable form of a TE run and dropped FP8 state in the fully_reshardable one; the torch
    reader refused every TE run; te_state's decoder refused megatron-core's `TEDelayedScaling`.
(2) Writing, the decisive test: the FP8 torch_dist at TP2 resharded to torch_dist at another layout
    (fully_reshardable and dp_reshardable; also from the torch fixture), then loaded by megatron-core's
    own `dist_checkpointing.load` (StrictHandling.RETURN_ALL, model and optimizer requests) into a TE
    model built at the target: no key missing or unexpected, `load_state_dict(strict=True)` on the
    module, and every TE module's scales and amax histories, read back through TE's own
    `get_extra_state`, equal the source's bitwise. A torch target loads strictly (`load_state_dict`)
    the same way. On the code before this change the reshard itself is refused (`--transformer-impl
    transformer_engine: rebuilding TransformerEngine layers needs TransformerEngine, which
    megatron-ucp does not use`).
(3) The drop-redundant-extra-state set reads and converts; written with args that ask for the flag,
    the target has no `_extra_state` object either, and keeps the delayed-scaling ones.
(4) Without a usable Transformer Engine a TE target is refused with what to do.

TE >= 2.18 unpickles a delayed-scaling payload only with NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1 (its
policy for every delayed-scaling checkpoint, Megatron-LM's own included): the loading ranks set it.
"""

from __future__ import annotations

import importlib.util
import io
import os
import re
from pathlib import Path

import pytest
import torch
from conftest import TE_SKIP
from oracles import dist_common, load, load_keys

from megatron_ucp.errors import UCPError
from megatron_ucp.layout import Layout
from megatron_ucp.testing.launch import launch

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
if os.environ.get("UCP_REQUIRE_TE") == "1":  # the TE run of make test: a missing TE is an error
    assert HAVE_TE, "UCP_REQUIRE_TE=1 but transformer_engine is not importable"
pytestmark = pytest.mark.skipif(not HAVE_TE, reason=f"{TE_SKIP}make test runs this file in .venvte")
if HAVE_TE:
    import megatron_ucp.testing.cpu_shim  # noqa: F401  (before TE builds a module in this process)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "megatron_lm_v019"
FP8_DIST, FP8_TORCH = FIXTURES / "torch_dist_te_fp8_tp2" / "ckpt", FIXTURES / "torch_te_fp8_tp2" / "ckpt"
DROPPED = FIXTURES / "torch_dist_te_drop_extra_dp2" / "ckpt"
RANK_PATH = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
TE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
TENSORS = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")
# the fixtures' model (harness/run_te.sh) as a tiny_gpt config
MODEL = {"num_layers": 2, "hidden_size": 16, "num_attention_heads": 4, "ffn_hidden_size": 32,
         "seq_length": 32, "vocab_size": 64, "dtype": "bf16", "micro_batch_size": 2,
         "global_batch_size": 4, "min_lr": 0.0, "transformer_impl": "transformer_engine",
         "extra": {"add_qkv_bias": True}}


def safe_unpickle(payload: torch.Tensor) -> dict:
    """megatron-core's own restricted unpickler of TE payloads (independent of megatron_ucp)."""
    from megatron.core.safe_globals import SafeUnpickler

    return SafeUnpickler(io.BytesIO(payload.numpy().tobytes())).load()


def fp8_fields(d: dict) -> dict:
    """What a test compares of one payload: the tensors and the recipe's fields (not its class:
    a written payload holds TE's DelayedScaling, Megatron-LM's megatron-core's TEDelayedScaling)."""
    recipe = {k: (v.name if type(v).__name__ == "Format" else v) for k, v in vars(d["recipe"]).items()
              if k != "_cached_repr"}
    return {"recipe": recipe, **{k: d[k] for k in TENSORS}}


def source_fp8(ckpt: Path) -> dict[str, dict]:
    """{'decoder.layers.<l>.<module>._extra_state': fields} of a torch_dist fixture, by hand."""
    keys = [k for k in _object_keys(ckpt) if "._extra_state/" in k]
    out = {}
    for key, value in load_keys(ckpt, keys).items():
        m = re.fullmatch(r"decoder\.layers\.(.+)\._extra_state/shard_(\d+)_\d+", key)
        if m and value[0].numel():
            name = f"decoder.layers.{m.group(2)}.{m.group(1)}._extra_state"
            out[name] = fp8_fields(safe_unpickle(value[0]))
    return out


def _object_keys(ckpt: Path) -> list[str]:
    from oracles import dist_iteration
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(dist_iteration(ckpt))).read_metadata().state_dict_metadata
    return [k for k, v in meta.items() if not hasattr(v, "size")]


def assert_same_fp8(a: dict[str, dict], b: dict[str, dict]) -> int:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for name in a:
        assert a[name]["recipe"] == b[name]["recipe"], name
        for k in TENSORS:
            x, y = a[name][k], b[name][k]
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), (name, k)
    return len(a)


def module_states(st) -> dict[str, dict]:
    """In a rank: every TE module's extra state as TE's own get_extra_state writes it after the
    load, named by the layer's global number (TransformerLayer.layer_number, 1-based)."""
    from megatron.core.utils import unwrap_model

    out = {}
    for chunk in st.model:
        for layer in unwrap_model(chunk).decoder.layers:
            for sub in TE_MODULES:
                payload = layer.get_submodule(sub).get_extra_state()
                if payload.numel():
                    out[f"decoder.layers.{layer.layer_number - 1}.{sub}._extra_state"] = \
                        fp8_fields(safe_unpickle(payload))
    return out


def _te_run(layout: str):
    from megatron_ucp.testing import te_cpu
    from megatron_ucp.testing import tiny_gpt as tg

    te_cpu.use_cpu_kernels()
    lay = Layout.parse(layout)
    tg.init_distributed(lay)
    return tg.build(tg.TinyGPTConfig(**MODEL), lay)


def load_torch_dist_rank(layout: str, load_dir: str, dump_dir: str) -> dict:
    """Rank function: a TE model at `layout`, the torch_dist checkpoint loaded as Megatron-LM's
    load_checkpoint does (model and optimizer sharded_state_dict with the checkpoint's
    content_metadata, megatron-core's dist_checkpointing.load, strict; the module's
    load_state_dict(strict=True)); dumps the FP8 state TE then holds. Returns the keys the strict
    load found missing or unexpected. (The optimizer's own load_state_dict is not run: megatron-core
    0.19 with torch AdamW refuses every fully_reshardable load, README "Resuming"; its state is
    checked by the read-back before the commit and by tests/test_megatron_dist_out.py.)"""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from megatron.core.utils import unwrap_model

    from megatron_ucp.testing import te_cpu
    from megatron_ucp.testing import tiny_gpt as tg

    st = _te_run(layout)
    # torch AdamW keeps no state before its first step, and megatron-core 0.19's DistributedOptimizer
    # then cannot declare its state (`assert len(steps) == 1`; TE's FusedAdam of a GPU run can): one
    # synthetic step first, whose state the load replaces
    te_cpu.synthetic_step(st)
    root = Path(load_dir)
    ckpt = root / f"iter_{int((root / 'latest_checkpointed_iteration.txt').read_text()):07d}"
    metadata = torch.load(ckpt / "common.pt", map_location="cpu", weights_only=False)["content_metadata"]
    module = unwrap_model(st.model[0])
    model_sd = module.sharded_state_dict(metadata=metadata)
    # the rng request of Megatron-LM's load_checkpoint (checkpointing.get_rng_state, torch_dist)
    rng = ShardedObject("rng_state", [None], (ps.get_pipeline_model_parallel_world_size(),
                                             ps.get_tensor_model_parallel_world_size()),
                        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                        replica_id=ps.get_data_parallel_rank(with_context_parallel=True))
    sd = {"model": model_sd, "rng_state": rng,
          "optimizer": st.optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)}
    loaded, missing, unexpected = dist_checkpointing.load(sd, str(ckpt), strict=StrictHandling.RETURN_ALL)
    module.load_state_dict(loaded["model"], strict=True)
    torch.save(module_states(st), Path(dump_dir) / f"fp8_rank{torch.distributed.get_rank()}.pt")
    tg.destroy()
    return {"missing": sorted(missing), "unexpected": sorted(unexpected),
            "iteration": loaded["iteration"], "rng": loaded["rng_state"][0] is not None}


def load_torch_rank(layout: str, load_dir: str, dump_dir: str) -> dict:
    """Rank function: a TE model at `layout`, its rank directory's model_optim_rng.pt loaded with
    load_state_dict(strict=True) (Megatron-LM's load_checkpoint for --ckpt-format torch); dumps the
    FP8 state TE then holds."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import unwrap_model

    from megatron_ucp.testing import tiny_gpt as tg

    st = _te_run(layout)
    lay = Layout.parse(layout)
    root = Path(load_dir)
    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    rank_dir = root / f"iter_{int((root / 'latest_checkpointed_iteration.txt').read_text()):07d}" / (
        f"mp_rank_{tp:02d}" if lay.pp == 1 else f"mp_rank_{tp:02d}_{pp:03d}")
    saved = torch.load(rank_dir / "model_optim_rng.pt", map_location="cpu", weights_only=False)
    unwrap_model(st.model[0]).load_state_dict(saved["model"], strict=True)
    torch.save(module_states(st), Path(dump_dir) / f"fp8_rank{torch.distributed.get_rank()}.pt")
    tg.destroy()
    return {"iteration": saved["iteration"]}


def dumped_fp8(dump_dir: Path) -> dict[str, dict]:
    """The ranks' dumps put together; copies of a module (TP, DP ranks) must be equal."""
    out: dict[str, dict] = {}
    for p in sorted(dump_dir.glob("fp8_rank*.pt")):
        for name, d in load(p).items():
            if name in out:
                assert_same_fp8({name: out[name]}, {name: d})
            out[name] = d
    return out


@pytest.fixture(scope="module")
def expected() -> dict[str, dict]:
    """The FP8 torch_dist fixture's module states, by hand: 2 layers x 4 TE modules."""
    fp8 = source_fp8(FP8_DIST)
    assert len(fp8) == 8
    recipe = next(iter(fp8.values()))["recipe"]
    assert (recipe["fp8_format"], recipe["amax_history_len"], recipe["margin"]) == ("HYBRID", 1, 0)
    return fp8


# ------------------------------------------------------------------ reading


def as_fields(states: dict) -> dict[str, dict]:
    """megatron_ucp's te_state.ModuleState map -> the fields `fp8_fields` gives."""
    return {n: {"recipe": {k: v for k, v in s.recipe.items() if k != "class"}, **s.tensors}
            for n, s in states.items()}


def test_fp8_state_of_both_formats_reads_as_megatron_core_decodes_it(expected, tmp_path):
    """Both FP8 fixtures (one harness, the same FP8 fill) read into the same state, bitwise equal to
    megatron-core's own decoding of the torch_dist payloads; the universal conversion keeps it."""
    from megatron_ucp import te_state
    from megatron_ucp.conversion import convert
    from megatron_ucp.formats import manifest as mf
    from megatron_ucp.formats import open_source
    from megatron_ucp.formats.megatron_te import encode
    from megatron_ucp.storage import Reader

    for ckpt in (FP8_DIST, FP8_TORCH):
        states = open_source(ckpt, progress=False).te_states()
        assert {s.recipe["class"] for s in states.values()} == {"DelayedScaling"}
        assert assert_same_fp8(expected, as_fields(states)) == 8
        # what a target writes (TE's own payload form) decodes to the same state, recipe included
        assert all(te_state.decode(encode(s), n).digest() == s.digest() for n, s in states.items())
    # the torch fixture's payloads (every TP rank's copy), decoded by megatron-core by hand
    for tp in (0, 1):
        model = load(FP8_TORCH / "iter_0000002" / f"mp_rank_{tp:02d}" / "model_optim_rng.pt")["model"]
        by_hand = {k: fp8_fields(safe_unpickle(v)) for k, v in model.items()
                   if k.endswith("._extra_state") and torch.is_tensor(v) and v.numel()}
        assert assert_same_fp8(expected, by_hand) == 8
    u = convert(FP8_DIST, tmp_path / "u", progress=False)
    field = mf.read(mf.resolve(u)).te_state
    assert set(field["modules"]) == set(expected)
    back = te_state.read(Reader(), u, field, list(field["modules"]))
    assert assert_same_fp8(expected, as_fields(back)) == 8


# ------------------------------------------------------------------ writing (the decisive test)

TARGETS = [  # (source, target layout, torch_dist optimizer form)
    (FP8_DIST, "tp1dp2", "fully_reshardable"),
    (FP8_DIST, "tp1pp2", "dp_reshardable"),
    (FP8_TORCH, "tp2", "fully_reshardable"),
]


@pytest.mark.parametrize("source, target, sharding", TARGETS, ids=lambda v: getattr(v, "parent", v).name
                         if isinstance(v, Path) else str(v))
def test_te_fp8_torch_dist_target_loads_strictly_in_megatron_core(expected, source, target, sharding,
                                                                  tmp_path):
    """The TP2 FP8 run resharded to torch_dist at `target`, loaded by megatron-core's own strict
    dist_checkpointing.load into a TE model there: nothing missing or unexpected, the module loads
    strictly, every TE module's FP8 state is the source's, bitwise."""
    from megatron_ucp.conversion import reshard

    out = reshard(source, tmp_path / "out", Layout.parse(target), target_format="torch_dist",
                  optim_sharding=sharding, progress=False).output
    assert dist_common(out)["content_metadata"]["distrib_optim_sharding_type"] == sharding
    assert assert_same_fp8(expected, source_fp8(out)) == 8  # the files, read by hand
    dump = tmp_path / "dump"
    dump.mkdir()
    env = {"PYTHONPATH": RANK_PATH, "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE": "1"}
    res = launch(Layout.parse(target).world_size, "tests.test_megatron_lm_te:load_torch_dist_rank",
                 {"layout": target, "load_dir": str(out), "dump_dir": str(dump)}, timeout=400, env=env)
    assert all(r["missing"] == [] and r["unexpected"] == [] for r in res), res
    assert all(r["iteration"] == 2 and r["rng"] for r in res)
    assert assert_same_fp8(expected, dumped_fp8(dump)) == 8


def test_te_fp8_torch_target_loads_strictly_in_megatron_core(expected, tmp_path):
    """The FP8 torch_dist run written as a --ckpt-format torch checkpoint at TP1 DP2: each rank's
    model_optim_rng.pt loads with load_state_dict(strict=True) into a TE model (every
    `_extra_state` key there), and TE then holds the source's FP8 state bitwise."""
    from megatron_ucp.conversion import reshard

    out = reshard(FP8_DIST, tmp_path / "out", Layout(dp=2), target_format="torch", progress=False).output
    model = load(out / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")["model"]
    by_hand = {k: fp8_fields(safe_unpickle(v)) for k, v in model.items()
               if k.endswith("._extra_state") and torch.is_tensor(v) and v.numel()}
    assert assert_same_fp8(expected, by_hand) == 8
    dump = tmp_path / "dump"
    dump.mkdir()
    env = {"PYTHONPATH": RANK_PATH, "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE": "1"}
    res = launch(2, "tests.test_megatron_lm_te:load_torch_rank",
                 {"layout": "dp2", "load_dir": str(out), "dump_dir": str(dump)}, timeout=400, env=env)
    assert all(r["iteration"] == 2 for r in res)
    assert assert_same_fp8(expected, dumped_fp8(dump)) == 8


# ------------------------------------------------------------------ --ckpt-drop-redundant-extra-state


def test_dropped_extra_state_checkpoint_reads_converts_and_is_written_alike(expected, tmp_path):
    """A save without `_extra_state` objects (Megatron-LM main's --ckpt-drop-redundant-extra-state,
    no FP8) converts; a TE target of it has every `_extra_state` object (empty), or none when its
    args ask for the flag; under the flag the FP8 run's delayed-scaling objects are kept (from its
    universal conversion: the universal form's FP8 state written back)."""
    from megatron_ucp.conversion import convert, write_torch_dist
    from megatron_ucp.formats import manifest as mf
    from megatron_ucp.formats import open_source
    from megatron_ucp.formats.megatron_dist import run_fields

    assert not [k for k in _object_keys(DROPPED) if "_extra_state" in k]
    u = convert(DROPPED, tmp_path / "u", progress=False)
    assert mf.read(mf.resolve(u)).te_state is None and open_source(DROPPED, progress=False).te_states() == {}
    args = run_fields(DROPPED).args
    plain = write_torch_dist(u, tmp_path / "plain", Layout(tp=2), args, progress=False)
    objects = [k for k in _object_keys(plain) if "._extra_state" in k]
    assert len(objects) == 9 and all(v[0].numel() == 0 for v in load_keys(plain, objects).values())
    args.ckpt_drop_redundant_extra_state = True
    dropped = write_torch_dist(u, tmp_path / "dropped", Layout(tp=2), args, progress=False)
    assert not [k for k in _object_keys(dropped) if "_extra_state" in k]
    fp8_args = run_fields(FP8_DIST).args
    fp8_args.ckpt_drop_redundant_extra_state = True
    u8 = convert(FP8_DIST, tmp_path / "u8", progress=False)
    kept = write_torch_dist(u8, tmp_path / "kept", Layout(dp=2), fp8_args, progress=False)
    assert assert_same_fp8(expected, source_fp8(kept)) == 8
    assert len([k for k in _object_keys(kept) if "_extra_state" in k]) == 8  # the final norm's is dropped


# ------------------------------------------------------------------ without Transformer Engine


def test_te_target_is_refused_where_te_is_not_usable(tmp_path, monkeypatch):
    """Without a usable TE (here: as if its import failed) a TE run's torch_dist / torch target is
    refused with what to do (its fully_reshardable torch_dist source, whose tensor keys are the local
    spec's, still reads); so are its sources that need TE's layers (the dp_reshardable buffers'
    parameter order, the torch format's state-dict keys). Nothing is written."""
    from megatron_ucp.conversion import reshard
    from megatron_ucp.formats import megatron_te

    monkeypatch.setattr(megatron_te, "_TE_UNAVAILABLE", "importing it fails: RuntimeError: (test)")
    for fmt in ("torch", "torch_dist"):
        with pytest.raises(UCPError, match=r"args template.*transformer_engine.*where Transformer Engine "
                                           r"is installed"):
            reshard(DROPPED, tmp_path / fmt, Layout(tp=2), target_format=fmt, progress=False)
    with pytest.raises(UCPError, match=r"dp_reshardable optimizer buffers.*where Transformer Engine is "
                                       r"installed"):
        reshard(FP8_DIST, tmp_path / "u", Layout(dp=2), progress=False)
    with pytest.raises(UCPError, match=r"transformer_engine.*where Transformer Engine is installed"):
        reshard(FP8_TORCH, tmp_path / "u2", Layout(dp=2), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_grouped_linear_state_splits_per_expert_as_megatron_core_and_back():
    """A torch checkpoint holds one payload per TE grouped linear (all its gemms), torch_dist one
    per expert: `split_gemms` takes gemm g's column as megatron-core's `_split_extra_state` does
    (scale.view(rows, -1)[:, g], amax_history.view(L, rows, -1)[:, :, g]; num_gemms 1) and
    `merge_gemms` puts them back bitwise; the written payload is TE's own form."""
    from megatron_ucp.formats.megatron_te import encode, merge_gemms, split_gemms
    from megatron_ucp.te_state import ModuleState, decode

    n, length = 4, 3
    tensors = {"scale_fwd": torch.arange(3.0 * n), "scale_bwd": -torch.arange(2.0 * n),
               "amax_history_fwd": torch.arange(length * 3.0 * n).view(length, -1),
               "amax_history_bwd": -torch.arange(length * 2.0 * n).view(length, -1)}
    recipe = {"class": "DelayedScaling", "fp8_format": "HYBRID", "amax_history_len": length, "margin": 0}
    merged = ModuleState(recipe, {"num_gemms": n, "fp8_checkpoint": True}, "te2-pickle", tensors)
    parts = split_gemms(merged, n, "test")
    for g, p in enumerate(parts):
        assert p.variables["num_gemms"] == 1
        for k, rows in (("fwd", 3), ("bwd", 2)):
            assert torch.equal(p.tensors[f"scale_{k}"], tensors[f"scale_{k}"].view(rows, -1)[:, g])
            assert torch.equal(p.tensors[f"amax_history_{k}"],
                               tensors[f"amax_history_{k}"].view(length, rows, -1)[:, :, g])
    again = merge_gemms(parts, "test")
    assert again.variables["num_gemms"] == n
    assert all(torch.equal(again.tensors[k], t) for k, t in tensors.items())
    payload = encode(again)
    d = safe_unpickle(payload)
    assert type(d["recipe"]).__module__ == "transformer_engine.common.recipe"
    assert d["recipe"].amax_history_len == length and d["extra_fp8_variables"]["num_gemms"] == n
    assert all(torch.equal(d[k], t) for k, t in tensors.items())
    back = decode(payload, "test")
    assert all(torch.equal(back.tensors[k], t) for k, t in tensors.items())
    assert {k: back.recipe[k] for k in recipe} == recipe
    assert encode(None).numel() == 0
