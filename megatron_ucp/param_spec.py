"""Partition specs derived from megatron-core itself.

For every parameter of every model chunk we ask the layer for its `sharded_state_dict()` (the same
declaration `dist_checkpointing` uses): the ShardedTensor key is the layout-free name, the global
shape/offsets say where this rank's TP slice sits, ShardedTensorFactory (SwiGLU `linear_fc1`,
GroupedMLP's fused experts) says the local tensor is several independently split blocks, possibly
transposed (found by running the factory on an index probe), and `replica_id` says whether this
copy is canonical or a TP/PP replica (replicated layer norms, the tied output layer). Nothing is
guessed from names: a parameter the model does not declare is an error.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, replace

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
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
from megatron.core.utils import unwrap_model

from megatron_ucp.errors import UCPError
from megatron_ucp.mcore_compat import is_legacy_grouped_mlp
from megatron_ucp.spec import ParamSpec, Piece
from megatron_ucp.storage import DTYPE_NAMES


@dataclass
class LocalParam:
    """One universal tensor's share on this rank: the model tensor (a parameter or persistent
    buffer), the region of it that holds this universal tensor, and where its pieces go.

    The region is the whole parameter except for fused expert weights (GroupedMLP), whose
    parameter holds every local expert: one LocalParam per expert, each a contiguous range."""

    spec: ParamSpec
    param: torch.nn.Parameter
    chunk: int
    local_name: str
    pieces: list[Piece]  # strided views of the region (flattened)
    canonical: bool  # False for replicas (TP copies of replicated params, tied output layer)
    base: int = 0  # the region is elements [base, base + numel) of the flattened parameter
    numel: int = -1  # -1: the whole parameter
    stack_index: tuple[int, ...] = ()  # stacked indices inside the sharded tensor (fused: expert)

    def __post_init__(self):
        if self.numel < 0:
            self.numel = self.param.numel()

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of the region: the parameter's, or flat for one expert of a fused weight."""
        whole = self.base == 0 and self.numel == self.param.numel()
        return tuple(self.param.shape) if whole else (self.numel,)

    def region(self, tensor: torch.Tensor) -> torch.Tensor:
        """The region of `tensor` (shaped like the parameter, contiguous), flattened."""
        return tensor.reshape(-1)[self.base:self.base + self.numel]


def universal_name(local_key: str, sharded_key: str, prepended: tuple[int, ...]) -> str:
    """'decoder.layers.self_attention.linear_qkv.weight' + layer 5 -> 'decoder.layers.5.self_...'.

    megatron stacks repeated modules (layers, experts) along prepended axes whose global offsets
    are the global indices. Each index goes after the path word that precedes the local index in
    the local key (`decoder.layers.1.` -> after `layers`); when the sharded key renames that word
    (SequentialMLP's `local_experts.1.linear_fc1` -> `experts.experts.linear_fc1`), the last index
    goes before the suffix the two keys share: `...experts.experts.<global expert>.linear_fc1.weight`.
    Transformer Engine's grouped linear (TEGroupedMLP) names expert k's tensor `weight<k>` and
    declares it under the sharded key's `weight`: read as SequentialMLP's `local_experts.<k>`.
    An index the sharded key already spells out is not stacked: when the layers of a block differ
    (first-k-dense MoE, `moe_layer_freq` lists, heterogeneous specs) megatron-core writes the global
    layer number into the key (`decoder.layers.3.mlp.experts.experts.linear_fc1.weight`), and only
    the expert axis is prepended.
    """
    if not prepended:
        return sharded_key
    local = local_key.split(".")
    out = sharded_key.split(".")
    spelled = {word for word, nxt in zip(out, out[1:]) if nxt.isdigit()}  # words followed by an index

    def stacked_positions() -> list[int]:
        return [i for i, part in enumerate(local) if part.isdigit() and i > 0 and local[i - 1] not in spelled]

    positions = stacked_positions()
    grouped = re.fullmatch(r"(weight|bias)(\d+)", local[-1])
    if (grouped and len(positions) + 1 == len(prepended) and len(local) > 2
            and sharded_key.split(".")[-1] == grouped.group(1)):
        local = [*local[:-2], "local_experts", grouped.group(2), local[-2], grouped.group(1)]
        positions = stacked_positions()
    if len(positions) != len(prepended):
        raise UCPError(f"parameter {local_key!r}: {len(prepended)} stacked axes in its sharded key "
                       f"{sharded_key!r} but {len(positions)} indices in its name; no rule maps it")
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


