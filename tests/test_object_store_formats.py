"""The other formats read from an object store (S3 on the SeaweedFS server, tests/seaweed.py):
Megatron-LM torch_dist and torch checkpoints, Hugging Face directories and DeepSpeed universal
folders uploaded to the bucket as they are on disk. What `convert` / `import-hf` /
`import-deepspeed` make of the URL equals, bitwise, what they make of the local copy, and a
torch_dist read fetches merged byte ranges (a few requests per data file, not one per tensor).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import READS_CORE_V019_FILES
from test_deepspeed_import import DS_DIR, TINY_MAP
from test_hf_import import build

import megatron_ucp as ucp
from megatron_ucp import formats, storage
from megatron_ucp.cli import main as cli
from megatron_ucp.conversion import reshard
from megatron_ucp.formats import open_source
from megatron_ucp.layout import Layout
from megatron_ucp.spec import states_of
from megatron_ucp.storage import location, object_store, store_backend

FIXTURES = Path(__file__).parent / "fixtures" / "megatron_lm"


def uploaded(local: Path, url: str) -> str:
    store_backend.upload_tree(local, location(url), [])
    return url


def universal(root) -> dict[str, torch.Tensor]:
    """Every tensor of a universal checkpoint, and every step."""
    return universal_of(open_source(root))


def universal_of(src) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in src.manifest.params.items():
        out[f"{name}/step"] = torch.tensor(src.step(name))
        for state in states_of(p.spec):
            out[f"{name}/{state}"] = src.read(name, state, (0,) * len(p.shape), p.shape)
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("fixture,fmt", [
    ("torch_dist_tp2_dp2", "megatron_torch_dist"), ("torch_dist_dsmoe_ep2_fully", "megatron_torch_dist"),
    ("torch_tp2_pp2", "megatron_torch"),
    *(pytest.param(f"../megatron_lm_v019/{fixture}", fmt, marks=READS_CORE_V019_FILES)
      for fixture, fmt in [("torch_dist_tp2_dp2", "megatron_torch_dist"),
                           ("fsdp_dtensor_dp2", "megatron_fsdp"), ("torch_dcp_fsdp2_dp2", "megatron_fsdp")])])
def test_megatron_lm_checkpoint_converts_from_the_bucket(fixture, fmt, s3_prefix, tmp_path, capsys):
    local = FIXTURES / fixture / "ckpt"
    url = uploaded(local, f"{s3_prefix}/{Path(fixture).name}")
    assert formats.detect(url) == fmt
    assert cli(["inspect", url]) == 0
    assert f"kind         {fmt} (read as universal tensors)" in capsys.readouterr().out
    from_bucket = ucp.convert(url, tmp_path / "from_bucket", progress=False)
    assert_same(universal(from_bucket), universal(ucp.convert(local, tmp_path / "local", progress=False)))
    if fmt != "megatron_torch":  # each stored key's items: one ranged GET per data object
        source = formats.open_source(url)
        assert_same(universal_of(source), universal(from_bucket))
        objects = source.reader.storage.objects
        assert 0 < objects.requests == objects.objects_fetched
        assert objects.objects_fetched < sum(len(m.chunks) for m in source.reader.meta.values()
                                             if hasattr(m, "chunks"))
    # into the bucket too, committed like a save
    assert cli(["convert", url, url + "-universal", "--no-progress"]) == 0
    assert_same(universal(url + "-universal"), universal(from_bucket))


def test_hf_directory_imports_from_the_bucket(s3_prefix, tmp_path):
    local = tmp_path / "hf"
    build("llama").save_pretrained(local)
    url = uploaded(local, f"{s3_prefix}/hf")
    assert formats.detect(url) == "hf"
    assert cli(["import-hf", url, str(tmp_path / "from_bucket"), "--no-progress"]) == 0
    assert cli(["import-hf", str(local), str(tmp_path / "local"), "--no-progress"]) == 0
    assert_same(universal(tmp_path / "from_bucket"), universal(tmp_path / "local"))


def test_deepspeed_folder_imports_from_the_bucket(s3_prefix, tmp_path):
    url = uploaded(DS_DIR, f"{s3_prefix}/ds")
    assert cli(["import-deepspeed", url, str(tmp_path / "from_bucket"), "--name-map", str(TINY_MAP),
                "--no-progress"]) == 0
    assert cli(["import-deepspeed", str(DS_DIR), str(tmp_path / "local"), "--name-map", str(TINY_MAP),
                "--no-progress"]) == 0
    assert_same(universal(tmp_path / "from_bucket"), universal(tmp_path / "local"))


def test_damaged_torch_dist_in_the_bucket_is_named(s3_prefix, tmp_path):
    """A data object cut short, or missing, is an error naming its URL; nothing is written."""
    local = FIXTURES / "torch_dist_tp2_dp2" / "ckpt"
    url = uploaded(local, f"{s3_prefix}/cut")
    iteration = location(url) / "iter_0000006"
    data = sorted(p for p in iteration.iterdir() if p.name.endswith(".distcp"))[0]
    whole = data.read_bytes()
    object_store.put(data, whole[:len(whole) // 2])
    with pytest.raises(ucp.UCPError, match=re.escape(str(data)) + ": bytes .* did not come back"):
        ucp.convert(url, tmp_path / "out", progress=False)
    object_store.delete([data])
    with pytest.raises(ucp.UCPError, match=f"{data.name}.*missing"):
        ucp.convert(url, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("target_format", ["torch_dist", "torch"])
def test_megatron_lm_target_written_into_the_bucket(target_format, s3_prefix, tmp_path):
    """`reshard --target-format torch_dist / torch` into a prefix (what Megatron-LM then loads
    through msc://): written and checked locally, uploaded with the tracker file last; read back
    from the bucket it holds what the same reshard to disk holds, bitwise."""
    source = FIXTURES / "torch_dist_tp2_dp2" / "ckpt"
    url = f"{s3_prefix}/{target_format}"
    target = Layout(tp=1, dp=2)
    reshard(source, url, target, target_format=target_format, progress=False)
    reshard(source, tmp_path / "local", target, target_format=target_format, progress=False)
    assert location(url + "/latest_checkpointed_iteration.txt").read_text() == "6"
    assert formats.detect(url) == f"megatron_{target_format}"
    assert_same(universal(ucp.convert(url, tmp_path / "u_bucket", progress=False)),
                universal(ucp.convert(tmp_path / "local", tmp_path / "u_local", progress=False)))
    assert storage.incomplete_uploads(location(url)) == []
