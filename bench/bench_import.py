"""import-hf: the weights-only universal checkpoint (the weights in their HF dtype, no optimizer
state on disk) against the full form (fp32 master weights and two zero fp32 Adam moments, what
import-hf wrote before format version 5; `import_hf(..., weights_only=False)`), measured in the
same run.

A random Llama (transformers' LlamaForCausalLM, every weight drawn, `--dtype` bf16 by default) is
saved with save_pretrained. Then --reps rounds import it both ways, the order alternating, the HF
files dropped from the page cache before each import (`--page-cache drop`). Per form: wall time
(median over rounds; the commit fsyncs every file), bytes this process wrote (/proc/self/io
wchar) and the output's size, peak RSS and peak anonymous memory (`_measure.PeakMemory`; RSS
includes the HF files' mapped pages). Cross-check: both outputs read back as bitwise the same fp32
master weights, zero moments and step 0 (what `megatron_ucp.load` puts into the optimizer).

    .venv/bin/python bench/bench_import.py [--hidden-size 1024 --num-layers 12 ...] [--json F]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._measure import PeakMemory, dir_bytes, drop_page_cache, proc_io  # noqa: E402

FORMS = {"weights_only": "import-hf, weights only (the default)",
         "full": "anchor: the full form (fp32 master + zero Adam moments)"}
MiB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model (a Llama; params ~ V*h*2 + L*(4h^2 + 3hf) with kv heads = heads)")
    g.add_argument("--num-layers", type=int, default=8)
    g.add_argument("--hidden-size", type=int, default=1024)
    g.add_argument("--ffn-hidden-size", type=int, default=2816)
    g.add_argument("--num-attention-heads", type=int, default=16)
    g.add_argument("--num-kv-heads", type=int, default=None, help="default: the attention heads")
    g.add_argument("--vocab-size", type=int, default=32000)
    g.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="the HF weights' dtype")
    g = p.add_argument_group("measurement")
    g.add_argument("--reps", type=int, default=3, help="rounds, each importing both forms")
    g.add_argument("--page-cache", choices=("drop", "keep"), default="drop",
                   help="evict the HF files from the page cache (fadvise) before each import")
    g.add_argument("--mem-sample-ms", type=float, default=20.0, help="anonymous memory sampling period")
    g.add_argument("--workdir", default=None, help="where the HF model and imports go (default: a temp dir)")
    g.add_argument("--keep", action="store_true", help="keep the HF model and the last imports")
    g.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def save_hf_model(args: argparse.Namespace, out: Path) -> int:
    """A random Llama of the given size saved with save_pretrained; returns its parameter count."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.ffn_hidden_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_kv_heads or args.num_attention_heads, max_position_embeddings=256,
        tie_word_embeddings=False)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # nothing at its init value (unit norms)
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def import_once(hf: Path, out: Path, form: str, args: argparse.Namespace) -> dict:
    """One timed import of `form` into a new `out`: seconds, bytes written, output size, memory."""
    from megatron_ucp.conversion import import_hf

    if args.page_cache == "drop":
        drop_page_cache(hf)
    before = proc_io().get("wchar", 0)
    with PeakMemory(sample_s=args.mem_sample_ms / 1000) as peak:
        t0 = time.perf_counter()
        import_hf(hf, out, progress=False, weights_only=form == "weights_only")
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "written": proc_io().get("wchar", 0) - before,
            "out_bytes": dir_bytes(out), "rss_peak": peak.result["rss_peak"],
            "anon_peak_delta": peak.result["anon_peak_delta"]}


def cross_check(weights_only: Path, full: Path) -> dict:
    """Both imports read back as bitwise the same fp32 master weights; every moment zero and every
    step 0 in both (the weights-only one's are the zeros its reader serves)."""
    import torch

    from megatron_ucp.formats import open_source

    a, b = open_source(weights_only), open_source(full)
    mismatched, nonzero = [], []
    for name, p in b.manifest.params.items():
        box = ((0,) * len(p.shape), p.shape)
        if not torch.equal(a.read(name, "param", *box).view(torch.int32),
                           b.read(name, "param", *box).view(torch.int32)):
            mismatched.append(name)
        for state in p.states:
            if state != "param" and (a.read(name, state, *box).any() or b.read(name, state, *box).any()):
                nonzero.append(f"{name}/{state}")
        if a.step(name) != 0.0 or b.step(name) != 0.0:
            nonzero.append(f"{name}/step")
    return {"params": len(b.manifest.params), "mismatched": mismatched, "nonzero_state": nonzero,
            "weights_only_manifest": a.manifest.weights_only and not b.manifest.weights_only}


def render(res: dict) -> str:
    hf_mib = res["hf_bytes"] / MiB
    lines = [f"== import-hf of a {res['params'] / 1e6:.1f}M-parameter {res['args']['dtype']} Llama "
             f"({hf_mib:.1f} MiB of safetensors), {res['args']['reps']} rounds, page cache "
             f"{res['args']['page_cache']} ==",
             f"{'':<54} {'median s':>9} {'written MiB':>12} {'out MiB':>9} {'x HF':>6} "
             f"{'peak RSS MiB':>13} {'anon peak MiB':>14}"]
    for form, label in FORMS.items():
        s = res["forms"][form]
        lines.append(f"{label:<54} {s['seconds']:>9.2f} {s['written'] / MiB:>12.1f} "
                     f"{s['out_bytes'] / MiB:>9.1f} {s['out_bytes'] / res['hf_bytes']:>6.2f} "
                     f"{s['rss_peak'] / MiB:>13.0f} {s['anon_peak_delta'] / MiB:>14.0f}")
    r = res["ratios"]
    lines.append(f"weights only vs the full form: {r['seconds']:.2f}x the time, {r['written']:.3f}x the "
                 f"bytes written, {r['out_bytes']:.3f}x on disk")
    c = res["check"]
    lines.append(f"cross-check: {c['params']} parameters, fp32 masters bitwise equal: "
                 f"{not c['mismatched']}, moments zero and steps 0: {not c['nonzero_state']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_import_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        hf = work / "hf"
        params = save_hf_model(args, hf)
        from megatron_ucp.formats import open_source

        open_source(hf, "hf")  # (megatron-core's imports and the spec rebuild, untimed once)
        rounds: dict[str, list[dict]] = {form: [] for form in FORMS}
        for rep in range(args.reps):
            order = list(FORMS) if rep % 2 == 0 else list(FORMS)[::-1]
            for form in order:
                out = work / form
                shutil.rmtree(out, ignore_errors=True)  # (the previous round's)
                rounds[form].append(import_once(hf, out, form, args))
        summary = {form: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                   for form, rs in rounds.items()}
        res = {"args": vars(args), "params": params, "hf_bytes": dir_bytes(hf), "rounds": rounds,
               "forms": summary, "check": cross_check(work / "weights_only", work / "full"),
               "ratios": {k: summary["weights_only"][k] / summary["full"][k]
                          for k in ("seconds", "written", "out_bytes", "rss_peak")}}
    finally:
        if not args.keep:  # (only what this run wrote: a --workdir may hold other files)
            for made in ("hf", *FORMS):
                shutil.rmtree(work / made, ignore_errors=True)
            if not args.workdir:
                work.rmdir()
    print(render(res))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
