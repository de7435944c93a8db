"""Device <-> host movement of optimizer-state fragments: the only place that touches device bytes.

Checksums and file writes only ever see host tensors (`storage.tensor_bytes` refuses others). On a
GPU, `HostStager.stage` copies a save's fragment tensors into one pinned host buffer, allocated on
the first save and reused (grown when needed) by later ones, with non-blocking copies on the current
stream and a single synchronize. Loads read into the optimizer's own shard tensors: in place on
the host; on a device through one host tensor of one region and state at a time (`loader.load`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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

    The copies are made with one `torch._foreach_copy_` call (batched=False: a loop of `copy_`),
    into views of the buffer that are kept while the tensors' dtypes and shapes stay those of the
    previous save (every save of a run): the part of the stall that grows with the number of
    tensors is then a few Python operations per tensor, not a dozen torch calls.
    """

    def __init__(self, batched: bool = True) -> None:
        self.batched = batched
        self.buffer: torch.Tensor | None = None  # uint8, pinned when a GPU is present
        self.allocations = 0  # how often the buffer had to be (re)allocated
        self._layout: list[tuple[torch.dtype, torch.Size]] = []  # what `_views` were made for
        self._views: list[torch.Tensor] = []

    def _ensure(self, nbytes: int, pin: bool) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() < nbytes or self.buffer.is_pinned() != pin:
            self.buffer = None  # free the old one before allocating the larger one
            self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
            self.allocations += 1
            self._layout = []  # views of the old buffer are stale
        return self.buffer

    def _views_for(self, srcs: list[torch.Tensor], pin: bool) -> list[torch.Tensor]:
        layout = [(t.dtype, t.shape) for t in srcs]
        if self.buffer is not None and self.buffer.is_pinned() == pin and layout == self._layout:
            return self._views
        offsets, total = [], 0
        for dtype, shape in layout:
            offsets.append(total)
            nbytes = shape.numel() * dtype.itemsize
            total += -(-nbytes // ALIGN) * ALIGN
        buf = self._ensure(total, pin)
        self._views = [buf[off:off + shape.numel() * dtype.itemsize].view(dtype).view(shape)
                       for off, (dtype, shape) in zip(offsets, layout)]
        self._layout = layout
        return self._views

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
        srcs = [tensors[i] for i in todo]
        on_device = any(_is_device(t) for t in srcs)
        dsts = self._views_for(srcs, pin=on_device and _pinned_ok())
        with torch.no_grad():  # (no autograd bookkeeping, no per-tensor detach)
            if self.batched:
                torch._foreach_copy_(dsts, srcs, non_blocking=on_device)
            else:
                for d, s in zip(dsts, srcs):
                    d.copy_(s, non_blocking=on_device)
        if on_device:
            torch.cuda.current_stream().synchronize()  # the one wait: every copy is on this stream
        for i, d in zip(todo, dsts):
            out[i] = d
        return out


def fill(dst: torch.Tensor, read: Callable[[torch.Tensor | None], torch.Tensor]) -> None:
    """Fill `dst` (a shard of an optimizer state, on the host or a device) with what `read(out)`
    produces: written by `read` straight into `dst` when it is a contiguous fp32 host tensor; else
    `read(None)` returns a new host tensor, copied to `dst` in one transfer."""
    if not _is_device(dst) and dst.dtype == torch.float32 and dst.is_contiguous():
        read(dst)
    else:
        dst.copy_(read(None))


def steps_to_floats(steps: Sequence[float | int | torch.Tensor]) -> list[float]:
    """Adam step counters as floats with one device->host transfer (no .item() per tensor)."""
    out = [float(s) if not torch.is_tensor(s) else None for s in steps]
    for on_device in (False, True):
        idx = [i for i, s in enumerate(steps) if torch.is_tensor(s) and _is_device(s) == on_device]
        if idx:
            with torch.no_grad():
                values = torch.stack([steps[i].reshape(()).double() for i in idx]).cpu().tolist()
            for i, v in zip(idx, values):
                out[i] = float(v)
    return out  # type: ignore[return-value]



def collective_device() -> torch.device:
    """Where a small tensor for a collective must live: the GPU under NCCL, else the host."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
