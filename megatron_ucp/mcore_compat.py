"""Every difference between the megatron-core releases megatron-ucp supports, in one place.

Supported: megatron-core 0.16.x (Python >= 3.10) and 0.19.x (Python >= 3.12); 0.17/0.18 import
the same names. The rest of the package imports megatron-core's names from here when a release
renamed, moved or removed them, and asks the predicates below instead of comparing versions.

What differs, and where it is handled:

* GroupedMLP (the legacy fused-expert MLP that calls the `grouped_gemm` library, with its handle
  `megatron.core.transformer.moe.grouped_gemm_util`) was removed in 0.19: `--moe-grouped-gemm`
  without Transformer Engine builds SequentialMLP there. `GroupedMLP` / `GROUPED_GEMM_UTIL` are
  None on such a release, and `is_legacy_grouped_mlp` is then always False.
* TransformerConfig fields that 0.19 deprecated and refuses in combinations that Megatron-LM
  0.16's arguments wrote by default (`moe_deepep_num_sms=20` with `moe_hybridep_num_sms=16`):
  `config_kwargs_from_args` leaves them out when rebuilding a model from another run's args.
* Hybrid (Mamba) models: 0.16's MambaModel keeps its layer pattern as `hybrid_override_pattern`;
  0.19's HybridModel (MambaModel is a deprecated subclass) as `hybrid_layer_pattern`, taking the
  old name as a deprecated argument (the attribute is then None): `hybrid_layer_pattern`.
  Without Triton (torch's CPU build), 0.16's `megatron.core.ssm.mamba_mixer` cannot be imported at
  all: it imports dynamic inference's Triton kernels at module level (0.19 does not):
  `mamba_modules` registers a stand-in for that module first.
  The Mamba mixer's conv1d is an `nn.Conv1d` submodule up to 0.18 and two parameters of the mixer
  (`conv1d_weight`, `conv1d_bias`) from 0.19. A module yields its own parameters before its
  submodules', so the mixers register their parameters in another order (0.18: dt_bias, A_log, D,
  in_proj, conv1d, norm, out_proj; 0.19: conv1d, dt_bias, A_log, D, in_proj, norm, out_proj), and
  DDP's flat buffers, which follow that order, differ: a dp_reshardable save of one release is
  sliced in its order under the other (`mamba_conv1d_is_module`, `saved_parameter_order`). The
  `--ckpt-format torch` state dicts name them `mixer.conv1d.weight` / `mixer.conv1d_weight` too:
  `saved_mamba_conv1d_form` tells the form from the saved names, `mamba_state_key` renames them.
* MLA's Q/KV norms: 0.19 resolves them in `QKNormConfigResolver`, which wants a Q norm fused into
  `linear_q_proj` when there is no query LoRA rank (only Transformer Engine has that layer); 0.16
  builds no Q norm there: `local_mla_qk_norm_without_q_lora`.
* Enums a newer release added: Megatron-LM 0.19's `args` pickle
  `megatron.core.transformer.enums.InferenceCudaGraphScope`, which 0.16 lacks, so a 0.19
  checkpoint would not unpickle under 0.16. `absent_enum_standin` stands in for such a class while
  a checkpoint is read: the member becomes its plain value (only the newer release reads that
  argument), so a 0.19 checkpoint converts under 0.16 for Megatron-LM 0.16 to resume.

Checked and found the same on both releases (Megatron-LM core_v0.16.1 and core_v0.19.0 fixtures):
the `--ckpt-format torch` files (`model_optim_rng.pt` param groups, `distrib_optim.pt` flat
buffers), so the torch-format writer has one form for both. What 0.19 does differently there is on
load: `DistributedOptimizer.load_state_dict` pairs saved and current param groups by
`megatron.core.optimizer.optimizer.param_group_identifier_keys` (0.19 adds max_lr, min_lr,
start_wd, end_wd, optimizer to 0.16's wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr), so a
resume must use the saving run's --lr / --min-lr (the writer keeps the source's values). 0.19's
torch_dist saves keep the common state in the .distcp files instead of `common.pt`: an on-disk
difference, handled where the format is read (formats/megatron_dist).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import megatron.core


def _version(text: str) -> tuple[int, int, int]:
    parts = []
    for word in text.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in word if c.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


MCORE_VERSION: tuple[int, int, int] = _version(megatron.core.__version__)


def _optional(module: str, name: str | None = None):
    """`module` (or its attribute `name`) when this release has it, else None."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None
    return mod if name is None else getattr(mod, name, None)


# the legacy fused-expert MLP and its grouped_gemm handle (0.16-0.18; removed in 0.19)
GroupedMLP = _optional("megatron.core.transformer.moe.experts", "GroupedMLP")
GROUPED_GEMM_UTIL = _optional("megatron.core.transformer.moe.grouped_gemm_util")


def is_legacy_grouped_mlp(module) -> bool:
    """Whether `module` is the legacy GroupedMLP (one fused weight1/weight2 for all local experts)."""
    return GroupedMLP is not None and isinstance(module, GroupedMLP)


