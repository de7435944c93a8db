"""A tiny megatron-core GPT: model, DDP, DistributedOptimizer, LR schedule, data.

Everything here is real megatron-core. On a CPU-only host the only stand-in is `cpu_shim` for
torch.cuda (gloo); on a GPU host the shim stays off and the same code runs on CUDA with NCCL, with
`transformer_impl="transformer_engine"` for Transformer Engine layers. The data is a deterministic
synthetic token stream indexed by global sample number, so every layout sees the same global
batches and losses are comparable across layouts.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.activations import squared_relu
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from megatron_ucp.formats.megatron_common import YARN_FROM_ARGS
from megatron_ucp.formats.megatron_rebuild import replace_module
from megatron_ucp.gdn_spec import gdn_local_block_spec, is_gdn_model
from megatron_ucp.layout import Layout
from megatron_ucp.testing import cpu_shim  # noqa: F401  (must precede megatron.core)
from megatron_ucp.testing.cp_attention import ContextParallelDotProductAttention, split_for_cp
from megatron_ucp.testing.cpu_shim import REAL_CUDA
from megatron_ucp.testing.mla_attention import MLACoreAttention
from megatron_ucp.testing.torch_norm import SequenceParallelTorchNorm


@dataclass
class TinyGPTConfig:
    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    ffn_hidden_size: int = 128
    vocab_size: int = 256  # padded, as the model is built
    unpadded_vocab_size: int | None = None  # true vocabulary (tokens drawn below it); None = vocab_size
    seq_length: int = 32
    swiglu: bool = False
    # "quick_gelu": GPT-OSS's gated x * sigmoid(1.702 x); "squared_relu": Nemotron-H's relu(x)^2;
    # default silu / gelu
    activation: str = ""
    normalization: str = "LayerNorm"
    position_embedding_type: str = "learned_absolute"
    # GPTModel's RoPE settings: its base, Llama 3's scaling (rope_scaling, its factor), linear
    # scaling (positions divided by seq_len_interpolation_factor), the rotated fraction of a head
    rotary_base: int | float = 10000
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    seq_len_interpolation_factor: float | None = None
    rotary_percent: float = 1.0
    add_bias_linear: bool = True
    untie_embeddings: bool = False
    qk_layernorm: bool = False
    dtype: str = "fp32"  # "fp32", "bf16" or "fp16" model weights; main params and Adam state fp32
    sequence_parallel: bool = False
    num_experts: int | None = None  # MoE in every layer (top-2 router, allgather dispatcher)
    moe_grouped_gemm: bool = False
    transformer_impl: str = "local"  # or "transformer_engine" (needs a GPU and TE)
    seed: int = 1234
    # dropout draws from the generators a resume must restore (or re-derive at another layout)
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # optimizer and schedule
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_warmup_steps: int = 2
    lr_decay_steps: int = 20
    initial_loss_scale: float = 2.0**12  # fp16 dynamic loss scaling
    micro_batch_size: int = 2
    global_batch_size: int = 8
    # a hybrid model (megatron-core's MambaModel): one symbol per layer, M Mamba, * attention,
    # - MLP, E MoE (num_layers is its length); the Mamba math on CPU is megatron_ucp.testing.mamba_cpu
    hybrid_pattern: str | None = None
    extra: dict = field(default_factory=dict)  # extra TransformerConfig fields
    # megatron-core's optimizer (--optimizer: adam, sgd, lion, muon), plain DDP or the distributed
    # optimizer, and further OptimizerConfig fields (optimizer_cpu_offload, sgd_momentum,
    # muon_tp_mode, use_layer_wise_distributed_optimizer, muon_scalar_optimizer, ...; the
    # precision-aware optimizer's *_dtype fields by torch name: "bfloat16", "uint8")
    optimizer: str = "adam"
    use_distributed_optimizer: bool = True
    optimizer_extra: dict = field(default_factory=dict)
    # Muon's LayerWise optimizer over megatron-core's shard-aligned param layout (its default);
    # False: the legacy path (plain DDP buffers, params assigned ping-pong by size)
    layer_wise_param_layout: bool = True


@dataclass
class TrainState:
    model: list  # model chunks (DDP-wrapped)
    optimizer: object
    scheduler: OptimizerParamScheduler
    config: TinyGPTConfig
    layout: Layout
    iteration: int = 0


def init_distributed(layout: Layout) -> None:
    """gloo (CPU) or NCCL (GPU) process group from RANK/WORLD_SIZE/MASTER_* env, then
    megatron-core's groups."""
    if REAL_CUDA:  # more ranks than GPUs share them (NCCL decides whether it allows that)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group("nccl" if REAL_CUDA else "gloo")
    if dist.get_world_size() != layout.world_size:
        raise ValueError(f"{layout} needs {layout.world_size} processes, got {dist.get_world_size()}")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
    )


