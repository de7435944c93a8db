"""Live weight sync: the HF-named tensors of a running megatron-core model, streamed.

RL frameworks push the policy's weights into an inference engine every step. `export_hf_weights`
yields them as export-hf would write them (the same name map, element orders, vocabulary rows and
dtype), gathered from any TP / PP / EP / DP layout one universal parameter at a time: each
parameter's pieces are broadcast by the ranks that hold them (the first data-parallel replica,
as a save takes them) and put together on every rank, split into its HF tensors, yielded, dropped.
At most one universal tensor (a stacked HF tensor of experts: its layer's) is in memory at once.

The weights are the model's own (its training dtype, e.g. bf16), not the optimizer's fp32 masters:
what an inference engine runs. `export_hf_weights(..., dtype="bf16")` of a bf16 run is bitwise
`export-hf --dtype bf16` of a checkpoint saved at the same step (the model weight is the bf16
master).

Collective: every rank of the job iterates the generator to its end, in step.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.base import Source
from megatron_ucp.formats.hf.export import FP8, hf_tensors, prepare
from megatron_ucp.formats.manifest import Manifest, ParamEntry
from megatron_ucp.layout import Layout
from megatron_ucp.param_spec import first_replica, local_params
from megatron_ucp.spec import ParamSpec, Piece
from megatron_ucp.validation import model_config

NO_SHARDS = 2**62  # (the export plan's shard size: streamed, nothing is cut into files)


def export_hf_weights(model_chunks: list, arch: str, *, dtype: str | None = "bf16",
                      vocab_size: int | None = None, hints: dict | None = None,
                      activation: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) of the live model `model_chunks` (this rank's chunks, as for
    `megatron_ucp.save`) as HF `arch`, on every rank (see the module doc). dtype: "bf16", "fp16",
    "fp32" (None: the model's); vocab_size: the true vocabulary (default: every embedding row);
    hints / activation: what the model config does not hold (`export-hf`'s)."""
    if not dist.is_initialized():
        raise UCPError("export_hf_weights gathers over the job's process group: initialise "
                       "torch.distributed (torchrun) and megatron-core's parallel state first")
    if dtype == FP8:
        raise UCPError("export_hf_weights streams fp32 / bf16 / fp16 weights; FP8 (--dtype fp8) is "
                       "for export-hf")
    source = LiveModel(model_chunks, vocab_size)
    planned, _, _ = prepare(source.manifest, arch, dtype=dtype, max_shard_bytes=NO_SHARDS,
                                      vocab_size=vocab_size, activation=activation, hints=hints)
    for name, _, tensor in hf_tensors(source, planned):
        yield name, tensor


class LiveModel(Source):
    """A live model as a source of its universal weights (`param` only): `read` gathers a
    parameter's pieces from the ranks holding them. Every rank reads the same names in the same
    order (the collective: one broadcast per piece)."""

    format = "live"

    def __init__(self, model_chunks: list, vocab_size: int | None):
        holds = first_replica()
        self._local: dict[str, list[tuple[Piece, torch.Tensor]]] = {}
        specs: dict[str, dict] = {}
        for lp in local_params(model_chunks):
            if not (lp.canonical and holds(lp)):
                continue
            region = lp.region(lp.param.detach())
            self._local.setdefault(lp.spec.name, []).extend((pc, region) for pc in lp.pieces)
            specs[lp.spec.name] = lp.spec.to_json()
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (specs, {n: [tuple(pc) for pc, _ in v]
                                                  for n, v in self._local.items()}))
        self.pieces: dict[str, list[tuple[int, Piece]]] = {}
        merged: dict[str, dict] = {}
        for rank, (rank_specs, rank_pieces) in enumerate(everyone):
            merged.update(rank_specs)
            for n, pcs in rank_pieces.items():
                self.pieces.setdefault(n, []).extend((rank, Piece(*pc)) for pc in pcs)
        layout = Layout.current()
        params = {n: ParamEntry(ParamSpec.from_json(merged[n]), 0.0) for n in sorted(merged)}
        self.manifest = Manifest("universal", 0, layout, dist.get_world_size(),
                                 {**model_config(model_chunks), "unpadded_vocab_size": vocab_size},
                                 params, {"param_groups": [], "grad_scaler": None}, None, {})
        self.dir, self.origin = "(live model)", {"kind": "live model"}
        # (pieces go as bytes: every backend broadcasts uint8; NCCL from the device)
        self.device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
            else torch.device("cpu")

    def read(self, name: str, state: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        if state != "param":
            raise UCPError(f"a live model streams its weights, not optimizer state {state!r}")
        spec = self.manifest.params[name].spec
        dtype = getattr(torch, spec.dtype)
        full = torch.empty(spec.shape, dtype=dtype)
        mine = iter(self._local.get(name, []))
        rank = dist.get_rank()
        device = self.device
        for owner, pc in self.pieces[name]:
            if owner == rank:
                _, region = next(mine)
                # (as_strided's offset counts in the storage: DDP's parameters are views of its buffer)
                view = torch.as_strided(region, pc.shape, pc.strides, region.storage_offset() + pc.start)
                buf = view.to(device, dtype).contiguous()
            else:
                buf = torch.empty(pc.shape, dtype=dtype, device=device)
            dist.broadcast(buf.view(torch.uint8), src=owner)
            full[tuple(slice(o, o + n) for o, n in zip(pc.offset, pc.shape))] = buf.cpu()
        # (in the model's dtype, not fp32: the export casts each HF tensor to its own dtype, and an
        # fp32 copy would double the peak of a bf16 run's largest tensor)
        return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]

    def step(self, name: str) -> float:
        return 0.0

    def rng_ranks(self) -> list[int]:
        return []

    def rng(self, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
        return {}, {}
