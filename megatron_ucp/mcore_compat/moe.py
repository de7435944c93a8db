"""Mixture-of-experts: the legacy GroupedMLP (0.16-0.18; removed in 0.19).

GroupedMLP is the legacy fused-expert MLP that calls the `grouped_gemm` library through its handle
`megatron.core.transformer.moe.grouped_gemm_util`. 0.19 removed both: `--moe-grouped-gemm` without
Transformer Engine builds SequentialMLP there. `GroupedMLP` / `GROUPED_GEMM_UTIL` are None on such
a release, and `is_legacy_grouped_mlp` is then always False.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

from megatron_ucp.errors import UCPError
from megatron_ucp.mcore_compat.release import optional, release_name

GroupedMLP = optional("megatron.core.transformer.moe.experts", "GroupedMLP")
GROUPED_GEMM_UTIL = optional("megatron.core.transformer.moe.grouped_gemm_util")


def is_legacy_grouped_mlp(module) -> bool:
    """Whether `module` is the legacy GroupedMLP (one fused weight1/weight2 for all local experts)."""
    return GroupedMLP is not None and isinstance(module, GroupedMLP)


def has_legacy_grouped_mlp() -> bool:
    """Whether this release can build GroupedMLP (`--moe-grouped-gemm` without Transformer Engine)."""
    return GroupedMLP is not None


def missing_module_hint(saved_keys) -> str:
    """Why a checkpoint's saved module names can have no counterpart in a model this release builds
    (empty when no release difference explains it)."""
    fused = sorted(k for k in saved_keys if k.endswith((".experts.weight1", ".experts.weight2")))
    if fused and not has_legacy_grouped_mlp():
        return (f"{fused[0]!r} is the fused expert weight of megatron-core's legacy GroupedMLP "
                f"(--moe-grouped-gemm without Transformer Engine), which {release_name()} no longer "
                "has; convert the checkpoint with megatron-core 0.16-0.18 (`megatron-ucp convert` "
                "or `reshard`) and load the universal checkpoint here, where its experts are "
                "named as SequentialMLP's")
    return ""


@contextlib.contextmanager
def grouped_gemm_importable(needed: bool) -> Iterator[None]:
    """GroupedMLP's constructor asserts that the CUDA `grouped_gemm` library is importable. The
    rebuild builds modules on the meta device and runs no forward, so while it builds, a module
    whose `gmm` refuses to run stands in when the library is absent (only megatron-core's handle
    to it is set, and restored afterwards). A no-op where this release has no GroupedMLP."""
    util = GROUPED_GEMM_UTIL
    if not needed or util is None or util.grouped_gemm is not None:
        yield
        return

    def gmm(*_a, **_k):
        raise UCPError("grouped_gemm is not installed: a model rebuilt by megatron-ucp from "
                       "checkpoint args has no forward")

    stand_in = types.ModuleType("grouped_gemm")
    stand_in.ops = types.SimpleNamespace(gmm=gmm)
    saved = (util.grouped_gemm, util.ops)
    util.grouped_gemm, util.ops = stand_in, stand_in.ops
    try:
        yield
    finally:
        util.grouped_gemm, util.ops = saved
