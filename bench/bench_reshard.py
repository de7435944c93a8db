"""Offline conversion throughput vs a plain copy of the same bytes, measured in the same run.

For every Megatron-LM fixture in tests/fixtures/megatron_lm: reshard to universal, and (legacy
sources) to a stock legacy checkpoint at another layout; the anchor is `shutil.copytree` + fsync of
the same source directory. Runs in ONE process, so the first conversion pays megatron's import.
A Megatron-LM -> Megatron-LM reshard (legacy sources) also runs once untimed under
`_measure.PeakMemory` and /proc/self/io: bytes this process wrote (`written`, against the output's
size: a reshard that streams writes its output once; one that went through a universal copy on
disk wrote about twice as much) and its peak RSS.

    .venv/bin/python bench/bench_reshard.py [--repeat 3] [--fixtures torch_dp2 ...] [--json F]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._measure import PeakMemory, copy_tree_fsync, dir_bytes, proc_io  # noqa: E402
from megatron_ucp.conversion import reshard  # noqa: E402
from megatron_ucp.layout import Layout  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "megatron_lm"
TARGETS = {"torch_tp2_pp2": Layout(tp=1, dp=2), "torch_dp2": Layout(tp=2), "torch_vpp": Layout(pp=2),
           "torch_llama_tp2": Layout(dp=2), "torch_tp2_fp32": Layout(dp=2), "torch_moe_ep2": None}


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


SCALE_MODEL = {"num_layers": 8, "hidden_size": 512, "num_attention_heads": 8,
               "ffn_hidden_size": 2048, "vocab_size": 8192, "seq_length": 64, "dtype": "bf16"}


def scaled_legacy_checkpoint(tmp: Path) -> Path:
    """A stock Megatron-LM legacy checkpoint (TP2xPP2) of a 23M-parameter GPT: trained one step
    with megatron-core, saved by megatron_ucp, written as legacy with the fixture's args scaled."""
    import torch

    from megatron_ucp.conversion import convert, write_legacy
    from megatron_ucp.testing.launch import launch

    launch(4, "megatron_ucp.testing.scenarios:train_and_save",
           {"layout": "tp2pp2", "cfg": SCALE_MODEL, "steps": 1, "save_dir": str(tmp / "frag")})
    convert(tmp / "frag", tmp / "uni", progress=False)
    rank_file = FIXTURES / "torch_tp2_pp2" / "ckpt" / "iter_0000006" / "mp_rank_00_000" / "model_optim_rng.pt"
    a = torch.load(rank_file, map_location="cpu", weights_only=False)["args"]
    m = SCALE_MODEL
    a.num_layers, a.hidden_size, a.ffn_hidden_size = m["num_layers"], m["hidden_size"], m["ffn_hidden_size"]
    a.num_attention_heads, a.num_query_groups = m["num_attention_heads"], m["num_attention_heads"]
    a.kv_channels = m["hidden_size"] // m["num_attention_heads"]
    a.padded_vocab_size, a.vocab_size = m["vocab_size"], m["vocab_size"] - 1
    a.seq_length = a.max_position_embeddings = m["seq_length"]
    return write_legacy(tmp / "uni", tmp / "legacy", Layout(tp=2, pp=2), a, progress=False)


def written_and_peak(fn, out: Path) -> dict:
    """One untimed call: bytes this process wrote (write syscalls), the output's size, peak RSS."""
    before = proc_io().get("wchar", 0)
    with PeakMemory(sample_s=0) as peak:
        fn(out)
    return {"written": proc_io().get("wchar", 0) - before, "out_bytes": dir_bytes(out),
            "rss_peak": peak.result["rss_peak"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--scale", action="store_true",
                    help="also a 23M-parameter (~350 MB) legacy checkpoint built on the fly")
    ap.add_argument("--fixtures", nargs="+", default=None, help="only these fixtures (default: all)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sources = [(p.name, p / "ckpt") for p in sorted(FIXTURES.iterdir())  # (not README, harness)
                   if (p / "ckpt").is_dir() and (not args.fixtures or p.name in args.fixtures)]
        if args.scale:
            sources.append(("scaled 23M legacy TP2xPP2", scaled_legacy_checkpoint(Path(tmp))))
            TARGETS["scaled 23M legacy TP2xPP2"] = Layout(tp=1, dp=2)
        reshard(FIXTURES / "torch_dp2" / "ckpt", Path(tmp) / "warm", progress=False)  # imports
        rows, io = [], {}
        n = itertools.count()  # a fresh output directory for every timed call
        for fixture, src in sources:
            size = dir_bytes(src)
            copy_s = timed(lambda s=src: copy_tree_fsync(s, Path(tmp) / f"c{next(n)}"), args.repeat)
            uni_s = timed(lambda s=src: reshard(s, Path(tmp) / f"u{next(n)}", progress=False),
                          args.repeat)
            rows.append((fixture, "universal", size, uni_s, copy_s))
            target = TARGETS.get(fixture)
            if not fixture.startswith("torch_dist") and target:
                t_s = timed(lambda t=target, s=src: reshard(s, Path(tmp) / f"t{next(n)}", t, "torch",
                                                     progress=False), args.repeat)
                rows.append((fixture, f"torch {target}", size, t_s, copy_s))
                io[fixture] = written_and_peak(
                    lambda out, t=target, s=src: reshard(s, out, t, "torch", progress=False),
                    Path(tmp) / f"t{next(n)}")
    print(f"{'fixture':<34} {'target':<22} {'MiB':>6} {'conv s':>8} {'MiB/s':>7} "
          f"{'copy s':>8} {'copy MiB/s':>10} {'conv/copy':>9}")
    for fixture, target, size, conv, copy in rows:
        mib = size / 2**20
        print(f"{fixture:<34} {target:<22} {mib:>6.2f} {conv:>8.3f} {mib / conv:>7.1f} "
              f"{copy:>8.4f} {mib / copy:>10.1f} {conv / copy:>8.1f}x")
    print("conv = reshard wall time (median); copy = copytree + fsync of the same source bytes")
    for fixture, m in io.items():
        print(f"{fixture} -> torch {TARGETS[fixture]}: wrote {m['written'] / 2**20:.1f} MiB for an output "
              f"of {m['out_bytes'] / 2**20:.1f} MiB ({m['written'] / m['out_bytes']:.2f}x), "
              f"peak RSS {m['rss_peak'] / 2**20:.0f} MiB")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(
            [{"fixture": fixture, "target": target, "bytes": size, "convert_s": conv, "copy_s": copy,
              **(io.get(fixture, {}) if target.startswith("torch") else {})}
             for fixture, target, size, conv, copy in rows], indent=1) + "\n")


if __name__ == "__main__":
    main()
