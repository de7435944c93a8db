"""Package surface: the exported functions stay functions after their modules are imported."""

import importlib

import megatron_ucp


def test_exports_survive_submodule_imports():
    for module in ("megatron_ucp.saver", "megatron_ucp.loader", "megatron_ucp.inspector",
                   "megatron_ucp.conversion", "megatron_ucp.validation"):
        importlib.import_module(module)
    for name in ("save", "load", "convert", "inspect", "check_layout"):
        assert callable(getattr(megatron_ucp, name)), name
        assert not isinstance(getattr(megatron_ucp, name), type(importlib)), name
