"""Megatron-LM's checkpoint conventions that both of its formats (`--ckpt-format torch` and
`torch_dist`) share: the tracker file, iteration and rank directory names, which global rank
writes which rank directory, the run's layout from its `args`, the args of the same run at
another layout, and the optimizer param groups and scheduler state as Megatron-LM stores them.
Unpickling its files: `megatron_pickle`; what differs between megatron-core releases:
`megatron_ucp.mcore_compat`.
"""

from __future__ import annotations

import argparse
import io
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatron_ucp import storage
from megatron_ucp.errors import UCPError
from megatron_ucp.formats.base import check_same_params, not_committed
from megatron_ucp.formats.megatron_pickle import MEGATRON_HOLDS, unpickle
from megatron_ucp.formats.megatron_te import te_unavailable
from megatron_ucp.layout import Layout

# a hybrid model's layer pattern in Megatron-LM args, whichever release's name holds it (the
# formats' shared name for it)
from megatron_ucp.mcore_compat.mamba import args_hybrid_pattern as hybrid_layer_pattern
from megatron_ucp.mcore_compat.mamba import set_hybrid_pattern_for_pp
from megatron_ucp.spec import UNRESHARDABLE_STATES
from megatron_ucp.storage import Location, location, refuse_non_empty
from megatron_ucp.validation import check_layout

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"


def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def tracked_iteration(root: Path) -> tuple[Path, int] | None:
    """(iteration directory, iteration) that a save root's tracker file names; None without a
    tracker. Raises when the tracker says something that is not an iteration."""
    tracker = root / TRACKER
    if not tracker.exists():
        return None
    try:
        text = tracker.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise UCPError(f"{tracker}: cannot read it ({e}); pass the iter_XXXXXXX directory to "
                       "convert instead") from e
    if text == RELEASE:
        return root / RELEASE, 0
    if not text.isdigit():
        raise UCPError(f"{tracker} says {text!r}, not an iteration number; pass the iter_XXXXXXX "
                       "directory to convert instead")
    return root / iteration_dir_name(int(text)), int(text)


def resolve_iteration(path: str | Path, is_iteration: Callable[[Path], bool],
                      fmt: str) -> tuple[Path, int | None]:
    """(iteration directory, iteration) from a Megatron-LM save root (its tracker file names the
    iteration) or an iteration directory itself; the iteration is None when a directory's name
    does not say it (the caller reads it from the files)."""
    path = location(path)
    if is_iteration(path):
        match = re.fullmatch(r"iter_(\d{7})", path.name)
        return path, int(match.group(1)) if match else 0 if path.name == RELEASE else None
    tracked = tracked_iteration(path)
    if tracked is not None:
        target, iteration = tracked
        if not is_iteration(target):
            why = "does not exist" if not target.exists() else f"is not a {fmt} checkpoint"
            raise UCPError(f"{path / TRACKER} names iteration {iteration}, but {target} {why}; pass "
                           "an existing iter_XXXXXXX directory instead")
        return tracked
    if not path.exists():
        raise UCPError(f"{path} does not exist; pass a Megatron-LM save root (with {TRACKER}) or "
                       "one of its iter_XXXXXXX directories")
    raise UCPError(f"{path} is neither a Megatron-LM save root (no {TRACKER}) nor a {fmt} iteration "
                   "directory; pass one of those")


def holds_checkpoint(path: str | Path, is_iteration: Callable[[Path], bool]) -> bool:
    """`path` is an iteration directory, or a save root whose tracker names one."""
    path = location(path)
    if is_iteration(path):
        return True
    try:
        tracked = tracked_iteration(path)
    except UCPError:  # a tracker that names no iteration: not a checkpoint of this format
        return False
    return tracked is not None and is_iteration(tracked[0])


