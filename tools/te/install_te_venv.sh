#!/usr/bin/env bash
# The Transformer Engine venv of `make test` (.venvte): TE 2.20.2 layered over .venv312 (Python 3.12,
# torch 2.13.0, megatron-core 0.19.x), which it reads through a .pth file instead of installing a
# second 5 GB CUDA torch. TE lives only here: with TE importable, megatron-core changes the defaults of
# local-spec models (TENorm, FusedAdam), so the local-spec suites never see it.
#
# transformer-engine-torch is an sdist only; its wheel is built once (C++ host code, no nvcc; 4.6 min
# on 2 cores at -O0, see cxx_host_only.sh) and cached outside the clone in TE_CACHE, keyed by the TE
# and torch versions, so a rerun or a fresh clone on the same machine reuses it.
set -euo pipefail
VENV=$1 BASE=$2 TE_CACHE=$3
TE_VERSION=2.20.2
SDIST_URL=https://files.pythonhosted.org/packages/3d/fb/c9ce298a38c22ed1059923a01cac7e1f4e4f7281d39a8679c8118febe079/transformer_engine_torch-$TE_VERSION.tar.gz
SDIST_SHA256=4c40ced8a6261649e689076f198d4feaf02277b1ba18931a66eccdaceb33c43e
HERE=$(cd "$(dirname "$0")" && pwd)
PY=$(readlink -f "$BASE/bin/python")
SITE=lib/python3.12/site-packages

test -x "$BASE/bin/python" || { echo "$0: $BASE (megatron-core 0.19) is missing: make install-mcore19 first"; exit 1; }
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
# .venv312's packages (torch, megatron-core, megatron-ucp editable) after the venv's own, with
# their .pth files processed (site.addsitedir), and its nvidia/ libraries where TE looks for them
echo "import site; site.addsitedir('$(cd "$BASE" && pwd)/$SITE')" > "$VENV/$SITE/zz_mcore019.pth"
ln -sfn "$(cd "$BASE" && pwd)/$SITE/nvidia" "$VENV/$SITE/nvidia"
TORCH=$("$VENV/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
# TE's Python dependencies, and the cuDNN frontend headers the extension's build includes (its 485 MB
# CUTLASS DSL dependency is for kernels, which never run here: --no-deps)
"$VENV/bin/pip" install -q --no-deps "transformer-engine==$TE_VERSION" "transformer-engine-cu13==$TE_VERSION" \
  nvidia-cudnn-frontend==1.32.0
"$VENV/bin/pip" install -q onnxscript==0.7.2 onnx==1.23.2 nvdlfw-inspect==0.2.2 importlib-metadata==10.2.0

WHEEL_DIR=$TE_CACHE/te-$TE_VERSION-torch$TORCH-cp312
WHEEL=$WHEEL_DIR/transformer_engine_torch-$TE_VERSION-cp312-cp312-linux_x86_64.whl
if [ ! -f "$WHEEL" ]; then
  echo "building transformer-engine-torch $TE_VERSION against torch $TORCH (about 5 minutes on 2 cores)"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  curl -fsSL -o "$work/te.tar.gz" "$SDIST_URL"
  echo "$SDIST_SHA256  $work/te.tar.gz" | sha256sum -c --quiet
  mv "$work/te.tar.gz" "$work/transformer_engine_torch-$TE_VERSION.tar.gz"
  # /usr/local/cuda's headers: the pip nvidia/cu13/include lacks crt/host_config.h
  NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_BUILD_USE_NVIDIA_WHEELS=1 NVTE_WITH_NCCL_EP=0 MAX_JOBS=2 \
    CUDA_HOME=/usr/local/cuda CPLUS_INCLUDE_PATH=/usr/local/cuda/include CXX="$HERE/cxx_host_only.sh" \
    PIP_NO_CACHE_DIR=1 "$VENV/bin/pip" wheel -q --no-build-isolation --no-deps -w "$work/wheel" \
    "$work/transformer_engine_torch-$TE_VERSION.tar.gz"
  mkdir -p "$TE_CACHE"
  rm -rf "$WHEEL_DIR.tmp" && mkdir -p "$WHEEL_DIR.tmp" && cp "$work"/wheel/*.whl "$WHEEL_DIR.tmp/"
  rm -rf "$WHEEL_DIR" && mv "$WHEEL_DIR.tmp" "$WHEEL_DIR"
fi
"$VENV/bin/pip" install -q --no-deps "$WHEEL"
"$VENV/bin/python" - <<'PY'
import megatron_ucp.testing.cpu_shim  # noqa: F401  (TE refuses to import without CUDA)
import transformer_engine.pytorch  # noqa: F401
import transformer_engine_torch  # noqa: F401
from megatron.core.extensions import transformer_engine  # noqa: F401
PY
