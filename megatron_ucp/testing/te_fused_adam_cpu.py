"""Pure-torch stand-ins for Transformer Engine 2.20's FusedAdam kernels, for CPU-only hosts (test
code only: `install()`; megatron_ucp itself never does). With them TE's own `FusedAdam.step` runs
on a CPU, so megatron-core's precision-aware optimizer (`--use-precision-aware-optimizer`: TE
FusedAdam with `master_weights`, `exp_avg_dtype`, `exp_avg_sq_dtype`, `master_weight_dtype`,
`store_param_remainders`) trains and keeps its low-precision state as on a GPU: every scaling,
unscaling and FP8 quantisation of the state is TE's Python (`FusedAdam._apply_scale`,
`get_unscaled_state`, `set_scaled_state`); only the elementwise update below is replaced.

What each replaces (common/multi_tensor/adam.cu; the CUDA kernels need a GPU):
- `transformer_engine_torch.multi_tensor_adam(chunk, noop, [g, p, m, v(, p_master)], lr, beta1,
  beta2, eps, step, mode, bias_correction, weight_decay)`: `AdamFunctor` (4 lists) and
  `AdamFunctorMaster` (5 lists: the update on the fp32 master, the model weight its cast);
- `transformer_engine_torch.multi_tensor_adam_param_remainder(...)` (`AdamFunctorMasterParamRemainder`):
  the fp32 master is the bf16 weight's bits over the int16 remainder's, with the kernel's rounding
  undone first (remainder < 0: weight - 1) and redone after (remainder < 0: weight + 1);
- the update itself (`adam_update`): fp32 math, ADAM_MODE_0 L2 (g += wd * p) or ADAM_MODE_1
  decoupled (update += wd * p), bias corrections `1 - pow(beta, step)` in double on the host, cast
  to fp32; results cast into each tensor's dtype (round to nearest even, as `static_cast`).
  nvcc contracts a * b + c into FMAs, torch does not: the values are TE's to an ulp, not bitwise
  a GPU's (a test compares CPU runs with CPU runs).
Not stood in: `multi_tensor_adam_fp8` (FP8 model weights), the capturable and MXFP8 variants.
"""

from __future__ import annotations

import torch

_ORIGINAL: dict = {}


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _update(g, p, m, v, lr, beta1, beta2, eps, step, mode, bias_correction, wd):
    """`adam_update` on fp32 tensors; returns (p, m, v)."""
    b1, b2 = _f32(beta1), _f32(beta2)
    c1 = _f32(1 - float(b1) ** step) if bias_correction else _f32(1.0)
    c2 = _f32(1 - float(b2) ** step) if bias_correction else _f32(1.0)
    lr, eps, wd = _f32(lr), _f32(eps), _f32(wd)
    if mode == 0:
        g = g + wd * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    update = (m / c1) / (torch.sqrt(v / c2) + eps)
    if mode != 0:
        update = update + wd * p
    return p - lr * update, m, v


def multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step, mode,
                      bias_correction, weight_decay):
    del chunk_size, noop_flag  # (the kernel ignores the noop flag: it propagates infs and NaNs)
    master = len(tensor_lists) == 5
    with torch.no_grad():
        for i in range(len(tensor_lists[0])):
            g, p, m, v = (t[i] for t in tensor_lists[:4])
            full = tensor_lists[4][i] if master else p
            new_p, new_m, new_v = _update(g.float(), full.float(), m.float(), v.float(), lr, beta1,
                                          beta2, eps, step, mode, bias_correction, weight_decay)
            if master:
                full.copy_(new_p)
            p.copy_(new_p)
            m.copy_(new_m)
            v.copy_(new_v)


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 weight bits, int16 remainder) of fp32 `master`, as the remainder kernel leaves them."""
    bits = master.contiguous().view(torch.int32)
    high, low = bits >> 16, (bits & 0xFFFF).to(torch.int16)
    high = torch.where(low < 0, high + 1, high)
    return high.to(torch.int16), low


def join_master(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master the remainder kernel reconstructs from a bf16 `weight` and its remainder."""
    high = weight.contiguous().view(torch.int16).to(torch.int32)
    low = remainder.to(torch.int32)
    high = torch.where(low < 0, high - 1, high)
    return ((high << 16) | (low & 0xFFFF)).view(torch.float32)


def multi_tensor_adam_param_remainder(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps,
                                      step, mode, bias_correction, weight_decay):
    del chunk_size, noop_flag
    with torch.no_grad():
        for g, p, m, v, rem in zip(*tensor_lists):
            new_p, new_m, new_v = _update(g.float(), join_master(p, rem), m.float(), v.float(), lr,
                                          beta1, beta2, eps, step, mode, bias_correction, weight_decay)
            high, low = split_master(new_p)
            p.view(torch.int16).copy_(high)
            rem.copy_(low)
            m.copy_(new_m)
            v.copy_(new_v)


def install() -> None:
    """Put the stand-ins where FusedAdam's constructor looks them up (idempotent; build the
    optimizer after this)."""
    import transformer_engine_torch as tex

    if not _ORIGINAL:
        _ORIGINAL.update(multi_tensor_adam=tex.multi_tensor_adam,
                         multi_tensor_adam_param_remainder=tex.multi_tensor_adam_param_remainder)
    tex.multi_tensor_adam = multi_tensor_adam
    tex.multi_tensor_adam_param_remainder = multi_tensor_adam_param_remainder
