"""Megatron-Bridge 0.6.2 torch_dist checkpoints (tests/fixtures/megatron_bridge, written by Bridge's
own pretrain() on CPU): read as a source of every command, and written at another layout, which
Bridge's own load resumes with its optimizer state (in .venvbridge, `make test`)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from conftest import FULL, READS_CORE_V019_FILES, RELEASE_SKIP
from oracles import universal_tensors
from safetensors.torch import load_file

from megatron_ucp import formats
from megatron_ucp.cli import main as cli
from megatron_ucp.conversion import reshard
from megatron_ucp.errors import UCPError
from megatron_ucp.layout import Layout

pytestmark = READS_CORE_V019_FILES  # Bridge 0.6.2 ran on megatron-core 0.19.2
ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / "megatron_bridge"
HARNESS = FIXTURES / "harness" / "run_bridge_pretrain.py"
BRIDGE_PYTHON = ROOT / ".venvbridge" / "bin" / "python"
# Skips of the Bridge-run tests outside `make test` (which builds .venvbridge)
BRIDGE_SKIP = "megatron-bridge: "
SETS = {"llama_dp2": Layout(tp=1, dp=2), "llama_tp2_fully": Layout(tp=2, dp=1),
        "moe_ep2": Layout(dp=2, ep=2)}


def fixture(name: str) -> Path:
    return FIXTURES / name / "ckpt"


@pytest.fixture(scope="module")
def universal(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("bridge")
    return {name: reshard(fixture(name), out / name, progress=False).output for name in SETS}


@pytest.mark.parametrize("name", list(SETS))
def test_bridge_checkpoint_is_a_source(universal, name):
    """Detected as Bridge's, read at its own layout with Bridge's iteration, consumed samples and
    Adam step; every fp32 master weight rounds to the stored bf16 weight (the reader checks it, so
    a wrong buffer offset cannot pass)."""
    assert formats.detect(fixture(name)) == "megatron_bridge"
    manifest, tensors = universal_tensors(universal[name])
    lay = manifest["layout"]
    assert (lay["tp"], lay["dp"], lay["ep"]) == (SETS[name].tp, SETS[name].dp, SETS[name].ep)
    assert manifest["iteration"] == 4 and manifest["extra"]["consumed_samples"] == 16
    assert {p["step"] for p in manifest["params"].values()} == {4.0}
    source = formats.open_source(fixture(name))
    assert source.origin["kind"].startswith("megatron-bridge torch_dist")
    groups = manifest["optimizer"]["param_groups"]
    assert {g["lr"] for g in groups} == {1e-3} and {g["weight_decay"] for g in groups} <= {0.0, 0.01}
    assert all(torch.count_nonzero(t).item() for k, t in tensors.items() if k.endswith("/exp_avg_sq"))


def test_every_command_reads_it(universal, tmp_path, capsys):
    """inspect, diff, verify of the conversion, export-hf (the weights are the universal ones)."""
    src = fixture("llama_dp2")
    assert cli(["inspect", str(src)]) == 0
    out = capsys.readouterr().out
    assert "megatron_bridge" in out and "TP1xPP1xDP2" in out
    assert cli(["diff", str(src), str(universal["llama_dp2"])]) == 0
    assert "identical" in capsys.readouterr().out
    assert cli(["verify", str(universal["llama_dp2"])]) == 0
    assert cli(["export-hf", str(src), str(tmp_path / "hf"), "--arch", "llama", "--no-progress"]) == 0
    hf = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        hf.update(load_file(f))
    _, tensors = universal_tensors(universal["llama_dp2"])
    got = hf["model.layers.1.self_attn.o_proj.weight"]
    assert torch.equal(got, tensors["decoder.layers.1.self_attention.linear_proj.weight/param"].to(got.dtype))


def test_export_with_the_hf_template(tmp_path):
    """export-hf of a Bridge run with --hf-template of the HF model it stands for (transformers'
    own config.json of that model, every default written, with a tokenizer and remote code): every
    template field kept with its value, its files byte for byte, the checkpoint's weights; a
    template of another width is refused naming the field."""
    import transformers

    from megatron_ucp.conversion import export_hf

    src = fixture("llama_dp2")
    plain = tmp_path / "plain"
    assert cli(["export-hf", str(src), str(plain), "--arch", "llama", "--no-progress"]) == 0
    template = tmp_path / "template"
    transformers.LlamaConfig.from_pretrained(plain).save_pretrained(template)
    (template / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    (template / "modeling_custom.py").write_text("# remote code\n")
    out = tmp_path / "hf"
    assert cli(["export-hf", str(src), str(out), "--arch", "llama", "--hf-template", str(template),
                "--no-progress"]) == 0
    for name in ("tokenizer_config.json", "modeling_custom.py"):
        assert (out / name).read_bytes() == (template / name).read_bytes(), name
    want, got = (json.loads((d / "config.json").read_text()) for d in (template, out))
    assert all(got[k] == v for k, v in want.items() if k != "transformers_version")
    a = {k: v for f in plain.glob("*.safetensors") for k, v in load_file(f).items()}
    b = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    (template / "config.json").write_text(json.dumps({**want, "hidden_size": 2 * want["hidden_size"]}))
    with pytest.raises(UCPError, match=f"config.json field hidden_size: the template .* says "
                       f"{2 * want['hidden_size']}, the checkpoint has {want['hidden_size']}"):
        export_hf(src, tmp_path / "bad", "llama", progress=False, hf_template=template)


@pytest.mark.parametrize("name, target, sharding", [
    ("llama_dp2", Layout(tp=2, dp=1), "dp_reshardable"),
    ("llama_tp2_fully", Layout(tp=1, dp=2), "fully_reshardable"),
    ("moe_ep2", Layout(tp=2, dp=1, ep=1), "fully_reshardable")])
def test_written_at_another_layout_reads_back_bitwise(universal, tmp_path, name, target, sharding):
    """A Bridge target at another layout: Bridge's files (run_config.yaml at the target's layout and
    optimizer form, train_state.pt, the trackers, the tokenizer directory), no Megatron-LM args, and
    the same universal tensors bitwise."""
    src = tmp_path / "src"  # (with tokenizer files: Bridge's NullTokenizer left its directory empty,
    shutil.copytree(fixture(name), src)  # which git does not keep)
    (src / "iter_0000004" / "tokenizer").mkdir(exist_ok=True)
    (src / "iter_0000004" / "tokenizer" / "tokenizer.json").write_text('{"model": {}}')
    out = tmp_path / "bridge"
    reshard(src, out, target, "bridge", progress=False, optim_sharding=sharding)
    it = out / "iter_0000004"
    cfg = yaml.safe_load((it / "run_config.yaml").read_text())
    assert (cfg["model"]["tensor_model_parallel_size"], cfg["model"]["expert_model_parallel_size"]) == (
        target.tp, target.ep)
    assert cfg["checkpoint"]["dist_ckpt_optim_fully_reshardable"] == (sharding == "fully_reshardable")
    state = torch.load(it / "train_state.pt", weights_only=True)
    assert int(state["step"]) == 4 and int(state["consumed_train_samples"]) == 16
    assert (out / "latest_train_state.pt").is_file()
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert (it / "tokenizer" / "tokenizer.json").read_text() == '{"model": {}}'
    assert "args" not in torch.load(it / "common.pt", weights_only=False)
    again = reshard(out, tmp_path / "u", progress=False).output
    m1, t1 = universal_tensors(universal[name])
    m2, t2 = universal_tensors(again)
    assert (m2["layout"]["tp"], m2["layout"]["dp"]) == (target.tp, target.dp)
    assert t1.keys() == t2.keys() and all(torch.equal(t1[k], t2[k]) for k in t1)
    # (a MoE run's expert groups are their own optimizer's at EP > 1 only: compare the settings)
    settings = [{(g["lr"], g["weight_decay"], tuple(g["betas"])) for g in m["optimizer"]["param_groups"]}
                for m in (m1, m2)]
    assert settings[0] == settings[1]


def test_refusals(tmp_path):
    """A Bridge checkpoint without its run config, a run config of an activation or an optimizer
    not read, a Bridge target from a source with no Bridge run: each named."""
    broken = tmp_path / "no_config"
    shutil.copytree(fixture("llama_dp2"), broken)
    (broken / "iter_0000004" / "run_config.yaml").unlink()
    with pytest.raises(UCPError, match="run_config.yaml is missing"):
        formats.open_source(broken)
    relu = tmp_path / "relu"
    shutil.copytree(fixture("llama_dp2"), relu)
    cfg_path = relu / "iter_0000004" / "run_config.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["model"]["activation_func"]["_target_"] = "torch.nn.functional.relu"
    cfg_path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(UCPError, match=r"model.activation_func torch.nn.functional.relu"):
        formats.open_source(relu)
    cfg["model"]["activation_func"]["_target_"] = "torch.nn.functional.silu"
    cfg["optimizer"]["optimizer"] = "lion"
    cfg_path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(UCPError, match=r"optimizer.optimizer='lion'"):
        formats.open_source(relu)
    mlm = ROOT / "tests" / "fixtures" / "megatron_lm_v019" / "torch_dist_tp2_dp2" / "ckpt"
    with pytest.raises(UCPError, match="needs a Bridge run's config"):
        reshard(mlm, tmp_path / "b", Layout(tp=1, dp=1), "bridge", progress=False)


def _bridge(nprocs: int, *args: str, timeout: int = 300) -> str:
    """Bridge's harness under torchrun in .venvbridge; its output."""
    with socket.socket() as s:  # a free port for the rendezvous (torchrun's static one needs one)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([str(BRIDGE_PYTHON), "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs),
                          "--master-addr", "127.0.0.1", "--master-port", str(port), str(HARNESS), *args],
                         env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout + res.stderr