# Transformer Engine's spec fuses some norms into the linear layer after them; megatron-core maps
# the local spec's names onto the fused ones for GPT attention (`input_layernorm.` ->
# `linear_qkv.layer_norm_`, `pre_mlp_layernorm.` -> `linear_fc1.layer_norm_`) but not for MLA
# (0.16.1 and 0.19.2, `get_gpt_layer_local_spec(multi_latent_attention=True)` has no keys map).
# Universal names are the fused (TE) ones, so a checkpoint saved with one spec loads into the other.
# (local suffix, TE suffix, the sibling that exists only where TE fuses that norm)
TE_FUSED_NORMS = (
    ("self_attention.q_layernorm.", "self_attention.linear_q_up_proj.layer_norm_",
     "self_attention.linear_q_up_proj.weight"),
    ("self_attention.kv_layernorm.", "self_attention.linear_kv_up_proj.layer_norm_",
     "self_attention.linear_kv_up_proj.weight"),
    # a dense MLP's norm: TE's linear_fc1 is always TELayerNormColumnParallelLinear
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_", "mlp.linear_fc1.weight"),
)
MLA_SIBLING = "self_attention.linear_kv_down_proj.weight"
# The other way: megatron-core's local GPT spec maps `pre_mlp_layernorm.` to
# `mlp.linear_fc1.layer_norm_` in every layer, MoE layers included (0.16.1 and 0.19.2,
# `get_gpt_layer_local_spec`'s keys map), where Transformer Engine's MoE layer keeps a norm module of
# its own (`pre_mlp_layernorm`): a MoE layer has no dense `mlp.linear_fc1.weight` to fuse it into.
FUSED_MLP_NORM, MOE_NORM = "mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."
DENSE_FC1 = "mlp.linear_fc1.weight"


def te_fused_names(names: list[str]) -> dict[str, str]:
    """Local-spec layer names -> the names Transformer Engine's spec declares for the same tensors,
    for one model's universal names: MLA's fused norms (TE_FUSED_NORMS) and a MoE layer's pre-MLP
    norm (MOE_NORM); other names are left alone."""
    present = set(names)
    out = {}
    for name in names:
        for local, te, sibling in TE_FUSED_NORMS:
            head, sep, tail = name.rpartition("." + local)
            if not sep or tail not in ("weight", "bias"):
                continue
            if f"{head}.{MLA_SIBLING}" in present and f"{head}.{sibling}" in present:
                out[name] = f"{head}.{te}{tail}"
        head, sep, tail = name.rpartition("." + FUSED_MLP_NORM)
        if sep and tail in ("weight", "bias") and f"{head}.{DENSE_FC1}" not in present:
            out[name] = f"{head}.{MOE_NORM}{tail}"
    return out


def legacy_moe_norm_name(name: str, saved: set[str] | dict) -> str | None:
    """The name megatron-ucp before 2026-12 gave a local-spec MoE layer's pre-MLP norm
    (`...mlp.linear_fc1.layer_norm_weight`, see MOE_NORM) when `saved` holds it under that name and
    not the current one, else None: such checkpoints load into either spec."""
    head, sep, tail = name.rpartition("." + MOE_NORM)
    if not sep or tail not in ("weight", "bias") or name in saved:
        return None
    old = f"{head}.{FUSED_MLP_NORM}{tail}"
    return old if old in saved and f"{head}.{DENSE_FC1}" not in saved else None


