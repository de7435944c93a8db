"""Transformer Engine models trained on a CPU-only host (the TE venv of `make test`).

TE installs and builds its modules here, but its kernels (forward, backward, FusedAdam, the
multi-tensor ops) need a GPU. What stands in for them:
- `use_cpu_kernels`: megatron-core picks TE's FusedAdam / FusedSGD and TE's multi-tensor kernels
  when TE is importable; these module globals are set back to torch's optimizers and megatron-core's
  own local multi-tensor functions (what megatron-core uses without TE or Apex); and
  `install_quantize_stand_ins`: TE's FP8 quantize kernels for FP8 parameters (`fp8_param=True`,
  delayed and current scaling), pure torch (`te_quantize_cpu`), and DDP's synchronous param all-gathers issued
  one by one: torch's gloo backend breaks a coalesced all_gather_into_tensor whose tensors differ in
  dtype (the uint8 buffer of FP8 weights next to the bf16 one: the bytes come back cast).
- `use_te_fused_adam`: the other way for the precision-aware optimizer, which only TE's FusedAdam
  implements: megatron-core keeps TE's FusedAdam, whose elementwise kernels run on the CPU
  (`te_fused_adam_cpu`).
- `synthetic_step`: a training step without TE's forward and backward: a deterministic gradient
  (an elementwise function of each parameter's value, so the same at every layout) written into
  DDP's grad buffers, DDP's real gradient reduction, then the real megatron-core optimizer step and
  LR schedule.
- `fill_fp8_meta`: FP8 delayed-scaling metadata as a first FP8 forward creates it
  (`te.fp8_autocast` + `init_fp8_metadata`), then filled with values distinct per module, layer,
  gemm and tensor (the same on every copy of a module, as TE's amax reduction leaves them).
"""

from __future__ import annotations

import zlib

import torch


def use_cpu_kernels() -> None:
    import megatron.core.optimizer as opt
    import megatron.core.optimizer.clip_grads as clip
    import megatron.core.optimizer.distrib_optimizer as dist_opt
    import megatron.core.optimizer.optimizer as optimizer
    from megatron.core.utils import (
        local_multi_tensor_applier,
        local_multi_tensor_l2_norm,
        local_multi_tensor_scale,
    )

    opt.Adam, opt.SGD, opt.USING_PYTORCH_OPTIMIZER = torch.optim.AdamW, torch.optim.SGD, True
    dist_opt.Adam, dist_opt.HAVE_APEX_OR_TE, dist_opt.USING_TE_OPTIMIZER = torch.optim.Adam, False, False
    optimizer.multi_tensor_applier = local_multi_tensor_applier
    optimizer.multi_tensor_scale_impl = local_multi_tensor_scale
    clip.multi_tensor_applier = local_multi_tensor_applier
    clip.l2_norm_impl = local_multi_tensor_l2_norm
    clip.multi_tensor_scale_impl = local_multi_tensor_scale
    clip.multi_tensor_scale_tensor_impl = None
    from megatron_ucp.mcore_compat.schedules import have_transformer_engine

    if have_transformer_engine():  # (importable without TE)
        install_quantize_stand_ins()


def use_te_fused_adam() -> None:
    """megatron-core builds TE's FusedAdam again (after `use_cpu_kernels`), with its kernels'
    CPU stand-ins: `--use-precision-aware-optimizer` runs need it."""
    import megatron.core.optimizer as opt
    import megatron.core.optimizer.distrib_optimizer as dist_opt
    from transformer_engine.pytorch.optimizers import FusedAdam

    from megatron_ucp.testing import te_fused_adam_cpu

    te_fused_adam_cpu.install()
    opt.Adam, opt.USING_PYTORCH_OPTIMIZER = FusedAdam, False
    dist_opt.Adam, dist_opt.HAVE_APEX_OR_TE, dist_opt.USING_TE_OPTIMIZER = FusedAdam, True, True


