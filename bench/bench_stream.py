"""Live weight sync: `megatron_ucp.export_hf_weights` (HF tensors streamed from the running model)
against its anchor, measured in the same run: what an RL loop does without it, a checkpoint
(`megatron_ucp.save`) then `export-hf` of it (bf16).

A Llama-style tiny_gpt model trains 1 step at --layout on CPU processes (gloo), saves, then streams
its HF weights (nothing kept: an engine would copy each tensor and drop it). Reported per GB of HF
weights: stream seconds, save + export-hf seconds, their ratio, and the peak RSS growth of rank 0
while streaming (one universal tensor at a time is the bound, not the model). Cross-check: the
streamed bytes equal the exported files' tensor bytes.

    .venv/bin/python bench/bench_stream.py [--layout tp2pp2 --hidden-size 512 --num-layers 8] [--json F]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GB = 1e9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layout", default="tp2pp2")
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--ffn-hidden-size", type=int, default=1408)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--workdir", default=None, help="where the checkpoint and export go (removed after)")
    p.add_argument("--json", default=None, help="write the figures here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    from megatron_ucp.conversion import export_hf
    from megatron_ucp.layout import Layout
    from megatron_ucp.testing.launch import launch

    cfg = dict(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
               ffn_hidden_size=a.ffn_hidden_size, vocab_size=a.vocab_size, unpadded_vocab_size=a.vocab_size,
               seq_length=32, micro_batch_size=2, global_batch_size=4 * Layout.parse(a.layout).dp,
               swiglu=True, normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
               num_query_groups=a.num_attention_heads // 2, untie_embeddings=True)
    work = Path(tempfile.mkdtemp(dir=a.workdir))
    try:
        run = {"cfg": cfg, "arch": "llama", "save_dir": str(work / "ckpt")}
        res = launch(Layout.parse(a.layout).world_size, "megatron_ucp.testing.hf_scenarios:stream_and_save",
                     {"layout": a.layout, "runs": [run], "steps": 1}, timeout=1800)
        ranks = [r[0] for r in res]
        t0 = time.perf_counter()
        out = export_hf(work / "ckpt", work / "hf", "llama", dtype="bf16", progress=False)
        export_s = time.perf_counter() - t0
        from safetensors import safe_open

        exported = 0
        for f in out.glob("*.safetensors"):
            with safe_open(str(f), "pt") as st:
                for k in st.keys():
                    t = st.get_tensor(k)
                    exported += t.numel() * t.element_size()
        gb = ranks[0]["bytes"] / GB
        stream_s = max(r["seconds"] for r in ranks)
        anchor_s = max(r["save_seconds"] for r in ranks) + export_s
        figures = {"layout": a.layout, "hf_bytes": ranks[0]["bytes"], "exported_bytes": exported,
                   "stream_s": stream_s, "save_s": max(r["save_seconds"] for r in ranks),
                   "export_hf_s": export_s,
                   "stream_s_per_gb": stream_s / gb, "anchor_s_per_gb": anchor_s / gb,
                   "ratio": stream_s / anchor_s,
                   "peak_rss_growth_per_gb": ranks[0]["peak_rss_growth"] / gb / GB}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'':28}{'seconds':>10}{'s / GB':>10}")
    print(f"{'stream (export_hf_weights)':28}{figures['stream_s']:10.2f}{figures['stream_s_per_gb']:10.2f}")
    print(f"{'anchor: save + export-hf':28}{anchor_s:10.2f}{figures['anchor_s_per_gb']:10.2f}")
    print(f"ratio {figures['ratio']:.3f}; {figures['hf_bytes'] / 2**20:.1f} MiB of HF weights at {a.layout}; "
          f"rank 0's peak RSS grew {ranks[0]['peak_rss_growth'] / 2**20:.1f} MiB while streaming "
          f"({figures['peak_rss_growth_per_gb']:.3f} GB per GB)")
    if figures["exported_bytes"] != figures["hf_bytes"]:
        raise SystemExit(f"streamed {figures['hf_bytes']} bytes, export-hf wrote {figures['exported_bytes']}")
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=1))
    return figures


if __name__ == "__main__":
    main()
