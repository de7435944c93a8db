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
* `dup`: one tensor stored under several HF names (DeepSeek-V3's MTP layers repeat the embedding
  and the output layer; Nemotron-H, which never ties, stores a tied embedding as lm_head too);
  reading them back, the copies must be equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ucp.errors import UCPError


@dataclass(frozen=True)
class Heads:
    """Attention geometry: `heads` query heads in `groups` query groups of `head_dim` each."""

    heads: int
    groups: int
    head_dim: int

    @property
    def per_group(self) -> int:
        return self.heads // self.groups

    @classmethod
    def of(cls, cfg: dict) -> Heads:
        """The geometry of a megatron model config (manifest `model`, or a name map's model)."""
        heads = cfg["num_attention_heads"]
        return cls(heads, cfg.get("num_query_groups") or heads,
                   cfg.get("kv_channels") or cfg["hidden_size"] // heads)

    def qkv_rows(self) -> tuple[int, int, int]:
        """Rows of q, k and v (HF's q_proj, k_proj, v_proj)."""
        return self.heads * self.head_dim, self.groups * self.head_dim, self.groups * self.head_dim


Shape = tuple[int, ...]


def hf_shapes(kind: str, shape: Shape, heads: Heads, count: int = 1) -> list[Shape]:
    """The shapes of the HF tensors `split` makes of a universal tensor of `shape` (`count`: the
    number of HF names of a `dup`)."""
    rest = tuple(shape[1:])
    if kind in ("copy", "qkv_cat", "gate_up_mix"):
        return [tuple(shape)]
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
