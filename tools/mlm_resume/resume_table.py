#!/usr/bin/env python3
"""Stock Megatron-LM resumes our conversions: the loss table.

For each case, a Megatron-LM fixture (written by a Megatron-LM release's own training loop,
iteration 6: tests/fixtures/megatron_lm for core_v0.16.1, tests/fixtures/megatron_lm_v019 for
core_v0.19.0, tests/fixtures/megatron_lm_v015 for core_v0.15.3's flattened_range form) is resharded
by megatron-ucp to another layout and format, then stock `pretrain_gpt.py` of the release in
MLM_SRC (--release) loads it at that layout and trains iterations 7-9. A resume that lost or
scrambled the optimizer state shows in the losses (the `--no-load-optim` control rows), and the
Adam step of the checkpoint Megatron-LM saves at iteration 9 must be 9.

CASES are the release's own fixtures; CROSS_CASES[release] are fixtures another release wrote
(migration across releases; the conversion runs under the resuming release's megatron-core). The
reference of a fixture's rows is the fixture resumed as saved at its own layout by its own release
(with --other-src/--other-python for the other release's fixtures), else by the resuming release,
else the conversion at the fixture's own layout (core_v0.15.3, which no resuming release here
loads as saved). A fixture as saved is also resumed by the resuming release when another release
wrote it; that row may fail (it is not counted in the exit code) and says why.

core_v0.16.1 (the default) needs a Megatron-LM core_v0.16.1 tree and the shared fixture harness
(../shared/fixtures/megatron_lm/harness/setup_env.sh):

    MLM_SRC=/tmp/mlmfix/src MLM_HARNESS=../shared/fixtures/megatron_lm/harness \\
        python tools/mlm_resume/resume_table.py --work /tmp/resume --json resume.json

core_v0.19.0 needs a core_v0.19.0 tree with megatron/core moved aside (megatron-core 0.19 wheel,
tests/fixtures/megatron_lm_v019/README.md) and runs with .venv312:

    MLM_SRC=/tmp/mlm019 PYTHONPATH=$PWD .venv312/bin/python tools/mlm_resume/resume_table.py \\
        --release core_v0.19.0 --work /tmp/resume019 --json resume019.json

Both, each resuming the other's fixtures too (the references in their own release):

    MLM_SRC=/tmp/mlm019 MLM_HARNESS=../shared/fixtures/megatron_lm/harness PYTHONPATH=$PWD \\
        .venv312/bin/python tools/mlm_resume/resume_table.py --release core_v0.19.0 \\
        --other-src /tmp/mlmfix/src --other-python .venv/bin/python --work /tmp/r19 --json r19.json
    MLM_SRC=/tmp/mlmfix/src MLM_HARNESS=../shared/fixtures/megatron_lm/harness PYTHONPATH=$PWD \\
        .venv/bin/python tools/mlm_resume/resume_table.py --release core_v0.16.1 \\
        --other-src /tmp/mlm019 --other-python .venv312/bin/python --work /tmp/r16 --json r16.json
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

from megatron_ucp.conversion import reshard  # noqa: E402
from megatron_ucp.errors import UCPError  # noqa: E402
from megatron_ucp.formats import open_source  # noqa: E402
from megatron_ucp.layout import Layout  # noqa: E402

# Megatron-LM release -> its fixtures (the only place the releases are named). core_v0.16.1 and
# core_v0.19.0 also resume (--release); core_v0.15.3's flattened_range set is a source only.
RELEASES = {"core_v0.16.1": REPO / "tests" / "fixtures" / "megatron_lm",
            "core_v0.19.0": REPO / "tests" / "fixtures" / "megatron_lm_v019",
            "core_v0.15.3": REPO / "tests" / "fixtures" / "megatron_lm_v015"}
RUNNABLE = ("core_v0.16.1", "core_v0.19.0")
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
# the DeepSeek-V3 shape of tests/fixtures/megatron_lm_v019 (harness/run_all.sh's DSV3): MLA, first
# layer dense, sigmoid-routed MoE with expert bias and a shared expert, MTP; run_pretrain_resume.py
# installs the local-MLA core attention
DSV3 = ("--swiglu --normalization RMSNorm --position-embedding-type rope "
        "--untie-embeddings-and-output-weights --disable-bias-linear --no-rope-fusion --ffn-hidden-size 64 "
        "--multi-latent-attention --kv-lora-rank 16 --qk-head-dim 8 --qk-pos-emb-head-dim 8 "
        "--v-head-dim 8 --rotary-scaling-factor 4 --num-experts 4 --moe-router-topk 2 "
        "--moe-ffn-hidden-size 32 --moe-token-dispatcher-type allgather --moe-layer-freq [0]*1+[1]*2 "
        "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-num-groups 2 "
        "--moe-router-group-topk 1 --moe-router-topk-scaling-factor 2.5 "
        "--moe-shared-expert-intermediate-size 32 --mtp-num-layers 1").split()
# GPT-OSS's shape (tests/fixtures/megatron_lm_v019/README.md, "Model families"): sinks, sliding
# windows, YaRN, the clamped SwiGLU, biases; its MoE (biased experts and router) at EP > 1 only
GPT_OSS = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --group-query-attention "
           "--num-query-groups 2 --kv-channels 8 --ffn-hidden-size 64 --normalization RMSNorm "
           "--untie-embeddings-and-output-weights --softmax-type learnable --window-size 7,0 "
           "--window-attn-skip-freq 2 --quick-geglu --glu-linear-offset 1.0 "
           "--activation-func-clamp-value 7.0 --position-embedding-type yarn --rotary-scaling-factor 4.0 "
           "--yarn-original-max-position-embeddings 8 --yarn-beta-fast 32 --yarn-beta-slow 1 "
           "--no-rope-fusion").split()
GPT_OSS_MOE = [*GPT_OSS, *MOE, "--moe-ffn-hidden-size", "32"]
QWEN3 = [*LLAMA, "--qk-layernorm"]
MODEL_FLAGS = {"torch_llama_tp2": LLAMA, "torch_moe_ep2": MOE, "torch_dist_qwen3moe_ep2_fully": QWEN3_MOE,
               "torch_dist_dsmoe_ep2_fully": DEEPSEEK_MOE, "torch_dist_mtp_pp2_fully": MTP}
# extra flags of the reference run (the fixture resumed at its own layout)
FULLY = ["--dist-ckpt-optim-fully-reshardable"]
REFERENCE_FLAGS = {"torch_dist_qwen3moe_ep2_fully": FULLY, "torch_dist_dsmoe_ep2_fully": FULLY,
                   "torch_dist_mtp_pp2_fully": [*FULLY, "--decoder-last-pipeline-num-layers", "2"],
                   "torch_dist_pp2_fullyreshardable": FULLY, "torch_dist_moe_ep2_fully": FULLY}
MODEL_FLAGS.update(torch_dist_llama_tp2=LLAMA, torch_dist_moe_ep2_fully=MOE,
                   torch_dist_dsv3_pp2=[*DSV3, "--q-lora-rank", "16", "--qk-layernorm"],
                   torch_dsv3_pp2=DSV3,
                   torch_dist_gptoss_ep2_fully=GPT_OSS_MOE, torch_gptoss_ep2=GPT_OSS_MOE,
                   torch_dist_gptoss_ep2=GPT_OSS_MOE,
                   torch_dist_gptoss_dense_tp2=GPT_OSS, torch_gptoss_dense_dp2=GPT_OSS,
                   torch_dist_qwen3_tp2=QWEN3)
REFERENCE_FLAGS["torch_dist_gptoss_ep2_fully"] = FULLY
# core_v0.19.0's Muon and Lion runs (megatron-core 0.19.2's LayerWiseDistributedOptimizer; the
# later --optimizer wins over COMMON's adam); run_pretrain_resume.py installs the gloo stand-in for
# LayerWise's uneven all-gather, as the fixtures' harness did
MODEL_FLAGS.update(torch_dist_muon_dp2=["--optimizer", "muon"], torch_muon_dp2=["--optimizer", "muon"],
                   torch_dist_lion_dp2=["--optimizer", "lion"])
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
    "torch_dist_pp2_fullyreshardable": dict(fmt="torch_dist", tp=1, pp=2, dp=1, last=2),
    "torch_dist_llama_tp2": dict(fmt="torch_dist", tp=2, pp=1, dp=1),
    "torch_dist_moe_ep2_fully": dict(fmt="torch_dist", tp=1, pp=1, dp=2, ep=2),
    "v015_tp2_dp2_flat": dict(fmt="torch_dist", tp=2, pp=1, dp=2),
    "torch_dist_dsv3_pp2": dict(fmt="torch_dist", tp=1, pp=2, dp=1, last=2),
    "torch_dsv3_pp2": dict(fmt="torch", tp=1, pp=2, dp=1, last=2),
    "torch_dist_gptoss_ep2_fully": dict(fmt="torch_dist", tp=1, pp=1, dp=2, ep=2),
    "torch_gptoss_ep2": dict(fmt="torch", tp=1, pp=1, dp=2, ep=2),
    "torch_dist_gptoss_ep2": dict(fmt="torch_dist", tp=1, pp=1, dp=2, ep=2),
    "torch_dist_gptoss_dense_tp2": dict(fmt="torch_dist", tp=2, pp=1, dp=1),
    "torch_gptoss_dense_dp2": dict(fmt="torch", tp=1, pp=1, dp=2),
    "torch_dist_qwen3_tp2": dict(fmt="torch_dist", tp=2, pp=1, dp=1),
    "torch_dist_muon_dp2": dict(fmt="torch_dist", tp=1, pp=1, dp=2),
    "torch_muon_dp2": dict(fmt="torch", tp=1, pp=1, dp=2),
    "torch_dist_lion_dp2": dict(fmt="torch_dist", tp=1, pp=1, dp=2),
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
    # refuses, and EP1 with linear biases fails in stock Megatron-LM (an in-place add on a view,
    # tests/fixtures/megatron_lm_v019/README.md "Model families"): so EP2 -> EP4 (DP4, one
    # sample per micro-batch to keep the global batch of 4)
    ("torch_moe_ep2", "torch_dist", dict(tp=1, pp=1, dp=4, ep=4), "fully_reshardable",
     ["--micro-batch-size", "1", "--dist-ckpt-optim-fully-reshardable"]),
    ("torch_moe_ep2", "torch_dist", dict(tp=1, pp=1, dp=4, ep=4), "dp_reshardable",
     ["--micro-batch-size", "1"]),  # megatron-ucp's MoE dp_reshardable export
    # the same layout with one sample per micro-batch: what the EP4 rows' micro-batch alone changes
    ("torch_moe_ep2", "torch", dict(tp=1, pp=1, dp=2, ep=2), None, ["--micro-batch-size", "1"]),
    ("torch_dist_qwen3moe_ep2_fully", "torch_dist", dict(tp=1, pp=1, dp=4, ep=4), "fully_reshardable",
     ["--micro-batch-size", "1", "--dist-ckpt-optim-fully-reshardable"]),
    ("torch_dist_dsmoe_ep2_fully", "torch_dist", dict(tp=1, pp=1, dp=4, ep=4), "fully_reshardable",
     ["--micro-batch-size", "1", "--dist-ckpt-optim-fully-reshardable"]),
    ("torch_dist_mtp_pp2_fully", "torch_dist", dict(tp=2, pp=1, dp=1), "fully_reshardable",
     ["--dist-ckpt-optim-fully-reshardable"]),
    ("torch_dist_pp2_fullyreshardable", "torch", dict(tp=2, pp=1, dp=1), None, []),
    ("torch_dist_llama_tp2", "torch", dict(tp=1, pp=2, dp=1, first=2), None, []),
    ("torch_dist_moe_ep2_fully", "torch", dict(tp=1, pp=1, dp=4, ep=4), None, ["--micro-batch-size", "1"]),
    # DeepSeek-V3 shape (core_v0.19.0 only), PP2 (stage 1: layers 1-2 + MTP) -> DP2, -> PP2 split
    # the other way (stage 0: layers 0-1), -> EP2 DP2 (the EP1 run's experts move from the dense
    # buffers and groups into the expert optimizer's); TP1 (MoE at TP > 1: see above)
    ("torch_dist_dsv3_pp2", "torch", dict(tp=1, pp=1, dp=2), None, []),
    ("torch_dist_dsv3_pp2", "torch", dict(tp=1, pp=1, dp=2, ep=2), None, []),
    ("torch_dsv3_pp2", "torch_dist", dict(tp=1, pp=1, dp=2, ep=2), "fully_reshardable",
     ["--dist-ckpt-optim-fully-reshardable"]),
    ("torch_dist_dsv3_pp2", "torch_dist", dict(tp=1, pp=2, dp=1, first=2), "dp_reshardable", []),
    ("torch_dist_dsv3_pp2", "torch", dict(tp=1, pp=1, dp=2), None, ["--no-load-optim"]),  # control
    ("torch_dsv3_pp2", "torch_dist", dict(tp=1, pp=1, dp=2), "dp_reshardable", []),
    ("torch_dsv3_pp2", "torch_dist", dict(tp=1, pp=2, dp=1, first=2), "fully_reshardable",
     ["--dist-ckpt-optim-fully-reshardable"]),
    ("torch_dsv3_pp2", "torch_dist", dict(tp=1, pp=1, dp=2), "dp_reshardable", ["--no-load-optim"]),
    # core_v0.19.0's GPT-OSS shape (YaRN: 0.16.1 has no --position-embedding-type yarn). Its biased
    # experts do not train at EP1 and its MoE not at TP > 1 on CPU (see above): EP2 -> EP4 and
    # torch_dist -> torch at EP2; the sinks TP2 -> TP1 and DP2 -> TP2 on the dense variants
    ("torch_dist_gptoss_ep2_fully", "torch_dist", dict(tp=1, pp=1, dp=4, ep=4), "fully_reshardable",
     ["--micro-batch-size", "1", "--dist-ckpt-optim-fully-reshardable"]),
    ("torch_dist_gptoss_ep2_fully", "torch", dict(tp=1, pp=1, dp=2, ep=2), None, []),
    ("torch_dist_gptoss_ep2_fully", "torch", dict(tp=1, pp=1, dp=2, ep=2), None, ["--no-load-optim"]),
    ("torch_gptoss_ep2", "torch_dist", dict(tp=1, pp=1, dp=4, ep=4), "fully_reshardable",
     ["--micro-batch-size", "1", "--dist-ckpt-optim-fully-reshardable"]),
    ("torch_gptoss_ep2", "torch", dict(tp=1, pp=1, dp=2, ep=2), None, ["--micro-batch-size", "1"]),
    # a MoE run's dp_reshardable save (megatron-ucp writes MoE torch_dist fully_reshardable)
    ("torch_dist_gptoss_ep2", "torch_dist", dict(tp=1, pp=1, dp=4, ep=4), "fully_reshardable",
     ["--micro-batch-size", "1", "--dist-ckpt-optim-fully-reshardable"]),
    ("torch_dist_gptoss_ep2", "torch", dict(tp=1, pp=1, dp=2, ep=2), None, []),
    ("torch_dist_gptoss_ep2", "torch_dist", dict(tp=1, pp=1, dp=4, ep=4), "dp_reshardable",
     ["--micro-batch-size", "1"]),  # megatron-ucp's MoE dp_reshardable export
    ("torch_dist_gptoss_dense_tp2", "torch", dict(tp=1, pp=1, dp=2), None, []),
    ("torch_dist_gptoss_dense_tp2", "torch_dist", dict(tp=1, pp=2, dp=1), "dp_reshardable", []),
    ("torch_dist_gptoss_dense_tp2", "torch", dict(tp=1, pp=1, dp=2), None, ["--no-load-optim"]),
    ("torch_gptoss_dense_dp2", "torch_dist", dict(tp=2, pp=1, dp=1), "dp_reshardable", []),  # sinks DP -> TP2
    ("torch_gptoss_dense_dp2", "torch", dict(tp=2, pp=1, dp=1), None, []),
    ("torch_dist_qwen3_tp2", "torch", dict(tp=1, pp=1, dp=2), None, []),
    ("torch_dist_qwen3_tp2", "torch_dist", dict(tp=1, pp=2, dp=1, first=2), "dp_reshardable", []),
    # Muon / Lion (LayerWise: the matrices' Muon or Lion state and the rest's Adam state, one
    # torch_dist form); Muon not at another TP (blockwise Muon orthogonalises each TP shard: the
    # update itself changes), Lion (elementwise) at TP2
    ("torch_dist_muon_dp2", "torch_dist", dict(tp=1, pp=1, dp=1), None, []),
    ("torch_dist_muon_dp2", "torch_dist", dict(tp=1, pp=2, dp=1, first=2), None, []),
    ("torch_dist_muon_dp2", "torch_dist", dict(tp=1, pp=1, dp=1), None, ["--no-load-optim"]),
    ("torch_muon_dp2", "torch_dist", dict(tp=1, pp=2, dp=1, first=2), None, []),
    ("torch_dist_lion_dp2", "torch_dist", dict(tp=2, pp=1, dp=1), None, []),
    ("torch_dist_lion_dp2", "torch_dist", dict(tp=1, pp=1, dp=1), None, []),
    ("torch_dist_lion_dp2", "torch_dist", dict(tp=2, pp=1, dp=1), None, ["--no-load-optim"]),
    # the torch form: each DP rank's layer_wise_optimizer_<dp>.pt (at DP2 the files are stock's)
    ("torch_muon_dp2", "torch", dict(tp=1, pp=1, dp=2), None, []),
    ("torch_muon_dp2", "torch", dict(tp=1, pp=1, dp=1), None, []),
    ("torch_dist_muon_dp2", "torch", dict(tp=1, pp=2, dp=1, first=2), None, []),
    ("torch_muon_dp2", "torch", dict(tp=1, pp=1, dp=1), None, ["--no-load-optim"]),
    ("torch_dist_lion_dp2", "torch", dict(tp=2, pp=1, dp=1), None, []),
    # another DP size (megatron-core assigns whole parameters to DP ranks by size): DP4 with one
    # sample per micro-batch (global batch 4), Lion at TP2 DP2
    ("torch_muon_dp2", "torch", dict(tp=1, pp=1, dp=4), None, ["--micro-batch-size", "1"]),
    ("torch_dist_muon_dp2", "torch_dist", dict(tp=1, pp=1, dp=4), None, ["--micro-batch-size", "1"]),
    ("torch_dist_lion_dp2", "torch", dict(tp=2, pp=1, dp=2), None, []),
    ("torch_dist_lion_dp2", "torch_dist", dict(tp=2, pp=1, dp=2), None, []),
]
# Across releases: the resuming release (--release) -> cases whose fixture another release wrote:
# (fixture's release, fixture, target format, target layout, optimizer sharding, extra flags). The
# conversion runs under the resuming release's megatron-core (the tool's interpreter).
CROSS_CASES = {
    "core_v0.19.0": [
        ("core_v0.16.1", "torch_dp2", "torch", dict(tp=2, pp=1, dp=1), None, []),
        ("core_v0.16.1", "torch_dp2", "torch", dict(tp=2, pp=1, dp=1), None, ["--no-load-optim"]),
        ("core_v0.16.1", "torch_dist_tp2_dp2", "torch_dist", dict(tp=1, pp=2, dp=1, first=2),
         "dp_reshardable", []),
        ("core_v0.16.1", "torch_llama_tp2", "torch_dist", dict(tp=1, pp=1, dp=2), "fully_reshardable", []),
        # 0.13-0.15's flattened_range form, which 0.19 no longer loads: the same-layout conversion
        # is the reference, `--no-load-optim` the control
        ("core_v0.15.3", "v015_tp2_dp2_flat", "torch_dist", dict(tp=2, pp=1, dp=2), "fully_reshardable", []),
        ("core_v0.15.3", "v015_tp2_dp2_flat", "torch_dist", dict(tp=1, pp=2, dp=1, first=2),
         "dp_reshardable", []),
        ("core_v0.15.3", "v015_tp2_dp2_flat", "torch", dict(tp=1, pp=1, dp=2), None, []),
        ("core_v0.15.3", "v015_tp2_dp2_flat", "torch_dist", dict(tp=2, pp=1, dp=2), "fully_reshardable",
         ["--no-load-optim"]),
    ],
    "core_v0.16.1": [
        # core_v0.16.1 loads none of them as saved (their args pickle 0.19's InferenceCudaGraphScope;
        # torch_dist: no common.pt): the conversion at the fixture's own layout is the reference
        ("core_v0.19.0", "torch_dp2", "torch", dict(tp=1, pp=1, dp=2), None, []),
        ("core_v0.19.0", "torch_dp2", "torch", dict(tp=2, pp=1, dp=1), None, []),
        ("core_v0.19.0", "torch_dp2", "torch", dict(tp=2, pp=1, dp=1), None, ["--no-load-optim"]),
        ("core_v0.19.0", "torch_dist_tp2_dp2", "torch_dist", dict(tp=2, pp=1, dp=2), "dp_reshardable", []),
        ("core_v0.19.0", "torch_dist_tp2_dp2", "torch", dict(tp=1, pp=1, dp=2), None, []),
        ("core_v0.19.0", "torch_dist_llama_tp2", "torch_dist", dict(tp=2, pp=1, dp=1),
         "fully_reshardable", []),
        ("core_v0.19.0", "torch_dist_llama_tp2", "torch_dist", dict(tp=1, pp=2, dp=1, first=2),
         "fully_reshardable", []),
    ],
}


def layout_flags(lay: dict, fmt: str) -> list[str]:
    flags = ["--ckpt-format", fmt, "--tensor-model-parallel-size", str(lay["tp"]),
             "--pipeline-model-parallel-size", str(lay["pp"])]
    if lay.get("first"):
        flags += ["--decoder-first-pipeline-num-layers", str(lay["first"])]
    if lay.get("last"):
        flags += ["--decoder-last-pipeline-num-layers", str(lay["last"])]
    if lay.get("ep"):
        flags += ["--expert-model-parallel-size", str(lay["ep"])]
    return flags


def world(lay: dict) -> int:
    return lay["tp"] * lay["pp"] * lay["dp"]


def run_megatron(runner: dict, load: Path, save: Path, lay: dict, fmt: str, extra: list[str], log: Path,
                 port: int) -> dict:
    """Stock pretrain_gpt.py of `runner` (a release's Megatron-LM tree, interpreter and shim) from
    `load` to iteration 9; the logged losses and the saved step. runner may name another launcher
    ("script", e.g. run_hybrid_resume.py) and other model flags ("common")."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           "TORCHDYNAMO_DISABLE": "1", "MLM_SHIM_DISTOPT_STEP_LOAD_FIX": "1",
           "MLM_SHIM_DISTOPT_UNSHARE_STEP": "1", "MLM_RESUME_KEEP_STEP": "1", "MLM_SRC": runner["src"],
           "PYTHONPATH": os.pathsep.join(filter(None, [runner.get("pythonpath"), str(REPO)]))}
    env.pop("MLM_HARNESS", None)  # run_pretrain_resume.py: without it, megatron-ucp's own shim
    if runner.get("harness"):
        env["MLM_HARNESS"] = runner["harness"]
    env.update(runner.get("env", {}))
    cmd = [runner["python"], "-m", "torch.distributed.run",
           "--nproc-per-node", str(world(lay)), "--master-port", str(port),
           str(runner.get("script", Path(__file__).with_name("run_pretrain_resume.py"))),
           *runner.get("common", COMMON),
           *layout_flags(lay, fmt), "--load", str(load), "--save", str(save), *extra]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=900).returncode
    text = log.read_text()
    losses = {int(m.group(1)): float(m.group(2)) for m in re.finditer(
        r"iteration\s+(\d+)/.*?lm loss: ([0-9.E+-]+)", text)}
    step = None
    error = None
    if rc != 0:  # the first exception any rank raised (not torchrun's ChildFailedError)
        found = [m.group(1) for m in re.finditer(r"^(?:\[rank\d+\]: )?([\w.]*(?:Error|Exception): .*)$",
                                                 text, re.M) if "ChildFailedError" not in m.group(1)]
        error = found[-1][:300] if found else f"exit code {rc}"
    if rc == 0:
        try:
            src = open_source(save)
            # a buffer (the router's expert_bias) has no Adam step, nor do Muon/Lion state
            steps = {src.step(n) for n, p in src.manifest.params.items()
                     if not p.spec.buffer and p.spec.optimizer == "adam"}
            step = steps.pop() if len(steps) == 1 else sorted(steps)
        except UCPError as e:  # report, and go on with the other cases
            step = f"unreadable: {e}"
    return {"rc": rc, "losses": losses, "saved_step": step, "seconds": time.perf_counter() - t0,
            "log": str(log), "error": error}


