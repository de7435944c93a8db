"""Scale curve: save, convert and load at several model sizes, against `cp -r` + sync and DeepSpeed's
`ds_to_universal` measured in the same run.

    .venv/bin/python bench/bench_scale.py --json out/bench_scale.json             # 130M,350M,700M
    .venv/bin/python bench/bench_scale.py --sizes 20M,50M --json out/scale_small.json
    .venv/bin/python bench/bench_scale.py --sizes 1M --no-deepspeed --json F   # a smoke run (tests/)
    .venv/bin/python bench/bench_scale.py --sizes 50M --convert-nprocs 2 --no-load --no-deepspeed \
        --json out/scale_convert.json    # the distributed conversion, 1 -> 2 processes

Per size, one after another (never two at once: the 700M model alone holds ~12 GB):
1. save (--layout, default PP2, 2 ranks): a real megatron-core GPT (untied embeddings; fp32 model
   by default: on this CPU bf16 matmuls are 5x and more slower than fp32, and the checkpoint holds the
   same fp32 master weights and Adam moments either way) with DDP + DistributedOptimizer, one
   train step, then `megatron_ucp.save` timed between barriers (max over ranks), peak RSS.
2. copy anchor: `cp -r` of the fragment checkpoint + fsync of every copied file (`sync FILE...`:
   only these bytes; a bare `sync` would also flush other processes' writes on a shared box).
3. convert (fragments -> universal): `megatron_ucp.convert` in a fresh process, timed around the
   call (imports done), peak RSS of that process: the `convert_*` keys. Then, unless
   --no-convert-cli, `python -m megatron_ucp convert` as a subprocess, wall time including the
   interpreter's start and imports (`convert_cli_*`), like for like with `ds_to_universal`.
4. load (--load-layout, default TP2, 2 ranks): `megatron_ucp.load` of the fragment checkpoint and
   of the universal one, at a layout other than the save's; checks that both loads hold bitwise the
   same state and the same global per-state sums as the save (not a timing, a sanity check).
5. DeepSpeed: a ZeRO-1 (bf16, Adam) checkpoint of the same parameter count (same layers, hidden,
   vocab and sequence length; bench/_ds_zero1.py, --ds-nprocs ranks), its own `cp -r` + fsync
   anchor, then `python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state` as a
   subprocess, timed with the fsync of its output (every output on disk, as for convert and cp).
A step that cannot fit in memory (estimates in `memory_needs`, from rank peaks measured here) waits
up to --memory-wait for other jobs to free memory, then is skipped, the reason in the JSON: on a
24 GiB machine at 700M that is the load (~23 GiB: megatron_ucp.load stages each rank's whole
optimizer shard in host memory) and DeepSpeed's 2-rank ZeRO-1 train step (~24 GiB).
Page cache: before each copy, convert, ds_to_universal and load, dirty pages are flushed (os.sync)
and the source's files are evicted (fadvise DONTNEED; `--page-cache keep` to skip): every one of
them starts from the same cold-source state. A VM's host may still cache them.

Peak memory of a subprocess (cp, convert, ds_to_universal) is max(the largest single process's
exact high-water RSS from wait4, the sampled sum of RSS over its process tree). In the ranks
(save, load) it is the exact VmHWM of each rank (bench/_measure.py), reported as the max over
ranks: absolute (the model and optimizer are resident) and as the delta the operation added.
RSS counts mmapped file pages (safetensors reads mmap the checkpoint), which the kernel can drop;
the `anon` figures count anonymous memory only.

DeepSpeed is not a dependency: it runs from --ds-pythonpath (default /tmp/dsx:/tmp/mlmfix/extra,
DeepSpeed 0.19.8 installed with `pip install --no-deps --target /tmp/dsx deepspeed==0.19.8 hjson
ninja py-cpuinfo msgpack`, pydantic in /tmp/mlmfix/extra) with DS_ACCELERATOR=cpu DS_BUILD_OPS=0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
os.chdir(ROOT)  # launch() runs `python -m megatron_ucp.testing.launch bench...` from the cwd
sys.path.insert(0, str(ROOT))

from bench._measure import dir_bytes, drop_page_cache, files_under  # noqa: E402
from megatron_ucp.layout import Layout  # noqa: E402
from megatron_ucp.testing.launch import LaunchError, free_port, launch  # noqa: E402

# name -> (num_layers, hidden_size, vocab_size); ffn = 4 h, heads = h / 64, untied embeddings
SIZES = {"1M": (2, 128, 2048), "20M": (4, 512, 8192), "50M": (6, 640, 16384), "130M": (12, 768, 32768),
         "350M": (22, 1024, 32768), "700M": (22, 1536, 32768)}
SEQ_LENGTH = 64
GB = 1e9
MiB = 2**20
CONVERT_VS_COPY_GOAL = 1.5  # convert <= 1.5x cp -r + sync of the same bytes
DS_VS_CONVERT_GOAL = 5.0  # ds_to_universal >= 5x slower than convert, per byte


def model_config(size: str, dtype: str) -> dict:
    layers, hidden, vocab = SIZES[size]
    return {"num_layers": layers, "hidden_size": hidden, "ffn_hidden_size": 4 * hidden,
            "num_attention_heads": hidden // 64, "vocab_size": vocab, "seq_length": SEQ_LENGTH,
            "untie_embeddings": True, "dtype": dtype, "micro_batch_size": 1, "global_batch_size": 1}


def param_count(cfg: dict) -> int:
    """Parameters of the megatron-core GPT and of the DeepSpeed torch GPT (the same formula)."""
    h, f, v, n = cfg["hidden_size"], cfg["ffn_hidden_size"], cfg["vocab_size"], cfg["num_layers"]
    return n * (4 * h * h + 2 * h * f + 9 * h + f) + 2 * v * h + cfg["seq_length"] * h + 2 * h


def parse_sizes(text: str) -> list[str]:
    sizes = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or not sizes:
        raise SystemExit(f"--sizes {text!r}: unknown size(s) {unknown}; choose from {', '.join(SIZES)} "
                         "(comma-separated, e.g. --sizes 20M,50M)")
    return sizes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", default="130M,350M,700M", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--layout", default="pp2", help="save layout (megatron_ucp.save)")
    p.add_argument("--load-layout", default="tp2", help="load layout (differs from --layout)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="model weights' dtype")
    p.add_argument("--reps", type=int, default=1, help="rounds of copy, convert and ds_to_universal")
    p.add_argument("--no-load", action="store_true", help="skip the load")
    p.add_argument("--no-convert-cli", action="store_true",
                   help="skip timing `python -m megatron_ucp convert` (start-up and imports included)")
    p.add_argument("--convert-nprocs", default="",
                   help="also time `megatron-ucp convert` as a torchrun job of these process counts "
                        "(comma-separated, e.g. 2,4): each process writes a share of the files; "
                        "scaling = the 1-process CLI time / this time")
    p.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed anchor")
    p.add_argument("--ds-nprocs", type=int, default=2, help="ZeRO-1 data-parallel ranks")
    p.add_argument("--ds-pythonpath", default="/tmp/dsx:/tmp/mlmfix/extra",
                   help="where DeepSpeed (and pydantic) are installed")
    p.add_argument("--page-cache", choices=("drop", "keep"), default="drop",
                   help="evict the source's files from the page cache before each read")
    p.add_argument("--mem-sample-ms", type=float, default=50.0,
                   help="sampling period of anonymous memory in the ranks and of process trees")
    p.add_argument("--timeout", type=float, default=3600.0, help="per launch / subprocess, seconds")
    p.add_argument("--memory-wait", type=float, default=900.0,
                   help="seconds to wait for enough free memory before a step (else it is skipped)")
    p.add_argument("--workdir", default=None, help="where checkpoints go (default: a new temp dir); "
                   "each size's directories are removed after it is measured")
    p.add_argument("--json", default=None, help="write all results here")
    args = p.parse_args(argv)
    args.size_list = parse_sizes(args.sizes)
    if Layout.parse(args.layout) == Layout.parse(args.load_layout):
        raise SystemExit(f"--load-layout {args.load_layout} is the save layout; pick another (e.g. tp2)")
    if args.reps < 1:
        raise SystemExit(f"--reps {args.reps}: needs at least 1")
    return args


# ---------------------------------------------------------------------------------- measurement


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (what `sync FILE...` does for them)."""
    for path in [*files_under(root), *(Path(d) for d, _, _ in os.walk(root))]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _status_bytes(pid: int, fields: tuple[str, ...]) -> dict[str, int]:
    out = dict.fromkeys(fields, 0)
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key = line.split(":")[0]
            if key in out:
                out[key] = int(line.split()[1]) * 1024
    except OSError:  # the process exited between listing and reading
        pass
    return out


