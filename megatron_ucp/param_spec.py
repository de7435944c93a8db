"""Partition specs derived from megatron-core itself.

For every parameter of every model chunk we ask the layer for its `sharded_state_dict()` (the same
declaration `dist_checkpointing` uses): the ShardedTensor key is the layout-free name, the global
shape/offsets say where this rank's TP slice sits, ShardedTensorFactory (SwiGLU `linear_fc1`) says
the local tensor is several independently split blocks, and `replica_id` says whether this copy is
canonical or a TP/PP replica (replicated layer norms, the tied output layer). Nothing is guessed from
names: a parameter the model does not declare is an error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megatron.core.utils import unwrap_model

from megatron_ucp.errors import UCPError
from megatron_ucp.spec import ParamSpec, Piece
from megatron_ucp.storage import DTYPE_NAMES


@dataclass
class LocalParam:
    """One parameter (or persistent buffer) on this rank: the model tensor and where its pieces go."""

    spec: ParamSpec
    param: torch.nn.Parameter
    chunk: int
    local_name: str
    pieces: list[Piece]
    canonical: bool  # False for replicas (TP copies of replicated params, tied output layer)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(self.param.shape)


def universal_name(local_key: str, sharded_key: str, prepended: tuple[int, ...]) -> str:
    """'decoder.layers.self_attention.linear_qkv.weight' + layer 5 -> 'decoder.layers.5.self_...'.

    megatron stacks repeated modules (layers, experts) along prepended axes whose global offsets
    are the global indices. Each index goes after the path word that precedes the local index in
    the local key (`decoder.layers.1.` -> after `layers`); when the sharded key renames that word
    (SequentialMLP's `local_experts.1.linear_fc1` -> `experts.experts.linear_fc1`), the last index
    goes before the suffix the two keys share: `...experts.experts.<global expert>.linear_fc1.weight`.
    """
    if not prepended:
        return sharded_key
    local = local_key.split(".")
    positions = [i for i, part in enumerate(local) if part.isdigit() and i > 0]
    if len(positions) != len(prepended):
        raise UCPError(f"parameter {local_key!r}: {len(prepended)} stacked axes in its sharded key "
                       f"{sharded_key!r} but {len(positions)} indices in its name; no rule maps it")
    out = sharded_key.split(".")
    at = 0  # insertion points move right as indices are placed
    for j, (pos, index) in enumerate(zip(positions, prepended)):
        anchor = local[pos - 1]
        if anchor in out[at:]:
            at = out.index(anchor, at) + 1
        elif j == len(positions) - 1 and out[-len(local[pos + 1:]):] == local[pos + 1:]:
            at = len(out) - len(local[pos + 1:])
        else:
            raise UCPError(f"parameter {local_key!r}: cannot place indices {prepended} in sharded "
                           f"key {sharded_key!r}; no rule maps it")
        out.insert(at, str(index))
        at += 1
    return ".".join(out)


def _canonical(replica_id) -> bool:
    # replica_id is (pipeline/tied copy, TP replica, DP rank); the distributed optimizer shards DP,
    # so every DP rank writes its own range and only the first two components decide.
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id[:-1])


def _dp_copy(replica_id) -> bool:
    return not isinstance(replica_id, int) and replica_id[-1] != 0


def _pipeline_copy(replica_id) -> bool:
    return not isinstance(replica_id, int) and replica_id[0] != 0


def _tp_axis(param: torch.Tensor, owner, sh: ShardedTensor, local_key: str) -> int | None:
    """The dim TP splits. megatron sets `tensor_model_parallel`/`partition_dim` on parameters in
    its weight-init helpers, so a model built with perform_initialization=False (Megatron-LM's
    --no-initialization) has them on biases only; then the layer type says it. The sharded
    tensor's fragmentation (visible when TP > 1) must agree either way."""
    if hasattr(param, "tensor_model_parallel"):
        axis = param.partition_dim if param.tensor_model_parallel else None
    elif isinstance(owner, (ColumnParallelLinear, VocabParallelEmbedding)) and param is owner.weight:
        axis = 0
    elif isinstance(owner, RowParallelLinear) and param is owner.weight:
        axis = 1
    else:
        axis = None
    split = [d for d, f in enumerate(sh.axis_fragmentations[sh.prepend_axis_num:]) if f > 1]
    if split and split != [axis]:
        raise UCPError(f"parameter {local_key!r}: its sharded_state_dict splits dim {split} but the "
                       f"parameter says TP splits dim {axis}; no consistent rule")
    return axis


def _flatten(x) -> list:
    if isinstance(x, dict):
        return [y for v in x.values() for y in _flatten(v)]
    if isinstance(x, (list, tuple)):
        return [y for v in x for y in _flatten(v)]
    return [x]


def _piece(local_key: str, param: torch.Tensor, sh: ShardedTensor) -> Piece:
    view = sh.data
    row_numel = math.prod(param.shape[1:])
    rel = view.storage_offset() - param.storage_offset()
    if (view.untyped_storage().data_ptr() != param.untyped_storage().data_ptr()
            or not view.is_contiguous() or tuple(view.shape[1:]) != tuple(param.shape[1:])
            or rel % row_numel):
        raise UCPError(f"parameter {local_key!r}: its sharded_state_dict piece is not a block of "
                       "rows of the parameter; no rule maps it")
    p = sh.prepend_axis_num
    return Piece(rel // row_numel, tuple(sh.global_offset[p:]), tuple(view.shape))


def local_params(model_chunks: list) -> list[LocalParam]:
    """Every trainable parameter of this rank's model chunks with its spec and pieces."""
    out: list[LocalParam] = []
    for chunk_index, chunk in enumerate(model_chunks):
        model = unwrap_model(chunk)
        params = {id(p): (n, p) for n, p in model.named_parameters()}
        buffers = {id(b): (n, b) for n, b in model.named_buffers()}
        owners = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
        # rows indexed by token id: the vocab-parallel embedding and the output (logit) layer
        vocab = {id(m.weight) for m in model.modules() if isinstance(m, VocabParallelEmbedding)}
        output_layer = getattr(model, "output_layer", None)
        if output_layer is not None and getattr(output_layer, "weight", None) is not None:
            vocab.add(id(output_layer.weight))
        seen: set[int] = set()
        for local_key, entry in model.sharded_state_dict().items():
            if isinstance(entry, ShardedObject):
                if entry.data is not None:
                    raise UCPError(f"{local_key!r} holds extra state {type(entry.data).__name__}; "
                                   "megatron-ucp v1 handles parameters only (TE extra state is "
                                   "not supported yet)")
                continue
            if not isinstance(entry, (ShardedTensor, ShardedTensorFactory)):
                raise UCPError(f"{local_key!r}: unsupported sharded entry {type(entry).__name__}")
            is_buffer = id(entry.data) in buffers
            if not is_buffer and id(entry.data) not in params:
                raise UCPError(f"{local_key!r} is in the model's sharded_state_dict but is neither a "
                               "parameter nor a buffer of the model; no rule maps it")
            name_in_model, param = (buffers if is_buffer else params)[id(entry.data)]
            seen.add(id(param))
            subs = _flatten(entry.build()) if isinstance(entry, ShardedTensorFactory) else [entry]
            first = subs[0]
            p = first.prepend_axis_num
            name = universal_name(local_key, first.key, tuple(first.global_offset[:p]))
            tp_axis = _tp_axis(param, owners.get(id(param)), first, local_key)
            if is_buffer and (len(subs) > 1 or any(f > 1 for f in first.axis_fragmentations[p:])
                              or not param.is_floating_point()):
                raise UCPError(f"buffer {local_key!r} is split over TP or is not floating point; "
                               "megatron-ucp v1 carries replicated floating-point buffers only")
            spec = ParamSpec(
                name=name,
                shape=tuple(first.global_shape[p:]),
                dtype=DTYPE_NAMES[param.dtype],
                tp_axis=tp_axis,
                tp_blocks=len(subs),
                # a pipeline-level copy (the tied output layer on the last stage) is an alias
                aliases=[name_in_model] if _pipeline_copy(first.replica_id) else [],
                vocab_rows=id(param) in vocab,
                buffer=is_buffer,
            )
            pieces = [_piece(local_key, param, s) for s in subs]
            if sum(math.prod(x.shape) for x in pieces) != param.numel():
                raise UCPError(f"parameter {local_key!r}: its sharded pieces do not cover it")
            # a buffer is not sharded by the optimizer: one DP replica writes it
            canonical = _canonical(first.replica_id) and not (is_buffer and _dp_copy(first.replica_id))
            out.append(LocalParam(spec, param, chunk_index, name_in_model, pieces, canonical))
        missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
        if missing:
            raise UCPError(f"parameters {missing} are not declared by the model's "
                           "sharded_state_dict(); megatron-ucp cannot tell how they are split")
    return out
