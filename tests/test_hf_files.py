"""The HF model directory's other files and config.json fields through import-hf and export-hf.

A random tiny transformers Llama saved with a real tokenizer (a WordLevel one trained in memory
with the `tokenizers` package, saved by PreTrainedTokenizerFast.save_pretrained), a chat template,
its own generation_config.json and a remote-code .py file named by config.json's auto_map:
import-hf then export-hf gives back every file byte for byte, a tokenizer that encodes the same,
and config.json field by field; a template's conflicting field is refused by name; a template's
weights are never copied.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from safetensors import safe_open  # noqa: E402

from megatron_ucp import formats  # noqa: E402
from megatron_ucp.cli import main  # noqa: E402
from megatron_ucp.conversion import export_hf, import_hf  # noqa: E402
from megatron_ucp.errors import UCPError  # noqa: E402
from megatron_ucp.formats import open_source  # noqa: E402
from megatron_ucp.formats.hf import export, files  # noqa: E402

LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             bos_token_id=1, eos_token_id=2, rope_theta=50000.0)
TEXT = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokenizer",
        "a tiny model with a tiny vocabulary"]
CHAT = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
REMOTE_CODE = "# configuration_tiny.py: stands for a hub model's remote code (auto_map)\nX = 1\n"
# fields of config.json that the export writes anew: the release that wrote it
NEW_IN_EXPORT = ("transformers_version",)
FIXTURES = Path(__file__).parent / "fixtures" / "megatron_lm"


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXT, tokenizers.trainers.WordLevelTrainer(
        vocab_size=64, special_tokens=["<unk>", "<s>", "</s>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                                bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT
    return fast


def save_model(out: Path, seed: int, **config) -> Path:
    """A random tiny Llama with its tokenizer, generation config, chat template and remote code."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, **config}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(out)
    tokenizer().save_pretrained(out)
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, do_sample=True, temperature=0.7,
                                  max_new_tokens=17).save_pretrained(out)
    (out / "configuration_tiny.py").write_text(REMOTE_CODE)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(auto_map={"AutoConfig": "configuration_tiny.TinyConfig"}, my_model_note="kept")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> Path:
    return save_model(tmp_path_factory.mktemp("hf") / "tiny", seed=0)


def tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


def config(hf_dir: Path) -> dict:
    return json.loads((hf_dir / "config.json").read_text())


def assert_carried(src: Path, out: Path) -> None:
    """Every non-weight file of `src` is in `out` byte for byte; the tokenizer encodes the same;
    config.json holds every field of `src`'s with its value."""
    names = files.carried_names(src)
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
            "configuration_tiny.py"} <= set(names)
    for name in names:
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    a, b = transformers.AutoTokenizer.from_pretrained(src), transformers.AutoTokenizer.from_pretrained(out)
    for text in [*TEXT, "unknown words here"]:
        assert a(text)["input_ids"] == b(text)["input_ids"]
    messages = [{"role": "user", "content": "hello world"}]
    assert a.apply_chat_template(messages, tokenize=False) == b.apply_chat_template(messages, tokenize=False)
    want, got = config(src), config(out)
    for k, v in want.items():
        if k not in NEW_IN_EXPORT:
            assert k in got and got[k] == v, k
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert generation.temperature == 0.7 and generation.max_new_tokens == 17