def transformer_config(cfg: TinyGPTConfig, layout: Layout) -> TransformerConfig:
    bf16, fp16 = cfg.dtype == "bf16", cfg.dtype == "fp16"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.dtype, torch.float32)
    config_class = MLATransformerConfig if cfg.extra.get("multi_latent_attention") else TransformerConfig
    fields = {**_config_fields(cfg, layout, bf16, fp16, dtype), **cfg.extra}
    yarn = {attr: fields.pop(attr, default) for attr, _, default in YARN_FROM_ARGS}
    config = config_class(**fields)
    if cfg.position_embedding_type == "yarn":  # GPTModel's YaRN reads attributes that are no
        for attr, value in yarn.items():  # fields, set as Megatron-LM sets them
            setattr(config, attr, value)
    return config


def _config_fields(cfg: TinyGPTConfig, layout: Layout, bf16: bool, fp16: bool, dtype) -> dict:
    """TransformerConfig fields for `cfg` at `layout` (cfg.extra may override any of them)."""
    same = ("hidden_size", "num_attention_heads", "num_query_groups",
            "ffn_hidden_size", "normalization", "add_bias_linear", "qk_layernorm")
    return dict(
        **{k: getattr(cfg, k) for k in same},
        num_layers=len(cfg.hybrid_pattern) if cfg.hybrid_pattern else cfg.num_layers,
        is_hybrid_model=bool(cfg.hybrid_pattern),
        gated_linear_unit=cfg.swiglu,
        activation_func=quick_gelu if cfg.activation == "quick_gelu" else
        squared_relu if cfg.activation == "squared_relu" else
        torch.nn.functional.silu if cfg.swiglu else torch.nn.functional.gelu,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        sequence_parallel=cfg.sequence_parallel,
        bf16=bf16,
        fp16=fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        # full weights drawn on CPU then split: init independent of TP (TE layers draw on the GPU)
        use_cpu_initialization=cfg.transformer_impl == "local",
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        num_moe_experts=cfg.num_experts,
        moe_router_topk=2,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        moe_grouped_gemm=cfg.moe_grouped_gemm,
        # As Megatron-LM does for interleaved schedules (overlap_p2p_comm -> no batched p2p): with
        # PP=2 the next and prev stage are the same rank, and batched isend/irecv would pair a
        # backward gradient with a forward activation of the same shape.
        batch_p2p_comm=not layout.vpp,
        overlap_p2p_comm=bool(layout.vpp),
    )


