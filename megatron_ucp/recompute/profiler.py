"""Measure a `Profile`: per-module costs of one real megatron-core GPT layer, and link costs.

Layer costs. A one-layer megatron-core GPTModel is built from the model config with the local layer
spec (`get_gpt_layer_local_spec`); its real `TransformerLayer.forward` runs on realistic inputs
(hidden states of one micro-batch, the causal mask). Forward pre-hooks on the six submodules
(MODULES order) cut the forward into segments; tensor hooks on each submodule's output mark when its
backward starts. Glue between submodules (q/k/v split, bias-dropout-add) belongs to the module it
follows in the forward; its backward falls in the interval of the module after it. Times are
medians over repeats after warm-up; the split between modules comes from the hooked runs and is
scaled to the median of unhooked whole-layer runs, so hooks (and, on a GPU, the synchronisations
they need) do not inflate the layer total. On a GPU times are wall seconds after a
synchronize; on a CPU at tp 1 they are the thread's CPU seconds (one thread, as each training rank
runs), so a host shared with other processes does not charge their time to the layer (at tp > 1
wall seconds: the TP all-reduce waits belong to the layer).

Activation bytes come from `ActivationCounter`, the one definition of activation memory: the
storages the layer keeps for backward, each counted once, parameters excluded. Every storage is
attributed to exactly one module, so the modules add up to the whole layer exactly. The rule makes
"selective recompute of group G frees the act_bytes of G's modules" true, as megatron-core does it:
- a storage goes to the module that produced it: a layernorm's output and statistics to the
  layernorm (`CheckpointWithoutOutput` discards the output and recomputes it), attention
  probabilities to core_attn, the MLP's hidden activations to mlp, q/k/v to qkv;
- except the output of core_attn or mlp, kept by the consumer (megatron's `checkpoint` returns it and
  keeps it): it goes to the module that saves it (core_attn's context -> proj);
- what the layer keeps of its own inputs (hidden states, attention mask) goes to qkv: no in-place
  recompute frees it.
`layer_input_bytes` is the hidden-state tensor entering a layer, [s/tp if sequence parallel, b, h].

Stage ends: the embedding (first stage) and the final layernorm + output layer + cross-entropy
(last stage), measured the same way on the same model.

Links: `links` (p2p and all-reduce costs fitted to alpha + bytes / bandwidth).

It measures on a GPU (`megatron-ucp profile-recompute`); nothing is patched. (The test suite runs it
on CPU hosts under its torch.cuda stand-in.) The layer is built in this process; at tp > 1
the caller runs one process per TP rank (torchrun) and every rank calls `profile_layer`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

from megatron_ucp.recompute.activations import ActivationCounter
from megatron_ucp.recompute.hardware import ModelConfigError, check_tp, load_model_config, normalize_model
from megatron_ucp.recompute.links import LINK_SIZES, free_port, measure_links, measure_links_spawned
from megatron_ucp.recompute.probe import AttributingCounter, LayerProbe, intervals
from megatron_ucp.recompute.profile import MODULES, LinkCost, ModuleCost, Profile, StageEnds, save
from megatron_ucp.recompute.timing import ProfilerError, compute_clock, on_gpu

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}



def transformer_config(model: dict, tp: int, gpu: bool):
    from megatron.core.transformer import TransformerConfig

    dtype = DTYPES[model["dtype"]]
    fields = dict(
        num_layers=1,
        hidden_size=model["hidden_size"],
        num_attention_heads=model["num_attention_heads"],
        num_query_groups=model["num_query_groups"],
        ffn_hidden_size=model["ffn_hidden_size"],
        normalization=model["normalization"],
        add_bias_linear=model["add_bias_linear"],
        gated_linear_unit=model["swiglu"],
        activation_func=torch.nn.functional.silu if model["swiglu"] else torch.nn.functional.gelu,
        tensor_model_parallel_size=tp,
        sequence_parallel=model["sequence_parallel"],
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=not gpu,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
    )
    return TransformerConfig(**{**fields, **model.get("extra", {})})


def build_model(model: dict, tp: int, gpu: bool):
    """A one-layer GPTModel with embedding and output layer (megatron-core's local layer spec)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(model, tp, gpu)
    spec = get_gpt_layer_local_spec(normalization=model["normalization"])
    gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=model["vocab_size"],
                   max_sequence_length=model["seq_length"], pre_process=True, post_process=True,
                   share_embeddings_and_output_weights=not model["untie_embeddings"],
                   position_embedding_type=model["position_embedding_type"])
    if gpu:
        gpt.cuda(torch.cuda.current_device())
    gpt.train()
    return gpt


