"""`megatron-ucp convert` as a distributed job (torchrun; here `launch`, which sets the same RANK,
WORLD_SIZE, MASTER_ADDR/PORT): each process writes a balanced share of the universal data files,
rank 0 commits once. The output must be byte for byte the single-process `--workers N` output
(the same file plan) and hold, bitwise, the tensors of the plain single-process conversion."""

from __future__ import annotations

import pytest
import torch
from conftest import STEPS
from test_transitions import universal_tensors

import megatron_ucp as ucp
from megatron_ucp.formats import open_source
from megatron_ucp.formats.group_job import balanced
from megatron_ucp.testing.launch import LaunchError, launch


def test_balanced_split():
    assert balanced([5, 1, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4, 5]]
    sets = balanced([3, 3, 2, 2, 2], 2)
    assert sorted(i for s in sets for i in s) == [0, 1, 2, 3, 4]
    loads = sorted(sum([3, 3, 2, 2, 2][i] for i in s) for s in sets)
    assert loads[-1] - loads[0] <= 3  # (largest first: within one file of even)


def _files(d) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("nprocs", [2, 3])
def test_distributed_convert_matches_single_process(nprocs, source_runs, tmp_path):
    ckpt = source_runs.get("tp2", {})["ckpt"]
    single = ucp.convert(ckpt, tmp_path / "single", workers=nprocs, progress=False)
    launch(nprocs, "megatron_ucp.testing.launch:cli",
           {"argv": ["convert", str(ckpt), str(tmp_path / "dist"), "--no-progress"]}, timeout=300)
    dist_files, single_files = _files(tmp_path / "dist"), _files(single)
    assert len([f for f in dist_files if f.startswith("params_")]) >= nprocs
    assert dist_files.keys() == single_files.keys()
    for name in dist_files:
        assert dist_files[name] == single_files[name], name
    plain = universal_tensors(ckpt, tmp_path / "plain")  # one process, one writer
    src = open_source(tmp_path / "dist")
    for name, p in src.manifest.params.items():
        for state in p.tensors:
            assert torch.equal(src.read(name, state, (0,) * len(p.shape), p.shape), plain[f"{name}/{state}"])
    assert src.manifest.iteration == STEPS


def test_distributed_convert_refuses_a_used_output_on_every_rank(source_runs, tmp_path):
    ckpt = source_runs.get("tp2", {})["ckpt"]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("taken")
    with pytest.raises(LaunchError) as ei:
        launch(2, "megatron_ucp.testing.launch:cli",
               {"argv": ["convert", str(ckpt), str(tmp_path / "out"), "--no-progress"]}, timeout=300)
    msg = str(ei.value)  # (the launcher kills the other rank once one has exited)
    codes = [int(c) for c in msg.split("exit codes [")[1].split("]")[0].split(",")]
    assert 0 not in codes and 2 in codes and "exists and is not empty" in msg, msg[-2000:]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_distributed_export_hf_matches_single_process(source_runs, tmp_path):
    """`export-hf` under torchrun: each of 2 processes writes a balanced share of the shards, rank
    0 commits once; every file is byte for byte the single-process export's."""
    from megatron_ucp.conversion import export_hf

    ckpt = source_runs.get("tp2", {})["ckpt"]
    single = export_hf(ckpt, tmp_path / "single", "gpt2", max_shard_bytes=100_000, progress=False)
    launch(2, "megatron_ucp.testing.launch:cli",
           {"argv": ["export-hf", str(ckpt), str(tmp_path / "dist"), "--arch", "gpt2",
                     "--max-shard-bytes", "100000", "--no-progress"]}, timeout=300)
    dist_files, single_files = _files(tmp_path / "dist"), _files(single)
    assert len([f for f in single_files if f.endswith(".safetensors")]) >= 3
    assert dist_files.keys() == single_files.keys()
    for name in dist_files:
        assert dist_files[name] == single_files[name], name


@pytest.mark.parametrize("command", ["convert", "export-hf"])
def test_distributed_job_writes_to_a_bucket(command, source_runs, s3_prefix, tmp_path):
    """The same jobs into an S3 prefix (hosts without a shared filesystem): each process uploads
    its files, rank 0 commits with the create-only put of the manifest (config.json for HF); the
    objects are byte for byte the single-process output and no upload is left incomplete."""
    from megatron_ucp import storage
    from megatron_ucp.conversion import export_hf
    from megatron_ucp.storage import location

    ckpt = source_runs.get("tp2", {})["ckpt"]
    if command == "convert":
        single = ucp.convert(ckpt, tmp_path / "single", workers=2, progress=False)
        extra = []
    else:
        single = export_hf(ckpt, tmp_path / "single", "gpt2", max_shard_bytes=100_000, progress=False)
        extra = ["--arch", "gpt2", "--max-shard-bytes", "100000"]
    launch(2, "megatron_ucp.testing.launch:cli",
           {"argv": [command, str(ckpt), s3_prefix, "--no-progress", *extra]}, timeout=300)
    storage.download(location(s3_prefix), tmp_path / "from_bucket")
    got, want = _files(tmp_path / "from_bucket"), _files(single)
    assert got.keys() == want.keys() and len([f for f in got if f.endswith(".safetensors")]) >= 2
    for name in got:
        assert got[name] == want[name], name
    assert storage.incomplete_uploads(location(s3_prefix)) == []