def build(cfg: TinyGPTConfig, layout: Layout) -> TrainState:
    """Build model chunks, DDP, DistributedOptimizer and scheduler at `layout` (process groups up)."""
    torch.manual_seed(cfg.seed)  # identical on every rank: full weights drawn on CPU, then split
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
    tf_config = transformer_config(cfg, layout)
    if cfg.transformer_impl == "transformer_engine":
        layer_spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=cfg.num_experts, moe_grouped_gemm=cfg.moe_grouped_gemm,
            qk_layernorm=cfg.qk_layernorm, multi_latent_attention=tf_config.multi_latent_attention,
        )
    else:
        layer_spec = get_gpt_layer_local_spec(
            num_experts=cfg.num_experts, moe_grouped_gemm=cfg.moe_grouped_gemm,
            qk_layernorm=cfg.qk_layernorm, normalization=cfg.normalization,
            multi_latent_attention=tf_config.multi_latent_attention,
        )

    def stand_ins(spec):
        if tf_config.multi_latent_attention and cfg.transformer_impl == "local":  # see mla_attention
            spec = replace_module(spec, DotProductAttention, MLACoreAttention)
        if layout.cp > 1:  # megatron-core's CP attention needs TE: see cp_attention
            spec = replace_module(spec, DotProductAttention, ContextParallelDotProductAttention)
        return spec

    layer_spec = stand_ins(layer_spec)
    if cfg.hybrid_pattern:
        return _finish(cfg, layout, tf_config, _hybrid_chunks(cfg, layout, tf_config))
    # dense and MoE layers mixed (first-k-dense, moe_layer_freq): megatron-core's per-layer block
    # spec, as Megatron-LM builds it
    mixed = bool(tf_config.num_moe_experts) and tf_config.moe_layer_freq != 1
    chunks = []
    for vp_stage in range(layout.vpp or 1):
        vp = vp_stage if layout.vpp else None
        spec = layer_spec
        if is_gdn_model(tf_config):  # Gated DeltaNet (Qwen3-Next): the fla math on CPU is gdn_cpu
            if not REAL_CUDA:
                from megatron_ucp.testing import gdn_cpu  # noqa: F401
            spec = gdn_local_block_spec(tf_config, vp_stage=vp)
        elif mixed:
            spec = stand_ins(get_gpt_decoder_block_spec(tf_config, cfg.transformer_impl != "local",
                                                        normalization=cfg.normalization, vp_stage=vp))
            if cfg.sequence_parallel:
                layers = replace_module(spec.layer_specs, WrappedTorchNorm, SequenceParallelTorchNorm)
                spec = dataclasses.replace(spec, layer_specs=layers, layer_norm=SequenceParallelTorchNorm)
        elif cfg.sequence_parallel:
            n = get_num_layers_to_build(tf_config, vp_stage=vp)
            spec = TransformerBlockSubmodules(
                layer_specs=[replace_module(layer_spec, WrappedTorchNorm, SequenceParallelTorchNorm)] * n,
                layer_norm=SequenceParallelTorchNorm,
            )
        mtp_spec = None
        if tf_config.mtp_num_layers:  # multi-token prediction layers (DeepSeek-V3) on the last stage
            mtp_spec = get_gpt_mtp_block_spec(tf_config, spec, cfg.transformer_impl != "local",
                                              vp_stage=vp)
            if cfg.sequence_parallel:  # its enorm / hnorm / final norm too
                mtp_spec = replace_module(mtp_spec, WrappedTorchNorm, SequenceParallelTorchNorm)
        model = GPTModel(
            config=tf_config,
            transformer_layer_spec=spec,
            mtp_block_spec=mtp_spec,
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.seq_length,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=not cfg.untie_embeddings,
            position_embedding_type=cfg.position_embedding_type,
            rotary_base=cfg.rotary_base, rope_scaling=cfg.rope_scaling,
            rope_scaling_factor=cfg.rope_scaling_factor,
            seq_len_interpolation_factor=cfg.seq_len_interpolation_factor,
            rotary_percent=cfg.rotary_percent,
            vp_stage=vp,
        )
        model.cuda(torch.cuda.current_device())  # as Megatron-LM's get_model (a no-op on the shim)
        if tf_config.bf16 or tf_config.fp16:
            model = Float16Module(tf_config, model)
        chunks.append(model)
    return _finish(cfg, layout, tf_config, chunks)


def _hybrid_chunks(cfg: TinyGPTConfig, layout: Layout, tf_config: TransformerConfig) -> list:
    """The hybrid model (MambaModel) of `cfg.hybrid_pattern`, with local layers or megatron-core's
    own Transformer Engine stack spec (one chunk: megatron-core's MambaStack has no virtual
    pipeline)."""
    from megatron_ucp.testing.mamba_cpu import MambaModel, local_mamba_stack_spec

    if cfg.transformer_impl == "transformer_engine":
        from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec as spec
    else:
        spec = local_mamba_stack_spec(cfg.normalization, cfg.num_experts, cfg.moe_grouped_gemm,
                                      norm=SequenceParallelTorchNorm if cfg.sequence_parallel else None)
    model = MambaModel(
        config=tf_config,
        mamba_stack_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.seq_length,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        hybrid_override_pattern=cfg.hybrid_pattern,
        share_embeddings_and_output_weights=not cfg.untie_embeddings,
        position_embedding_type=cfg.position_embedding_type,
    )
    model.cuda(torch.cuda.current_device())
    if tf_config.bf16 or tf_config.fp16:
        model = Float16Module(tf_config, model)
    return [model]


