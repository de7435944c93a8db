"""The manifest records every TransformerConfig field that can change a shape or what the model
computes (lists and tuples included), and a target that cannot represent one refuses it by name."""

from __future__ import annotations

import dataclasses
import json

import pytest
from megatron.core.transformer.transformer_config import TransformerConfig

import megatron_ucp as ucp
from megatron_ucp.formats import open_source
from megatron_ucp.formats.hf import export
from megatron_ucp.testing.launch import launch
from megatron_ucp.validation import NOT_RECORDED, config_record

try:  # MLA's config (megatron-core 0.10 and later)
    from megatron.core.transformer.transformer_config import MLATransformerConfig
except ImportError:  # pragma: no cover
    MLATransformerConfig = None

SMALL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128)
# list- and tuple-valued settings that change what a model computes or which layers it has
LISTS = dict(window_size=(4, 0), window_attn_skip_freq=2, num_moe_experts=4, moe_layer_freq=[0, 1, 1, 1],
             no_rope_freq=[0, 0, 0, 1], moe_router_topk=2)


def _configs():
    yield TransformerConfig(**SMALL, **LISTS)
    if MLATransformerConfig is not None:
        yield MLATransformerConfig(**SMALL, multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16,
                                   qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16)


@pytest.mark.parametrize("config", list(_configs()), ids=lambda c: type(c).__name__)
def test_every_config_field_is_recorded_or_declared_irrelevant(config):
    record = config_record(config)
    json.dumps(record, allow_nan=False)  # (the manifest is JSON)
    missing = [f.name for f in dataclasses.fields(config)
               if f.name not in record and f.name not in NOT_RECORDED]
    assert not missing, (f"TransformerConfig fields neither recorded in the manifest nor declared in "
                         f"validation.NOT_RECORDED (with why): {missing}")
    assert record["activation_func"] == "torch._C._nn.gelu"  # megatron-core's default activation
    assert record["params_dtype"] == "torch.float32"


def test_lists_and_tuples_are_recorded():
    record = config_record(TransformerConfig(**SMALL, **LISTS))
    assert record["window_size"] == [4, 0]
    assert record["moe_layer_freq"] == [0, 1, 1, 1]
    assert record["no_rope_freq"] == [0, 0, 0, 1]
    assert record["window_attn_skip_freq"] == 2


def test_declared_fields_exist():
    """A name in NOT_RECORDED that no config has is a typo (it would hide nothing)."""
    names = {f.name for c in _configs() for f in dataclasses.fields(c)}
    assert set(NOT_RECORDED) <= names, set(NOT_RECORDED) - names


def test_sliding_window_model_is_not_exported_as_full_attention(tmp_path):
    """A Llama-shaped model with window_size=(4, 0): its manifest records the window, and export-hf
    --arch llama refuses it by name (HF Llama has no sliding window; exporting it would write a
    full-attention model with the same weights and other logits). It still loads into itself."""
    cfg = {"num_layers": 2, "swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope",
           "add_bias_linear": False, "untie_embeddings": True, "global_batch_size": 4,
           "extra": {"window_size": [4, 0]}}
    launch(1, "megatron_ucp.testing.scenarios:train_and_save",
           {"layout": "tp1", "cfg": cfg, "steps": 1, "save_dir": str(tmp_path / "ckpt")})
    source = open_source(tmp_path / "ckpt")
    assert source.manifest.model["window_size"] == [4, 0]
    with pytest.raises(ucp.UCPError, match=r"cannot export as HF llama: model config "
                                           r"window_size=\[4, 0\]: sliding-window attention"):
        export(source, tmp_path / "hf", "llama", progress=False)
    assert not (tmp_path / "hf").exists()
    full = {**cfg, "extra": {}}  # the same model without the window is another model
    with pytest.raises(Exception, match=r"window_size: checkpoint \[4, 0\], model None"):
        launch(1, "megatron_ucp.testing.scenarios:load_and_train",
               {"layout": "tp1", "cfg": full, "load_dir": str(tmp_path / "ckpt"), "steps": 0})
