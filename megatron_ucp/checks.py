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

from megatron_ucp import formats, storage, te_state
from megatron_ucp.errors import UCPError
from megatron_ucp.formats import manifest as mf
from megatron_ucp.storage import location


def verify(path: str | Path) -> str:
    """Checksums of every tensor and exact coverage of every parameter; raises UCPError. Saves
    that never committed (`.iter_*.partial` under a save root) are reported."""
    if not mf.is_checkpoint(path):
        try:
            fmt = formats.detect(path)
        except UCPError:
            fmt = None  # (open_megatron_ucp below says what the path lacks)
        if fmt is not None:
            raise UCPError(f"{path}: a {fmt} checkpoint carries no checksums, so verify (which checks "
                           "megatron-ucp's own checkpoints) has nothing to check; `megatron-ucp "
                           "inspect` reads its metadata, `convert` reads every tensor")
    source = formats.open_megatron_ucp(path, verify_checksums=True)
    n = source.verify()
    m = source.manifest
    fp8 = te_state.source_states(source, verify_checksums=True)  # (each tensor's crc32 checked)
    fp8_note = f", FP8 state of {len(fp8)} modules verified" if fp8 else ""
    kind = f"{m.kind}, weights only (no optimizer state)" if m.weights_only else m.kind
    report = (f"OK {source.dir}: {kind}, iteration {m.iteration}, {len(m.params)} "
              f"parameters, {n} tensors verified{fp8_note}, {source.bytes_read / 2**20:.2f} MiB read")
    root = location(path)
    stale = storage.interrupted_saves(root, mf.MANIFEST) if root != source.dir else []
    if stale:
        report += (f"; {len(stale)} interrupted save(s) under {path} ({', '.join(p.name for p in stale)}):"
                   " never loaded, removed by the next save")
    uploads = storage.incomplete_uploads(root)  # a killed writer's, billed until aborted (a store's)
    if uploads:
        report += (f"; {len(uploads)} incomplete multipart upload(s) under {path} "
                   f"({', '.join(u.path.key for u in uploads[:5])}): aborted by the next save")
    return report


@dataclass
class Difference:
    """One row of a diff: a tensor's largest differences, or something only one side has
    (`missing`: the parameter or state is absent from that side; its differences are infinite)."""

    name: str
    state: str  # an optimizer state, "step" (the parameter's Adam step) or "-" (the parameter)
    max_abs: float
    max_rel: float
    note: str = ""
    missing: str = ""  # "A" or "B": the side that lacks this parameter or state

    def differs(self, atol: float = 0.0, rtol: float = 0.0) -> bool:
        return bool(self.missing) or not (self.max_abs <= atol or self.max_rel <= rtol)


def _row(name: str, state: str, a: torch.Tensor | float, b: torch.Tensor | float,
         note: str = "") -> Difference:
    d = (torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs()
    rel = d / torch.as_tensor(a, dtype=torch.float64).abs().clamp_min(torch.finfo(torch.float32).tiny)
    if d.numel() == 0:
        return Difference(name, state, 0.0, 0.0, note)
    return Difference(name, state, float(d.max()), float(rel.max()), note)


def _missing(name: str, state: str, a_has: bool) -> Difference:
    side = "B" if a_has else "A"
    return Difference(name, state, math.inf, math.inf, f"missing in {side}", missing=side)


def diff(a: str | Path, b: str | Path, trust_pickle: bool = False) -> list[Difference]:
    """Compare two checkpoints of any formats and layouts: the iteration, the set of parameters,
    the set of states of each parameter, each parameter's Adam step, and the max abs/rel
    difference of every tensor both hold (vocab rows: the common rows only). Whatever one side
    lacks is a `missing` row. Values are compared as stored: checksums are `verify`'s job. A
    weights-only checkpoint's optimizer states are the zeros a load gives (the row says so)."""
    sa = formats.open_source(a, verify_checksums=False, progress=False, trust_pickle=trust_pickle)
    sb = formats.open_source(b, verify_checksums=False, progress=False, trust_pickle=trust_pickle)
    ma, mb = sa.manifest, sb.manifest
    pa, pb = ma.params, mb.params
    out = [_row("(checkpoint)", "iteration", ma.iteration, mb.iteration,
                f"iteration {ma.iteration} vs {mb.iteration}")]
    out += [_missing(n, "-", n in pa) for n in sorted(set(pa) ^ set(pb))]
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
        step_a, step_b = sa.step(name), sb.step(name)
        out.append(_row(name, "step", step_a, step_b, f"step {step_a:g} vs {step_b:g}"))
        states_a, states_b = pa[name].states, pb[name].states
        out += [_missing(name, s, s in states_a) for s in sorted(set(states_a) ^ set(states_b))]
        for state in (s for s in states_a if s in states_b):
            ta = sa.read(name, state, (0,) * len(shape), shape)
            tb = sb.read(name, state, (0,) * len(shape), shape)
            fresh = [side for side, m in (("A", ma), ("B", mb)) if m.weights_only and state != "param"]
            zero = f"zero: weights only in {' and '.join(fresh)}" if fresh else ""
            out.append(_row(name, state, ta, tb, "; ".join(x for x in (note, zero) if x)))
    return out + _fp8_rows(sa, sb)


def _fp8_rows(sa, sb) -> list[Difference]:
    """Transformer Engine FP8 state: per module its recipe (a differing recipe is an infinite row)
    and each scale / amax history tensor."""
    fa, fb = te_state.source_states(sa), te_state.source_states(sb)
    out = [_missing(n, "fp8", n in fa) for n in sorted(set(fa) ^ set(fb))]
    for name in sorted(set(fa) & set(fb)):
        a, b = fa[name], fb[name]
        if a.recipe != b.recipe:
            out.append(Difference(name, "recipe", math.inf, math.inf,
                                  f"FP8 recipe {a.recipe} vs {b.recipe}"))
            continue
        out += [_missing(name, k, k in a.tensors) for k in sorted(set(a.tensors) ^ set(b.tensors))]
        for k in sorted(set(a.tensors) & set(b.tensors)):
            if a.tensors[k].shape != b.tensors[k].shape:
                out.append(Difference(name, k, math.inf, math.inf,
                                      f"shape {list(a.tensors[k].shape)} vs {list(b.tensors[k].shape)}"))
            else:
                out.append(_row(name, k, a.tensors[k], b.tensors[k]))
    return out


def format_diff(rows: list[Difference], atol: float = 0.0, rtol: float = 0.0) -> str:
    """The rows as a table, then a summary line that names what only one side has."""
    lines = [f"{'parameter':<62} {'state':<10} {'max abs':>10} {'max rel':>10}  note"]
    for r in rows:
        lines.append(f"{r.name:<62} {r.state:<10} {r.max_abs:>10.3e} {r.max_rel:>10.3e}  {r.note}")
    missing = [r for r in rows if r.missing]
    for side in ("A", "B"):
        lost = [f"{r.name}/{r.state}" if r.state != "-" else r.name for r in missing if r.missing == side]
        if lost:
            lines.append(f"missing in {side} ({len(lost)}): {', '.join(lost[:8])}"
                         + (" ..." if len(lost) > 8 else ""))
    compared = [r for r in rows if not r.missing]
    worst = max((r.max_abs for r in compared), default=0.0)
    differing = sum(r.differs(atol, rtol) for r in rows)
    verdict = "identical" if not differing and worst == 0 else (
        "within tolerance" if not differing else f"{differing} rows differ")
    lines.append(f"{len(rows)} rows; largest abs difference {worst:.3e}; {verdict}")
    return "\n".join(lines)