def _finish(cfg: TinyGPTConfig, layout: Layout, tf_config: TransformerConfig, chunks: list) -> TrainState:
    """DDP, the distributed optimizer and the LR schedule around the model chunks."""
    layer_wise = bool(cfg.optimizer_extra.get("use_layer_wise_distributed_optimizer"))
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=(cfg.layer_wise_param_layout if layer_wise
                                   else cfg.use_distributed_optimizer),
        # Megatron-LM's --fp8-param-gather sets both (TransformerConfig.fp8_param from it): the
        # distributed optimizer then derives the FP8 weights from its masters after each step
        fp8_param_gather=bool(getattr(tf_config, "fp8_param", False)),
        # MXFP8 parameters (megatron-core 0.19): the param all-gather through the grad buffer,
        # then re-quantized (Megatron-LM's --reuse-grad-buf-for-mxfp8-param-ag sets both configs)
        **({"reuse_grad_buf_for_mxfp8_param_ag": True}
           if cfg.optimizer_extra.get("reuse_grad_buf_for_mxfp8_param_ag") else {}),
    )
    layouts = _layer_wise_layouts(chunks, ddp_config) if layer_wise and cfg.layer_wise_param_layout \
        else [None] * len(chunks)
    chunks = [
        DistributedDataParallel(
            config=tf_config, ddp_config=ddp_config, module=m, disable_bucketing=(i > 0),
            **({"full_param_layout": layout} if layout is not None else {}),
        )
        for i, (m, layout) in enumerate(zip(chunks, layouts))
    ]
    for m in chunks:
        m.broadcast_params()
    opt_config = OptimizerConfig(
        optimizer=cfg.optimizer,
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.95,
        clip_grad=1.0,
        bf16=tf_config.bf16,
        fp16=tf_config.fp16,
        initial_loss_scale=cfg.initial_loss_scale,
        params_dtype=tf_config.params_dtype,
        use_distributed_optimizer=cfg.use_distributed_optimizer and not layer_wise,
        **{k: getattr(torch, v) if k.endswith("_dtype") and isinstance(v, str) else v
           for k, v in cfg.optimizer_extra.items()},
    )
    if layer_wise and not cfg.layer_wise_param_layout and not REAL_CUDA:
        from megatron_ucp.testing import gloo_all_gather

        gloo_all_gather.install()
    if cfg.optimizer_extra.get("optimizer_cpu_offload") and not REAL_CUDA:
        from megatron_ucp.testing import hybrid_offload_cpu

        hybrid_offload_cpu.install()
    optimizer = get_megatron_optimizer(opt_config, chunks)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_steps * cfg.global_batch_size,
        lr_decay_steps=cfg.lr_decay_steps * cfg.global_batch_size,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=cfg.lr_decay_steps * cfg.global_batch_size,
        wd_incr_style="constant",
    )
    tf_config.finalize_model_grads_func = finalize_model_grads
    tf_config.grad_scale_func = optimizer.scale_loss  # fp16: scale the loss by the loss scaler
    tf_config.no_sync_func = [m.no_sync for m in chunks] if len(chunks) > 1 else chunks[0].no_sync
    return TrainState(chunks, optimizer, scheduler, cfg, layout)


def _layer_wise_layouts(chunks: list, ddp_config) -> list:
    """Muon's shard-aligned param layout per model chunk, as Megatron-LM's training builds it
    before wrapping the chunks in DDP (tag the Muon-managed params, then lay out every buffer)."""
    from megatron.core.optimizer.layer_wise_optimizer import (
        LayerWiseDistributedOptimizer,
        tag_params_for_buffer_routing,
    )

    tag_params_for_buffer_routing(chunks)
    dp = ps.get_data_parallel_world_size(with_context_parallel=True)
    expert_dp = ps.get_expert_data_parallel_world_size()
    return [LayerWiseDistributedOptimizer.compute_full_param_layout(
        [p for p in m.parameters() if p.requires_grad], ddp_config.bucket_size, dp, ddp_config,
        expert_data_parallel_world_size=expert_dp) for m in chunks]


