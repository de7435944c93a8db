"""Mamba-2 layers of a hybrid model (megatron-core's `MambaModel`) on CPU runs.

What it replaces: megatron-core's `MambaMixer` computes with CUDA/Triton kernels of `mamba_ssm`
and `causal_conv1d`, which need a GPU to install and to import; without them megatron-core's
`mamba_mixer` module sets `HAVE_MAMBA_SSM = False` (MambaMixer then refuses to build) and derives
its gated norm `ExtendedRMSNorm` from a MagicMock. MambaStack's final norm is Transformer Engine's
`TENorm`, which raises without TE. On import, where `mamba_ssm` is missing, this module puts in
their place the packages' own pure-PyTorch reference math (mamba-ssm 2.3.2.post1,
causal-conv1d 1.7.0):

- `mamba_split_conv1d_scan_combined` (the fused training kernel, mamba_ssm/ops/triton/
  ssd_combined.py) as its reference `mamba_split_conv1d_scan_ref` computes it: split zxBCdt, causal
  depthwise conv + SiLU over xBC (`causal_conv1d_ref`, causal_conv1d/causal_conv1d_interface.py),
  the selective state-space scan with softplus(dt + dt_bias), the D skip and the SiLU(z) gate
  (`ssd_selective_scan`; its scan is computed here with `ssd_minimal_discrete`,
  mamba_ssm/modules/ssd_minimal.py, the chunked closed form of the same recurrence, which runs on
  CPU where `ssd_chunk_scan_combined_ref` gave NaNs), then the optional gated RMSNorm;
- `RMSNormGated` (mamba_ssm/ops/triton/layernorm_gated.py `RMSNorm`) computing `rms_norm_ref`, and
  megatron-core's `ExtendedRMSNorm` re-derived from it with megatron-core's own sharded_state_dict;
- MambaStack's final norm: torch's RMSNorm/LayerNorm (torch_norm.SequenceParallelTorchNorm);
- without Triton (the CPU build of torch), megatron-core 0.16's `mamba_mixer` cannot even be
  imported: it imports the Triton kernels of dynamic (batched) inference from
  `megatron.core.inference.contexts.attention_context.triton.tensor_ops` at module level. That
  module is registered (`mcore_compat.mamba_modules`) before megatron-core's Mamba modules are
  imported, as one whose functions raise: training never calls them.

Every parameter is megatron-core's own (in_proj, conv1d, dt_bias, A_log, D, norm, out_proj), built
by MambaMixer itself, so a checkpoint holds exactly what it holds on a GPU; only the arithmetic
differs (reference math instead of fused kernels). `local_mamba_stack_spec` is the hybrid stack's
layer spec with megatron-core's local (non-TE) layers, which megatron-core 0.16 does not ship
(`megatron_ucp.hybrid_spec.hybrid_stack_spec`).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from megatron_ucp.hybrid_spec import hybrid_stack_spec
from megatron_ucp.mcore_compat import mamba_modules

mamba_mixer, mamba_block = mamba_modules()  # see above (0.16 without Triton)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.extensions import transformer_engine as te_extensions  # noqa: E402
from megatron.core.models.mamba import MambaModel  # noqa: E402, F401  (for tiny_gpt)
from megatron.core.transformer.utils import (  # noqa: E402
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)

HAVE_REAL_MAMBA_SSM = bool(mamba_mixer.HAVE_MAMBA_SSM)


def segsum(x: torch.Tensor) -> torch.Tensor:
    """mamba_ssm.modules.ssd_minimal.segsum: [..., T] -> [..., T, T], exp() of it the decay from
    step j to step i (lower triangle; -inf above)."""
    t = x.size(-1)
    x = x[..., None].expand(*x.shape, t)
    x = x.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool), diagonal=-1), 0)
    out = torch.cumsum(x, dim=-2)
    return out.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool), diagonal=0), -torch.inf)


def ssd_minimal_discrete(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                         block_len: int) -> torch.Tensor:
    """mamba_ssm.modules.ssd_minimal.ssd_minimal_discrete (no initial state): the SSD scan
    y_t = C_t h_t, h_t = exp(a_t) h_{t-1} + B_t x_t in closed form per chunk of block_len steps.
    x [b, l, h, p], a [b, l, h], b and c [b, l, h, n] -> y [b, l, h, p]."""
    bsz, length = x.shape[:2]
    chunks = length // block_len

    def blocked(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(bsz, chunks, block_len, *t.shape[2:])

    x, a, b, c = blocked(x), blocked(a), blocked(b), blocked(c)
    a = a.permute(0, 3, 1, 2)  # b h c l
    a_cumsum = torch.cumsum(a, dim=-1)
    y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", c, b, torch.exp(segsum(a)), x)
    decay_states = torch.exp(a_cumsum[:, :, :, -1:] - a_cumsum)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", b, decay_states, x)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    decay_chunk = torch.exp(segsum(F.pad(a_cumsum[:, :, :, -1], (1, 0))))
    states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)[:, :-1]
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", c, states, torch.exp(a_cumsum))
    return (y_diag + y_off).reshape(bsz, length, *y_diag.shape[3:])


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      activation: str | None = None) -> torch.Tensor:
    """causal_conv1d.causal_conv1d_interface.causal_conv1d_ref (no initial/final states, no
    seq_idx): depthwise causal convolution. x [b, d, s], weight [d, w] -> [b, d, s]."""
    dtype_in, seqlen, (dim, width) = x.dtype, x.shape[-1], weight.shape
    out = F.conv1d(x.to(weight.dtype), weight.unsqueeze(1), bias, padding=width - 1, groups=dim)
    out = out[..., :seqlen]
    return (out if activation is None else F.silu(out)).to(dtype=dtype_in)


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    """causal_conv1d_fn's signature over `causal_conv1d_ref` (training: no states, no packing)."""
    if seq_idx is not None or initial_states is not None or return_final_states:
        raise NotImplementedError("megatron_ucp.testing.mamba_cpu: packed sequences and conv states "
                                  "(inference) need the real causal_conv1d")
    return causal_conv1d_ref(x, weight, bias, activation)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 z: torch.Tensor | None = None, eps: float = 1e-6, group_size: int | None = None,
                 norm_before_gate: bool = True) -> torch.Tensor:
    """mamba_ssm.ops.triton.layernorm_gated.rms_norm_ref (upcast): RMSNorm per group of
    `group_size` channels, gated by SiLU(z) before or after the norm."""
    dtype = x.dtype
    x, weight = x.float(), weight.float()
    z = z.float() if z is not None else None
    if z is not None and not norm_before_gate:
        x = x * F.silu(z)
    groups = x.reshape(*x.shape[:-1], -1, group_size or x.shape[-1])
    out = (groups * torch.rsqrt(groups.square().mean(dim=-1, keepdim=True) + eps)).reshape(x.shape) * weight
    if bias is not None:
        out = out + bias.float()
    if z is not None and norm_before_gate:
        out = out * F.silu(z)
    return out.to(dtype)


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                     return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True):
    """mamba_ssm.ops.triton.ssd_combined.mamba_split_conv1d_scan_combined, computed as its
    reference `mamba_split_conv1d_scan_ref`. zxbcdt [b, l, 2 dim + 2 ngroups dstate + nheads]."""
    if initial_states is not None or seq_idx is not None or return_final_states:
        raise NotImplementedError("megatron_ucp.testing.mamba_cpu: initial states and packed sequences "
                                  "need the real mamba_ssm")
    nheads, headdim = (D.shape[0], headdim) if D.dim() == 1 else D.shape
    bsz, seqlen, _ = zxbcdt.shape
    dim = nheads * headdim
    dstate = (zxbcdt.shape[-1] - 2 * dim - nheads) // ngroups // 2
    z, xbc, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    xbc = causal_conv1d_ref(xbc.transpose(1, 2), conv1d_weight, conv1d_bias, activation).transpose(1, 2)
    x, b, c = torch.split(xbc, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    x = x.reshape(bsz, seqlen, nheads, headdim)
    # each group's B and C serve nheads / ngroups consecutive heads
    b, c = (t.reshape(bsz, seqlen, ngroups, 1, dstate).expand(-1, -1, -1, nheads // ngroups, -1)
            .reshape(bsz, seqlen, nheads, dstate) for t in (b, c))
    # ssd_selective_scan: dt = softplus(dt + dt_bias) clamped to dt_limit, discretised A dt, B dt x
    dt = F.softplus(dt.float() + dt_bias.float()).clamp(*dt_limit)
    block = chunk_size if seqlen % chunk_size == 0 else seqlen
    y = ssd_minimal_discrete((x.float() * dt[..., None]), A.float() * dt, b.float(), c.float(), block)
    d = D.float()
    y = y + x.float() * (d[:, None] if d.dim() == 1 else d)
    y = y.reshape(bsz, seqlen, dim)
    if rmsnorm_weight is None:
        y = y * F.silu(z.float())
    else:
        y = rms_norm_ref(y, rmsnorm_weight, None, z=z, eps=rmsnorm_eps, norm_before_gate=norm_before_gate)
    y = y.to(zxbcdt.dtype)
    return F.linear(y, outproj_weight, outproj_bias) if outproj_weight is not None else y


class RMSNormGated(torch.nn.Module):
    """mamba_ssm.ops.triton.layernorm_gated.RMSNorm: weight only (ones), `rms_norm_ref`."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = True, device=None, dtype=None):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        return rms_norm_ref(x, self.weight, self.bias, z, self.eps, self.group_size, self.norm_before_gate)


class ExtendedRMSNorm(RMSNormGated):
    """megatron-core's `mamba_mixer.ExtendedRMSNorm` on the reference norm. Without mamba_ssm
    megatron-core's class derives from a MagicMock instance (so it is one, and its method is
    lost); its sharded_state_dict is restated here as megatron-core 0.16 to 0.19 write it: the
    weight split on dim 0 over TP."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        if not hasattr(self, "tp_group"):
            self.tp_group = parallel_state.get_tensor_model_parallel_group()
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"])


def _final_norm(config, hidden_size: int, eps: float = 1e-5):
    from megatron_ucp.testing.torch_norm import SequenceParallelTorchNorm

    return SequenceParallelTorchNorm(config, hidden_size, eps)


if not HAVE_REAL_MAMBA_SSM:  # see above
    mamba_mixer.mamba_split_conv1d_scan_combined = mamba_split_conv1d_scan_combined
    mamba_mixer.causal_conv1d_fn = causal_conv1d_fn
    mamba_mixer.RMSNormGated = RMSNormGated
    mamba_mixer.ExtendedRMSNorm = ExtendedRMSNorm
    mamba_mixer.HAVE_MAMBA_SSM = True
if not te_extensions.HAVE_TE:  # (megatron-core 0.19 moved MambaStack to models/hybrid/hybrid_block)
    sys.modules[mamba_block.MambaStack.__module__].TENorm = _final_norm


def local_mamba_stack_spec(normalization: str, num_experts: int | None, moe_grouped_gemm: bool = False,
                           norm=None):
    """The hybrid stack with megatron-core's local layers (`megatron_ucp.hybrid_spec.hybrid_stack_spec`,
    which the HF importer's rebuild uses too)."""
    return hybrid_stack_spec(normalization, num_experts, moe_grouped_gemm, norm)


# The `--spec` of the Megatron-LM fixtures' hybrid runs on CPU (`--spec megatron_ucp.testing.mamba_cpu
# hybrid_stack_spec_local`): the library's spec (megatron_ucp.hybrid_spec), imported here so that
# the stand-ins above are installed first.
from megatron_ucp.hybrid_spec import hybrid_stack_spec_local  # noqa: E402,F401