def tree_memory(pid: int) -> tuple[int, int]:
    """(sum of RSS, sum of anonymous RSS) over process `pid` and its descendants."""
    try:
        procs = [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:
        return 0, 0
    rss = anon = 0
    for p in procs:
        s = _status_bytes(p, ("VmRSS", "RssAnon"))
        rss, anon = rss + s["VmRSS"], anon + s["RssAnon"]
    return rss, anon


def run_measured(cmd: list[str], log: Path, sample_s: float, timeout: float, env: dict | None = None,
                 fsync_dir: Path | None = None) -> dict:
    """Run `cmd` (then fsync `fsync_dir`) and time it; peak memory of its process tree."""
    os.sync()  # the previous op's writeback is not this op's cost
    with open(log, "w") as logf:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, cwd=ROOT)
        tree_rss = tree_anon = 0
        next_sample = t0
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            now = time.perf_counter()
            if now >= next_sample:
                rss, anon = tree_memory(proc.pid)
                tree_rss, tree_anon = max(tree_rss, rss), max(tree_anon, anon)
                next_sample = now + sample_s
            if now - t0 > timeout:
                proc.kill()
            time.sleep(0.005)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode == 0 and fsync_dir is not None:
            fsync_tree(fsync_dir)
        seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = log.read_text()[-4000:]
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}; log {log}:\n{tail}")
    max_process_rss = usage.ru_maxrss * 1024  # Linux: KiB; the largest process of the tree
    return {"seconds": seconds, "peak_rss_mib": max(max_process_rss, tree_rss) / MiB,
            "max_process_rss_mib": max_process_rss / MiB, "tree_rss_sampled_mib": tree_rss / MiB,
            "tree_anon_sampled_mib": tree_anon / MiB}


