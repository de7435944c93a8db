"""Rebuild a Megatron-LM run's GPT model chunks (and DDP buffers) from its checkpoint `args`.

Why this exists: Megatron-LM checkpoints do not say where a parameter sits in the global model or
in the distributed optimizer's flat buffers; megatron-core's code decides that at the saving
layout. Both importers (`megatron_legacy`, `megatron_dist`) therefore ask megatron-core itself: they
rebuild the model as one global rank of the source run would, inside this process, on a fake
process group (no communication), with weights on the meta device (no memory, no GPU), and read
names, TP splits and buffer offsets from the rebuilt modules.

Usage:

    with source_rank(args, rank):
        chunks = wrap_ddp(build_chunks(args), args)   # or build_chunks(args) for specs only

`single_rank_args(args)` gives the same run at TP1/PP1 on one rank (for universal parameter specs);
`megatron_specs(args)` reads those specs off the rebuilt model (the HF and DeepSpeed importers).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ucp.errors import UCPError
from megatron_ucp.formats.megatron_common import (
    YARN_FROM_ARGS,
    hybrid_layer_pattern,
    layout,
    rank_order,
    world,
)
from megatron_ucp.formats.megatron_hybrid import build_hybrid_chunk
from megatron_ucp.formats.megatron_te import te_on_meta, uses_te
from megatron_ucp.gdn_spec import gdn_block_spec, gdn_buildable, is_gdn_model, mark_split_dims
from megatron_ucp.mcore_compat.config import config_kwargs_from_args, rederive_weight_shards
from megatron_ucp.mcore_compat.mamba import (
    mamba_conv1d_is_module,
    saved_parameter_order,
    set_hybrid_pattern_for_pp,
)
from megatron_ucp.mcore_compat.moe import grouped_gemm_importable
from megatron_ucp.param_spec import local_params
from megatron_ucp.spec import ParamSpec
from megatron_ucp.validation import model_config as config_of

# TransformerConfig settings for the rebuild. The fusions change nothing about parameter names,
# shapes or order but would need CUDA extensions or TransformerEngine. Initialisation stays on (on
# the meta device it costs nothing): megatron-core 0.16 sets a weight's `tensor_model_parallel` and
# `partition_dim` attributes, which the param specs read, only inside its init helpers; the CPU
# path needs no CUDA RNG tracker.
REBUILD_SETTINGS = {
    "use_cpu_initialization": True,
    "perform_initialization": True,
    "gradient_accumulation_fusion": False,
    "masked_softmax_fusion": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "persist_layer_norm": False,
    "apply_rope_fusion": False,
    "cross_entropy_loss_fusion": False,
    "tp_comm_overlap": False,
    "use_te_rng_tracker": False,
    "config_logger_dir": "",
}


def single_rank_args(args):
    """A copy of `args` describing the same model trained on one rank (TP1, PP1, no VPP/CP/EP).

    Why: the universal parameter specs (names, global shapes, split axes) come from the whole
    model on one rank; every layout-only setting is reset so the TransformerConfig stays valid.
    """
    one = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
           "virtual_pipeline_model_parallel_size": None, "context_parallel_size": 1,
           "hierarchical_context_parallel_sizes": None, "expert_model_parallel_size": 1,
           "expert_tensor_parallel_size": 1, "data_parallel_size": 1, "world_size": 1,
           "sequence_parallel": False, "decoder_first_pipeline_num_layers": None,
           "decoder_last_pipeline_num_layers": None, "pipeline_model_parallel_layout": None,
           "num_layers_per_virtual_pipeline_stage": None,
           "num_virtual_stages_per_pipeline_rank": None,
           "account_for_embedding_in_pipeline_split": False,
           "account_for_loss_in_pipeline_split": False,
           "overlap_param_gather_with_optimizer_step": False}
    single = argparse.Namespace(**{**vars(args), **one})
    set_hybrid_pattern_for_pp(single, 1)  # (a hybrid pattern's `|` stages)
    rederive_weight_shards(single)
    return single


# ----------------------------------------------------------------------------------------------
# parallel state of one source rank


@contextlib.contextmanager
def source_rank(args, rank: int) -> Iterator[None]:
    """megatron-core's parallel state as global rank `rank` of the saving run, on a fake process
    group, with CUDA placement pointed at the meta device: structure only, no weight memory, no GPU.

    Refuses to run when torch.distributed is already initialised (the fake group would replace the
    job's own); the patched torch.cuda attributes are restored and all groups destroyed on exit.
    """
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers backend "fake"

    if dist.is_available() and dist.is_initialized():
        raise UCPError("reading or writing a Megatron-LM checkpoint rebuilds its model from the args "
                       "on a private fake process group and cannot run inside a job that already "
                       "has one; run it in a separate process (`megatron-ucp reshard` / "
                       "`import-legacy` / `import-torch-dist`)")
    saved = (torch.cuda.current_device, torch.Tensor.cuda)
    try:
        torch.cuda.current_device = lambda: torch.device("meta")
        torch.Tensor.cuda = lambda self, *a, **k: self
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world(args))
        ps.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=layout(args).vpp,
            context_parallel_size=getattr(args, "context_parallel_size", 1),
            hierarchical_context_parallel_sizes=getattr(args, "hierarchical_context_parallel_sizes", None),
            expert_model_parallel_size=getattr(args, "expert_model_parallel_size", 1),
            expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None),
            order=rank_order(args),
            create_gloo_process_groups=False,
        )
        with torch.device("meta"):
            yield
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.cuda.current_device, torch.Tensor.cuda = saved


# ----------------------------------------------------------------------------------------------
# the model, as megatron.training builds it


def transformer_config(args):
    """megatron.training.arguments.core_transformer_config_from_args (core_v0.16.1), plus the
    structure-neutral REBUILD_SETTINGS."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    cls = MLATransformerConfig if getattr(args, "multi_latent_attention", False) else TransformerConfig
    fields = {f.name for f in dataclasses.fields(cls)}
    kw = config_kwargs_from_args({k: getattr(args, k) for k in fields if hasattr(args, k)})
    kw.update(
        deallocate_pipeline_outputs=True,
        pipeline_dtype=args.params_dtype,
        num_moe_experts=getattr(args, "num_experts", None),
        num_layers_in_first_pipeline_stage=getattr(args, "decoder_first_pipeline_num_layers", None),
        num_layers_in_last_pipeline_stage=getattr(args, "decoder_last_pipeline_num_layers", None),
        num_query_groups=args.num_query_groups if getattr(args, "group_query_attention", False) else None,
    )
    if getattr(args, "swiglu", False):
        kw.update(activation_func=F.silu, gated_linear_unit=True)
    elif getattr(args, "squared_relu", False):
        from megatron.core.activations import squared_relu

        kw["activation_func"] = squared_relu
    elif getattr(args, "quick_geglu", False):
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        kw.update(activation_func=quick_gelu, gated_linear_unit=True)
    if getattr(args, "rope_type", None) is None:
        kw.pop("rope_type", None)
    cp_comm = getattr(args, "cp_comm_type", None)
    if isinstance(cp_comm, list) and len(cp_comm) == 1:
        kw["cp_comm_type"] = cp_comm[0]
    kw.update({k: v for k, v in REBUILD_SETTINGS.items() if k in fields})
    try:
        config = cls(**kw)
    except Exception as e:
        raise UCPError(f"cannot rebuild the model's TransformerConfig from the checkpoint args "
                       f"({type(e).__name__}: {e})") from e
    _set_yarn_attributes(config, args)
    return config


def _set_yarn_attributes(config, args) -> None:
    """A non-MLA YaRN run's `config.yarn_*`, as Megatron-LM sets them (MLA's config has fields)."""
    if getattr(args, "position_embedding_type", None) != "yarn" or \
            getattr(args, "multi_latent_attention", False):
        return
    for attr, arg, default in YARN_FROM_ARGS:
        if not hasattr(config, attr):
            value = getattr(args, arg, None)
            setattr(config, attr, default if value is None else value)


def replace_module(spec, old: type, new):
    """Copy of a layer or block spec with every `old` module class replaced by `new`."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if spec is old:
        return new
    if isinstance(spec, list):  # a block spec's layer_specs
        return [replace_module(s, old, new) for s in spec]
    if isinstance(spec, ModuleSpec) or dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: replace_module(getattr(spec, f.name), old, new)
                                            for f in dataclasses.fields(spec)})
    return spec


class _MLACoreAttentionSpecOnly(torch.nn.Module):
    """MLA's core attention in a rebuild (structure only, never run). Why: megatron-core's MLA
    passes k_channels / v_channels, which only Transformer Engine's core attention accepts, not the
    local spec's DotProductAttention; the vanilla-softmax core attention has no parameters."""

    def __init__(self, *_: object, **__: object):
        super().__init__()

    def forward(self, *_: object, **__: object):
        raise UCPError("a model rebuilt by megatron-ucp from checkpoint args has no forward")


@contextlib.contextmanager
def _mla_without_te(config) -> Iterator[None]:
    """megatron-core's MLA tests isinstance(linear_proj, TELinear) when HAVE_TE, which its TE
    extension module sets without Transformer Engine (TELinear then is a stand-in, not a class):
    while building, HAVE_TE says what it means."""
    if not getattr(config, "multi_latent_attention", False):
        yield
        return
    from megatron.core.transformer import multi_latent_attention as mla

    saved = mla.HAVE_TE
    mla.HAVE_TE = saved and isinstance(mla.TELinear, type)
    try:
        yield
    finally:
        mla.HAVE_TE = saved


def build_chunks(args) -> list:
    """This rank's model chunks (one per VPP stage) as Megatron-LM's get_model builds them
    (gpt_builders; the local spec, TE's for a TE run where TE is usable; MoE through the decoder
    block spec), Float16Module-wrapped when the
    run trained in fp16/bf16. Call inside `source_rank`."""
    from megatron.core.transformer.module import Float16Module

    config = transformer_config(args)
    vpp = layout(args).vpp
    with grouped_gemm_importable(getattr(args, "moe_grouped_gemm", False)), _mla_without_te(config), \
            te_on_meta(uses_te(args)):
        if hybrid_layer_pattern(args):
            if vpp:
                raise UCPError("a hybrid (Mamba) model has no virtual pipeline stages in megatron-core "
                               "(MambaStack refuses them); the args ask for "
                               f"{vpp} per pipeline rank")
            chunks = [build_hybrid_chunk(args, config)]
        else:
            chunks = [_build_chunk(args, config, i if vpp else None) for i in range(vpp or 1)]
    if args.fp16 or args.bf16:
        chunks = [Float16Module(config, c) for c in chunks]
    return chunks


def _build_chunk(args, config, vp: int | None):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_decoder_layer_specs,
        get_gpt_mtp_block_spec,
    )

    qk_l2_norm = getattr(args, "qk_l2_norm", False)
    te = uses_te(args)  # a TE run with TE usable here: TE's layers, else the local spec
    if is_gdn_model(args):  # Gated DeltaNet (Qwen3-Next): gpt_builders' spec, or its local one
        with gdn_buildable():
            return _gpt_model(args, config, gdn_block_spec(config, te, vp, args), None, vp)
    if getattr(args, "num_experts", None):
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te,
                                          normalization=args.normalization, qk_l2_norm=qk_l2_norm,
                                          vp_stage=vp)
    else:
        spec = _dense_layer_spec(args)
    mtp_spec = None
    if getattr(args, "mtp_num_layers", None):
        # gpt_builders: the MTP layer takes the spec of the decoder's last layer (the dense layer
        # spec when this stage builds no decoder layer)
        if getattr(spec, "layer_specs", None) == []:
            mtp_layer_spec = _dense_layer_spec(args)
        else:
            mtp_layer_spec = get_gpt_decoder_layer_specs(
                config, use_transformer_engine=te, normalization=args.normalization,
                qk_l2_norm=qk_l2_norm, vp_stage=vp)[-1]
        mtp_spec = get_gpt_mtp_block_spec(config, mtp_layer_spec, use_transformer_engine=te,
                                          vp_stage=vp)
    if getattr(args, "multi_latent_attention", False) and not te:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        spec = replace_module(spec, DotProductAttention, _MLACoreAttentionSpecOnly)
        mtp_spec = replace_module(mtp_spec, DotProductAttention, _MLACoreAttentionSpecOnly)
    return _gpt_model(args, config, spec, mtp_spec, vp)