def _layer_inputs(model: dict, tp: int, gpu: bool, seed: int):
    s, b, h = model["seq_length"], model["micro_batch_size"], model["hidden_size"]
    if model["sequence_parallel"]:
        s //= tp
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(s, b, h, generator=g).to(DTYPES[model["dtype"]])
    grad = torch.randn(s, b, h, generator=g).to(DTYPES[model["dtype"]]) * 1e-2
    mask = torch.triu(torch.ones(model["seq_length"], model["seq_length"], dtype=torch.bool), 1)[None, None]
    if gpu:
        hidden, grad, mask = hidden.cuda(), grad.cuda(), mask.cuda()
    return hidden, grad, mask


def _rotary(gpt, model: dict):
    if model["position_embedding_type"] != "rope":
        return None
    return gpt.rotary_pos_emb(model["seq_length"])


def _run_layer(layer, hidden: torch.Tensor, grad: torch.Tensor, mask, rotary, clock) -> tuple[float, float]:
    """One forward and backward of the layer; returns (fwd_s, bwd_s)."""
    x = hidden.detach().requires_grad_()
    t0 = clock()
    out, _ = layer(x, attention_mask=mask, rotary_pos_emb=rotary)
    t1 = clock()
    out.backward(grad)
    t2 = clock()
    return t1 - t0, t2 - t1


def measure_layer(gpt, model: dict, tp: int, gpu: bool, warmup: int, repeats: int, seed: int = 0,
                  clock=None):
    """[ModuleCost] in MODULES order and the layer's saved bytes, for one micro-batch."""
    clock = clock or compute_clock(gpu, tp)
    layer = gpt.decoder.layers[0]
    params = list(gpt.parameters())
    hidden, grad, mask = _layer_inputs(model, tp, gpu, seed)
    rotary = _rotary(gpt, model)
    probe = LayerProbe(layer, params, clock)
    try:
        # bytes: one hooked forward under the attributing counter
        x = hidden.detach().requires_grad_()
        counter = AttributingCounter(params)
        probe.begin(counter, [x, mask])
        with counter:
            out, _ = layer(x, attention_mask=mask, rotary_pos_emb=rotary)
        act = probe.attribute()
        total_bytes = counter.live_bytes
        out.backward(grad)
        del out
        probe.counter = None
        # shares: hooked runs (no counter: its pack hook would cost time)
        fwd_parts, bwd_parts = [], []
        for i in range(warmup + repeats):
            x = hidden.detach().requires_grad_()
            probe.begin(None, [x, mask])
            layer.zero_grad(set_to_none=True)
            t0 = clock()
            out, _ = layer(x, attention_mask=mask, rotary_pos_emb=rotary)
            t1 = clock()
            out.backward(grad)
            t2 = clock()
            if i >= warmup:
                fwd_parts.append(intervals(probe.fwd_marks, t0, t1, "input_layernorm"))
                bwd_parts.append(intervals(probe.bwd_marks, t1, t2, "mlp"))
            del out
    finally:
        probe.remove()
    # totals: unhooked runs
    totals = []
    for i in range(warmup + repeats):
        layer.zero_grad(set_to_none=True)
        fb = _run_layer(layer, hidden, grad, mask, rotary, clock)
        if i >= warmup:
            totals.append(fb)
    fwd_total = statistics.median(t[0] for t in totals)
    bwd_total = statistics.median(t[1] for t in totals)
    costs = []
    fwd_med = {m: statistics.median(p[m] for p in fwd_parts) for m in MODULES}
    bwd_med = {m: statistics.median(p[m] for p in bwd_parts) for m in MODULES}
    fwd_sum, bwd_sum = sum(fwd_med.values()) or 1.0, sum(bwd_med.values()) or 1.0
    for m in MODULES:
        costs.append(ModuleCost(m, fwd_med[m] / fwd_sum * fwd_total, bwd_med[m] / bwd_sum * bwd_total,
                                act[m]))
    layer.zero_grad(set_to_none=True)
    return costs, total_bytes


