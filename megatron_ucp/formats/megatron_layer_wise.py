"""megatron-core 0.19's LayerWiseDistributedOptimizer (`--optimizer muon|lion`) as both Megatron-LM
writers (`megatron_dist/layer_wise.py`, `megatron_legacy/layer_wise.py`) meet it: the family of
each torch optimizer it chains, and param groups rebuilt from the target's args that take the
source's hyper-parameters of the group with the same identity (`param_group_identifier_keys`,
the tuple megatron-core's load pairs groups by)."""

from __future__ import annotations

import json

from megatron_ucp.errors import UCPError

FAMILIES = ("adam", "muon", "lion")  # the families of the torch optimizers LayerWise chains here


def identity(group: dict) -> tuple:
    """The tuple megatron-core's load pairs a saved param group with a current one by. A
    megatron-ucp manifest group's integer `optimizer` is its chain index, not megatron-core's
    `optimizer` key (a string, which it then overwrote): absent."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    return tuple(None if k == "optimizer" and not isinstance(group.get(k), str) else group.get(k)
                 for k in param_group_identifier_keys)


def chain_family(torch_optimizer) -> str:
    """The family of one torch optimizer chained in the LayerWise optimizer (its class)."""
    from megatron_ucp.optimizer_family import family

    groups = torch_optimizer.param_groups
    return family(torch_optimizer, groups[0] if groups else {})


def check_chain_family(source, c: int, fam: str, names: list[str]) -> None:
    """Every parameter chained optimizer `c` (of family `fam`) holds has state of that family in
    the source; a family megatron-ucp does not write is refused by name."""
    have = sorted({source.manifest.params[n].spec.optimizer for n in names})
    if fam not in FAMILIES or have not in ([], [fam]):
        raise UCPError(f"{source.dir}: chained optimizer {c} of the LayerWiseDistributedOptimizer "
                       f"rebuilt from the args is {fam}, its parameters (e.g. {names[:2]}) have "
                       f"{'/'.join(have)} state in the checkpoint; the args do not describe the run "
                       f"that trained this state (megatron-ucp writes {list(FAMILIES)} state)")


def group_from_source(target: dict, saved: list[dict], where) -> dict:
    """A rebuilt param group with the hyper-parameters of the source's group of its identity."""
    want = identity(target)
    found = {json.dumps(_hyper(g), sort_keys=True): g for g in saved if identity(g) == want}
    if len(found) != 1:
        raise UCPError(f"{where}: {'no' if not found else len(found)} param groups of the checkpoint "
                       f"match the target's group {want} (megatron-core pairs saved and current "
                       "groups by these keys); the args do not describe this checkpoint's optimizer"
                       f"; the checkpoint has {[identity(g) for g in saved]}")
    out = dict(target)
    for k, v in _hyper(next(iter(found.values()))).items():
        out[k] = tuple(v) if isinstance(v, list) and (isinstance(out.get(k), tuple) or k == "betas") else v
    return out


def _hyper(group: dict) -> dict:
    """A manifest param group's hyper-parameters: without the step (per parameter) and the chain
    index (an integer `optimizer`; megatron-core's own `optimizer` key is a string)."""
    return {k: v for k, v in group.items()
            if k != "step" and not (k == "optimizer" and not isinstance(v, str))}