def test_bridge_resumes_the_written_checkpoint_at_another_layout(universal, tmp_path):
    """Bridge's DP2 run -> a Bridge checkpoint at TP2 -> Bridge's own setup() and load_checkpoint at
    TP2: every weight, fp32 master weight, moment and Adam step it holds is the source's, bitwise
    (saved from the live run with megatron_ucp.save and compared with the source's conversion)."""
    from megatron_ucp import mcore_compat

    if not mcore_compat.has_core_v019_enums():
        pytest.skip(f"{RELEASE_SKIP}Bridge 0.6.2 runs on megatron-core 0.19")
    if not BRIDGE_PYTHON.exists():
        if os.environ.get("UCP_REQUIRE_BRIDGE") == "1":
            pytest.fail(f"UCP_REQUIRE_BRIDGE=1 but {BRIDGE_PYTHON} is missing")
        pytest.skip(f"{BRIDGE_SKIP}needs .venvbridge (make test builds it: "
                    "tools/bridge/install_bridge_venv.sh)")
    written = tmp_path / "bridge_tp2"
    reshard(fixture("llama_dp2"), written, Layout(tp=2, dp=1), "bridge", progress=False)
    live = tmp_path / "live"
    log = _bridge(2, "--tp", "2", "--load", str(written), "--save", str(tmp_path / "unused"),
                  "--resume-check", str(live))
    assert f"successfully loaded checkpoint from {written}" in log and "RNG state will be ignored" not in log
    m1, t1 = universal_tensors(universal["llama_dp2"])
    m2, t2 = universal_tensors(reshard(live, tmp_path / "live_universal", progress=False).output)
    assert (m2["layout"]["tp"], m2["layout"]["dp"]) == (2, 1) and m2["iteration"] == 4
    assert {p["step"] for p in m2["params"].values()} == {4.0}
    assert t1.keys() == t2.keys()
    differ = [k for k in t1 if not torch.equal(t1[k], t2[k])]
    assert not differ, differ[:5]
    assert json.dumps(m2["extra"]["consumed_samples"]) == "16"


