"""Measurement helpers with no torch dependency: peak memory, page cache, bytes on disk, I/O counters.

Peak memory (`PeakMemory`):
- `rss_peak` is the kernel's exact high-water mark of this process's resident set (VmHWM from
  /proc/self/status), reset to the current RSS on entry by writing "5" to /proc/self/clear_refs
  (Linux >= 4.0, allowed for a process on itself). Where that is not possible it falls back to
  sampling RSS in a thread and says so (`exact: false`). RSS includes file pages mapped into the
  process (safetensors and torch_dist readers mmap checkpoint files), which are page cache the
  kernel can drop, so `anon_peak` also tracks anonymous memory (RssAnon: heap, tensors), sampled.
- `children_uss_peak` is the largest sum, over one sample, of the unique set size (memory no other
  process shares) of this process's descendants, sampled every `sample_s` seconds, and
  `children_uss_before` the same sum for the children alive at entry. megatron-core's torch_dist
  writer forks worker processes per save to write files, and on its first save spawns a
  multiprocessing Manager process that stays alive; their private memory is not in the parent's
  RSS, and forked workers' copy-on-write pages shared with the parent are already counted there,
  so USS is the honest amount to add. Sampling can miss short spikes.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil


def _status(field: str) -> int | None:
    """A memory field of /proc/self/status (VmHWM, RssAnon, ...) in bytes; None if unavailable."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _vm_hwm() -> int | None:
    return _status("VmHWM")


def _reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _vm_hwm() is not None


class PeakMemory:
    """Context manager recording peak memory during a block; read `.result` after it."""

    def __init__(self, sample_s: float = 0.02) -> None:
        self.sample_s = sample_s
        self.proc = psutil.Process()
        self.result: dict = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._children_peak = 0
        self._self_peak = 0

    def _children_uss(self) -> int:
        total = 0
        for child in self.proc.children(recursive=True):
            try:
                total += child.memory_full_info().uss
            except psutil.Error:  # the child exited between listing and reading
                pass
        return total

    def _sample(self) -> None:
        self._children_peak = max(self._children_peak, self._children_uss())
        self._anon_peak = max(self._anon_peak, _status("RssAnon") or 0)
        if not self._exact:
            self._self_peak = max(self._self_peak, self.proc.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.wait(self.sample_s):
            self._sample()

    def __enter__(self) -> PeakMemory:
        self._exact = _reset_hwm()
        self._before = self.proc.memory_info().rss
        self._self_peak = self._before
        self._anon_before = self._anon_peak = _status("RssAnon") or 0
        self._children_before = self._children_uss() if self.sample_s > 0 else 0
        self._children_peak = self._children_before
        if self.sample_s > 0:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        after = self.proc.memory_info().rss
        self._anon_peak = max(self._anon_peak, _status("RssAnon") or 0)
        peak = _vm_hwm() if self._exact else max(self._self_peak, after)
        self.result = {"rss_before": self._before, "rss_peak": peak, "rss_after": after,
                       "rss_peak_delta": peak - self._before,
                       "anon_before": self._anon_before, "anon_peak": self._anon_peak,
                       "anon_peak_delta": self._anon_peak - self._anon_before,
                       "children_uss_before": self._children_before,
                       "children_uss_peak": self._children_peak, "exact": self._exact}


def files_under(path: str | Path) -> Iterator[Path]:
    for root, _, names in os.walk(path):
        for name in names:
            yield Path(root) / name


def dir_bytes(path: str | Path) -> int:
    """Bytes of all regular files under `path` (apparent size)."""
    return sum(p.stat().st_size for p in files_under(path))


def copy_tree_fsync(src: str | Path, dst: str | Path) -> int:
    """The copy anchor: `shutil.copytree(src, dst)`, then fsync of every copied file (the bytes on
    disk, as a checkpoint writer leaves them); the bytes copied."""
    shutil.copytree(src, dst)
    n = 0
    for p in sorted(Path(dst).rglob("*")):
        if p.is_file():
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
            n += p.stat().st_size
    return n


def drop_page_cache(path: str | Path) -> None:
    """Evict the files under `path` from the page cache (POSIX_FADV_DONTNEED; no root needed).

    The files must be clean (both savers fsync), otherwise dirty pages stay cached. On a VM the host
    may still cache them, so a "cold" read can be faster than the physical disk.
    """
    for p in files_under(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def proc_io() -> dict[str, int]:
    """This process's /proc/self/io counters (read_bytes: bytes fetched from storage; {} if absent)."""
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        return {}
    return {k: int(v) for k, v in (line.split(": ") for line in text.splitlines() if line)}