def install_quantize_stand_ins() -> None:
    """TE's Float8Quantizer and Float8CurrentScalingQuantizer casts (`tex.quantize`),
    `tex.compute_amax`, `tex.fp8_transpose` and the multi-tensor scale / scale computation of TE's
    cast_master_weights_to_fp8, in pure torch (see te_quantize_cpu); DDP's synchronous
    coalesced collectives run one by one (`_uncoalesced`)."""
    from megatron_ucp.mcore_compat.optimizer import wrap_ddp_coalescing_manager
    from megatron_ucp.testing import te_quantize_cpu

    te_quantize_cpu.install()
    wrap_ddp_coalescing_manager(_uncoalesced)


class _Done:
    def wait(self) -> None:
        pass


def _uncoalesced(original):
    """megatron-core's `_coalescing_manager` with synchronous ops run one by one (the same
    collectives; gloo's coalesced all_gather_into_tensor casts tensors of mixed dtypes);
    asynchronous ones keep torch's."""
    import contextlib

    @contextlib.contextmanager
    def manager(group=None, device=None, async_ops=False):
        if async_ops:
            with original(group, device, async_ops) as cm:
                yield cm
            return
        yield _Done()

    manager._ucp_uncoalesced = True
    return manager


def synthetic_step(state) -> None:
    """One optimizer step of `state` (tiny_gpt.TrainState) on the gradient sin(3p + step)."""
    for chunk in state.model:
        chunk.zero_grad_buffer()
        for p in chunk.parameters():
            if p.requires_grad:
                p.main_grad.copy_(torch.sin(3.0 * p.detach().float() + state.iteration))
        chunk.start_grad_sync()
        chunk.finish_grad_sync()
    state.optimizer.step()
    state.scheduler.step(increment=state.config.global_batch_size)
    state.iteration += 1


def _values(name: str, shape: tuple[int, ...], low: float, high: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return low + (high - low) * torch.rand(shape, generator=g)


def fill_fp8_meta(model_chunks: list, recipe) -> int:
    """FP8 metadata for every TE module of the chunks under `recipe` (delayed scaling: every scale
    and amax history filled with distinct values); returns the number of (module, gemm) entries."""
    import transformer_engine.pytorch as te

    from megatron_ucp import te_state

    entries = te_state.module_entries(model_chunks)
    modules = {id(e.module): e.module for e in entries}
    with te.autocast(enabled=True, recipe=recipe):
        for m in modules.values():
            m.init_fp8_metadata(num_gemms=getattr(m, "num_gemms", 1) if te_state.is_grouped(m) else 1)
    if not recipe.delayed():
        return len(entries)
    with torch.no_grad():
        for e in entries:
            n = e.module.fp8_meta["num_gemms"]
            for k, (which, attr) in te_state.DELAYED_TENSORS.items():
                t = getattr(e.module.fp8_meta[which], attr)
                rows = 3 if which == "scaling_fwd" else 2
                view = t.view(-1, rows, n) if k.startswith("amax") else t.view(rows, n)
                part = view[..., e.gemm]
                part.copy_(_values(f"{e.name}/{k}", tuple(part.shape), *((0.5, 4.0) if "scale" in k
                                                                          else (0.0, 300.0))))
    return len(entries)


def module_fp8_states(model_chunks: list) -> dict:
    """{universal module name: TE's own extra state of the module (its gemm), unpickled by plain
    pickle}: what a test compares after a load, read the way TE itself writes it."""
    import pickle

    from megatron_ucp import te_state

    out = {}
    for e in te_state.module_entries(model_chunks):
        if torch.is_tensor(e.data) and e.data.numel():
            d = pickle.loads(e.data.numpy().tobytes())  # the test's own payloads (trusted)
            out[e.name] = {"recipe": repr(d["recipe"]),
                           **{k: d[k].clone() for k in te_state.DELAYED_TENSORS if k in d}}
        elif e.module.fp8_meta.get("fp8_checkpoint") and e.module.fp8_meta.get("recipe") is not None:
            out[e.name] = {"recipe": repr(e.module.fp8_meta["recipe"])}  # a stateless recipe
    return out
