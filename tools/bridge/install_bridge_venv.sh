#!/usr/bin/env bash
# The Megatron-Bridge venv of `make test` (.venvbridge): Bridge 0.6.2 layered over .venv312 (Python
# 3.12, torch 2.13.0, megatron-core 0.19.x), which it reads through a .pth file instead of installing
# a second 5 GB CUDA torch. It runs Bridge's own pretrain() and checkpoint load on CPU with the
# stand-ins of megatron_ucp/testing/bridge_cpu.py (tests/test_megatron_bridge.py); the fixtures in
# tests/fixtures/megatron_bridge were written with it (their README).
#
# `pip install megatron-bridge==0.6.2` fails here (its dependency fast-hadamard-transform is an sdist
# whose build needs torch, and it pins CUDA-only packages): the wheel goes in with --no-deps, then
# what its training, checkpointing and data imports need, pinned (transformers: Bridge's 5.8-5.12.1).
# NVRx is left out (the index's newest, 0.4.1, breaks megatron-core 0.19's version check; bridge_cpu
# serves pretrain.py's one import of it).
set -euo pipefail
VENV=$1 BASE=$2
SITE=lib/python3.12/site-packages
PY=$(readlink -f "$BASE/bin/python")
test -x "$BASE/bin/python" || { echo "$0: $BASE (megatron-core 0.19) is missing: make install-mcore19 first"; exit 1; }
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
echo "import site; site.addsitedir('$(cd "$BASE" && pwd)/$SITE')" > "$VENV/$SITE/zz_mcore019.pth"
"$VENV/bin/pip" install -q --no-deps megatron-bridge==0.6.2
"$VENV/bin/pip" install -q transformers==5.12.1 omegaconf==2.3.0 hydra-core==1.3.8 datasets==5.2.0 \
  tensorboard==2.21.0 nvidia-modelopt==0.47.0 requests==2.34.2 ipython==9.18.1 megatron-energon==7.4.1
PYTHONPATH="$(pwd)" "$VENV/bin/python" -c "
from megatron_ucp.testing import bridge_cpu
bridge_cpu.install()
import megatron.bridge.training.pretrain  # noqa: F401
"