def _gpt_model(args, config, spec, mtp_spec, vp: int | None):
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel

    model = GPTModel(
        config=config, transformer_layer_spec=spec, mtp_block_spec=mtp_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=getattr(args, "rotary_percent", 1.0),
        rotary_base=getattr(args, "rotary_base", 10000),
        rope_scaling=getattr(args, "use_rope_scaling", False),
        rope_scaling_factor=getattr(args, "rope_scaling_factor", 8.0),
        # linear RoPE scaling (--rotary-seq-len-interpolation-factor): megatron-core divides the positions
        seq_len_interpolation_factor=getattr(args, "rotary_seq_len_interpolation_factor", None),
        vp_stage=vp,
    )
    if is_gdn_model(args):
        mark_split_dims(model)
    for p in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    return model


def _dense_layer_spec(args):
    """gpt_builders' layer spec of a dense model: Transformer Engine's for a TE run where TE is
    usable, else the local one (the MoE switches, grouped GEMM and legacy GroupedMLP, select
    nothing without experts)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if uses_te(args):
        return get_gpt_layer_with_transformer_engine_spec(
            None, False, getattr(args, "qk_layernorm", False),
            getattr(args, "multi_latent_attention", False), qk_l2_norm=getattr(args, "qk_l2_norm", False))
    return get_gpt_layer_local_spec(
        num_experts=None, qk_layernorm=getattr(args, "qk_layernorm", False),
        multi_latent_attention=getattr(args, "multi_latent_attention", False),
        normalization=args.normalization, qk_l2_norm=getattr(args, "qk_l2_norm", False))


def wrap_ddp(chunks: list, args, mamba_conv1d_module: bool | None = None) -> list:
    """The chunks inside megatron-core DistributedDataParallel with the run's buffer settings, as
    megatron.training.training.get_model builds the DDP config (only the buffer layout matters:
    `buffers[i].param_index_map` and bucket offsets are what the importers read).

    mamba_conv1d_module: how the release that saved a hybrid model held its Mamba mixers' conv1d
    (a submodule up to megatron-core 0.18, two parameters from 0.19; None: as this release). The
    buffers follow the registration order, which differs between the two
    (`mcore_compat.saved_parameter_order`): where the saving release's differs from this one's,
    DDP is shown the parameters in the saving release's order."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.utils import unwrap_model

    config = unwrap_model(chunks[0]).config
    num_parameters = sum(p.nelement() for c in chunks for p in c.parameters())
    fields = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    kw = {k: getattr(args, k) for k in fields if hasattr(args, k)}
    kw.update(grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
              use_distributed_optimizer=True, check_for_nan_in_grad=False,
              check_for_large_grads=False, nccl_ub=False,
              pad_buckets_for_high_nccl_busbw=getattr(args, "ddp_pad_buckets_for_high_nccl_busbw", False),
              average_in_collective=getattr(args, "ddp_average_in_collective", False))
    num_buckets = getattr(args, "ddp_num_buckets", None)
    kw["bucket_size"] = (num_parameters // num_buckets if num_buckets
                         else getattr(args, "ddp_bucket_size", None))
    kw = {k: v for k, v in kw.items() if k in fields}
    disable = getattr(args, "overlap_param_gather_with_optimizer_step", False)
    reorder = (mamba_conv1d_module is not None and hybrid_layer_pattern(args)
               and mamba_conv1d_module != mamba_conv1d_is_module())
    wrapped = []
    for i, c in enumerate(chunks):
        if reorder:  # megatron-core DDP takes its parameters from module.named_parameters()/parameters()
            named = saved_parameter_order(c, mamba_conv1d_module)
            c.named_parameters = lambda *a, _n=named, **k: iter(_n)
            c.parameters = lambda *a, _n=named, **k: iter([p for _, p in _n])
        try:
            wrapped.append(DistributedDataParallel(
                config=config, ddp_config=DistributedDataParallelConfig(**kw), module=c,
                disable_bucketing=(i > 0) or disable))
        finally:
            if reorder:
                del c.named_parameters, c.parameters
    return wrapped


