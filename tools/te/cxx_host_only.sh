#!/usr/bin/env bash
# C++ compiler for the CPU-only build of transformer-engine-torch: its .cpp files are host glue (pybind11
# bindings that launch kernels living in libtransformer_engine.so) and never run a kernel on this
# machine, so they are compiled at -O0 instead of the package's -O3: the build takes less time.
args=()
for a in "$@"; do
  case "$a" in -O2|-O3) args+=(-O0) ;; *) args+=("$a") ;; esac
done
exec "${UCP_REAL_CXX:-c++}" "${args[@]}"