def _tokens(model: dict, gpu: bool, seed: int):
    s, b = model["seq_length"], model["micro_batch_size"]
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, model["vocab_size"], (b, s), generator=g)
    labels = torch.randint(0, model["vocab_size"], (b, s), generator=g)
    position_ids = torch.arange(s).expand(b, -1)
    if gpu:
        tokens, labels, position_ids = tokens.cuda(), labels.cuda(), position_ids.cuda()
    return tokens, labels, position_ids


def measure_ends(gpt, model: dict, tp: int, gpu: bool, warmup: int, repeats: int, seed: int = 0,
                 clock=None) -> StageEnds:
    """Embedding (first stage) and final layernorm + output layer + loss (last stage) costs."""
    clock = clock or compute_clock(gpu, tp)
    params = list(gpt.parameters())
    tokens, labels, position_ids = _tokens(model, gpu, seed)
    hidden, grad, _ = _layer_inputs(model, tp, gpu, seed)
    output_weight = None if model["untie_embeddings"] else gpt.shared_embedding_or_output_weight()

    def embedding(_):
        return gpt.embedding(input_ids=tokens, position_ids=position_ids)

    def output(x):
        y = gpt.decoder.final_layernorm(x)
        logits, _ = gpt.output_layer(y, weight=output_weight)
        # as the training loss function: mean over the per-token losses
        return gpt.compute_language_model_loss(labels, logits).float().mean()

    def timed(fn, grad_out) -> tuple[float, float]:
        times = []
        for i in range(warmup + repeats):
            gpt.zero_grad(set_to_none=True)
            x = hidden.detach().requires_grad_()
            t0 = clock()
            y = fn(x)
            t1 = clock()
            y.backward(grad_out)
            t2 = clock()
            if i >= warmup:
                times.append((t1 - t0, t2 - t1))
        return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)

    def saved(fn) -> int:
        counter = ActivationCounter(params)
        x = hidden.detach().requires_grad_()
        with counter:
            y = fn(x)
        nbytes = counter.live_bytes
        del y
        return nbytes

    emb_fwd, emb_bwd = timed(embedding, grad)  # the embedding's output gradient: hidden-state shaped
    out_fwd, out_bwd = timed(output, None)  # the loss is a scalar
    ends = StageEnds(embedding_fwd_s=emb_fwd, embedding_bwd_s=emb_bwd, embedding_act_bytes=saved(embedding),
                     output_fwd_s=out_fwd, output_bwd_s=out_bwd, output_act_bytes=saved(output))
    gpt.zero_grad(set_to_none=True)
    return ends


def compute_slots(gpu: bool) -> int | None:
    """Ranks that can compute at once: the CPU cores this process may use; None on a GPU."""
    if gpu:
        return None
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def layer_input_bytes(model: dict, tp: int) -> int:
    s = model["seq_length"] // tp if model["sequence_parallel"] else model["seq_length"]
    return s * model["micro_batch_size"] * model["hidden_size"] * DTYPES[model["dtype"]].itemsize