def test_model_only_checkpoint_is_a_weights_only_source(universal, tmp_path, capsys):
    """Bridge's save without optimizer state (the llama_dp2 run again, save_optim=False): a
    weights-only source, each weight the bf16 one the optimizer-state run holds at the same
    iteration (the same deterministic run), from which a load starts the optimizer fresh."""
    src = fixture("llama_dp2_model_only")
    assert cli(["inspect", str(src)]) == 0
    assert "weights only" in capsys.readouterr().out
    out = reshard(src, tmp_path / "u", progress=False).output
    manifest, tensors = universal_tensors(out)
    assert manifest["weights_only"] and manifest["iteration"] == 4
    assert {k.rsplit("/", 1)[1] for k in tensors} == {"param"}
    _, full = universal_tensors(universal["llama_dp2"])
    for key, weight in tensors.items():
        assert weight.dtype == torch.bfloat16 and torch.equal(weight, full[key].to(torch.bfloat16)), key


# Bridge's finetune() with LoRA (rank 4, alpha 8 on linear_qkv/proj/fc1/fc2) from llama_dp2_model_only,
# at TP1 and TP2 (harness/make_fixtures.sh); the run records its base as given, relative to FIXTURES
LORA_SETS = {"lora_tp1": 1, "lora_tp2": 2}
LORA_BASE = fixture("llama_dp2_model_only")
LORA_KEYS = tuple(f"decoder.layers.{m}.weight" for m in (
    "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"))