def model_config(chunks: list, args) -> dict:
    """The manifest's model config of the rebuilt chunks, recording the run's own values for the
    rebuild switches (not ours) and keeping the padded vocabulary (Megatron-LM trains its rows)."""
    cfg = config_of(chunks)
    for k in REBUILD_SETTINGS:
        if k in cfg and hasattr(args, k):
            cfg[k] = getattr(args, k)
    cfg["unpadded_vocab_size"] = None
    return cfg


def megatron_specs(args: argparse.Namespace) -> tuple[dict[str, ParamSpec], dict]:
    """(universal name -> spec, in the model's order; the manifest model config) of the model
    that Megatron-LM style `args` (one rank, TP1/PP1) describe.

    Why: an imported checkpoint (Hugging Face, DeepSpeed) must describe each tensor exactly as a
    megatron-core run of that model would (TP split dims, SwiGLU blocks, vocab rows, names), or
    `megatron_ucp.load` refuses it. So the specs are not written by hand: the model is built whole
    on one rank, on a fake process group with meta tensors, and `param_spec` reads them off it.
    """
    with source_rank(args, 0):
        chunks = build_chunks(args)
        specs = {lp.spec.name: lp.spec for lp in local_params(chunks) if lp.canonical}
        cfg = model_config(chunks, args)
        del chunks
    return specs, cfg


