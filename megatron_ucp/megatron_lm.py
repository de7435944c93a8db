"""Megatron-LM (`megatron.training`, tag core_v0.16.1) integration: checkpoints in and out.

Megatron-LM's training loop calls `megatron.training.checkpointing.save_checkpoint` and
`load_checkpoint`. The two hooks here have exactly their signatures; when the run asks for
megatron-ucp they call `megatron_ucp.save` / `megatron_ucp.load` instead, otherwise they hand the
call to Megatron-LM's own function unchanged.

* `--ucp-save` (or `--ckpt-format universal`): every save writes a megatron-ucp fragment checkpoint
  under `--save` (no gather, any layout).
* `--universal-checkpoint` (or `--ckpt-format universal`): `--load` is a megatron-ucp save root,
  fragment directory or universal directory, loaded at the current TP/PP/DP layout whatever layout
  it was saved at.
* `--overlap-recompute PLAN.json`: the training loop's forward-backward function executes a
  megatron-ucp recompute plan (`megatron_ucp.recompute.runtime`): per-layer recompute choices, full
  layers recomputed while the stage waits for its output gradient (`get_forward_backward_func`).

Two ways in:

1. No patch: call `install()` before `pretrain()` runs (e.g. `python -m megatron_ucp.megatron_lm
   pretrain_gpt.py ARGS`, which does that and then runs the script). It replaces the two functions
   in `megatron.training.checkpointing` and in `megatron.training.training` (which imported them
   by name) and chains `extra_args_provider` onto whatever provider the script passes.
2. `patches/megatron-lm-core_v0.16.1-universal.patch`: Megatron-LM calls these hooks itself when
   the flags are set, and accepts `--ckpt-format universal` natively.

Both need nothing from Megatron-LM beyond its public module functions; for runs that do not use
`megatron.training` (or tests), `set_args_source` supplies the argument namespace.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import Callable
from pathlib import Path

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.megatron_common import null_tokenizer_vocab
from megatron_ucp.mcore_compat import training as mcore_training

UNIVERSAL_FORMAT = "universal"  # the --ckpt-format value that means "megatron-ucp, both ways"
# Megatron-LM args written to the checkpoint's `extra` and restored on load: the training loop
# resumes its data position (consumed samples) and its FLOP counter from them.
SAMPLE_COUNTERS = ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples")

_ORIGINALS: dict[str, Callable] = {}  # Megatron-LM's own functions, saved by install()
_ARGS_SOURCE: Callable[[], argparse.Namespace] | None = None


# ---------------------------------------------------------------------------------- arguments

def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add megatron-ucp's flags to Megatron-LM's parser (an `extra_args_provider` for pretrain()).

    Idempotent and compatible with the patch: flags the parser already has are left alone. It also
    lets `--ckpt-format` accept `universal` without the patch, by extending that option's choices.
    """
    have = parser._option_string_actions
    group = parser.add_argument_group("megatron-ucp", "universal checkpointing (megatron_ucp)")
    if "--universal-checkpoint" not in have:
        group.add_argument("--universal-checkpoint", action="store_true",
                           help="Load --load with megatron_ucp: a megatron-ucp save root, fragment "
                                "checkpoint or universal directory, saved at any TP/PP/DP layout, "
                                "resumed at the current one.")
    if "--ucp-save" not in have:
        group.add_argument("--ucp-save", action="store_true",
                           help="Save checkpoints with megatron_ucp (fragment form, loadable at any "
                                "layout) instead of Megatron-LM's own format.")
    if "--overlap-recompute" not in have:
        group.add_argument("--overlap-recompute", default=None, metavar="PLAN.json",
                           help="Execute a megatron-ucp recompute plan (`megatron-ucp plan-recompute`):"
                                " each layer's recompute as planned, full layers recomputed while the "
                                "stage waits for its output gradient. Replaces --recompute-granularity;"
                                " run with the plan's --decoder-first/last-pipeline-num-layers.")
    for action in parser._actions:
        if action.dest == "ckpt_format" and action.choices is not None \
                and UNIVERSAL_FORMAT not in action.choices:
            action.choices = (*action.choices, UNIVERSAL_FORMAT)
    return parser


