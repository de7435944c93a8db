"""Transformer Engine (and local-spec) runs for the TE list of `make test`, one rank each (`launch`).

Steps are `te_cpu.synthetic_step` (TE's kernels do not run on a CPU); both specs take the same
steps, so a TE run and a local run are driven alike. `fp8` names an FP8 recipe the TE modules get
before the save (`te_cpu.fill_fp8_meta`). Dumps: `dump_local_state` (model slices, optimizer
shards) and `fp8.pt` per rank (every TE module's own extra state after the load).
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
    if kind == "blockwise":
        return te_recipe.Float8BlockScaling(fp8_format=te_recipe.Format.E4M3)
    raise ValueError(kind)


def _dump_fp8(st, dump_dir: str) -> None:
    Path(dump_dir).mkdir(parents=True, exist_ok=True)
    torch.save(te_cpu.module_fp8_states(st.model), Path(dump_dir) / f"fp8_rank{dist.get_rank()}.pt")


def train_and_save(layout: str, cfg: dict, steps: int, save_dir: str, fp8: dict | None = None,
                   dump_dir: str | None = None, skew_rank: int | None = None) -> dict:
    """`steps` synthetic steps, FP8 metadata per `fp8`, save. skew_rank: that rank's copy of the
    first TE module's FP8 state is changed before the save (a negative control)."""
    st = scenarios.setup(layout, cfg)
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
    tg.destroy()
    return {"fp8_entries": n, "error": error}


def load(layout: str, cfg: dict, load_dir: str, dump_dir: str | None = None,
         resave_dir: str | None = None) -> dict:
    """Load at `layout`, dump, re-save, then one more synthetic step (the state is usable)."""
    st = scenarios.setup(layout, cfg)
    r = ucp.load(st.model, st.optimizer, st.scheduler, load_dir)
    st.iteration = r.iteration
    if dump_dir:
        scenarios.dump_local_state(st, dump_dir)
        _dump_fp8(st, dump_dir)
    if resave_dir:
        ucp.save(st.model, st.optimizer, st.scheduler, resave_dir, st.iteration, extra=r.extra,
                 seed=st.config.seed, vocab_size=st.config.unpadded_vocab_size)
    te_cpu.synthetic_step(st)
    tg.destroy()
    return {"iteration": r.iteration, "fp8_modules": r.fp8_modules}