def test_import_export_carries_every_file(hf_model, tmp_path, caplog):
    universal = import_hf(hf_model, tmp_path / "u", progress=False)
    record = open_source(universal).manifest.extra["hf_import"]["files"]
    assert sorted(record) == files.carried_names(hf_model)
    assert "model.safetensors" not in record and "config.json" not in record
    for name, entry in record.items():  # the checkpoint stores each, as recorded
        data = (universal / files.STORED_DIR / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": files.digest(data), "stored": True}
    assert (universal / files.STORED_DIR / "tokenizer.json").read_bytes() == \
        (hf_model / "tokenizer.json").read_bytes()
    # a conversion of the checkpoint (universal -> universal, through the writer) keeps them
    copy = formats.get("universal").write(open_source(universal), tmp_path / "u_copy", progress=False)
    assert sorted(p.name for p in (copy / files.STORED_DIR).iterdir()) == sorted(record)
    assert all((copy / files.STORED_DIR / n).read_bytes() == (hf_model / n).read_bytes() for n in record)
    out = export(open_source(universal), tmp_path / "hf", "llama", progress=False)
    assert_carried(hf_model, out)
    a, b = tensors(hf_model), tensors(out)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    # the HF directory moved away: the checkpoint's copies are carried, no warning
    moved = tmp_path / "moved"
    shutil.copytree(hf_model, moved)
    shutil.rmtree(tmp_path / "hf")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        other = tmp_path / "u_moved"
        shutil.copytree(universal, other)
        _without_source(other, tmp_path / "gone")
        out = export(open_source(other), tmp_path / "hf2", "llama", progress=False)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert_carried(moved, out)


def _without_source(universal: Path, path: Path) -> None:
    """Point the checkpoint's import record at a directory that is not there."""
    manifest = json.loads((universal / "manifest.json").read_text())
    manifest["extra"]["hf_import"]["path"] = str(path)
    (universal / "manifest.json").write_text(json.dumps(manifest))


def test_files_over_the_cap_come_from_the_source_or_the_template(hf_model, tmp_path, monkeypatch, caplog):
    """Files past STORE_CAP are recorded only: export-hf takes them from the recorded directory
    if they are its recorded bytes, else warns naming them and --hf-template."""
    src = tmp_path / "src"
    shutil.copytree(hf_model, src)
    monkeypatch.setattr(files, "STORE_CAP", 0)
    universal = import_hf(src, tmp_path / "u", progress=False)
    assert not (universal / files.STORED_DIR).exists()
    assert not any(e["stored"] for e in open_source(universal).manifest.extra["hf_import"]["files"].values())
    assert_carried(src, export(open_source(universal), tmp_path / "a", "llama", progress=False))
    (src / "chat_template.jinja").write_text("changed")  # no longer the recorded bytes
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        out = export(open_source(universal), tmp_path / "b", "llama", progress=False)
    assert not (out / "chat_template.jinja").exists() and (out / "tokenizer.json").exists()
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "chat_template.jinja" in warned and "--hf-template" in warned
    out = export_hf(universal, tmp_path / "c", "llama", progress=False, hf_template=hf_model)
    assert_carried(hf_model, out)


def test_template_weights_are_never_copied(hf_model, tmp_path):
    """--hf-template of another model of the same config: its files and fields, the checkpoint's
    weights (bitwise), never the template's."""
    other = save_model(tmp_path / "other", seed=1)
    universal = import_hf(hf_model, tmp_path / "u", progress=False)
    out = export_hf(universal, tmp_path / "hf", "llama", progress=False, hf_template=other)
    assert_carried(other, out)
    a, b, t = tensors(hf_model), tensors(out), tensors(other)
    assert sorted(b) == sorted(a)
    for k in a:
        assert torch.equal(a[k], b[k]) and not torch.equal(t[k], b[k]), k
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model-00001-of-00001.safetensors"]


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": 32}, "config.json field num_hidden_layers: the template .*other/config.json "
     "says 32, the checkpoint has 2"),
    ({"rms_norm_eps": 1e-5}, "field rms_norm_eps: .* says 1e-05, the checkpoint has 1e-06"),
    ({"eos_token_id": 3}, "field eos_token_id: .* says 3, the checkpoint has 2"),
    ({"model_type": "mistral"}, "field model_type: .* says 'mistral', the checkpoint has 'llama'"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 50000.0, "factor": 2.0}},
     "field rope_parameters.rope_type: .* says 'linear', the checkpoint has 'default'"),
    # a field the export does not write that would change the model: refused by name
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "field rope_scaling: .* describes "
     "another model"),
])
def test_template_conflicts_are_refused_by_name(hf_model, tmp_path, change, message):
    other = tmp_path / "other"
    shutil.copytree(hf_model, other)
    (other / "config.json").write_text(json.dumps({**config(hf_model), **change}))
    universal = import_hf(hf_model, tmp_path / "u", progress=False)
    with pytest.raises(UCPError, match=message):
        export_hf(universal, tmp_path / "hf", "llama", progress=False, hf_template=other)
    assert not (tmp_path / "hf").exists()


def test_template_dtype_and_quantization_are_the_exports(hf_model, tmp_path):
    """The template's torch_dtype (transformers 4's spelling) and dtype are the export's; its
    quantization_config is dropped from a non-FP8 export; informational fields are the template's."""
    other = tmp_path / "other"
    shutil.copytree(hf_model, other)
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}
    (other / "config.json").write_text(json.dumps({
        **config(hf_model), "torch_dtype": "float32", "dtype": "float32", "_name_or_path": "org/tiny",
        "transformers_version": "4.57.0", "use_cache": False, "quantization_config": quantization}))
    universal = import_hf(hf_model, tmp_path / "u", progress=False)
    out = export_hf(universal, tmp_path / "hf", "llama", dtype="bf16", progress=False, hf_template=other)
    got = config(out)
    assert got["torch_dtype"] == got["dtype"] == "bfloat16" and "quantization_config" not in got
    assert got["_name_or_path"] == "org/tiny" and got["transformers_version"] == "4.57.0"
    assert got["use_cache"] is False and got["my_model_note"] == "kept"
    assert all(t.dtype == torch.bfloat16 for t in tensors(out).values())
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.config.num_hidden_layers == 2


