"""Unpickling another release's checkpoints: enums a newer release added.

Megatron-LM 0.19's `args` pickle `megatron.core.transformer.enums.InferenceCudaGraphScope`, which
0.16 lacks, so a 0.19 checkpoint would not unpickle under 0.16. `absent_enum_standin` stands in for
such a class while a checkpoint is read: the member becomes its plain value (only the newer release
reads that argument), so a 0.19 checkpoint converts under 0.16 for Megatron-LM 0.16 to resume.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from megatron_ucp.mcore_compat.release import optional, release_name

# the enum of Megatron-LM core_v0.19.0's args that 0.16 lacks (None on such a release)
INFERENCE_CUDA_GRAPH_SCOPE = optional("megatron.core.transformer.enums", "InferenceCudaGraphScope")


def has_core_v019_enums() -> bool:
    """Whether this release has the enums Megatron-LM core_v0.19.0's checkpoints pickle (0.19 on)."""
    return INFERENCE_CUDA_GRAPH_SCOPE is not None


@functools.cache  # one stand-in per name: the unpickler matches it by identity
def absent_enum_standin(qualified_name: str) -> Callable[[Any], Any] | None:
    """For the unpickler: a stand-in for `qualified_name` when it names a megatron-core global
    that this release lacks (an enum a newer release added), else None. A pickled enum member is
    the call `EnumClass(value)`; the stand-in returns the value itself."""
    module, _, name = qualified_name.rpartition(".")
    if not module.startswith("megatron.core.") or not name.isidentifier():
        return None
    if optional(module, name) is not None:
        return None  # this release has it: the allowlist decides

    def enum_member_value(value: Any) -> Any:
        if not isinstance(value, (int, str, float, bool, type(None))):
            raise TypeError(f"{qualified_name} is not in {release_name()} and was not pickled as an "
                            f"enum member (called with {type(value).__name__})")
        return value

    enum_member_value.__qualname__ = f"absent_enum_standin[{qualified_name}]"
    return enum_member_value
