"""Checkpoint benchmark: megatron_ucp.save/load/convert vs megatron-core dist_checkpointing.

Run from the repository root:   .venv/bin/python bench/bench_checkpoint.py [--json out.json]
On megatron-core 0.19:          PYTHONPATH=$PWD .venv312/bin/python bench/bench_checkpoint.py ...
(the same ops against that release's own dist_checkpointing: its default torch_dist save and load
strategies, the strategy Megatron-LM core_v0.19 builds without --ckpt-fully-parallel-save).
--reuse-saves with the --workdir of an earlier --keep run times convert and load only, on the same
files (e.g. two versions of megatron-ucp, or both releases, against one checkpoint).

Three launches, all real megatron-core (GPT + DDP + DistributedOptimizer) on CPU with gloo:
1. save at --layout (default TP2xPP2, 4 ranks): train --train-steps so Adam state exists, then
   --reps rounds of (a) megatron_ucp.save and (b) dist_checkpointing.save (torch_dist, default
   strategy) of Megatron-LM's sharded state dict with the DistributedOptimizer in dp_reshardable
   and in fully_reshardable mode. Op order rotates each round. Each op runs between barriers; its
   time is the max over ranks, and the table shows the median over rounds.
2. convert (1 process): megatron_ucp.convert of the last ucp save, against copytree+fsync and a
   plain read of the same bytes.
3. load at --load-layout (default DP2, 2 ranks): megatron_ucp.load of the fragment save and of the
   converted universal copy, and dist_checkpointing.load of the fully_reshardable save (the only
   megatron-core format that loads at another TP/PP), then a cross-check that both loaders
   produce the same optimizer shard and model weights.
See bench/_measure.py for how peak memory is measured.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.chdir(ROOT)  # launch() runs `python -m megatron_ucp.testing.launch bench._rank:fn` from the cwd
sys.path.insert(0, str(ROOT))

from bench._measure import dir_bytes  # noqa: E402
from megatron_ucp.layout import Layout  # noqa: E402
from megatron_ucp.testing.launch import launch  # noqa: E402

UCP, MCORE_DP, MCORE_FULL = "ucp", "mcore_dp_reshardable", "mcore_fully_reshardable"
UCP_ASYNC, STAGING_COPY, RAW_WRITE = "ucp_async", "staging_copy", "raw_write"
SAVE_LABELS = {UCP: "megatron_ucp.save (fragments)",
               UCP_ASYNC: "megatron_ucp.save async (until committed)",
               MCORE_DP: "mcore dist_ckpt save, dp_reshardable",
               MCORE_FULL: "mcore dist_ckpt save, fully_reshardable",
               STAGING_COPY: "anchor: bare copy of the same bytes to pinned host",
               RAW_WRITE: "anchor: raw write + fsync of the same bytes"}
LOAD_LABELS = {"plain_read": "anchor: plain read of the fragment files (1 process)",
               "ucp_load": "megatron_ucp.load (fragments)",
               "ucp_load_universal": "megatron_ucp.load (universal)",
               "mcore_load": "mcore dist_ckpt load, fully_reshardable"}
CONVERT_LABELS = {"convert": "megatron_ucp.convert (consolidate)",
                  "copytree_fsync": "shutil.copytree + fsync (same bytes)",
                  "read_all": "plain read of all files (same bytes)"}
MiB = 2**20


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:  # run from a source tree (PYTHONPATH)
        return "source tree"


def resolve_layout(text: str, nprocs: int | None) -> tuple[str, int]:
    """'tp2pp2' + nprocs 8 -> TP2xPP2xDP2; without nprocs the unnamed DP is 1."""
    lay = Layout.parse(text)
    if nprocs is not None and "dp" not in text.lower():
        per = lay.tp * lay.pp * lay.cp
        if nprocs % per:
            raise SystemExit(f"--nprocs {nprocs} is not a multiple of TP*PP*CP={per} ({text})")
        lay = Layout(tp=lay.tp, pp=lay.pp, dp=nprocs // per, vpp=lay.vpp, cp=lay.cp, ep=lay.ep)
    if nprocs is not None and nprocs != lay.world_size:
        raise SystemExit(f"layout {lay} needs {lay.world_size} processes, --nprocs says {nprocs}")
    name = f"tp{lay.tp}pp{lay.pp}dp{lay.dp}" + (f"vpp{lay.vpp}" if lay.vpp else "") + \
        (f"cp{lay.cp}" if lay.cp > 1 else "") + (f"ep{lay.ep}" if lay.ep > 1 else "")
    return name, lay.world_size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layout", default="tp2pp2", help="save layout, e.g. tp2pp2, tp2dp2, tp1pp2dp2")
    p.add_argument("--nprocs", type=int, default=None, help="save ranks (default: the layout's)")
    p.add_argument("--load-layout", default="dp2", help="load layout (different from --layout)")
    p.add_argument("--load-nprocs", type=int, default=None, help="load ranks (default: the layout's)")
    g = p.add_argument_group("model size (params ~ L*(4h^2+2hf) + V*h)")
    g.add_argument("--num-layers", type=int, default=6)
    g.add_argument("--hidden-size", type=int, default=512)
    g.add_argument("--ffn-hidden-size", type=int, default=2048)
    g.add_argument("--num-attention-heads", type=int, default=8)
    g.add_argument("--vocab-size", type=int, default=8192)
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    g.add_argument("--num-experts", type=int, default=None,
                   help="MoE in every layer (SwiGLU experts, no biases, top-2); layout may set ep")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="GroupedMLP experts (fused weights; needs bf16) instead of SequentialMLP")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=4)
    g = p.add_argument_group("what to run")
    g.add_argument("--train-steps", type=int, default=1)
    g.add_argument("--reps", type=int, default=3, help="timed rounds of every save op")
    g.add_argument("--warmup", type=int, default=1,
                   help="untimed first rounds of every save op (reported as '1st call')")
    g.add_argument("--load-reps", type=int, default=3, help="rounds of every load op")
    g.add_argument("--convert-reps", type=int, default=2)
    g.add_argument("--no-convert", action="store_true", help="skip convert (and the universal load)")
    g.add_argument("--no-load", action="store_true", help="skip the load launch")
    g.add_argument("--reuse-saves", action="store_true",
                   help="skip the save launch: convert and load the saves an earlier run with the "
                        "same --workdir and model left there (--keep)")
    g.add_argument("--async-save", action="store_true",
                   help="also time megatron_ucp.save(async_save=True) and its anchors (a bare copy "
                        "of the same bytes to pinned host memory, a raw write of them)")
    g.add_argument("--no-mcore-fully-reshardable", action="store_true",
                   help="skip mcore's fully_reshardable save (it gathers on DP rank 0)")
    g.add_argument("--mcore-fully-parallel", action="store_true",
                   help="wrap mcore's save strategy in FullyParallelSaveStrategyWrapper over DP "
                        "(Megatron-LM's default; no effect when DP=1)")
    g = p.add_argument_group("measurement")
    g.add_argument("--page-cache", choices=("drop", "keep"), default="drop",
                   help="evict checkpoint files from the page cache (fadvise) before each load/convert")
    g.add_argument("--mem-sample-ms", type=float, default=20.0,
                   help="sampling period for child processes' USS and anonymous RSS (0: off)")
    g.add_argument("--launch-timeout", type=float, default=900.0,
                   help="seconds each launch (save, convert, load) may take before its ranks are killed")
    g.add_argument("--workdir", default=None, help="where checkpoints go (default: a new temp dir)")
    g.add_argument("--keep", action="store_true", help="keep the checkpoints")
    g.add_argument("--json", default=None, help="write all results here")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------- aggregation


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def summarize(per_rank: list[dict], op: str) -> dict:
    """Per op: time per round = max over ranks, median over timed rounds (rep >= 0); memory = max
    over ranks and timed rounds. Warm-up rounds (rep < 0) give `first_call_seconds` only."""
    recs = [[r for r in rank["records"] if r["op"] == op] for rank in per_rank]
    reps = sorted({r["rep"] for r in recs[0]})

    def seconds(rep: int) -> float:
        return max(next(r["seconds"] for r in rr if r["rep"] == rep) for rr in recs)

    secs = [seconds(rep) for rep in reps if rep >= 0]
    timed = [[r for r in rr if r["rep"] >= 0] for rr in recs]
    flat = [r for rr in timed for r in rr]
    mem = [r["mem"] for r in flat]
    out = {
        "seconds_per_rep": secs, "seconds_median": _median(secs), "seconds_min": min(secs),
        "first_call_seconds": seconds(min(reps)) if min(reps) < 0 else None,
        "rss_peak_delta_max": max(m["rss_peak_delta"] for m in mem),
        "rss_peak_max": max(m["rss_peak"] for m in mem),
        "rss_peak_delta_per_rank": [max(r["mem"]["rss_peak_delta"] for r in rr) for rr in timed],
        "anon_peak_delta_max": max(m["anon_peak_delta"] for m in mem),
        "children_uss_peak_max": max(m["children_uss_peak"] for m in mem),
        "children_uss_added_max": max(m["children_uss_peak"] - m["children_uss_before"] for m in mem),
        "children_uss_before_max": max(m["children_uss_before"] for m in mem),
        "mem_exact": all(m["exact"] for m in mem),
        "io_read_bytes_per_rank": [rr[-1]["io_read_bytes"] for rr in timed],
    }
    last = [rr[-1] for rr in timed]
    if "disk_bytes" in last[0]:
        out["disk_bytes"] = last[0]["disk_bytes"]
    if isinstance(last[0].get("out"), dict):  # per-rank breakdowns (state dict build / write ...)
        keys = [k for k, x in last[0]["out"].items() if isinstance(x, float)]
        rounds = list(zip(*timed))  # rounds[i] = every rank's record of timed round i
        out["breakdown_median_of_rank_max"] = {
            k: _median([max(r["out"][k] for r in rnd) for rnd in rounds]) for k in keys}
        if "bytes_read" in last[0]["out"]:
            out["bytes_read_per_rank"] = [r["out"]["bytes_read"] for r in last]
    return out


# ------------------------------------------------------------------------------------------ tables


def _fmt_bytes(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:,.1f} MiB"


def _ratio(x: float, anchor: float | None) -> str:
    return "-" if not anchor else f"{x / anchor:.2f}x"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join("-" * w for w in widths)
    out = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths))),
           line]
    for r in rows:
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(out)


def render(res: dict) -> str:
    s = res["save"]["summary"]
    dp, full = s.get(MCORE_DP, {}).get("seconds_median"), s.get(MCORE_FULL, {}).get("seconds_median")
    if not s:  # --reuse-saves
        lines = [f"== saves at {res['save']['layout']} reused from {res['save']['reused']}, "
                 f"{res['model']['params'] / 1e6:.1f}M params, {res['args']['dtype']} model =="]
    else:
        lines = [f"== save at {res['save']['layout']} ({res['save']['nprocs']} ranks), "
                 f"{res['model']['params'] / 1e6:.1f}M params, {res['args']['dtype']} model, "
                 f"{res['args']['reps']} rounds ==",
                 table(["operation", "median s", "rounds s", "1st call s", "vs mcore dp_resh",
                        "vs mcore fully_resh", "on disk", "peak RSS d", "anon d",
                        "child procs USS: +op / before"],
                       [[SAVE_LABELS[op], f"{v['seconds_median']:.3f}",
                         " ".join(f"{x:.2f}" for x in v["seconds_per_rep"]),
                         "-" if v["first_call_seconds"] is None else f"{v['first_call_seconds']:.3f}",
                         _ratio(v["seconds_median"], dp), _ratio(v["seconds_median"], full),
                         _fmt_bytes(v.get("disk_bytes")), _fmt_bytes(v["rss_peak_delta_max"]),
                         _fmt_bytes(v["anon_peak_delta_max"]),
                         f"+{v['children_uss_added_max'] / MiB:,.1f} / "
                         f"{v['children_uss_before_max'] / MiB:,.0f} MiB"]
                        for op, v in s.items()])]
    for op, v in s.items():
        if "breakdown_median_of_rank_max" in v:
            parts = ", ".join(f"{k} {x:.3f}s" for k, x in v["breakdown_median_of_rank_max"].items())
            lines.append(f"  {op} parts (max over ranks, median over rounds): {parts}")
    if "async" in res:
        lines.append("  async save: " + ", ".join(f"{k}={v:.3f}" for k, v in res["async"].items()))
    if "convert" in res:
        c = res["convert"]["summary"]
        conv = c["convert"]["seconds_median"]
        in_bytes = res["convert"]["in_bytes"]
        lines += ["", f"== consolidation of the ucp save ({_fmt_bytes(in_bytes)} in), 1 process, "
                  f"page cache {res['args']['page_cache']} ==",
                  table(["operation", "median s", "MiB/s in", "vs convert", "written", "peak RSS d",
                         "anon d"],
                        [[CONVERT_LABELS[op], f"{v['seconds_median']:.3f}",
                          f"{in_bytes / MiB / v['seconds_median']:,.0f}",
                          _ratio(v["seconds_median"], conv), _fmt_bytes(v["out_bytes"]),
                          _fmt_bytes(v["rss_peak_delta_max"]), _fmt_bytes(v["anon_peak_delta_max"])]
                         for op, v in c.items()])]
    if "load" in res:
        ld = res["load"]["summary"]
        anchor = ld.get("mcore_load", {}).get("seconds_median")
        # the plain read of the fragment save's files (1 process, same page cache policy), timed in
        # the load launch between the loads: what a load that reads every byte once costs at least
        plain = ld["plain_read"]["seconds_median"]
        rows = []
        for op, v in ld.items():
            src = res["load"]["source_bytes"][op]
            br = v.get("bytes_read_per_rank")
            rows.append([LOAD_LABELS[op], f"{v['seconds_median']:.3f}",
                         " ".join(f"{x:.2f}" for x in v["seconds_per_rep"]),
                         _ratio(v["seconds_median"], anchor), _ratio(v["seconds_median"], plain),
                         _fmt_bytes(src),
                         " / ".join(f"{b / MiB:.1f}" for b in br) if br else "-",
                         f"{sum(br) / src:.2f}" if br else "-",
                         _fmt_bytes(sum(v["io_read_bytes_per_rank"])),
                         _fmt_bytes(v["rss_peak_delta_max"]), _fmt_bytes(v["anon_peak_delta_max"])])
        lines += ["", f"== load at {res['load']['layout']} ({res['load']['nprocs']} ranks) from the "
                  f"{res['save']['layout']} saves, page cache {res['args']['page_cache']} ==",
                  table(["operation", "median s", "rounds s", "vs mcore load", "vs plain read",
                         "ckpt on disk", "bytes_read/rank MiB",
                         "sum/disk", "OS read_bytes, all ranks", "peak RSS d", "anon d"], rows)]
        for pair, c in res["load"]["checks"].items():
            lines.append(f"  cross-check {pair}: max |diff| over ranks " +
                         ", ".join(f"{k}={x:g}" for k, x in c["max_abs_diff"].items()) +
                         (f"; differing params: {', '.join(c['mismatched'])}" if c["mismatched"]
                          else "; identical"))
        for op, c in res["load"]["consistency"].items():
            lines.append(f"  {op}: max |cast(fp32 master) - loaded model weight| = {c['max_abs_diff']:g}" +
                         (f" in {', '.join(c['mismatched'])}" if c["mismatched"] else " (consistent)"))
        lines.append(f"  one train step after the loads: loss {res['load']['loss_after_load']:.4f}")
        for op, err in res["load"]["failed"].items():
            lines.append(f"  {LOAD_LABELS[op]}: FAILED inside megatron-core: {err[:300]}")
    la0, la1 = res["loadavg_before"], res["loadavg_after"]
    lines += ["", f"host: {res['env']['cpus']} CPUs, load average (1 min) {la0:.1f} before, {la1:.1f} "
              "after; torch " + res["env"]["torch"] + ", megatron-core " + res["env"]["megatron-core"],
              "notes:",
              "- time: barrier, op, barrier on every rank; max over ranks; median over rounds (op order "
              "rotates per round; os.sync() before each op). 1st call: an untimed warm-up round.",
              "- on disk: ucp keeps fp32 master weights + Adam moments (model weights are recast from "
              "the masters at load); mcore also stores the bf16/fp32 model weights and common.pt.",
              "- peak RSS d: kernel high-water RSS of the rank process during the op (VmHWM reset via "
              "/proc/self/clear_refs) minus its RSS just before; max over ranks and rounds. It counts "
              "mmapped checkpoint pages (reclaimable page cache); anon d is the sampled peak of "
              "anonymous memory (RssAnon: heap, tensors) over its value before the op.",
              "- child procs USS: sampled peak unique memory of the rank's child processes, added during "
              "the op (+) and alive before it. mcore's torch_dist writer forks writer processes per "
              "save and, on its first save, spawns a multiprocessing Manager that stays alive (the "
              "'alive before' part); ucp writes in-process.",
              "- bytes_read/rank: LoadResult.bytes_read (tensor bytes megatron_ucp read); sum/disk > 1 "
              "when ranks hold replicas (tied embeddings on both PP ends). OS read_bytes: /proc/self/io "
              "of the rank processes, last round (storage reads; ~0 when the page cache is kept).",
              "- vs plain read: load time over the plain read of all the fragment save's files "
              "(the anchor row: one process, same page-cache policy, timed in the load launch "
              "in the same rounds as the loads).",
              "- load: the load run allocates Adam state before timing and overwrites all model and "
              "optimizer state with a sentinel before every load, so the cross-checks see only what "
              "each loader wrote."]
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------- main


def _merge_checks(per_rank: list[dict], key: str) -> dict:
    """Per-rank {name: {max_abs_diff: float | {state: float}, mismatched: [...]}} -> max over ranks."""
    out = {}
    for name, first in per_rank[0][key].items():
        diffs = [r[key][name]["max_abs_diff"] for r in per_rank]
        merged = ({k: max(d[k] for d in diffs) for k in first["max_abs_diff"]}
                  if isinstance(first["max_abs_diff"], dict) else max(diffs))
        out[name] = {"max_abs_diff": merged,
                     "mismatched": sorted({f"rank{r['rank']}:{n}" for r in per_rank
                                           for n in r[key][name]["mismatched"]})}
    return out


def run_save(args: argparse.Namespace, cfg: dict, workdir: Path, sample_s: float) -> dict:
    layout, nprocs = resolve_layout(args.layout, args.nprocs)
    t0 = time.perf_counter()
    ops = [UCP, MCORE_DP] + ([] if args.no_mcore_fully_reshardable else [MCORE_FULL])
    if args.async_save:
        ops += [UCP_ASYNC, STAGING_COPY, RAW_WRITE]
    out = launch(nprocs, "bench._rank:save_bench",
                 {"layout": layout, "cfg": cfg, "train_steps": args.train_steps,
                  "workdir": str(workdir), "reps": args.reps, "warmup": args.warmup, "ops": ops,
                  "sample_s": sample_s, "mcore_fully_parallel": args.mcore_fully_parallel},
                 timeout=args.launch_timeout)
    return {"layout": layout, "nprocs": nprocs, "per_rank": out,
            "launch_seconds": time.perf_counter() - t0,
            "summary": {op: summarize(out, op) for op in ops}}


def async_figures(summary: dict) -> dict:
    """The async-save keys compared from run to run (see the README's benchmark section)."""
    b = summary[UCP_ASYNC]["breakdown_median_of_rank_max"]
    stall, total = b["stall_s"], b["total_s"]
    copy_s, write_s = summary[STAGING_COPY]["seconds_median"], summary[RAW_WRITE]["seconds_median"]
    out = {"async_stall_s": stall, "async_total_s": total,
           "async_stall_vs_mcore_dp_reshardable": stall / summary[MCORE_DP]["seconds_median"],
           "async_stall_vs_staging_copy": stall / copy_s,
           "staging_copy_s": copy_s, "raw_write_s": write_s,
           # bytes / (total - stall) against bytes / raw_write_s
           "async_write_throughput_vs_raw_write": write_s / max(total - stall, 1e-9),
           "sync_save_s": summary[UCP]["seconds_median"]}
    if "gpu_peak_delta_mib" in b:
        out["async_gpu_peak_delta_mib"] = b["gpu_peak_delta_mib"]
    return out


def run_convert(args: argparse.Namespace, src: Path, workdir: Path, sample_s: float) -> dict:
    t0 = time.perf_counter()
    out = launch(1, "bench._rank:convert_bench",
                 {"src": str(src), "workdir": str(workdir), "reps": args.convert_reps,
                  "sample_s": sample_s, "cold": args.page_cache == "drop"}, timeout=args.launch_timeout)[0]
    summary = {op: summarize([out], op) for op in CONVERT_LABELS}
    for op in CONVERT_LABELS:
        summary[op]["out_bytes"] = next(r["out_bytes"] for r in out["records"] if r["op"] == op)
    return {"per_rank": [out], "summary": summary, "in_bytes": out["records"][0]["in_bytes"],
            "universal": out["universal"], "launch_seconds": time.perf_counter() - t0}


def run_load(args: argparse.Namespace, cfg: dict, sources: dict[str, str], sample_s: float) -> dict:
    layout, nprocs = resolve_layout(args.load_layout, args.load_nprocs)
    t0 = time.perf_counter()
    out = launch(nprocs, "bench._rank:load_bench",
                 {"layout": layout, "cfg": cfg, "sources": sources, "reps": args.load_reps,
                  "sample_s": sample_s, "cold": args.page_cache == "drop"}, timeout=args.launch_timeout)
    return {"layout": layout, "nprocs": nprocs, "per_rank": out,
            "summary": {op: summarize(out, op) for op in sources if op not in out[0]["failed"]},
            "source_bytes": {op: dir_bytes(src) for op, src in sources.items()},
            "checks": _merge_checks(out, "checks"), "consistency": _merge_checks(out, "consistency"),
            "loss_after_load": out[0]["loss_after_load"], "launch_seconds": time.perf_counter() - t0,
            "failed": out[0]["failed"]}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    resolve_layout(args.layout, args.nprocs)  # fail fast on bad layouts
    resolve_layout(args.load_layout, args.load_nprocs)
    if args.reuse_saves and not (args.workdir and (Path(args.workdir) / "save" / UCP).is_dir()):
        raise SystemExit("--reuse-saves needs --workdir of an earlier run with --keep (its save/ucp)")
    if args.reuse_saves and args.async_save:
        raise SystemExit("--reuse-saves skips the saves: drop --async-save")
    cfg = {"num_layers": args.num_layers, "hidden_size": args.hidden_size,
           "ffn_hidden_size": args.ffn_hidden_size, "num_attention_heads": args.num_attention_heads,
           "vocab_size": args.vocab_size, "seq_length": args.seq_length, "dtype": args.dtype,
           "micro_batch_size": args.micro_batch_size, "global_batch_size": args.global_batch_size}
    h, f, v, L = args.hidden_size, args.ffn_hidden_size, args.vocab_size, args.num_layers
    params = L * (4 * h * h + 2 * h * f + 9 * h + f) + v * h + args.seq_length * h + 2 * h
    if args.num_experts:
        cfg.update(num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm,
                   swiglu=True, add_bias_linear=False)
        params = L * (4 * h * h + args.num_experts * (3 * h * f + h) + 2 * h) + v * h + args.seq_length * h
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ucp_bench_"))
    workdir.mkdir(parents=True, exist_ok=True)
    sample_s = args.mem_sample_ms / 1000
    res: dict = {"args": vars(args), "model": {"config": cfg, "params": params},
                 "env": {"cpus": os.cpu_count(), **{p: _version(p) for p in
                                                    ("torch", "megatron-core", "megatron-ucp")}}}
    t_all = time.perf_counter()
    res["loadavg_before"] = os.getloadavg()[0]
    try:
        print(f"[bench] save: {args.layout}, ~{params / 1e6:.1f}M params, workdir {workdir}", flush=True)
        if args.reuse_saves:
            layout, nprocs = resolve_layout(args.layout, args.nprocs)
            res["save"] = {"layout": layout, "nprocs": nprocs, "summary": {},
                           "reused": str(workdir / "save")}
        else:
            res["save"] = run_save(args, cfg, workdir / "save", sample_s)
            print(f"[bench] save launch done in {res['save']['launch_seconds']:.1f}s", flush=True)
        if args.async_save:
            res["async"] = async_figures(res["save"]["summary"])
        sources = {"plain_read": str(workdir / "save" / UCP), "ucp_load": str(workdir / "save" / UCP)}
        if not args.no_convert:
            res["convert"] = run_convert(args, workdir / "save" / UCP, workdir / "convert", sample_s)
            sources["ucp_load_universal"] = res["convert"]["universal"]
            print(f"[bench] convert launch done in {res['convert']['launch_seconds']:.1f}s", flush=True)
        if not args.no_load:
            if not args.no_mcore_fully_reshardable:
                sources["mcore_load"] = str(workdir / "save" / MCORE_FULL)
            res["load"] = run_load(args, cfg, sources, sample_s)
            print(f"[bench] load launch done in {res['load']['launch_seconds']:.1f}s", flush=True)
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    res["total_seconds"] = time.perf_counter() - t_all
    res["loadavg_after"] = os.getloadavg()[0]
    text = render(res)
    print("\n" + text + f"\n\ntotal wall time {res['total_seconds']:.1f}s", flush=True)
    res["table"] = text
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
        print(f"[bench] results written to {args.json}")
    return res


if __name__ == "__main__":
    main()