def test_fp8_export_keeps_the_templates_quantization_fields(hf_model, tmp_path):
    """--dtype fp8: the template's quantization_config merged with the export's (its block size
    checked, its other keys kept); ue8m0 scales, which the export does not write, refused."""
    other = tmp_path / "other"
    shutil.copytree(hf_model, other)
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [16, 16], "modules_to_not_convert": ["lm_head"]}
    (other / "config.json").write_text(json.dumps({**config(hf_model), "quantization_config": quantization}))
    universal = import_hf(hf_model, tmp_path / "u", progress=False)
    out = export_hf(universal, tmp_path / "hf", "llama", dtype="fp8", fp8_block_size=(16, 16),
                    progress=False, hf_template=other)
    assert config(out)["quantization_config"] == quantization and config(out)["dtype"] == "bfloat16"
    with pytest.raises(UCPError, match=r"field quantization_config.weight_block_size: .* says \[16, 16\], "
                       r"the checkpoint has \[8, 8\]"):
        export_hf(universal, tmp_path / "b", "llama", dtype="fp8", fp8_block_size=(8, 8),
                  progress=False, hf_template=other)
    (other / "config.json").write_text(json.dumps({**config(hf_model), "quantization_config": {
        **quantization, "scale_fmt": "ue8m0"}}))
    with pytest.raises(UCPError, match="quantization_config.scale_fmt: .* says 'ue8m0'"):
        export_hf(universal, tmp_path / "c", "llama", dtype="fp8", fp8_block_size=(16, 16),
                  progress=False, hf_template=other)


def test_no_template(hf_model, tmp_path):
    """--no-hf-template: config.json and generation_config.json derived from the checkpoint alone."""
    universal = import_hf(hf_model, tmp_path / "u", progress=False)
    out = export_hf(universal, tmp_path / "hf", "llama", progress=False, hf_template=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model-00001-of-00001.safetensors",
        "model.safetensors.index.json"]
    assert "auto_map" not in config(out) and "temperature" not in json.loads(
        (out / "generation_config.json").read_text())
    with pytest.raises(UCPError, match="--hf-template .*nowhere: not a directory"):
        export_hf(universal, tmp_path / "b", "llama", progress=False, hf_template=tmp_path / "nowhere")


def test_cli(hf_model, tmp_path, capsys):
    universal = tmp_path / "u"
    assert main(["import-hf", str(hf_model), str(universal), "--no-progress"]) == 0
    assert main(["inspect", str(universal)]) == 0
    names = files.carried_names(hf_model)
    assert f"hf files     {len(names)} ({', '.join(names[:4])}, ...) of {hf_model}, {len(names)} stored " \
           "in hf_files/" in capsys.readouterr().out
    assert main(["export-hf", str(universal), str(tmp_path / "a"), "--arch", "llama",
                 "--no-progress"]) == 0
    assert_carried(hf_model, tmp_path / "a")
    other = save_model(tmp_path / "other", seed=1)
    assert main(["export-hf", str(universal), str(tmp_path / "b"), "--arch", "llama",
                 "--hf-template", str(other), "--no-progress"]) == 0
    assert_carried(other, tmp_path / "b")
    assert torch.equal(tensors(tmp_path / "b")["lm_head.weight"], tensors(hf_model)["lm_head.weight"])
    assert main(["export-hf", str(universal), str(tmp_path / "c"), "--arch", "llama",
                 "--no-hf-template", "--no-progress"]) == 0
    assert not (tmp_path / "c" / "tokenizer.json").exists()
    with pytest.raises(SystemExit):
        main(["export-hf", str(universal), str(tmp_path / "d"), "--arch", "llama",
              "--hf-template", str(other), "--no-hf-template"])
    (other / "config.json").write_text(json.dumps({**config(other), "hidden_size": 64}))
    assert main(["export-hf", str(universal), str(tmp_path / "e"), "--arch", "llama",
                 "--hf-template", str(other), "--no-progress"]) != 0
    assert "config.json field hidden_size" in capsys.readouterr().err


def test_megatron_lm_checkpoint_with_the_hf_template(tmp_path):
    """The Megatron-LM route: a Megatron-LM checkpoint (no import record: no template, a warning)
    exported with --hf-template of its HF model (transformers' own config.json of that model, every
    default written, plus a tokenizer and remote code): config.json holds every template field
    with its value, the files are carried, the weights are the checkpoint's; a template of another
    model size is refused naming the field."""
    src = FIXTURES / "torch_llama_tp2" / "ckpt"
    plain = export_hf(src, tmp_path / "plain", "llama", progress=False)
    # the original HF model: transformers' config of that model, its tokenizer and files
    template = tmp_path / "template"
    transformers.LlamaConfig.from_pretrained(plain).save_pretrained(template)
    tokenizer().save_pretrained(template)
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, do_sample=True,
                                  temperature=0.5).save_pretrained(template)
    (template / "configuration_tiny.py").write_text(REMOTE_CODE)
    out = export_hf(src, tmp_path / "hf", "llama", progress=False, hf_template=template)
    for name in files.carried_names(template):
        assert (out / name).read_bytes() == (template / name).read_bytes(), name
    want, got = config(template), config(out)
    for k, v in want.items():
        if k not in NEW_IN_EXPORT:
            assert got[k] == v, k
    a, b = tensors(plain), tensors(out)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    (template / "config.json").write_text(json.dumps({**want, "num_hidden_layers": 32}))
    with pytest.raises(UCPError, match="field num_hidden_layers: the template .*template/config.json "
                       f"says 32, the checkpoint has {want['num_hidden_layers']}"):
        export_hf(src, tmp_path / "bad", "llama", progress=False, hf_template=template)
