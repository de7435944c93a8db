"""megatron-ucp: universal checkpointing for megatron-core (save distributed, load at any layout).

Attributes are imported lazily so that `import megatron_ucp.testing.cpu_shim` can run before
megatron.core is first imported, and so the CLI starts without importing torch for `--help`.
"""

import importlib

__version__ = "0.1.0"
_EXPORTS = {
    "save": "megatron_ucp.saver",
    "finalize": "megatron_ucp.saver",
    "load": "megatron_ucp.loader",
    "LoadResult": "megatron_ucp.loader",
    "convert": "megatron_ucp.conversion",
    "reshard": "megatron_ucp.conversion",
    "import_hf": "megatron_ucp.conversion",
    "import_deepspeed": "megatron_ucp.conversion",
    "export_hf": "megatron_ucp.conversion",
    "export_hf_weights": "megatron_ucp.hf_stream",
    "check_layout": "megatron_ucp.validation",
    "inspect": "megatron_ucp.inspector",
    "Layout": "megatron_ucp.layout",
    "UCPError": "megatron_ucp.errors",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'megatron_ucp' has no attribute {name!r}")