def profile_layer(model_cfg: dict, tp: int = 1, micro_batch_size: int | None = None, warmup: int = 2,
                  repeats: int = 5, links: bool = True, link_sizes=LINK_SIZES,
                  slots: int | None | str = "auto", seed: int = 0) -> Profile:
    """Measure a Profile of `model_cfg` at TP size `tp` in this process.

    tp == 1: needs no process group (a private one-rank group is made and destroyed if none is up);
    links are measured on two spawned processes. tp > 1: every rank of an initialised process group
    of world size tp x n calls this; megatron-core's model-parallel state is set up (and torn down)
    here if it is not up yet; links are measured between ranks 0 and 1 (p2p) and over the TP group.
    slots: compute_slots for the profile ("auto": CPU cores here, None on a GPU).
    """
    model = normalize_model(model_cfg)
    if micro_batch_size is not None:
        model["micro_batch_size"] = micro_batch_size
    check_tp(model, tp)
    if model["position_embedding_type"] not in ("learned_absolute", "rope", "none"):
        raise ProfilerError(f"model config: field 'position_embedding_type' is "
                            f"{model['position_embedding_type']!r}; use learned_absolute, rope or none")
    if not isinstance(model.get("extra", {}), dict):
        raise ProfilerError("model config: field 'extra' must be a mapping of TransformerConfig fields")
    recompute = {k: v for k, v in model.get("extra", {}).items() if k.startswith("recompute") and v}
    if recompute:
        raise ProfilerError(f"model config: 'extra' sets {recompute}; profile without recompute (the "
                            "plan decides it per layer from the profile)")
    gpu = on_gpu()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    own_group = own_state = False
    if not dist.is_initialized():
        if tp > 1:
            raise ProfilerError(f"tp={tp}: run one process per TP rank (torchrun --nproc-per-node {tp})")
        if gpu:
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)
        own_group = True
    elif dist.get_world_size() % tp:
        raise ProfilerError(f"tp={tp} does not divide the world size {dist.get_world_size()}")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        own_state = True
    elif ps.get_tensor_model_parallel_world_size() != tp:
        raise ProfilerError(f"tp={tp}, but megatron-core's model parallel state has TP size "
                            f"{ps.get_tensor_model_parallel_world_size()}")
    threads = torch.get_num_threads()
    if not gpu:
        torch.set_num_threads(1)  # one rank = one thread, as the training ranks run
    try:
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        gpt = build_model(model, tp, gpu)
        layer, layer_saved = measure_layer(gpt, model, tp, gpu, warmup, repeats, seed)
        ends = measure_ends(gpt, model, tp, gpu, warmup, repeats, seed)
        notes = [f"layer keeps {layer_saved} bytes per micro-batch"]
        if not links:
            p2p, allreduce = LinkCost(0.0, 1e18), None
            notes.append("links not measured: p2p costs nothing")
        elif dist.get_world_size() > 1:
            p2p, allreduce = measure_links(link_sizes, warmup, repeats, ranks=(0, 1),
                                           allreduce_group=ps.get_tensor_model_parallel_group() if tp > 1
                                           else None)
        else:
            p2p, allreduce = measure_links_spawned(gpu, link_sizes, warmup, repeats)
        if tp == 1 and allreduce is not None:
            notes.append("tp_allreduce measured between 2 ranks")
        device = (f"{torch.cuda.get_device_name()}-nccl" if gpu else "cpu-gloo")
        return Profile(device=device, source="measured", model=model, tp=tp, layer=layer,
                       layer_input_bytes=layer_input_bytes(model, tp), ends=ends, p2p=p2p,
                       tp_allreduce=allreduce, compute_slots=compute_slots(gpu) if slots == "auto" else slots,
                       notes="; ".join(notes))
    finally:
        torch.set_num_threads(threads)
        if own_state:
            ps.destroy_model_parallel()
        if own_group:
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """megatron-ucp profile-recompute --config model.yaml --tp T --micro-batch M --out prof.json"""
    p = argparse.ArgumentParser(prog="megatron-ucp profile-recompute",
                                description="measure per-module layer costs and link costs into a "
                                "recompute profile (JSON) for plan-recompute")
    p.add_argument("--config", required=True, metavar="MODEL.yaml",
                   help="model fields (hidden_size, num_attention_heads, seq_length, vocab_size, ...)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (>1: run under torchrun)")
    p.add_argument("--micro-batch", type=int, default=None, help="micro-batch size (default: config's)")
    p.add_argument("--out", required=True, metavar="PROFILE.json")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-links", action="store_true", help="skip p2p/all-reduce (they then cost 0)")
    args = p.parse_args(argv)
    try:
        model = load_model_config(args.config)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and not dist.is_initialized():
            gpu = on_gpu()
            if gpu:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl" if gpu else "gloo")
        profile = profile_layer(model, tp=args.tp, micro_batch_size=args.micro_batch,
                                warmup=args.warmup, repeats=args.repeats, links=not args.no_links)
    except (ProfilerError, ModelConfigError) as e:
        print(f"profile-recompute: {e}", file=sys.stderr)
        return 2
    if not dist.is_initialized() or dist.get_rank() == 0:
        save(profile, args.out)
        total = profile.layer_fwd_s + profile.layer_bwd_s
        print(f"wrote {args.out}: layer fwd+bwd {total * 1e3:.2f} ms, {profile.layer_act_bytes} bytes "
              f"saved per micro-batch, p2p {profile.p2p.alpha_s * 1e6:.0f} us + "
              f"{profile.p2p.bytes_per_s / 1e9:.2f} GB/s on {profile.device}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

