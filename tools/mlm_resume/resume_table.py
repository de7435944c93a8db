#!/usr/bin/env python3
"""Stock Megatron-LM resumes our conversions: the loss table.

For each case, the Megatron-LM fixture (written by the chosen Megatron-LM release's own training
loop, iteration 6: tests/fixtures/megatron_lm for core_v0.16.1, tests/fixtures/megatron_lm_v019
for core_v0.19.0) is resharded by megatron-ucp to another layout and
format, then stock `pretrain_gpt.py` loads it at that layout and trains iterations 7-9. The
reference is the fixture resumed unchanged at its own layout. A resume that lost or scrambled the
optimizer state shows in the losses (the `no optimizer state` control row), and the Adam step of
the checkpoint Megatron-LM saves at iteration 9 must be 9.

core_v0.16.1 (the default) needs a Megatron-LM core_v0.16.1 tree and the shared fixture harness
(../shared/fixtures/megatron_lm/harness/setup_env.sh):

    MLM_SRC=/tmp/mlmfix/src MLM_HARNESS=../shared/fixtures/megatron_lm/harness \\
        python tools/mlm_resume/resume_table.py --work /tmp/resume --json resume.json

core_v0.19.0 needs a core_v0.19.0 tree with megatron/core moved aside (megatron-core 0.19 wheel,
tests/fixtures/megatron_lm_v019/README.md) and runs with .venv312:

    MLM_SRC=/tmp/mlm019 PYTHONPATH=$PWD .venv312/bin/python tools/mlm_resume/resume_table.py \\
        --release core_v0.19.0 --work /tmp/resume019 --json resume019.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from megatron_ucp.errors import UCPError  # noqa: E402
from megatron_ucp.formats import open_source  # noqa: E402
from megatron_ucp.layout import Layout  # noqa: E402
from megatron_ucp.reshard import reshard  # noqa: E402

# Megatron-LM release -> its fixtures (the only place the release is named)
RELEASES = {"core_v0.16.1": REPO / "tests" / "fixtures" / "megatron_lm",
            "core_v0.19.0": REPO / "tests" / "fixtures" / "megatron_lm_v019"}
FIXTURES = RELEASES["core_v0.16.1"]
# the fixture harness's common flags (run_set.sh), trained on to iteration 9
COMMON = ("--num-layers 3 --hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 128 "
          "--seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 "
          "--train-iters 9 --lr 1e-3 --lr-decay-style constant --weight-decay 0.01 --clip-grad 1.0 "
          "--optimizer adam --adam-beta1 0.9 --adam-beta2 0.95 --use-distributed-optimizer "
          "--mock-data --tokenizer-type NullTokenizer --vocab-size 250 --transformer-impl local "
          "--distributed-backend gloo --no-gradient-accumulation-fusion --no-masked-softmax-fusion "
          "--no-bias-gelu-fusion --no-bias-dropout-fusion --no-persist-layer-norm "
          "--hidden-dropout 0.0 --attention-dropout 0.0 --seed 4321 --log-interval 1 "
          "--eval-iters 0 --eval-interval 1000 --bf16 --save-interval 3 "
          "--override-opt_param-scheduler").split()
LLAMA = ("--swiglu --group-query-attention --num-query-groups 2 --normalization RMSNorm "
         "--position-embedding-type rope --untie-embeddings-and-output-weights "
         "--disable-bias-linear --no-rope-fusion").split()
MOE = "--num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type allgather".split()
QWEN3_MOE = [*LLAMA, "--qk-layernorm", *MOE, "--moe-ffn-hidden-size", "64"]
DEEPSEEK_MOE = [*LLAMA, *MOE, "--moe-ffn-hidden-size", "48", "--moe-layer-freq", "[0]*1+[1]*2",
                "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                "--moe-router-topk-scaling-factor", "2.5", "--moe-shared-expert-intermediate-size", "64",
                "--moe-shared-expert-gate"]
MTP = [*LLAMA, "--mtp-num-layers", "1"]
MODEL_FLAGS = {"torch_llama_tp2": LLAMA, "torch_moe_ep2": MOE, "torch_dist_qwen3moe_ep2_fully": QWEN3_MOE,
               "torch_dist_dsmoe_ep2_fully": DEEPSEEK_MOE, "torch_dist_mtp_pp2_fully": MTP}
# extra flags of the reference run (the fixture resumed at its own layout)
FULLY = ["--dist-ckpt-optim-fully-reshardable"]
REFERENCE_FLAGS = {"torch_dist_qwen3moe_ep2_fully": FULLY, "torch_dist_dsmoe_ep2_fully": FULLY,
                   "torch_dist_mtp_pp2_fully": [*FULLY, "--decoder-last-pipeline-num-layers", "2"]}
# fixture -> its layout at save (Megatron flags)
SOURCE_LAYOUT = {
    "torch_dp2": dict(fmt="torch", tp=1, pp=1, dp=2),
    "torch_tp2_pp2": dict(fmt="torch", tp=2, pp=2, dp=1, first=2),
    "torch_dist_tp2_dp2": dict(fmt="torch_dist", tp=2, pp=1, dp=2),
    "torch_llama_tp2": dict(fmt="torch", tp=2, pp=1, dp=1),
    "torch_moe_ep2": dict(fmt="torch", tp=1, pp=1, dp=2, ep=2),
    "torch_dist_qwen3moe_ep2_fully": dict(fmt="torch_dist", tp=1, pp=1, dp=2, ep=2),
    "torch_dist_dsmoe_ep2_fully": dict(fmt="torch_dist", tp=1, pp=1, dp=2, ep=2),
    "torch_dist_mtp_pp2_fully": dict(fmt="torch_dist", tp=1, pp=2, dp=1),
}
# (fixture, target format, target layout, optimizer sharding for torch_dist, extra Megatron flags)
CASES = [
    ("torch_dp2", "torch", dict(tp=2, pp=1, dp=1), None, []),
    ("torch_dp2", "torch", dict(tp=1, pp=2, dp=1, first=2), None, []),
    ("torch_dp2", "torch_dist", dict(tp=2, pp=1, dp=1), "fully_reshardable", []),
    ("torch_dp2", "torch_dist", dict(tp=2, pp=1, dp=1), "dp_reshardable", []),
    ("torch_dp2", "torch", dict(tp=2, pp=1, dp=1), None, ["--no-load-optim"]),  # control
    ("torch_tp2_pp2", "torch", dict(tp=1, pp=1, dp=2), None, []),
    ("torch_tp2_pp2", "torch_dist", dict(tp=1, pp=1, dp=2), "dp_reshardable", []),
    ("torch_dist_tp2_dp2", "torch", dict(tp=1, pp=1, dp=2), None, []),
    ("torch_dist_tp2_dp2", "torch_dist", dict(tp=1, pp=2, dp=1, first=2), "dp_reshardable", []),
    ("torch_llama_tp2", "torch_dist", dict(tp=1, pp=1, dp=2), "dp_reshardable", []),
    ("torch_llama_tp2", "torch", dict(tp=1, pp=2, dp=1, first=2), None, []),
    # MoE at TP > 1 needs sequence parallelism, which megatron-core's local (non-TE) LayerNorm
    # refuses, and EP1 with linear biases fails in stock Megatron-LM: so EP2 -> EP4 (DP4, one
    # sample per micro-batch to keep the global batch of 4)
    ("torch_moe_ep2", "torch_dist", dict(tp=1, pp=1, dp=4, ep=4), "fully_reshardable",
     ["--micro-batch-size", "1", "--dist-ckpt-optim-fully-reshardable"]),
    ("torch_dist_qwen3moe_ep2_fully", "torch_dist", dict(tp=1, pp=1, dp=4, ep=4), "fully_reshardable",
     ["--micro-batch-size", "1", "--dist-ckpt-optim-fully-reshardable"]),
    ("torch_dist_dsmoe_ep2_fully", "torch_dist", dict(tp=1, pp=1, dp=4, ep=4), "fully_reshardable",
     ["--micro-batch-size", "1", "--dist-ckpt-optim-fully-reshardable"]),
    ("torch_dist_mtp_pp2_fully", "torch_dist", dict(tp=2, pp=1, dp=1), "fully_reshardable",
     ["--dist-ckpt-optim-fully-reshardable"]),
]


def layout_flags(lay: dict, fmt: str) -> list[str]:
    flags = ["--ckpt-format", fmt, "--tensor-model-parallel-size", str(lay["tp"]),
             "--pipeline-model-parallel-size", str(lay["pp"])]
    if lay.get("first"):
        flags += ["--decoder-first-pipeline-num-layers", str(lay["first"])]
    if lay.get("ep"):
        flags += ["--expert-model-parallel-size", str(lay["ep"])]
    return flags


def world(lay: dict) -> int:
    return lay["tp"] * lay["pp"] * lay["dp"]


def run_megatron(load: Path, save: Path, lay: dict, fmt: str, extra: list[str], log: Path,
                 port: int) -> dict:
    """Stock pretrain_gpt.py from `load` to iteration 9; the logged losses and the saved step."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           "TORCHDYNAMO_DISABLE": "1", "MLM_SHIM_DISTOPT_STEP_LOAD_FIX": "1",
           "MLM_SHIM_DISTOPT_UNSHARE_STEP": "1", "MLM_RESUME_KEEP_STEP": "1"}
    cmd = [os.environ.get("PYTHON", sys.executable), "-m", "torch.distributed.run",
           "--nproc-per-node", str(world(lay)), "--master-port", str(port),
           str(Path(__file__).with_name("run_pretrain_resume.py")), *COMMON,
           *layout_flags(lay, fmt), "--load", str(load), "--save", str(save), *extra]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=900).returncode
    text = log.read_text()
    losses = {int(m.group(1)): float(m.group(2)) for m in re.finditer(
        r"iteration\s+(\d+)/.*?lm loss: ([0-9.E+-]+)", text)}
    step = None
    if rc == 0:
        try:
            src = open_source(save)
            # a buffer (the router's expert_bias) has no Adam step
            steps = {src.step(n) for n, p in src.manifest.params.items() if not p.spec.buffer}
            step = steps.pop() if len(steps) == 1 else sorted(steps)
        except UCPError as e:  # report, and go on with the other cases
            step = f"unreadable: {e}"
    return {"rc": rc, "losses": losses, "saved_step": step, "seconds": time.perf_counter() - t0,
            "log": str(log)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/megatron_ucp_resume")
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=None,
                    help="regex on the case id; only the references of the chosen cases' fixtures run")
    ap.add_argument("--release", default="core_v0.16.1", choices=sorted(RELEASES),
                    help="the Megatron-LM release in MLM_SRC: whose fixtures resume")
    ap.add_argument("--port", type=int, default=29950, help="first master port (one per run)")
    a = ap.parse_args()
    global FIXTURES
    FIXTURES = RELEASES[a.release]
    needed = ("MLM_SRC", "MLM_HARNESS") if a.release == "core_v0.16.1" else ("MLM_SRC",)
    for var in needed:
        if var not in os.environ:
            sys.exit(f"set {var} (see the docstring)")
    if a.release != "core_v0.16.1":
        os.environ.pop("MLM_HARNESS", None)  # run_pretrain_resume.py: megatron-ucp's own shim
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rows, port = [], a.port
    refs = {}
    def case_name(fixture, fmt, lay, sharding, extra) -> str:
        return f"{fixture} -> {fmt} " + "x".join(f"{k.upper()}{v}" for k, v in lay.items()
                                                  if k != "first") \
            + (f" {sharding}" if sharding else "") + (" " + " ".join(extra) if extra else "")

    cases = [c for c in CASES if not a.only or re.search(a.only, case_name(*c))]
    sources = [f for f in SOURCE_LAYOUT if any(c[0] == f for c in cases)]  # their references
    # each fixture's reference, then its cases: a run cut short still has complete pairs
    runs = [r for f in sources
            for r in [(f, None, None, None, REFERENCE_FLAGS.get(f, []))] + [c for c in cases if c[0] == f]]
    for fixture, fmt, lay, sharding, extra in runs:
        reference = fmt is None
        src_lay = SOURCE_LAYOUT[fixture]
        tgt = src_lay if reference else lay
        name = f"{fixture} -> (itself)" if reference else case_name(fixture, fmt, lay, sharding, extra)
        case = work / re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
        case.mkdir()
        port += 1
        if reference:
            load = FIXTURES / fixture / "ckpt"
            seconds = 0.0
        else:
            load = case / "converted"
            t0 = time.perf_counter()
            reshard(FIXTURES / fixture / "ckpt", load,
                    Layout(**{k: v for k, v in lay.items() if k in ("tp", "pp", "dp", "ep")}),
                    fmt, progress=False, first_stage_layers=lay.get("first"),
                    optim_sharding=sharding)
            seconds = time.perf_counter() - t0
        r = run_megatron(load, case / "resumed", tgt, tgt["fmt"] if reference else fmt,
                         MODEL_FLAGS.get(fixture, []) + extra, case / "log.txt", port)
        r.update(case=name, fixture=fixture, reshard_s=seconds)
        if reference:
            refs[fixture] = r["losses"]
        ref = refs.get(fixture, {})
        r["max_abs_vs_reference"] = max((abs(v - ref[i]) for i, v in r["losses"].items() if i in ref),
                                        default=None)
        r["max_rel_vs_reference"] = max((abs(v - ref[i]) / abs(ref[i]) for i, v in r["losses"].items()
                                         if i in ref), default=None)
        rows.append(r)
        print(f"{name}: rc={r['rc']} losses={r['losses']} step={r['saved_step']} "
              f"max|d|={r['max_abs_vs_reference']}", flush=True)
    print("\n| case | rc | loss 7 | loss 8 | loss 9 | max abs diff vs reference | max rel diff "
          "| saved step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        lo = [f"{r['losses'].get(i, float('nan')):.6f}" for i in (7, 8, 9)]
        d, rel = r["max_abs_vs_reference"], r["max_rel_vs_reference"]
        print(f"| {r['case']} | {r['rc']} | {' | '.join(lo)} | "
              f"{'-' if d is None else f'{d:.2e}'} | {'-' if rel is None else f'{rel:.2e}'} | "
              f"{r['saved_step']} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
