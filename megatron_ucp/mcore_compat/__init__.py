"""Every difference between the megatron-core releases megatron-ucp supports, and every call of a
private megatron-core name, in one package.

The supported releases are listed, as data, in `configs/mcore_releases.json` (the Makefile,
tests/conftest.py and the README table read it). The rest of the library imports megatron-core's
names from here when a release renamed, moved or removed them, asks the predicates below instead of
comparing versions, and calls megatron-core's private functions and methods only through here;
tests/test_mcore_release.py fails on a release comparison or a private megatron-core name anywhere
else in the library.

One module per concern:

* `release`: the installed release (`MCORE_VERSION`, `release_name`) and `optional` names.
* `config`: TransformerConfig fields 0.19 deprecated, Megatron-LM 0.19's weight-shard args, MLA's
  Q/KV norms (0.19's `QKNormConfigResolver`).
* `moe`: the legacy GroupedMLP and its grouped_gemm handle (removed in 0.19).
* `mamba`: hybrid models: the layer pattern's names, 0.16's Triton import, the Mamba conv1d forms
  and parameter orders (0.19 made conv1d two parameters of the mixer).
* `pickling`: enums a newer release added (a 0.19 checkpoint read under 0.16).
* `dist_ckpt`: what each release writes in a torch_dist checkpoint.
* `optimizer`: DistributedOptimizer's private shard accessors, `_get_param_groups`.
* `schedules`: the recompute RNG and p2p internals of the Lynx runtime, selective recompute limits.
* `training`: Megatron-LM's hook signatures and module layout per release.

Checked and found the same on both releases (Megatron-LM core_v0.16.1 and core_v0.19.0 fixtures):
the `--ckpt-format torch` files (`model_optim_rng.pt` param groups, `distrib_optim.pt` flat
buffers), so the torch-format writer has one form for both. What 0.19 does differently there is on
load: `DistributedOptimizer.load_state_dict` pairs saved and current param groups by
`megatron.core.optimizer.optimizer.param_group_identifier_keys` (0.19 adds max_lr, min_lr,
start_wd, end_wd, optimizer to 0.16's wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr), so a
resume must use the saving run's --lr / --min-lr (the writer keeps the source's values).

The names below stay importable from the package itself (`mcore_compat.X`); each is loaded from
its module on first use, so that importing one module (e.g. `schedules` for the planner) does not
import megatron-core.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module of this package that defines it
_NAMES = {
    "MCORE_VERSION": "release", "release_name": "release", "release_series": "release",
    "parse_version": "release", "optional": "release",
    "DEPRECATED_CONFIG_FIELDS": "config", "config_kwargs_from_args": "config",
    "rederive_weight_shards": "config", "MLA_QK_NORM_CONFIG": "config",
    "local_mla_qk_norm_without_q_lora": "config",
    "GroupedMLP": "moe", "GROUPED_GEMM_UTIL": "moe", "is_legacy_grouped_mlp": "moe",
    "has_legacy_grouped_mlp": "moe", "missing_module_hint": "moe",
    "absent_enum_standin": "pickling", "has_core_v019_enums": "pickling",
    "hybrid_layer_pattern": "mamba", "args_hybrid_pattern": "mamba", "mamba_modules": "mamba",
    "mamba_conv1d_is_module": "mamba", "saved_parameter_order": "mamba",
    "saved_mamba_conv1d_form": "mamba", "mamba_state_key": "mamba",
    "megatron_param_groups": "optimizer", "gdn_modules": "gdn",
}
_MODULES = ("release", "config", "moe", "mamba", "pickling", "dist_ckpt", "optimizer", "schedules",
            "training", "gdn")

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        value = getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    elif name in _MODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_NAMES, *_MODULES})
