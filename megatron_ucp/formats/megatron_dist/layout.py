"""The files of a Megatron-LM `--ckpt-format torch_dist` checkpoint.

An iteration directory holds torch.distributed.checkpoint files (`.metadata`, `__*_*.distcp`),
the common (non-tensor) state: args, iteration, optimizer param groups, scheduler, content
metadata, and `metadata.json` (backend names). megatron-core up to 0.18 writes the common state to
`common.pt`; 0.19 pickles it into the `.distcp` files as the object `common_state/shard_0_1` (a
one-element list) and writes no `common.pt` (its loader reads either). Model tensors are stored
at global shape with layers stacked
(`decoder.layers.self_attention.linear_qkv.weight` is [layers, ...]); the optimizer state is either
`fully_reshardable` (`optimizer.state.<state>.<model key>`, global shape), `dp_reshardable` (each
model-parallel rank's flat DistributedOptimizer buckets, `optimizer.distributed.dp_group_idx_<k>.*`;
a MoE run's ChainedOptimizer prefixes them `chained_0.` (dense) and `chained_1.` (experts, one
per expert tensor-model-pipeline rank))
or, from megatron-core 0.13-0.15, `fully_sharded_model_space` (the `flattened_range` form,
`optimizer.state.<fp32_param|exp_avg|exp_avg_sq>.<model key>`, see `flattened_shape`). A run with an
emerging optimizer (`--optimizer muon` / `lion` with `--use-distributed-optimizer`: megatron-core
0.19's LayerWiseDistributedOptimizer) stores every state in model space, global shape, per chained
optimizer: `chained_<i>.optimizer.state.<fp32_param|state>.<model key>` (`LAYER_WISE`,
`layer_wise_key`), whatever its `content_metadata` says.
Which stacked index holds which universal parameter is read off the model rebuilt from `args`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.megatron_common import layout
from megatron_ucp.formats.megatron_rebuild import (
    build_chunks,
    model_config,
    single_rank_args,
    source_rank,
    wrap_ddp,
)
from megatron_ucp.formats.megatron_te import object_names
from megatron_ucp.mcore_compat.dist_ckpt import (  # noqa: F401  (what each release writes)
    COMMON_STATE_KEY,
    FLATTENED,
    FULLY_RESHARDABLE_CONTENT,
)
from megatron_ucp.mcore_compat.mamba import conv1d_module_from_files
from megatron_ucp.param_spec import declared_state_dict, flatten, local_params
from megatron_ucp.storage import location

COMMON_FILE = "common.pt"
METADATA_FILE = ".metadata"
SHARDINGS = ("dp_reshardable", "fully_reshardable")  # the forms written (and read)
READ_SHARDINGS = (*SHARDINGS, FLATTENED)  # read only: megatron-core >= 0.16 no longer loads it
# read only: megatron-core 0.19's LayerWiseDistributedOptimizer (Muon / Lion and their scalar Adam),
# each chained optimizer's state in model space (`layer_wise_key`); its saves say dp_reshardable
LAYER_WISE = "layer_wise"
LAYER_WISE_KEY = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.state\.(.+)$")  # chain, "<state>.<key>"
# megatron-ucp's note in the common state of a hybrid model's save: {"mamba_conv1d_module": bool},
# the Mamba conv1d form (megatron_rebuild.wrap_ddp) whose parameter order its flat buffers follow
# (its common.pt does not tell: megatron-ucp writes one under 0.19 too). Megatron-LM ignores it.
UCP_COMMON_KEY = "megatron_ucp"
METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                 "common_backend": "torch", "common_backend_version": 1}


def is_iteration(path: Path) -> bool:
    return (location(path) / METADATA_FILE).exists()


def state_key(state: str, model_key: str) -> str:
    """fully_reshardable: the key of one optimizer state of a model tensor."""
    return f"optimizer.state.{state}.{model_key}"


def flattened_state_key(state: str, model_key: str) -> str:
    """fully_sharded_model_space: the key of one optimizer state of a model tensor (the master
    weight is called `fp32_param` there)."""
    return f"optimizer.state.{'fp32_param' if state == 'param' else state}.{model_key}"


def layer_wise_key(chain: int | None, state: str, model_key: str) -> str:
    """LayerWiseDistributedOptimizer: one state of a model tensor in chained optimizer `chain`
    (None: a LayerWise optimizer of one torch optimizer, no `chained_` prefix); the master weight
    is `fp32_param`."""
    prefix = "" if chain is None else f"chained_{chain}."
    return f"{prefix}optimizer.state.{'fp32_param' if state == 'param' else state}.{model_key}"


def flattened_shape(model_shape: tuple[int, ...], stored_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The local chunk shape of a `flattened_range` optimizer tensor, None if the shapes disagree.

    megatron-core <= 0.15 stores an optimizer state whose ShardedTensors carry a flattened_range
    (each DP rank a contiguous range of its TP-local chunk, flattened) with the global shape
    reformulated as [X // x, Y // y, Z // z, x * y * z] for a model tensor [X, Y, Z] whose TP-local
    chunk is [x, y, z] (dist_checkpointing/strategies/resharding.py,
    nd_flattened_tensor_reformulated_global_shape): one row per chunk of the model tensor, the
    chunk flattened in C order on the last axis. Stacked layer axes have chunk size 1."""
    grid = stored_shape[:-1]
    if len(grid) != len(model_shape) or any(g == 0 or n % g for n, g in zip(model_shape, grid)):
        return None
    local = tuple(n // g for n, g in zip(model_shape, grid))
    return local if math.prod(local) == stored_shape[-1] else None


def bucket_key(mp_rank: int, buffer: int, dtypes: tuple, bucket: int, chained: str = "") -> str:
    """dp_reshardable: the key prefix of one flat bucket of a model-parallel rank's buffer.
    chained: a MoE run's ChainedOptimizer prefix, `chained_0.` (dense) or `chained_1.` (experts,
    whose mp_rank is the rank in the expert tensor-model-pipeline group: ETP x EP x PP)."""
    return (f"{chained}optimizer.distributed.dp_group_idx_{mp_rank}.gbuf_idx_{buffer}."
            f"dtype_({dtypes[0]}, {dtypes[1]}).bucket_idx_{bucket}")


def param_groups_key(mp_rank: int, chained: str = "") -> str:
    return f"{chained}optimizer.distributed.dp_group_idx_{mp_rank}.optimizer/shard_0_1"


# a key of the optimizer's state (a MoE run's dp_reshardable buckets carry a `chained_<i>.` prefix)
OPTIMIZER_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.")
# the two optimizers of a MoE run's ChainedOptimizer (dp_reshardable)
DENSE, EXPERT = "chained_0.", "chained_1."


def saved_mamba_conv1d_module(common: dict, ckpt: Path) -> bool:
    """How the release that saved the torch_dist checkpoint `ckpt` held its Mamba mixers' conv1d
    (megatron_rebuild.wrap_ddp): megatron-ucp's note where it wrote it, else from the file layout:
    megatron-core <= 0.18 keeps `common.pt` and a conv1d submodule, 0.19 neither."""
    note = common.get(UCP_COMMON_KEY) if isinstance(common, dict) else None
    if isinstance(note, dict) and "mamba_conv1d_module" in note:
        return bool(note["mamba_conv1d_module"])
    return conv1d_module_from_files((ckpt / COMMON_FILE).exists())


def optimizer_ranks(args, mamba_conv1d_module: bool | None = None
                    ) -> Iterator[tuple[int | None, int | None, list]]:
    """A MoE run (dp_reshardable): (dense model-parallel rank or None, expert model-parallel rank
    or None, its chunks inside megatron-core DDP) for every global rank that stores a dense bucket
    (data-parallel rank 0) or an expert bucket (expert-data-parallel rank 0), each rank once per
    index: the `dp_group_idx` of the two optimizers (megatron-core's get_megatron_optimizer: the
    rank in the model-parallel group, and in the expert tensor-model-pipeline group)."""
    from megatron.core import parallel_state as ps

    lay = layout(args)
    dense_seen: set[int] = set()
    expert_seen: set[int] = set()
    for rank in range(lay.world_size):
        with source_rank(args, rank):
            dense = ps.get_model_parallel_group().rank() if ps.get_data_parallel_rank() == 0 else None
            expert = (ps.get_expert_tensor_model_pipeline_parallel_group().rank()
                      if ps.get_expert_data_parallel_rank() == 0 else None)
            dense = None if dense in dense_seen else dense
            expert = None if expert in expert_seen else expert
            if dense is None and expert is None:
                continue
            dense_seen.add(dense)
            expert_seen.add(expert)
            yield dense, expert, wrap_ddp(build_chunks(args), args, mamba_conv1d_module)


def buffer_sets(args, chained: bool, where, mamba_conv1d_module: bool | None = None
                ) -> Iterator[tuple[int, str, list, dict]]:
    """(dp_group_idx, key prefix, DDP buffers, {id(param): LocalParam}) of each optimizer whose
    buckets a dp_reshardable save of the run `args` describe stores (no VPP: one chunk), yielded
    inside that rank's parallel state. chained: a MoE run whose experts have buffers of their own,
    a ChainedOptimizer's dense (`chained_0.`) and expert (`chained_1.`) optimizers
    (`optimizer_ranks`); else one optimizer per model-parallel rank, no prefix. where: the
    checkpoint, named when its args build expert buffers it holds no state for.
    mamba_conv1d_module: the saving release's Mamba conv1d form (`megatron_rebuild.wrap_ddp`;
    None: this release's)."""
    if not chained:
        for mp_rank, chunks in model_parallel_ranks(args, mamba_conv1d_module):
            if chunks[0].expert_parallel_buffers:
                raise UCPError(f"{where}: the model rebuilt from the checkpoint's args keeps its "
                               "experts in buffers of their own (a second, expert optimizer), but "
                               "the checkpoint holds no `chained_1.` expert optimizer state; the "
                               "args do not describe the run that saved it")
            yield mp_rank, "", chunks[0].buffers, {id(lp.param): lp for lp in local_params(chunks[:1])}
        return
    for dense, expert, chunks in optimizer_ranks(args, mamba_conv1d_module):
        lps = {id(lp.param): lp for lp in local_params(chunks[:1])}
        if dense is not None:
            yield dense, DENSE, chunks[0].buffers, lps
        if expert is not None:
            yield expert, EXPERT, chunks[0].expert_parallel_buffers, lps


def model_parallel_ranks(args, mamba_conv1d_module: bool | None = None) -> Iterator[tuple[int, list]]:
    """(model-parallel rank, its chunks inside megatron-core DDP) for every (PP, TP) rank at DP
    rank 0 of the run `args` describe: whose DistributedOptimizer buckets the dp_reshardable form
    stores. Each is rebuilt on a fake group with meta tensors (the layout, no data) and yielded
    inside that rank's parallel state, so take what is needed before the next one."""
    from megatron.core import parallel_state as ps

    lay = layout(args)
    for pp_rank in range(lay.pp):
        for tp_rank in range(lay.tp):
            rank = tp_rank + lay.tp * lay.dp * pp_rank  # megatron's default order tp-cp-ep-dp-pp
            with source_rank(args, rank):
                if (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                        ps.get_data_parallel_rank()) != (tp_rank, pp_rank, 0):
                    raise UCPError(f"rank {rank} is not (tp {tp_rank}, pp {pp_rank}, dp 0) in "
                                   "megatron's rank order; unsupported rank order")
                yield ps.get_model_parallel_group().rank(), wrap_ddp(build_chunks(args), args,
                                                                     mamba_conv1d_module)


def storage_keys(model) -> dict[int, tuple[str, tuple[int, ...], list[str]]]:
    """id(param) -> (torch_dist key, indices along its stacked axes, the keys of its sections), from
    sharded_state_dict. Sections: a factory whose pieces carry different keys (Mamba's in_proj
    `.z/.x/.B/.C/.dt`, conv1d `.x/.B/.C`) stores the parameter as one tensor per section, in
    this order along the TP axis (`param_spec.sections`); [key] otherwise."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.utils import unwrap_model

    out = {}
    for entry in declared_state_dict(unwrap_model(model)).values():
        if isinstance(entry, ShardedTensorFactory):
            subs = [t for t in flatten(entry.build()) if isinstance(t, ShardedTensor)]
        elif isinstance(entry, ShardedTensor):
            subs = [entry]
        else:
            continue
        first, p = subs[0], subs[0].prepend_axis_num
        out[id(entry.data)] = (first.key, tuple(first.global_offset[:p]),
                               list(dict.fromkeys(t.key for t in subs)))
    return out


@dataclasses.dataclass
class Param:
    """Where one universal parameter lives in the torch_dist checkpoint."""

    spec: dict
    key: str  # torch_dist model key (stacked)
    index: tuple[int, ...]  # position along the stacked axes
    # dp_reshardable: (flat-bucket key prefix, start in that bucket, numel, pieces)
    slabs: list = dataclasses.field(default_factory=list)
    # a persistent buffer (MoE router expert_bias): its dtype in the model, which Megatron-LM
    # keeps (fp32 in a bf16 run); it has no optimizer state
    buffer_dtype: torch.dtype | None = None
    # a parameter stored in sections (spec["tp_sections"]): each section's key, in order along the
    # TP axis (`storage_keys`); None: the one tensor `key`
    section_keys: list[str] | None = None

    def parts(self) -> list[tuple[str, tuple[slice, ...], tuple[int, ...]]]:
        """(torch_dist key, its box in the universal tensor, its shape) of each stored tensor of
        this parameter: the whole parameter, or one per section along the TP axis."""
        shape = tuple(self.spec["shape"])
        if not self.section_keys:
            return [(self.key, tuple(slice(None) for _ in shape), shape)]
        axis, sizes = self.spec["tp_axis"], self.spec["tp_sections"]
        out, start = [], 0
        for key, n in zip(self.section_keys, sizes):
            box = tuple(slice(start, start + n) if d == axis else slice(None) for d in range(len(shape)))
            out.append((key, box, shape[:axis] + (n,) + shape[axis + 1:]))
            start += n
        return out

    def stored(self, read, index: tuple[int, ...] | None = None) -> torch.Tensor:
        """The parameter put together from its stored tensors: `read(key)` -> the stored (stacked)
        tensor, each taken at `index` (default: this parameter's)."""
        at = self.index if index is None else index
        parts = [read(key)[at] for key, _, _ in self.parts()]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.spec["tp_axis"])


def plan_model(args, objects: dict | None = None) -> tuple[dict[str, Param], dict]:
    """Universal params (in storage-key order) and the model config, from the run's model rebuilt
    whole on one rank (TP1/PP1, world 1, rank 0). objects: filled with every ShardedObject of that
    model, unique key -> (its data, its universal name where it is an `_extra_state`, else None)."""
    from megatron.core.utils import unwrap_model

    one = single_rank_args(args)
    with source_rank(one, 0):
        model = build_chunks(one)[0]
        if objects is not None:
            names = {u: n for u, n in object_names(unwrap_model(model)).values()}
            objects.update({u: (data, names.get(u)) for u, data in sharded_objects(model).items()})
        keys = storage_keys(model)
        plan = {}
        for lp in local_params([model]):
            if id(lp.param) not in keys:
                raise UCPError(f"parameter {lp.local_name!r} has no sharded_state_dict key")
            key, index, section_keys = keys[id(lp.param)]
            if bool(lp.spec.tp_sections) != (len(section_keys) > 1) or (
                    lp.spec.tp_sections and len(section_keys) != len(lp.spec.tp_sections)):
                raise UCPError(f"parameter {lp.local_name!r}: sharded_state_dict keys {section_keys} "
                               f"do not match its sections {lp.spec.tp_sections}")
            plan[lp.spec.name] = Param(lp.spec.to_json(), key, (*index, *lp.stack_index),
                                       buffer_dtype=lp.param.dtype if lp.spec.buffer else None,
                                       section_keys=section_keys if len(section_keys) > 1 else None)
        cfg = model_config([model], args)
        del model
    plan = dict(sorted(plan.items(), key=lambda kv: (kv[1].key, kv[1].index)))
    return plan, cfg


def sharded_objects(model) -> dict[str, object]:
    """unique key (e.g. `decoder.layers.mlp.linear_fc1._extra_state/shard_2_3`) -> data, for every
    ShardedObject of the whole model rebuilt on one rank (the `_extra_state` entries)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.utils import unwrap_model

    return {v.unique_key: v.data for v in declared_state_dict(unwrap_model(model)).values()
            if isinstance(v, ShardedObject)}


def object_value(data) -> list:
    """A ShardedObject as megatron-core's torch_dist strategy stores it: `[data]` (it saves
    torch.save([sh_obj.data]); DefaultSavePlanner torch.saves every non-tensor value itself)."""
    return [data]