def carries_extra_state(data) -> bool:
    """Whether an `_extra_state` entry holds anything. Local layers declare None; Transformer
    Engine modules return an empty uint8 tensor unless FP8 is on (then pickled FP8 metadata;
    TE before 1.6 used an io.BytesIO)."""
    if data is None:
        return False
    if torch.is_tensor(data):
        return data.numel() > 0
    if isinstance(data, io.BytesIO):
        return data.getbuffer().nbytes > 0
    return True


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


def _tp_axis(param: torch.Tensor, owner, sh: ShardedTensor, local_key: str,
             first_dim: int) -> int | None:
    """The dim of the universal tensor that TP splits. megatron sets `tensor_model_parallel`/
    `partition_dim` on parameters in its weight-init helpers, so a model built with
    perform_initialization=False (Megatron-LM's --no-initialization) has them on biases only; then
    the layer type says it. GroupedMLP's attributes describe its fused [hidden, experts x ffn]
    weight; per expert, fc1 is column-parallel and fc2 row-parallel, as in SequentialMLP. The
    sharded tensor's fragmentation (visible when TP > 1) must agree either way."""
    if is_legacy_grouped_mlp(owner):
        axis = 0 if param is owner.weight1 else 1
    elif getattr(owner, "softmax_offset", None) is param:
        # learnable attention sinks (softmax_type="learnable"), one per head: megatron-core's local
        # and Transformer Engine attention declare them split on dim 0 but mark no attribute (a
        # rebuild's set_defaults_if_not_set_tensor_model_parallel_attributes marks them unsplit)
        axis = 0
    elif hasattr(param, "tensor_model_parallel"):
        # megatron-core's Mamba mixer marks its per-channel parameters (conv1d, dt_bias, A_log, D,
        # the gated norm) `tensor_model_parallel` without a `partition_dim` and declares them
        # split on dim 0, the dim megatron's attribute defaults to elsewhere
        axis = getattr(param, "partition_dim", 0) if param.tensor_model_parallel else None
    elif isinstance(owner, (ColumnParallelLinear, VocabParallelEmbedding)) and param is owner.weight:
        axis = 0
    elif isinstance(owner, RowParallelLinear) and param is owner.weight:
        axis = 1
    else:
        axis = None
    split = [d for d, f in enumerate(sh.axis_fragmentations[first_dim:]) if f > 1]
    if split and split != [axis]:
        raise UCPError(f"parameter {local_key!r}: its sharded_state_dict splits dim {split} but the "
                       f"parameter says TP splits dim {axis}; no consistent rule")
    return axis


def _expert_name(name: str, expert: int) -> str:
    """'...mlp.experts.experts.linear_fc1.weight', 3 -> '...mlp.experts.experts.3.linear_fc1.weight',
    the name SequentialMLP's expert 3 gets from `universal_name`."""
    parts = name.split(".")
    return ".".join(parts[:-2] + [str(expert)] + parts[-2:])


def _split_experts(local_key: str, param: torch.Tensor, pieces: list[Piece]):
    """Per global expert of a fused weight: (expert, base, numel, pieces relative to base). Each
    expert must occupy its own contiguous range of the parameter (GroupedMLP views the weight as
    [local experts, ...]), so the optimizer's flat shard splits into per-expert fragments."""
    by_expert: dict[int, list[Piece]] = {}
    for pc in pieces:
        for j in range(pc.shape[0]):
            by_expert.setdefault(pc.offset[0] + j, []).append(
                Piece(pc.start + j * pc.strides[0], pc.offset[1:], pc.shape[1:], pc.strides[1:]))
    numel = param.numel() // len(by_expert)
    for expert, pcs in sorted(by_expert.items()):
        base = min(pc.start for pc in pcs) // numel * numel
        if any(pc.start < base or pc.span((0,) * len(pc.shape), pc.shape)[1] >= base + numel
               for pc in pcs):
            raise UCPError(f"parameter {local_key!r}: expert {expert} is not a contiguous range of "
                           "the fused weight; no rule maps it")
        yield expert, base, numel, [pc._replace(start=pc.start - base) for pc in pcs]


