"""The profiler's clocks and its error type: wall seconds after a device synchronize, or a
thread's CPU seconds (`compute_clock`)."""

from __future__ import annotations

import time

import torch


class ProfilerError(ValueError):
    """A model config or setting the profiler cannot use; the message names the field."""


def on_gpu() -> bool:
    """True on a real CUDA device; False on a CPU host with a torch.cuda stand-in installed."""
    if not torch.cuda.is_available():
        raise ProfilerError("no CUDA device and no torch.cuda stand-in: profile on a GPU host, the "
                            "device the run trains on (or plan without a profile: plan-recompute "
                            "uses published figures of --gpu)")
    return torch.empty(0, device="cuda").device.type == "cuda"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # a no-op on the CPU stand-in


def wall() -> float:
    """Wall seconds after the device finished its queued work (links, GPU compute)."""
    sync()
    return time.perf_counter()


def compute_clock(gpu: bool, tp: int = 1):
    """The clock module costs are read with: wall time on a GPU (after a synchronize) or when TP
    collectives run inside the layer (their waits are part of its time); else, on a CPU, the
    thread's CPU time, so the seconds the core spent on other processes (a shared host) are not
    charged to the layer - on an idle core the two are the same for this single-threaded work."""
    return wall if gpu or tp > 1 else time.thread_time
