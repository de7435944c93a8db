"""megatron_ucp.megatron_lm: Megatron-LM's save/load hooks, their flags and their delegation.

CI has no Megatron-LM checkout (megatron.training), so the hooks run with real megatron-core (tiny
GPT, DDP, DistributedOptimizer, scheduler) in launched gloo processes and get their arguments from
`set_args_source`, the namespace Megatron-LM's `get_args()` would return. The real Megatron-LM
pretrain_gpt.py route is recorded in patches/README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import pytest

from megatron_ucp import megatron_lm
from megatron_ucp.testing.launch import launch

HERE = Path(__file__).resolve().parent
THIS = f"{Path(__file__).stem}"
# 2 layers keep both launches short; vocab 256 padded from 251 = NullTokenizer(--vocab-size 250) + EOD
CFG = {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "vocab_size": 256,
       "unpadded_vocab_size": 251, "global_batch_size": 8, "micro_batch_size": 2}
STEPS = 2
FLOPS = 12345.0


def _megatron_args(**kw) -> argparse.Namespace:
    """The fields of Megatron-LM's args the hooks read, as `pretrain_gpt.py` would set them."""
    base = dict(ckpt_format="torch_dist", ucp_save=False, universal_checkpoint=False, save=None,
                load=None, seed=1234, tokenizer_type="NullTokenizer", vocab_size=250,
                padded_vocab_size=256, consumed_train_samples=0, skipped_train_samples=0,
                consumed_valid_samples=0, finetune=False, no_load_optim=False, no_load_rng=False,
                pretrained_checkpoint=None)
    return argparse.Namespace(**{**base, **kw})


# ------------------------------------------------------------------------- launched ranks

def rank_train_and_save(save_dir: str) -> dict:
    """TP2: train, save through the save hook (--ucp-save --async-save), then one more step (the
    reference); the commit comes from the training loop's maybe_finalize_async_save hook."""
    from megatron_ucp import saver
    from megatron_ucp.layout import Layout
    from megatron_ucp.testing import tiny_gpt as tg

    layout = Layout.parse("tp2")
    tg.init_distributed(layout)
    st = tg.build(tg.TinyGPTConfig(**CFG), layout)
    for _ in range(STEPS):
        tg.train_step(st)
    args = _megatron_args(ucp_save=True, save=save_dir, seed=st.config.seed, async_save=True,
                          consumed_train_samples=STEPS * CFG["global_batch_size"],
                          skipped_train_samples=3, consumed_valid_samples=5)
    megatron_lm.set_args_source(lambda: args)
    megatron_lm._ORIGINALS["maybe_finalize_async_save"] = lambda *a, **k: calls.append((a, k))
    calls: list = []
    megatron_lm.save_checkpoint(st.iteration, st.model, st.optimizer, st.scheduler, FLOPS)
    pending = saver.pending()
    continued = tg.train_step(st)
    megatron_lm.maybe_finalize_async_save(blocking=True, terminate=True)  # end of training
    tg.destroy()
    return {"continued": continued, "pending_after_save": pending, "pending_after_finalize":
            saver.pending(), "original_calls": [[list(a), k] for a, k in calls]}


