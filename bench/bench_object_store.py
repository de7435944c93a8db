"""Object-store benchmark: megatron-ucp's save and resharded load against raw obstore I/O of the
same bytes, in one run against one local SeaweedFS server (megatron_ucp.testing.s3_server).

    python bench/bench_object_store.py [--save-layout tp2] [--load-layout dp2] [--hidden-size 512]
                                       [--dtype fp32|bf16] [--link-gbit 4]

Save: every rank's synchronous `megatron_ucp.save` to s3:// (staging, crc32, multipart upload,
index, manifest and `latest` commit) against a raw `obstore.put` multipart upload of a buffer of
that rank's rank-file size (same part size and concurrency). Load: `megatron_ucp.load` at another
layout (planned, merged ranged GETs, then the optimizer copy) against raw `get_ranges` of the same
number of bytes per rank file, one contiguous range each; the load's read phase (everything up to
the reads into the optimizer state, `LoadResult.read_seconds`) is also shown alone: the rest is
megatron-core's DP all-gather of the model weights, which the raw anchor does not do. Throughput
ratio = raw time / our time (1.0: as fast as the raw client): of the best rounds, and the median
of the rounds' ratios (each round runs ours then raw back to back, after one untimed round of
each). Requests: the GETs each rank issued per load (LoadResult.requests). Cross-check (not
timed): the state the store load left equals, per rank, the one a load of a local copy of the same
checkpoint writes over poisoned state (`load_store_equals_local_copy`).

Anchors, same server, same run: torch DCP's FsspecWriter / FsspecReader through s3fs (this rank's
tensors of our checkpoint, at the saving layout: DCP reshards only through a model's sharded
state), and megatron-core's torch_dist (`dist_checkpointing.save` / `load` of Megatron-LM's state
dict, fully_reshardable optimizer, loaded at the other layout) through multi-storage-client
(`msc://`, a profile written for this server). One that cannot run prints why.

The server and the ranks share this machine's cores: the figures say how much our layer costs over
the client, not what a real store delivers.
(`pip install -e .[dev]` installs s3fs; `.[msc-anchor]` multi-storage-client.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.chdir(ROOT)  # launch() runs `python -m megatron_ucp.testing.launch bench._s3_rank:fn` from the cwd

from megatron_ucp.layout import Layout  # noqa: E402
from megatron_ucp.storage import download, location  # noqa: E402
from megatron_ucp.testing.launch import LaunchError, launch  # noqa: E402
from megatron_ucp.testing.s3_server import seaweedfs, write_msc_config  # noqa: E402


def _summary(per_rank: list[dict], nbytes: int) -> dict:
    reps = len(per_rank[0]["ours"])
    ours = min(max(r["ours"][i] for r in per_rank) for i in range(reps))  # best rep, slowest rank
    raw = min(max(r["raw"][i] for r in per_rank) for i in range(reps))
    paired = sorted(max(r["raw"][i] for r in per_rank) / max(r["ours"][i] for r in per_rank)
                    for i in range(reps))  # each round's raw and ours ran back to back
    return {"ours_s": ours, "raw_s": raw, "bytes": nbytes, "ours_MBps": nbytes / ours / 1e6,
            "raw_MBps": nbytes / raw / 1e6, "ratio": raw / ours, "paired_ratios": paired,
            "paired_ratio_median": paired[len(paired) // 2]}


def _best(per_rank: list[dict], key: str) -> float:
    """The best rep of the slowest rank."""
    return min(max(r[key][i] for r in per_rank) for i in range(len(per_rank[0][key])))


def _failure(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if "Error" in ln or "error" in ln]
    return (lines[-1] if lines else str(e).splitlines()[-1] if str(e) else type(e).__name__)[:400]


def _dcp_anchor(args, cfg: dict, url: str, endpoint: str) -> dict:
    """torch DCP (FsspecWriter / FsspecReader) through s3fs: this rank's tensors of our checkpoint,
    saved and loaded at the saving layout (DCP reshards only through a model's sharded state)."""
    try:
        import s3fs  # noqa: F401
    except ImportError:
        return {"error": "s3fs is not installed (pip install -e .[dev] installs s3fs==2026.9.0)"}
    try:
        runs = launch(Layout.parse(args.save_layout).world_size, "bench._s3_rank:dcp_bench",
                      {"layout": args.save_layout, "cfg": cfg, "url": url, "reps": args.reps,
                       "endpoint": endpoint}, timeout=1200)
    except LaunchError as e:
        return {"error": _failure(e)}
    if not all(r["bitwise"] for r in runs):
        return {"error": "DCP read back other bytes than it wrote"}
    return {"save_s": _best(runs, "save"), "load_s": _best(runs, "load"),
            "note": f"at {args.save_layout}, no resharding"}


def _msc_anchor(args, cfg: dict, tmp: Path, endpoint: str) -> dict:
    """megatron-core's torch_dist (dist_checkpointing.save/load, Megatron-LM's state dict, the
    fully_reshardable optimizer) through multi-storage-client (msc://), loaded at the other layout."""
    try:
        import multistorageclient  # noqa: F401
    except ImportError:
        return {"error": "multi-storage-client is not installed (pip install -e .[msc-anchor], or "
                         "pip install --target DIR multi-storage-client==1.3.1 and PYTHONPATH=DIR)"}
    env = write_msc_config(tmp / "msc.json", endpoint, "bench")  # a profile for the same bucket
    job = {"cfg": cfg, "url": "msc://bench/mcore", "reps": args.reps}
    try:
        saves = launch(Layout.parse(args.save_layout).world_size, "bench._s3_rank:msc_save_bench",
                       {"layout": args.save_layout, **job}, timeout=1200, env=env)
        out = {"save_s": _best(saves, "save")}
    except LaunchError as e:
        return {"error": f"save: {_failure(e)}"}
    try:
        loads = launch(Layout.parse(args.load_layout).world_size, "bench._s3_rank:msc_load_bench",
                       {"layout": args.load_layout, **job}, timeout=1200, env=env)
        out["load_s"] = _best(loads, "load")
    except LaunchError as e:
        out["error_load"] = _failure(e)
    return out


@contextlib.contextmanager
def shaped_link(endpoint: str, gbit: float | None) -> Iterator[None]:
    """With `gbit`: the traffic to and from the S3 port on loopback shaped to `gbit` Gbit/s (Linux
    tc, HTB: one class for both directions), as a store across a network link would be; the
    server's own internal hops and gloo between ranks stay unshaped. Needs root and `tc`."""
    if not gbit:
        yield
        return
    port = endpoint.rsplit(":", 1)[1]
    rules = ["qdisc add dev lo root handle 1: htb default 10",
             "class add dev lo parent 1: classid 1:10 htb rate 100gbit",
             f"class add dev lo parent 1: classid 1:20 htb rate {gbit}gbit ceil {gbit}gbit",
             *(f"filter add dev lo protocol ip parent 1: prio 1 u32 match ip {d} {port} 0xffff flowid 1:20"
               for d in ("sport", "dport"))]
    if shutil.which("tc") is None or os.geteuid() != 0:
        raise SystemExit("--link-gbit shapes loopback with Linux tc: it needs root and tc (iproute2)")
    try:
        for rule in rules:
            subprocess.run(["tc", *rule.split()], check=True, capture_output=True, text=True)
        yield
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"--link-gbit: `tc {' '.join(e.cmd[1:])}` failed: {e.stderr.strip()} (is "
                         "another qdisc on lo? `tc qdisc del dev lo root` removes it)") from e
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--save-layout", default="tp2")
    p.add_argument("--load-layout", default="dp2")
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--ffn-hidden-size", type=int, default=2048)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                   help="model weights (the checkpoint holds fp32 master weights and Adam moments "
                        "either way; bf16 halves the DP all-gather of the weights after a load)")
    p.add_argument("--link-gbit", type=float, default=None,
                   help="shape the client <-> S3 traffic to this many Gbit/s (tc on loopback, root "
                        "only): the store behind a network link instead of on the ranks' own cores")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-anchors", action="store_true",
                   help="skip the DCP/s3fs and megatron-core/MSC anchors (ours vs raw obstore only)")
    p.add_argument("--out", default=str(ROOT / "out" / "bench_object_store.json"))
    args = p.parse_args(argv)
    cfg = {"num_layers": args.num_layers, "hidden_size": args.hidden_size,
           "ffn_hidden_size": args.ffn_hidden_size, "num_attention_heads": args.num_attention_heads,
           "dtype": args.dtype}
    with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp, seaweedfs(Path(tmp)) as (endpoint, bucket), \
            shaped_link(endpoint, args.link_gbit):
        url = f"{bucket}/bench"
        saves = launch(Layout.parse(args.save_layout).world_size, "bench._s3_rank:save_bench",
                       {"layout": args.save_layout, "cfg": cfg, "url": url, "reps": args.reps}, timeout=1200)
        local = Path(tmp) / "local"  # the same checkpoint on disk: the load's non-storage work
        download(location(f"{url}/ours0"), local)
        loads = launch(Layout.parse(args.load_layout).world_size, "bench._s3_rank:load_bench",
                       {"layout": args.load_layout, "cfg": cfg, "url": url, "reps": args.reps,
                        "local": str(local)}, timeout=1200)
        anchors = {} if args.no_anchors else {
            "dcp_s3fs": _dcp_anchor(args, cfg, url, endpoint),
            "mcore_torch_dist_msc": _msc_anchor(args, cfg, Path(tmp), endpoint)}
    res = {"config": cfg, "save_layout": args.save_layout, "load_layout": args.load_layout,
           "link_gbit": args.link_gbit,
           "save": _summary(saves, sum(r["file_bytes"] for r in saves)),
           "load": _summary(loads, sum(r["bytes_read"] for r in loads)),
           "load_read_phase": _summary([{"ours": r["ours_read"], "raw": r["raw"]} for r in loads],
                                       sum(r["bytes_read"] for r in loads)),
           "load_param_sync_s": _best(loads, "ours_param_sync"),
           "load_from_local_disk_s": min(max(r["local"][i] for r in loads) for i in range(args.reps)),
           "load_planning_s": max(r["planning"] for r in loads),
           "requests_per_rank_per_load": [r["requests"] for r in loads],
           "files_opened_per_rank": [r["files_opened"] for r in loads], "anchors": anchors,
           "load_store_equals_local_copy": all(r["store_equals_local"] for r in loads),
           "raw_load_machine_busy": max((b for r in loads for b in r["raw_machine_busy"]), default=None)}
    print(f"{'op':<28} {'ours s':>8} {'raw s':>8} {'MB':>8} {'ours MB/s':>10} {'raw MB/s':>9} "
          f"{'raw/ours':>8} {'paired median':>13}")
    for op, what in (("save", f"save {args.save_layout}"),
                     ("load", f"load {args.save_layout}->{args.load_layout}"),
                     ("load_read_phase", "  its read phase")):
        s = res[op]
        print(f"{what:<28} {s['ours_s']:>8.3f} {s['raw_s']:>8.3f} {s['bytes'] / 1e6:>8.1f} "
              f"{s['ours_MBps']:>10.1f} {s['raw_MBps']:>9.1f} {s['ratio']:>8.2f} "
              f"{s['paired_ratio_median']:>13.2f}")
    for name, a in anchors.items():
        if "error" in a:
            print(f"{name}: did not run: {a['error']}")
            continue
        for op in ("save", "load"):
            if "error_" + op in a:
                print(f"{name} {op}: did not run: {a['error_' + op]}")
            if op + "_s" in a:
                mb, t = res[op]["bytes"] / 1e6, a[op + "_s"]
                print(f"{name + ' ' + op:<28} {t:>8.3f} {'':>8} {mb:>8.1f} {mb / t:>10.1f}"
                      f" {'':>9} anchor/ours {t / res[op]['ours_s']:.2f}"
                      + (f" ({a['note']})" if a.get("note") and op == "load" else ""))
    print(f"the load's read phase: open, checks, plan and the reads into the optimizer state; then "
          f"megatron-core's DP all-gather of the model weights: {res['load_param_sync_s']:.3f} s "
          "(gloo on CPU; the param sync every optimizer step ends with)")
    print(f"the same load from a local copy (page cache warm): {res['load_from_local_disk_s']:.3f} s; "
          f"its planning pass in the store load: {res['load_planning_s']:.3f} s")
    if res["raw_load_machine_busy"] is not None:  # near 100%: the client and server CPU set the pace
        print(f"this machine's {os.cpu_count()} cores during the raw GETs: "
              f"{100 * res['raw_load_machine_busy']:.0f}% busy (the busiest round)")
    print(f"GET requests per rank per load: {res['requests_per_rank_per_load']} "
          f"(rank files opened: {res['files_opened_per_rank']})")
    print("the state loaded from the store equals the one loaded from a local copy (crc32 per rank): "
          f"{res['load_store_equals_local_copy']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
