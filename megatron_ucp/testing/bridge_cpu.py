"""Run Megatron-Bridge 0.6.2's own training loop and checkpointing on a CPU-only host.

Import `install()` before any megatron.bridge import (after nothing else of megatron). What each
piece stands in for (none touches Bridge's checkpoint, model or optimizer code):

* megatron-ucp's CUDA shim (`cpu_shim`): torch.cuda plumbing -> CPU, as for Megatron-LM.
* Transformer Engine: `megatron/bridge/peft/lora_layers.py` imports `transformer_engine.pytorch`
  unconditionally (0.6.2, line 20). A placeholder is returned to that one module's import (never put
  in sys.modules), so megatron-core's and Bridge's own TE detection still find no TE.
* NVIDIA Resiliency Extension: `training/pretrain.py` imports `nvidia_resiliency_ext.inprocess` for a
  type hint; the index's newest NVRx (0.4.1) breaks megatron-core 0.19's version check (no
  `__version__`), so it is not installed and a placeholder is served to that one import.
* megatron-core 0.19.2's torch-Adam path of a DistributedOptimizer load (`mcore_compat.optimizer.
  torch_adam_resume_fixes`).
* the dataset helper's build step (`compile_helpers`, run by Bridge's initialize): megatron-core's
  wheel ships the helper prebuilt but not its Makefile; the prebuilt one is imported instead.
* Bridge's PEFT TE detection: `peft/utils.py:86` and `peft/module_matcher.py:40` set `HAVE_TE` when
  megatron-core's `extensions.transformer_engine` exports `TEColumnParallelLinear` etc., which it does
  without TE too, as MagicMock placeholders; LoRA's `get_adapter_attributes_from_linear` then fails
  (`peft/utils.py:591`: `TypeError: isinstance() arg 2 must be a type`). Set False, as it is.
* `local_gpt_provider(provider)`: Bridge's GPTModelProvider defaults to TE's layer spec
  (gpt_provider.py) and its bridges switch on fusions that need TE or CUDA (`apply_rope_fusion`,
  `persist_layer_norm`, `bias_activation_fusion`, `masked_softmax_fusion`, `bias_dropout_fusion`,
  `gradient_accumulation_fusion`, `moe_permute_fusion`): Bridge's own `local_layer_spec`, fusions off.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.util
import types

FUSIONS_OFF = ("apply_rope_fusion", "persist_layer_norm", "bias_activation_fusion", "masked_softmax_fusion",
               "bias_dropout_fusion", "gradient_accumulation_fusion", "moe_permute_fusion",
               "cross_entropy_loss_fusion")


def install() -> None:
    import megatron_ucp.testing.cpu_shim  # noqa: F401  (before megatron imports)

    served = {package: (module, make) for package, module, make in PLACEHOLDERS
              if importlib.util.find_spec(package) is None}  # a real package: nothing to stand in for
    real_import = builtins.__import__

    def serve_placeholder(name, globals=None, locals=None, fromlist=(), level=0):
        package = name.partition(".")[0]
        if package in served and (globals or {}).get("__name__") == served[package][0]:
            top = served[package][1]()
            if not fromlist:  # `import a.b [as c]` takes the top package
                return top
            for part in name.split(".")[1:]:  # `from a.b import c` takes a.b
                top = getattr(top, part)
            return top
        return real_import(name, globals, locals, fromlist, level)

    builtins.__import__ = serve_placeholder
    try:
        for module, _ in served.values():
            importlib.import_module(module)
    finally:
        builtins.__import__ = real_import
    from megatron_ucp.mcore_compat.optimizer import torch_adam_resume_fixes

    torch_adam_resume_fixes()
    # megatron-core's wheel ships the dataset helper prebuilt but not its Makefile
    importlib.import_module("megatron.core.datasets.helpers_cpp")
    importlib.import_module("megatron.bridge.training.initialize").compile_helpers = lambda: None
    if importlib.util.find_spec("transformer_engine") is None:  # (megatron-core's MagicMock TE layers)
        for module in ("megatron.bridge.peft.utils", "megatron.bridge.peft.module_matcher"):
            importlib.import_module(module).HAVE_TE = False


def _placeholder_te() -> types.ModuleType:
    """What lora_layers takes from `transformer_engine.pytorch`: layer classes nothing is an instance
    of (its isinstance checks are then False, as for megatron-core's local layers) and `ops`."""
    te = types.ModuleType("transformer_engine")
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    for cls in ("Linear", "LayerNormLinear", "GroupedLinear"):
        setattr(te.pytorch, cls, type(cls, (), {"__module__": __name__}))
    te.pytorch.ops = types.SimpleNamespace(Sequential=type("Sequential", (), {"__module__": __name__}))
    return te


def _placeholder_nvrx() -> types.ModuleType:
    """What pretrain.py takes from `nvidia_resiliency_ext.inprocess`: the `CallWrapper` type of an
    argument that stays None (in-process restart is off)."""
    nvrx = types.ModuleType("nvidia_resiliency_ext")
    nvrx.inprocess = types.ModuleType("nvidia_resiliency_ext.inprocess")
    nvrx.inprocess.CallWrapper = type("CallWrapper", (), {"__module__": __name__})
    return nvrx


# (package, the one Bridge module it is served to, the placeholder): Bridge 0.6.2 imports these
# unconditionally; megatron-core's and Bridge's own guarded imports still find neither
PLACEHOLDERS = (("transformer_engine", "megatron.bridge.peft.lora_layers", _placeholder_te),
                ("nvidia_resiliency_ext", "megatron.bridge.training.pretrain", _placeholder_nvrx))


def local_gpt_provider(provider):
    """`provider` (a Bridge GPTModelProvider) building megatron-core's local layers through Bridge's
    own `local_layer_spec` (recorded as such in run_config.yaml), the fusions off."""
    from megatron.bridge.models.gpt_provider import local_layer_spec

    for name in FUSIONS_OFF:
        if hasattr(provider, name):
            setattr(provider, name, False)
    provider.transformer_layer_spec = local_layer_spec
    provider.transformer_impl = "local"
    return provider