def case_name(release: str, here: str, fixture: str, fmt: str, lay: dict, sharding: str | None,
              extra: list[str]) -> str:
    source = fixture if release == here else f"{release}:{fixture}"
    return f"{source} -> {fmt} " + "x".join(f"{k.upper()}{v}" for k, v in lay.items() if k != "first") \
        + (f" {sharding}" if sharding else "") + (" " + " ".join(extra) if extra else "")


def same_layout(lay: dict, source: dict) -> bool:
    return all(lay.get(k, 1) == source.get(k, 1) for k in ("tp", "pp", "dp", "ep"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/megatron_ucp_resume")
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=None,
                    help="regex on the case id; only the references of the chosen cases' fixtures run")
    ap.add_argument("--release", default="core_v0.16.1", choices=RUNNABLE,
                    help="the Megatron-LM release in MLM_SRC: it resumes every case")
    ap.add_argument("--other-src", default=None,
                    help="a Megatron-LM tree of the other resuming release (megatron/core moved aside): "
                         "it resumes its own fixtures as saved, the references of the cross-release cases")
    ap.add_argument("--other-python", default=None,
                    help="the interpreter with the other release's megatron-core")
    ap.add_argument("--pythonpath", default=None,
                    help="PYTHONPATH of the runs (before this checkout; the tool's own is not passed "
                         "on), e.g. a --target directory with the triton that core_v0.16.1's "
                         "megatron.training imports")
    ap.add_argument("--other-pythonpath", default=None, help="the same for the other release's runs")
    ap.add_argument("--port", type=int, default=29950, help="first master port (one per run)")
    a = ap.parse_args()
    here = a.release
    other = next(r for r in RUNNABLE if r != here)
    uses_harness = here == "core_v0.16.1" or (a.other_src and other == "core_v0.16.1")
    needed = ["MLM_SRC"] + (["MLM_HARNESS"] if uses_harness else [])
    for var in needed:
        if var not in os.environ:
            sys.exit(f"set {var} (see the docstring)")
    runners = {here: {"python": os.environ.get("PYTHON", sys.executable), "src": os.environ["MLM_SRC"],
                      "harness": os.environ["MLM_HARNESS"] if here == "core_v0.16.1" else None,
                      "pythonpath": a.pythonpath}}
    if a.other_src:
        if not a.other_python:
            sys.exit("--other-src needs --other-python")
        runners[other] = {"python": a.other_python, "src": a.other_src,
                          "harness": os.environ["MLM_HARNESS"] if other == "core_v0.16.1" else None,
                          "pythonpath": a.other_pythonpath}
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)

    cases = []
    for release, *case in [(here, *c) for c in CASES] + CROSS_CASES.get(here, []):
        name = case_name(release, here, *case)
        if a.only and not re.search(a.only, name):
            continue
        if not (RELEASES[release] / case[0] / "ckpt").is_dir():
            print(f"skipped {name}: {release} has no fixture {case[0]}", flush=True)
            continue
        cases.append((release, *case))
    groups = list(dict.fromkeys((c[0], c[1]) for c in cases))
    rows, port = [], a.port
    for release, fixture in groups:  # each fixture's references, then its cases
        src_lay = SOURCE_LAYOUT[fixture]
        fixture_dir = RELEASES[release] / fixture / "ckpt"
        source = fixture if release == here else f"{release}:{fixture}"
        resumers = [r for r in dict.fromkeys((release, here)) if r in runners]
        runs = [(r, None, None, None, REFERENCE_FLAGS.get(fixture, [])) for r in resumers]
        runs += [(here, *c[2:]) for c in cases if c[:2] == (release, fixture)]
        group_rows = []
        for resumer, fmt, lay, sharding, extra in runs:
            as_saved = fmt is None
            tgt = src_lay if as_saved else lay
            name = (f"{source} (as saved)" if as_saved
                    else case_name(release, here, fixture, fmt, lay, sharding, extra))
            case = work / re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{name} by {resumer}")
            case.mkdir()
            port += 1
            seconds, load = 0.0, fixture_dir
            if not as_saved:
                load = case / "converted"
                t0 = time.perf_counter()
                reshard(fixture_dir, load,
                        Layout(**{k: v for k, v in lay.items() if k in ("tp", "pp", "dp", "ep")}),
                        fmt, progress=False, first_stage_layers=lay.get("first"),
                        optim_sharding=sharding)
                seconds = time.perf_counter() - t0
            r = run_megatron(runners[resumer], load, case / "resumed", tgt,
                             src_lay["fmt"] if as_saved else fmt, MODEL_FLAGS.get(fixture, []) + extra,
                             case / "log.txt", port)
            # a fixture as saved by another release may not load here (e.g. 0.19 args under 0.16)
            r["ok"] = r["rc"] == 0 and all(i in r["losses"] for i in (7, 8, 9))
            if not r["ok"] and not r["error"]:  # Megatron-LM exits 0 when it cannot load
                r["error"] = "no lm loss for iterations 7-9: " + (re.findall(
                    r"^\s*(WeightsUnpickler error: .{0,160}|could not load the checkpoint)",
                    Path(r["log"]).read_text(), re.M) or ["see the log"])[-1]
            r.update(case=name, resumed_by=resumer, fixture=f"{release}:{fixture}", reshard_s=seconds,
                     as_saved=as_saved, must_pass=not as_saved or resumer == release,
                     same_layout=not as_saved and same_layout(lay, src_lay) and not extra)
            group_rows.append(r)
            print(f"{name} [{resumer}]: rc={r['rc']} losses={r['losses']} step={r['saved_step']}"
                  + (f" error={r['error']}" if r["error"] else ""), flush=True)
        # The reference runs the resuming release's code on its data: the fixture as saved resumed
        # by it, else the conversion at the fixture's own layout. Another release's Megatron-LM
        # feeds other mock tokens (iteration 7, before any update, differs), so the fixture resumed
        # by its own release is compared too (max_abs_vs_own_release), not the reference.
        ok = [r for r in group_rows if r["ok"]]
        ref = next((r for r in ok if r["as_saved"] and r["resumed_by"] == here), None) \
            or next((r for r in ok if r["same_layout"]), None) \
            or next((r for r in ok if r["as_saved"]), None)
        own = next((r for r in ok if r["as_saved"] and r["resumed_by"] == release != here), None)
        for r in group_rows:
            for key, base in (("reference", ref), ("own_release", own)):
                lo = base["losses"] if base else {}
                r[key] = f"{base['case']} [{base['resumed_by']}]" if base else None
                r[f"max_abs_vs_{key}"] = max((abs(v - lo[i]) for i, v in r["losses"].items() if i in lo),
                                             default=None)
                r[f"max_rel_vs_{key}"] = max((abs(v - lo[i]) / abs(lo[i]) for i, v in r["losses"].items()
                                              if i in lo), default=None)
        rows += group_rows
    def fmt(x) -> str:
        return "-" if x is None else f"{x:.2e}"

    print("\n| case | resumed by | rc | loss 7 | loss 8 | loss 9 | max abs diff vs reference "
          "| max rel diff | max abs diff vs own release | saved step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lo = [f"{r['losses'].get(i, float('nan')):.6f}" for i in (7, 8, 9)]
        print(f"| {r['case']} | {r['resumed_by']} | {r['rc']} | {' | '.join(lo)} | "
              f"{fmt(r['max_abs_vs_reference'])} | {fmt(r['max_rel_vs_reference'])} | "
              f"{fmt(r['max_abs_vs_own_release'])} | {r['saved_step']} |")
    print()
    for fixture in dict.fromkeys(r["fixture"] for r in rows):
        ref = next(r["reference"] for r in rows if r["fixture"] == fixture)
        print(f"reference of {fixture}: {ref}")
    for r in rows:
        if r["error"]:
            print(f"{r['case']} [{r['resumed_by']}] failed: {r['error']} ({r['log']})")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0 if all(r["ok"] and r["saved_step"] == 9.0 for r in rows if r["must_pass"]
                    and "--no-load-optim" not in r["case"]) else 1


if __name__ == "__main__":
    sys.exit(main())