def torch_load(path: Location, what: str, trust_pickle: bool = False, holds: str = MEGATRON_HOLDS) -> Any:
    """torch.load on CPU, memory-mapped so a large checkpoint is not read into RAM at once (an
    object in a store: fetched whole, as torch.load reads every byte of it anyway), with the
    restricted unpickler (`unpickle`)."""
    if not path.exists():
        raise UCPError(f"{path} is missing; {what}")
    local = storage.local_file(path)
    if local is None:
        data = storage.read_bytes(path)

        def load(weights_only: bool) -> Any:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)
    else:
        def load(weights_only: bool) -> Any:
            return _load_file(local, weights_only)

    try:
        return unpickle(load, path, trust_pickle, holds)
    except UCPError:
        raise
    except ModuleNotFoundError as e:
        raise UCPError(f"{path}: cannot unpickle it, it references module {e.name!r} which is not "
                       "installed here; install it (the checkpoint's args refer to it)") from e
    except Exception as e:
        raise UCPError(f"{path} cannot be read ({type(e).__name__}: {e}); the file is truncated or "
                       "corrupt: restore it from the source or convert another iteration") from e


def _load_file(path: Path, weights_only: bool) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        return torch.load(path, map_location="cpu", weights_only=weights_only)  # non-zip format


# ------------------------------------------------------------------------ the run's layout


def world(args) -> int:
    """The saving run's world size (args.world_size, else the product of the parallel sizes)."""
    return getattr(args, "world_size", None) or (
        args.tensor_model_parallel_size * args.pipeline_model_parallel_size
        * getattr(args, "context_parallel_size", 1) * getattr(args, "data_parallel_size", 1))


def layout(args) -> Layout:
    """The saving run's parallel layout; DP is derived from the world size when args lack it."""
    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  getattr(args, "context_parallel_size", 1) or 1)
    dp = getattr(args, "data_parallel_size", None) or world(args) // (tp * pp * cp)
    return Layout(tp=tp, pp=pp, dp=dp,
                  vpp=getattr(args, "virtual_pipeline_model_parallel_size", None), cp=cp,
                  ep=getattr(args, "expert_model_parallel_size", 1) or 1)


def rank_order(args) -> str:
    """The rank order megatron.training.initialize passes to initialize_model_parallel."""
    return "tp-cp-ep-pp-dp" if getattr(args, "use_tp_pp_dp_mapping", False) else "tp-cp-ep-dp-pp"


def rank_dir_name(tp: int, pp: int, ep: int, args) -> str:
    """Megatron-LM's get_checkpoint_name: mp_rank_TT, then _PPP if PP > 1, then _EEE if EP > 1."""
    name = f"mp_rank_{tp:02d}"
    if args.pipeline_model_parallel_size > 1:
        name += f"_{pp:03d}"
    if getattr(args, "expert_model_parallel_size", 1) > 1:
        name += f"_{ep:03d}"
    return name


RANK_DIR = re.compile(r"mp_rank_\d{2}(_\d{3}){0,2}")


def writer_ranks(args) -> dict[str, int]:
    """Rank directory -> the global rank that wrote it (expert-data-parallel rank 0).

    Uses megatron-core's RankGenerator with the sizes initialize_model_parallel derives, so rank
    orders other than the default are handled the way the saving run handled them.
    """
    from megatron.core.parallel_state import RankGenerator

    lay, n = layout(args), world(args)
    etp = getattr(args, "expert_tensor_parallel_size", None) or lay.tp
    dense = RankGenerator(tp=lay.tp, ep=1, dp=lay.dp, pp=lay.pp, cp=lay.cp, order=rank_order(args))
    expert = RankGenerator(tp=etp, ep=lay.ep, dp=n // (etp * lay.ep * lay.pp), pp=lay.pp, cp=1,
                           order=rank_order(args))

    def position(gen, token: str) -> dict[int, int]:
        return {r: i for group in gen.get_ranks(token) for i, r in enumerate(group)}

    tp, pp = position(dense, "tp"), position(dense, "pp")
    ep, edp = position(expert, "ep"), position(expert, "dp")
    out: dict[str, int] = {}
    for r in range(n):
        if edp[r] == 0:
            out.setdefault(rank_dir_name(tp[r], pp[r], ep[r], args), r)
    return out


def rng_shard_key(pp_rank: int, tp_rank: int, pp: int, tp: int,
                  dp: tuple[int, int] | None = None) -> str:
    """The torch_dist key of one (PP, TP) rank's rng_state ShardedObject; with expert parallelism
    Megatron-LM shards it by (PP, TP, DP): dp = (DP rank, DP size)."""
    if dp is not None:
        return f"rng_state/shard_{pp_rank}.{tp_rank}.{dp[0]}_{pp}.{tp}.{dp[1]}"
    return f"rng_state/shard_{pp_rank}.{tp_rank}_{pp}.{tp}"


