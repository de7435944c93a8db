"""Metadata at scale: the save's fragment index and one load plan for thousands of ranks, no processes.

    .venv/bin/python bench/bench_plan.py --ranks 4096 --tensors 20000 --json out/plan.json

A synthetic GPT-like model (columns-, row-parallel and replicated tensors, 10 per layer, plus the
vocab embedding on the first stage) at TP x PP x DP = --tp x --pp x (ranks / tp / pp). Each rank's
fragment records are generated as `megatron_ucp.save` makes them: the DistributedOptimizer splits
the flat buffer of each (TP, PP) position's local parameters into DP contiguous ranges; only the
canonical copy of a TP-replicated tensor (TP rank 0) is saved; specs come from DP rank 0 only.

Timed with the library's own code:
- save_index_s: rank 0's `merge_specs` + `build_index` over every rank's records (the exact-tiling
  check included) and the manifest's JSON encoding;
- load_plan_s: `FragmentSource` over the index, then `loader.read_local` for every region one rank
  needs (its DP range of each local tensor), with a reader that records which files it would open
  and returns zeros instead of reading bytes.
files_opened_per_rank is compared with files_holding_rank_bytes, counted from the synthetic
partition itself. Peak memory: the process's RSS high-water mark over the whole run (it holds
every rank's synthetic records at once), and the part of it that importing torch and megatron-core
takes.
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_ucp.formats import manifest as mf  # noqa: E402
from megatron_ucp.formats.fragments import FragmentSource, build_index, merge_specs  # noqa: E402
from megatron_ucp.formats.manifest import Manifest, paused_gc  # noqa: E402
from megatron_ucp.layout import Layout  # noqa: E402
from megatron_ucp.local_slice import read_local  # noqa: E402
from megatron_ucp.param_spec import LocalParam  # noqa: E402
from megatron_ucp.spec import ParamSpec, Piece  # noqa: E402
from megatron_ucp.storage import Reader  # noqa: E402

RSS_AFTER_IMPORTS_MIB = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # torch, megatron-core

H = 64  # hidden size of the synthetic layers (shapes only matter for the pieces)
LAYER = [  # (suffix, shape, tp_axis): 10 tensors per layer
    ("self_attention.linear_qkv.layer_norm_weight", (H,), None),
    ("self_attention.linear_qkv.weight", (3 * H, H), 0),
    ("self_attention.linear_qkv.bias", (3 * H,), 0),
    ("self_attention.linear_proj.weight", (H, H), 1),
    ("self_attention.linear_proj.bias", (H,), None),
    ("mlp.linear_fc1.layer_norm_weight", (H,), None),
    ("mlp.linear_fc1.weight", (4 * H, H), 0),
    ("mlp.linear_fc1.bias", (4 * H,), 0),
    ("mlp.linear_fc2.weight", (H, 4 * H), 1),
    ("mlp.linear_fc2.bias", (H,), None),
]


def model(tensors: int, pp: int, vocab: int) -> list[list[tuple[str, tuple, int | None]]]:
    """Per pipeline stage: (name, global shape, tp_axis) of its tensors, ~`tensors` in all."""
    layers = max(pp, (tensors - 1) // len(LAYER))
    per_stage = layers // pp
    stages = []
    for s in range(pp):
        out = [("embedding.word_embeddings.weight", (vocab, H), 0)] if s == 0 else []
        for layer in range(s * per_stage, (s + 1) * per_stage):
            out += [(f"decoder.layers.{layer}.{suffix}", shape, axis) for suffix, shape, axis in LAYER]
        stages.append(out)
    return stages


def local_piece(shape: tuple, axis: int | None, tp: int, t: int) -> tuple[tuple, Piece]:
    if axis is None:
        return shape, Piece.rows(0, (0,) * len(shape), shape)
    local = list(shape)
    local[axis] //= tp
    offset = [0] * len(shape)
    offset[axis] = t * local[axis]
    strides = tuple(math.prod(local[d + 1:]) for d in range(len(local)))
    return tuple(local), Piece(0, tuple(offset), tuple(local), strides)


def rank_records(stage: list, tp: int, t: int, dp: int, d: int) -> tuple[list, list]:
    """(records, needs) of rank (t, d) of a stage: its saved fragments, and the regions it needs
    at load time at the same layout: (name, local shape, piece, start, end) of its DP range."""
    sizes = [math.prod(local_piece(shape, axis, tp, t)[0]) for _, shape, axis in stage]
    total = sum(sizes)
    lo, hi = d * total // dp, (d + 1) * total // dp
    records, needs, base = [], [], 0
    for (name, shape, axis), n in zip(stage, sizes):
        a, b = max(lo, base), min(hi, base + n)
        if b > a:
            local, piece = local_piece(shape, axis, tp, t)
            needs.append((name, local, piece, a - base, b - base))
            if axis is not None or t == 0:  # TP-replicated tensors: saved by TP rank 0 only
                records.append((name, list(local), [piece.to_json()], a - base, b - base, 100.0))
        base += n
    return records, needs


class PlanReader(Reader):
    """Records which files a load would open; returns zeros instead of reading, and each file's
    header records (which the reader checks the index against) from the index itself."""

    def __init__(self, lengths: dict[tuple[Path, str], int], headers: dict[Path, list]) -> None:
        super().__init__()
        self.lengths = lengths
        self.headers = headers

    def metadata(self, path: Path) -> dict[str, str]:
        self.open(path)
        return {"fragments": json.dumps(self.headers.get(Path(path), []))}

    def open(self, path: Path):
        self.handles[Path(path)] = None
        return None

    def read(self, path: Path, key: str, index=None) -> torch.Tensor:
        self.open(path)
        if index is None:
            return torch.zeros(self.lengths[(Path(path), key.rsplit("/", 1)[0])])
        return torch.zeros(index[0].stop - index[0].start)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--tensors", type=int, default=20000)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--pp", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--load-rank", type=int, default=None, help="the rank whose load plan is timed")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    tp, pp = args.tp, args.pp
    dp = args.ranks // (tp * pp)
    if dp * tp * pp != args.ranks:
        raise SystemExit(f"--ranks {args.ranks} is not a multiple of TP*PP={tp * pp}")
    stages = model(args.tensors, pp, args.vocab)
    n_tensors = sum(len(s) for s in stages)

    # what each rank sends rank 0 (rank = (pp, dp, tp) order does not matter for the index)
    t0 = time.perf_counter()
    gathered, rank_of = [], {}
    for s, stage in enumerate(stages):
        for d in range(dp):
            for t in range(tp):
                records, _ = rank_records(stage, tp, t, dp, d)
                specs = None
                if d == 0:
                    specs = [ParamSpec(n, shape, "bfloat16", axis).to_json() for n, shape, axis in stage]
                rank_of[(s, d, t)] = len(gathered)
                gathered.append((specs, records))
    gen_s = time.perf_counter() - t0
    gathered_bytes = sum(len(pickle.dumps(g)) for g in gathered)

    t0 = time.perf_counter()
    with paused_gc():  # as the save does on rank 0
        specs = merge_specs([g[0] for g in gathered])
        t1 = time.perf_counter()
        params = build_index(specs, [g[1] for g in gathered])
    t2 = time.perf_counter()
    manifest = Manifest.fragments(iteration=0, layout=Layout(tp=tp, pp=pp, dp=dp),
                                  world_size=args.ranks, model={}, optimizer={"param_groups": []},
                                  scheduler=None, extra={}, seed=0)
    manifest.params = params
    text = mf.encode(manifest)  # what the save writes
    save_index_s = time.perf_counter() - t0
    save_parts = {"merge_specs_s": t1 - t0, "build_index_s": t2 - t1,
                  "manifest_json_s": time.perf_counter() - t2}
    n_fragments = sum(len(g[1]) for g in gathered)
    del gathered

    # one rank's load plan at the same layout
    load_rank = args.load_rank if args.load_rank is not None else rank_of[(pp // 2, dp // 2, tp - 1)]
    (s, d, t) = next(k for k, v in rank_of.items() if v == load_rank)
    _, needs = rank_records(stages[s], tp, t, dp, d)
    ckpt = Path(tempfile.gettempdir()) / "ucp_plan"
    paths = [ckpt / f for f in manifest.files]
    lengths = {(paths[f.file], name): f.end - f.start for name, p_ in params.items()
               for sl in p_.slices for f in sl.fragments}
    headers: dict[Path, list] = {}
    for name, p_ in params.items():
        for sl in p_.slices:
            pieces = [pc.to_json() for pc in sl.pieces]
            for f in sl.fragments:
                headers.setdefault(paths[f.file], []).append(
                    {"name": name, "range": [f.start, f.end], "local_shape": list(sl.local_shape),
                     "pieces": pieces, "crc32": {}})
    del params, manifest
    t0 = time.perf_counter()
    with paused_gc():  # as manifest.read does
        manifest = Manifest.from_json(json.loads(text), str(ckpt / mf.MANIFEST))
    t1 = time.perf_counter()
    source = FragmentSource(ckpt, manifest, verify_checksums=False)
    source.reader = reader = PlanReader(lengths, headers)
    t2 = time.perf_counter()
    for name, local, piece, a, b in needs:
        spec = ParamSpec(name, manifest.params[name].shape, "bfloat16", manifest.params[name].spec.tp_axis)
        lp = LocalParam(spec, torch.empty(local, device="meta"), 0, name, [piece], True)
        read_local(source, lp, "param", a, b)
    load_plan_s = time.perf_counter() - t0
    load_parts = {"manifest_parse_s": t1 - t0, "fragment_source_s": t2 - t1,
                  "read_plan_s": time.perf_counter() - t2}
    # ground truth: the ranks that saved elements [a, b) of the rank's tensors (its own position,
    # and TP rank 0's for TP-replicated tensors, whose DP ranges line up with this rank's)
    holding = {rank_of[(s, d, t)]} | ({rank_of[(s, d, 0)]} if any(
        dict((n, ax) for n, _, ax in stages[s])[name] is None for name, *_ in needs) else set())
    opened = {ckpt / f for f in manifest.files}
    files_opened = len([f for f in reader.handles if f in opened])

    res = {"ranks": args.ranks, "layout": f"TP{tp}xPP{pp}xDP{dp}", "tensors": n_tensors,
           "fragments": n_fragments, "gathered_metadata_mib": gathered_bytes / 2**20,
           "manifest_mib": len(text) / 2**20, "generate_s": gen_s,
           "save_index_s": save_index_s, **save_parts, "load_plan_s": load_plan_s, **load_parts,
           "load_rank": load_rank,
           "files_opened_per_rank": files_opened, "files_holding_rank_bytes": len(holding),
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "rss_after_imports_mib": RSS_AFTER_IMPORTS_MIB}
    for k, v in res.items():
        print(f"{k:26s} {v:.3f}" if isinstance(v, float) else f"{k:26s} {v}")
    print("goals: save_index_s < 2, load_plan_s < 2, peak_rss_mib < 500, files_opened_per_rank == "
          "files_holding_rank_bytes (+ the manifest)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