@pytest.mark.parametrize("name", list(LORA_SETS))
def test_lora_checkpoint_reads_merged_into_its_base(name, tmp_path, capsys, monkeypatch):
    """inspect names the adapters and the base; the tensors are the base's with W + (alpha/dim) B @ A
    on the four adapted weights (the oracle computed here from the stored tensors, per layer, in
    bf16 as Bridge's LoRAMerge) and the base's bitwise elsewhere; the recorded relative base path
    resolves from the run's directory, --base overrides it."""
    from megatron_ucp.formats.dcp_reader import DistReader

    src = fixture(name)
    assert cli(["inspect", str(src), "--base", str(LORA_BASE)]) == 0
    out = capsys.readouterr().out
    assert "rank 4, alpha 8 (scale 2), dropout 0 (pre)" in out
    assert "target modules linear_qkv, linear_proj, linear_fc1, linear_fc2" in out
    assert "recorded: llama_dp2_model_only/ckpt" in out
    monkeypatch.chdir(FIXTURES)  # (where the run was started: the recorded path resolves)
    source = formats.open_source(src)
    assert source.manifest.weights_only
    assert source.origin["base"].endswith("llama_dp2_model_only/ckpt/iter_0000004")
    lora = DistReader(src / "iter_0000004")
    base = DistReader(LORA_BASE / "iter_0000004")
    for key in base.tensor_keys():
        if key.startswith("optimizer") or "_extra_state" in key:
            continue
        got, w = source.reader.tensor(key), base.tensor(key)
        if key not in LORA_KEYS:
            assert torch.equal(got, w), key
            continue
        prefix = key.removesuffix(".weight")
        a = lora.tensor(f"{prefix}.adapter.linear_in.weight")  # A [layers, dim, in]
        b = lora.tensor(f"{prefix}.adapter.linear_out.weight")  # B [layers, out, dim]
        assert a.dtype == torch.bfloat16 and a.shape[1] == 4 and b.shape[2] == 4 and torch.count_nonzero(b)
        want = torch.stack([w[i] + 2.0 * (b[i] @ a[i]) for i in range(w.shape[0])])
        assert torch.equal(got, want) and not torch.equal(got, w), key
    universal = reshard(src, tmp_path / "u", progress=False).output
    manifest, tensors = universal_tensors(universal)
    assert manifest["weights_only"]
    assert torch.equal(tensors["decoder.layers.1.mlp.linear_fc2.weight/param"].to(torch.bfloat16),
                       source.reader.tensor("decoder.layers.mlp.linear_fc2.weight")[1])


def _edited_lora(tmp_path: Path, edit) -> Path:
    out = tmp_path / "lora"
    shutil.copytree(fixture("lora_tp1"), out)
    path = out / "iter_0000004" / "run_config.yaml"
    cfg = yaml.safe_load(path.read_text())
    edit(cfg)
    path.write_text(yaml.safe_dump(cfg))
    return out


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["peft"].update(_target_="megatron.bridge.peft.dora.DoRA"), "dora.DoRA: DoRA rescales"),
    (lambda c: c["peft"].update(_target_="megatron.bridge.peft.canonical_lora.CanonicalLoRA"),
     "canonical LoRA keeps separate q/k/v"),
    (lambda c: c["peft"].update(target_modules=["linear_qkv", "*.linear_fc1"]),
     r"peft.target_modules \['\*.linear_fc1'\]"),
    (lambda c: c["peft"].update(exclude_modules=["linear_proj"]), r"peft.exclude_modules \['linear_proj'\]"),
    (lambda c: c["checkpoint"].update(pretrained_checkpoint="/nowhere/base"),
     r"checkpoint.pretrained_checkpoint=/nowhere/base does not exist .*--base DIR"),
])
def test_lora_refusals(tmp_path, edit, message):
    """PEFT forms megatron-ucp does not merge, by name with what to do; a base that moved, naming
    the recorded path and the flag."""
    with pytest.raises(UCPError, match=message):
        formats.open_source(_edited_lora(tmp_path, edit))