def chain_extra_args_providers(*providers: Callable | None) -> Callable:
    """One provider calling each given one in turn (None entries are skipped).

    pretrain_gpt.py passes its own provider (modelopt's, or None) to pretrain(); chaining keeps it.
    """
    live = [p for p in providers if p is not None]

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for p in live:
            parser = p(parser)
        return parser

    return provider


def set_args_source(source: Callable[[], argparse.Namespace] | None) -> None:
    """Where the hooks get the run's arguments; None (default) = `megatron.training.get_args`.

    The hook signatures are Megatron-LM's, which carry no `args`; a loop that does not use
    megatron.training's global args (or a test) sets its namespace here.
    """
    global _ARGS_SOURCE
    _ARGS_SOURCE = source


def _get_args() -> argparse.Namespace:
    if _ARGS_SOURCE is not None:
        return _ARGS_SOURCE()
    from megatron.training.global_vars import get_args

    return get_args()


def wants_ucp_save(args: argparse.Namespace) -> bool:
    """True when saves must go through megatron_ucp (--ucp-save or --ckpt-format universal)."""
    return bool(getattr(args, "ucp_save", False)) or getattr(args, "ckpt_format", None) == UNIVERSAL_FORMAT


def wants_ucp_load(args: argparse.Namespace) -> bool:
    """True when --load must be read by megatron_ucp (--universal-checkpoint or --ckpt-format universal)."""
    return (bool(getattr(args, "universal_checkpoint", False))
            or getattr(args, "ckpt_format", None) == UNIVERSAL_FORMAT)


def true_vocab_size(args: argparse.Namespace) -> int | None:
    """The unpadded vocabulary (tokenizer size), or None when it cannot be known.

    `args.padded_vocab_size` is the padded size the model is built with (a multiple of
    make_vocab_size_divisible_by x TP), so it changes with TP; recording the true size lets a load
    at another TP re-pad. The tokenizer is asked first; NullTokenizer's size is --vocab-size + 1
    (it appends an EOD token).
    """
    size = None
    try:
        from megatron.training.global_vars import get_tokenizer

        size = int(get_tokenizer().vocab_size)
    except Exception:  # no megatron.training, or the tokenizer was not built (tests, custom loops)
        size = null_tokenizer_vocab(args)
    padded = getattr(args, "padded_vocab_size", None)
    if size is None or (padded is not None and size > padded):
        return None
    return size


