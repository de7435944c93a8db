"""Element order of fused megatron-core tensors versus their layout in other frameworks (Hugging
Face transformers, DeepSpeed runs of HF-style modules): shared by the formats that convert them.

Each transform maps one universal tensor (megatron-core's element order, docs/FORMAT.md) to the
tensors that hold the same numbers in the other layout (`split`), back (`join`), and says their
shapes without touching data (`hf_shapes`), so writers can lay out their files before reading
anything. (`formats/hf/transforms.py` holds the same table for the HF format; it is to re-export
this module.)

* `copy`: the same tensor.
* `conv1d`: HF GPT-2's Conv1D stores `[in, out]`, megatron's linear `[out, in]`: a transpose.
* `qkv`: megatron's fused `linear_qkv` rows per query group `[q heads of group g; k_g; v_g]`
  (x head_dim) -> separate `q_proj`, `k_proj`, `v_proj` (GQA; weight or bias).
* `qkv_cat`: the same rows as one `[q; k; v]` tensor (GPT-2's `c_attn` bias).
* `qkv_conv1d`: `qkv_cat`, transposed (GPT-2's `c_attn` weight).
* `gate_up`: SwiGLU `linear_fc1` `[gate; up]` -> `gate_proj`, `up_proj` (Mixtral: `w1`, `w3`).
* `transpose`: megatron's `[out, in]` -> `[in, out]` (GPT-OSS's experts compute `x @ W`).
* `gate_up_mix_t`: `linear_fc1` `[gate; up]` -> GPT-OSS's `gate_up_proj` `[in, 2 * ffn]`, whose
  columns alternate gate, up, gate, up (`gate_up[..., ::2]` is the gate); `gate_up_mix` the same
  for the bias.
* `qgkv`: megatron's fused `linear_qkv` of gated attention (`attention_output_gate`), rows per
  query group `[q heads of group g; their gates; k_g; v_g]` -> `q_proj` with each head's query
  and gate interleaved (`[q_h; gate_h]` per head: HF Qwen3-Next), `k_proj`, `v_proj`.
* `gdn_in_proj`: megatron-core's GatedDeltaNet `in_proj` `[q; k; v; z; beta; alpha]` (each over
  all heads) -> HF Qwen3-Next's `in_proj_qkvz` (rows per key head g: `[q_g; k_g; v; z]` of the
  value heads it serves) and `in_proj_ba` (per key head: `[beta; alpha]` of those value heads).
* `plus_one`: the HF tensor is the universal one plus 1 (HF Qwen3-Next's gated output norm
  scales by its weight, megatron-core's zero-centered norm by 1 + weight).
* `dup`: one tensor stored under several HF names (DeepSeek-V3's MTP layers repeat the embedding
  and the output layer; Nemotron-H, which never ties, stores a tied embedding as lm_head too);
  reading them back, the copies must be equal.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from megatron_ucp.errors import UCPError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Heads:
    """Attention geometry: `heads` query heads in `groups` query groups of `head_dim` each."""

    heads: int
    groups: int
    head_dim: int
    # a GatedDeltaNet's (linear attention) key and value heads and their dims (0: none)
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0

    @property
    def per_group(self) -> int:
        return self.heads // self.groups

    @classmethod
    def of(cls, cfg: dict) -> Heads:
        """The geometry of a megatron model config (manifest `model`, or a name map's model)."""
        heads = cfg["num_attention_heads"]
        linear = (cfg.get("linear_num_key_heads"), cfg.get("linear_num_value_heads"),
                  cfg.get("linear_key_head_dim"), cfg.get("linear_value_head_dim"))
        if cfg.get("experimental_attention_variant") != "gated_delta_net" or None in linear:
            linear = (0, 0, 0, 0)
        return cls(heads, cfg.get("num_query_groups") or heads,
                   cfg.get("kv_channels") or cfg["hidden_size"] // heads, *linear)

    def qgkv_rows(self) -> tuple[int, int, int]:
        """Rows of gated attention's q_proj (queries and gates), k_proj, v_proj."""
        q, k, v = self.qkv_rows()
        return 2 * q, k, v

    def gdn_rows(self) -> tuple[int, int]:
        """Rows of a GatedDeltaNet's in_proj_qkvz and in_proj_ba."""
        qk, v = self.linear_k_heads * self.linear_k_dim, self.linear_v_heads * self.linear_v_dim
        return 2 * qk + 2 * v, 2 * self.linear_v_heads

    def qkv_rows(self) -> tuple[int, int, int]:
        """Rows of q, k and v (HF's q_proj, k_proj, v_proj)."""
        return self.heads * self.head_dim, self.groups * self.head_dim, self.groups * self.head_dim


Shape = tuple[int, ...]


def hf_shapes(kind: str, shape: Shape, heads: Heads, count: int = 1) -> list[Shape]:
    """The shapes of the HF tensors `split` makes of a universal tensor of `shape` (`count`: the
    number of HF names of a `dup`)."""
    rest = tuple(shape[1:])
    if kind in ("copy", "qkv_cat", "gate_up_mix", "plus_one"):
        return [tuple(shape)]
    if kind == "qgkv":
        return [(rows, *rest) for rows in heads.qgkv_rows()]
    if kind == "gdn_in_proj":
        return [(rows, *rest) for rows in heads.gdn_rows()]
    if kind == "dup":
        return [tuple(shape)] * count
    if kind in ("conv1d", "qkv_conv1d", "transpose", "gate_up_mix_t"):
        return [tuple(reversed(shape))]
    if kind == "qkv":
        return [(rows, *rest) for rows in heads.qkv_rows()]
    if kind == "gate_up":
        return [(shape[0] // 2, *rest)] * 2
    raise ValueError(f"unknown transform {kind!r}")


def check_qkv_rows(rows: int, heads: Heads, what: str) -> None:
    """A fused QKV tensor of `rows` rows fits the attention geometry."""
    need = sum(heads.qkv_rows())
    if rows != need:
        raise UCPError(f"{what}: fused QKV has {rows} rows; {heads.heads} heads in "
                       f"{heads.groups} query groups of {heads.head_dim} need {need}")


def _per_group(t: torch.Tensor, heads: Heads) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of a fused megatron QKV tensor, each with the groups' rows in group order."""
    g, d, n = heads.groups, heads.head_dim, heads.per_group
    grouped = t.reshape(g, (n + 2) * d, *t.shape[1:])
    q, k, v = grouped.split([n * d, d, d], dim=1)
    return (q.reshape(g * n * d, *t.shape[1:]), k.reshape(g * d, *t.shape[1:]),
            v.reshape(g * d, *t.shape[1:]))


def _gated_per_group(t: torch.Tensor, heads: Heads, what: str) -> list[torch.Tensor]:
    """q_proj (each head's query then its gate), k_proj, v_proj of a gated fused QKV tensor."""
    need = sum(heads.qgkv_rows())
    if t.shape[0] != need:
        raise UCPError(f"{what}: gated fused QKV has {t.shape[0]} rows; {heads.heads} heads in "
                       f"{heads.groups} query groups of {heads.head_dim} with their gates need {need}")
    g, d, n, rest = heads.groups, heads.head_dim, heads.per_group, tuple(t.shape[1:])
    q, gate, k, v = t.reshape(g, (2 * n + 2) * d, *rest).split([n * d, n * d, d, d], dim=1)
    q_proj = torch.stack([q.reshape(g * n, d, *rest), gate.reshape(g * n, d, *rest)], dim=1)
    return [q_proj.reshape(2 * g * n * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest)]


def _gated_join(parts: list[torch.Tensor], heads: Heads) -> torch.Tensor:
    q_proj, k, v = parts
    g, d, n, rest = heads.groups, heads.head_dim, heads.per_group, tuple(q_proj.shape[1:])
    q, gate = q_proj.reshape(g * n, 2, d, *rest).unbind(1)
    fused = torch.cat([q.reshape(g, n * d, *rest), gate.reshape(g, n * d, *rest),
                       k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
    return fused.reshape(g * (2 * n + 2) * d, *rest)


def _gdn_sizes(heads: Heads) -> tuple[int, int, int, int]:
    """Key heads, value heads per key head, and one key head's q (or k) and v rows."""
    nk, nv = heads.linear_k_heads, heads.linear_v_heads
    return nk, nv // nk, heads.linear_k_dim, nv // nk * heads.linear_v_dim


def _gdn_split(t: torch.Tensor, heads: Heads, what: str) -> list[torch.Tensor]:
    """in_proj_qkvz, in_proj_ba of a GatedDeltaNet in_proj [q; k; v; z; beta; alpha]."""
    if not heads.linear_k_heads or t.shape[0] != sum(heads.gdn_rows()):
        raise UCPError(f"{what}: GatedDeltaNet in_proj has {t.shape[0]} rows; the model's "
                       f"{heads.linear_k_heads} key heads of {heads.linear_k_dim} and "
                       f"{heads.linear_v_heads} value heads of {heads.linear_v_dim} need "
                       f"{sum(heads.gdn_rows()) if heads.linear_k_heads else 'a linear-attention geometry'}")
    nk, r, qk, v = _gdn_sizes(heads)
    rest = tuple(t.shape[1:])
    q, k, vv, z, b, a = t.split([nk * qk, nk * qk, nk * v, nk * v, nk * r, nk * r], dim=0)
    qkvz = torch.cat([x.reshape(nk, -1, *rest) for x in (q, k, vv, z)], dim=1)
    ba = torch.cat([x.reshape(nk, r, *rest) for x in (b, a)], dim=1)
    return [qkvz.reshape(-1, *rest), ba.reshape(-1, *rest)]


def _gdn_join(parts: list[torch.Tensor], heads: Heads, what: str) -> torch.Tensor:
    qkvz, ba = parts
    if not heads.linear_k_heads or (qkvz.shape[0], ba.shape[0]) != heads.gdn_rows():
        raise UCPError(f"{what}: in_proj_qkvz / in_proj_ba have {qkvz.shape[0]} / {ba.shape[0]} rows; "
                       f"the linear-attention geometry needs {heads.gdn_rows()}")
    nk, r, qk, v = _gdn_sizes(heads)
    rest = tuple(qkvz.shape[1:])
    q, k, vv, z = qkvz.reshape(nk, 2 * qk + 2 * v, *rest).split([qk, qk, v, v], dim=1)
    b, a = ba.reshape(nk, 2 * r, *rest).split([r, r], dim=1)
    return torch.cat([x.reshape(-1, *rest) for x in (q, k, vv, z, b, a)], dim=0)


def _gate_up_rows(t: torch.Tensor, what: str) -> int:
    if t.shape[0] % 2:
        raise UCPError(f"{what}: SwiGLU linear_fc1 has an odd number of rows ({t.shape[0]})")
    return t.shape[0] // 2


def split(kind: str, t: torch.Tensor, heads: Heads, what: str = "tensor",
          count: int = 1) -> list[torch.Tensor]:
    """The HF tensors (contiguous) holding the numbers of universal tensor `t`."""
    if kind == "copy":
        out = [t]
    elif kind == "dup":
        out = [t] * count
    elif kind in ("conv1d", "transpose"):
        out = [t.t()]
    elif kind == "plus_one":
        out = [t + 1]
    elif kind == "qgkv":
        out = _gated_per_group(t, heads, what)
    elif kind == "gdn_in_proj":
        out = _gdn_split(t, heads, what)
    elif kind in ("gate_up_mix", "gate_up_mix_t"):  # rows [gate; up] -> gate, up alternating
        ffn = _gate_up_rows(t, what)
        mixed = t.reshape(2, ffn, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
        out = [mixed.t() if kind == "gate_up_mix_t" else mixed]
    elif kind in ("qkv", "qkv_cat", "qkv_conv1d"):
        check_qkv_rows(t.shape[0], heads, what)
        out = list(_per_group(t, heads))
        if kind != "qkv":
            out = [torch.cat(out, dim=0)]
        if kind == "qkv_conv1d":
            out = [out[0].t()]
    elif kind == "gate_up":
        _gate_up_rows(t, what)
        out = list(t.chunk(2, dim=0))
    else:
        raise ValueError(f"unknown transform {kind!r}")
    return [x.contiguous() for x in out]


def join(kind: str, parts: list[torch.Tensor], heads: Heads, what: str = "tensor") -> torch.Tensor:
    """The universal tensor whose `split` gives `parts` (the inverse of `split`)."""
    if kind == "copy":
        return parts[0].contiguous()
    if kind == "dup":
        for p in parts[1:]:
            if not torch.equal(p, parts[0]):
                raise UCPError(f"{what}: the HF checkpoint's copies of this tensor differ; they "
                               "must be one tensor (the MTP layers share the main model's; a tied "
                               "Nemotron-H stores its embedding as lm_head too)")
        return parts[0].contiguous()
    if kind in ("conv1d", "transpose"):
        return parts[0].t().contiguous()
    if kind == "plus_one":
        out = (parts[0] - 1).contiguous()
        inexact = int((out + 1 != parts[0]).sum())
        if inexact:  # (x - 1 is exact for x in [0.5, 2]; megatron-core computes 1 + w all the same)
            log.warning("%s: %d of %d values w of the HF tensor are not 1 + (w - 1) in %s: the zero-centered "
                        "weight megatron-core holds rounds them (export-hf writes 1 + (w - 1))",
                        what, inexact, out.numel(), out.dtype)
        return out
    if kind == "qgkv":
        if tuple(p.shape[0] for p in parts) != heads.qgkv_rows():
            raise UCPError(f"{what}: q_proj / k_proj / v_proj have {[p.shape[0] for p in parts]} rows; "
                           f"gated attention of {heads.heads} heads in {heads.groups} query groups of "
                           f"{heads.head_dim} needs {list(heads.qgkv_rows())}")
        return _gated_join(parts, heads)
    if kind == "gdn_in_proj":
        return _gdn_join(parts, heads, what)
    if kind in ("gate_up_mix", "gate_up_mix_t"):
        t = parts[0].t() if kind == "gate_up_mix_t" else parts[0]
        ffn = _gate_up_rows(t, what)
        return t.reshape(ffn, 2, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()
    if kind == "gate_up":
        return torch.cat(parts, dim=0)
    if kind in ("qkv_cat", "qkv_conv1d"):
        t = parts[0].t() if kind == "qkv_conv1d" else parts[0]
        check_qkv_rows(t.shape[0], heads, what)
        parts = list(t.split(list(heads.qkv_rows()), dim=0))
    if kind in ("qkv", "qkv_cat", "qkv_conv1d"):
        q, k, v = parts
        g, d, n = heads.groups, heads.head_dim, heads.per_group
        rest = tuple(q.shape[1:])
        fused = torch.cat([q.reshape(g, n * d, *rest), k.reshape(g, d, *rest),
                           v.reshape(g, d, *rest)], dim=1)
        return fused.reshape(g * (n + 2) * d, *rest)
    raise ValueError(f"unknown transform {kind!r}")
