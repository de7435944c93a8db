"""Megatron-LM's FSDP checkpoints (`--ckpt-format fsdp_dtensor` / `torch_dcp`) as a source.

Both store each tensor at global shape (`layout`), so no layout rule is needed: the universal
names, shapes and the model parameter each one is stored as come from the model rebuilt from the
checkpoint's `args` on one rank (`param_spec.local_params`).

fsdp_dtensor (Megatron-FSDP) names every tensor after its parameter:
* `param` is the stored model tensor itself: Megatron-FSDP's state dict holds the fp32 main
  weights (its training-dtype model weights are not saved);
* `exp_avg`, `exp_avg_sq` are `optimizer.state.<prefix><name>.<state>`;
* the Adam step is the per-parameter `step` of torch's AdamW (`optimizer.state...step`), or the
  param group's `step` of Transformer Engine's FusedAdam (`param_to_group_meta`);
* the param groups are the distinct `param_to_group_meta` entries.

torch_dcp (torch FSDP2 with megatron-core's Float16Optimizer) addresses the optimizer state by
position: `optimizer.fp32_from_fp16_params.<group>.<i>` and `optimizer.optimizer.state.<n>.*`.
Which parameter is at which position is megatron-core's own param-group construction on the
rebuilt model (`mcore_compat.megatron_param_groups`), checked against the stored groups (their
positions and hyper-parameters) and shapes; every master weight read is checked bitwise against
the stored model weight (the training dtype).

Every stored tensor must be used and every parameter's states present: nothing is dropped or
guessed. Runs whose stored names need the rewriting megatron-core does for them on save
(SwiGLU's split fc1, MoE experts) and TP/PP/CP/VPP runs are refused: not covered by a fixture.
"""

from __future__ import annotations

import argparse
import logging
import re
import time
from pathlib import Path

import torch

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.base import RunFields, Source
from megatron_ucp.formats.dcp_reader import DistReader, ReadsDcp
from megatron_ucp.formats.manifest import Manifest, ParamEntry
from megatron_ucp.formats.megatron_common import (
    check_supported,
    group_json,
    jsonable_tree,
    layout,
    resolve_iteration,
    world,
)
from megatron_ucp.formats.megatron_fsdp.layout import (
    FSDP2_GROUP_PREFIX,
    FSDP2_MASTER_PREFIX,
    FSDP2_STATE_PREFIX,
    FSDP_DTENSOR,
    GROUP_META_PREFIX,
    STATE_PREFIX,
    TORCH_DCP,
    is_iteration,
    kind_of_keys,
    strip_wrappers,
)
from megatron_ucp.formats.megatron_rebuild import (
    build_chunks,
    model_config,
    single_rank_args,
    source_rank,
)
from megatron_ucp.mcore_compat import megatron_param_groups
from megatron_ucp.param_spec import local_params
from megatron_ucp.spec import ParamSpec

log = logging.getLogger(__name__)
MOMENTS = ("exp_avg", "exp_avg_sq")
RESAVE = ("load it in Megatron-LM (same version and flags) and save it again with "
          "--ckpt-format torch_dist (--dist-ckpt-optim-fully-reshardable) or --ckpt-format torch "
          "and the distributed optimizer, then convert that")


def open_reader(load_dir: str | Path, trust_pickle: bool) -> tuple[DistReader, int | None, str]:
    """(reader, iteration from the directory name, which FSDP form)."""
    ckpt, iteration = resolve_iteration(load_dir, is_iteration, "--ckpt-format fsdp_dtensor / torch_dcp")
    reader = DistReader(ckpt, trust_pickle=trust_pickle)
    kind = kind_of_keys(reader.meta)
    if kind is None:
        raise UCPError(f"{ckpt}: a torch.distributed.checkpoint directory without Megatron-LM's "
                       "'args' and 'model.*' entries; not a Megatron-LM fsdp_dtensor / torch_dcp "
                       "save (a torch_dist save also has metadata.json)")
    return reader, iteration, kind


