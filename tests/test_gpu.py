"""GPU proof (`make test-gpu`, marker `gpu`): megatron-core on CUDA with NCCL, bf16, the Adam that
megatron-core picks (Transformer Engine's FusedAdam when TE is installed), and Transformer Engine
layers (`get_gpt_layer_with_transformer_engine_spec`). Skipped on hosts without a GPU (CI).

- save (sync and async) and load on the GPU: every model tensor, fp32 master weight, Adam moment
  and step after the load equals, bitwise, the state dumped at the save;
- the async save's files hold the state at the save although training went on before the commit;
- TE and local layer specs name the same universal tensors (GPT, and MLA whose norms TE fuses):
  TE -> local -> TE round trips are bitwise equal in the universal form;
- staging returns pinned host copies, bitwise, reusing its buffer.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import SCENARIOS, STEPS
from test_transitions import universal_tensors

from megatron_ucp.staging import HostStager
from megatron_ucp.testing.devices import has_real_cuda
from megatron_ucp.testing.launch import launch

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
REAL_CUDA = has_real_cuda()  # without the CPU shim: importing it would change this process
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not REAL_CUDA, reason="needs a CUDA GPU")]
needs_te = pytest.mark.skipif(not (REAL_CUDA and HAVE_TE),
                             reason="needs a CUDA GPU with Transformer Engine")

# cuBLAS and Transformer Engine pick deterministic kernels: a same-layout resume is then exact
DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
BASE = {"dtype": "bf16", "swiglu": True, "num_query_groups": 2, "hidden_size": 128,
        "num_attention_heads": 8, "ffn_hidden_size": 256, "seq_length": 64}
TE = {**BASE, "transformer_impl": "transformer_engine"}
LOCAL = {**BASE, "transformer_impl": "local"}


def _dump(path) -> dict:
    d = torch.load(path / "rank0.pt", weights_only=False)
    return {(e["chunk"], e["name"]): e for e in d["params"]}


def assert_same_state(saved_dir, loaded_dir) -> int:
    saved, loaded = _dump(saved_dir), _dump(loaded_dir)
    assert saved.keys() == loaded.keys()
    n = 0
    for key, s in saved.items():
        lo = loaded[key]
        assert torch.equal(s["model"], lo["model"]), (key, "model")
        assert s["range"] == lo["range"], key
        if s["range"] is not None:
            assert s["step"] == lo["step"] == STEPS, (key, s["step"], lo["step"])
            for state in ("param", "exp_avg", "exp_avg_sq"):
                assert torch.equal(s[state], lo[state]), (key, state)
                n += 1
    return n


@pytest.fixture(scope="module", params=["sync", "async"])
def te_run(request, tmp_path_factory):
    if not HAVE_TE:
        pytest.skip("needs Transformer Engine")
    d = tmp_path_factory.mktemp(f"gpu_te_{request.param}")
    res = launch(1, f"{SCENARIOS}:train_and_save",
                 {"layout": "tp1", "cfg": TE, "steps": STEPS, "save_dir": str(d / "ckpt"),
                  "continue_steps": STEPS, "dump_dir": str(d / "dump"),
                  "async_save": request.param == "async"}, timeout=600, env=DETERMINISTIC)
    return {"dir": d, "res": res[0], "mode": request.param}


@needs_te
def test_te_fused_adam_bf16_save_load_bitwise(te_run, tmp_path):
    assert "FusedAdam" in te_run["res"]["optimizer"], te_run["res"]["optimizer"]
    if te_run["mode"] == "async":
        assert te_run["res"]["pending_while_training"] == STEPS
    res = launch(1, f"{SCENARIOS}:load_and_train",
                 {"layout": "tp1", "cfg": TE, "load_dir": str(te_run["dir"] / "ckpt"), "steps": STEPS,
                  "dump_dir": str(tmp_path / "dump")}, timeout=600, env=DETERMINISTIC)
    assert res[0]["iteration"] == STEPS and res[0]["rng_restored"]
    assert assert_same_state(te_run["dir"] / "dump", tmp_path / "dump") > 0
    # same state, same data, deterministic kernels (DETERMINISTIC): the same losses, bit for bit
    assert res[0]["losses"] == te_run["res"]["continued"]


@needs_te
def test_te_and_local_specs_share_universal_names(te_run, tmp_path):
    if te_run["mode"] != "sync":
        pytest.skip("one round trip is enough")
    src = te_run["dir"] / "ckpt"
    launch(1, f"{SCENARIOS}:load_and_train",
           {"layout": "tp1", "cfg": LOCAL, "load_dir": str(src), "steps": 1,
            "resave_dir": str(tmp_path / "local")}, timeout=600, env=DETERMINISTIC)
    launch(1, f"{SCENARIOS}:load_and_train",
           {"layout": "tp1", "cfg": TE, "load_dir": str(tmp_path / "local"), "steps": 1,
            "resave_dir": str(tmp_path / "te_again")}, timeout=600, env=DETERMINISTIC)
    a = universal_tensors(src, tmp_path / "ua")
    b = universal_tensors(tmp_path / "local", tmp_path / "ub")
    c = universal_tensors(tmp_path / "te_again", tmp_path / "uc")
    assert a.keys() == b.keys() == c.keys()
    assert any("linear_qkv.layer_norm_weight" in k for k in a)  # TE's fused-norm name
    for k in a:
        assert torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]), k


@needs_te
def test_te_and_local_mla_share_universal_names(tmp_path):
    """MLA (DeepSeek-V3 shape, dense first layer): TE fuses the q/kv latent norms and the dense
    MLP's norm into the next linear; the local spec does not (param_spec.TE_FUSED_NORMS). A TE
    checkpoint loads into the local spec and back, and all three hold the same universal tensors."""
    from test_model_families import MLA

    mla = {**BASE, "qk_layernorm": True, "num_experts": 4,
           "extra": {**MLA["extra"], "moe_layer_freq": [0, 1]}, "num_layers": 2}
    te, local = {**mla, "transformer_impl": "transformer_engine"}, {**mla, "transformer_impl": "local"}
    launch(1, f"{SCENARIOS}:train_and_save",
           {"layout": "tp1", "cfg": te, "steps": STEPS, "save_dir": str(tmp_path / "te")},
           timeout=600, env=DETERMINISTIC)
    for cfg, src, dst in ((local, "te", "local"), (te, "local", "te_again")):
        launch(1, f"{SCENARIOS}:load_and_train",
               {"layout": "tp1", "cfg": cfg, "load_dir": str(tmp_path / src), "steps": 1,
                "resave_dir": str(tmp_path / dst)}, timeout=600, env=DETERMINISTIC)
    a, b, c = (universal_tensors(tmp_path / d, tmp_path / f"u_{d}") for d in ("te", "local", "te_again"))
    assert a.keys() == b.keys() == c.keys()
    assert "decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight" in a
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in a
    for k in a:
        assert torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]), k


def test_local_spec_on_cuda_save_load_bitwise(tmp_path):
    """No TE needed: megatron-core's local layers on CUDA with NCCL."""
    res = launch(1, f"{SCENARIOS}:train_and_save",
                 {"layout": "tp1", "cfg": LOCAL, "steps": STEPS, "save_dir": str(tmp_path / "ckpt"),
                  "continue_steps": STEPS, "dump_dir": str(tmp_path / "dump"), "async_save": True},
                 timeout=600, env=DETERMINISTIC)
    out = launch(1, f"{SCENARIOS}:load_and_train",
                 {"layout": "tp1", "cfg": LOCAL, "load_dir": str(tmp_path / "ckpt"), "steps": STEPS,
                  "dump_dir": str(tmp_path / "loaded")}, timeout=600, env=DETERMINISTIC)
    assert assert_same_state(tmp_path / "dump", tmp_path / "loaded") > 0
    assert out[0]["losses"] == res[0]["continued"]  # bitwise: same state, deterministic kernels


def test_stager_pinned_copies_from_cuda():
    src = [torch.randn(n, device="cuda") for n in (1, 1000, 4097)]
    stager = HostStager()
    for _ in range(2):
        host = stager.stage(src)
        assert all(h.device.type == "cpu" and h.is_pinned() for h in host)
        assert all(torch.equal(h, s.cpu()) for h, s in zip(host, src))
    assert stager.allocations == 1
    host = HostStager(batched=True).stage(src)
    assert all(torch.equal(h, s.cpu()) for h, s in zip(host, src))
