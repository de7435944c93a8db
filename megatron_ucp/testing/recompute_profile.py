"""Rank functions for the recompute profiler on the CPU shim (run through `launch`), and a CPU entry.

`python -m megatron_ucp.testing.recompute_profile --config model.yaml --out prof.json` is
`megatron_ucp.recompute.profiler.main` with the torch.cuda stand-in installed first, for CPU hosts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from megatron_ucp.testing import cpu_shim  # noqa: F401  (must precede megatron.core)


def profile(model: dict, tp: int = 1, warmup: int = 1, repeats: int = 3, links: bool = True,
            link_sizes: list | None = None) -> dict:
    """profile_layer on this rank, as JSON (launched on more than one rank: every rank joins a gloo
    group first, as under torchrun)."""
    import torch.distributed as dist

    from megatron_ucp.recompute import profiler

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    kwargs = {"link_sizes": tuple(link_sizes)} if link_sizes else {}
    out = profiler.profile_layer(model, tp=tp, warmup=warmup, repeats=repeats, links=links,
                                 **kwargs).to_json()
    if dist.is_initialized():
        dist.destroy_process_group()
    return out


def layer_saved_bytes(model: dict, recompute_modules: list | None = None) -> int:
    """What one whole layer keeps for backward, counted by a plain ActivationCounter around the real
    TransformerLayer forward (no hooks), with megatron's selective `recompute_modules` if given.
    Needs megatron-core's model-parallel state (TP 1) set up."""
    from megatron.core import tensor_parallel

    from megatron_ucp.recompute import profiler
    from megatron_ucp.recompute.activations import ActivationCounter
    from megatron_ucp.recompute.hardware import normalize_model

    m = normalize_model(model)
    if recompute_modules:
        m["extra"] = {**m.get("extra", {}), "recompute_granularity": "selective",
                      "recompute_modules": list(recompute_modules)}
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    gpt = profiler.build_model(m, 1, gpu=False)
    hidden, grad, mask = profiler._layer_inputs(m, 1, False, seed=0)
    x = hidden.detach().requires_grad_()
    counter = ActivationCounter(gpt.parameters())
    with counter:
        out, _ = gpt.decoder.layers[0](x, attention_mask=mask, rotary_pos_emb=profiler._rotary(gpt, m))
    saved = counter.live_bytes
    out.backward(grad)
    return saved


def layer_checks(models: list, saved_cases: list, link_sizes: list) -> dict:
    """One process: a profile of each model (links measured for the first only, on two spawned
    ranks), then the whole-layer saved bytes of each (model index, recompute_modules) case."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_ucp.recompute import profiler

    profiles = [profiler.profile_layer(m, warmup=1, repeats=2, links=i == 0,
                                       link_sizes=tuple(link_sizes)).to_json()
                for i, m in enumerate(models)]
    dist.init_process_group("gloo")
    ps.initialize_model_parallel()
    saved = [layer_saved_bytes(models[i], modules) for i, modules in saved_cases]
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return {"profiles": profiles, "saved": saved}


def timed_steps(layout: str, cfg: dict, runs: list, warmup: int, steps: int) -> dict:
    """Training steps of the tiny GPT at `layout` (pp only) for several recompute settings.

    A run is {"name", "extra": TransformerConfig fields (megatron's recompute settings), "plan":
    make_plan choices or None}: None runs megatron-core's forward_backward_func, a plan runs
    `runtime.forward_backward_func`. Each run has its own model and optimizer; their steps are
    interleaved (run 1, run 2, ..., run 1, ...), so load from other processes falls on all alike.
    Per run: per timed step this rank's schedule seconds, its CPU seconds, the host's busy CPU
    seconds over the window between the barriers around the schedule (a caller can tell how much
    CPU other processes took), the optimizer seconds; the activation high-water mark of one untimed
    step (ActivationCounter: its hooks cost time); all losses; the runtime's recompute counters.
    Every step starts after a barrier, so the slowest rank's schedule time is the step's."""
    import time

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ucp.layout import Layout
    from megatron_ucp.recompute import runtime
    from megatron_ucp.recompute.activations import ActivationCounter
    from megatron_ucp.testing import tiny_gpt as tg
    from megatron_ucp.testing.recompute_plans import make_plan

    lay = Layout.parse(layout)
    tg.init_distributed(lay)
    states, funcs = [], []
    for run in runs:
        run_cfg = {**cfg, "extra": {**cfg.get("extra", {}), **run.get("extra", {})}}
        states.append(tg.build(tg.TinyGPTConfig(**run_cfg), lay))
        funcs.append(runtime.forward_backward_func(make_plan(run["plan"], lay.pp, cfg)) if run.get("plan")
                     else get_forward_backward_func())

    def step(st: tg.TrainState, fb, counter: ActivationCounter | None) -> dict:
        batches = tg._micro_batches(st.config, st.iteration)
        for m in st.model:
            m.zero_grad_buffer()
        st.optimizer.zero_grad()
        runtime.reset_counts()
        dist.barrier()
        busy0, cpu0, t0 = busy_cpu_s(), time.process_time(), time.perf_counter()
        if counter is not None:
            counter.__enter__()
        try:
            losses = fb(forward_step_func=tg._forward_step, data_iterator=iter(batches), model=st.model,
                        num_microbatches=len(batches), seq_length=st.config.seq_length,
                        micro_batch_size=st.config.micro_batch_size, forward_only=False)
        finally:
            if counter is not None:
                counter.__exit__(None, None, None)
        t1, cpu1 = time.perf_counter(), time.process_time()
        dist.barrier()  # the window every rank's schedule lies in: [t0, t_end]
        busy1, t_end = busy_cpu_s(), time.perf_counter()
        st.optimizer.step()
        st.scheduler.step(increment=st.config.global_batch_size)
        t2 = time.perf_counter()
        st.iteration += 1
        return {"schedule_s": t1 - t0, "optimizer_s": t2 - t_end, "cpu_s": cpu1 - cpu0,
                "window_s": t_end - t0, "host_busy_s": busy1 - busy0,
                "losses": [float(x["lm loss"]) for x in losses], "counts": runtime.recompute_counts()}

    results = [{"name": run["name"], "steps": [], "losses": []} for run in runs]
    for i in range(warmup + 1 + steps):
        for st, fb, res in zip(states, funcs, results):
            params = [p for m in st.model for p in m.parameters()]
            counter = ActivationCounter(params) if i == warmup else None
            out = step(st, fb, counter)
            res["losses"] += out.pop("losses")
            if counter is not None:
                res["activation_peak_bytes"] = counter.peak_bytes
                res["recompute_counts"] = out["counts"]  # of one step
            elif i > warmup:
                res["steps"].append(out)
    stage = ps.get_pipeline_model_parallel_rank()
    tg.destroy()
    return {"stage": stage, "runs": results}


def busy_cpu_s() -> float:
    """CPU seconds all cores of this host have been busy since boot (/proc/stat; 0.0 elsewhere)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return 0.0
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    from megatron_ucp.recompute import profiler

    sys.exit(profiler.main(sys.argv[1:]))