def _print_rank_0(msg: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def _original(name: str) -> Callable:
    """Megatron-LM's own function `name`, whether or not install() replaced it."""
    if name in _ORIGINALS:
        return _ORIGINALS[name]
    import megatron.training.checkpointing as ckpt

    fn = getattr(ckpt, name)
    if fn is globals()[name]:
        raise UCPError(f"megatron.training.checkpointing.{name} is megatron_ucp's hook but the "
                       "original was not recorded; call megatron_ucp.megatron_lm.install()")
    return fn


# -------------------------------------------------------------------------------------- hooks

# save_checkpoint's / load_checkpoint's parameters after checkpointing_context, in order: each
# release appends to the list (mcore_compat.training), so the hooks take them as *rest/**kw and
# forward them as they came: one hook for every release.
SAVE_PARAMS, LOAD_PARAMS = mcore_training.SAVE_PARAMS, mcore_training.LOAD_PARAMS


def _named(names: tuple[str, ...], rest: tuple, kw: dict) -> dict:
    if len(rest) > len(names):
        raise TypeError(f"{len(rest)} positional arguments after checkpointing_context; this "
                        f"megatron_ucp knows {len(names)} ({', '.join(names)})")
    return {**dict(zip(names, rest)), **kw}


def save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
                    num_floating_point_operations_so_far, checkpointing_context=None, *rest, **kw):
    """Megatron-LM's `save_checkpoint` (its signature, core_v0.16.1 to core_v0.19.0): megatron_ucp.save
    when asked for.

    Writes `<args.save>/iter_XXXXXXX` in megatron-ucp's fragment form with the training loop's
    sample counters and FLOP count in `extra`, the run's seed, and the true vocabulary size.
    Megatron-LM's tracker file is not written: a Megatron-format loader must not mistake the
    directory for one of its own. Otherwise the call goes to Megatron-LM's save_checkpoint.
    """
    args = _get_args()
    if not wants_ucp_save(args):
        return _original("save_checkpoint")(
            iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
            checkpointing_context, *rest, **kw)
    named = _named(SAVE_PARAMS, rest, kw)
    non_persistent_ckpt, release = named.get("non_persistent_ckpt", False), named.get("release", False)
    if non_persistent_ckpt:
        raise UCPError("megatron-ucp does not write non-persistent checkpoints; drop "
                       "--non-persistent-save-interval or the --ucp-save / --ckpt-format universal flag")
    if optimizer is None or getattr(optimizer, "is_stub_optimizer", False):
        raise UCPError("megatron-ucp saves need the DistributedOptimizer (model and optimizer state "
                       "are one checkpoint); this save_checkpoint call has no optimizer")
    if not getattr(args, "save", None):
        raise UCPError("--ucp-save / --ckpt-format universal needs --save DIR")
    import megatron_ucp

    extra = {k: int(getattr(args, k, 0) or 0) for k in SAMPLE_COUNTERS}
    extra["num_floating_point_operations_so_far"] = float(num_floating_point_operations_so_far or 0)
    extra["release"] = bool(release)
    models = model if isinstance(model, list) else [model]
    _print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {args.save} in megatron-ucp "
                  "fragment format")
    # --async-save: the commit happens in the maybe_finalize_async_save hook (below), which the
    # training loop calls each iteration; only install() puts it in place (not the patch route)
    async_save = bool(getattr(args, "async_save", False))
    if async_save and "maybe_finalize_async_save" not in _ORIGINALS:
        _print_rank_0("  --async-save: megatron_ucp.megatron_lm.install() is not in effect (patch "
                      "route), so this save is synchronous")
        async_save = False
    megatron_ucp.save(models, optimizer, opt_param_scheduler, args.save, iteration, extra=extra,
                      seed=int(getattr(args, "seed", 1234)), vocab_size=true_vocab_size(args),
                      async_save=async_save)
    _print_rank_0(f"  successfully saved checkpoint from iteration {iteration:7d} to {args.save} "
                  "[megatron-ucp]")


def maybe_finalize_async_save(*args, **kwargs):
    """Megatron-LM's `maybe_finalize_async_save` (same arguments): its own queue first, then a
    pending megatron-ucp asynchronous save (committed once every rank has written its file; with
    blocking=True, as at the end of training, it waits). The training loop calls it on every rank
    each iteration, which is what megatron_ucp.finalize needs."""
    out = _original("maybe_finalize_async_save")(*args, **kwargs)
    import megatron_ucp

    megatron_ucp.finalize(blocking=bool(kwargs.get("blocking", args[0] if args else False)))
    return out


def _find_checkpoint(path: str | None) -> Path | None:
    """The checkpoint directory `path` names (save root, fragment or universal dir), or None."""
    from megatron_ucp.formats import manifest as mf
    from megatron_ucp.storage import StoreError, location

    if not path:
        return None
    where = location(path)  # an unsupported URL scheme is an error, never "no checkpoint"
    try:
        return mf.resolve(where)
    except StoreError:  # a store that failed (credentials, throttling) is not an empty --load
        raise
    except UCPError:
        return None


