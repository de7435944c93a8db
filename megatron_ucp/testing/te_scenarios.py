"""Transformer Engine (and local-spec) runs for the TE list of `make test`, one rank each (`launch`).

Steps are `te_cpu.synthetic_step` (TE's kernels do not run on a CPU); both specs take the same
steps, so a TE run and a local run are driven alike. `fp8` names an FP8 recipe the TE modules get
before the save (`te_cpu.fill_fp8_meta`). Dumps: `dump_local_state` (model slices, optimizer
shards), `fp8.pt` per rank (every TE module's own extra state after the load) and, for FP8
parameters (`fp8_param=True`), `fp8params_rank<r>.pt`: every Float8Tensor weight's raw bytes and
scale_inv (after the load; for the saving run, after megatron-core re-derived them from the saved
masters once the save was written: `rederive_fp8_params`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

import megatron_ucp as ucp
from megatron_ucp.testing import scenarios, te_cpu
from megatron_ucp.testing import tiny_gpt as tg

te_cpu.use_cpu_kernels()


def _recipe(fp8: dict | None):
    if not fp8:
        return None
    from transformer_engine.common import recipe as te_recipe

    kind = fp8.get("recipe", "delayed")
    if kind == "delayed":
        return te_recipe.DelayedScaling(fp8_format=te_recipe.Format[fp8.get("format", "HYBRID")],
                                        amax_history_len=fp8.get("amax_history_len", 16),
                                        amax_compute_algo="max")
    if kind == "tensorwise":
        return te_recipe.Float8CurrentScaling(fp8_format=te_recipe.Format.HYBRID)
    if kind == "mxfp8":
        return te_recipe.MXFP8BlockScaling(fp8_format=te_recipe.Format.E4M3)
    if kind == "blockwise":
        return te_recipe.Float8BlockScaling(fp8_format=te_recipe.Format.E4M3)
    raise ValueError(kind)


def _dump_fp8(st, dump_dir: str) -> None:
    Path(dump_dir).mkdir(parents=True, exist_ok=True)
    torch.save(te_cpu.module_fp8_states(st.model), Path(dump_dir) / f"fp8_rank{dist.get_rank()}.pt")


def fp8_params(model_chunks: list) -> list:
    """[(chunk index, name, Float8Tensor param)] of the chunks (FP8 parameters, `fp8_param=True`)."""
    from megatron.core.fp8_utils import is_float8tensor
    from megatron.core.utils import unwrap_model

    return [(i, n, p) for i, chunk in enumerate(model_chunks)
            for n, p in unwrap_model(chunk).named_parameters() if is_float8tensor(p)]


def rederive_fp8_params(st) -> None:
    """megatron-core's own derivation of the FP8 weights from the DistributedOptimizer's fp32
    masters, as after a step: `_copy_main_params_to_model_params` (-> fp8_utils.quantize_param_shard
    -> TE's cast_master_weights_to_fp8) and the forced param all-gather."""
    from megatron_ucp.mcore_compat.optimizer import copy_main_params_to_model_params

    for o in scenarios._leaf_optimizers(st.optimizer):
        copy_main_params_to_model_params(o)
    for chunk in st.model:
        chunk.start_param_sync(force_sync=True)


def _fp8_param_entry(i: int, n: str, p) -> dict:
    """A Float8Tensor's bytes and scale_inv; an MXFP8Tensor's rowwise and columnwise bytes and
    E8M0 scales (the [M, K/32] / [M/32, K] blocks TE writes: the padding is uninitialised)."""
    if hasattr(p, "_rowwise_data"):
        m, k = p._rowwise_data.shape
        return {"chunk": i, "name": n, "data": p._rowwise_data.detach().clone(),
                "scale_inv": p._rowwise_scale_inv[:m, :k // 32].detach().clone(),
                "columnwise_data": p._columnwise_data.detach().clone(),
                "columnwise_scale_inv": p._columnwise_scale_inv[:m // 32, :k].detach().clone(),
                "fp8_dtype": str(p._fp8_dtype)}
    return {"chunk": i, "name": n, "data": p._data.detach().clone(),
            "scale_inv": p._scale_inv.detach().clone().reshape(-1), "fp8_dtype": str(p._fp8_dtype)}


def _dump_fp8_params(st, dump_dir: str) -> int:
    entries = [_fp8_param_entry(i, n, p) for i, n, p in fp8_params(st.model)]
    Path(dump_dir).mkdir(parents=True, exist_ok=True)
    torch.save(entries, Path(dump_dir) / f"fp8params_rank{dist.get_rank()}.pt")
    return len(entries)


def setup(layout: str, cfg: dict):
    """`scenarios.setup`, with TE's FusedAdam (its kernels on the CPU) for a precision-aware run;
    an MXFP8 run (`fp8_recipe="mxfp8"`) on a device of compute capability 10.0 (TE refuses MXFP8
    below; the CPU shim reports Hopper's 9.0 otherwise)."""
    if cfg.get("extra", {}).get("fp8_recipe") == "mxfp8":
        from megatron_ucp.testing import cpu_shim

        cpu_shim.set_compute_capability(10, 0)
    if cfg.get("optimizer_extra", {}).get("use_precision_aware_optimizer"):
        te_cpu.use_te_fused_adam()
    return scenarios.setup(layout, cfg)


def train_and_save(layout: str, cfg: dict, steps: int, save_dir: str, fp8: dict | None = None,
                   dump_dir: str | None = None, skew_rank: int | None = None) -> dict:
    """`steps` synthetic steps, FP8 metadata per `fp8`, save. skew_rank: that rank's copy of the
    first TE module's FP8 state is changed before the save (a negative control)."""
    st = setup(layout, cfg)
    for _ in range(steps):
        te_cpu.synthetic_step(st)
    recipe = _recipe(fp8)
    n = te_cpu.fill_fp8_meta(st.model, recipe) if recipe is not None else 0
    if skew_rank is not None and dist.get_rank() == skew_rank:
        from megatron_ucp import te_state

        first = te_state.module_entries(st.model)[0].module
        first.fp8_meta["scaling_fwd"].scale.add_(1.0)
    if dump_dir:
        scenarios.dump_local_state(st, dump_dir)
        _dump_fp8(st, dump_dir)
    error = None
    try:
        scenarios._save(st, save_dir)
    except ucp.UCPError as e:
        error = str(e)
    fp8_weights = 0
    if dump_dir and fp8_params(st.model):
        rederive_fp8_params(st)
        fp8_weights = _dump_fp8_params(st, dump_dir)
    tg.destroy()
    return {"fp8_entries": n, "error": error, "fp8_weights": fp8_weights}


def load(layout: str, cfg: dict, load_dir: str, dump_dir: str | None = None,
         resave_dir: str | None = None) -> dict:
    """Load at `layout`, dump, re-save, then one more synthetic step (the state is usable)."""
    st = setup(layout, cfg)
    r = ucp.load(st.model, st.optimizer, st.scheduler, load_dir)
    st.iteration = r.iteration
    if dump_dir:
        scenarios.dump_local_state(st, dump_dir)
        _dump_fp8(st, dump_dir)
        if fp8_params(st.model):
            _dump_fp8_params(st, dump_dir)
    if resave_dir:
        ucp.save(st.model, st.optimizer, st.scheduler, resave_dir, st.iteration, extra=r.extra,
                 seed=st.config.seed, vocab_size=st.config.unpadded_vocab_size)
    dtypes = sorted({f"{k}:{str(v.dtype).removeprefix('torch.')}" for v_state in _fused_adam_states(st)
                     for k, v in v_state.items()})
    te_cpu.synthetic_step(st)
    tg.destroy()
    return {"iteration": r.iteration, "fp8_modules": r.fp8_modules, "state_dtypes": dtypes}


def _fused_adam_states(st) -> list[dict]:
    """Each parameter shard's state in TE's FusedAdam (precision-aware runs), its own tensors."""
    out = []
    for o in scenarios._leaf_optimizers(st.optimizer):
        if getattr(o.optimizer, "master_weights", False):
            out += [{k: v for k, v in o.optimizer.state[p].items() if torch.is_tensor(v)}
                    for g in o.optimizer.param_groups for p in g["params"]]
    return out


def _raw_snapshot(st) -> dict[str, torch.Tensor]:
    """Every model weight and every FusedAdam state tensor as stored (fp8 state: its bytes)."""
    from megatron.core.utils import unwrap_model

    out = {f"model/{i}/{n}": p.detach().clone() for i, chunk in enumerate(st.model)
           for n, p in unwrap_model(chunk).named_parameters()}
    for j, state in enumerate(_fused_adam_states(st)):
        for k, v in state.items():
            out[f"state/{j}/{k}"] = getattr(v, "_data", v).detach().clone()
    return out


def continue_after_load(layout: str, cfg: dict, steps: int, save_dir: str) -> dict:
    """`steps` steps, save, one more step (the uninterrupted run); then a new run at the same
    layout loads the save and takes one step: both runs' weights and state, compared as stored."""
    st = setup(layout, cfg)
    for _ in range(steps):
        te_cpu.synthetic_step(st)
    scenarios._save(st, save_dir)
    te_cpu.synthetic_step(st)
    uninterrupted = _raw_snapshot(st)
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()  # (the process group stays: gloo is not set up twice)
    st = setup(layout, cfg)
    st.iteration = ucp.load(st.model, st.optimizer, st.scheduler, save_dir).iteration
    te_cpu.synthetic_step(st)
    resumed = _raw_snapshot(st)
    tg.destroy()
    mismatch = sorted(k for k in uninterrupted if k not in resumed
                      or not torch.equal(uninterrupted[k], resumed[k]))
    return {"compared": len(uninterrupted), "mismatch": mismatch}
