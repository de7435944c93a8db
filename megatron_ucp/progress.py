"""Progress of long offline work, without a terminal dependency in the library.

`progress` arguments take False (silent), True (an INFO log line at every tenth of the work) or a
factory called as `factory(total=..., desc=..., unit=...)` that returns an object with
`update(n)` and `close()`: the CLI and tools pass `tqdm.tqdm`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("megatron_ucp")


class Bar(Protocol):
    def update(self, n: int = 1) -> object: ...
    def close(self) -> object: ...


Progress = bool | Callable[..., Bar] | None


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class _Logged:
    def __init__(self, total: int, desc: str, unit: str):
        self.total, self.desc, self.unit, self.done, self.next = total, desc, unit, 0, 0

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.done >= self.next:
            log.info("%s: %d/%d %s", self.desc, self.done, self.total, self.unit)
            self.next = self.done + max(1, self.total // 10)

    def close(self) -> None:
        pass


def bar(progress: Progress, total: int, desc: str, unit: str) -> Bar:
    if not progress:
        return _Silent()
    if progress is True:
        return _Logged(total, desc, unit)
    return progress(total=total, desc=desc, unit=unit)