def has_legacy_grouped_mlp() -> bool:
    """Whether this release can build GroupedMLP (`--moe-grouped-gemm` without Transformer Engine)."""
    return GroupedMLP is not None


# 0.19 resolves MLA's Q/KV norms in QKNormConfigResolver: without a query LoRA rank a Q norm must
# be fused into linear_q_proj (a norm on the hidden states that 0.16 does not have), and only
# Transformer Engine provides that fused layer, so the local spec cannot build such a model with
# qk_layernorm; 0.16 builds it without any Q norm.
MLA_QK_NORM_CONFIG = _optional("megatron.core.transformer.mla_qk_norm_config")


def local_mla_qk_norm_without_q_lora() -> bool:
    """Whether the local spec builds MLA with qk_layernorm and no q_lora_rank (0.16: kv norm only)."""
    return MLA_QK_NORM_CONFIG is None


@functools.cache  # one stand-in per name: the unpickler matches it by identity
def absent_enum_standin(qualified_name: str) -> Callable[[Any], Any] | None:
    """For the unpickler: a stand-in for `qualified_name` when it names a megatron-core global
    that this release lacks (an enum a newer release added), else None. A pickled enum member is
    the call `EnumClass(value)`; the stand-in returns the value itself."""
    module, _, name = qualified_name.rpartition(".")
    if not module.startswith("megatron.core.") or not name.isidentifier():
        return None
    if _optional(module, name) is not None:
        return None  # this release has it: the allowlist decides

    def enum_member_value(value: Any) -> Any:
        if not isinstance(value, (int, str, float, bool, type(None))):
            raise TypeError(f"{qualified_name} is not in {release_name()} and was not pickled as an "
                            f"enum member (called with {type(value).__name__})")
        return value

    enum_member_value.__qualname__ = f"absent_enum_standin[{qualified_name}]"
    return enum_member_value


def release_name() -> str:
    return f"megatron-core {megatron.core.__version__}"


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


# Fields a newer TransformerConfig accepts only for backward compatibility (it routes them to their
# successor and refuses some combinations of them). They steer runtime kernels and CUDA graphs,
# never parameter names, shapes or splits; a rebuild from an older release's args leaves them out.
_DEPRECATED_CONFIG_FIELDS = {
    (0, 19): ("moe_deepep_num_sms", "moe_hybridep_num_sms", "enable_cuda_graph",
              "external_cuda_graph", "cuda_graph_scope", "moe_enable_deepep",
              "moe_router_topk_limited_devices"),
}
DEPRECATED_CONFIG_FIELDS = frozenset(
    name for since, names in _DEPRECATED_CONFIG_FIELDS.items() if MCORE_VERSION[:2] >= since
    for name in names)


# Megatron-LM 0.19's args record how many shards TP (times GTP) cuts each weight into, resolved from
# the TP sizes at start-up; TransformerConfig refuses fewer shards than TP. A copy of a run's args at
# another TP (a rebuild at TP1, a conversion target) carries them re-derived, GTP's factor kept.
_WEIGHT_SHARD_ARGS = (
    ("tensor_parallel_num_weight_shards", "tensor_model_parallel_size", "gtp_weight_remat_size"),
    ("expert_tensor_parallel_num_weight_shards", "expert_tensor_parallel_size",
     "expert_gtp_weight_remat_size"),
)


def rederive_weight_shards(args) -> None:
    """Set the weight-shard counts of Megatron-LM `args` (0.19; absent before) from its TP sizes."""
    for shards, tp, remat in _WEIGHT_SHARD_ARGS:
        if getattr(args, shards, None) is not None and getattr(args, tp, None):
            setattr(args, shards, getattr(args, tp) * (getattr(args, remat, None) or 1))


def config_kwargs_from_args(kw: dict) -> dict:
    """TransformerConfig keyword arguments taken from a Megatron-LM run's `args` (which may come
    from another release), without the fields this release keeps only as deprecated aliases."""
    return {k: v for k, v in kw.items() if k not in DEPRECATED_CONFIG_FIELDS}


def hybrid_layer_pattern(model) -> str | None:
    """A hybrid model's layer pattern (`M*-E`: Mamba, attention, MLP, MoE), None for other models."""
    return getattr(model, "hybrid_layer_pattern", None) or getattr(model, "hybrid_override_pattern", None)


# megatron-core 0.16's mamba_mixer imports these Triton kernels of dynamic (batched) inference at
# module level; without Triton that import fails, and with it the whole Mamba mixer
_MAMBA_INFERENCE_KERNELS = "megatron.core.inference.contexts.attention_context.triton.tensor_ops"


def _inference_kernel(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"{_MAMBA_INFERENCE_KERNELS}.{name} is a Triton kernel of dynamic "
                                  "inference and Triton is not installed (megatron-ucp registered "
                                  "this stand-in so that megatron-core's Mamba mixer can be imported)")
    return kernel


