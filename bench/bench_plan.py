"""Metadata at scale: the save's fragment index and one load plan for thousands of ranks, no processes.

    .venv/bin/python bench/bench_plan.py --ranks 4096 --tensors 20000 --json out/plan.json

A synthetic GPT-like model (columns-, row-parallel and replicated tensors, 10 per layer, plus the
vocab embedding on the first stage) at TP x PP x DP = --tp x --pp x (ranks / tp / pp). Each rank's
fragment records are generated as `megatron_ucp.save` makes them: the DistributedOptimizer splits
the flat buffer of each (TP, PP) position's local parameters into DP contiguous ranges; only the
canonical copy of a TP-replicated tensor (TP rank 0) is saved; specs come from DP rank 0 only.
Each rank's part reaches rank 0 as `finalize` gathers it (`index_part`, pickled and unpickled).

Timed with the library's own code (wall seconds; `*_cpu_s`: this process's CPU seconds, a figure
less disturbed by other processes on a shared machine):
- save_index_s: rank 0's `merge_specs` + `build_index` over every rank's part (the exact-tiling
  check included) and the manifest's JSON encoding (`manifest.encode`);
- load_plan_s: `manifest.read` of the written manifest, `FragmentSource` over it, then
  `local_slice.read_local` for every region one rank needs (its DP range of each local tensor),
  with a reader that records which files it would open and returns zeros instead of reading
  bytes (each file's header records come from the index; a file that holds none of the rank's
  bytes stops the benchmark).
files_opened_per_rank is compared with files_holding_rank_bytes, counted from the synthetic
partition itself. Peak memory: the process's RSS high-water mark over the whole run (it holds
every rank's gathered part at once, as rank 0 does), the RSS after the imports (torch and numpy:
the metadata path does not import megatron-core, which a training process has loaded anyway,
about 130 MiB more), and the difference.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import pickle
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_ucp.formats import manifest as mf  # noqa: E402
from megatron_ucp.formats.fragments import FragmentSource, build_index, index_part, merge_specs, part_records  # noqa: E402
from megatron_ucp.formats.manifest import Manifest  # noqa: E402
from megatron_ucp.gc_pause import paused_gc  # noqa: E402
from megatron_ucp.layout import Layout  # noqa: E402
from megatron_ucp.local_slice import read_local  # noqa: E402
from megatron_ucp.spec import ParamSpec, Piece  # noqa: E402
from megatron_ucp.storage import Reader  # noqa: E402

RSS_AFTER_IMPORTS_MIB = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # torch, numpy


class Region(NamedTuple):
    """What `read_local` reads of a `param_spec.LocalParam` (the rest of it is the live model
    parameter, which a plan does not need: megatron-core is not imported)."""

    spec: ParamSpec
    pieces: list[Piece]


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


def stage_locals(stage: list, tp: int, t: int) -> tuple[list, list[int]]:
    """TP rank t's local tensors of a stage, (name, tp_axis, local shape, piece, numel) in the
    order of the DistributedOptimizer's flat buffer, and where each starts in it."""
    out, starts, base = [], [], 0
    for name, shape, axis in stage:
        local, piece = local_piece(shape, axis, tp, t)
        out.append((name, axis, local, piece, math.prod(local)))
        starts.append(base)
        base += math.prod(local)
    return out, starts


