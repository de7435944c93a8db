"""Reading and writing megatron-core DistributedOptimizer state through its own range maps.

Each DP rank owns a contiguous range of every parameter's flattened elements (possibly empty); the
optimizer's range map says which (`mcore_compat.optimizer.param_range`). Main (fp32) params and
Adam moments are read and written in place through the accessors the optimizer's own checkpoint
code uses (megatron-core's private methods, called only through `mcore_compat.optimizer`).

The Adam step lives in one of two places: torch's Adam/AdamW keep a `step` tensor in every
parameter's state; Transformer Engine's and Apex's FusedAdam (what megatron-core picks when either
is installed) keep one `step` per param group. Both are read and written here.
"""

from __future__ import annotations

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron_ucp.errors import UCPError
from megatron_ucp.mcore_compat import optimizer as mcore_optimizer
from megatron_ucp.spec import STATES

# is_expert_parallel is not part of the identity: at EP1 experts join the dense optimizer
GROUP_KEYS = ("wd_mult", "lr_mult", "is_decoupled_lr")


def distributed_optimizers(optimizer) -> list[DistributedOptimizer]:
    opts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for o in opts:
        if not isinstance(o, DistributedOptimizer):
            raise UCPError(f"optimizer {type(o).__name__} is not megatron-core's DistributedOptimizer;"
                           " build it with OptimizerConfig(use_distributed_optimizer=True)")
        if o.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            raise UCPError("precision-aware optimizer state is not supported by megatron-ucp v1")
    return opts