def import_specs(args: argparse.Namespace, run: dict, true_vocab: int) -> tuple[dict[str, ParamSpec], dict]:
    """`megatron_specs` of an imported model, its config recording the importer's true vocabulary
    and rotary base. RoPE (or no position embedding) has no parameter of max_sequence_length, so
    that field is dropped: a run may train at any length (a load compares it only when the
    checkpoint has it)."""
    specs, model = megatron_specs(args)
    model["unpadded_vocab_size"] = true_vocab
    if "rotary_base" in run:
        model["rotary_base"] = run["rotary_base"]
    if "rotary_base" in run or model.get("position_embedding_type") == "none":
        model.pop("max_sequence_length", None)
    return specs, model


def layer_wise_params(chunks: list, args) -> list[list[list[tuple[int, str]]]]:
    """megatron-core 0.19's LayerWiseDistributedOptimizer (`--optimizer muon|lion` with
    `--use-distributed-optimizer`) as stock Megatron-LM builds it, for the current (fake) rank:
    per chained torch optimizer, per param group, the (chunk index, local name) of the parameters
    this data-parallel rank owns, in the group's order: the order of that rank's
    `layer_wise_optimizer_<dp>.pt` state and `fp32_from_fp16_params`. `chunks`: the bare model
    chunks rebuilt from the args (`layer_wise_optimizers`)."""
    from megatron.core.utils import unwrap_model

    names = {id(p): (i, n) for i, c in enumerate(chunks) for n, p in unwrap_model(c).named_parameters()}
    return [[[names[id(p)] for p in g["params"]] for g in o.param_groups]
            for o in layer_wise_optimizers(chunks, args)]