def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg='load', strict=True,
                    checkpointing_context=None, *rest, **kw):
    """Megatron-LM's `load_checkpoint` (its signature, core_v0.16.1 to core_v0.19.0): megatron_ucp.load
    when asked for.

    Returns `(iteration, num_floating_point_operations_so_far)` as Megatron-LM's does and sets what
    its training loop reads afterwards: `args.consumed_train_samples`, `skipped_train_samples`,
    `consumed_valid_samples` (the data loaders resume from them), the micro-batch calculator, and
    the loaded iteration. Model weights, fp32 master weights, Adam moments and each parameter's own
    Adam step, the LR schedule and (at the saving layout) RNG state come from the checkpoint.

    With `--ckpt-format universal` and nothing to load under --load, it returns (0, 0) and training
    starts fresh, as Megatron-LM does for an empty --load; with --universal-checkpoint (or
    --exit-on-missing-checkpoint) a missing checkpoint is an error.
    """
    args = _get_args()
    if not wants_ucp_load(args):
        return _original("load_checkpoint")(
            ddp_model, optimizer, opt_param_scheduler, load_arg, strict, checkpointing_context,
            *rest, **kw)
    skip_load_to_model_and_opt = _named(LOAD_PARAMS, rest, kw).get("skip_load_to_model_and_opt", False)
    import torch.distributed as dist

    import megatron_ucp

    load_dir = getattr(args, load_arg, None)
    ckpt = _find_checkpoint(load_dir)
    if ckpt is None and getattr(args, "pretrained_checkpoint", None):
        ckpt = _find_checkpoint(args.pretrained_checkpoint)
        if ckpt is not None:
            raise UCPError(f"--pretrained-checkpoint {args.pretrained_checkpoint} is a megatron-ucp "
                           "checkpoint; finetuning from one (weights only, fresh optimizer) is not "
                           "supported yet: resume it with --load")
    if ckpt is None:
        if getattr(args, "universal_checkpoint", False) or getattr(args, "exit_on_missing_checkpoint", False):
            from megatron_ucp.formats import manifest as mf

            mf.resolve(load_dir or "")  # raises the precise reason
        _print_rank_0(f"WARNING: no megatron-ucp checkpoint under --{load_arg.replace('_', '-')} "
                      f"{load_dir}; training from scratch")
        return 0, 0
    for flag in ("finetune", "no_load_rng"):
        if getattr(args, flag, False):
            raise UCPError(f"--{flag.replace('_', '-')} is not supported with megatron-ucp loads: "
                           "they restore model, optimizer, schedule and RNG together")
    if skip_load_to_model_and_opt:
        raise UCPError("megatron-ucp cannot load into FSDP2 models (skip_load_to_model_and_opt)")
    models = ddp_model if isinstance(ddp_model, list) else [ddp_model]
    # --no-load-optim: the weights alone, the optimizer and its schedule fresh, as Megatron-LM's own
    # load does (the way to switch optimizers, e.g. an Adam checkpoint into a Muon run)
    no_optim = bool(getattr(args, "no_load_optim", False))
    result = megatron_ucp.load(models, optimizer, None if no_optim else opt_param_scheduler, ckpt,
                               strict=strict, reset_optimizer=no_optim)

    extra = result.extra
    for k in SAMPLE_COUNTERS:
        setattr(args, k, int(extra.get(k, 0)))
    if not args.consumed_train_samples and result.iteration:
        # a checkpoint saved by megatron_ucp.save outside Megatron-LM may only say consumed_samples
        args.consumed_train_samples = int(extra.get("consumed_samples", 0))
    _update_megatron_lm_state(args, result.iteration)
    iteration = 0 if extra.get("release") else result.iteration
    if dist.is_initialized():
        dist.barrier()
    _print_rank_0(f"  successfully loaded checkpoint from {ckpt} (megatron-ucp {result.checkpoint.name}, "
                  f"saved at {result.source_layout}) at iteration {iteration}")
    return iteration, extra.get("num_floating_point_operations_so_far", 0)


def _update_megatron_lm_state(args: argparse.Namespace, iteration: int) -> None:
    """What Megatron-LM's own load_checkpoint updates besides the model: micro-batch ramp-up,
    checkpoint version and loaded-iteration globals (skipped where megatron.training is absent)."""
    from megatron.core import num_microbatches_calculator as nmc

    if mcore_training.microbatches_calculator_initialized():
        nmc.update_num_microbatches(consumed_samples=args.consumed_train_samples, verbose=True)
    try:
        import megatron.training.checkpointing as ckpt
    except ImportError:
        return
    ckpt.set_checkpoint_version(3.0)  # current parameter layout; no QKV reordering applies
    ckpt.set_loaded_iteration(iteration)


# ------------------------------------------------------------------- overlapped recomputation

_OVERLAP_SCHEDULES: dict[str, Callable] = {}  # plan path -> its forward-backward function


