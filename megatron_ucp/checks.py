"""`verify` and `diff`: is a checkpoint whole, and how far apart are two checkpoints?

Both accept any form megatron-ucp reads: its own fragment and universal directories directly,
and Megatron-LM `torch` / `torch_dist` checkpoints through the importers (into a temporary
universal directory), so two runs can be compared across formats and layouts.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_ucp import manifest as mf
from megatron_ucp.errors import UCPError
from megatron_ucp.sources import open_source


def detect(path: str | Path) -> str:
    """'fragments' | 'universal' | 'megatron_torch' | 'megatron_torch_dist'."""
    path = Path(path)
    if (path / mf.MANIFEST).exists() or (path / mf.LATEST).exists():
        return mf.read(mf.resolve(path))["kind"]
    tracker = path / "latest_checkpointed_iteration.txt"
    candidates = [path]
    if tracker.exists():
        text = tracker.read_text().strip()
        candidates.append(path / ("release" if text == "release" else f"iter_{int(text):07d}"))
    for d in candidates:
        if (d / ".metadata").exists():
            return "megatron_torch_dist"
        if any(d.glob("mp_rank_*/model_optim_rng.pt")):
            return "megatron_torch"
    raise UCPError(f"{path}: unknown checkpoint format (no megatron-ucp manifest, no Megatron-LM "
                   "tracker with mp_rank_* or .metadata); pass a checkpoint directory")


def open_any(path: str | Path, scratch: Path, verify_checksums: bool = True):
    """A source for any supported format; Megatron-LM checkpoints are imported into `scratch`."""
    kind = detect(path)
    if kind == "megatron_torch":
        from megatron_ucp.megatron_legacy import convert_legacy

        path = convert_legacy(path, scratch / "imported", progress=False)
    elif kind == "megatron_torch_dist":
        from megatron_ucp.megatron_dist import convert_torch_dist

        path = convert_torch_dist(path, scratch / "imported", progress=False)
    return open_source(path, verify_checksums)


def verify(path: str | Path) -> str:
    """Checksums of every tensor and exact coverage of every parameter; raises UCPError."""
    source = open_source(path, verify_checksums=True)
    n = source.verify()
    m = source.manifest
    return (f"OK {source.dir}: {m['kind']}, iteration {m['iteration']}, {len(m['params'])} "
            f"parameters, {n} tensors verified, {source.reader.bytes_read / 2**20:.2f} MiB read")


@dataclass
class Difference:
    name: str
    state: str
    max_abs: float
    max_rel: float
    note: str = ""


def diff(a: str | Path, b: str | Path) -> list[Difference]:
    """Max abs/rel difference per parameter and state (vocab rows: the common rows only).
    Values are compared as stored: checksums are `verify`'s job, not diff's."""
    with tempfile.TemporaryDirectory(prefix="ucp_diff_") as tmp:
        sa = open_any(a, Path(tmp) / "a", verify_checksums=False)
        sb = open_any(b, Path(tmp) / "b", verify_checksums=False)
        pa, pb = sa.manifest["params"], sb.manifest["params"]
        out = [Difference(n, "-", math.inf, math.inf, f"only in {'A' if n in pa else 'B'}")
               for n in sorted(set(pa) ^ set(pb))]
        for name in sorted(set(pa) & set(pb)):
            shape_a, shape_b = pa[name]["shape"], pb[name]["shape"]
            note = ""
            if shape_a != shape_b:
                if not (pa[name].get("vocab_rows") and shape_a[1:] == shape_b[1:]):
                    out.append(Difference(name, "-", math.inf, math.inf, f"shape {shape_a} vs {shape_b}"))
                    continue
                note = f"common vocab rows {min(shape_a[0], shape_b[0])}"
            shape = tuple(min(x, y) for x, y in zip(shape_a, shape_b))
            for state in ("param", "exp_avg", "exp_avg_sq"):
                try:
                    ta = sa.read(name, state, (0,) * len(shape), shape)
                    tb = sb.read(name, state, (0,) * len(shape), shape)
                except KeyError:
                    continue  # a buffer has no optimizer state
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