def flatten(x) -> list:
    """The leaves of nested dicts, lists and tuples (a sharded_state_dict, a factory's build)."""
    if isinstance(x, dict):
        return [y for v in x.values() for y in flatten(v)]
    if isinstance(x, (list, tuple)):
        return [y for v in x for y in flatten(v)]
    return [x]


def sharded_pieces(local_key: str, param: torch.Tensor, entry) -> list[ShardedTensor]:
    """The ShardedTensors an entry declares. A factory's build function copies (SwiGLU halves,
    GroupedMLP's transposed experts), so it is run on a tensor holding each element's own flat
    index instead of the parameter: the built pieces then hold the local index of every element."""
    if not param.is_contiguous():
        raise UCPError(f"parameter {local_key!r} is not contiguous; no rule maps it")
    if not isinstance(entry, ShardedTensorFactory):
        return [entry]
    dtype = torch.int32 if param.numel() < 2**31 else torch.int64
    probe = torch.arange(param.numel(), dtype=dtype, device="cpu").view(param.shape)
    return flatten(entry.build_fn(entry.key, probe, entry.replica_id, entry.flattened_range))


def sections(local_key: str, factory_key: str, subs: list[ShardedTensor], tp_axis: int | None,
             first_dim: int) -> tuple[list[int] | None, dict[str, int]]:
    """A factory whose pieces carry different keys splits one parameter into sections, each a
    tensor of its own split over TP on its own: megatron-core's Mamba mixer declares in_proj as
    `in_proj.weight.z/.x/.B/.C/.dt` and conv1d as `.x/.B/.C` (`_split_tensor_factory`). The
    universal tensor is the whole parameter as TP 1 holds it, the sections one after another
    along the TP axis. Returns (global section sizes or None, each key's offset along the axis)."""
    keys = list(dict.fromkeys(sh.key for sh in subs))
    if len(keys) == 1:
        return None, {keys[0]: 0}
    if tp_axis is None or any(not k.startswith(factory_key + ".") for k in keys):
        raise UCPError(f"parameter {local_key!r}: its sharded_state_dict splits it into {keys}, which "
                       f"are not sections of {factory_key!r} along a TP axis; no rule maps it")
    shapes = {sh.key: tuple(sh.global_shape[first_dim:]) for sh in subs}
    rest = {k: shape[:tp_axis] + shape[tp_axis + 1:] for k, shape in shapes.items()}
    if len(set(rest.values())) != 1:
        raise UCPError(f"parameter {local_key!r}: its sections {shapes} differ off the TP axis "
                       f"{tp_axis}; no rule maps it")
    sizes = [shapes[k][tp_axis] for k in keys]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return sizes, dict(zip(keys, starts))


def strided_pieces(local_key: str, param: torch.Tensor, subs: list[ShardedTensor],
                   probed: bool) -> list[Piece]:
    """Each sharded piece as a strided view of the flattened parameter: a plain ShardedTensor's
    data is the parameter or a view of it (its strides say where it lives); a probed piece holds
    local indices, from which start and strides are read and then checked element by element."""
    out, hit = [], None
    for sh in subs:
        view = sh.data
        if probed:
            start = int(view.reshape(-1)[0]) if view.numel() else 0
            strides = tuple(int(view[tuple(int(j == d) for j in range(view.dim()))]) - start
                            if n > 1 else 0 for d, n in enumerate(view.shape))
        elif view.untyped_storage().data_ptr() == param.untyped_storage().data_ptr():
            start, strides = view.storage_offset() - param.storage_offset(), tuple(view.stride())
        else:
            raise UCPError(f"parameter {local_key!r}: its sharded_state_dict piece is not a view of "
                           "the parameter; no rule maps it")
        p = sh.prepend_axis_num
        pc = Piece(start, tuple(sh.global_offset[p:]), tuple(view.shape), strides)
        last = pc.span((0,) * len(pc.shape), pc.shape)[1]
        if not (pc.numel > 0 and start >= 0 and min(strides, default=0) >= 0 and last < param.numel()):
            raise UCPError(f"parameter {local_key!r}: a sharded piece is not a strided view of the "
                           "parameter; no rule maps it")
        out.append(pc)
        if len(subs) == 1 and pc.contiguous and pc.numel == param.numel():
            continue  # the parameter itself (the common case): nothing to cross-check
        # element by element: the probe matches the strides, and no element is in two pieces
        flat = pc.local_index(view.dtype if probed else torch.int64)
        hit = torch.zeros(param.numel(), dtype=torch.bool, device="cpu") if hit is None else hit
        if (probed and not torch.equal(flat, view)) or hit[flat].any():
            raise UCPError(f"parameter {local_key!r}: a sharded piece is not a strided view of the "
                           "parameter, or overlaps another; no rule maps it")
        hit[flat] = True
    if (hit is not None and not bool(hit.all())) or sum(pc.numel for pc in out) != param.numel():
        raise UCPError(f"parameter {local_key!r}: its sharded pieces do not cover it")
    return out