class OptimizerIndex:
    """Which DistributedOptimizer owns each model param, and the element range this rank holds."""

    def __init__(self, optimizer):
        self.opts = distributed_optimizers(optimizer)
        self.owner = {p: o for o in self.opts for p in o.model_param_group_index_map}

    def shard_range(self, param: torch.nn.Parameter) -> tuple[int, int] | None:
        o = self.owner.get(param)
        if o is None:
            return None
        start, end = mcore_optimizer.param_range(o, param)
        return (start, end) if end > start else None

    def region_range(self, lp) -> tuple[tuple[int, int], int, int] | None:
        """(shard, a, b): this rank's optimizer shard of `lp`'s parameter (a LocalParam) and the
        part [a, b) of it inside `lp`'s universal-tensor region, as flat indices of the parameter
        (a fused expert weight has several regions); None when the rank holds none of the region."""
        shard = self.shard_range(lp.param)
        if shard is None:
            return None
        a, b = max(shard[0], lp.base), min(shard[1], lp.base + lp.numel)
        return (shard, a, b) if b > a else None

    def _group(self, param: torch.nn.Parameter) -> dict:
        o = self.owner[param]
        return o.optimizer.param_groups[o.model_param_group_index_map[param][0]]

    def get(self, param: torch.nn.Parameter) -> tuple[dict[str, torch.Tensor], float | torch.Tensor]:
        """This rank's shard of the fp32 master weight and Adam moments (on the optimizer's device,
        not copied), plus the Adam step as the optimizer holds it (`staging.steps_to_floats`
        converts many at once without a device sync per parameter)."""
        o = self.owner[param]
        states = mcore_optimizer.main_param_and_optimizer_states(o, param)
        if "exp_avg" not in states:
            raise UCPError("the optimizer has no Adam state yet (no step taken); nothing to save")
        step = states["step"] if "step" in states else self._group(param).get("step", 0)
        return {k: states[k].detach() for k in STATES}, step

    def ensure_state(self) -> None:
        """Create Adam state tensors if the optimizer has not stepped yet (they are overwritten)."""
        for o in self.opts:
            if any(len(o.optimizer.state.get(p, {})) == 0
                   for g in o.optimizer.param_groups for p in g["params"]):
                mcore_optimizer.init_optimizer_states(o)

    def states(self, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        """This rank's shard of `param`'s fp32 master weight and Adam moments: the optimizer's own
        tensors (on its device), which a load fills in place (`set_step` then sets the step)."""
        tensors = mcore_optimizer.main_param_and_optimizer_states(self.owner[param], param)
        missing = [k for k in STATES if k not in tensors]
        if missing:
            raise UCPError(f"the optimizer has no {missing} state for a parameter; call ensure_state()")
        return {k: tensors[k] for k in STATES}

    @torch.no_grad()
    def set_step(self, param: torch.nn.Parameter, step: float) -> None:
        """Set the Adam step of `param` where this optimizer keeps it (torch Adam: per parameter;
        FusedAdam: per param group)."""
        o = self.owner[param]
        gi, go = o.model_param_group_index_map[param]
        group = o.optimizer.param_groups[gi]
        if not isinstance(o.optimizer, (torch.optim.Adam, torch.optim.AdamW)):  # FusedAdam: per group
            old = group.get("step")
            group["step"] = (torch.full_like(old, int(step)) if torch.is_tensor(old) else int(step))
            return
        state = o.optimizer.state[group["params"][go]]
        # Each parameter gets its own step tensor: a shared one would be incremented once per
        # parameter per iteration (megatron-core 0.16.1's own legacy load path does that).
        old = state.get("step")
        state["step"] = (torch.full_like(old, step) if torch.is_tensor(old)
                         else torch.tensor(step, dtype=torch.float32))

    def param_groups(self) -> list[dict]:
        """JSON-able hyper-parameters of every param group, in order (no tensors, no params)."""
        out = []
        for i, o in enumerate(self.opts):
            for g in o.optimizer.param_groups:
                # a FusedAdam group's step is saved per parameter with the fragments, like torch's
                out.append({"optimizer": i, **{k: _jsonable(v) for k, v in g.items()
                                               if k not in ("params", "step")
                                               and _jsonable(v) is not None}})
        return out

    def load_param_groups(self, saved: list[dict]) -> None:
        """Restore hyper-parameters into groups with the same identity keys (wd_mult, lr_mult...)."""
        for i, o in enumerate(self.opts):
            for g in o.optimizer.param_groups:
                ident = tuple(g.get(k) for k in GROUP_KEYS)
                # by identity, not position: the number of chained optimizers depends on the layout
                match = [s for s in saved if tuple(s.get(k) for k in GROUP_KEYS) == ident]
                if not match:
                    raise UCPError(f"optimizer {i} has a param group {dict(zip(GROUP_KEYS, ident))}"
                                   " that the checkpoint does not have; the optimizer config differs")
                for k, v in match[0].items():
                    if k != "optimizer" and k in g:
                        g[k] = tuple(v) if isinstance(g[k], tuple) else v

    def grad_scaler(self) -> dict | None:
        """fp16 dynamic loss-scaler state (scale, growth and hysteresis trackers) as JSON."""
        scaler = self.opts[0].grad_scaler
        if scaler is None or not scaler.state_dict():
            return None
        return {k: _jsonable(v) for k, v in scaler.state_dict().items()}

    def load_grad_scaler(self, saved: dict | None) -> None:
        for o in self.opts:
            if o.grad_scaler is not None and o.grad_scaler.state_dict():
                if saved is None:
                    continue  # trained without a loss scaler (bf16/fp32): keep the configured one
                o.grad_scaler.load_state_dict({**saved, "scale": torch.tensor(saved["scale"])})

    def copy_main_to_model(self, model_chunks: list) -> None:
        """Write the loaded master weights into the model weights and all-gather them over DP."""
        for o in self.opts:
            mcore_optimizer.copy_main_params_to_model_params(o)
        for chunk in model_chunks:
            chunk.start_param_sync(force_sync=True)


def _jsonable(v):
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (tuple, list)) and all(isinstance(x, (bool, int, float, str)) for x in v):
        return list(v)
    if torch.is_tensor(v) and v.numel() == 1:
        return v.item()
    return None
