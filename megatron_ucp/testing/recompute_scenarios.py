"""Rank functions (for `launch`) that run the recompute runtime against megatron-core's own recompute.

`compare_runs` builds the tiny GPT once per run at one layout, takes one training step with either
megatron-core's schedule and recompute settings or `runtime.forward_backward_func(plan)`, and
returns per run: the losses, every parameter's main_grad compared bitwise with the first run, the
activation high-water mark (`ActivationCounter`) and the runtime's recompute counters. It also
measures the activation bytes of one layer per recompute choice and of the stage ends, so a test
can compose the expected peak from the shared memory model.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import unwrap_model

from megatron_ucp.layout import Layout
from megatron_ucp.mcore_compat.schedules import have_transformer_engine
from megatron_ucp.recompute import runtime
from megatron_ucp.recompute.activations import ActivationCounter
from megatron_ucp.recompute.plan import PlanError
from megatron_ucp.testing import tiny_gpt as tg  # installs the CPU shim first
from megatron_ucp.testing.recompute_plans import make_plan


def _params(st: tg.TrainState) -> list[torch.Tensor]:
    return [p for m in st.model for p in m.parameters()]


def _step(st: tg.TrainState, forward_backward) -> tuple[list[float], int]:
    """tg.train_step's forward-backward (no optimizer step); returns (micro-batch losses, peak)."""
    cfg = st.config
    batches = tg._micro_batches(cfg, st.iteration)
    for m in st.model:
        m.zero_grad_buffer()
    st.optimizer.zero_grad()
    iters = [iter(batches) for _ in st.model]
    with ActivationCounter(_params(st)) as counter:
        losses = forward_backward(
            forward_step_func=tg._forward_step, data_iterator=iters if len(iters) > 1 else iters[0],
            model=st.model, num_microbatches=len(batches), seq_length=cfg.seq_length,
            micro_batch_size=cfg.micro_batch_size, forward_only=False)
    return [float(x["lm loss"]) for x in losses], counter.peak_bytes


def _main_grads(st: tg.TrainState) -> dict[str, torch.Tensor]:
    return {f"{i}.{name}": p.main_grad.detach().clone()
            for i, m in enumerate(st.model) for name, p in m.named_parameters()}