def layer_wise_optimizers(chunks: list, args) -> list:
    """The torch optimizers chained in the LayerWiseDistributedOptimizer stock Megatron-LM builds
    for `args` at the current (fake) rank, in chain order; their param groups hold the parameters
    of `chunks` this data-parallel rank owns.

    megatron-core itself assigns the parameters (`get_megatron_optimizer`: the Muon/Adam param
    groups and the ping-pong assignment by numel, `_shard_params_ping_pong`). Megatron-LM's model
    builder (`megatron/training/models/dist_utils.py:_ddp_wrap`) gives DDP no LayerWise param layout
    and `use_distributed_optimizer=False`, so LayerWise runs its legacy path with every parameter,
    as rebuilt here. The optimizer is built in fp32 (its bf16 wrapper needs CUDA tensors): the
    groups, their order and the assignment depend on the parameters' names, shapes and the
    hyper-parameters only; the bf16 wrapper keeps each group's order."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.utils import unwrap_model
    from torch.overrides import TorchFunctionMode

    config = unwrap_model(chunks[0]).config
    fields = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    kw = {k: getattr(args, k) for k in fields if hasattr(args, k)}
    kw.update(use_distributed_optimizer=False, check_for_nan_in_grad=False,
              check_for_large_grads=False, nccl_ub=False,
              grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32)
    ddp = [DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(**kw),
                                   module=c, disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    ofields = {f.name for f in dataclasses.fields(OptimizerConfig)}
    okw = {k: getattr(args, k) for k in ofields if hasattr(args, k)}
    okw.update(bf16=False, fp16=False, timers=None, use_distributed_optimizer=False,
               use_layer_wise_distributed_optimizer=True)

    class _CudaToMeta(TorchFunctionMode):  # tensors megatron-core creates on device="cuda"
        def __torch_function__(self, func, types, a=(), k=None):
            k = dict(k or {})
            if "cuda" in str(k.get("device", "")):
                k["device"] = "meta"
            return func(*a, **k)

    with _CudaToMeta():
        opt = get_megatron_optimizer(OptimizerConfig(**okw), ddp, use_gloo_process_groups=False)
    if type(opt).__name__ != "LayerWiseDistributedOptimizer":  # (a chain of it and others)
        raise UCPError(f"the optimizer rebuilt from args is {type(opt).__name__} of "
                       f"{[type(o).__name__ for o in getattr(opt, 'chained_optimizers', [])]}, "
                       "not one LayerWiseDistributedOptimizer as stock Megatron-LM builds it for "
                       "--optimizer muon|lion --use-distributed-optimizer; not mapped")
    return [getattr(o, "optimizer", o) for o in opt.chained_optimizers]
