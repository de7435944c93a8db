"""Multi-process scenarios run through `launch`: train/save at one layout, load/train at another.

Every function here runs inside one rank (see `launch.launch`) and returns JSON. `dump_dir` writes
each rank's raw local state (model slice, optimizer shard, step) read through megatron-core's own
accessors, so tests can assemble full tensors independently of megatron_ucp's mapping code.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.utils import unwrap_model

import megatron_ucp as ucp
from megatron_ucp import saver
from megatron_ucp.layout import Layout
from megatron_ucp.mcore_compat import optimizer as mcore_optimizer
from megatron_ucp.testing import tiny_gpt as tg  # installs the CPU shim first


def _scaler_state(st: tg.TrainState) -> dict | None:
    scaler = getattr(_leaf_optimizers(st.optimizer)[0], "grad_scaler", None)
    return {k: float(v) for k, v in scaler.state_dict().items()} if scaler is not None else None


def setup(layout: str, cfg: dict) -> tg.TrainState:
    """The tiny GPT of `cfg` at `layout` (the process group once, megatron-core's groups per call)."""
    lay = Layout.parse(layout)
    tg.init_distributed(lay)
    return tg.build(tg.TinyGPTConfig(**cfg), lay)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _leaf_optimizers(optimizer) -> list:
    """The optimizers that hold state: megatron-core's DistributedOptimizer, Float16/FP32 wrappers
    and (inside LayerWise, fp32) bare torch optimizers, out of any ChainedOptimizer nesting."""
    inner = getattr(optimizer, "chained_optimizers", None)
    return [leaf for o in inner for leaf in _leaf_optimizers(o)] if inner else [optimizer]


def _optimizer_entry(opts: list, p: torch.nn.Parameter) -> dict | None:
    """This rank's range of `p`'s state in megatron-core's own structures: {range, step, states,
    <state>: tensor}; None when no optimizer of this rank holds it. (Independent of
    megatron_ucp.optimizer_state: the reference the transition tests compare against.)"""
    for o in opts:
        if hasattr(o, "model_param_group_index_map"):  # DistributedOptimizer
            if p not in o.model_param_group_index_map:
                continue
            start, end = mcore_optimizer.param_range(o, p)
            s = dict(mcore_optimizer.main_param_and_optimizer_states(o, p))
            gi, go = o.model_param_group_index_map[p]
            group = o.optimizer.param_groups[gi]
            if s["param"].dtype == torch.int16:  # precision-aware: the remainder of a bf16 weight
                from megatron_ucp.testing.te_fused_adam_cpu import join_master

                s["param"] = join_master(group["params"][go].detach(), s["param"])
        else:  # the full state of p in the torch optimizer (its fp32 copy: main_param)
            torch_opt = getattr(o, "optimizer", o)
            main = getattr(p, "main_param", p)
            group = next((g for g in torch_opt.param_groups if any(m is main for m in g["params"])),
                         None)
            if group is None:
                continue
            start, end = 0, p.numel()
            s = {"param": main, **torch_opt.state[main]}
        # torch Adam keeps the step per parameter, TE/Apex FusedAdam per param group; Lion, SGD
        # and Muon count none
        step = s["step"] if "step" in s else group.get("step", 0)
        states = ["param"] + sorted(k for k, v in s.items() if torch.is_tensor(v)
                                    and k not in ("param", "step", "master_param"))
        return {"range": (start, end), "step": float(step), "states": states,
                **{k: _host_copy(s[k]).reshape(-1) for k in states}}
    return None


def dump_local_state(state: tg.TrainState, dump_dir: str) -> None:
    """Write rank<r>.pt: every local param's model tensor, optimizer shard and step."""
    opts = _leaf_optimizers(state.optimizer)
    entries = []
    for chunk_index, chunk in enumerate(state.model):
        for name, p in unwrap_model(chunk).named_parameters():
            e = {"chunk": chunk_index, "name": name, "model": _host_copy(p), "range": None}
            e.update(_optimizer_entry(opts, p) or {})
            entries.append(e)
        persistent = unwrap_model(chunk).state_dict(keep_vars=True)
        for name, b in unwrap_model(chunk).named_buffers():
            if name in persistent and b.is_floating_point():
                entries.append({"chunk": chunk_index, "name": name, "model": _host_copy(b),
                                "range": None})
    coords = {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
              "dp": ps.get_data_parallel_rank(), "layout": str(state.layout),
              "tp_size": state.layout.tp, "pp_size": state.layout.pp, "vpp": state.layout.vpp or 1,
              "num_layers": len(state.config.hybrid_pattern or "") or state.config.num_layers,
              "ep": ps.get_expert_model_parallel_rank(),
              "ep_size": state.layout.ep, "num_experts": state.config.num_experts or 0,
              "first_stage_layers": state.config.extra.get("num_layers_in_first_pipeline_stage"),
              "last_stage_layers": state.config.extra.get("num_layers_in_last_pipeline_stage"),
              "mamba": _mamba_dims(state)}
    Path(dump_dir).mkdir(parents=True, exist_ok=True)
    torch.save({"coords": coords, "params": entries}, Path(dump_dir) / f"rank{dist.get_rank()}.pt")


def _mamba_dims(state: tg.TrainState) -> dict | None:
    """A hybrid model's Mamba mixer sizes (megatron-core's MambaMixer attributes), which say how
    its in_proj and conv1d are laid out; None for a model without Mamba layers."""
    for chunk in state.model:
        for m in unwrap_model(chunk).modules():
            if hasattr(m, "d_inner") and hasattr(m, "ngroups") and hasattr(m, "nheads"):
                return {"d_inner": m.d_inner, "groups_x_state": m.ngroups * m.d_state, "heads": m.nheads}
    return None


def dump_rng(rng_dir: str) -> None:
    """Write rank<r>.pt: every generator this rank holds now (rng.capture)."""
    from megatron_ucp import rng

    tensors, meta = rng.capture()
    Path(rng_dir).mkdir(parents=True, exist_ok=True)
    torch.save({"tensors": tensors, "meta": meta}, Path(rng_dir) / f"rank{dist.get_rank()}.pt")


def _save(st: tg.TrainState, save_dir: str, async_save: bool = False) -> None:
    ucp.save(st.model, st.optimizer, st.scheduler, save_dir, st.iteration,
             extra={"consumed_samples": st.iteration * st.config.global_batch_size}, seed=st.config.seed,
             vocab_size=st.config.unpadded_vocab_size, async_save=async_save)


def train_and_save(layout: str, cfg: dict, steps: int, save_dir: str, continue_steps: int = 0,
                   dump_dir: str | None = None, async_save: bool = False, rng_dir: str | None = None) -> dict:
    """Train `steps`, save, then keep training `continue_steps` (the no-interruption reference).
    rng_dir: the generators as they are once the save returns (what a resume must restore).

    async_save: the background writer is held until the continued steps have changed every
    parameter and Adam moment in place, so the files must come from the staged copies.
    """
    st = setup(layout, cfg)
    losses = [tg.train_step(st) for _ in range(steps)]
    if dump_dir:
        dump_local_state(st, dump_dir)
    dist.barrier()
    gate = threading.Event()
    if async_save:
        saver.before_background_write = lambda pending: gate.wait()
    t0 = time.perf_counter()
    _save(st, save_dir, async_save)
    save_s = time.perf_counter() - t0
    if rng_dir:
        dump_rng(rng_dir)
    scaler = _scaler_state(st)
    continued = [tg.train_step(st) for _ in range(continue_steps)]
    uncommitted = saver.pending()
    gate.set()
    ucp.finalize()
    saver.before_background_write = None
    adam = type(inner_optimizer(st))
    optimizer = f"{adam.__module__}.{adam.__name__}"
    tg.destroy()
    return {"losses": losses, "continued": continued, "save_seconds": save_s, "grad_scaler": scaler,
            "pending_while_training": uncommitted, "optimizer": optimizer}


def inner_optimizer(st: tg.TrainState):
    """The Adam implementation megatron-core picked (torch, or TE/Apex FusedAdam)."""
    opts = getattr(st.optimizer, "chained_optimizers", None) or [st.optimizer]
    return opts[0].optimizer


def async_saves(layout: str, cfg: dict, save_dir: str, dump_dir: str, fail_rank: int | None = None) -> dict:
    """Async save at step 2, two async saves in a row (3 and 4, the second commits the first), then
    (fail_rank) an async save 5 whose background write raises ENOSPC on that rank: the error comes
    out of the next finalize on every rank, once, and save 6 works again."""
    st = setup(layout, cfg)
    out: dict = {"committed": []}
    for _ in range(2):
        tg.train_step(st)
    dump_local_state(st, dump_dir)
    _save(st, save_dir, async_save=True)
    out["pending_after_save"] = saver.pending()
    tg.train_step(st)
    _save(st, save_dir, async_save=True)  # commits iteration 2 first
    out["committed"].append(_latest(save_dir))
    tg.train_step(st)
    _save(st, save_dir, async_save=True)
    ucp.finalize()
    out["committed"].append(_latest(save_dir))
    out["pending_after_finalize"] = saver.pending()
    if fail_rank is not None:
        tg.train_step(st)
        real = saver.write_rank_file
        if dist.get_rank() == fail_rank:
            def full_disk(path, *a, **k):
                raise OSError(28, "No space left on device", str(path))
            saver.write_rank_file = full_disk
        _save(st, save_dir, async_save=True)
        try:
            ucp.finalize()
            out["error"] = None
        except ucp.UCPError as e:
            out["error"] = str(e)
        saver.write_rank_file = real
        out["latest_after_error"] = _latest(save_dir)
        out["second_finalize"] = ucp.finalize()  # the error is not raised twice
        tg.train_step(st)
        _save(st, save_dir, async_save=True)
        ucp.finalize()
        out["latest_after_retry"] = _latest(save_dir)
    tg.destroy()
    return out


def _latest(save_dir: str) -> str:
    dist.barrier()
    return (Path(save_dir) / "latest").read_text().strip()


def load_and_train(layout: str, cfg: dict, load_dir: str, steps: int, dump_dir: str | None = None,
                   resave_dir: str | None = None, sabotage: str | None = None,
                   rng_dir: str | None = None, reset_optimizer: bool = False) -> dict:
    """Load at `layout`, optionally dump (state; generators to `rng_dir`) and re-save at once,
    then train `steps`.

    sabotage="scheduler" restarts the LR schedule after the load, sabotage="rng" re-seeds torch's
    generator (negative controls for tests).
    """
    st = setup(layout, cfg)
    t0 = time.perf_counter()
    r = ucp.load(st.model, st.optimizer, st.scheduler, load_dir, reset_optimizer=reset_optimizer)
    load_s = time.perf_counter() - t0
    if sabotage == "scheduler":
        st.scheduler.num_steps = 0
        st.scheduler.step(0)
    if sabotage == "rng":
        torch.manual_seed(0)
    st.iteration = r.iteration
    if rng_dir:
        dump_rng(rng_dir)
    scaler = _scaler_state(st)
    if dump_dir:
        dump_local_state(st, dump_dir)
    if resave_dir:
        ucp.save(st.model, st.optimizer, st.scheduler, resave_dir, st.iteration, extra=r.extra,
                 seed=st.config.seed, vocab_size=st.config.unpadded_vocab_size)
    losses = [tg.train_step(st) for _ in range(steps)]
    tg.destroy()
    return {"losses": losses, "iteration": r.iteration, "extra": r.extra, "bytes_read": r.bytes_read,
            "files_opened": r.files_opened, "requests": r.requests,
            "rng_restored": r.rng_restored, "load_seconds": load_s, "grad_scaler": scaler,
            "read_seconds": r.read_seconds, "param_sync_seconds": r.param_sync_seconds,
            "lr": [g["lr"] for g in st.optimizer.param_groups],
            "optimizer_reset": list(r.optimizer_reset)}


def train_fresh(layout: str, cfg: dict, steps: int) -> dict:
    """Train from initialisation (identical at every layout): measures the reduction-order floor."""
    st = setup(layout, cfg)
    losses = [tg.train_step(st) for _ in range(steps)]
    tg.destroy()
    return {"losses": losses}


def param_specs(layout: str, cfg: dict) -> list[dict]:
    """This rank's canonical universal specs (no training): what megatron_ucp derives from the model."""
    st = setup(layout, cfg)
    from megatron_ucp.param_spec import local_params

    out = [lp.spec.to_json() for lp in local_params(st.model) if lp.canonical]
    tg.destroy()
    return out
