"""Hooks that cut one TransformerLayer's forward and backward into its modules' intervals and
attribute every stored activation to exactly one module (the profiler's `measure_layer`; the rule
is in `profiler`'s docstring)."""

from __future__ import annotations

import torch

from megatron_ucp.recompute.activations import ActivationCounter
from megatron_ucp.recompute.profile import MODULES

# Submodule of a TransformerLayer for each profile module name.
SUBMODULES = {"input_layernorm": "input_layernorm", "qkv": "self_attention.linear_qkv",
              "core_attn": "self_attention.core_attention", "proj": "self_attention.linear_proj",
              "pre_mlp_layernorm": "pre_mlp_layernorm", "mlp": "mlp"}
CHECKPOINTED = ("core_attn", "mlp")  # megatron's `checkpoint` keeps their output


class AttributingCounter(ActivationCounter):
    """ActivationCounter that also records which segment saved each storage first."""

    def __init__(self, params):
        super().__init__(params)
        self.segment: str | None = None
        self.saver: dict[int, str | None] = {}

    def _pack(self, t: torch.Tensor):
        saved = super()._pack(t)
        if saved.key is not None and self._refs[saved.key][0] == 1:  # a storage new to the graph
            self.saver[saved.key] = self.segment
        return saved


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


class LayerProbe:
    """Hooks on one TransformerLayer's six submodules: segment boundaries, producers, backward marks."""

    def __init__(self, layer, params, clock):
        self.clock = clock
        self.modules = {name: layer.get_submodule(path) for name, path in SUBMODULES.items()}
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.counter: AttributingCounter | None = None
        self.fwd_marks: list[tuple[str, float]] = []
        self.bwd_marks: list[tuple[str, float]] = []
        self.producer: dict[int, str] = {}  # storage ptr -> module that made it
        self.keep: list[torch.Tensor] = []  # registered tensors stay alive: no storage reuse
        self.handles = []
        for name, module in self.modules.items():
            self.handles.append(module.register_forward_pre_hook(self._pre(name)))
            self.handles.append(module.register_forward_hook(self._post(name)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def begin(self, counter: AttributingCounter | None, inputs: list[torch.Tensor]) -> None:
        self.counter, self.fwd_marks, self.bwd_marks = counter, [], []
        self.producer, self.keep = {}, list(inputs)
        for t in inputs:
            self.producer[t.untyped_storage().data_ptr()] = "outside"
        if counter is not None:
            counter.segment = "qkv"  # before the first hook: nothing is saved there

    def _register(self, tensors: list[torch.Tensor], name: str) -> None:
        for t in tensors:
            key = t.untyped_storage().data_ptr()
            if key not in self.producer and key not in self.params:
                self.producer[key] = name
                self.keep.append(t)

    def _pre(self, name: str):
        def hook(module, args):
            self.fwd_marks.append((name, self.clock()))
            # inputs no module produced were made by the glue after the previous module
            previous = self.fwd_marks[-2][0] if len(self.fwd_marks) > 1 else "outside"
            self._register(_tensors(args), previous)
            if self.counter is not None:
                self.counter.segment = name
        return hook

    def _post(self, name: str):
        def hook(module, args, output):
            tensors = _tensors(output)
            self._register(tensors, name)
            for t in tensors:
                if t.requires_grad and t.untyped_storage().data_ptr() not in self.params:
                    t.register_hook(self._grad_ready(name))
                    break  # the first output is the one the next module consumes
        return hook

    def _grad_ready(self, name: str):
        def hook(grad):
            self.bwd_marks.append((name, self.clock()))
        return hook

    def attribute(self) -> dict[str, int]:
        """Live saved bytes per module (the rule in the module docstring); sums to live_bytes."""
        per_module = dict.fromkeys(MODULES, 0)
        for key, (_, nbytes) in self.counter._refs.items():
            saver = self.counter.saver.get(key) or "qkv"
            producer = self.producer.get(key, saver)  # not registered: made inside its saver
            if producer == "outside":
                owner = "qkv"
            elif producer in CHECKPOINTED and saver != producer:
                owner = saver
            else:
                owner = producer
            per_module[owner] += nbytes
        return per_module


def intervals(marks: list[tuple[str, float]], start: float, end: float, first: str) -> dict[str, float]:
    """Seconds from each mark to the next (the time before the first mark goes to `first`)."""
    out = dict.fromkeys(MODULES, 0.0)
    marks = sorted(marks, key=lambda m: m[1])
    edges = [(first, start)] + marks + [(None, end)]
    for (name, t0), (_, t1) in zip(edges, edges[1:]):
        out[name] += t1 - t0
    return out