def _digest(grads: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name, g in grads.items():
        h.update(name.encode())
        h.update(g.numpy().tobytes())
    return h.hexdigest()


def _saved_bytes(params, fn) -> int:
    """Bytes autograd keeps after fn() (its result held), as ActivationCounter counts them."""
    with ActivationCounter(params) as counter:
        out = fn()
    nbytes = counter.live_bytes
    del out
    return nbytes


def measure_bytes(st: tg.TrainState, choices: set[str]) -> dict:
    """Activation bytes of one micro-batch: one layer per recompute choice, and the stage ends.

    The layer is this stage's first, on the hidden states and causal mask a micro-batch brings;
    the ends are those of the profiler (embedding; final layernorm + output layer + loss)."""
    cfg = st.config
    gpt = unwrap_model(st.model[0])
    params = _params(st)
    layer = gpt.decoder.layers[0]
    batch = tg._micro_batches(cfg, 0)[0]
    hidden = torch.randn(cfg.seq_length, cfg.micro_batch_size, cfg.hidden_size,
                         generator=torch.Generator().manual_seed(0))
    out: dict = {"layer_input": hidden.numel() * hidden.element_size()}
    basic = {"none", "full", "selective:core_attn"}
    if not cfg.add_bias_linear:  # see runtime._set_selective: with biases megatron's mlp recompute hangs
        basic.add("selective:mlp")
    for name in sorted(choices | basic):
        lp = make_plan([name], 1, {}).layers[0]
        runtime._reset_layer(layer)
        layer.__dict__.pop("_ucp_recompute", None)
        if lp.recompute == "selective":
            runtime._set_selective(layer, lp)
        elif lp.recompute == "full":
            layer.forward = runtime._full_recompute_forward(layer, lp.window)
        out[name] = _saved_bytes(params, lambda: layer(hidden_states=hidden.clone().requires_grad_(),
                                                      attention_mask=batch["attention_mask"]))
    runtime._reset_layer(layer)
    out["embedding"] = out["output"] = 0
    if gpt.pre_process:
        out["embedding"] = _saved_bytes(params, lambda: gpt.embedding(
            input_ids=batch["tokens"], position_ids=batch["position_ids"]))
    if gpt.post_process:
        weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights \
            else None

        def output():
            y = gpt.decoder.final_layernorm(hidden.clone().requires_grad_())
            logits, _ = gpt.output_layer(y, weight=weight)
            return gpt.compute_language_model_loss(batch["labels"], logits).float().mean()

        out["output"] = _saved_bytes(params, output)
    return out


def compare_runs(layout: str, cfg: dict, runs: list[dict], refusals: bool = False) -> dict:
    """One training step per run; grads compared bitwise with runs[0]'s on this rank.

    A run is {"name", "extra": TransformerConfig fields (megatron's recompute settings), "plan":
    make_plan choices or None (None: megatron-core's own schedule)}. refusals: also collect what
    apply_plan refuses (`_refusals`, pp 2 only).
    """
    lay = Layout.parse(layout)
    tg.init_distributed(lay)
    stage = ps.get_pipeline_model_parallel_rank()
    results, reference = [], None
    measured = None
    for run in runs:
        run_cfg = tg.TinyGPTConfig(**{**cfg, "extra": {**cfg.get("extra", {}), **run.get("extra", {})}})
        st = tg.build(run_cfg, lay)
        if measured is None:
            measured = measure_bytes(st, {c for r in runs for c in r.get("plan") or ()})
            st = tg.build(run_cfg, lay)  # fresh RNG streams for the step
        if run.get("plan"):
            fb = runtime.forward_backward_func(make_plan(run["plan"], lay.pp, cfg))
        else:
            fb = get_forward_backward_func()
        runtime.reset_counts()
        losses, peak = _step(st, fb)
        grads = _main_grads(st)
        if reference is None:
            reference = grads
        differ = [k for k, g in grads.items() if not torch.equal(g, reference[k])]
        max_diff = max((float((g - reference[k]).abs().max()) for k, g in grads.items()), default=0.0)
        results.append({"name": run["name"], "losses": losses, "digest": _digest(grads),
                        "differ": differ, "max_abs_diff": max_diff, "peak": peak,
                        "counts": runtime.recompute_counts(), "num_params": len(grads)})
        dist.barrier()
    return {"stage": stage, "runs": results, "bytes": measured,
            "refusals": _refusals(lay, cfg) if refusals else {}}


def _refusal(fn) -> str | None:
    try:
        fn()
    except PlanError as e:
        return str(e)
    return None


def _refusals(lay: Layout, cfg: dict) -> dict:
    """Messages of the plans and models apply_plan must refuse (None: not refused)."""
    n = cfg["num_layers"]
    st = tg.build(tg.TinyGPTConfig(**cfg), lay)
    stage = ps.get_pipeline_model_parallel_rank()
    out = {
        "layer_count": _refusal(lambda: runtime.apply_plan(
            st.model, make_plan(["full"] * (n + 2), lay.pp, cfg), stage)),
        "partition": _refusal(lambda: runtime.apply_plan(
            st.model, make_plan(["full"] * n, lay.pp, cfg, layers_per_stage=[n - 1, 1]), stage)),
        "layout": _refusal(lambda: runtime.apply_plan(
            st.model, make_plan(["full"] * n, lay.pp, cfg, tp=2), stage)),
    }
    mega = tg.build(tg.TinyGPTConfig(**{**cfg, "extra": {
        **cfg.get("extra", {}), "recompute_granularity": "full", "recompute_method": "uniform",
        "recompute_num_layers": 1}}), lay)
    out["megatron_recompute"] = _refusal(lambda: runtime.apply_plan(
        mega.model, make_plan(["full"] * n, lay.pp, cfg), stage))
    biased = tg.build(tg.TinyGPTConfig(**{**cfg, "add_bias_linear": True}), lay)
    out["mlp_with_bias"] = _refusal(lambda: runtime.apply_plan(
        biased.model, make_plan(["selective:mlp"] * n, lay.pp, cfg), stage))
    out["layernorm_without_te"] = "Transformer Engine is installed" if have_transformer_engine() else \
        _refusal(lambda: runtime.apply_plan(st.model, make_plan(["selective:layernorm"] * n, lay.pp, cfg),
                                            stage))
    # interleaved: p2p_wait refused; an inline plan passes through megatron's interleaved schedule
    ps.destroy_model_parallel()
    vlay = Layout(pp=lay.pp, vpp=2)
    tg.init_distributed(vlay)
    vst = tg.build(tg.TinyGPTConfig(**cfg), vlay)
    out["vpp_p2p_wait"] = _refusal(lambda: runtime.apply_plan(
        vst.model, make_plan(["full"] * n, lay.pp, cfg, vpp=2), stage))
    ref_losses, _ = _step(vst, get_forward_backward_func())
    ref = _main_grads(vst)
    vst = tg.build(tg.TinyGPTConfig(**cfg), vlay)
    inline = make_plan(["full:inline", "selective:core_attn"] * (n // 2), lay.pp, cfg, vpp=2)
    runtime.reset_counts()
    losses, _ = _step(vst, runtime.forward_backward_func(inline))
    grads = _main_grads(vst)
    out["vpp_inline_equal"] = losses == ref_losses and all(torch.equal(g, ref[k]) for k, g in grads.items())
    out["vpp_inline_counts"] = runtime.recompute_counts()
    return out