def training_args(args, where: Path | str, form: str) -> argparse.Namespace:
    """The run's args as a DDP + distributed-optimizer run of the same model: what the model is
    rebuilt from and what a Megatron-LM target written from this source carries (its optimizer
    state is the distributed optimizer's; resume it without the FSDP flags)."""
    a = argparse.Namespace(**vars(args))
    for flag in ("use_megatron_fsdp", "use_custom_fsdp", "use_torch_fsdp2"):
        if hasattr(a, flag):
            setattr(a, flag, False)
    a.use_distributed_optimizer = True
    problems = []
    lay = layout(a)
    if lay.tp > 1 or lay.pp > 1 or lay.cp > 1 or lay.vpp:
        problems.append(f"layout {lay}: only data-parallel FSDP runs (TP1 PP1 CP1) are read")
    if getattr(a, "use_mup", False):
        problems.append("--use-mup: its param-group overrides are not rebuilt")
    if getattr(a, "swiglu", False):
        problems.append("--swiglu: megatron-core stores fc1 split in two (handle_swiglu_in_state_dict)")
    if getattr(a, "num_experts", None):
        problems.append("MoE: megatron-core renames the expert tensors (handle_experts_in_state_dict)")
    if problems:
        raise UCPError(f"{where}: this Megatron-LM --ckpt-format {form} checkpoint is not supported: "
                       + "; ".join(problems) + f"; {RESAVE}")
    check_supported(a, where)
    return a


def unwrap_model(model):
    from megatron.core.utils import unwrap_model

    return unwrap_model(model)


def _plan(args) -> tuple[dict[str, tuple[dict, str]], dict]:
    """{universal name: (spec json, the model's own parameter name)} and the model config, from
    the model rebuilt from args on one rank (the names the FSDP state dict uses, wrappers off)."""
    one = single_rank_args(args)
    with source_rank(one, 0):
        chunks = build_chunks(one)
        names = {id(p): n for n, p in unwrap_model(chunks[0]).named_parameters()}
        plan = {}
        for lp in local_params(chunks):
            if id(lp.param) not in names or lp.local_shape != tuple(lp.spec.shape):
                raise UCPError(f"parameter {lp.spec.name!r} is not one whole model parameter at "
                               f"TP1 (shape {list(lp.local_shape)}, universal {list(lp.spec.shape)}); "
                               "FSDP reading covers plain parameters only")
            if lp.spec.buffer:
                raise UCPError(f"{lp.spec.name!r} is a buffer; FSDP reading covers parameters only")
            plan[lp.spec.name] = (lp.spec.to_json(), names[id(lp.param)])
        cfg = model_config(chunks, args)
    return plan, cfg


def _split_state_key(key: str) -> tuple[str, str]:
    """`optimizer.state.module.module.decoder.x.weight.exp_avg` -> (`decoder.x.weight`, `exp_avg`)."""
    name, _, state = key[len(STATE_PREFIX):].rpartition(".")
    return strip_wrappers(name), state


