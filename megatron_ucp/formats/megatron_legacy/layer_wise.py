"""megatron-core 0.19's LayerWiseDistributedOptimizer (`--optimizer muon|lion` with
`--use-distributed-optimizer`) in a `--ckpt-format torch` checkpoint written at a target layout.

Each DP rank of a rank directory saves `layer_wise_optimizer_<dp>.pt` (`save_state_dict_to_file`):
a list, one `Float16OptimizerWithFloat16Params.state_dict()` per chained optimizer, of that rank's
own parameters only, by position: `optimizer.state[i]` (Muon `momentum_buffer`, Lion `exp_avg`,
Adam `step` [a tensor], `exp_avg`, `exp_avg_sq`), `optimizer.param_groups` (hyper-parameters and
`params`, the positions) and `fp32_from_fp16_params[group][j]`, the masters; `model_optim_rng.pt`'s
`optimizer` is DP rank 0's. Which parameters a rank owns, and in which group order, is
megatron-core's own assignment, read off the optimizer it builds at that target rank
(`megatron_rebuild.layer_wise_optimizers`, as the reader does); each group takes the source's
hyper-parameters of the group of its identity (`formats.megatron_layer_wise.group_from_source`).
"""

from __future__ import annotations

import torch

from megatron_ucp.formats.megatron_layer_wise import (
    chain_family,
    check_chain_family,
    group_from_source,
)
from megatron_ucp.formats.megatron_legacy.layout import layer_wise_ranks
from megatron_ucp.formats.megatron_rebuild import build_chunks, layer_wise_optimizers, source_rank
from megatron_ucp.local_slice import read_local
from megatron_ucp.param_spec import local_params
from megatron_ucp.spec import OPTIMIZER_STATES


def rank_dir_files(source, args, name: str) -> dict[int, list]:
    """data-parallel rank -> what its `layer_wise_optimizer_<dp>.pt` holds, for every DP rank
    whose state rank directory `name` keeps."""
    out = {}
    for dp, rank in layer_wise_ranks(args, name):
        with source_rank(args, rank):  # (meta tensors: only the layout is taken inside)
            chunks = build_chunks(args)
            lps = {id(lp.param): lp for lp in local_params(chunks)}
            chains = [(chain_family(o), [({k: v for k, v in g.items() if k != "params"},
                                          [lps[id(p)] for p in g["params"]]) for g in o.param_groups])
                      for o in layer_wise_optimizers(chunks, args)]
        out[dp] = [_optimizer_state(source, c, fam, groups) for c, (fam, groups) in enumerate(chains)]
    return out


def _optimizer_state(source, c: int, fam: str, groups: list) -> dict:
    """One chained optimizer's Float16OptimizerWithFloat16Params.state_dict() on one DP rank (its
    torch optimizer of family `fam`)."""
    saved = source.manifest.optimizer.get("param_groups", [])
    check_chain_family(source, c, fam, [lp.spec.name for _, held in groups for lp in held])
    state, param_groups, masters, index = {}, [], [], 0
    for hyper, held in groups:
        ids, group_masters = [], []
        for lp in held:
            shape = tuple(lp.param.shape)
            group_masters.append(read_local(source, lp, "param", 0, lp.numel).view(shape))
            entry = {"step": torch.tensor(float(source.step(lp.spec.name)))} if fam == "adam" else {}
            for s in OPTIMIZER_STATES[fam]:
                entry[s] = read_local(source, lp, s, 0, lp.numel).view(shape)
            state[index] = entry
            ids.append(index)
            index += 1
        param_groups.append({**group_from_source(hyper, saved, source.dir), "params": ids})
        masters.append(group_masters)
    return {"optimizer": {"state": state, "param_groups": param_groups}, "fp32_from_fp16_params": masters}
