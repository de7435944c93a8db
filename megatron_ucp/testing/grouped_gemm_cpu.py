"""A CPU stand-in for the `grouped_gemm` CUDA library that megatron-core's GroupedMLP calls.

GroupedMLP (`--moe-grouped-gemm` without Transformer Engine) imports `grouped_gemm` and refuses to
build without it; the library is CUDA-only. `install()` registers this module under that name
before megatron-core is imported, so the real GroupedMLP (its fused weights, its
sharded_state_dict, its forward) runs on CPU. `gmm` is the reference semantics of
`grouped_gemm.ops.gmm`: rows of `a` are grouped by expert (`batch_sizes` rows each) and each group
is multiplied by that expert's matrix; autograd gives the backward.
"""

from __future__ import annotations

import sys
import types

import torch


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """a: [tokens, k], b: [experts, k, n] (or [experts, n, k] with trans_b) -> [tokens, n]."""
    groups = torch.split(a, [int(n) for n in batch_sizes.tolist()])
    outs = [g @ (b[i].t() if trans_b else b[i]) for i, g in enumerate(groups)]
    return torch.cat(outs) if outs else a.new_empty((0, b.shape[1] if trans_b else b.shape[2]))


def install() -> None:
    """Make `import grouped_gemm` find this module (call before importing megatron.core)."""
    if "grouped_gemm" in sys.modules:
        return
    module = types.ModuleType("grouped_gemm")
    module.ops = types.SimpleNamespace(gmm=gmm)
    module.__doc__ = __doc__
    sys.modules["grouped_gemm"] = module
    util = sys.modules.get("megatron.core.transformer.moe.grouped_gemm_util")
    if util is not None:  # megatron-core already imported: point its module-level handles here
        util.grouped_gemm, util.ops = module, module.ops