def rank_load_and_train(load_dir: str, empty_dir: str) -> dict:
    """TP1 DP2: the load hook's fresh-start, error and resume paths, then one training step."""
    import torch
    import torch.distributed as dist

    from megatron_ucp.errors import UCPError
    from megatron_ucp.layout import Layout
    from megatron_ucp.optimizer_state import torch_optimizers
    from megatron_ucp.testing import tiny_gpt as tg

    layout = Layout.parse("dp2")
    tg.init_distributed(layout)
    st = tg.build(tg.TinyGPTConfig(**CFG), layout)
    out: dict = {}

    # --ckpt-format universal with nothing under --load: a fresh start, as Megatron-LM does
    args = _megatron_args(ckpt_format="universal", load=empty_dir)
    megatron_lm.set_args_source(lambda: args)
    out["fresh"] = list(megatron_lm.load_checkpoint(st.model, st.optimizer, st.scheduler))
    # --universal-checkpoint names a checkpoint explicitly: a missing one is an error
    args = _megatron_args(universal_checkpoint=True, load=empty_dir)
    try:
        megatron_lm.load_checkpoint(st.model, st.optimizer, st.scheduler)
        out["missing_error"] = None
    except UCPError as e:
        out["missing_error"] = str(e)
    # --no-load-optim: the weights, and the optimizer and its schedule as built (no state yet)
    args = _megatron_args(universal_checkpoint=True, load=load_dir, no_load_optim=True)
    megatron_lm.load_checkpoint(st.model, st.optimizer, st.scheduler)
    out["no_load_optim"] = [sum(len(s) for o in torch_optimizers(st.optimizer) for s in o.state.values()),
                            st.scheduler.num_steps]
    dist.barrier()

    args = _megatron_args(universal_checkpoint=True, load=load_dir)
    iteration, flops = megatron_lm.load_checkpoint(st.model, st.optimizer, st.scheduler)
    out.update(iteration=iteration, flops=flops,
               counters=[args.consumed_train_samples, args.skipped_train_samples,
                         args.consumed_valid_samples])
    # every parameter has its own Adam step tensor, at the saved step
    steps = [s["step"] for o in torch_optimizers(st.optimizer) for s in o.state.values()]
    out["steps"] = sorted({float(s) for s in steps})
    out["distinct_step_tensors"] = len({id(s) for s in steps}) == len(steps) and all(
        torch.is_tensor(s) for s in steps)
    st.iteration = iteration
    out["loss"] = tg.train_step(st)
    tg.destroy()
    return out


# ------------------------------------------------------------------------------------ tests

def test_extra_args_provider_adds_flags_and_universal_format():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-format", choices=("torch", "torch_dist"), default="torch_dist")
    seen = []
    provider = megatron_lm.chain_extra_args_providers(
        None, lambda p: seen.append("theirs") or p, megatron_lm.extra_args_provider,
        megatron_lm.extra_args_provider)  # twice: idempotent (as with the patch's own flags)
    parser = provider(parser)
    assert seen == ["theirs"]
    args = parser.parse_args(["--ckpt-format", "universal", "--universal-checkpoint", "--ucp-save"])
    assert (args.ckpt_format, args.universal_checkpoint, args.ucp_save) == ("universal", True, True)
    args = parser.parse_args([])
    assert not megatron_lm.wants_ucp_save(args) and not megatron_lm.wants_ucp_load(args)
    assert megatron_lm.wants_ucp_save(argparse.Namespace(ckpt_format="universal"))
    assert megatron_lm.wants_ucp_load(argparse.Namespace(ckpt_format="universal"))
    assert megatron_lm.wants_ucp_load(argparse.Namespace(ckpt_format="torch", universal_checkpoint=True))


def test_overlap_recompute_flag_selects_the_plan_schedule(tmp_path, monkeypatch):
    """--overlap-recompute PLAN.json: the training loop's forward-backward function executes the
    plan (launched runs of it: tests/test_recompute_runtime.py); without it, megatron-core's."""
    import megatron_ucp.testing.cpu_shim  # noqa: F401, I001  (must precede megatron.core)
    from megatron.core.pipeline_parallel import schedules

    from megatron_ucp.recompute import plan as recompute_plan
    from megatron_ucp.recompute.plan import PlanError
    from megatron_ucp.testing.recompute_plans import make_plan

    parser = megatron_lm.extra_args_provider(argparse.ArgumentParser())
    assert parser.parse_args([]).overlap_recompute is None
    path = tmp_path / "plan.json"
    assert parser.parse_args(["--overlap-recompute", str(path)]).overlap_recompute == str(path)

    monkeypatch.setattr(megatron_lm, "_ARGS_SOURCE", lambda: _megatron_args())
    assert megatron_lm.get_forward_backward_func(2, None) is \
        schedules.forward_backward_pipelining_without_interleaving
    assert megatron_lm.get_forward_backward_func(1, None) is schedules.forward_backward_no_pipelining

    recompute_plan.save(make_plan(["full", "none", "full:inline", "selective:core_attn"], 2, CFG), path)
    monkeypatch.setattr(megatron_lm, "_ARGS_SOURCE", lambda: _megatron_args(overlap_recompute=str(path)))
    monkeypatch.setattr(megatron_lm, "_OVERLAP_SCHEDULES", {})
    func = megatron_lm.get_forward_backward_func()
    assert func.__qualname__.startswith("forward_backward_func.")  # runtime's, not megatron-core's
    assert megatron_lm.get_forward_backward_func() is func  # loaded once
    bad = tmp_path / "not_a_plan.json"
    bad.write_text('{"version": 99}')
    monkeypatch.setattr(megatron_lm, "_ARGS_SOURCE", lambda: _megatron_args(overlap_recompute=str(bad)))
    with pytest.raises(PlanError, match="not_a_plan.json"):
        megatron_lm.get_forward_backward_func()