def declared_state_dict(model) -> dict:
    """The (unwrapped) model's `sharded_state_dict()`, with the metadata megatron-core's layers
    read: the DP x CP group (GPTModel's MTP embedding copy and the learnable softmax offset index
    it without a default; Megatron-LM's save passes it too)."""
    try:
        return model.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))
    except AssertionError as e:  # megatron-core cannot declare this model (nor save it in torch_dist)
        hint = ""
        tied = getattr(model, "share_embeddings_and_output_weights", False)
        if getattr(model, "mtp_process", False) and tied:
            hint = (" megatron-core 0.16.1 cannot declare MTP with tied embeddings on a pipeline "
                    "stage after the first (LanguageModule.tie_embeddings_and_output_weights_state_dict "
                    "asserts); train with untied embeddings or PP=1.")
        raise UCPError(f"the model's own sharded_state_dict() (megatron-core) fails: "
                       f"AssertionError {str(e)[:200]!r}; megatron-ucp derives every parameter's "
                       f"split from it, so it can neither save nor load this model.{hint}") from e


def _vocab_params(model) -> set[int]:
    """ids of the parameters whose rows are indexed by token id: the vocab-parallel embedding and
    the output (logit) layer."""
    vocab = {id(m.weight) for m in model.modules() if isinstance(m, VocabParallelEmbedding)}
    output_layer = getattr(model, "output_layer", None)
    if output_layer is not None and getattr(output_layer, "weight", None) is not None:
        vocab.add(id(output_layer.weight))
    return vocab


def _check_object(model, local_key: str, entry: ShardedObject) -> None:
    """A ShardedObject is refused where it holds state a resume would need, except a Transformer
    Engine module's `_extra_state` (FP8 metadata), which `te_state` carries."""
    head, sep, _ = local_key.rpartition("._extra_state")
    if sep:
        try:
            if hasattr(model.get_submodule(head), "fp8_meta"):
                return
        except AttributeError:
            pass
    if carries_extra_state(entry.data):
        raise UCPError(f"{local_key!r} holds extra state ({type(entry.data).__name__}, "
                       "e.g. Transformer Engine FP8 scaling factors and amax history); "
                       "megatron-ucp carries parameters, optimizer state, buffers and "
                       "Transformer Engine modules' FP8 state only")


def _te_fused_names(chunk_params: list[LocalParam]) -> None:
    """One chunk's parameters renamed in place to Transformer Engine's spelling (`TE_FUSED_NORMS`)."""
    renamed = te_fused_names([lp.spec.name for lp in chunk_params])
    for lp in chunk_params:
        if lp.spec.name in renamed:
            lp.spec = replace(lp.spec, name=renamed[lp.spec.name])


