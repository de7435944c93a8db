"""Unpickling Megatron-LM's files safely: torch's restricted unpickler with the types a Megatron-LM
checkpoint pickles besides tensors (`allowed_globals`), stand-ins for enums of a newer megatron-core
(`mcore_compat.pickling`), and a refusal naming the type for anything else unless the caller
trusts the file.
"""

from __future__ import annotations

import functools
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatron_ucp.errors import UCPError

TRUST_PICKLE = "--trust-pickle (trust_pickle=True)"


@functools.lru_cache(maxsize=1)  # asked for every unpickled object: build it once
def allowed_globals() -> list:
    """The types a Megatron-LM checkpoint pickles besides tensors and containers: `args`
    (argparse.Namespace holding enums, signal numbers and dtypes) and the numpy RNG state."""
    import argparse
    import enum
    import signal

    import megatron.core.enums as core_enums
    import megatron.core.transformer.enums as transformer_enums
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct
    enums = [v for m in (core_enums, transformer_enums) for v in vars(m).values()
             if isinstance(v, type) and issubclass(v, enum.Enum) and v.__module__ == m.__name__]
    dtypes = [type(np.dtype(t)) for t in ("bool", "uint8", "int8", "uint16", "int16", "uint32",
                                          "int32", "uint64", "int64", "float16", "float32", "float64")]
    # an array pickled under numpy 1.x names numpy.core.multiarray, under 2.x numpy._core.multiarray
    # (Megatron-LM 0.13-0.15 runs often had numpy 1.x): both names load with either numpy
    renamed = [(_reconstruct, f"{m}.multiarray._reconstruct") for m in ("numpy.core", "numpy._core")
               if f"{m}.multiarray" != _reconstruct.__module__]
    return [argparse.Namespace, signal.Signals, _reconstruct, *renamed, np.ndarray, np.dtype, *dtypes,
            *enums]


MEGATRON_HOLDS = ("a Megatron-LM checkpoint holds (tensors, argparse.Namespace, Megatron enums, "
                  "numpy RNG state)")


def unpickle(load: Callable[[bool], Any], where: Path | str, trust_pickle: bool,
             holds: str = MEGATRON_HOLDS) -> Any:
    """`load(weights_only)` with torch's restricted unpickler and `allowed_globals()`: anything
    else is refused, naming the type, unless the caller trusts the file (then plain pickle).
    `holds` says, in the refusal, what the format's files are expected to hold."""
    if trust_pickle:
        return load(False)
    standins: list[tuple[Callable, str]] = []  # enums of a newer megatron-core (mcore_compat)
    while True:
        try:
            with torch.serialization.safe_globals([*allowed_globals(), *standins]):
                return load(True)
        except pickle.UnpicklingError as e:
            found = re.search(r"GLOBAL ([\w.]+)", str(e))
            what = found.group(1) if found else "an object of a type outside the allowlist"
            if found and all(name != what for _, name in standins):
                from megatron_ucp.mcore_compat import absent_enum_standin  # imports megatron.core

                standin = absent_enum_standin(what)
                if standin is not None:
                    standins.append((standin, what))
                    continue
            raise UCPError(f"{where}: refusing to unpickle {what}: it is none of the types {holds}, "
                           "and unpickling it could run code from the file. If you trust this "
                           f"checkpoint, pass {TRUST_PICKLE}") from None
