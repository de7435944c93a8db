"""Where megatron-core keeps its Gated DeltaNet (Qwen3-Next's linear attention) per release.

0.16 to 0.18: one module, `megatron.core.ssm.gated_delta_net` (its `HAVE_FLA`, its kernel
`chunk_gated_delta_rule`, the class `GatedDeltaNet`). 0.19: a package of that name, whose `common`
holds `HAVE_FLA`, the fla functions and the base class `_GDNBase` (its `reset_parameters`), and
whose `gdn` holds `GatedDeltaNet` and the kernel name it reads. Same parameters (in_proj
[q; k; v; z; beta; alpha], conv1d, dt_bias, A_log, out_norm, out_proj) on both.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def gdn_modules() -> tuple[ModuleType, ModuleType, type]:
    """(the module holding `HAVE_FLA` and the fla functions, the one whose `chunk_gated_delta_rule`
    GatedDeltaNet reads, the class defining `reset_parameters`)."""
    package = importlib.import_module("megatron.core.ssm.gated_delta_net")
    if hasattr(package, "__path__"):  # 0.19: a package
        common = importlib.import_module("megatron.core.ssm.gated_delta_net.common")
        gdn = importlib.import_module("megatron.core.ssm.gated_delta_net.gdn")
        return common, gdn, common._GDNBase
    return package, package, package.GatedDeltaNet