def log(size: str, msg: str) -> None:
    print(f"[bench_scale {size}] {msg}", flush=True)


def copy_round(src: Path, dst: Path, log: Path, args: argparse.Namespace, sample_s: float) -> dict:
    """The copy anchor: `cp -r` of `src` from a cold page cache + fsync of every copied file."""
    shutil.rmtree(dst, ignore_errors=True)
    cold(src, args)
    rec = run_measured(["cp", "-r", str(src), str(dst)], log, sample_s, args.timeout, fsync_dir=dst)
    shutil.rmtree(dst)
    return rec


def cold(path: Path, args: argparse.Namespace) -> None:
    os.sync()
    if args.page_cache == "drop":
        drop_page_cache(path)


def median_round(recs: list[dict]) -> dict:
    """The median round's record (the lower middle one), with every round's seconds."""
    recs = sorted(recs, key=lambda r: r["seconds"])
    out = dict(recs[(len(recs) - 1) // 2])
    out["rounds_s"] = [r["seconds"] for r in recs]
    return out


def python_startup(module: str, env: dict | None = None) -> float:
    """Seconds to start the interpreter and import `module` (the fixed part of a CLI's wall time)."""
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", f"import {module}"], env=env, cwd=ROOT,
                              capture_output=True, text=True)
        times.append(time.perf_counter() - t0)
        if done.returncode:
            raise SystemExit(f"cannot import {module} (PYTHONPATH={(env or os.environ).get('PYTHONPATH')}):\n"
                             f"{done.stderr[-1500:]}\nDeepSpeed: see --ds-pythonpath in --help, or pass "
                             "--no-deepspeed")
    return min(times)


def ds_env(args: argparse.Namespace) -> dict:
    return dict(os.environ, PYTHONPATH=args.ds_pythonpath, DS_ACCELERATOR="cpu", DS_BUILD_OPS="0")


def convert_in_process(src: str, dst: str, sample_s: float, cold: bool) -> dict:
    """Rank function (one process, run through launch): `megatron_ucp.convert` timed in-process,
    after its imports, from a cold source; peak memory of this process during the call."""
    from bench._measure import PeakMemory
    from megatron_ucp.conversion import convert

    os.sync()
    if cold:
        drop_page_cache(src)
    with PeakMemory(sample_s) as mem:
        t0 = time.perf_counter()
        convert(src, dst, progress=False)
        fsync_tree(Path(dst))  # convert fsyncs its output already: a no-op kept for symmetry
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "mem": mem.result}


# ------------------------------------------------------------------------------------- one size


GiB = 2**30
PROCESS_BASE = 2**30  # interpreter, torch, megatron-core and gloo of one rank, with room


def memory_needs(params: int, args: argparse.Namespace) -> dict[str, int]:
    """Bytes of host memory each step needs, from the bytes per parameter measured on this CPU
    setup (rank peak RSS at 130M and 350M, less ~0.6 GB of imports per process):
    train + save: fp32 weight 4 + fp32 grad 4 + Adam moments 8 (bf16 model: + fp32 master 4 - 2);
    load: the same + ~15, because megatron_ucp.load stages the rank's whole optimizer shard
    (master + 2 moments, 12 bytes/param) in host buffers before copying it in
    (megatron_ucp/loader.py), plus read temporaries;
    DeepSpeed bf16 ZeRO-1 (its train step and save_checkpoint): ~16.5 bytes/param on every rank
    with 2 ranks, ~27 with 1."""
    per_param = 16 if args.dtype == "fp32" else 18
    mcore = Layout.parse(args.layout).world_size * PROCESS_BASE
    load = Layout.parse(args.load_layout).world_size * PROCESS_BASE
    ds_per_param = max(27.0, 16.5 * args.ds_nprocs)
    return {"train_save": params * per_param + mcore, "load": params * (per_param + 15) + load,
            "deepspeed": int(params * ds_per_param) + args.ds_nprocs * PROCESS_BASE}


