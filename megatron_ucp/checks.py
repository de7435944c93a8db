"""`verify` and `diff`: is a checkpoint whole, and how far apart are two checkpoints?

`diff` reads any supported format through its source (megatron-ucp fragment and universal
directories, Megatron-LM `torch` / `torch_dist` checkpoints), so two runs can be compared across
formats and layouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_ucp import formats, object_store
from megatron_ucp.formats import manifest as mf
from megatron_ucp.object_store import ObjectPath
from megatron_ucp.storage import location


def verify(path: str | Path) -> str:
    """Checksums of every tensor and exact coverage of every parameter; raises UCPError. Saves
    that never committed (`.iter_*.partial` under a save root) are reported."""
    source = formats.open_megatron_ucp(path, verify_checksums=True)
    n = source.verify()
    m = source.manifest
    report = (f"OK {source.dir}: {m.kind}, iteration {m.iteration}, {len(m.params)} "
              f"parameters, {n} tensors verified, {source.bytes_read / 2**20:.2f} MiB read")
    root = location(path)
    stale = mf.interrupted_saves(root) if root != source.dir else []
    if stale:
        report += (f"; {len(stale)} interrupted save(s) under {path} ({', '.join(p.name for p in stale)}):"
                   " never loaded, removed by the next save")
    if isinstance(root, ObjectPath):  # a killed writer's multipart uploads, billed until aborted
        uploads = object_store.incomplete_uploads(root)
        if uploads:
            report += (f"; {len(uploads)} incomplete multipart upload(s) under {path} "
                       f"({', '.join(u.path.key for u in uploads[:5])}): aborted by the next save")
    return report


@dataclass
class Difference:
    name: str
    state: str
    max_abs: float
    max_rel: float
    note: str = ""


def diff(a: str | Path, b: str | Path, trust_pickle: bool = False) -> list[Difference]:
    """Max abs/rel difference per parameter and state (vocab rows: the common rows only).
    Values are compared as stored: checksums are `verify`'s job, not diff's."""
    sa = formats.open_source(a, verify_checksums=False, progress=False, trust_pickle=trust_pickle)
    sb = formats.open_source(b, verify_checksums=False, progress=False, trust_pickle=trust_pickle)
    pa, pb = sa.manifest.params, sb.manifest.params
    out = [Difference(n, "-", math.inf, math.inf, f"only in {'A' if n in pa else 'B'}")
           for n in sorted(set(pa) ^ set(pb))]
    for name in sorted(set(pa) & set(pb)):
        shape_a, shape_b = pa[name].shape, pb[name].shape
        note = ""
        if shape_a != shape_b:
            if not (pa[name].spec.vocab_rows and shape_a[1:] == shape_b[1:]):
                out.append(Difference(name, "-", math.inf, math.inf,
                                      f"shape {list(shape_a)} vs {list(shape_b)}"))
                continue
            note = f"common vocab rows {min(shape_a[0], shape_b[0])}"
        shape = tuple(min(x, y) for x, y in zip(shape_a, shape_b))
        for state in pa[name].states:
            if state not in pb[name].states:
                continue
            ta = sa.read(name, state, (0,) * len(shape), shape)
            tb = sb.read(name, state, (0,) * len(shape), shape)
            d = (ta - tb).abs()
            rel = d / ta.abs().clamp_min(torch.finfo(torch.float32).tiny)
            out.append(Difference(name, state, float(d.max()), float(rel.max()), note))
    return out


def format_diff(rows: list[Difference]) -> str:
    lines = [f"{'parameter':<62} {'state':<10} {'max abs':>10} {'max rel':>10}  note"]
    for r in rows:
        lines.append(f"{r.name:<62} {r.state:<10} {r.max_abs:>10.3e} {r.max_rel:>10.3e}  {r.note}")
    worst = max((r.max_abs for r in rows), default=0.0)
    lines.append(f"{len(rows)} rows; largest abs difference {worst:.3e}"
                 + ("; identical" if worst == 0 else ""))
    return "\n".join(lines)
