"""`paused_gc`: cyclic garbage collection paused while megatron-ucp builds or parses metadata
(the fragment index, the manifest)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection while building or parsing metadata: it allocates millions of
    small containers and no cycles, and the collector's passes over them would cost seconds
    (measured 5x on the 4096-rank plan benchmark).

    Re-enabling alone would only defer that cost: every container allocated in the pause sits in
    the youngest generation, and the first collection after it walks them all (0.4 s for a
    4096-rank index). So the survivors are moved to the oldest generation unexamined (`gc.freeze`
    then `gc.unfreeze`), where only the rare full collections see them, as any long-lived data.
    Young garbage cycles from before the pause are collected first (a young collection: cheap),
    so none is held back until the next full collection."""
    enabled = gc.isenabled()
    if enabled:
        gc.collect(1)
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if gc.get_freeze_count() == 0:  # nobody else's frozen objects would be thawed
                gc.freeze()
                gc.unfreeze()
            gc.enable()
