"""`megatron-ucp` command line: convert, inspect, reshard, verify, diff, import-legacy,
import-torch-dist, export-hf, import-hf, import-deepspeed, profile-recompute, plan-recompute."""

from __future__ import annotations

import argparse
import sys

from megatron_ucp import formats  # the registry: no torch


class _HFArchs:
    """export-hf --arch choices: the registry formats.hf.archs.ARCHS, read only when argparse
    checks or lists them (importing it imports torch, which building the parser must not)."""

    def __iter__(self):
        from megatron_ucp.formats.hf.archs import ARCHS

        return iter(ARCHS)

    def __contains__(self, name: object) -> bool:
        return name in tuple(self)


HF_ARCHS = _HFArchs()

BASE_HELP = ("a Megatron-Bridge LoRA checkpoint's base checkpoint, into which its adapters are "
             "merged (default: its run_config.yaml checkpoint.pretrained_checkpoint)")
TRUST_HELP = ("unpickle Megatron-LM files with the plain unpickler (runs code from the file): only "
              "for checkpoints you trust whose pickles hold types outside megatron-ucp's allowlist")
NO_PROGRESS_HELP = "no progress bars (log lines only)"
TARGET_DIMS = {"tp": "tensor-parallel", "pp": "pipeline-parallel", "dp": "data-parallel",
               "ep": "expert-parallel", "vpp": "virtual pipeline (model chunks per stage)",
               "cp": "context-parallel"}


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (every subcommand but profile-recompute's own flags)."""
    parser = argparse.ArgumentParser(prog="megatron-ucp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    # (in the order `--help` lists them)
    _add_convert_inspect(sub)
    _add_reshard(sub)
    _add_verify_diff(sub)
    _add_megatron_imports(sub)
    _add_export_hf(sub)
    _add_other_imports(sub)
    _add_plan_recompute(sub)
    sub.add_parser("profile-recompute", add_help=False,
                   help="Lynx: measure per-module layer costs and p2p/TP all-reduce costs on the real "
                   "megatron-core layers into a profile for plan-recompute (its own --help)")
    return parser


def _add_convert_inspect(sub) -> None:
    p = sub.add_parser("convert", help="consolidate a fragment checkpoint into a universal directory")
    p.add_argument("fragments_dir", help="save root (with 'latest') or an iter_XXXXXXX directory")
    p.add_argument("universal_dir", help="new output directory")
    p.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    p = sub.add_parser("inspect", help="print layout, iteration, parameter table and sizes of any "
                       "checkpoint (megatron-ucp, Megatron-LM torch or torch_dist, Hugging Face)")
    p.add_argument("dir", help="checkpoint (format detected): a save root or a checkpoint directory")
    p.add_argument("--trust-pickle", action="store_true", help=TRUST_HELP)
    p.add_argument("--base", default=None, metavar="DIR", help=BASE_HELP)


def _add_verify_diff(sub) -> None:
    p = sub.add_parser("verify", help="checksums of every tensor and exact coverage of every parameter")
    p.add_argument("dir", help="megatron-ucp checkpoint: a save root or a checkpoint directory")
    p = sub.add_parser("diff", help="compare two checkpoints (any supported format and layout): the "
                       "iteration, which parameters and optimizer states each holds, every Adam step "
                       "and the max abs/rel difference per tensor. Exit status: 0 when they hold the "
                       "same parameters, states and steps and every difference is within --atol or "
                       "--rtol (default: identical), 1 when they differ, 2 on an error")
    p.add_argument("a", help="first checkpoint (format detected)")
    p.add_argument("b", help="second checkpoint (format detected)")
    p.add_argument("--atol", type=float, default=0.0,
                   help="a tensor matches when its max abs difference is at most this (default 0)")
    p.add_argument("--rtol", type=float, default=0.0,
                   help="... or its max relative difference is at most this (default 0)")
    p.add_argument("--trust-pickle", action="store_true", help=TRUST_HELP)


def _add_reshard(sub) -> None:
    """reshard: its target formats are the registry's (`formats.TARGETS`)."""
    megatron = [t for t, name in formats.TARGETS.items() if formats.FORMATS[name].run_args]
    p = sub.add_parser("reshard", help="any checkpoint (megatron-ucp, Megatron-LM torch or torch_dist, "
                       "Megatron-Bridge) "
                       "-> universal directory, checked against a target layout")
    p.add_argument("--load", required=True, help="source checkpoint (format detected)")
    p.add_argument("--save", required=True, help="new output directory")
    for dim, what in TARGET_DIMS.items():
        p.add_argument(f"--target-{dim}", type=int, default=None,
                       help=f"target {what} size (default 1; a universal target is only checked "
                       "against the target layout, which the loading run chooses)")
    p.add_argument("--target-format", choices=list(formats.TARGETS), default="universal",
                   help="universal (default; layout-free, megatron_ucp.load or Megatron-LM "
                   "--universal-checkpoint), or a Megatron-LM checkpoint at the target layout: "
                   f"{' or '.join(f'{t} (--ckpt-format {t})' for t in megatron if t != 'bridge')}, "
                   "or a Megatron-Bridge torch_dist save (bridge); those need a Megatron-LM or "
                   "Bridge source (a bridge target: a Bridge source)")
    p.add_argument("--workers", type=int, default=1,
                   help="processes writing the universal data files (forked; default 1)")
    p.add_argument("--target-first-stage-layers", type=int, default=None,
                   help="uneven pipeline: layers on the first stage (Megatron-LM targets)")
    p.add_argument("--target-last-stage-layers", type=int, default=None,
                   help="uneven pipeline: layers on the last stage (Megatron-LM targets)")
    p.add_argument("--target-etp", type=int, default=None,
                   help="torch_dist target of a MoE model: expert tensor parallel size (default: "
                   "the source's rule, its own value or TP)")
    p.add_argument("--target-optim-sharding", choices=["fully_reshardable", "dp_reshardable"],
                   default=None, help="torch_dist target: the optimizer state's form (default "
                   "fully_reshardable, loads at any layout; dp_reshardable, Megatron-LM's default, "
                   "loads at the target TP/PP only; a Muon/Lion run's LayerWise optimizer has one "
                   "form, any layout: leave it unset)")
    p.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    p.add_argument("--trust-pickle", action="store_true", help=TRUST_HELP)
    p.add_argument("--base", default=None, metavar="DIR", help=BASE_HELP)


def _add_megatron_imports(sub) -> None:
    """import-<format> of each registered format that declares such a command."""
    for command, name in formats.IMPORT_COMMANDS.items():
        what = formats.FORMATS[name].target
        p = sub.add_parser(command, help=f"convert a Megatron-LM --ckpt-format {what} checkpoint "
                           "(distributed optimizer) into a universal directory")
        p.add_argument("load_dir", help="Megatron-LM save root (with "
                       "latest_checkpointed_iteration.txt) or an iter_XXXXXXX directory")
        p.add_argument("universal_dir", help="new output directory")
        p.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
        p.add_argument("--trust-pickle", action="store_true", help=TRUST_HELP)


def _add_other_imports(sub) -> None:
    """import-hf, import-deepspeed (their own arguments)."""
    p = sub.add_parser("import-hf", help="a Hugging Face transformers model directory -> universal "
                       "directory, weights only (in the HF dtype; no optimizer state on disk: a "
                       "load starts the optimizer fresh)")
    p.add_argument("hf_dir", help="save_pretrained output: config.json and *.safetensors (blockwise "
                   "FP8 weights, DeepSeek-V3 / Kimi-K2 style, are dequantized to fp32)")
    p.add_argument("universal_dir", help="new output directory")
    p.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    p = sub.add_parser("import-deepspeed", help="a DeepSpeed universal checkpoint folder "
                       "(ds_to_universal output) -> universal directory with its optimizer state "
                       "(fp32 master weights, Adam moments and step)")
    p.add_argument("ds_universal_dir", help="ds_to_universal's --output_folder (holds zero/), or the "
                   "DeepSpeed save directory whose latest_universal names it")
    p.add_argument("universal_dir", help="new output directory")
    p.add_argument("--name-map", required=True, metavar="MAP.yaml",
                   help="the megatron-core model settings and the DeepSpeed -> megatron-core name "
                   "rules (configs/deepspeed/*.yaml; schema in configs/deepspeed/README.md)")
    p.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    p.add_argument("--trust-pickle", action="store_true",
                   help="unpickle the zero/*.pt files with the plain unpickler (runs code from the "
                   "files): only for checkpoints you trust that hold types outside the allowlist "
                   "(tensors, numbers, flags)")


def _add_export_hf(sub) -> None:
    p = sub.add_parser("export-hf", help="any checkpoint -> a Hugging Face transformers model "
                       "directory (config.json, safetensors shards; no optimizer state)")
    p.add_argument("src", help="source checkpoint (format detected)")
    p.add_argument("out", help="new output directory")
    p.add_argument("--arch", required=True, choices=HF_ARCHS, metavar="ARCH",  # (metavar: lazy choices)
                   help="the transformers architecture to write (the model must match it exactly): "
                   "%(choices)s")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32", "bfloat16", "float16", "float32", "fp8"],
                   default=None, help="weight dtype (default: the checkpoint's model dtype); fp8: the "
                   "linear weights as blockwise FP8 (e4m3 + weight_scale_inv, DeepSeek-V3's form), the "
                   "rest bf16")
    p.add_argument("--fp8-block-size", type=int, nargs=2, default=None, metavar=("ROWS", "COLS"),
                   help="--dtype fp8's blocks (default: those of the FP8 HF model import-hf read, else "
                   "128 128)")
    p.add_argument("--max-shard-bytes", type=int, default=5 * 10**9,
                   help="largest safetensors shard (default 5e9 bytes, as save_pretrained)")
    p.add_argument("--vocab-size", type=int, default=None, help="true vocabulary: embedding rows "
                   "to keep (default: the checkpoint's record, else all rows)")
    p.add_argument("--rope-theta", type=float, default=None, help="rotary base (default: the "
                   "model config's rotary_base, else megatron-core's 10000)")
    p.add_argument("--activation", choices=["swiglu", "gelu", "openai_gelu"], default=None,
                   help="the run's MLP activation, which megatron_ucp.save does not record "
                   "(default: Megatron-LM args, else the import-hf record, else gelu / swiglu)")
    template = p.add_mutually_exclusive_group()
    template.add_argument("--hf-template", metavar="DIR", default=None,
                          help="HF model directory whose tokenizer, generation / processor configs, "
                          "chat template and remote code are copied (never its weights) and whose "
                          "config.json fields the checkpoint does not determine are kept (those it "
                          "does must agree: a conflict is refused by name); default: the HF model "
                          "import-hf read (the checkpoint's copies of its files, else its directory)")
    template.add_argument("--no-hf-template", action="store_true",
                          help="carry no template: config.json and generation_config.json as derived "
                          "from the checkpoint alone")
    p.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    p.add_argument("--trust-pickle", action="store_true", help=TRUST_HELP)
    p.add_argument("--base", default=None, metavar="DIR", help=BASE_HELP)


def _add_plan_recompute(sub) -> None:
    p = sub.add_parser("plan-recompute", help="Lynx: per-layer recompute choices, overlap windows and "
                       "a recompute-aware stage partition under a memory limit, against Megatron's "
                       "best recompute setting (simulated)")
    p.add_argument("--config", required=True, metavar="MODEL.yaml",
                   help="model config (configs/recompute/*.yaml)")
    for flag in ("tp", "pp", "dp"):
        p.add_argument(f"--{flag}", type=int, required=True, help=f"{TARGET_DIMS[flag]} size of the run")
    p.add_argument("--micro-batch", type=int, required=True, help="micro-batch size (sequences)")
    p.add_argument("--global-batch", type=int, required=True, help="global batch size (sequences)")
    p.add_argument("--memory-gib", type=float, required=True,
                   help="memory per GPU for weights, grads, optimizer state and activations")
    p.add_argument("--profile", metavar="PROFILE.json", default=None,
                   help="measured profile (megatron-ucp profile-recompute); default: published "
                   "figures of --gpu")
    p.add_argument("--gpu", default="A100-80GB", help="published figures to use without --profile "
                   "(A100-80GB, H100-80GB)")
    p.add_argument("--vpp", type=int, default=None, help="interleaved schedule: model chunks per stage")
    p.add_argument("--out", default="recompute-plan.json", metavar="PLAN.json",
                   help="where to write the plan (default recompute-plan.json)")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["profile-recompute"]:  # its flags are the profiler's own parser's
        from megatron_ucp.recompute import profiler

        return profiler.main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "plan-recompute":
        return _plan_recompute(args)

    import logging

    from tqdm import tqdm

    from megatron_ucp.errors import UCPError

    # the library reports through the `megatron_ucp` logger; here its INFO lines go to stderr
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[megatron-ucp] %(message)s"))
    logger = logging.getLogger("megatron_ucp")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    progress = False if getattr(args, "no_progress", False) else tqdm

    distributed = created_group = False
    try:
        # under torchrun a conversion is one job: each process converts a share, rank 0 commits
        if args.command in ("convert", "reshard", "export-hf"):
            distributed, created_group = _join_torchrun_job()
        if distributed:
            progress = False
        status = _run(args, progress, distributed)
        if distributed:  # every process is done before any tears the group down
            import torch.distributed as dist

            dist.barrier()
        return status
    except UCPError as e:
        print(f"megatron-ucp: error: {e}", file=sys.stderr)
        return 2
    finally:
        logger.removeHandler(handler)
        if created_group:
            _leave_torchrun_job()


def _run(args, progress, distributed: bool) -> int:
    """One command but plan-/profile-recompute; its exit status."""
    from megatron_ucp import conversion

    if args.command == "convert":
        conversion.convert(args.fragments_dir, args.universal_dir, progress=progress,
                           distributed=distributed)
    elif args.command == "inspect":
        from megatron_ucp.inspector import inspect

        print(inspect(args.dir, trust_pickle=args.trust_pickle, lora_base=args.base))
    elif args.command == "reshard":
        from megatron_ucp.layout import Layout

        sizes = {d: getattr(args, f"target_{d}") for d in TARGET_DIMS}
        target = (Layout(**{d: v for d, v in sizes.items() if v is not None})
                  if any(v is not None for v in sizes.values()) else None)
        print(conversion.reshard(args.load, args.save, target, args.target_format,
                                 progress=progress,
                                 first_stage_layers=args.target_first_stage_layers,
                                 last_stage_layers=args.target_last_stage_layers,
                                 workers=args.workers, optim_sharding=args.target_optim_sharding,
                                 expert_tensor_parallel=args.target_etp,
                                 trust_pickle=args.trust_pickle, distributed=distributed,
                                 lora_base=args.base))
    elif args.command == "verify":
        from megatron_ucp.checks import verify

        print(verify(args.dir))
    elif args.command == "diff":
        from megatron_ucp.checks import diff, format_diff

        rows = diff(args.a, args.b, trust_pickle=args.trust_pickle)
        print(format_diff(rows, args.atol, args.rtol))
        return int(any(r.differs(args.atol, args.rtol) for r in rows))
    elif args.command in formats.IMPORT_COMMANDS:
        conversion.convert(args.load_dir, args.universal_dir, progress=progress,
                           fmt=formats.IMPORT_COMMANDS[args.command], trust_pickle=args.trust_pickle)
    elif args.command == "export-hf":
        conversion.export_hf(args.src, args.out, args.arch, dtype=args.dtype,
                             max_shard_bytes=args.max_shard_bytes, progress=progress,
                             vocab_size=args.vocab_size, rope_theta=args.rope_theta,
                             activation=args.activation, trust_pickle=args.trust_pickle,
                             lora_base=args.base,
                             distributed=distributed,
                             fp8_block_size=tuple(args.fp8_block_size) if args.fp8_block_size else None,
                             hf_template=False if args.no_hf_template else args.hf_template)
    elif args.command == "import-hf":
        conversion.import_hf(args.hf_dir, args.universal_dir, progress=progress)
    elif args.command == "import-deepspeed":
        conversion.import_deepspeed(args.ds_universal_dir, args.universal_dir, args.name_map,
                                    trust_pickle=args.trust_pickle, progress=progress)
    return 0


def _join_torchrun_job() -> tuple[bool, bool]:
    """(distributed, created): distributed under torchrun with several processes (WORLD_SIZE > 1),
    where the gloo process group is initialized here unless it is already (from torchrun's
    MASTER_ADDR / MASTER_PORT / RANK); gloo, no GPU needed."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False, False
    import torch.distributed as dist

    if dist.is_initialized():
        return True, False
    dist.init_process_group("gloo")
    return True, True


def _leave_torchrun_job() -> None:
    """Destroy the process group `_join_torchrun_job` made: a gloo group left to the interpreter's
    exit can abort the process (std::terminate in its threads) after the job's work is done."""
    import torch.distributed as dist

    dist.destroy_process_group()


def _plan_recompute(args) -> int:
    """megatron-ucp plan-recompute: print the plan table, write the plan JSON."""
    from megatron_ucp.recompute import hardware, planner
    from megatron_ucp.recompute import plan as plan_io
    from megatron_ucp.recompute import profile as profile_io
    from megatron_ucp.recompute.simulator import SimulatorError

    errors = (hardware.ModelConfigError, planner.PlannerError, profile_io.ProfileError,
              plan_io.PlanError, SimulatorError)
    try:
        model = hardware.load_model_config(args.config)
        model["micro_batch_size"] = args.micro_batch
        hardware.check_tp(model, args.tp, args.config)
        if args.profile:
            prof = profile_io.load(args.profile)
            if prof.tp != args.tp and prof.source == "published" and prof.device.split()[0] in hardware.GPUS:
                prof = hardware.published_profile(model, args.tp, args.micro_batch, prof.device.split()[0])
            elif prof.tp != args.tp:
                raise planner.PlannerError(
                    f"{args.profile}: the profile was taken at TP {prof.tp}, not --tp {args.tp}; "
                    f"profile again with `megatron-ucp profile-recompute --tp {args.tp}` (or omit "
                    "--profile to plan with published figures)")
            for field in ("hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                          "seq_length", "micro_batch_size"):
                want, got = model.get(field), prof.model.get(field)
                if got is not None and got != want:
                    raise planner.PlannerError(
                        f"{args.profile}: field model.{field} is {got}, but {args.config} with "
                        f"--micro-batch {args.micro_batch} says {want}; profile this model and "
                        "micro-batch again")
        else:
            prof = hardware.published_profile(model, args.tp, args.micro_batch, args.gpu)
        result = planner.plan(prof, pp=args.pp, dp=args.dp, global_batch_size=args.global_batch,
                              memory_limit_bytes=int(args.memory_gib * 2**30),
                              num_layers=model["num_layers"], vpp=args.vpp, model=model)
    except planner.NothingFitsError as e:
        print(f"megatron-ucp: {e}", file=sys.stderr)
        return 2
    except errors as e:
        print(f"megatron-ucp: error: {e}", file=sys.stderr)
        return 2
    import pathlib

    print(planner.format_plan(result, pathlib.Path(args.config).stem))
    plan_io.save(result, args.out)
    print(f"plan written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