def mamba_modules():
    """megatron-core's (mamba_mixer, mamba_block) modules, importable also without Triton: where
    Triton is missing, the inference kernels 0.16's mamba_mixer imports are registered first as
    functions that raise (training and a structure-only rebuild never call them)."""
    import importlib.util
    import sys
    import types

    if importlib.util.find_spec("triton") is None and _MAMBA_INFERENCE_KERNELS not in sys.modules:
        ops = types.ModuleType(_MAMBA_INFERENCE_KERNELS, "stand-in: see megatron_ucp.mcore_compat")
        for name in ("tensor_get_slice_after", "tensor_masked_update", "tensor_merge"):
            setattr(ops, name, _inference_kernel(name))
        sys.modules[_MAMBA_INFERENCE_KERNELS] = ops
    from megatron.core.ssm import mamba_block, mamba_mixer

    return mamba_mixer, mamba_block


@functools.cache  # (asked for every saved key of a hybrid model)
def mamba_conv1d_is_module() -> bool:
    """Whether this release's Mamba mixer holds conv1d as an nn.Conv1d submodule (<= 0.18), not as
    its own two parameters `conv1d_weight` / `conv1d_bias` (0.19; see the module docstring)."""
    mamba_mixer, _ = mamba_modules()
    return "conv1d_weight" not in mamba_mixer.MambaMixer.__init__.__code__.co_names


# a Mamba mixer's parameters (local names, either release's) in each form's registration order
_MIXER_ORDER = {
    True: ("dt_bias", "A_log", "D", "in_proj.", "conv1d.weight", "conv1d.bias", "norm.", "out_proj."),
    False: ("conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "in_proj.", "norm.", "out_proj."),
}


def saved_parameter_order(module, conv1d_module: bool) -> list[tuple[str, Any]]:
    """`module.named_parameters()` in the order a release whose Mamba mixers hold conv1d as a
    submodule (`conv1d_module`, <= 0.18) or as two parameters (0.19) registers them: each mixer's
    parameters put in that release's order, everything else where this release has it. Raises
    ValueError where a mixer holds a parameter neither release has."""
    mamba_mixer, _ = mamba_modules()
    order = _MIXER_ORDER[conv1d_module]
    mixers = [name for name, m in module.named_modules() if isinstance(m, mamba_mixer.MambaMixer)]
    named = list(module.named_parameters())
    for mixer in mixers:
        prefix = f"{mixer}." if mixer else ""
        at = [i for i, (n, _) in enumerate(named) if n.startswith(prefix)]

        def rank(name: str, prefix: str = prefix) -> int:
            local = name[len(prefix):].replace("conv1d_", "conv1d.")
            found = [i for i, head in enumerate(order) if local == head or
                     (head.endswith(".") and local.startswith(head))]
            if not found:
                raise ValueError(f"Mamba mixer parameter {name!r} is not one of {order}")
            return found[0]

        mine = sorted((named[i] for i in at), key=lambda np: rank(np[0]))  # stable: in_proj.* etc.
        for i, np in zip(at, mine):
            named[i] = np
    return named


# a Mamba mixer's conv1d in a state dict: (submodule form, parameter form)
_CONV1D_KEYS = ((".mixer.conv1d.weight", ".mixer.conv1d_weight"),
                (".mixer.conv1d.bias", ".mixer.conv1d_bias"))


def saved_mamba_conv1d_form(keys) -> bool | None:
    """From a saved model state dict's keys: True where its Mamba mixers hold conv1d as a submodule
    (`mixer.conv1d.weight`, megatron-core <= 0.18), False as two parameters (`mixer.conv1d_weight`,
    0.19), None without Mamba mixers."""
    for key in keys:
        for module_form, param_form in _CONV1D_KEYS:
            if key.endswith(module_form):
                return True
            if key.endswith(param_form):
                return False
    return None


def mamba_state_key(key: str) -> str:
    """A saved model state-dict key with a Mamba mixer's conv1d named as this release names it."""
    module_form = mamba_conv1d_is_module()
    for as_module, as_param in _CONV1D_KEYS:
        old, new = (as_param, as_module) if module_form else (as_module, as_param)
        if key.endswith(old):
            return key[: -len(old)] + new
    return key


def megatron_param_groups(model_chunks: list, args) -> list[dict]:
    """The optimizer param groups megatron-core builds for `model_chunks` of the run `args`
    describe, in its order ({'params': [...], 'wd_mult': ..., ...}), as Megatron-LM's training
    builds them (OptimizerConfig from the args' fields, the standard overrides: no weight decay
    on biases and 1-D parameters, decoupled LR). The private `_get_param_groups(model_chunks,
    config, config_overrides)` and `get_standard_config_overrides` are the same in 0.16 and 0.19.
    Call inside `megatron_rebuild.source_rank` (it all-gathers the group keys)."""
    import dataclasses

    from megatron.core.optimizer import (
        OptimizerConfig,
        _get_param_groups,
        get_standard_config_overrides,
    )

    names = {f.name for f in dataclasses.fields(OptimizerConfig)}
    config = OptimizerConfig(**{k: v for k, v in vars(args).items() if k in names})
    return _get_param_groups(model_chunks, config, get_standard_config_overrides(config))