def rank_records(locals_: list, starts: list[int], t: int, dp: int, d: int) -> tuple[list, list]:
    """(records, needs) of rank (t, d) of a stage: its saved fragments, and the regions it needs
    at load time at the same layout: (name, local shape, piece, start, end) of its DP range."""
    total = starts[-1] + locals_[-1][4]
    lo, hi = d * total // dp, (d + 1) * total // dp
    records, needs = [], []
    i = bisect.bisect_right(starts, lo) - 1  # the first tensor the range reaches
    while i < len(locals_) and starts[i] < hi:
        name, axis, local, piece, n = locals_[i]
        a, b = max(lo, starts[i]) - starts[i], min(hi, starts[i] + n) - starts[i]
        if b > a:
            needs.append((name, local, piece, a, b))
            if axis is not None or t == 0:  # TP-replicated tensors: saved by TP rank 0 only
                records.append((name, list(local), [piece.to_json()], a, b, 100.0))
        i += 1
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
        if Path(path) not in self.headers:
            raise SystemExit(f"the load plan opened {path}, which holds none of the rank's bytes")
        return {"fragments": json.dumps(self.headers[Path(path)])}

    def open(self, path: Path):
        self.handles[Path(path)] = None
        return None

    def check(self, path: Path, key: str, dtype: str, shape: tuple[int, ...]) -> None:
        self.open(path)  # the header entry of a tensor: no file here to check it against

    def read(self, path: Path, key: str, index=None) -> torch.Tensor:
        self.open(path)
        if index is None:
            return torch.zeros(self.lengths[(Path(path), key.rsplit("/", 1)[0])])
        return torch.zeros(index[0].stop - index[0].start)

    def read_into(self, path: Path, key: str, out: torch.Tensor, start: int = 0,
                  checksum: bool = False, crc: int = 0) -> int | None:
        """The pread path a local load takes (`FragmentSource._pread_flat`): recorded, `out` zeroed.
        The planning source verifies no checksum, so there is no crc32 to return."""
        self.open(path)
        out.zero_()
        return None


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
    gathered, rank_of, gathered_bytes, n_fragments = [], {}, 0, 0
    for s, stage in enumerate(stages):
        stage_specs = [ParamSpec(n, shape, "bfloat16", axis).to_json() for n, shape, axis in stage]
        per_tp = [stage_locals(stage, tp, t) for t in range(tp)]
        for d in range(dp):
            for t in range(tp):
                records, _ = rank_records(*per_tp[t], t, dp, d)
                n_fragments += len(records)
                # as `finalize` gathers it: a rank's `index_part`, pickled there, unpickled at rank 0
                sent = pickle.dumps(index_part(stage_specs if d == 0 else None, records))
                gathered_bytes += len(sent)
                rank_of[(s, d, t)] = len(gathered)
                gathered.append(pickle.loads(sent))
    gen_s = time.perf_counter() - t0

    t0, c0 = time.perf_counter(), time.process_time()
    with paused_gc():  # rank 0 in `finalize`
        specs = merge_specs([g[0] for g in gathered])
        t1 = time.perf_counter()
        params = build_index(specs, (part_records(g[1]) for g in gathered))
    t2 = time.perf_counter()
    manifest = Manifest.fragments(iteration=0, layout=Layout(tp=tp, pp=pp, dp=dp),
                                  world_size=args.ranks, model={}, optimizer={"param_groups": []},
                                  scheduler=None, extra={}, seed=0)
    manifest.params = params
    text = mf.encode(manifest)  # what the save writes
    save_index_s, save_index_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    save_parts = {"merge_specs_s": t1 - t0, "build_index_s": t2 - t1,
                  "manifest_json_s": time.perf_counter() - t2}
    del gathered

    # one rank's load plan at the same layout
    load_rank = args.load_rank if args.load_rank is not None else rank_of[(pp // 2, dp // 2, tp - 1)]
    (s, d, t) = next(k for k, v in rank_of.items() if v == load_rank)
    _, needs = rank_records(*stage_locals(stages[s], tp, t), t, dp, d)
    # ground truth: the ranks that saved elements [a, b) of the rank's tensors (its own position,
    # and TP rank 0's for TP-replicated tensors, whose DP ranges line up with this rank's)
    holding = {rank_of[(s, d, t)]} | ({rank_of[(s, d, 0)]} if any(
        dict((n, ax) for n, _, ax in stages[s])[name] is None for name, *_ in needs) else set())
    ckpt = Path(tempfile.mkdtemp(prefix="ucp_plan_"))
    paths = [ckpt / f for f in manifest.files]
    lengths, headers = {}, {paths[i]: [] for i in holding}  # what those files would hold
    for name, p_ in params.items():
        for sl in p_.slices_json:
            for file, start, end in sl["fragments"]:
                if file in holding:
                    lengths[(paths[file], name)] = end - start
                    headers[paths[file]].append(
                        {"name": name, "range": [start, end], "local_shape": sl["local_shape"],
                         "pieces": sl["pieces"], "step": p_.step, "crc32": {}})
    del params, manifest
    (ckpt / mf.MANIFEST).write_text(text)
    manifest_mib = len(text) / 2**20
    del text

    t0, c0 = time.perf_counter(), time.process_time()
    manifest = mf.read(ckpt)
    t1 = time.perf_counter()
    source = FragmentSource(ckpt, manifest, verify_checksums=False)
    source.reader = reader = PlanReader(lengths, headers)
    t2 = time.perf_counter()
    for name, _, piece, a, b in needs:
        spec = ParamSpec(name, manifest.params[name].shape, "bfloat16", manifest.params[name].spec.tp_axis)
        read_local(source, Region(spec, [piece]), "param", a, b)
    load_plan_s, load_plan_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    load_parts = {"manifest_parse_s": t1 - t0, "fragment_source_s": t2 - t1,
                  "read_plan_s": time.perf_counter() - t2}
    files_opened = len([f for f in reader.handles if f in set(paths)])
    shutil.rmtree(ckpt)

    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    res = {"ranks": args.ranks, "layout": f"TP{tp}xPP{pp}xDP{dp}", "tensors": n_tensors,
           "fragments": n_fragments, "gathered_metadata_mib": gathered_bytes / 2**20,
           "manifest_mib": manifest_mib, "generate_s": gen_s,
           "save_index_s": save_index_s, **save_parts, "load_plan_s": load_plan_s, **load_parts,
           "save_index_cpu_s": save_index_cpu_s, "load_plan_cpu_s": load_plan_cpu_s,
           "load_rank": load_rank,
           "files_opened_per_rank": files_opened, "files_holding_rank_bytes": len(holding),
           "peak_rss_mib": peak_rss_mib, "rss_after_imports_mib": RSS_AFTER_IMPORTS_MIB,
           "peak_rss_above_imports_mib": peak_rss_mib - RSS_AFTER_IMPORTS_MIB}
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
