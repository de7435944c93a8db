#!/usr/bin/env bash
# The GPU check: megatron_ucp's save/load bitwise on CUDA with NCCL and the pinned staging
# throughput, on a GPU machine with no network whose image has torch but no megatron-core.
#
#   bash tools/gpu/gpu_check.sh            # on the GPU machine, from the repo root, .whl/ carried
#   bash tools/gpu/gpu_check.sh --dry-run  # anywhere: syntax, the wheel list (and folder), imports
#
# The run: picks the Python that has torch (GPU_CHECK_PYTHON, else python3, else the image's
# /opt/torch/.venv/bin/python3), installs from .whl/ (`make gpu-wheels` fills it here) what that
# Python lacks into GPU_CHECK_SITE (no network: pip --no-index --no-deps --target), puts the repo
# and that folder on PYTHONPATH and runs tools/gpu/gpu_check.py's steps inside GPU_CHECK_BUDGET_S
# (each step capped and killed whole on expiry; the whole run stays under 8 minutes). The figures
# block comes last; with OUT set, $OUT/gpu_check.json and $OUT/gpu_check.log too.
# GPU_CHECK_CPU_REHEARSAL=1 runs the same steps on a CPU host (the CUDA shim, gloo): a rehearsal
# of this script, not a GPU result. GPU_CHECK_STAGING_GIB (default 1,4): the staging sizes.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
ROOT=$(pwd)
BUDGET=${GPU_CHECK_BUDGET_S:-390}
SITE=${GPU_CHECK_SITE:-/tmp/ucp_gpu_site}
STAGING_GIB=${GPU_CHECK_STAGING_GIB:-1,4}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

mode=run
case "${1:-}" in
  --dry-run) mode=dry ;;
  "") ;;
  *) echo "usage: bash tools/gpu/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac

# GPU_CHECK_PYTHON as given, else the first Python that imports torch (the GPU image's python3 is
# the one that holds PyTorch)
PY=${GPU_CHECK_PYTHON:-}
if [ -z "$PY" ]; then
  for cand in python3 /opt/torch/.venv/bin/python3; do
    command -v "$cand" >/dev/null 2>&1 || continue
    if timeout 60 "$cand" -c "import torch" >/dev/null 2>&1; then PY=$cand; break; fi
  done
fi
if [ -z "$PY" ]; then echo "gpu_check: no Python with torch found (set GPU_CHECK_PYTHON)" >&2; exit 1; fi
PYVER=$(timeout 30 "$PY" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
echo "gpu_check: Python $PYVER ($(command -v "$PY"))"

if [ "$mode" = dry ]; then
  rc=0
  bash -n "${BASH_SOURCE[0]}" && echo "gpu_check: bash -n ok" || rc=1
  timeout 60 "$PY" -c 'import sys; [compile(open(f).read(), f, "exec") for f in sys.argv[1:]]' \
    tools/gpu/wheels.py tools/gpu/gpu_check.py && echo "gpu_check: python compile ok" || rc=1
  timeout 120 "$PY" tools/gpu/wheels.py check || rc=1
  site_args=()
  if [ -d .whl ]; then  # the run's own install, into a throwaway folder
    tmp_site=$(mktemp -d /tmp/ucp_gpu_dry_site.XXXXXX)
    trap 'rm -rf "$tmp_site"' EXIT
    timeout 120 "$PY" tools/gpu/wheels.py install --target "$tmp_site"
    case $? in
      0) site_args=(--expect-site "$tmp_site") ;;
      3) ;;  # the folder was filled for other Pythons (make gpu-wheels GPU_PYTHONS=...)
      *) rc=1 ;;
    esac
    export PYTHONPATH="$ROOT:$tmp_site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "gpu_check: .whl/ absent: the imports below resolve from this Python's own packages"
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  fi
  timeout 180 "$PY" tools/gpu/gpu_check.py --dry-run "${site_args[@]}" || rc=1
  echo "gpu_check: dry run $([ $rc = 0 ] && echo ok || echo FAILED)"
  exit $rc
fi

[ -d .whl ] || echo "gpu_check: .whl/ absent (was it carried?); only what the image has will do"
rm -rf "$SITE"
if ! timeout 60 "$PY" tools/gpu/wheels.py install --target "$SITE"; then
  echo "gpu_check: the offline wheel install failed or timed out" >&2
  exit 1
fi
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
rehearsal=()
[ "${GPU_CHECK_CPU_REHEARSAL:-0}" = 1 ] && rehearsal=(--cpu-rehearsal)
# -k: a step that ignores the TERM is killed 20 s later; gpu_check.py keeps to BUDGET - 20 itself
timeout -k 20 "$BUDGET" "$PY" tools/gpu/gpu_check.py --budget $((BUDGET - 20)) \
  --staging-gib "$STAGING_GIB" "${rehearsal[@]}"
rc=$?
[ $rc = 124 ] && echo "gpu_check: stopped at its ${BUDGET} s budget" >&2
exit $rc