def wait_for_memory(need: int, what: str, args: argparse.Namespace) -> str | None:
    """None once `need` bytes are available (polling up to --memory-wait seconds: other jobs on
    the box come and go), else why the step is skipped."""
    total = psutil.virtual_memory().total
    if need > 0.95 * total:
        return (f"skipped: {what} needs about {need / GiB:.1f} GiB of memory; this machine has "
                f"{total / GiB:.1f} GiB")
    deadline = time.monotonic() + args.memory_wait
    while True:
        avail = psutil.virtual_memory().available
        if avail >= need:
            return None
        if time.monotonic() >= deadline:
            return (f"skipped: {what} needs about {need / GiB:.1f} GiB of memory, {avail / GiB:.1f} GiB "
                    f"was available after waiting {args.memory_wait:.0f}s (see --memory-wait)")
        time.sleep(10)


def check_disk(size: str, params: int, work: Path, with_deepspeed: bool) -> None:
    """Ours: the fragment checkpoint and its copy or universal form (12 bytes/param each);
    DeepSpeed's: its checkpoint (14 bytes/param), ds_to_universal's temporary and its output."""
    need = 2 * 12 * params + (3 * 14 * params if with_deepspeed else 0)
    free = shutil.disk_usage(work).free
    if need > free:
        raise SystemExit(f"size {size} needs about {need / GB:.0f} GB free under {work}, {free / GB:.0f} GB "
                         "is free: pass --workdir on a larger disk or drop the size from --sizes")


def measure_load(res: dict, args: argparse.Namespace, cfg: dict, save_root: Path, uni_dir: Path,
                 saved_sums: dict, sample_s: float) -> None:
    """megatron_ucp.load at --load-layout of the fragment and the universal checkpoint."""
    nprocs = Layout.parse(args.load_layout).world_size
    ranks = launch(nprocs, "bench._scale_rank:load",
                   {"layout": args.load_layout, "cfg": cfg, "sample_s": sample_s,
                    "sources": {"fragments": str(save_root), "universal": str(uni_dir)},
                    "cold": args.page_cache == "drop"}, timeout=args.timeout)
    for form, prefix in (("fragments", "load"), ("universal", "load_universal")):
        recs = [r["records"][form] for r in ranks]
        res[f"{prefix}_s"] = max(r["seconds"] for r in recs)
        res[f"{prefix}_peak_rss_mib"] = max(r["mem"]["rss_peak"] for r in recs) / MiB
        res[f"{prefix}_peak_rss_delta_mib"] = max(r["mem"]["rss_peak_delta"] for r in recs) / MiB
        res[f"{prefix}_anon_peak_delta_mib"] = max(r["mem"]["anon_peak_delta"] for r in recs) / MiB
        sums = recs[0]["state_sums"]
        res[f"{prefix}_state_sums_max_rel_diff"] = max(
            abs(sums[s] - v) / max(abs(v), 1e-30) for s, v in saved_sums.items())
    res["load_rank_peak_rss_mib"] = max(r["rank_peak_rss_mib"] for r in ranks)
    res["loads_identical"] = all(r["records"]["fragments"]["crc"] == r["records"]["universal"]["crc"]
                                 for r in ranks)
    log(res["size"], f"load at {args.load_layout} {res['load_s']:.1f}s (universal "
        f"{res['load_universal_s']:.1f}s), identical: {res['loads_identical']}")


