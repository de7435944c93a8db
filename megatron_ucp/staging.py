"""Device <-> host movement of optimizer-state fragments: the only place that touches device bytes.

Checksums and file writes only ever see host tensors (`storage.tensor_bytes` refuses others). On a
GPU, `HostStager.stage` copies a save's fragment tensors into one pinned host buffer, allocated on
the first save and reused (grown when needed) by later ones, with non-blocking copies on the current
stream and a single synchronize. Loads assemble each optimizer shard in host memory and copy it to
the device once per state (`OptimizerIndex.set`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ALIGN = 512  # bytes: every staged tensor starts on a boundary that suits any dtype and DMA


def _is_device(t: torch.Tensor) -> bool:
    return t.device.type != "cpu"


def _pinned_ok() -> bool:
    try:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    except RuntimeError:
        return False


class HostStager:
    """Host copies of a save's tensors, in one reusable (pinned, on a GPU host) buffer.

    batched=True copies with one `torch._foreach_copy_` call instead of a loop of `copy_`; the
    benchmark `bench/bench_staging.py` times both.
    """

    def __init__(self, batched: bool = False) -> None:
        self.batched = batched
        self.buffer: torch.Tensor | None = None  # uint8, pinned when a GPU is present
        self.allocations = 0  # how often the buffer had to be (re)allocated

    def _ensure(self, nbytes: int, pin: bool) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() < nbytes or self.buffer.is_pinned() != pin:
            self.buffer = None  # free the old one before allocating the larger one
            self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
            self.allocations += 1
        return self.buffer

    def stage(self, tensors: Sequence[torch.Tensor], copy: bool = True) -> list[torch.Tensor]:
        """Host tensors with the values of `tensors`, in order.

        copy=False returns host tensors as they are (a synchronous save writes them before training
        resumes); device tensors are always copied. The returned copies alias the stager's buffer:
        they are valid until the next `stage` call.
        """
        todo = [i for i, t in enumerate(tensors) if copy or _is_device(t)]
        out = list(tensors)
        if not todo:
            return out
        offsets, total = [], 0
        for i in todo:
            offsets.append(total)
            total += -(-tensors[i].numel() * tensors[i].element_size() // ALIGN) * ALIGN
        on_device = any(_is_device(tensors[i]) for i in todo)
        buf = self._ensure(total, pin=on_device and _pinned_ok())
        dsts, srcs = [], []
        for i, off in zip(todo, offsets):
            t = tensors[i]
            dst = buf[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            dsts.append(dst)
            srcs.append(t.detach())
            out[i] = dst
        if self.batched:
            torch._foreach_copy_(dsts, srcs, non_blocking=on_device)
        else:
            for d, s in zip(dsts, srcs):
                d.copy_(s, non_blocking=on_device)
        if on_device:
            torch.cuda.current_stream().synchronize()  # the one wait: every copy is on this stream
        return out


def steps_to_floats(steps: Sequence[float | int | torch.Tensor]) -> list[float]:
    """Adam step counters as floats with one device->host transfer (no .item() per tensor)."""
    out = [float(s) if not torch.is_tensor(s) else None for s in steps]
    for on_device in (False, True):
        idx = [i for i, s in enumerate(steps) if torch.is_tensor(s) and _is_device(s) == on_device]
        if idx:
            values = torch.stack([steps[i].detach().reshape(()).double() for i in idx]).cpu().tolist()
            for i, v in zip(idx, values):
                out[i] = float(v)
    return out  # type: ignore[return-value]



def collective_device() -> torch.device:
    """Where a small tensor for a collective must live: the GPU under NCCL, else the host."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