def test_lora_base_flag_refusals(tmp_path):
    with pytest.raises(UCPError, match="--base /nowhere: no such directory"):
        formats.open_source(fixture("lora_tp1"), lora_base="/nowhere")
    with pytest.raises(UCPError, match="is not a LoRA checkpoint .* drop --base"):
        formats.open_source(fixture("llama_dp2"), lora_base=LORA_BASE)
    with pytest.raises(UCPError, match="base checkpoint of .* is itself a LoRA checkpoint"):
        formats.open_source(fixture("lora_tp1"), lora_base=fixture("lora_tp2"))
    assert cli(["export-hf", str(fixture("lora_tp1")), str(tmp_path / "hf"), "--arch", "llama",
                "--no-progress"]) == 2  # (from the tests' directory the recorded relative base is not there)


# (make test runs Bridge's merge at TP2, where A and B are split; TP1 with the full matrix: CI time)
@pytest.mark.parametrize("name", [pytest.param("lora_tp1", marks=pytest.mark.skipif(
    not FULL, reason="UCP_FULL_MATRIX=1 runs Bridge's merge at TP1 too")), "lora_tp2"])
def test_lora_merge_equals_bridges_and_exported_logits(name, tmp_path):
    """Bridge's own merge on the real Bridge model (its PEFT resume of the LoRA checkpoint, then
    `LoRALinear.weight` = `LoRAMerge.merge` at the run's TP, saved by `save_megatron_model`):
    bitwise megatron-ucp's merged tensors; the HF model export-hf writes from the LoRA checkpoint
    gives the logits of Bridge's merged model's forward (fp32, <= 1e-5 relative; the base model
    alone is > 1e-2 away)."""
    from transformers import AutoModelForCausalLM

    from megatron_ucp import mcore_compat

    if not mcore_compat.has_core_v019_enums():
        pytest.skip(f"{RELEASE_SKIP}Bridge 0.6.2 runs on megatron-core 0.19")
    if not BRIDGE_PYTHON.exists():
        if os.environ.get("UCP_REQUIRE_BRIDGE") == "1":
            pytest.fail(f"UCP_REQUIRE_BRIDGE=1 but {BRIDGE_PYTHON} is missing")
        pytest.skip(f"{BRIDGE_SKIP}needs .venvbridge (make test builds it: "
                    "tools/bridge/install_bridge_venv.sh)")
    tp = LORA_SETS[name]
    _bridge(tp, "--tp", str(tp), "--lora", str(LORA_BASE), "--load", str(fixture(name)),
            "--save", str(tmp_path / "unused"), "--lora-merge-check", str(tmp_path))
    ours = formats.open_source(fixture(name), lora_base=LORA_BASE)
    bridges = formats.open_source(tmp_path / "merged")
    assert bridges.manifest.params.keys() == ours.manifest.params.keys()
    for n, p in ours.manifest.params.items():
        whole = ((0,) * len(p.shape), tuple(p.shape))
        assert torch.equal(ours.read(n, "param", *whole), bridges.read(n, "param", *whole)), n
    hf = tmp_path / "hf"
    assert cli(["export-hf", str(fixture(name)), str(hf), "--arch", "llama", "--base", str(LORA_BASE),
                "--no-progress"]) == 0
    assert cli(["export-hf", str(LORA_BASE), str(tmp_path / "hf_base"), "--arch", "llama",
                "--no-progress"]) == 0
    logits = torch.load(tmp_path / "logits.pt", weights_only=True)
    want = logits["merged_fp32"]  # Bridge's merged model (its bf16 weights in fp32), megatron-core forward
    rel = {}
    for what in ("hf", "hf_base"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / what, dtype=torch.float32).eval()
        with torch.no_grad():
            got = model(logits["tokens"]).logits
        assert got.shape == want.shape
        rel[what] = ((got - want).abs().max() / want.abs().max()).item()
    assert rel["hf"] <= 1e-5 and rel["hf_base"] > 1e-2, rel  # (the base alone: the adapters left out)
    # Bridge's forward with the adapters live (bf16) is its merged model's, to bf16 rounding
    assert (logits["live"] - logits["merged"]).abs().max() < 1e-2 * logits["merged"].abs().max()