def test_true_vocab_size():
    assert megatron_lm.true_vocab_size(_megatron_args()) == 251  # NullTokenizer adds EOD
    assert megatron_lm.true_vocab_size(_megatron_args(tokenizer_type="GPT2BPETokenizer")) is None
    assert megatron_lm.true_vocab_size(_megatron_args(vocab_size=300)) is None  # > padded: unknown


def test_hooks_delegate_to_megatron_lm_when_not_asked(monkeypatch):
    """Megatron-LM's own functions get exactly the call the hooks got, positional and keyword, with
    core_v0.19.0's extra parameters (dp_group, expt_dp_group, rng_state_key_prefix) too."""
    calls = {}
    monkeypatch.setitem(megatron_lm._ORIGINALS, "save_checkpoint",
                        lambda *a, **k: calls.setdefault("save", (a, k)))
    monkeypatch.setitem(megatron_lm._ORIGINALS, "load_checkpoint",
                        lambda *a, **k: calls.setdefault("load", (a, k)) and (7, 8.0))
    monkeypatch.setattr(megatron_lm, "_ARGS_SOURCE", lambda: _megatron_args())
    megatron_lm.save_checkpoint(5, "model", "opt", "sched", 1.5, "ctx", non_persistent_ckpt=True,
                                release=True, dp_cp_group="g", dp_group="d", rng_state_key_prefix="p")
    assert calls["save"] == ((5, "model", "opt", "sched", 1.5, "ctx"),
                             {"non_persistent_ckpt": True, "release": True, "dp_cp_group": "g",
                              "dp_group": "d", "rng_state_key_prefix": "p"})
    assert megatron_lm.load_checkpoint("model", "opt", "sched", "pretrained_checkpoint",
                                       strict=False) == (7, 8.0)
    assert calls["load"] == (("model", "opt", "sched", "pretrained_checkpoint", False, None), {})
    calls.clear()
    positional = (None, None, None, None, None, True, None, None, True, None, None, "g", "d", "e", "p")
    megatron_lm.save_checkpoint(5, "model", "opt", "sched", 1.5, "ctx", *positional)
    assert calls["save"] == ((5, "model", "opt", "sched", 1.5, "ctx", *positional), {})
    assert megatron_lm._named(megatron_lm.SAVE_PARAMS, positional, {})["expt_dp_group"] == "e"


def test_save_hook_then_load_hook_at_another_layout(tmp_path):
    (tmp_path / "empty").mkdir()
    _save_hook_then_load_hook(str(tmp_path / "ckpt"), str(tmp_path / "empty"),
                              "not a megatron-ucp checkpoint")


def test_save_and_load_hooks_with_a_bucket(s3_prefix, tmp_path, monkeypatch):
    """`--save s3://... --ckpt-format universal` (async save, committed by the finalize hook),
    then `--load s3://...` at TP1xDP2 and an empty prefix as a fresh start, against the SeaweedFS
    server; nothing is written locally (no `s3:` directory)."""
    monkeypatch.chdir(tmp_path)
    # (a store has no empty directories: an empty prefix is one that does not exist)
    _save_hook_then_load_hook(f"{s3_prefix}/ckpt", f"{s3_prefix}/empty", f"{s3_prefix}/empty does not exist")
    assert list(tmp_path.iterdir()) == []


