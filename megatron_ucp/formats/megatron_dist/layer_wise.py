"""megatron-core 0.19's LayerWiseDistributedOptimizer (`--optimizer muon|lion` with
`--use-distributed-optimizer`) in a torch_dist checkpoint written at a target layout.

Its `sharded_state_dict` keeps each chained optimizer's states in model space at global shape,
`chained_<i>.optimizer.state.<fp32_param | state>.<model key>` (`layout.layer_wise_key`), every
replica id 0 (whole parameters, one owner per DP group): nothing depends on the layout but which
chain holds a parameter. The common state's `optimizer` is `{i: {"optimizer": {"param_groups":
[...]}}}` per chain, an Adam chain with `"state": {"common_step": tensor(step)}` (Muon and Lion
count no step). Everything is taken from the optimizer megatron-core itself builds from the
target's args (`megatron_rebuild.layer_wise_optimizers`): the whole model on one rank for each
parameter's chain, the target's rank 0 for the param groups (rank 0 writes the common state).
Each rebuilt group takes the source's hyper-parameters of the group with the same identity
(`param_group_identifier_keys`, the tuple megatron-core's load pairs groups by).
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.megatron_dist.layout import layer_wise_key
from megatron_ucp.formats.megatron_layer_wise import (
    chain_family,
    check_chain_family,
    group_from_source,
)
from megatron_ucp.formats.megatron_rebuild import (
    build_chunks,
    layer_wise_optimizers,
    single_rank_args,
    source_rank,
)
from megatron_ucp.param_spec import local_params
from megatron_ucp.spec import OPTIMIZER_STATES

# what the LayerWise save's common state says (it keeps no flat buffers, whatever it says)
LAYER_WISE_CONTENT = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
                      "chained_optim_avoid_prefix": True}


@dataclasses.dataclass
class LayerWisePlan:
    chain: dict[str, int | None]  # universal name -> its chained optimizer (None: only one)
    family: dict[str, str]
    optimizer: dict  # the common state's `optimizer`

    def keys(self, name: str, part_key: str) -> dict[str, str]:
        """state -> torch_dist key of every optimizer tensor of one stored part of `name`."""
        return {s: layer_wise_key(self.chain[name], s, part_key)
                for s in ("param", *OPTIMIZER_STATES[self.family[name]])}


def plan(source, args) -> LayerWisePlan:
    """Each parameter's chain and family, and the common state's optimizer, for a torch_dist
    checkpoint of `source` at the layout `args` describe."""
    params = {n: p for n, p in source.manifest.params.items() if not p.spec.buffer}
    if getattr(args, "num_experts", None):
        raise UCPError(f"{source.dir}: a MoE run in the LayerWiseDistributedOptimizer: its expert "
                       "optimizers are not mapped by the torch_dist writer")
    one = single_rank_args(args)
    with source_rank(one, 0):
        chunks = build_chunks(one)
        names = {id(lp.param): lp.spec.name for lp in local_params(chunks) if lp.canonical}
        opts = layer_wise_optimizers(chunks, one)
        members = [[names[id(p)] for g in o.param_groups for p in g["params"] if id(p) in names]
                   for o in opts]
        fams = [chain_family(o) for o in opts]
    with source_rank(args, 0):  # the target's rank 0, which writes the common state
        groups = [[{k: v for k, v in g.items() if k != "params"} for g in o.param_groups]
                  for o in layer_wise_optimizers(build_chunks(args), args)]
    if len(groups) != len(members):
        raise UCPError(f"the LayerWise optimizer rebuilt from args chains {len(members)} optimizers "
                       f"on one rank but {len(groups)} at the target's rank 0; not mapped")
    multi = len(members) > 1
    chain = {n: (c if multi else None) for c, held in enumerate(members) for n in held}
    missing = sorted(set(params) - set(chain))
    if missing:
        raise UCPError(f"{source.dir}: parameter(s) {missing[:3]} are in no optimizer of the "
                       "LayerWiseDistributedOptimizer rebuilt from the args")
    family = {n: params[n].spec.optimizer for n in chain}
    optimizer = {}
    for c, held in enumerate(members):
        check_chain_family(source, c, fams[c], held)
        saved = source.manifest.optimizer.get("param_groups", [])
        entry = {}  # (in the order megatron-core's save has it)
        steps = {float(source.step(n)) for n in held}
        if fams[c] == "adam":
            if len(steps) != 1:
                raise UCPError(f"{source.dir}: the Adam parameters of chained optimizer {c} are at "
                               f"steps {sorted(steps)}; megatron-core keeps one (common_step)")
            entry["state"] = {"common_step": torch.tensor(steps.pop())}
        entry["param_groups"] = [group_from_source(g, saved, source.dir) for g in groups[c]]
        optimizer[c] = {"optimizer": entry}
    return LayerWisePlan(chain, family, optimizer if multi else optimizer[0])
