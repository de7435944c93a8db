"""Every benchmark entry script (bench/bench_*.py) run at a tiny size, the way a user runs it: a
subprocess with CLI flags, its results written under tmp_path. Each test checks that the script
completes and that its own cross-checks hold (bitwise equal loads, files opened vs files holding a
rank's bytes, a plan within its memory limit), never a timing: a benchmark that rots (an API it
uses changed, a fixture folder gained a file) fails here instead of on the next person who runs it.

The sizes are tiny models that still run each script's steps and cross-checks, with one round of
each; bench_scale leaves out its DeepSpeed anchor (not a dependency) and the convert CLI's timing,
bench_object_store starts its own SeaweedFS on 127.0.0.1 and leaves out its external anchors
(--no-anchors: DCP through s3fs, megatron-core through multi-storage-client). The first six: about
1.5 minutes on 2 otherwise idle cores (the scripts alone: 86 s), 4.5 minutes at a load average of
10; bench_import (added 2026-12) 12 s more at a load average of 4.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600  # per script; at these sizes each takes 1-30 s
# a GPT small enough that a launch costs little more than megatron-core's import
TINY_GPT = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
            "--num-attention-heads", "4"]


def run_bench(script: str, *args: str) -> str:
    """`python bench/<script> args...` from the repository root; its stdout (the printed table)."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, (f"{script} {' '.join(args)} exited with {proc.returncode}:\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout


def test_bench_plan(tmp_path):
    out = tmp_path / "plan.json"
    run_bench("bench_plan.py", "--ranks", "128", "--tensors", "400", "--tp", "4", "--pp", "4",
              "--vocab", "1024", "--json", str(out))
    res = json.loads(out.read_text())
    assert res["ranks"] == 128 and res["layout"] == "TP4xPP4xDP8"
    assert res["tensors"] > 0 and res["fragments"] > 0 and res["manifest_mib"] > 0
    # the load plan opens exactly the files that hold the rank's bytes
    assert res["files_opened_per_rank"] == res["files_holding_rank_bytes"] >= 1


def test_bench_recompute(tmp_path):
    out = tmp_path / "recompute.json"
    run_bench("bench_recompute.py", "--gpu", "A100-80GB", "--models", "gpt-1.3b",
              "--micro-batches", "4", "--json", str(out))
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert row["model"] == "gpt-1.3b" and row["limits"]
    assert any(e["memory_binds"] for e in row["limits"])  # the rows where the planner matters
    for e in row["limits"]:
        # the plan fits its limit, and is never slower than Megatron's best setting (which the
        # planner's search contains); simulated step times, not measured ones
        assert max(e["plan_peak_gib"]) <= e["limit_gib"] * (1 + 1e-9), e
        assert e["speedup"] is not None and e["speedup"] >= 1 - 1e-9, e
        assert math.isfinite(e["plan_step_s"]) and e["plan_step_s"] > 0
        assert len(e["plan_layers_per_stage"]) == row["pp"]


def test_bench_reshard(tmp_path):
    out = tmp_path / "reshard.json"
    fixtures = ("torch_tp2_pp2", "torch_dist_tp2_dp2")  # a legacy and a torch_dist source
    run_bench("bench_reshard.py", "--repeat", "1", "--fixtures", *fixtures, "--json", str(out))
    rows = json.loads(out.read_text())
    assert {(r["fixture"], r["target"]) for r in rows} == {
        ("torch_tp2_pp2", "universal"), ("torch_tp2_pp2", "torch TP1xPP1xDP2"),
        ("torch_dist_tp2_dp2", "universal")}
    assert all(r["bytes"] > 0 for r in rows)
    # the Megatron-LM -> Megatron-LM reshard streams: it writes its output once, no universal copy
    (legacy,) = [r for r in rows if r["target"].startswith("torch")]
    assert 0 < legacy["written"] < 1.5 * legacy["out_bytes"], legacy