def measure_deepspeed(res: dict, args: argparse.Namespace, cfg: dict, work: Path, sample_s: float) -> None:
    """A DeepSpeed ZeRO-1 checkpoint of the same parameter count, its copy anchor and ds_to_universal."""
    ds_root, ds_copy, ds_uni = work / "ds", work / "ds_copy", work / "ds_universal"
    ranks = launch(args.ds_nprocs, "bench._ds_zero1:train_and_save",
                   {"save_dir": str(ds_root), "num_layers": cfg["num_layers"],
                    "hidden_size": cfg["hidden_size"], "ffn_hidden_size": cfg["ffn_hidden_size"],
                    "num_attention_heads": cfg["num_attention_heads"], "vocab_size": cfg["vocab_size"],
                    "seq_length": cfg["seq_length"]}, timeout=args.timeout, env=ds_env(args))
    res["ds_params"] = ranks[0]["params"]
    res["ds_train_rank_peak_rss_mib"] = max(r["peak_rss_mib"] for r in ranks)
    ds_iter = ds_root / (ds_root / "latest").read_text().strip()
    res["ds_checkpoint_bytes"] = dir_bytes(ds_iter)

    def ds_round(i: int) -> dict:
        shutil.rmtree(ds_uni, ignore_errors=True)
        cold(ds_iter, args)
        rec = run_measured([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                            "--input_folder", str(ds_iter), "--output_folder", str(ds_uni),
                            "--inject_missing_state"], work / f"ds_to_universal{i}.log", sample_s,
                           args.timeout, env=ds_env(args), fsync_dir=ds_uni)
        rec["out_bytes"] = dir_bytes(ds_uni)
        return rec

    ds_cps, dss = [], []
    for i in range(args.reps):
        ds_cps.append(copy_round(ds_iter, ds_copy, work / f"ds_cp{i}.log", args, sample_s))
        dss.append(ds_round(i))
    ds_cp, ds = median_round(ds_cps), median_round(dss)
    res["ds_copy_s"] = ds_cp["seconds"]
    res["ds_to_universal_s"], res["ds_to_universal_rounds_s"] = ds["seconds"], ds["rounds_s"]
    res["ds_to_universal_peak_rss_mib"] = ds["peak_rss_mib"]
    res["ds_to_universal_anon_peak_mib"] = ds["tree_anon_sampled_mib"]
    res["ds_universal_bytes"] = ds["out_bytes"]
    res["ds_to_universal_vs_copy"] = res["ds_to_universal_s"] / res["ds_copy_s"]
    # seconds per input byte, DeepSpeed's over ours: the two checkpoints hold the same params
    # but not the same bytes (DeepSpeed adds the bf16 model weights: 14 vs 12 bytes/param)
    res["ds_vs_convert"] = ((res["ds_to_universal_s"] / res["ds_checkpoint_bytes"])
                            / (res["convert_s"] / res["checkpoint_bytes"]))
    res["ds_vs_convert_raw"] = res["ds_to_universal_s"] / res["convert_s"]
    if "convert_cli_s" in res:  # both as command-line tools: interpreter start and imports included
        res["ds_vs_convert_cli"] = ((res["ds_to_universal_s"] / res["ds_checkpoint_bytes"])
                                    / (res["convert_cli_s"] / res["checkpoint_bytes"]))
    shutil.rmtree(ds_root)
    shutil.rmtree(ds_uni)
    log(res["size"], f"DeepSpeed {res['ds_checkpoint_bytes'] / GB:.2f} GB: cp -r + fsync "
        f"{res['ds_copy_s']:.1f}s, ds_to_universal {res['ds_to_universal_s']:.1f}s "
        f"({res['ds_vs_convert']:.1f}x convert per byte)")