class _FsdpSource(ReadsDcp, Source):
    """What both forms share: the args, the model plan, the run state, reading by stored key."""

    format = "megatron_fsdp"  # its name in the `formats` registry
    form = ""

    def __init__(self, reader: DistReader, iteration: int | None):
        self.reader = reader
        self.dir = reader.dir
        saved_args = reader.obj("args")
        if getattr(saved_args, "ckpt_format", self.form) != self.form:
            raise UCPError(f"{self.dir}: its args say --ckpt-format {saved_args.ckpt_format}, but "
                           f"the files are the --ckpt-format {self.form} form; the directory mixes "
                           "two saves")
        self.args = training_args(saved_args, self.dir, self.form)
        self.plan, self.model_cfg = _plan(self.args)
        self.iteration = int(reader.obj("iteration")) if "iteration" in reader.meta else iteration
        self.keys: dict[str, dict[str, str]] = {}  # universal name -> state -> stored key
        self._last: tuple[tuple[str, str], torch.Tensor] | None = None

    def _model_keys(self) -> dict[str, str]:
        """The model's own parameter name -> its `model.*` key; every one must be a parameter."""
        model = {strip_wrappers(k[len("model."):]): k for k in self.reader.tensor_keys()
                 if k.startswith("model.")}
        unused = sorted(set(model) - {local for _, local in self.plan.values()})
        if unused:
            raise UCPError(f"{self.dir}: stored model tensor(s) {unused[:3]} belong to no parameter "
                           "of the model built from the checkpoint's args (an unsupported module?)")
        for name, (spec, local) in self.plan.items():
            if local not in model:
                raise UCPError(f"{self.dir}: the model built from the args has parameter {local!r} "
                               f"(universal {name!r}) but the checkpoint has no model.*{local} "
                               "tensor; the args do not describe this checkpoint")
            if self.reader.shape(model[local]) != tuple(spec["shape"]):
                raise UCPError(f"{self.dir}: {model[local]!r} has shape "
                               f"{list(self.reader.shape(model[local]))}, the model built from "
                               f"args needs {spec['shape']} for {name!r}")
        return model

    def _manifest(self, steps: dict[str, float], groups: list[dict]) -> Manifest:
        args = self.args
        self.origin = {"kind": f"megatron-lm --ckpt-format {self.form}", "path": str(self.dir)}
        return Manifest(
            "universal", self.iteration or 0, layout(args), world(args), self.model_cfg,
            {n: ParamEntry(ParamSpec.from_json(spec), steps[n]) for n, (spec, _) in self.plan.items()},
            {"param_groups": groups, "grad_scaler": None}, scheduler(self.reader),
            {"consumed_samples": int(getattr(args, "consumed_train_samples", 0) or 0)},
            int(getattr(args, "seed", 1234)))

    def read(self, name: str, state: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        if self._last is None or self._last[0] != (name, state):
            key = self.keys[name][state]
            t = self.reader.tensor(key)
            if t.dtype != torch.float32:
                raise UCPError(f"{self.dir}: {key!r} is {t.dtype}, expected float32")
            if state == "param" and "model" in self.keys[name]:
                model = self.reader.tensor(self.keys[name]["model"])
                if not torch.equal(t.to(model.dtype), model):
                    raise UCPError(f"{self.dir}: master weight {key!r} cast to {model.dtype} differs "
                                   f"from the stored model weight {self.keys[name]['model']!r}; the "
                                   "optimizer's order of parameters was not understood (refusing "
                                   "to write wrong state)")
            self._last = ((name, state), t)
        return self._last[1][tuple(slice(o, o + n) for o, n in zip(offset, shape))]

    def rng_ranks(self) -> list[int]:
        return []  # Megatron-LM's per-rank generator states go to its own writers (run_fields)


class FsdpDtensorSource(_FsdpSource):
    """A Megatron-LM `--ckpt-format fsdp_dtensor` checkpoint (Megatron-FSDP) as universal tensors:
    every tensor is named after its parameter; `model.*` holds the fp32 main weights."""

    form = FSDP_DTENSOR

    def __init__(self, reader: DistReader, iteration: int | None):
        t0 = time.perf_counter()
        super().__init__(reader, iteration)
        ckpt = self.dir
        model = self._model_keys()
        states: dict[str, dict[str, str]] = {}
        for k in reader.tensor_keys():
            if k.startswith(STATE_PREFIX):
                name, state = _split_state_key(k)
                states.setdefault(name, {})[state] = k
            elif not k.startswith(("model.", "rng_state.")):
                raise UCPError(f"{ckpt}: stored tensor {k!r} is neither a model weight, an "
                               "optimizer state nor an rng state; not understood")
        unused = sorted(set(states) - set(model))
        if unused:
            raise UCPError(f"{ckpt}: optimizer state of {unused[:3]}, which the model built from "
                           "the checkpoint's args does not have")
        for name, (_, local) in self.plan.items():
            key = model[local]
            if reader.meta[key].properties.dtype != torch.float32:
                raise UCPError(f"{ckpt}: {key!r} is {reader.meta[key].properties.dtype}, not the "
                               "fp32 main weight Megatron-FSDP saves; no master weight to read")
            have = states.get(local, {})
            missing = [s for s in MOMENTS if s not in have]
            if missing:
                raise UCPError(f"{ckpt}: optimizer state {missing} of {local!r} is missing (saved "
                               "without optimizer, or a rank's state lost); convert a save with it")
            extra = sorted(set(have) - {*MOMENTS, "step"})
            if extra:
                raise UCPError(f"{ckpt}: optimizer state(s) {extra} of {local!r} are not Adam's; "
                               "only Adam is read")
            self.keys[name] = {"param": key, **{s: have[s] for s in MOMENTS},
                               **({"step": have["step"]} if "step" in have else {})}
        groups, steps = self._groups_and_steps()
        self.manifest = self._manifest(steps, groups)
        log.info("planned %d parameters of %s (--ckpt-format %s) in %.2fs", len(self.plan), ckpt,
                 self.form, time.perf_counter() - t0)

    def _groups_and_steps(self) -> tuple[list[dict], dict[str, float]]:
        """The distinct param groups (in the order of their first parameter) and each universal
        parameter's Adam step."""
        reader = self.reader
        values = reader.objs([k for k in reader.meta if k.startswith(GROUP_META_PREFIX)])
        meta: dict[str, dict] = {}
        for k, v in values.items():
            local, _, field = k[len(GROUP_META_PREFIX):].rpartition(".")
            meta.setdefault(strip_wrappers(local), {})[field] = v
        groups: list[dict] = []
        steps: dict[str, float] = {}
        for name, (_, local) in self.plan.items():
            if local not in meta:
                raise UCPError(f"{reader.dir}: no param group (optimizer.param_to_group_meta) for "
                               f"{local!r}; the checkpoint was saved without optimizer?")
            g, keys = meta[local], self.keys[name]
            if "step" in keys:  # torch's AdamW: per parameter
                steps[name] = float(reader.tensor(keys["step"]))
            elif g.get("step") is not None:  # Transformer Engine's FusedAdam: per group
                steps[name] = float(g["step"])
            else:
                raise UCPError(f"{reader.dir}: no Adam step for {local!r} (neither "
                               "optimizer.state.*.step nor its param group's step)")
            entry = group_json(g, 0)
            if entry not in groups:
                groups.append(entry)
        return groups, steps


class TorchDcpSource(_FsdpSource):
    """A Megatron-LM `--ckpt-format torch_dcp` checkpoint (torch FSDP2, Float16Optimizer) as
    universal tensors. Its optimizer state is addressed by position in the optimizer's param
    groups; the order is megatron-core's own (`mcore_compat.megatron_param_groups` on the model
    rebuilt from args), checked against the stored groups (sizes, hyper-parameters), shapes, and
    bf16(master) == stored model weight, bit for bit, on every read."""

    form = TORCH_DCP

    def __init__(self, reader: DistReader, iteration: int | None):
        t0 = time.perf_counter()
        super().__init__(reader, iteration)
        ckpt, args = self.dir, self.args
        model = self._model_keys()
        if not (args.bf16 or args.fp16):
            raise UCPError(f"{ckpt}: an fp32 FSDP2 run (no --bf16/--fp16): its optimizer has no "
                           "fp32_from_fp16_params; only the Float16Optimizer form is read")
        saved = reader.objs([k for k in reader.meta if k.startswith(FSDP2_GROUP_PREFIX)])
        stored_groups: dict[int, dict] = {}
        for k, v in saved.items():
            g, _, field = k[len(FSDP2_GROUP_PREFIX):].partition(".")
            stored_groups.setdefault(int(g), {})[field] = v
        with source_rank(single_rank_args(args), 0):
            chunks = build_chunks(single_rank_args(args))
            names = {id(p): n for n, p in unwrap_model(chunks[0]).named_parameters()}
            built = megatron_param_groups(chunks, args)
            by_id = [[names[id(p)] for p in g["params"]] for g in built]
            hyper = [{k: v for k, v in g.items() if k != "params"} for g in built]
        if not stored_groups:
            raise UCPError(f"{ckpt}: no optimizer param groups ({FSDP2_GROUP_PREFIX}*): saved "
                           "without optimizer (--no-save-optim)? Only saves with it are read")
        if len(stored_groups) != len(by_id):
            raise UCPError(f"{ckpt}: {len(stored_groups)} optimizer param groups stored, megatron-"
                           f"core builds {len(by_id)} for the model of the args")
        local_to_names: dict[str, list[str]] = {}
        for name, (_, local) in self.plan.items():
            local_to_names.setdefault(local, []).append(name)
        position, steps, groups = 0, {}, []
        for g, locals_ in enumerate(by_id):
            stored = stored_groups[g]
            want = list(range(position, position + len(locals_)))
            if list(stored.get("params", [])) != want:
                raise UCPError(f"{ckpt}: param group {g} holds positions {stored.get('params')}, "
                               f"megatron-core builds it with {len(locals_)} parameters ({want[:3]}"
                               "...); the args do not describe this run's optimizer")
            for k, v in hyper[g].items():
                if k in stored and stored[k] != v:
                    raise UCPError(f"{ckpt}: param group {g} has {k}={stored[k]!r}, megatron-core "
                                   f"builds it with {v!r}; the args do not describe this optimizer")
            groups.append(group_json(stored, 0))
            for i, local in enumerate(locals_):
                n = position + i
                keys = {"param": f"{FSDP2_MASTER_PREFIX}{g}.{i}", "model": model[local],
                        **{s: f"{FSDP2_STATE_PREFIX}{n}.{s}" for s in (*MOMENTS, "step")}}
                for s, k in keys.items():
                    if k not in reader.meta:
                        raise UCPError(f"{ckpt}: {k!r} ({s} of {local!r}) is missing; saved "
                                       "without optimizer?")
                    if s != "step" and reader.shape(k) != reader.shape(model[local]):
                        raise UCPError(f"{ckpt}: {k!r} has shape {list(reader.shape(k))}, "
                                       f"{local!r} {list(reader.shape(model[local]))}; the "
                                       "optimizer's order of parameters was not understood")
                for name in local_to_names.get(local, []):
                    self.keys[name] = keys
                    steps[name] = float(reader.tensor(keys["step"]))
            position += len(locals_)
        missing = sorted(set(self.plan) - set(self.keys))
        if missing:
            raise UCPError(f"{ckpt}: parameter(s) {missing[:3]} are in no optimizer param group")
        known = {k for keys in self.keys.values() for k in keys.values()}
        extra = sorted(k for k in reader.tensor_keys() if k.startswith("optimizer.") and k not in known)
        if extra:
            raise UCPError(f"{ckpt}: optimizer tensor(s) {extra[:3]} belong to no parameter")
        self.manifest = self._manifest(steps, groups)
        log.info("planned %d parameters of %s (--ckpt-format %s) in %.2fs", len(self.plan), ckpt,
                 self.form, time.perf_counter() - t0)


def open_fsdp_source(load_dir: str | Path, trust_pickle: bool = False) -> _FsdpSource:
    reader, iteration, kind = open_reader(load_dir, trust_pickle)
    return (FsdpDtensorSource if kind == FSDP_DTENSOR else TorchDcpSource)(reader, iteration)


def scheduler(reader: DistReader) -> dict | None:
    keys = [k for k in reader.meta if k.startswith("opt_param_scheduler.")]
    if not keys:
        return None
    return {k[len("opt_param_scheduler."):]: jsonable_tree(v) for k, v in reader.objs(keys).items()}


def run_fields(load_dir: str | Path, trust_pickle: bool = False) -> RunFields:
    """The run's args (as a DDP + distributed-optimizer run, `training_args`), rng states
    {(pp, tp): rng list} (torch_dcp keeps one list, of the only (0, 0) position), layout and
    flops: what a Megatron-LM writer takes from the source run."""
    reader, _, kind = open_reader(load_dir, trust_pickle)
    args = training_args(reader.obj("args"), reader.dir, kind)
    keys = [k for k in reader.meta if k.startswith("rng_state.")]
    tensors = set(reader.tensor_keys())
    objects = reader.objs([k for k in keys if k not in tensors])
    rng: dict[tuple[int, ...], dict[int, dict]] = {}
    for k in keys:  # fsdp_dtensor: rng_state.(<pp>, <tp>).<i>.<field>; torch_dcp: rng_state.<i>.<field>
        m = re.fullmatch(r"rng_state\.(?:\((\d+), (\d+)\)\.)?(\d+)\.(.+)", k)
        if m is None:
            raise UCPError(f"{reader.dir}: rng state key {k!r} not understood")
        position = (int(m.group(1)), int(m.group(2))) if m.group(1) is not None else (0, 0)
        node = rng.setdefault(position, {}).setdefault(int(m.group(3)), {})
        *path, leaf = m.group(4).split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = reader.tensor(k).clone() if k in tensors else objects[k]
    by_position = {pos: [states[i] for i in sorted(states)] for pos, states in rng.items()} or None
    flops = (reader.obj("num_floating_point_operations_so_far")
             if "num_floating_point_operations_so_far" in reader.meta else None)
    return RunFields(args=args, layout=layout(args), rng_state=by_position,
                     rng_by_position=by_position, num_floating_point_operations_so_far=flops)
