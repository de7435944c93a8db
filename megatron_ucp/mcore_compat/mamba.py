"""Hybrid (Mamba) models: what differs between releases.

* The layer pattern: 0.16's MambaModel keeps it as `hybrid_override_pattern`; 0.19's HybridModel
  (MambaModel is a deprecated subclass) as `hybrid_layer_pattern`, taking the old name as a
  deprecated argument (the attribute is then None): `hybrid_layer_pattern`. Megatron-LM's args name
  it `--hybrid-override-pattern` (0.16) or `--hybrid-layer-pattern` (0.19): `args_hybrid_pattern`.
* Without Triton (torch's CPU build), 0.16's `megatron.core.ssm.mamba_mixer` cannot be imported at
  all: it imports dynamic inference's Triton kernels at module level (0.19 does not):
  `mamba_modules` registers a stand-in for that module first.
* The Mamba mixer's conv1d is an `nn.Conv1d` submodule up to 0.18 and two parameters of the mixer
  (`conv1d_weight`, `conv1d_bias`) from 0.19. A module yields its own parameters before its
  submodules', so the mixers register their parameters in another order (0.18: dt_bias, A_log, D,
  in_proj, conv1d, norm, out_proj; 0.19: conv1d, dt_bias, A_log, D, in_proj, norm, out_proj), and
  DDP's flat buffers, which follow that order, differ: a dp_reshardable save of one release is
  sliced in its order under the other (`mamba_conv1d_is_module`, `saved_parameter_order`). The
  `--ckpt-format torch` state dicts name them `mixer.conv1d.weight` / `mixer.conv1d_weight` too:
  `saved_mamba_conv1d_form` tells the form from the saved names, `mamba_state_key` renames them.
  0.19's torch_dist saves have no `common.pt`: `conv1d_module_from_files`.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import types
from typing import Any

# Megatron-LM's args holding a hybrid model's layer pattern: 0.16's name, then 0.19's
ARGS_PATTERN_NAMES = ("hybrid_override_pattern", "hybrid_layer_pattern")


def hybrid_layer_pattern(model) -> str | None:
    """A hybrid model's layer pattern (`M*-E`: Mamba, attention, MLP, MoE), None for other models."""
    return getattr(model, "hybrid_layer_pattern", None) or getattr(model, "hybrid_override_pattern", None)


def args_hybrid_pattern(args) -> str | None:
    """A hybrid model's layer pattern in Megatron-LM args (0.19: `--hybrid-layer-pattern`; before:
    `--hybrid-override-pattern`), None for a GPT model."""
    for name in ARGS_PATTERN_NAMES:
        if getattr(args, name, None):
            return getattr(args, name)
    return None


def set_args_hybrid_pattern(args, pattern: str) -> None:
    """Replace the layer pattern in whichever of the release's args holds it."""
    for name in ARGS_PATTERN_NAMES:
        if getattr(args, name, None):
            setattr(args, name, pattern)


def set_hybrid_pattern_for_pp(args, pp: int) -> None:
    """Megatron-LM 0.19 cuts a hybrid pattern's pipeline stages at its `|`s (their count must be
    the PP size, or a multiple of it for virtual stages); a pattern without them is split by
    megatron-core itself at any PP. The same model at another PP than the pattern's stages: the
    pattern without its `|`s (set in place, in whichever of the release's args holds it)."""
    pattern = args_hybrid_pattern(args)
    if not pattern or "|" not in pattern.split("/")[0] or pattern.split("/")[0].count("|") + 1 == pp:
        return
    main, *mtp = pattern.split("/")
    set_args_hybrid_pattern(args, "/".join([main.replace("|", ""), *mtp]))


def build_hybrid_model(pattern: str, **kwargs):
    """megatron-core's hybrid model (MambaModel; 0.19: HybridModel's deprecated subclass, which still
    takes the pattern as `hybrid_override_pattern`) with `kwargs` as the constructor's."""
    from megatron.core.models.mamba import MambaModel

    return MambaModel(hybrid_override_pattern=pattern, **kwargs)


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
    if importlib.util.find_spec("triton") is None and _MAMBA_INFERENCE_KERNELS not in sys.modules:
        ops = types.ModuleType(_MAMBA_INFERENCE_KERNELS, "stand-in: see megatron_ucp.mcore_compat.mamba")
        for name in ("tensor_get_slice_after", "tensor_masked_update", "tensor_merge"):
            setattr(ops, name, _inference_kernel(name))
        sys.modules[_MAMBA_INFERENCE_KERNELS] = ops
    from megatron.core.ssm import mamba_block, mamba_mixer

    return mamba_mixer, mamba_block


def mamba_stack_module():
    """The module that defines MambaStack (0.19 moved it to models/hybrid/hybrid_block), whose
    `TENorm` is the stack's final norm."""
    _, mamba_block = mamba_modules()
    return sys.modules[mamba_block.MambaStack.__module__]


@functools.cache  # (asked for every saved key of a hybrid model)
def mamba_conv1d_is_module() -> bool:
    """Whether this release's Mamba mixer holds conv1d as an nn.Conv1d submodule (<= 0.18), not as
    its own two parameters `conv1d_weight` / `conv1d_bias` (0.19; see the module docstring)."""
    mamba_mixer, _ = mamba_modules()
    return "conv1d_weight" not in mamba_mixer.MambaMixer.__init__.__code__.co_names


def conv1d_module_from_files(has_common_file: bool) -> bool:
    """The Mamba conv1d form of the release that wrote a torch_dist checkpoint without megatron-ucp's
    note, from its files: megatron-core <= 0.18 keeps `common.pt` and a conv1d submodule, 0.19
    neither."""
    return has_common_file


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
