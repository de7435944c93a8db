"""Reading and writing megatron-core optimizer state through the optimizers' own tensors.

megatron-core wraps each torch optimizer in one of three ways; a run chains several (dense and
expert parameters, Muon's matrices and Adam's rest). Each wrapper is a `_Unit` here, which says for
every model parameter it manages which elements this rank writes at a save and fills at a load:

- `DistributedOptimizer` (`--use-distributed-optimizer`): each DP rank owns a contiguous range of
  every parameter's flattened elements (possibly empty), by its range map
  (`mcore_compat.optimizer.param_range`); it writes and fills that range.
- `Float16OptimizerWithFloat16Params` / `FP32Optimizer` (plain DDP): every DP rank holds the full
  state of its TP/PP slice; the first DP replica writes it, every replica fills it.
- `LayerWiseDistributedOptimizer` (Muon, `--optimizer muon`): whole parameters are assigned to DP
  ranks; the owner writes and fills the state, and every rank reads the weights of the parameters
  it does not own (the owner's all-gather would bring them).

The torch optimizer inside sets the state's family (`spec.OPTIMIZER_STATES`: Adam's moments,
Lion's momentum, SGD's and Muon's momentum buffer). Master weights and states are read and written
in place through the accessors the optimizers' own checkpoint code uses (megatron-core's private
methods, called only through `mcore_compat.optimizer`).

The Adam step lives in one of two places: torch's Adam/AdamW keep a `step` tensor in every
parameter's state; Transformer Engine's and Apex's FusedAdam (what megatron-core picks when either
is installed) keep one `step` per param group. Both are read and written here.

The precision-aware optimizer (`--use-precision-aware-optimizer`, TE's FusedAdam inside the
DistributedOptimizer) keeps its state in its own dtypes; the universal form holds their fp32 values
(`_PrecisionAwareUnit`).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

from megatron_ucp import precision_aware
from megatron_ucp.errors import UCPError
from megatron_ucp.mcore_compat import optimizer as mcore_optimizer
from megatron_ucp.optimizer_family import SUPPORTED, _qualname, family, hyperparameters
from megatron_ucp.spec import OPTIMIZER_STATES, UNRESHARDABLE_STATES

# is_expert_parallel is not part of the identity: at EP1 experts join the dense optimizer
GROUP_KEYS = ("wd_mult", "lr_mult", "is_decoupled_lr")
class _Unit:
    """One megatron-core optimizer wrapper and the model parameters it manages on this rank."""

    wrapper: object  # the MegatronOptimizer (or, inside LayerWise, a bare torch optimizer)
    torch_optimizer: torch.optim.Optimizer
    outer = ""  # the optimizer that chains it ("LayerWiseDistributedOptimizer/"), as inspect shows
    # model param -> (its main param in torch_optimizer, group index); a DistributedOptimizer's
    # main params are its shards, reached through its accessors (None here)
    main: dict

    def save_range(self, param) -> tuple[int, int] | None:
        raise NotImplementedError

    def load_range(self, param) -> tuple[int, int] | None:
        raise NotImplementedError

    def family(self, param) -> str:
        return family(self.torch_optimizer, self.group(param))

    def group(self, param) -> dict:
        return self.torch_optimizer.param_groups[self.main[param][1]]

    def state_of(self, param) -> dict:
        return self.torch_optimizer.state[self.main[param][0]]

    def tensors(self, param) -> dict[str, torch.Tensor]:
        """{"param": the main weight, state: tensor} over this rank's range, flat, live."""
        main = self.main[param][0]
        state = self.state_of(param)
        return {"param": main.view(-1), **{k: v.view(-1) for k, v in state.items()
                                           if torch.is_tensor(v) and k != "step"}}

    def ensure_state(self) -> None:
        """Zero state tensors where the optimizer has none yet (a load overwrites them)."""
        for main, gi in self.main.values():
            fam = family(self.torch_optimizer, self.torch_optimizer.param_groups[gi])
            state = self.torch_optimizer.state[main]
            for k in OPTIMIZER_STATES[fam]:
                if k not in state:
                    state[k] = torch.zeros_like(main)
            if fam == "adam" and "step" not in state and isinstance(
                    self.torch_optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                state["step"] = torch.tensor(0.0, dtype=torch.float32)

    def load_tensors(self, param, weights_only: bool) -> dict[str, torch.Tensor]:
        """The tensors a load fills (`flush` then hands them to the optimizer): its own."""
        return self.tensors(param)

    def flush(self, param=None) -> None:
        pass

    def copy_main_to_model(self) -> None:
        pass  # the main params are the model's (fp32) or copied by the wrapper (Float16)

    def unowned(self) -> list:
        """Model params this unit manages on other ranks only: their weights are read whole."""
        return []


class _DistributedUnit(_Unit):
    def __init__(self, opt: DistributedOptimizer) -> None:
        self.wrapper, self.torch_optimizer = opt, opt.optimizer
        self.main = {p: (None, gi) for p, (gi, _) in opt.model_param_group_index_map.items()}

    def save_range(self, param):
        start, end = mcore_optimizer.param_range(self.wrapper, param)
        return (start, end) if end > start else None

    load_range = save_range

    def group(self, param) -> dict:
        return self.torch_optimizer.param_groups[self.wrapper.model_param_group_index_map[param][0]]

    def _shard(self, param) -> torch.Tensor:
        """The torch optimizer's param for `param`: this rank's shard (its main param, or under the
        precision-aware optimizer a view of the model's weight)."""
        gi, go = self.wrapper.model_param_group_index_map[param]
        return self.torch_optimizer.param_groups[gi]["params"][go]

    def state_of(self, param) -> dict:
        return self.torch_optimizer.state[self._shard(param)]

    def tensors(self, param):
        states = mcore_optimizer.main_param_and_optimizer_states(self.wrapper, param)
        return {k: v for k, v in states.items() if k not in ("step", "master_param")}

    def ensure_state(self) -> None:
        if any(len(self.torch_optimizer.state.get(p, {})) == 0
               for g in self.torch_optimizer.param_groups for p in g["params"]):
            mcore_optimizer.init_optimizer_states(self.wrapper)

    def copy_main_to_model(self) -> None:
        opt = self.torch_optimizer
        if isinstance(opt, HybridDeviceOptimizer):
            # CPU offload: its sub-optimizers update copies of the main params (a host copy of a
            # device shard, an fp32 copy of a low-precision one) and copy them back after each
            # step; a load wrote the main params, so the copies take their values
            with torch.no_grad():
                for p, inner in opt.param_to_inner_param.items():
                    if inner is not p:
                        inner.copy_(p)
        mcore_optimizer.copy_main_params_to_model_params(self.wrapper)


class _PrecisionAwareUnit(_DistributedUnit):
    """`--use-precision-aware-optimizer`: TE's FusedAdam holds the state in its own dtypes; the
    universal form and a load's staging hold their fp32 values (`precision_aware`)."""

    def __init__(self, opt: DistributedOptimizer) -> None:
        super().__init__(opt)
        if isinstance(self.torch_optimizer, HybridDeviceOptimizer):
            raise UCPError("the precision-aware optimizer (--use-precision-aware-optimizer) with "
                           "--optimizer-cpu-offload is not supported by megatron-ucp: train with one "
                           "of them: such a run can neither save nor load (not even with "
                           "reset_optimizer)")
        self._staged: dict = {}

    def tensors(self, param):
        return precision_aware.read(self.torch_optimizer, self._shard(param))

    def load_tensors(self, param, weights_only: bool):
        if param not in self._staged:
            self._staged[param] = precision_aware.stage(self.torch_optimizer, self._shard(param),
                                                        weights_only)
        return self._staged[param]

    def flush(self, param=None) -> None:
        for p in list(self._staged) if param is None else [param] if param in self._staged else []:
            precision_aware.write(self.torch_optimizer, self._shard(p), self._staged.pop(p))


class _ReplicatedUnit(_Unit):
    """Float16OptimizerWithFloat16Params / FP32Optimizer / a bare torch optimizer: the full state
    of every parameter in its groups (this rank's TP/PP slice)."""

    def __init__(self, wrapper, torch_optimizer, owned_by_rank: bool = False,
                 others: tuple = ()) -> None:
        self.wrapper, self.torch_optimizer = wrapper, torch_optimizer
        self.owned_by_rank = owned_by_rank  # LayerWise: each param on one DP rank only
        self.others = others  # LayerWise: the params other DP ranks own
        model_of = {}  # main param -> model param (Float16 keeps an fp32 copy of bf16/fp16 ones)
        for model_group, main_group in zip(getattr(wrapper, "float16_groups", []),
                                           getattr(wrapper, "fp32_from_float16_groups", [])):
            model_of.update({id(m): p for p, m in zip(model_group, main_group)})
        self.main = {model_of.get(id(m), m): (m, gi)
                     for gi, g in enumerate(torch_optimizer.param_groups) for m in g["params"]}
        self._first_replica = {
            False: ps.get_data_parallel_rank(with_context_parallel=True) == 0,
            True: ps.get_expert_data_parallel_rank() == 0}

    def save_range(self, param):
        expert = getattr(param, "allreduce", True) is False
        if self.owned_by_rank or self._first_replica[expert]:
            return (0, param.numel())
        return None

    def load_range(self, param):
        return (0, param.numel())

    def copy_main_to_model(self) -> None:
        if isinstance(self.wrapper, Float16OptimizerWithFloat16Params):
            mcore_optimizer.copy_main_params_to_model_params(self.wrapper)

    def unowned(self) -> list:
        return list(self.others)


def _layer_wise_units(opt) -> list[_Unit]:
    """LayerWiseDistributedOptimizer: a `_ReplicatedUnit` per chained optimizer (a Float16
    wrapper in bf16 runs, else the bare torch optimizer) over the params this rank owns; the
    first also answers for the params other DP ranks own (`dp_cp_params_list`: one list a rank)."""
    inners = [(inner, getattr(inner, "optimizer", inner)) for inner in opt.chained_optimizers]
    mine = {id(m) for _, t in inners for g in t.param_groups for m in g["params"]}
    everyone = [p for lists in (opt.dp_cp_params_list, opt.expt_dp_params_list) if lists
                for rank_params in lists for p in rank_params]
    # (a Float16 wrapper's groups hold the fp32 copies: a model param is mine by its main_param)
    others = tuple(p for p in everyone if id(getattr(p, "main_param", p)) not in mine)
    units = [_ReplicatedUnit(inner, torch_opt, owned_by_rank=True, others=others if i == 0 else ())
             for i, (inner, torch_opt) in enumerate(inners)]
    for u in units:
        u.outer = "LayerWiseDistributedOptimizer/"
    return units


def _units(optimizer) -> list[_Unit]:
    # (LayerWise is a ChainedOptimizer itself: alone on its legacy path, else chained with a
    # DistributedOptimizer)
    layer_wise = type(optimizer).__name__ == "LayerWiseDistributedOptimizer"
    opts = [optimizer] if layer_wise else getattr(optimizer, "chained_optimizers", None) or [optimizer]
    units: list[_Unit] = []
    for o in opts:
        if type(o).__name__ == "LayerWiseDistributedOptimizer":
            units += _layer_wise_units(o)
        elif isinstance(o, DistributedOptimizer):
            aware = o.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            units.append(_PrecisionAwareUnit(o) if aware else _DistributedUnit(o))
        elif isinstance(o, (Float16OptimizerWithFloat16Params, FP32Optimizer)):
            units.append(_ReplicatedUnit(o, o.optimizer))
        elif getattr(o, "chained_optimizers", None):
            units += _units(o)  # a LayerWise chain inside the outer ChainedOptimizer
        else:
            raise UCPError(f"optimizer {_qualname(o)} is not supported by megatron-ucp (supported: "
                           f"{SUPPORTED}); build the optimizer with megatron-core's "
                           "get_megatron_optimizer")
    for u in units:  # every torch optimizer's family, now: an unknown one is refused at once
        for p in u.main:
            u.family(p)
    return units


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside megatron-core's `optimizer`, in chain order."""
    return [u.torch_optimizer for u in _units(optimizer)]


class OptimizerIndex:
    """Which optimizer unit owns each model param, and the element range this rank holds."""

    def __init__(self, optimizer):
        self.units = _units(optimizer)
        self.owner = {p: u for u in self.units for p in u.main}

    def family(self, param) -> str | None:
        u = self.owner.get(param)
        return None if u is None else u.family(param)

    def shard_range(self, param: torch.nn.Parameter, save: bool = False) -> tuple[int, int] | None:
        u = self.owner.get(param)
        if u is None:
            return None
        return u.save_range(param) if save else u.load_range(param)

    def region_range(self, lp, save: bool = False) -> tuple[tuple[int, int], int, int] | None:
        """(shard, a, b): this rank's optimizer shard of `lp`'s parameter (a LocalParam) and the
        part [a, b) of it inside `lp`'s universal-tensor region, as flat indices of the parameter
        (a fused expert weight has several regions); None when the rank holds none of the region.
        save: the elements this rank writes (one DP replica of a replicated state), else fills."""
        shard = self.shard_range(lp.param, save)
        if shard is None:
            return None
        a, b = max(shard[0], lp.base), min(shard[1], lp.base + lp.numel)
        return (shard, a, b) if b > a else None

    def unreshardable(self) -> list[tuple[str, str]]:
        """(class, family) of every optimizer of this run whose state megatron-ucp cannot lay out
        (`spec.UNRESHARDABLE_STATES`); by class, so that every rank answers alike, also one that
        holds none of its parameters."""
        out = []
        for u in self.units:
            opt = u.torch_optimizer  # (CPU offload: its sub-optimizers are torch's, never SOAP)
            fam = None if isinstance(opt, HybridDeviceOptimizer) else family(opt, {})
            if fam in UNRESHARDABLE_STATES and (_qualname(u.torch_optimizer), fam) not in out:
                out.append((_qualname(u.torch_optimizer), fam))
        return out

    def refuse_unreshardable_save(self) -> None:
        """A save of a run with such an optimizer is refused, naming it, what its state is and what
        can be done instead (before anything is written)."""
        for cls, fam in self.unreshardable():
            raise UCPError(f"optimizer {cls} (--optimizer {fam}) is not supported by megatron-ucp "
                           f"saves: {UNRESHARDABLE_STATES[fam]}. Save the run with Megatron-LM's "
                           "own checkpointing; megatron-ucp loads weights into a SOAP run from a "
                           "checkpoint of another optimizer with load(..., reset_optimizer=True) "
                           "(the SOAP state starts fresh at its first step)")

    def unowned(self) -> set:
        """Model params whose weights this rank reads whole (another DP rank owns their state)."""
        return {p for u in self.units for p in u.unowned()}

    def get(self, param: torch.nn.Parameter) -> tuple[dict[str, torch.Tensor], float | torch.Tensor]:
        """This rank's shard of the fp32 master weight and optimizer states (on the optimizer's
        device, not copied), plus the Adam step as the optimizer holds it (0 for an optimizer
        without one; `staging.steps_to_floats` converts many at once)."""
        tensors = self.states(param, missing="yet (no step taken); nothing to save")
        return {k: t.detach() for k, t in tensors.items()}, self._step(param)

    def _step(self, param):
        u = self.owner[param]
        state = u.state_of(param)
        if "step" in state:
            return state["step"]
        return u.group(param).get("step", 0)

    def ensure_state(self) -> None:
        """Create optimizer state tensors if the optimizer has not stepped yet (overwritten)."""
        for u in self.units:
            u.ensure_state()

    def states(self, param: torch.nn.Parameter, weights_only: bool = False,
               missing: str = "for a parameter; call ensure_state()",
               load: bool = False) -> dict[str, torch.Tensor]:
        """This rank's range of `param`'s master weight and optimizer states: the optimizer's own
        tensors (flat, on its device), which a load fills in place (`set_step` then sets the step).
        weights_only: the master weight alone (the state may not exist yet); missing: what the
        error says after the missing states' names. load: the tensors a load fills, handed to the
        optimizer by `flush` (fp32 stand-ins of the precision-aware optimizer's own)."""
        u = self.owner[param]
        tensors = u.load_tensors(param, weights_only) if load else u.tensors(param)
        if weights_only:
            return {"param": tensors["param"]}
        fam = u.family(param)
        absent = [k for k in OPTIMIZER_STATES[fam] if k not in tensors]
        if absent:
            raise UCPError(f"the optimizer has no {fam} state {absent} {missing}")
        return {k: tensors[k] for k in ("param", *OPTIMIZER_STATES[fam])}

    @torch.no_grad()
    def set_step(self, param: torch.nn.Parameter, step: float) -> None:
        """Set the Adam step of `param` where its optimizer keeps it: in the parameter's state
        (torch Adam, also under CPU offload), else in its param group (FusedAdam); an optimizer
        that counts no step keeps none."""
        u = self.owner[param]
        state, group = u.state_of(param), u.group(param)
        if "step" in state:
            # Each parameter gets its own step tensor: a shared one would be incremented once per
            # parameter per iteration (megatron-core 0.16.1's own legacy load path does that).
            old = state["step"]
            state["step"] = (torch.full_like(old, step) if torch.is_tensor(old)
                             else type(old)(step))
        elif "step" in group:
            old = group["step"]
            group["step"] = torch.full_like(old, int(step)) if torch.is_tensor(old) else int(step)

    def flush(self, param=None) -> None:
        """Hand what a load filled (`states(..., load=True)`) to the optimizers: `param`'s, or all."""
        for u in self.units if param is None else [self.owner[param]]:
            u.flush(param)

    def param_groups(self) -> list[dict]:
        """JSON-able hyper-parameters of every param group, in order (no tensors, no params)."""
        out = []
        for i, u in enumerate(self.units):
            for g in u.torch_optimizer.param_groups:
                # a FusedAdam group's step is saved per parameter with the fragments, like torch's
                out.append({"optimizer": i, **{k: _jsonable(v) for k, v in g.items()
                                               if k not in ("params", "step")
                                               and _jsonable(v) is not None}})
        return out

    def optimizers(self) -> list[dict]:
        """Each unit's classes and family, as the manifest records them (`inspect` shows them)."""
        out = []
        for u in self.units:
            # (rank 0's view: "-" where rank 0 holds none of the unit's parameters)
            entry = {"class": f"{u.outer}{_qualname(u.wrapper)}({_qualname(u.torch_optimizer)})",
                     "family": "+".join(sorted({u.family(p) for p in u.main})) or "-"}
            hyper = hyperparameters(u.torch_optimizer)
            if hyper:
                entry["hyperparameters"] = hyper
            if hyper.get("tp_mode") == "blockwise":
                entry["note"] = ("blockwise Muon orthogonalises each TP shard on its own: at another "
                                 "TP size the state continues exactly but the update rule differs")
            if note := precision_aware.note(hyper):
                entry["note"] = note
            out.append(entry)
        return out

    def load_param_groups(self, saved: list[dict]) -> None:
        """Restore hyper-parameters into groups with the same identity keys (wd_mult, lr_mult...,
        and megatron-core's own per-group optimizer name where it keeps one: a Muon run's Adam
        groups share the rest with its Muon groups)."""
        for i, u in enumerate(self.units):
            for g in u.torch_optimizer.param_groups:
                ident = _identity(g)
                # by identity, not position: the number of chained optimizers depends on the layout
                match = [s for s in saved if _identity(s) == ident]
                if not match:
                    raise UCPError(f"optimizer {i} has a param group {dict(zip(GROUP_KEYS, ident))}"
                                   " that the checkpoint does not have; the optimizer config differs")
                for k, v in match[0].items():
                    if k != "optimizer" and k in g:
                        g[k] = tuple(v) if isinstance(g[k], tuple) else v

    def _scalers(self) -> list:
        return [s for u in self.units if (s := getattr(u.wrapper, "grad_scaler", None)) is not None]

    def grad_scaler(self) -> dict | None:
        """fp16 dynamic loss-scaler state (scale, growth and hysteresis trackers) as JSON."""
        scalers = self._scalers()
        if not scalers or not scalers[0].state_dict():
            return None
        return {k: _jsonable(v) for k, v in scalers[0].state_dict().items()}

    def load_grad_scaler(self, saved: dict | None) -> None:
        for scaler in self._scalers():
            if scaler.state_dict():
                if saved is None:
                    continue  # trained without a loss scaler (bf16/fp32): keep the configured one
                scaler.load_state_dict({**saved, "scale": torch.tensor(saved["scale"])})

    def copy_main_to_model(self, model_chunks: list) -> None:
        """Write the loaded master weights into the model weights and all-gather them over DP."""
        for u in self.units:
            u.copy_main_to_model()
        if any(isinstance(u, _DistributedUnit) for u in self.units):
            for chunk in model_chunks:
                chunk.start_param_sync(force_sync=True)


def _identity(group: dict) -> tuple:
    """A param group's identity: GROUP_KEYS and megatron-core's `optimizer` name ("adam" for a
    Muon run's scalar groups; a manifest's integer `optimizer` is the chain index, no name)."""
    name = group.get("optimizer")
    return (*(group.get(k) for k in GROUP_KEYS), name if isinstance(name, str) else None)


def _jsonable(v):
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (tuple, list)) and all(isinstance(x, (bool, int, float, str)) for x in v):
        return list(v)
    if torch.is_tensor(v) and v.numel() == 1:
        return v.item()
    return None