def null_tokenizer_vocab(args) -> int | None:
    """The vocabulary of a run with --tokenizer-type NullTokenizer: its --vocab-size ids plus the
    EOD token it appends. None for other tokenizers (args record only the padded size)."""
    if getattr(args, "tokenizer_type", None) == "NullTokenizer" and getattr(args, "vocab_size", None):
        return int(args.vocab_size) + 1
    return None


# `--spec` values of a hybrid (Mamba) run whose stack megatron-ucp rebuilds: megatron-core's local
# layers with the TE spec's parameter names (`megatron_ucp.hybrid_spec`). Megatron-LM's
# pretrain_hybrid.py needs a `--spec` (megatron-core 0.19 ships only Transformer Engine's); without
# TE this is the one that builds. The second name is the same spec where CPU runs import it, with
# the CPU stand-ins of the Mamba kernels (the Megatron-LM fixtures' args name it).
LOCAL_HYBRID_SPECS = (("megatron_ucp.hybrid_spec", "hybrid_stack_spec_local"),
                      ("megatron_ucp.testing.mamba_cpu", "hybrid_stack_spec_local"))


def check_supported(args, where: Path | str) -> None:
    """Refuse runs whose model or optimizer state megatron-ucp cannot rebuild from args."""
    problems = []
    if getattr(args, "use_legacy_models", False):
        problems.append("--use-legacy-models (megatron.legacy GPT) is not a megatron-core model")
    impl = getattr(args, "transformer_impl", "local")
    if impl not in ("local", "transformer_engine"):
        problems.append(f"--transformer-impl {impl} is not rebuilt (local and transformer_engine are)")
    elif impl == "transformer_engine" and te_unavailable():
        problems.append("--transformer-impl transformer_engine: its layers are rebuilt with Transformer "
                        f"Engine, which is not usable here ({te_unavailable()}); run the conversion "
                        "where Transformer Engine is installed (with CUDA, which TE requires)")
    spec = getattr(args, "spec", None)
    if spec and not (hybrid_layer_pattern(args) and tuple(spec) in LOCAL_HYBRID_SPECS):
        problems.append(f"--spec {' '.join(spec)} is set" + (
            f" (a hybrid model's stack is rebuilt with megatron-core's local layers, as "
            f"`--spec {' '.join(LOCAL_HYBRID_SPECS[0])}` builds it; other specs are not)"
            if hybrid_layer_pattern(args) else ""))
    for flag in ("yaml_cfg", "heterogeneous_layers_config_path", "experimental_attention_variant",
                 "use_precision_aware_optimizer"):
        if getattr(args, flag, None):
            problems.append(f"--{flag.replace('_', '-')} is set")
    if not getattr(args, "use_distributed_optimizer", False) and not getattr(
            args, "use_layer_wise_distributed_optimizer", False):
        problems.append("the run did not use --use-distributed-optimizer (no distrib_optim.pt)")
    if getattr(args, "num_distributed_optimizer_instances", 1) != 1:
        problems.append("--num-distributed-optimizer-instances > 1")
    if getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False):
        problems.append("FSDP runs are not DDP + distributed optimizer")
    if world(args) != layout(args).world_size:
        problems.append(f"world_size {world(args)} != TPxPPxDPxCP {layout(args).world_size}")
    if problems:
        raise UCPError(f"{where}: cannot import this Megatron-LM checkpoint: " + "; ".join(problems))