def measure_size(size: str, args: argparse.Namespace, work: Path) -> dict:
    cfg = model_config(size, args.dtype)
    # one micro-batch per data-parallel rank (a DP layout needs at least that many)
    cfg["global_batch_size"] = cfg["micro_batch_size"] * max(
        Layout.parse(args.layout).dp, Layout.parse(args.load_layout).dp)
    params = param_count(cfg)
    sample_s = args.mem_sample_ms / 1000
    needs = memory_needs(params, args)
    ds_can_fit = needs["deepspeed"] <= 0.95 * psutil.virtual_memory().total  # see wait_for_memory
    check_disk(size, params, work, not args.no_deepspeed and ds_can_fit)
    res: dict = {"size": size, "params": params, "config": cfg, "loadavg_before": os.getloadavg()[0],
                 "mem_available_before_mib": psutil.virtual_memory().available / MiB,
                 "memory_needs_gib": {k: v / GiB for k, v in needs.items()}}
    save_root, copy_dir, uni_dir = work / "save", work / "copy", work / "universal"

    skipped = wait_for_memory(needs["train_save"], "the train step and save", args)
    if skipped:
        log(size, skipped)
        return {**res, "skipped": skipped}

    # 1. train one step and save
    nprocs = Layout.parse(args.layout).world_size
    ranks = launch(nprocs, "bench._scale_rank:train_and_save",
                   {"layout": args.layout, "cfg": cfg, "save_dir": str(save_root), "sample_s": sample_s},
                   timeout=args.timeout)
    if ranks[0]["params"] != params:
        raise RuntimeError(f"the model has {ranks[0]['params']} parameters, the formula says {params}")
    iter_dir = Path(ranks[0]["iter_dir"])
    res["checkpoint_bytes"] = dir_bytes(iter_dir)
    res["save_s"] = max(r["save_s"] for r in ranks)
    res["save_peak_rss_mib"] = max(r["mem"]["rss_peak"] for r in ranks) / MiB
    res["save_peak_rss_delta_mib"] = max(r["mem"]["rss_peak_delta"] for r in ranks) / MiB
    res["save_anon_peak_delta_mib"] = max(r["mem"]["anon_peak_delta"] for r in ranks) / MiB
    res["build_s"] = max(r["build_s"] for r in ranks)
    res["train_step_s"] = max(r["train_s"] for r in ranks)
    res["train_loss"] = ranks[0]["loss"]
    res["train_rank_peak_rss_mib"] = max(r["rank_peak_rss_mib"] for r in ranks)  # whole run of a rank
    saved_sums = ranks[0]["state_sums"]
    log(size, f"saved {res['checkpoint_bytes'] / GB:.2f} GB in {res['save_s']:.1f}s")

    # 2. + 3. cp -r + fsync, and convert (in-process, then as the CLI), each from a cold source;
    # with --reps the three alternate round by round
    def convert_round(i: int) -> dict:
        shutil.rmtree(uni_dir, ignore_errors=True)
        return launch(1, "bench.bench_scale:convert_in_process",
                      {"src": str(iter_dir), "dst": str(uni_dir), "sample_s": sample_s,
                       "cold": args.page_cache == "drop"}, timeout=args.timeout)[0]

    def convert_cli_round(i: int) -> dict:
        shutil.rmtree(uni_dir, ignore_errors=True)
        cold(iter_dir, args)
        return run_measured([sys.executable, "-m", "megatron_ucp", "convert", str(iter_dir), str(uni_dir),
                             "--no-progress"], work / f"convert{i}.log", sample_s, args.timeout,
                            fsync_dir=uni_dir)

    def convert_torchrun_round(i: int, n: int) -> dict:
        out = work / "universal_torchrun"
        shutil.rmtree(out, ignore_errors=True)
        cold(iter_dir, args)
        r = run_measured([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
                          f"--master-port={free_port()}", "-m", "megatron_ucp", "convert", str(iter_dir),
                          str(out), "--no-progress"], work / f"convert_torchrun{n}_{i}.log", sample_s,
                         args.timeout, fsync_dir=out)
        shutil.rmtree(out, ignore_errors=True)
        return r

    nprocs_list = [int(n) for n in args.convert_nprocs.split(",") if n.strip()]
    copies, converts, clis = [], [], []
    torchruns: dict[int, list] = {n: [] for n in nprocs_list}
    for i in range(args.reps):
        copies.append(copy_round(iter_dir, copy_dir, work / f"cp{i}.log", args, sample_s))
        if not args.no_convert_cli or nprocs_list:
            clis.append(convert_cli_round(i))
        for n in nprocs_list:
            torchruns[n].append(convert_torchrun_round(i, n))
        converts.append(convert_round(i))  # last: its output is what the load reads
    copy, convert = median_round(copies), median_round(converts)
    res["copy_s"], res["copy_rounds_s"] = copy["seconds"], copy["rounds_s"]
    res["convert_s"], res["convert_rounds_s"] = convert["seconds"], convert["rounds_s"]
    res["convert_peak_rss_mib"] = convert["mem"]["rss_peak"] / MiB
    res["convert_peak_rss_delta_mib"] = convert["mem"]["rss_peak_delta"] / MiB
    res["convert_anon_peak_delta_mib"] = convert["mem"]["anon_peak_delta"] / MiB
    res["convert_vs_copy"] = res["convert_s"] / res["copy_s"]
    if clis:
        cli = median_round(clis)
        res["convert_cli_s"], res["convert_cli_rounds_s"] = cli["seconds"], cli["rounds_s"]
        res["convert_cli_peak_rss_mib"] = cli["peak_rss_mib"]
        res["convert_cli_vs_copy"] = res["convert_cli_s"] / res["copy_s"]
    for n, rounds in torchruns.items():  # the distributed conversion against the 1-process CLI
        t = median_round(rounds)
        res[f"convert_torchrun{n}_s"], res[f"convert_torchrun{n}_rounds_s"] = t["seconds"], t["rounds_s"]
        res[f"convert_torchrun{n}_peak_rss_mib"] = t["peak_rss_mib"]
        res[f"convert_torchrun{n}_scaling"] = res["convert_cli_s"] / t["seconds"]
        log(size, f"convert as a torchrun job of {n} processes {t['seconds']:.1f}s "
            f"({res[f'convert_torchrun{n}_scaling']:.2f}x the 1-process CLI)")
    res["universal_bytes"] = dir_bytes(uni_dir)
    log(size, f"cp -r + fsync {res['copy_s']:.1f}s, convert {res['convert_s']:.1f}s "
        f"({res['convert_vs_copy']:.2f}x)" + (f", CLI {res['convert_cli_s']:.1f}s" if clis else ""))

    # 4. load at another layout, from both forms
    load_skipped = None if args.no_load else wait_for_memory(needs["load"], "the load", args)
    if load_skipped:
        res["load_skipped"] = load_skipped
        log(size, load_skipped)
    if not args.no_load and not load_skipped:
        try:
            measure_load(res, args, cfg, save_root, uni_dir, saved_sums, sample_s)
        except (LaunchError, RuntimeError) as e:  # e.g. killed for memory: keep the other figures
            res["load_error"] = str(e)[-3000:]
            log(size, f"load failed: {str(e)[-500:]}")
    shutil.rmtree(save_root)
    shutil.rmtree(uni_dir)

    # 5. DeepSpeed ZeRO-1 of the same parameter count, its copy anchor and ds_to_universal
    ds_skipped = None if args.no_deepspeed else wait_for_memory(needs["deepspeed"], "DeepSpeed's train step",
                                                                 args)
    if ds_skipped:
        res["ds_skipped"] = ds_skipped
        log(size, ds_skipped)
    if not args.no_deepspeed and not ds_skipped:
        try:
            measure_deepspeed(res, args, cfg, work, sample_s)
        except (LaunchError, RuntimeError) as e:
            res["ds_error"] = str(e)[-3000:]
            log(size, f"DeepSpeed failed: {str(e)[-500:]}")
        finally:
            for d in ("ds", "ds_copy", "ds_universal"):
                shutil.rmtree(work / d, ignore_errors=True)

    # per-byte figures: linear growth shows as constant values across sizes
    gb, ds_gb = res["checkpoint_bytes"] / GB, res.get("ds_checkpoint_bytes", 0) / GB
    for key in ("save_s", "copy_s", "convert_s", "load_s", "load_universal_s"):
        if key in res:
            res[key.removesuffix("_s") + "_s_per_gb"] = res[key] / gb
    for key in ("save_peak_rss_mib", "save_peak_rss_delta_mib", "convert_peak_rss_mib",
                "load_peak_rss_mib", "load_peak_rss_delta_mib"):
        if key in res:
            res[key + "_per_gb"] = res[key] / gb
    if ds_gb:
        res["ds_to_universal_s_per_gb"] = res["ds_to_universal_s"] / ds_gb
        res["ds_copy_s_per_gb"] = res["ds_copy_s"] / ds_gb
        res["ds_to_universal_peak_rss_mib_per_gb"] = res["ds_to_universal_peak_rss_mib"] / ds_gb
    res["loadavg_after"] = os.getloadavg()[0]
    return res