def test_bench_checkpoint(tmp_path):
    out = tmp_path / "checkpoint.json"
    run_bench("bench_checkpoint.py", "--layout", "tp2", "--load-layout", "dp2", *TINY_GPT,
              "--vocab-size", "256", "--seq-length", "16", "--reps", "1", "--warmup", "0",
              "--load-reps", "1", "--convert-reps", "1", "--page-cache", "keep",
              "--workdir", str(tmp_path / "work"), "--json", str(out))
    res = json.loads(out.read_text())
    assert set(res["save"]["summary"]) == {"ucp", "mcore_dp_reshardable", "mcore_fully_reshardable"}
    assert res["convert"]["in_bytes"] > 0
    load = res["load"]
    assert load["failed"] == {}
    # megatron_ucp.load of the fragments, of the universal copy and megatron-core's own load agree
    # bitwise on every rank, and each loaded model weight is the cast of its fp32 master
    assert set(load["checks"]) == {"ucp_load vs ucp_load_universal", "ucp_load vs mcore_load",
                                   "ucp_load_universal vs mcore_load"}
    for pair, check in load["checks"].items():
        assert check["mismatched"] == [] and set(check["max_abs_diff"].values()) == {0.0}, (pair, check)
    for op, check in load["consistency"].items():
        assert check["mismatched"] == [] and check["max_abs_diff"] == 0.0, (op, check)
    assert math.isfinite(load["loss_after_load"])


def test_bench_import(tmp_path):
    out = tmp_path / "import.json"
    run_bench("bench_import.py", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
              "--num-attention-heads", "4", "--vocab-size", "256", "--reps", "1",
              "--workdir", str(tmp_path / "work"), "--json", str(out))
    res = json.loads(out.read_text())
    check = res["check"]
    assert check["mismatched"] == [] and check["nonzero_state"] == [] and check["weights_only_manifest"]
    # bf16 weights alone (+ headers and the manifest) against fp32 weights and two fp32 moments
    assert res["ratios"]["out_bytes"] < 0.25 and res["ratios"]["written"] < 0.25
    assert res["forms"]["full"]["out_bytes"] > 6 * res["hf_bytes"]
    assert not any((tmp_path / "work").iterdir())  # (what it wrote is removed)


def test_bench_scale(tmp_path):
    out = tmp_path / "scale.json"
    run_bench("bench_scale.py", "--sizes", "1M", "--no-deepspeed", "--no-convert-cli",
              "--page-cache", "keep", "--workdir", str(tmp_path / "work"), "--json", str(out))
    (size,) = json.loads(out.read_text())["per_size"]
    assert size["size"] == "1M" and "skipped" not in size and "load_error" not in size, size
    assert size["checkpoint_bytes"] > 0 and size["universal_bytes"] > 0
    # both loads (fragments, universal) hold bitwise the same state, and the global sums of every
    # state match the save's (a sum at another layout: another order, equal to rounding)
    assert size["loads_identical"] is True
    assert size["load_state_sums_max_rel_diff"] < 1e-9
    assert size["load_universal_state_sums_max_rel_diff"] < 1e-9


def test_bench_object_store(tmp_path):
    out = tmp_path / "object_store.json"
    run_bench("bench_object_store.py", *TINY_GPT, "--reps", "1", "--no-anchors", "--out", str(out))
    res = json.loads(out.read_text())
    assert res["anchors"] == {}
    assert res["save"]["bytes"] > 0 and res["load"]["bytes"] > 0
    # the state loaded from the store equals the one loaded from a local copy (crc32 per rank)
    assert res["load_store_equals_local_copy"] is True
    # planned, merged ranged GETs: a few requests per rank file, not one per tensor
    assert all(opened >= 1 for opened in res["files_opened_per_rank"])
    assert all(1 <= req <= 8 * opened for req, opened in
               zip(res["requests_per_rank_per_load"], res["files_opened_per_rank"]))


def test_bench_stream(tmp_path):
    out = tmp_path / "stream.json"
    run_bench("bench_stream.py", "--layout", "tp2", "--num-layers", "2", "--hidden-size", "64",
              "--ffn-hidden-size", "128", "--num-attention-heads", "4", "--vocab-size", "256",
              "--workdir", str(tmp_path), "--json", str(out))
    res = json.loads(out.read_text())
    assert res["exported_bytes"] == res["hf_bytes"] > 0 and res["ratio"] > 0