def target_args(template, target: Layout, first_stage_layers: int | None = None,
                last_stage_layers: int | None = None, consumed_samples: int | None = None,
                expert_tensor_parallel: int | None = None):
    """A copy of the template `args` (e.g. the source checkpoint's) describing the same model
    trained at `target`: every layout-dependent setting is set to the target, the uneven
    pipeline split is reset unless given, the padded vocabulary is rounded up to the target's
    multiple (make_vocab_size_divisible_by x TP) as Megatron-LM pads it at start-up.
    expert_tensor_parallel: the target's expert TP size (default: the source's rule, its own
    value or TP)."""
    a = argparse.Namespace(**vars(template))
    vpp = target.vpp or None
    a.tensor_model_parallel_size = target.tp
    a.pipeline_model_parallel_size = target.pp
    a.transformer_pipeline_model_parallel_size = target.pp
    a.context_parallel_size = target.cp
    a.expert_model_parallel_size = target.ep
    if expert_tensor_parallel is not None:
        if not getattr(template, "num_experts", None):
            raise UCPError(f"--target-etp {expert_tensor_parallel}: the model has no experts")
        if target.world_size % (expert_tensor_parallel * target.ep * target.pp):
            raise UCPError(f"--target-etp {expert_tensor_parallel}: the target's {target.world_size} "
                           f"ranks do not split into ETP x EP {target.ep} x PP {target.pp} groups")
        a.expert_tensor_parallel_size = expert_tensor_parallel
    elif getattr(template, "expert_tensor_parallel_size", None) in (
            None, template.tensor_model_parallel_size):
        a.expert_tensor_parallel_size = target.tp
    a.data_parallel_size = target.dp
    a.world_size = target.world_size
    a.virtual_pipeline_model_parallel_size = vpp
    if getattr(template, "num_virtual_stages_per_pipeline_rank", None):
        a.num_virtual_stages_per_pipeline_rank, a.num_layers_per_virtual_pipeline_stage = vpp, None
    else:
        a.num_virtual_stages_per_pipeline_rank = None
        a.num_layers_per_virtual_pipeline_stage = a.num_layers // (target.pp * vpp) if vpp else None
    a.decoder_first_pipeline_num_layers = first_stage_layers
    a.decoder_last_pipeline_num_layers = last_stage_layers
    pp_layout = getattr(a, "pipeline_model_parallel_layout", None)
    if pp_layout and target.pp != template.pipeline_model_parallel_size:
        raise UCPError("the template args set --pipeline-model-parallel-layout for PP "
                       f"{template.pipeline_model_parallel_size}; it cannot describe PP {target.pp}: "
                       "pass args without it")
    if target.tp == 1:
        a.sequence_parallel = False
    set_hybrid_pattern_for_pp(a, target.pp)
    from megatron_ucp.mcore_compat import rederive_weight_shards  # imports megatron.core

    rederive_weight_shards(a)
    multiple = getattr(a, "make_vocab_size_divisible_by", 128) * target.tp
    a.padded_vocab_size = -(-a.padded_vocab_size // multiple) * multiple
    if consumed_samples is not None:
        a.consumed_train_samples = consumed_samples
    return a


def prepare_export(fmt: str, source, save_dir: str | Path, target: Layout, args_template,
                   first_stage_layers: int | None, last_stage_layers: int | None,
                   expert_tensor_parallel: int | None = None):
    """Checks and inputs shared by the Megatron-LM writers: args to describe the run, a new output
    directory, a target layout that can hold the model (a live process group is refused by the
    rebuild, `megatron_rebuild.source_rank`). Returns (target args, output path)."""
    if args_template is None:
        raise UCPError(f"writing a Megatron-LM {fmt} checkpoint needs Megatron-LM args (model "
                       "architecture, optimizer and run settings); pass the args of a Megatron-LM "
                       "checkpoint of this model")
    out = location(save_dir)
    refuse_non_empty(out)
    manifest = source.manifest
    args = target_args(args_template, target, first_stage_layers, last_stage_layers,
                       manifest.extra.get("consumed_samples"), expert_tensor_parallel)
    check_supported(args, "args template")
    check_layout({**manifest.model, "num_layers_in_first_pipeline_stage": first_stage_layers,
                  "num_layers_in_last_pipeline_stage": last_stage_layers}, target, str(source.dir))
    return args, out


def single_step(source) -> float:
    """The one Adam step of every trained parameter: Megatron-LM keeps one per param group."""
    steps = {source.step(n) for n, p in source.manifest.params.items() if not p.spec.buffer}
    if len(steps) != 1:
        raise UCPError(f"the universal checkpoint has parameters at different Adam steps "
                       f"{sorted(steps)}; a Megatron-LM checkpoint keeps one step per param group "
                       "and cannot hold them")
    return float(steps.pop())


def check_export(out: Path, source, open_written: Callable[[Path], Any]) -> None:
    """Before a Megatron-LM export is committed: it opens with its own reader (which checks that
    the flat buffers or stacked tensors cover every element of every parameter once), and holds
    exactly the source's parameters, at their shapes (vocab rows padded up) and Adam step."""
    written = open_written(out)
    have, want = written.manifest.params, source.manifest.params
    check_same_params(out, have, want)
    for name, p in want.items():
        got = have[name].shape
        padded = p.spec.vocab_rows and got[1:] == p.shape[1:] and got[0] >= p.shape[0]
        if got != p.shape and not padded:
            raise not_committed(out, f"has {name!r} at shape {list(got)}, the source at "
                                f"{list(p.shape)}")
        if not p.spec.buffer and written.step(name) != source.step(name):
            raise not_committed(out, f"has {name!r} at Adam step {written.step(name)}, the source "
                                f"at {source.step(name)}")
        if have[name].spec.optimizer != p.spec.optimizer:
            raise not_committed(out, f"has {name!r} with {have[name].spec.optimizer} optimizer "
                                f"state, the source with {p.spec.optimizer}")


# ------------------------------------------------------ optimizer param groups and scheduler


def jsonable_tree(x):
    if isinstance(x, dict):
        return {str(k): jsonable_tree(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable_tree(v) for v in x]
    if torch.is_tensor(x):
        return x.item() if x.numel() == 1 else x.tolist()
    if isinstance(x, (bool, int, float, str)) or x is None:
        return x
    return str(x)


def as_list(x) -> list:
    return x if isinstance(x, list) else [x]


def group_json(g: dict, optimizer: int) -> dict:
    """A param group's hyper-parameters as the manifest keeps them (the step is per parameter)."""
    entry = {"optimizer": optimizer}
    for k, v in g.items():
        v = jsonable_tree(v)
        if k not in ("params", "step") and v is not None:
            entry[k] = v
    return entry


def optimizer_json(saved) -> dict:
    """Hyper-parameters of every param group of every chained optimizer (`model_optim_rng.pt` /
    `common.pt` 'optimizer'), and the fp16 grad scaler of the first that has one."""
    groups, scaler = [], None
    for i, opt in enumerate(as_list(saved)):
        if opt is None:
            continue
        groups += [group_json(g, i) for g in opt.get("optimizer", {}).get("param_groups", [])]
        if scaler is None and opt.get("grad_scaler"):
            scaler = jsonable_tree(opt["grad_scaler"])
    return {"param_groups": groups, "grad_scaler": scaler}


def group_step(groups: list[dict], where: str) -> float | None:
    """The one Adam step of a chained optimizer's param groups ('step', the same in all)."""
    steps = {float(g["step"]) for g in groups if g.get("step") is not None}
    if len(steps) > 1:
        raise UCPError(f"{where}: param groups have different Adam steps {sorted(steps)}; "
                       "megatron-ucp keeps one step per parameter and cannot tell which is whose")
    return steps.pop() if steps else None


# Megatron's param-group keys (megatron.core.optimizer._get_param_groups), in its order
_MEGATRON_GROUP_KEYS = ("is_expert_parallel", "default_config", "wd_mult", "lr_mult",
                        "is_decoupled_lr", "max_lr", "min_lr")


def chained_groups(manifest_groups: list[dict], n_optimizers: int) -> list[list[dict]]:
    """The manifest's param groups per chained optimizer of a target with `n_optimizers` (1:
    dense; 2: dense, expert). A run without expert parallelism has no expert optimizer (megatron-core
    keeps its experts in the dense buffers and groups): for a target that has one, its groups are
    the dense groups with `is_expert_parallel` set, the hyper-parameters the experts trained with
    (megatron-core pairs saved and current groups by (wd_mult, lr_mult, is_expert_parallel, ...);
    a saved group no current group asks for is not used)."""
    groups = [[g for g in manifest_groups if g.get("optimizer", 0) == i] for i in range(n_optimizers)]
    if n_optimizers == 2 and groups[0] and not groups[1] and not any(
            g.get("is_expert_parallel") for g in groups[0]):
        groups[1] = [{**g, "optimizer": 1, "is_expert_parallel": True} for g in groups[0]]
    return groups


def torch_group(g: dict, step: float) -> dict:
    """A param group as DistributedOptimizer.state_dict() writes it from a manifest entry: the
    manifest (JSON) drops None values and turns tuples into lists; torch AdamW's defaults that
    the import dropped (foreach=None, fused=None) come back; keys in Megatron's then torch's order,
    the step (a float) last."""
    g = {k: (tuple(v) if k == "betas" and isinstance(v, list) else v)
         for k, v in g.items() if k != "optimizer"}
    defaults: dict = {}
    if "decoupled_weight_decay" in g or "amsgrad" in g:  # torch.optim.Adam/AdamW
        defaults = torch.optim.AdamW([torch.zeros(1, device="cpu")]).defaults
        g = {**{k: v for k, v in defaults.items() if v is None and k not in g}, **g}
    order = [k for k in _MEGATRON_GROUP_KEYS if k in g] + [k for k in defaults if k in g]
    order += [k for k in g if k not in order]
    return {**{k: g[k] for k in order}, "step": step}


# OptimizerParamScheduler.state_dict() key order (megatron-core 0.16)
_SCHEDULER_KEYS = ("max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style", "lr_decay_steps",
                   "min_lr", "start_wd", "end_wd", "wd_incr_style", "wd_incr_steps")


def scheduler_state(saved: dict | None) -> dict | None:
    """The manifest's scheduler state in OptimizerParamScheduler.state_dict()'s key order."""
    if not saved:
        return saved
    order = [k for k in _SCHEDULER_KEYS if k in saved] + [k for k in saved if k not in _SCHEDULER_KEYS]
    return {k: saved[k] for k in order}


def rng_for(rng_state: dict | list, *keys) -> Any:
    """One target rank's Megatron `rng_state`: `rng_state` itself when it is one list, else the
    first of `keys` it has (rank directory name, (PP rank, TP rank)), else its first entry."""
    if isinstance(rng_state, list):
        return rng_state
    return next((rng_state[k] for k in keys if k in rng_state), next(iter(rng_state.values())))


# GPTModel's `yarn` position embedding reads these as attributes of the config that are no
# dataclass fields (`getattr(config, "yarn_rotary_scaling_factor")`, no default): Megatron-LM
# core_v0.19.0 sets them from its args (megatron/training/argument_utils.py,
# `_apply_yarn_config_from_args`; the CLI names three without the prefix). Same defaults.
YARN_FROM_ARGS = (
    ("yarn_rotary_scaling_factor", "rotary_scaling_factor", 1.0),
    ("yarn_original_max_position_embeddings", "yarn_original_max_position_embeddings", 4096),
    ("yarn_beta_fast", "yarn_beta_fast", 32.0), ("yarn_beta_slow", "yarn_beta_slow", 1.0),
    ("yarn_mscale", "mscale", 1.0),
    ("yarn_mscale_all_dim", "mscale_all_dim", 0.0),
    ("yarn_correction_range_round_to_int", "yarn_correction_range_round_to_int", True),
)


def layer_wise_family(states: set[str], args, where: str) -> str:
    """The optimizer family (`spec.OPTIMIZER_STATES`) of one torch optimizer in megatron-core 0.19's
    LayerWiseDistributedOptimizer (`--optimizer muon|lion`) by its states; else refused by name."""
    names = set(states) - {"param", "fp32_param", "step"}
    if names == {"exp_avg", "exp_avg_sq"}:
        return "adam"
    if names == {"exp_avg"}:
        return "lion"
    if names == {"momentum_buffer"} and getattr(args, "optimizer", None) in ("muon", "dist_muon"):
        return "muon"
    why = (f"SOAP's: {UNRESHARDABLE_STATES['soap']}" if names & {"L", "R", "Q_L", "Q_R"} else "that "
           "megatron-ucp does not map (it reads Muon's momentum_buffer, Lion's exp_avg, Adam's moments)")
    raise UCPError(f"{where}: a LayerWiseDistributedOptimizer state {sorted(names)} (--optimizer "
                   f"{getattr(args, 'optimizer', None)}), {why}; resume with Megatron-LM or convert weights")