def _save_hook_then_load_hook(save_dir: str, empty: str, missing_error: str) -> None:
    from megatron_ucp.storage import location

    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)}
    src = launch(2, f"{THIS}:rank_train_and_save", {"save_dir": save_dir}, env=env)
    for r in src:  # --async-save: committed by the finalize hook, which also ran Megatron-LM's own
        assert r["pending_after_save"] == STEPS and r["pending_after_finalize"] is None
        assert r["original_calls"] == [[[], {"blocking": True, "terminate": True}]]
    save_dir = location(save_dir)
    manifest = json.loads((save_dir / "iter_0000002" / "manifest.json").read_text())
    assert (save_dir / "latest").read_text().strip() == "iter_0000002"
    assert manifest["model"]["unpadded_vocab_size"] == 251
    assert manifest["extra"] == {"consumed_train_samples": 16, "skipped_train_samples": 3,
                                 "consumed_valid_samples": 5, "release": False,
                                 "num_floating_point_operations_so_far": FLOPS}
    assert manifest["seed"] == 1234 and manifest["layout"]["tp"] == 2

    res = launch(2, f"{THIS}:rank_load_and_train",
                 {"load_dir": str(save_dir), "empty_dir": empty}, env=env)
    for r in res:
        assert r["fresh"] == [0, 0]
        assert r["missing_error"] and missing_error in r["missing_error"], r["missing_error"]
        assert r["no_load_optim"] == [0, 0]
        assert (r["iteration"], r["flops"]) == (STEPS, FLOPS)
        assert r["counters"] == [16, 3, 5]
        assert r["steps"] == [float(STEPS)] and r["distinct_step_tensors"]
    ref, got = src[0]["continued"], res[0]["loss"]
    assert math.isclose(got, ref, rel_tol=1e-5), (ref, got)  # fp32, TP2 -> DP2: reduction order only


def test_install_hooks_megatron_training(monkeypatch):
    """install() on the megatron.training the environment has (megatron-core 0.19's wheel ships
    core_v0.19.0's; 0.16's none): the hooks replace save/load/finalize where the training loop
    looks them up, and Megatron-LM's own parse_args takes `--ckpt-format universal` (core_v0.19.0's
    initialize has no parse_args to wrap: install() failed there with AttributeError)."""
    # (a release skip: megatron-core 0.19's wheel ships megatron.training, 0.16's does not)
    pytest.importorskip("megatron.training.training",
                        reason="release: this megatron-core wheel ships no megatron.training (Megatron-LM)")
    import sys

    import megatron.training.arguments as arguments
    import megatron.training.async_utils as async_utils
    import megatron.training.checkpointing as ckpt
    import megatron.training.initialize as initialize
    import megatron.training.training as training

    names = ("save_checkpoint", "load_checkpoint", "maybe_finalize_async_save", "parse_args",
             "get_forward_backward_func")
    for module in (arguments, async_utils, ckpt, initialize, training):  # restored after the test
        for name in names:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setattr(megatron_lm, "_ORIGINALS", {})
    megatron_lm.install()
    megatron_lm.install()  # idempotent
    for module in (ckpt, training):
        assert module.save_checkpoint is megatron_lm.save_checkpoint
        assert module.load_checkpoint is megatron_lm.load_checkpoint
    for module in (async_utils, training):
        assert module.maybe_finalize_async_save is megatron_lm.maybe_finalize_async_save
    assert megatron_lm._ORIGINALS["save_checkpoint"] is not megatron_lm.save_checkpoint
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--ckpt-format", "universal", "--async-save"])
    args = arguments.parse_args()
    assert (args.ckpt_format, args.ucp_save, args.universal_checkpoint, args.async_save) == \
        ("universal", False, False, True)


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
