"""Blockwise FP8 Hugging Face weights (DeepSeek-V3/R1, Kimi-K2: F8_E4M3 + a fp32 weight_scale_inv
per block) in and out, against real transformers 5.23.

The FP8 directories are made here from the tiny fp32 models of tests/test_hf_import.py: the
modules to quantize are the ones transformers' own FP8 quantizer replaces (replace_with_fp8_linear),
the bytes come from a block-by-block quantization written here (DeepSeek's formula: scale_inv =
amax / 448, w = e4m3(x / scale_inv)), the rest is bf16 as in DeepSeek's release (the expert bias
fp32), and config.json gets DeepSeek-V3's quantization_config. transformers' own Fp8Quantize
(another rounding of the same scale, see formats/hf/fp8.py) is what the re-export test feeds too.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import save_file  # noqa: E402
from test_hf_import import MODELS, TOKENS, build, tensors  # noqa: E402
from transformers.integrations import finegrained_fp8  # noqa: E402
from transformers.quantizers import quantizer_finegrained_fp8  # noqa: E402

from megatron_ucp.cli import main  # noqa: E402
from megatron_ucp.conversion import import_hf  # noqa: E402
from megatron_ucp.errors import UCPError  # noqa: E402
from megatron_ucp.formats import open_source  # noqa: E402
from megatron_ucp.formats.hf import export  # noqa: E402
from megatron_ucp.formats.hf.source import HFSource  # noqa: E402
from megatron_ucp.inspector import inspect  # noqa: E402

FP8 = torch.float8_e4m3fn
BLOCK = (8, 8)  # divides every dimension of the tiny models (transformers' CPU dequantization needs it)
PARTIAL = (16, 16)  # does not: partial last blocks, as DeepSeek-V3's kv_a_proj_with_mqa (576 rows of 128)
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"}  # DeepSeek-V3's
KEEP_FP32 = r"\.e_score_correction_bias$"
# Nemotron-H without MoE layers (transformers 5.23 cannot build its FP8 experts: export refuses those)
NEMOTRON_DENSE = {**MODELS["nemotron_h"][2],
                  "layers_block_type": ["linear_attention", "mlp", "full_attention", "mlp"]}


def hand_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's blockwise FP8 (inference/kernel.py act_quant's formula), one block at a time."""
    w = w.float()
    rows, cols = w.shape
    q = torch.empty(w.shape, dtype=FP8)
    s = torch.empty(math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            box = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            scale = w[box].abs().max() / 448.0
            s[i, j] = scale if scale > 0 else 1.0
            q[box] = (w[box] / s[i, j]).clamp(-448.0, 448.0).to(FP8)
    return q, s


def hand_dequantize(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    out = torch.empty(q.shape)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            box = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            out[box] = q[box].float() * s[i, j]
    return out


def transformers_fp8_modules(hf_dir: Path) -> set[str]:
    """The modules of transformers' model of `hf_dir` its FP8 quantizer's replace_with_fp8_linear
    makes FP8Linear / FP8Experts (lm_head and _keep_in_fp32_modules kept)."""
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    skip = quantizer_finegrained_fp8.FineGrainedFP8HfQuantizer.get_modules_to_not_convert(
        model, None, model._keep_in_fp32_modules)
    finegrained_fp8.replace_with_fp8_linear(model, modules_to_not_convert=skip,
                                            quantization_config=transformers.FineGrainedFP8Config())
    return {n for n, m in model.named_modules()
            if isinstance(m, (finegrained_fp8.FP8Linear, finegrained_fp8.FP8Experts))}


def transformers_fp8_names(hf_dir: Path, names) -> set[str]:
    """The HF tensors among `names` transformers' FP8 quantizer quantizes: the weights of its FP8
    modules, experts in the Hub layout (`experts.<e>.<proj>.weight` of the fused `experts` module;
    the Hub's `backbone.` and Mixtral's `block_sparse_moe.` are transformers' `model.` and `mlp.`)."""
    fp8 = transformers_fp8_modules(hf_dir)
    out = set()
    for name in names:
        module = re.sub(r"\.experts\.\d+\.\w+$", ".experts", name.removesuffix(".weight"))
        module = re.sub(r"^backbone\.", "model.", module).replace(".block_sparse_moe.", ".mlp.")
        if name.endswith(".weight") and module in fp8:
            out.add(name)
    return out


def fp8_dir(src: Path, dst: Path, block: tuple[int, int]) -> Path:
    """`src` (fp32) as DeepSeek's FP8 release stores a model (module doc)."""
    t = tensors(src)
    out = {}
    for name in sorted(transformers_fp8_names(src, t)):
        out[name], out[name + "_scale_inv"] = hand_quantize(t.pop(name), block)
    out.update({k: v if re.search(KEEP_FP32, k) else v.bfloat16() for k, v in t.items()})
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(dtype="bfloat16", quantization_config={**FP8_CONFIG, "weight_block_size": list(block)})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def transformers_load(hf_dir: Path, monkeypatch, dtype: torch.dtype = torch.float32):
    """transformers' model of `hf_dir`. An FP8 one transformers 5.23 dequantizes on a CPU
    (FineGrainedFP8HfQuantizer.validate_environment: no GPU -> dequantize=True; Fp8Dequantize
    computes in fp32 and casts to `dtype`; the tensors stored unquantized keep their stored dtype
    whatever `dtype` says, so a forward needs `dtype` to be theirs, bf16). It first refuses when
    accelerate is not installed, as in the dev venvs; nothing of accelerate runs on that path
    (this load works without it installed), so only that guard is lifted."""
    if importlib.util.find_spec("accelerate") is None:
        monkeypatch.setattr(quantizer_finegrained_fp8, "is_accelerate_available", lambda: True)
    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()


def transformers_quantizer() -> finegrained_fp8.Fp8Quantize:
    """transformers' own blockwise quantization in BLOCK blocks (what its save of an FP8 model runs)."""
    config = transformers.FineGrainedFP8Config(weight_block_size=BLOCK)
    return finegrained_fp8.Fp8Quantize(type("Quantizer", (), {"quantization_config": config})())


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names whose dtype, shape or bytes differ (FP8 compared as bytes)."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or a[k].dtype != b[k].dtype
                  or not torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """fp32 `llama` and `deepseek_v3` (test_hf_import's tiny models) and their FP8 forms in BLOCK
    blocks (`<name>_fp8`), deepseek_v3 also in PARTIAL ones."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for name in ("llama", "deepseek_v3"):
        build(name).save_pretrained(root / name)
        out[name] = root / name
        out[f"{name}_fp8"] = fp8_dir(root / name, root / f"{name}_fp8", BLOCK)
    out["deepseek_v3_partial"] = fp8_dir(root / "deepseek_v3", root / "deepseek_v3_partial", PARTIAL)
    return out


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_import_dequantizes_as_transformers_does(dirs, tmp_path, monkeypatch, name):
    """import-hf of an FP8 directory holds the values transformers' own dequantization gives,
    bitwise: its FP8 load (dequantized in fp32) and its load of export-hf's fp32 form of the import
    hold the same values (experts fused by transformers: every tensor compared as it holds it)."""
    universal = import_hf(dirs[f"{name}_fp8"], tmp_path / "u", progress=False)
    record = open_source(universal).manifest.extra["hf_import"]["quantization"]
    quantized = transformers_fp8_names(dirs[name], tensors(dirs[name]))
    assert record == {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK),
                      "activation_scheme": "dynamic", "scale_fmt": "float", "fp8_tensors": len(quantized),
                      "dequantized_to": "float32"}
    assert f"{len(quantized)} blockwise FP8 (e4m3) tensors in 8x8 blocks, dequantized" in inspect(universal)
    out = export(open_source(universal), tmp_path / "fp32", MODELS[name][0], dtype="fp32", progress=False)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    fp8 = tensors(dirs[f"{name}_fp8"])
    for k, t in tensors(out).items():  # the hand-written dequantization too
        want = hand_dequantize(fp8[k], fp8[k + "_scale_inv"], BLOCK) if k in quantized else fp8[k].float()
        assert torch.equal(t, want), k
    theirs = transformers_load(dirs[f"{name}_fp8"], monkeypatch).state_dict()
    ours = transformers_load(out, monkeypatch).state_dict()
    assert sorted(theirs) == sorted(ours) and all(torch.equal(theirs[k].float(), ours[k]) for k in ours)
    dequantized = [k for k in theirs if k.rsplit(".", 1)[0] in transformers_fp8_modules(dirs[name])]
    assert dequantized and all(theirs[k].dtype == torch.float32 for k in dequantized)


def test_partial_blocks_import(dirs, tmp_path):
    """Partial last blocks (a dimension the block does not divide) dequantize with the scale of
    their block, bitwise as the hand-written dequantization and transformers' block-aware one
    (_dequantize_fp8_weight, its FP8 backward). transformers 5.23's loading on a CPU (Fp8Dequantize)
    derives the block from the scale grid's shape instead (24 rows in 2 scale rows: blocks of 12)
    and misreads these tensors, so the comparison is not with its load."""
    out = export(HFSource(dirs["deepseek_v3_partial"]), tmp_path / "fp32", "deepseek_v3", dtype="fp32",
                 progress=False)
    fp8, got = tensors(dirs["deepseek_v3_partial"]), tensors(out)
    partial = [k for k, t in fp8.items() if t.dtype == FP8 and (t.shape[0] % 16 or t.shape[1] % 16)]
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in partial
    for k, t in got.items():
        if fp8[k].dtype != FP8:
            assert torch.equal(t, fp8[k].float()), k
            continue
        want = hand_dequantize(fp8[k], fp8[k + "_scale_inv"], PARTIAL)
        theirs = finegrained_fp8._dequantize_fp8_weight(fp8[k], fp8[k + "_scale_inv"], list(PARTIAL),
                                                        torch.float32)
        assert torch.equal(t, want) and torch.equal(t, theirs), k


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_export_fp8(dirs, tmp_path, monkeypatch, name):
    """export-hf --dtype fp8 writes the linear weights transformers' FP8 quantizer quantizes, with
    DeepSeek's scales and bytes (the directory is the hand-made FP8 one, byte for byte), the rest
    bf16 (the expert bias fp32), DeepSeek-V3's quantization_config; transformers reads it (FP8,
    dequantized on this CPU) with logits close to those of the bf16 export."""
    arch = MODELS[name][0]
    import_hf(dirs[name], tmp_path / "u", progress=False)
    for dtype, out in (("fp8", tmp_path / "fp8"), ("bf16", tmp_path / "bf16")):
        block = ["--fp8-block-size", "8", "8"] if dtype == "fp8" else []
        assert main(["export-hf", str(tmp_path / "u"), str(out), "--arch", arch, "--dtype", dtype,
                     *block, "--no-progress"]) == 0
    got, want = tensors(tmp_path / "fp8"), tensors(dirs[f"{name}_fp8"])
    assert same_bytes(got, want) == []
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"] == {**FP8_CONFIG, "weight_block_size": [8, 8]}
    assert config["dtype"] == "bfloat16"
    # transformers' own Fp8Quantize rounds the same scale another way (1 / fl(448 / amax), two
    # roundings against DeepSeek's one): up to two ulps apart
    quantizer = transformers_quantizer()
    source = tensors(dirs[name])
    for k in (k for k, t in got.items() if t.dtype == FP8):
        theirs = quantizer._quantize_one(k, source[k])[k + "_scale_inv"]
        assert (theirs.view(torch.int32) - got[k + "_scale_inv"].view(torch.int32)).abs().max() <= 2, k
    with torch.no_grad():
        fp8_logits = transformers_load(tmp_path / "fp8", monkeypatch, torch.bfloat16)(TOKENS).logits
        bf16_logits = transformers_load(tmp_path / "bf16", monkeypatch, torch.bfloat16)(TOKENS).logits
    diff = (fp8_logits - bf16_logits).abs().max().item()
    print(f"{name}: transformers logits, FP8 ({BLOCK} blocks) vs bf16 export: max abs diff {diff:.3g} "
          f"(max abs logit {bf16_logits.abs().max().item():.3g})")
    assert diff < 0.1 and not torch.equal(fp8_logits, bf16_logits)


@pytest.mark.parametrize("name", ["llama_fp8", "deepseek_v3_fp8", "deepseek_v3_partial"])
def test_fp8_reexport_is_bitwise(dirs, tmp_path, name):
    """An FP8 directory imported and exported again as FP8 (its block size from the import record)
    is the same bytes and scales: DeepSeek's scale amax / 448 comes back from the dequantized
    block's amax (formats/hf/fp8.py)."""
    arch = "llama" if name.startswith("llama") else "deepseek_v3"
    import_hf(dirs[name], tmp_path / "u", progress=False)
    out = export(open_source(tmp_path / "u"), tmp_path / "hf", arch, dtype="fp8", progress=False)
    assert same_bytes(tensors(out), tensors(dirs[name])) == []
    cfg = json.loads((dirs[name] / "config.json").read_text())
    assert json.loads((out / "config.json").read_text())["quantization_config"] == cfg["quantization_config"]


def test_transformers_quantized_reexport(dirs, tmp_path):
    """A directory quantized by transformers' own Fp8Quantize (scale_inv = 1 / (448 / amax), two
    roundings) exported again: the same FP8 bytes, but DeepSeek's scale fl(amax / 448) of its
    dequantized blocks is not always transformers' scale: a scale differs by one ulp where
    1 / fl(448 / amax) is not a value fl(a / 448) takes (9% of the fp32 amax values)."""
    quantizer = transformers_quantizer()
    src = tensors(dirs["llama_fp8"])
    theirs = {}
    for k, t in tensors(dirs["llama"]).items():
        theirs.update(quantizer._quantize_one(k, t) if src[k].dtype == FP8 else {k: src[k]})
    (tmp_path / "tq").mkdir()
    save_file(theirs, str(tmp_path / "tq" / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(dirs["llama_fp8"] / "config.json", tmp_path / "tq")
    out = tensors(export(HFSource(tmp_path / "tq"), tmp_path / "hf", "llama", dtype="fp8", progress=False))
    assert [k for k in same_bytes(out, theirs) if not k.endswith("_scale_inv")] == []
    ulps = torch.cat([(out[k].view(torch.int32) - theirs[k].view(torch.int32)).flatten()
                      for k in out if k.endswith("_scale_inv")])
    print(f"transformers-quantized llama re-exported: {int((ulps != 0).sum())} of {ulps.numel()} scales "
          "one ulp off")
    assert ulps.abs().max() <= 1


def bad_copy(src: Path, dst: Path, config: dict | None = None, change=None) -> Path:
    """A copy of FP8 directory `src` with config.json fields changed (None: removed) and its
    tensors changed by `change(tensors)`."""
    t = tensors(src)
    if change:
        change(t)
    dst.mkdir()
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = {**json.loads((src / "config.json").read_text()), **(config or {})}
    (dst / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return dst


Q = "model.layers.0.self_attn.q_proj.weight"
QUANT = {**FP8_CONFIG, "weight_block_size": [8, 8]}


@pytest.mark.parametrize("config, change, message", [
    (None, lambda t: t.pop(Q + "_scale_inv"), f"tensor '{Q}' is F8_E4M3 without its '{Q}_scale_inv'"),
    (None, lambda t: t.update({Q + "_scale_inv": t[Q + "_scale_inv"][:1]}),
     rf"tensor '{Q}_scale_inv' is F32 of shape \[1, 4\]; {Q} of shape \[32, 32\] in blocks of "
     r"quantization_config.weight_block_size=\[8, 8\] needs F32 of shape \[4, 4\]"),
    (None, lambda t: t.update({Q + "_scale_inv": t[Q + "_scale_inv"].bfloat16()}), "is BF16 of shape"),
    (None, lambda t: t.update({Q: t[Q].float().to(torch.float8_e5m2)}), f"tensor '{Q}' is F8_E5M2; only F32"),
    (None, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(FP8),
                               "model.norm.weight_scale_inv": torch.ones(1)}),
     r"'model.norm.weight' is F8_E4M3 of shape \[32\]: blockwise FP8 weights have two dimensions"),
    (None, lambda t: t.update({"model.embed_tokens.weight_scale_inv": torch.ones(13, 4)}),
     "'model.embed_tokens.weight_scale_inv' scales 'model.embed_tokens.weight', which is BF16"),
    (None, lambda t: t.update({"model.layers.0.self_attn.q_proj.input_scale": torch.ones(())}),
     "q_proj.input_scale' belongs to another FP8 scheme"),
    ({"quantization_config": None}, None,
     f"tensor '{Q}' is F8_E4M3 but config.json has no quantization_config"),
    ({"quantization_config": {**QUANT, "quant_method": "bitsandbytes"}}, None,
     "config.json: quantization_config.quant_method='bitsandbytes': another quantization method"),
    ({"quantization_config": {**QUANT, "fmt": "e5m2"}}, None, "quantization_config.fmt='e5m2'"),
    ({"quantization_config": {**QUANT, "activation_scheme": "static"}}, None,
     "quantization_config.activation_scheme='static': static activation scales"),
    ({"quantization_config": {**QUANT, "weight_block_size": [128]}}, None,
     r"quantization_config.weight_block_size=\[128\]: needs two positive block sizes"),
    ({"quantization_config": {**QUANT, "weight_block_size": None}}, None,
     r"quantization_config.weight_block_size=None: needs two positive block sizes \[rows, cols\] \(None "
     "is per-tensor FP8\\)"),
])
def test_import_refuses_what_is_not_blockwise_fp8(dirs, tmp_path, config, change, message):
    bad = bad_copy(dirs["llama_fp8"], tmp_path / "bad", config, change)
    with pytest.raises(UCPError, match=message) as e:
        import_hf(bad, tmp_path / "u", progress=False)
    assert ("model.safetensors" in str(e.value)) != ("config.json: quantization_config" in str(e.value))
    assert not (tmp_path / "u").exists()


@pytest.mark.parametrize("name, message", [
    ("gpt2", "GPT-2's linear layers are transformers Conv1D modules"),
    ("gpt_oss", "GPT-OSS's experts have biases"),
    ("nemotron_h", "hybrid_layer_pattern='ME\\*-' has MoE layers"),
    ("qwen3_next", "FP8 weights of HF qwen3_next are not written"),
])
def test_export_fp8_refuses_what_transformers_cannot_load(tmp_path, name, message):
    build(name).save_pretrained(tmp_path / "src")
    with pytest.raises(UCPError, match=f"cannot export as HF {MODELS[name][0]} with dtype fp8: {message}"):
        export(HFSource(tmp_path / "src"), tmp_path / "hf", MODELS[name][0], dtype="fp8", progress=False)
    assert not (tmp_path / "hf").exists()


def test_export_fp8_block_size_checks(dirs, tmp_path):
    with pytest.raises(UCPError, match=r"an FP8 block size \(\[8, 8\]\) is for dtype fp8 only, not bf16"):
        export(HFSource(dirs["llama"]), tmp_path / "a", "llama", dtype="bf16", fp8_block_size=(8, 8),
               progress=False)
    with pytest.raises(UCPError, match=r"FP8 block size \[0, 8\]: needs two positive sizes"):
        export(HFSource(dirs["llama"]), tmp_path / "b", "llama", dtype="fp8", fp8_block_size=(0, 8),
               progress=False)
    src = HFSource(dirs["llama"])
    real = src.read

    def read(name, state, offset, shape):  # a diverged run
        t = real(name, state, offset, shape)
        return t.clone().fill_(float("inf")) if name.endswith("linear_proj.weight") else t

    src.read = read
    with pytest.raises(UCPError, match=r"model.layers.0.self_attn.o_proj.weight \(from decoder.layers.0."
                       r"self_attention.linear_proj.weight\) holds non-finite values"):
        export(src, tmp_path / "c", "llama", dtype="fp8", progress=False)
    assert not any((tmp_path / d).exists() for d in "abc")


@pytest.mark.parametrize("name", ["llama_bias", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3",
                                  "nemotron_h_dense"])
def test_export_quantizes_what_transformers_does(tmp_path, name):
    """Per architecture: the tensors export-hf --dtype fp8 writes as FP8 (128 x 128 blocks, all
    partial here) are those transformers' FP8 quantizer makes FP8Linear / FP8Experts, each with
    its scale_inv."""
    if name == "nemotron_h_dense":
        model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**NEMOTRON_DENSE))
    else:
        model = build(name)
    model.save_pretrained(tmp_path / "src")
    arch = "nemotron_h" if name == "nemotron_h_dense" else MODELS[name][0]
    got = tensors(export(HFSource(tmp_path / "src"), tmp_path / "hf", arch, dtype="fp8", progress=False))
    fp8 = {k for k, t in got.items() if t.dtype == FP8}
    assert fp8 and fp8 == transformers_fp8_names(tmp_path / "src", got)
    assert all(got[k + "_scale_inv"].shape == tuple(math.ceil(n / 128) for n in got[k].shape) for k in fp8)
    assert {k for k, t in got.items() if t.dtype == torch.float32} == {k + "_scale_inv" for k in fp8} | {
        k for k in got if re.search(KEEP_FP32, k)}
