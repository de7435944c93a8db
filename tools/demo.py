"""End-to-end demo of megatron_ucp on CPU: save at one layout, resume at others, compare losses.

    .venv/bin/python tools/demo.py --out out/demo          (what `make demo` runs)

[1] Trains a tiny megatron-core GPT at TP2xPP2 (4 gloo processes) for --steps steps, saves a
    fragment checkpoint into OUT/ckpt, and keeps training --continue-steps more: the uninterrupted
    reference.
[2] Prints `megatron-ucp inspect` of the checkpoint.
[3] Consolidates it into the universal checkpoint OUT/universal (--skip-universal leaves this out).
[4] Resumes for --continue-steps steps at TP2xPP2 (same layout, 4 processes), at TP1xPP1xDP2
    (2 processes) and from OUT/universal at TP2 (2 processes).
Then prints the losses side by side with a one-line verdict and writes the plot OUT/loss.png.

Exit status 0 when every resumed run matches the reference within the tolerance, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import time
from pathlib import Path

import megatron_ucp as ucp
from megatron_ucp.testing.launch import launch

SCENARIOS = "megatron_ucp.testing.scenarios"
REFERENCE = "uninterrupted TP2xPP2"
# Max relative loss delta accepted between a resumed run and the uninterrupted one. Different
# layouts reduce in different orders, so bitwise equality is not expected across layouts.
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-3}


@dataclasses.dataclass
class Run:
    label: str
    layout: str
    nprocs: int
    load_dir: Path


class Progress:
    """Timestamped progress lines: `[  12.3s] message`."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}", flush=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("out/demo"),
                   help="output directory: ckpt/, universal/, loss.png (default: %(default)s)")
    p.add_argument("--steps", type=int, default=6, help="training steps before the checkpoint")
    p.add_argument("--continue-steps", type=int, default=6, help="steps after the checkpoint")
    p.add_argument("--dtype", choices=sorted(TOLERANCE), default="fp32", help="model weight dtype")
    p.add_argument("--skip-universal", action="store_true",
                   help="skip consolidating to a universal checkpoint and resuming from it")
    args = p.parse_args(argv)
    if args.steps < 1 or args.continue_steps < 1:
        p.error("--steps and --continue-steps must be at least 1")
    return args


def run_workers(log: Progress, nprocs: int, function: str, kwargs: dict, what: str) -> dict:
    """Launch `function` on `nprocs` ranks and return rank 0's result (losses agree on all ranks)."""
    log(f"{what} ({nprocs} processes) ...")
    t0 = time.perf_counter()
    result = launch(nprocs, f"{SCENARIOS}:{function}", kwargs)[0]
    log(f"  done in {time.perf_counter() - t0:.1f}s")
    return result


def fmt_losses(losses: list[float]) -> str:
    return " ".join(f"{x:.4f}" for x in losses)


def print_table(first: int, reference: list[float], resumed: dict[str, list[float]]) -> float:
    """Print the loss table; returns the max relative delta of any resumed run vs the reference."""
    labels = list(resumed)
    widths = [max(len(REFERENCE), 10)] + [max(len(lbl), 10) for lbl in labels]
    head = ["iteration", REFERENCE, *labels, "max |delta|", "max rel delta"]
    print("  ".join(f"{h:>{w}}" for h, w in zip(head, [9, *widths, 11, 13])))
    max_rel = 0.0
    for i, ref in enumerate(reference):
        vals = [resumed[lbl][i] for lbl in labels]
        abs_d = max(abs(v - ref) for v in vals)
        rel_d = abs_d / abs(ref) if ref else abs_d
        max_rel = max(max_rel, rel_d)
        cells = [f"{first + i:>9}", f"{ref:>{widths[0]}.6f}"]
        cells += [f"{v:>{w}.6f}" for v, w in zip(vals, widths[1:])]
        cells += [f"{abs_d:>11.2e}", f"{rel_d:>13.2e}"]
        print("  ".join(cells))
    return max_rel


