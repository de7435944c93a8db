"""The command line treats every format alike: `inspect` reads Megatron-LM checkpoints too, every
flag has a help text, and `--dtype` takes the names HF users type."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from megatron_ucp.cli import build_parser, main

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "megatron_lm"


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("command", [c for c in _subcommands() if c != "profile-recompute"])
def test_every_flag_has_a_help_text(command):
    parser = _subcommands()[command]
    bare = [a.option_strings or a.dest for a in parser._actions
            if not a.help and not isinstance(a, argparse._HelpAction)]
    assert bare == [], f"megatron-ucp {command}: arguments without help: {bare}"


def test_reshard_help_describes_the_target_flags(capsys):
    with pytest.raises(SystemExit):
        main(["reshard", "--help"])
    out = capsys.readouterr().out
    for flag, words in (("--target-tp", "tensor-parallel"), ("--target-vpp", "virtual pipeline"),
                        ("--target-format", "--ckpt-format torch_dist")):
        assert flag in out and words in out, (flag, out)


@pytest.mark.parametrize("fixture,kind", [("torch_dp2", "megatron_torch"),
                                          ("torch_dist_tp2_dp2", "megatron_torch_dist")])
def test_inspect_reads_megatron_lm_checkpoints(fixture, kind, capsys):
    assert main(["inspect", str(FIXTURES / fixture / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert f"kind         {kind}" in out
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in out
    assert "iteration    6" in out


def test_inspect_says_what_the_model_is(capsys):
    """The DeepSeek-V3-shape run (core_v0.16.1): its features on one line, and the MTP layer's
    long names in their column."""
    assert main(["inspect", str(FIXTURES / "torch_dist_dsv3_pp2" / "ckpt")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "features     MLA (q_lora_rank 16, kv_lora_rank 16), MoE 4 experts top-2, shared expert, " \
        "MTP 1, YaRN, QK-norm" in out
    table = out[out.index(next(line for line in out if line.startswith("name "))):]
    assert len({len(line) for line in table}) == 1  # one width: every column aligned


def test_verify_says_a_megatron_lm_checkpoint_has_no_checksums(capsys):
    assert main(["verify", str(FIXTURES / "torch_dist_tp2_dp2" / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert "a megatron_torch_dist checkpoint carries no checksums" in err and "inspect" in err


def test_inspect_refuses_what_is_no_checkpoint(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "unknown checkpoint format" in capsys.readouterr().err


@pytest.mark.parametrize("name,st_dtype", [("bfloat16", "BF16"), ("float16", "F16"), ("float32", "F32"),
                                           ("bf16", "BF16")])
def test_export_dtype_takes_torch_names(name, st_dtype, tmp_path):
    out = tmp_path / "hf"
    assert main(["export-hf", str(FIXTURES / "torch_llama_tp2" / "ckpt"), str(out), "--arch", "llama",
                 "--dtype", name, "--no-progress"]) == 0
    shard = next(out.glob("*.safetensors"))
    header = json.loads(shard.read_bytes()[8:8 + int.from_bytes(shard.read_bytes()[:8], "little")])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {st_dtype}


def test_export_hf_offers_every_arch():
    from megatron_ucp.cli import HF_ARCHS
    from megatron_ucp.formats.hf.archs import ARCHS

    assert tuple(HF_ARCHS) == ARCHS


def test_parser_builds_without_torch():
    """`--help` needs no torch: the --arch choices are read from the registry only when parsed."""
    import subprocess
    import sys

    code = ("import sys; from megatron_ucp.cli import build_parser; build_parser(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