# -------------------------------------------------------------------------------------- summary


def linear_fit(xs: list[float], ys: list[float]) -> dict:
    """Least-squares y = slope x + intercept, and R^2 (1: the points lie on the line)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - slope * x - intercept) ** 2 for x, y in zip(xs, ys))
    return {"slope_per_gb": slope, "intercept": intercept, "r2": 1 - ss_res / ss_tot if ss_tot else 1.0}


FIT_KEYS = {  # metric -> the bytes it is fitted against
    "save_s": "checkpoint_bytes", "copy_s": "checkpoint_bytes", "convert_s": "checkpoint_bytes",
    "load_s": "checkpoint_bytes", "load_universal_s": "checkpoint_bytes",
    "save_peak_rss_mib": "checkpoint_bytes", "save_peak_rss_delta_mib": "checkpoint_bytes",
    "convert_cli_s": "checkpoint_bytes", "convert_peak_rss_mib": "checkpoint_bytes",
    "convert_anon_peak_delta_mib": "checkpoint_bytes",
    "load_peak_rss_mib": "checkpoint_bytes", "load_peak_rss_delta_mib": "checkpoint_bytes",
    "ds_copy_s": "ds_checkpoint_bytes", "ds_to_universal_s": "ds_checkpoint_bytes",
    "ds_to_universal_peak_rss_mib": "ds_checkpoint_bytes"}


def fits(per_size: list[dict]) -> dict:
    """A line through each metric over the sizes that have it (at least two)."""
    out = {}
    for key, by in FIT_KEYS.items():
        pts = [(r[by] / GB, r[key]) for r in per_size if key in r and by in r]
        if len(pts) >= 2:
            out[key] = {"vs": by, "sizes": len(pts), **linear_fit([x for x, _ in pts], [y for _, y in pts])}
    return out


def goals(per_size: list[dict]) -> dict:
    return {"convert_vs_copy<=1.5": {r["size"]: r["convert_vs_copy"] <= CONVERT_VS_COPY_GOAL
                                     for r in per_size if "convert_vs_copy" in r},
            "ds_vs_convert>=5": {r["size"]: r["ds_vs_convert"] >= DS_VS_CONVERT_GOAL
                                 for r in per_size if "ds_vs_convert" in r}}


ROWS = [  # (key, format) in table order
    ("params", "{:,.0f}"), ("checkpoint_bytes", "bytes"), ("save_s", "{:.2f}"),
    ("save_peak_rss_mib", "{:,.0f}"), ("save_peak_rss_delta_mib", "{:,.0f}"), ("copy_s", "{:.2f}"),
    ("convert_s", "{:.2f}"), ("convert_vs_copy", "{:.2f}x"), ("convert_peak_rss_mib", "{:,.0f}"),
    ("convert_peak_rss_delta_mib", "{:,.0f}"), ("convert_anon_peak_delta_mib", "{:,.0f}"),
    ("convert_cli_s", "{:.2f}"), ("convert_cli_vs_copy", "{:.2f}x"), ("convert_cli_peak_rss_mib", "{:,.0f}"),
    ("load_s", "{:.2f}"), ("load_peak_rss_mib", "{:,.0f}"),
    ("load_peak_rss_delta_mib", "{:,.0f}"), ("load_universal_s", "{:.2f}"), ("loads_identical", "{}"),
    ("load_state_sums_max_rel_diff", "{:.1e}"), ("ds_checkpoint_bytes", "bytes"), ("ds_copy_s", "{:.2f}"),
    ("ds_to_universal_s", "{:.2f}"), ("ds_to_universal_peak_rss_mib", "{:,.0f}"),
    ("ds_universal_bytes", "bytes"), ("ds_vs_convert", "{:.2f}x"), ("ds_vs_convert_raw", "{:.2f}x"),
    ("ds_vs_convert_cli", "{:.2f}x"),
    ("ds_to_universal_vs_copy", "{:.2f}x"),
    ("save_s_per_gb", "{:.2f}"), ("copy_s_per_gb", "{:.2f}"), ("convert_s_per_gb", "{:.2f}"),
    ("load_s_per_gb", "{:.2f}"), ("ds_to_universal_s_per_gb", "{:.2f}"),
    ("save_peak_rss_delta_mib_per_gb", "{:,.0f}"), ("convert_peak_rss_mib_per_gb", "{:,.0f}"),
    ("load_peak_rss_delta_mib_per_gb", "{:,.0f}"), ("ds_to_universal_peak_rss_mib_per_gb", "{:,.0f}")]


def render(res: dict) -> str:
    sizes = [r for r in res["per_size"] if "error" not in r and "skipped" not in r]
    rows = []
    for key, fmt in ROWS:
        if not any(key in r for r in sizes):
            continue
        cells = []
        for r in sizes:
            v = r.get(key)
            cells.append("-" if v is None else f"{v / GB:.2f} GB" if fmt == "bytes" else fmt.format(v))
        rows.append([key, *cells])
    headers = ["", *(r["size"] for r in sizes)]
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]
    lines = ["  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths))) for row in [headers, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for key, f in res["fits"].items():
        lines.append(f"fit {key} vs {f['vs']} ({f['sizes']} sizes): {f['slope_per_gb']:.3f}/GB + "
                     f"{f['intercept']:.2f}, R^2 {f['r2']:.4f}")
    for r in res["per_size"]:
        for key in ("skipped", "error", "load_skipped", "load_error", "ds_skipped", "ds_error"):
            if key in r:
                lines.append(f"{r['size']} {key}: {r[key][-300:]}")
    for goal, met in res["goals"].items():
        lines.append(f"goal {goal}: " + ", ".join(f"{size} {'met' if ok else 'MISSED'}"
                                                  for size, ok in met.items()))
    a = res["anchors"]
    lines.append(f"interpreter start + imports: megatron_ucp.conversion {a['ucp_startup_s']:.2f}s"
                 + (f", ds_to_universal {a['ds_startup_s']:.2f}s" if "ds_startup_s" in a else "")
                 + " (inside convert_cli_s and ds_to_universal_s; not inside convert_s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    work_root = Path(args.workdir or tempfile.mkdtemp(prefix="ucp_scale_"))
    work_root.mkdir(parents=True, exist_ok=True)
    res: dict = {"args": {k: v for k, v in vars(args).items() if k != "size_list"},
                 "env": {"cpus": os.cpu_count(), "python": platform.python_version(),
                         "mem_total_gib": psutil.virtual_memory().total / 2**30},
                 "page_cache": "cold source: os.sync + fadvise DONTNEED before each copy, convert, "
                               "ds_to_universal and load" if args.page_cache == "drop" else "kept warm",
                 "ds_vs_convert_definition": "(ds_to_universal_s / ds_checkpoint_bytes) / "
                                             "(convert_s / checkpoint_bytes): seconds per input byte",
                 "per_size": []}
    t_all = time.perf_counter()
    try:
        res["anchors"] = {"ucp_startup_s": python_startup("megatron_ucp.conversion")}
        if not args.no_deepspeed:
            res["anchors"]["ds_startup_s"] = python_startup("deepspeed.checkpoint.ds_to_universal",
                                                            ds_env(args))
        for size in args.size_list:
            work = work_root / size
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            try:
                res["per_size"].append(measure_size(size, args, work))
            except (LaunchError, RuntimeError) as e:  # the next size may still fit: go on
                log(size, f"failed: {str(e)[-1000:]}")
                res["per_size"].append({"size": size, "error": str(e)[-3000:]})
            finally:
                shutil.rmtree(work, ignore_errors=True)
            write_results(res, args, t_all)  # a later size failing keeps this one's figures
    finally:
        if not args.workdir:
            shutil.rmtree(work_root, ignore_errors=True)
    write_results(res, args, t_all)
    print("\n" + res["table"] + f"\n\ntotal wall time {res['total_seconds']:.0f}s", flush=True)
    if args.json:
        print(f"[bench_scale] results written to {args.json}")
    return res


def write_results(res: dict, args: argparse.Namespace, t_all: float) -> None:
    measured = [r for r in res["per_size"] if "error" not in r and "skipped" not in r]
    res["fits"] = fits(measured)
    res["goals"] = goals(measured)
    res["total_seconds"] = time.perf_counter() - t_all
    res["table"] = render(res)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