def local_params(model_chunks: list) -> list[LocalParam]:
    """Every trainable parameter of this rank's model chunks with its spec and pieces."""
    out: list[LocalParam] = []
    for chunk_index, chunk in enumerate(model_chunks):
        model = unwrap_model(chunk)
        params = {id(p): (n, p) for n, p in model.named_parameters()}
        buffers = {id(b): (n, b) for n, b in model.named_buffers()}
        owners = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
        vocab = _vocab_params(model)
        seen: set[int] = set()
        for local_key, entry in declared_state_dict(model).items():
            if isinstance(entry, ShardedObject):
                _check_object(model, local_key, entry)
                continue
            if not isinstance(entry, (ShardedTensor, ShardedTensorFactory)):
                raise UCPError(f"{local_key!r}: unsupported sharded entry {type(entry).__name__}")
            is_buffer = id(entry.data) in buffers
            if not is_buffer and id(entry.data) not in params:
                raise UCPError(f"{local_key!r} is in the model's sharded_state_dict but is neither a "
                               "parameter nor a buffer of the model; no rule maps it")
            name_in_model, param = (buffers if is_buffer else params)[id(entry.data)]
            seen.add(id(param))
            subs = sharded_pieces(local_key, param, entry)
            first = subs[0]
            p = first.prepend_axis_num
            owner = owners.get(id(param))
            # GroupedMLP fuses its local experts into one parameter; its sharded tensors stack them
            # along their first dim, which becomes the global expert index in the name, as for
            # SequentialMLP (megatron declares the two forms with the same keys).
            fused = is_legacy_grouped_mlp(owner)
            tp_axis = _tp_axis(param, owner, first, local_key, p + fused)
            section_sizes, section_start = sections(local_key, entry.key, subs, tp_axis, p + fused)
            name = universal_name(local_key, entry.key if section_sizes else first.key,
                                  tuple(first.global_offset[:p]))
            shape = tuple(first.global_shape[p + fused:])
            if section_sizes:
                shape = shape[:tp_axis] + (sum(section_sizes),) + shape[tp_axis + 1:]
            if is_buffer and (len(subs) > 1 or any(f > 1 for f in first.axis_fragmentations[p:])
                              or not param.is_floating_point()):
                raise UCPError(f"buffer {local_key!r} is split over TP or is not floating point; "
                               "megatron-ucp v1 carries replicated floating-point buffers only")
            spec = ParamSpec(
                name=name,
                shape=shape,
                dtype=DTYPE_NAMES[param.dtype],
                tp_axis=tp_axis,
                tp_blocks=len(subs),
                # a pipeline-level copy (the tied output layer on the last stage) is an alias
                aliases=[name_in_model] if _pipeline_copy(first.replica_id) else [],
                vocab_rows=id(param) in vocab,
                buffer=is_buffer,
                tp_sections=section_sizes,
            )
            pieces = strided_pieces(local_key, param, subs, isinstance(entry, ShardedTensorFactory))
            if section_sizes:  # each section's piece moves to where the section starts
                pieces = [pc._replace(offset=tuple(o + section_start[sh.key] * (d == tp_axis)
                                                   for d, o in enumerate(pc.offset)))
                          for pc, sh in zip(pieces, subs)]
            # a buffer is not sharded by the optimizer: one DP replica writes it
            canonical = _canonical(first.replica_id) and not (is_buffer and _dp_copy(first.replica_id))
            if fused:
                for expert, base, numel, expert_pieces in _split_experts(local_key, param, pieces):
                    out.append(LocalParam(replace(spec, name=_expert_name(name, expert)), param,
                                          chunk_index, name_in_model, expert_pieces, canonical,
                                          base, numel, (expert,)))
                continue
            out.append(LocalParam(spec, param, chunk_index, name_in_model, pieces, canonical))
        _te_fused_names([lp for lp in out if lp.chunk == chunk_index])
        missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
        if missing:
            raise UCPError(f"parameters {missing} are not declared by the model's "
                           "sharded_state_dict(); megatron-ucp cannot tell how they are split")
    return out


def first_replica():
    """`holds(lp)`: whether this rank is the first data-parallel replica of `lp`'s model-parallel
    position (expert parameters: of the expert data-parallel group), the one whose pieces a save or
    a gather takes (DP replicas hold the same)."""
    from megatron.core import parallel_state as ps

    dense = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    expert = ps.get_expert_data_parallel_rank() == 0
    return lambda lp: expert if getattr(lp.param, "allreduce", True) is False else dense
