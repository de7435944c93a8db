"""Gated DeltaNet layers (megatron-core's `GatedDeltaNet`, Qwen3-Next's linear attention) on CPU runs.

What it replaces: megatron-core's GatedDeltaNet computes with the `fla` package (flash-linear-
attention: Triton kernels, CUDA only) and refuses to build without it (`HAVE_FLA` false: ImportError).
On import, where fla is missing, this module puts in place of its three functions plain PyTorch
math of the same definitions:

- `l2norm` (fla.modules.l2norm): x / sqrt(sum(x^2) + eps) over the last dim, in fp32;
- `chunk_gated_delta_rule` (fla.ops.gated_delta_rule): the gated delta rule as its recurrence, one
  token at a time (transformers' `torch_recurrent_gated_delta_rule` of Qwen3-Next computes the
  same): per head the state S (dk x dv) decays by exp(g_t), then S += k_t (beta_t (v_t - S^T k_t))^T,
  and the output is S^T q_t scaled by dk^-1/2;
- `causal_conv1d` (fla.modules.convolution, megatron-core 0.19's conv path): the depthwise causal
  convolution of [batch, seq, channels] with its SiLU, as torch's conv1d (0.16 calls torch's conv1d
  itself where causal_conv1d is missing).

Every parameter is megatron-core's own (in_proj, conv1d, A_log, dt_bias, out_norm, out_proj), built
by GatedDeltaNet itself; only the arithmetic differs (a recurrence instead of fused chunked kernels).
Training runs only: no initial or final states (inference), no packed sequences (cu_seqlens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_ucp.mcore_compat import gdn_modules


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6, output_dtype=None) -> torch.Tensor:
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).sum(dim=dim, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


def _training_only(initial_state, output_final_state, cu_seqlens) -> None:
    if initial_state is not None or output_final_state or cu_seqlens is not None:
        raise NotImplementedError("megatron_ucp.testing.gdn_cpu: recurrent states (inference) and "
                                  "packed sequences need the real fla kernels")


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **unused):
    """q, k [b, s, h, dk], v [b, s, h, dv], g and beta [b, s, h] -> ([b, s, h, dv], None)."""
    _training_only(initial_state, output_final_state, cu_seqlens)
    dtype = q.dtype
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q, k, v, g, beta = (t.float().transpose(1, 2) for t in (q, k, v, g, beta))  # heads first
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    state = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1])
    out = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        delta = (v[:, :, t] - (state * k[:, :, t, :, None]).sum(-2)) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        out.append((state * q[:, :, t, :, None]).sum(-2))
    return torch.stack(out, dim=2).transpose(1, 2).contiguous().to(dtype), None


def causal_conv1d(x, weight, bias=None, activation=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, **unused):
    """x [b, s, d], weight [d, w] -> ([b, s, d], None)."""
    _training_only(initial_state, output_final_state, cu_seqlens)
    seq, width = x.shape[1], weight.shape[-1]
    out = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1, groups=x.shape[-1])
    out = out[..., :seq]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    return out.transpose(1, 2), None


def install() -> None:
    """Put the functions above in megatron-core's GatedDeltaNet modules, where fla is missing."""
    flags, kernel, _ = gdn_modules()
    if flags.HAVE_FLA:
        return
    flags.l2norm, kernel.chunk_gated_delta_rule = l2norm, chunk_gated_delta_rule
    if hasattr(kernel, "causal_conv1d"):  # (0.19; 0.16 convolves with torch without causal_conv1d)
        kernel.causal_conv1d = causal_conv1d
    flags.HAVE_FLA = True


install()