def get_forward_backward_func(pp_size: int | None = None, vp_size: int | None = None, **kw) -> Callable:
    """megatron-core's `get_forward_backward_func` (same signature; 0.19's `schedule_pg_collection`
    goes through in `kw`), for Megatron-LM's training loop.

    With `--overlap-recompute PLAN.json` it returns the function that executes that plan
    (`megatron_ucp.recompute.runtime.forward_backward_func`; it picks megatron-core's schedule for
    the initialised layout itself, so pp_size/vp_size are not used); otherwise megatron-core's own
    function for pp_size/vp_size. The plan is loaded once per path.
    """
    path = getattr(_get_args(), "overlap_recompute", None)
    if not path:
        from megatron.core.pipeline_parallel import get_forward_backward_func as core_func

        return core_func(pp_size, vp_size, **kw)
    if path not in _OVERLAP_SCHEDULES:
        from megatron_ucp.recompute import plan as recompute_plan
        from megatron_ucp.recompute import runtime

        plan = recompute_plan.load(path)  # PlanError naming the file when it is not a plan
        _OVERLAP_SCHEDULES[path] = runtime.forward_backward_func(plan)
        _print_rank_0(f"--overlap-recompute {path}: {sum(lp.recompute == 'full' for lp in plan.layers)}"
                      f" full, {sum(lp.recompute == 'selective' for lp in plan.layers)} selective of "
                      f"{len(plan.layers)} layers, partition {plan.layers_per_stage}")
    return _OVERLAP_SCHEDULES[path]


# ------------------------------------------------------------------------------ installation

def _wrap_parse_args(parse_args: Callable) -> Callable:
    if getattr(parse_args, "_megatron_ucp", False):
        return parse_args

    def wrapped(extra_args_provider=None, ignore_unknown_args=False):
        return parse_args(chain_extra_args_providers(extra_args_provider, _provider),
                          ignore_unknown_args)

    wrapped._megatron_ucp = True
    wrapped.__doc__ = parse_args.__doc__
    return wrapped


_provider = extra_args_provider  # the module-level provider, unshadowed by parameter names


def install() -> None:
    """Route Megatron-LM's checkpoint save/load through the hooks; no Megatron-LM patch needed.

    `megatron.training.training` imported save_checkpoint / load_checkpoint by name, so both it and
    `megatron.training.checkpointing` get the hooks; Megatron-LM's argument parser gets the flags
    (parse_args is wrapped so the script's own extra_args_provider still runs); the training loop's
    `get_forward_backward_func` becomes the --overlap-recompute hook. Call it after the CPU shim (if
    any) and before pretrain(). Idempotent.
    """
    import megatron.training.arguments as arguments
    import megatron.training.checkpointing as ckpt
    import megatron.training.initialize as initialize
    import megatron.training.training as training

    for name, hook in (("save_checkpoint", save_checkpoint), ("load_checkpoint", load_checkpoint)):
        current = getattr(ckpt, name)
        if current is not hook:
            _ORIGINALS[name] = current
        setattr(ckpt, name, hook)
        setattr(training, name, hook)
    import megatron.training.async_utils as async_utils

    current = async_utils.maybe_finalize_async_save
    if current is not maybe_finalize_async_save:
        _ORIGINALS["maybe_finalize_async_save"] = current
    for module in mcore_training.modules_holding("maybe_finalize_async_save",
                                                 (async_utils, training, ckpt)):
        module.maybe_finalize_async_save = maybe_finalize_async_save
    # training.py imported get_forward_backward_func by name; ours hands back megatron-core's
    # unless --overlap-recompute is set
    training.get_forward_backward_func = get_forward_backward_func
    # core_v0.16.1's initialize imported parse_args by name; core_v0.19.0's has none
    for module in mcore_training.modules_holding("parse_args", (arguments, initialize)):
        module.parse_args = _wrap_parse_args(module.parse_args)


def run_script(script: str, argv: list[str]) -> None:
    """install(), then run a Megatron-LM training script (e.g. pretrain_gpt.py) as __main__."""
    script = os.path.abspath(script)
    sys.path.insert(0, os.path.dirname(script))  # as `python script.py` would
    install()
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m megatron_ucp.megatron_lm PATH/TO/pretrain_gpt.py [megatron args...]")
    # the importable module, not this __main__ copy: one set of hooks and recorded originals
    from megatron_ucp.megatron_lm import run_script as _run_script

    _run_script(sys.argv[1], sys.argv[2:])