def plot(path: Path, steps: int, before: list[float], reference: list[float],
         resumed: dict[str, list[float]], dtype: str) -> None:
    """Loss curves (top) and relative |resumed - uninterrupted| (bottom, log) around the resume."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_d) = plt.subplots(2, 1, figsize=(9, 7), sharex=True,
                                   gridspec_kw={"height_ratios": [3, 2]})
    it_all = list(range(1, steps + len(reference) + 1))
    it_after = it_all[steps:]
    ax.plot(it_all, before + reference, "-o", color="black", lw=2, ms=5, label=REFERENCE)
    styles = ["s", "^", "D", "v"]
    tol, top = TOLERANCE[dtype], 1.0
    for (label, losses), m in zip(resumed.items(), styles):
        ax.plot(it_after, losses, f"--{m}", ms=8, mfc="none", mew=1.5, label=f"resumed {label}")
        rel = [abs(a - b) / abs(b) if b else abs(a - b) for a, b in zip(losses, reference)]
        exact = all(d == 0 for d in rel)
        top = max(top, 2 * max(rel))
        ax_d.plot(it_after, [d if d > 0 else float("nan") for d in rel], f"--{m}", ms=7, mfc="none",
                  mew=1.5, label=label + (" (bitwise equal at every step)" if exact else ""))
    ax_d.axhline(tol, color="tab:gray", ls="--", lw=1, label=f"tolerance {tol:.0e} ({dtype})")
    for a in (ax, ax_d):
        a.axvline(steps + 0.5, color="tab:red", ls=":", lw=1.5)
        a.grid(alpha=0.3)
    ax.text(steps + 0.6, 0.97, f"checkpoint at iteration {steps}:\nresumed runs start here",
            color="tab:red", transform=ax.get_xaxis_transform(), va="top", fontsize=9)
    ax.set_ylabel("training loss")
    ax.set_title(f"megatron_ucp: tiny GPT ({dtype}) saved at TP2xPP2, resumed at other layouts")
    ax.legend(loc="lower left", fontsize=9)
    ax_d.set_yscale("log")
    ax_d.set_ylim(1e-10, top)
    ax_d.set_ylabel("relative |loss delta|\nvs uninterrupted\n(zeros not drawn)")
    ax_d.set_xlabel("iteration")
    ax_d.set_xticks(it_all)
    ax_d.legend(loc="upper left", fontsize=9, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = Progress()
    out: Path = args.out.resolve()
    ckpt, universal = out / "ckpt", out / "universal"
    out.mkdir(parents=True, exist_ok=True)
    for d in (ckpt, universal):  # the demo owns these two; start fresh each time
        shutil.rmtree(d, ignore_errors=True)
    cfg = {"dtype": args.dtype}
    n, m = args.steps, args.continue_steps
    log(f"megatron_ucp demo: tiny GPT, {args.dtype}, {n} steps + checkpoint + {m} steps; output {out}")

    ref = run_workers(log, 4, "train_and_save",
                      {"layout": "tp2pp2", "cfg": cfg, "steps": n, "save_dir": str(ckpt),
                       "continue_steps": m},
                      f"[1] train TP2xPP2 for {n} steps, save to {ckpt}, continue {m} steps")
    log(f"  losses 1..{n}: {fmt_losses(ref['losses'])}")
    log(f"  save took {ref['save_seconds']:.2f}s; continued losses: {fmt_losses(ref['continued'])}")

    log(f"[2] megatron-ucp inspect {ckpt}")
    print(ucp.inspect(ckpt), flush=True)

    runs = [Run("TP2xPP2", "tp2pp2", 4, ckpt), Run("TP1xPP1xDP2", "tp1pp1dp2", 2, ckpt)]
    if not args.skip_universal:
        log(f"[3] consolidate {ckpt} -> {universal}")
        t0 = time.perf_counter()
        ucp.convert(ckpt, universal, progress=False)
        size = sum(f.stat().st_size for f in universal.rglob("*") if f.is_file())
        log(f"  universal checkpoint written: {size / 2**20:.2f} MiB in {time.perf_counter() - t0:.2f}s")
        runs.append(Run("TP2 (universal)", "tp2pp1dp1", 2, universal))

    resumed: dict[str, list[float]] = {}
    for k, run in enumerate(runs, start=1):
        r = run_workers(log, run.nprocs, "load_and_train",
                        {"layout": run.layout, "cfg": cfg, "load_dir": str(run.load_dir), "steps": m},
                        f"[4.{k}] resume {run.load_dir.name}/ at {run.label} for {m} steps")
        log(f"  loaded iteration {r['iteration']} in {r['load_seconds']:.2f}s, "
            f"rng {'restored' if r['rng_restored'] else 're-derived (layout changed)'}; "
            f"losses: {fmt_losses(r['losses'])}")
        resumed[run.label] = r["losses"]

    print()
    max_rel = print_table(n + 1, ref["continued"], resumed)
    tol = TOLERANCE[args.dtype]
    ok = max_rel <= tol
    print(f"\nverdict: {'PASS' if ok else 'FAIL'}: max relative loss delta after resume {max_rel:.2e} "
          f"({'<=' if ok else '>'} tolerance {tol:.0e} for {args.dtype}) over {len(resumed)} resumed "
          f"runs x {m} steps")

    png = out / "loss.png"
    plot(png, n, ref["losses"], ref["continued"], resumed, args.dtype)
    log(f"plot written to {png}")
    log(f"total wall time {log.elapsed():.1f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
