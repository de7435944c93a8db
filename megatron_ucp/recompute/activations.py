"""Count the bytes autograd keeps for backward: the activation memory of a pipeline stage.

`ActivationCounter` is a `torch.autograd.graph.saved_tensors_hooks` pair. Every tensor autograd
saves passes through `pack`; its storage is counted once (views of one storage share it) until
the last saved reference to it is released (the graph node is freed after its backward). Model
parameters (and views of them) are not activations and are not counted. It works the same on CPU
and CUDA: no device query, no timing, so a test can assert on it exactly.

The counter sees what autograd keeps, including the inputs a checkpoint function saves and the
activations a recomputation re-creates; it does not see temporaries that never enter the graph.
"""

from __future__ import annotations

import torch


class _Saved:
    """What autograd holds instead of the tensor; releasing it un-counts the storage."""

    __slots__ = ("tensor", "key", "counter")

    def __init__(self, tensor: torch.Tensor, key: int | None, counter: ActivationCounter):
        self.tensor, self.key, self.counter = tensor, key, counter

    def __del__(self):
        if self.key is not None:
            self.counter._release(self.key)


class ActivationCounter:
    """with ActivationCounter(params) as c: ...; c.live_bytes, c.peak_bytes."""

    def __init__(self, params=()):
        self._param_storages = {p.untyped_storage().data_ptr() for p in params}
        self._refs: dict[int, list] = {}  # storage ptr -> [refcount, nbytes]
        self.live_bytes = 0
        self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> _Saved:
        if t.layout != torch.strided or t.device.type == "meta":
            return _Saved(t, None, self)
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._param_storages or storage.nbytes() == 0:
            return _Saved(t, None, self)
        ref = self._refs.get(key)
        if ref is None:
            self._refs[key] = [1, storage.nbytes()]
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        else:
            ref[0] += 1
        return _Saved(t, key, self)

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def _release(self, key: int) -> None:
        ref = self._refs.get(key)
        if ref is None:
            return
        ref[0] -= 1
        if ref[0] == 0:
            del self._refs[key]
            self.live_bytes -= ref[1]

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def __enter__(self) -> ActivationCounter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
