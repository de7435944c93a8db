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
from conftest import READS_CORE_V019_FILES, RELEASE_SKIP
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