def sample_tokens(cfg: TinyGPTConfig, sample_index: int) -> torch.Tensor:
    """Sample `sample_index` of the synthetic stream: seq_length + 1 tokens with local structure."""
    g = torch.Generator().manual_seed(1_000_003 * (sample_index + 1))
    vocab = cfg.unpadded_vocab_size or cfg.vocab_size
    start = torch.randint(0, vocab, (1,), generator=g)
    steps = torch.randint(1, 4, (cfg.seq_length + 1,), generator=g)
    return (start + torch.cumsum(steps, 0)) % vocab


def _micro_batches(cfg: TinyGPTConfig, iteration: int) -> list[dict]:
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    per_rank = cfg.global_batch_size // dp_size
    first = iteration * cfg.global_batch_size + dp_rank * per_rank
    mask = torch.triu(torch.ones(cfg.seq_length, cfg.seq_length, dtype=torch.bool), 1)[None, None]
    batches = []
    for mb in range(per_rank // cfg.micro_batch_size):
        idx = range(first + mb * cfg.micro_batch_size, first + (mb + 1) * cfg.micro_batch_size)
        seqs = torch.stack([sample_tokens(cfg, i) for i in idx])
        batch = {  # a context-parallel rank keeps its share of the sequence (mask: see cp_attention)
            "tokens": split_for_cp(seqs[:, :-1].contiguous()),
            "labels": split_for_cp(seqs[:, 1:].contiguous()),
            "position_ids": split_for_cp(torch.arange(cfg.seq_length).expand(len(idx), -1)),
            # TE's causal attention builds its own mask
            "attention_mask": None if cfg.transformer_impl == "transformer_engine" else mask,
        }
        batches.append({k: v if v is None else v.cuda() for k, v in batch.items()})
    return batches


def _loss_func(output_tensor: torch.Tensor):
    # As Megatron-LM: with CP, this rank's share of the sequence mean (the schedule multiplies by the
    # CP size and DDP averages over DP x CP); the logged value is the CP-wide mean.
    cp = ps.get_context_parallel_world_size()
    loss = output_tensor.float().mean() / cp
    logged = loss.detach().clone()  # the schedule scales `loss` in place
    if cp > 1:
        dist.all_reduce(logged, group=ps.get_context_parallel_group())
    return loss, {"lm loss": logged}


def _forward_step(data_iterator, model):
    b = next(data_iterator)
    out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
    return out, _loss_func


def train_step(state: TrainState) -> float:
    """One optimizer step on global batch number `state.iteration`; returns the global mean loss."""
    cfg, layout = state.config, state.layout
    batches = _micro_batches(cfg, state.iteration)
    num_mb = len(batches)
    for m in state.model:
        m.zero_grad_buffer()
    state.optimizer.zero_grad()
    iters = [iter(batches) for _ in state.model]
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iters if len(iters) > 1 else iters[0],
        model=state.model,
        num_microbatches=num_mb,
        seq_length=cfg.seq_length,
        micro_batch_size=cfg.micro_batch_size,
        forward_only=False,
    )
    state.optimizer.step()
    state.scheduler.step(increment=cfg.global_batch_size)
    state.iteration += 1
    local = torch.zeros(1, dtype=torch.float64).cuda()  # NCCL reduces device tensors
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        local += sum(float(x["lm loss"]) for x in losses) / num_mb / layout.dp
    dist.all_reduce(local)  # DP mean; other PP stages contribute 0
    return float(local) / layout.tp / layout.cp


def destroy() -> None:
    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def env_layout() -> Layout:
    return Layout.parse(os.environ["UCP_LAYOUT"])


__all__ = ["TinyGPTConfig", "TrainState", "build", "init_distributed", "train_step", "partial"]
