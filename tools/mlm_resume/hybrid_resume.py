"""Stock Megatron-LM resumes megatron-ucp's conversions of its own hybrid Mamba checkpoints, on CPU:
each fixture as saved at its own layout (the reference), its conversions to other layouts and
formats, and a `--no-load-optim` control, trained from iteration 6 to 9; prints a markdown table of
the losses at 7-9 and their distance to the reference, and writes all results as JSON.

core_v0.19.0 (the default; `pretrain_hybrid.py`, tests/fixtures/megatron_lm_v019 `*hybrid*`):

    MLM_SRC=/tmp/mlm019 PYTHONPATH=$PWD .venv312/bin/python tools/mlm_resume/hybrid_resume.py \\
        --work /tmp/hres --json /tmp/hres.json

core_v0.16.1 (`pretrain_mamba.py`, tests/fixtures/megatron_lm/torch_dist_hybrid_tp2; the shared
fixture harness's CUDA shim, and the triton its megatron.training imports on PYTHONPATH):

    MLM_SRC=/tmp/mlmfix/src MLM_HARNESS=../shared/fixtures/megatron_lm/harness \\
        PYTHONPATH=/work/venvs/i21resume/py311:$PWD .venv/bin/python tools/mlm_resume/hybrid_resume.py \\
        --release core_v0.16.1 --work /tmp/hres16 --json /tmp/hres16.json

Runs go through run_hybrid_resume.py (run_pretrain_resume.py's shim and load fixes, plus
megatron_ucp.testing.mamba_cpu, as the fixtures' harness). The model flags are the fixtures'
(harness/run_hybrid.sh). core_v0.19.0 takes the pattern as `--hybrid-layer-pattern` (which sets
the layer count); core_v0.16.1 as `--hybrid-override-pattern` with `--num-layers` its length. A PP2
fixture's pattern cuts its stages with `|`; at another PP the pattern without them (what
megatron-ucp writes into the target's args) is passed. Target format `universal`: the fixture
converted (`convert`) and loaded as it is by `megatron_ucp.megatron_lm.install()`
(run_pretrain_resume.py's MLM_UCP_INSTALL=1).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from megatron_ucp.conversion import convert, reshard  # noqa: E402
from megatron_ucp.layout import Layout  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import resume_table  # noqa: E402

# resume_table's common flags (the fixture harness's) without its layer count (the pattern's)
_LAYERS = resume_table.COMMON.index("--num-layers")
COMMON = [*resume_table.COMMON[:_LAYERS], *resume_table.COMMON[_LAYERS + 2:],
          *("--mamba-state-dim 8 --mamba-head-dim 16 --mamba-num-groups 2 --normalization RMSNorm "
            "--position-embedding-type none --disable-bias-linear --untie-embeddings-and-output-weights "
            "--spec megatron_ucp.testing.mamba_cpu hybrid_stack_spec_local").split()]
MOE = ("--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 "
       "--moe-token-dispatcher-type allgather").split()
# release -> its fixtures, its hybrid entry point, how it takes the pattern
RELEASES = {"core_v0.19.0": {"fixtures": REPO / "tests" / "fixtures" / "megatron_lm_v019",
                             "script": "pretrain_hybrid.py", "harness": False},
            "core_v0.16.1": {"fixtures": REPO / "tests" / "fixtures" / "megatron_lm",
                             "script": "pretrain_mamba.py", "harness": True}}
# release -> fixture -> (its layout and format at save, its pattern, model flags)
FIXTURE = {"core_v0.19.0": {"torch_dist_hybrid_tp2": (dict(fmt="torch_dist", tp=2, pp=1, dp=1), "M*M-", []),
                            "torch_hybrid_pp2": (dict(fmt="torch", tp=1, pp=2, dp=1), "M*-|ME", MOE)},
           "core_v0.16.1": {"torch_dist_hybrid_tp2": (dict(fmt="torch_dist", tp=2, pp=1, dp=1), "M*M-", [])}}
# another release's fixture (RELEASE:NAME; migration, converted under the resuming release's
# megatron-core): its reference is its conversion at its own layout (the case named here), as the
# two releases feed other mock tokens; it is also resumed as saved (a row not counted in the exit
# code: see the README on core_v0.16.1's dp_reshardable Mamba buffers under core_v0.19.0)
FIXTURE["core_v0.19.0"]["core_v0.16.1:torch_dist_hybrid_tp2"] = \
    FIXTURE["core_v0.16.1"]["torch_dist_hybrid_tp2"]
REFERENCE = {"core_v0.16.1:torch_dist_hybrid_tp2": "core_v0.16.1:torch_dist_hybrid_tp2 -> torch TP2xPP1xDP1"}


def tp2_cases(torch_target: dict) -> list[tuple]:
    """The TP2 torch_dist fixture's cases in each release: DP2 both forms, PP2 fully_reshardable,
    the saved TP in the other format, the control; `torch_target`: its torch row's layout."""
    return [
        ("torch_dist_hybrid_tp2", "torch_dist", dict(tp=1, pp=1, dp=2), "dp_reshardable", []),
        ("torch_dist_hybrid_tp2", "torch", torch_target, None, []),
        ("torch_dist_hybrid_tp2", "torch_dist", dict(tp=1, pp=2, dp=1), "fully_reshardable",
         ["--dist-ckpt-optim-fully-reshardable"]),
        ("torch_dist_hybrid_tp2", "torch", dict(tp=2, pp=1, dp=1), None, []),  # the saved TP, other format
        ("torch_dist_hybrid_tp2", "torch_dist", dict(tp=1, pp=1, dp=2), "dp_reshardable",
         ["--no-load-optim"]),
    ]


# release -> (fixture, target format, target layout, torch_dist optimizer form, extra Megatron flags)
CASES = {"core_v0.16.1": tp2_cases(dict(tp=1, pp=1, dp=2)), "core_v0.19.0": [
    *tp2_cases(dict(tp=1, pp=2, dp=1)),
    ("torch_hybrid_pp2", "torch", dict(tp=1, pp=1, dp=2), None, []),
    ("torch_hybrid_pp2", "torch_dist", dict(tp=1, pp=1, dp=2), "dp_reshardable", []),
    ("torch_hybrid_pp2", "torch_dist", dict(tp=1, pp=1, dp=2), "fully_reshardable",
     ["--dist-ckpt-optim-fully-reshardable"]),
    ("torch_hybrid_pp2", "torch", dict(tp=1, pp=1, dp=2), None, ["--no-load-optim"]),
    # the universal checkpoint itself, loaded by megatron_ucp.megatron_lm.install() (MLM_UCP_INSTALL)
    ("torch_hybrid_pp2", "universal", dict(tp=1, pp=1, dp=2), None, []),
    ("core_v0.16.1:torch_dist_hybrid_tp2", "torch", dict(tp=2, pp=1, dp=1), None, []),  # its reference
    ("core_v0.16.1:torch_dist_hybrid_tp2", "torch_dist", dict(tp=1, pp=1, dp=2), "dp_reshardable", []),
    ("core_v0.16.1:torch_dist_hybrid_tp2", "torch", dict(tp=1, pp=1, dp=2), None, []),
    ("core_v0.16.1:torch_dist_hybrid_tp2", "torch_dist", dict(tp=1, pp=1, dp=2), "dp_reshardable",
     ["--no-load-optim"]),
]}


def run(release: str, load: Path, save: Path, lay: dict, fmt: str, pattern: str, extra: list[str],
        log: Path, port: int) -> dict:
    """resume_table.run_megatron with the release's hybrid entry point (run_hybrid_resume.py) and
    this model's flags; a pattern's `|` stage cuts only where the run has that many stages."""
    if lay["pp"] != pattern.count("|") + 1:
        pattern = pattern.replace("|", "")
    rel = RELEASES[release]
    runner = {"src": os.environ["MLM_SRC"], "python": sys.executable,
              "pythonpath": os.environ.get("PYTHONPATH"),
              "harness": os.environ["MLM_HARNESS"] if rel["harness"] else None,
              "script": Path(__file__).with_name("run_hybrid_resume.py"), "common": COMMON,
              "env": {"MLM_HYBRID_SCRIPT": rel["script"],
                      **({"MLM_UCP_INSTALL": "1"} if fmt == "universal" else {})}}
    flags = (["--hybrid-layer-pattern", pattern] if release == "core_v0.19.0" else
             ["--hybrid-override-pattern", pattern, "--num-layers", str(len(pattern.replace("|", "")))])
    res = resume_table.run_megatron(runner, load, save, lay, fmt, [*flags, *extra], log, port)
    return {**res, "pattern": pattern}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/megatron_ucp_hybrid_resume")
    ap.add_argument("--json", default=None)
    ap.add_argument("--port", type=int, default=29980)
    ap.add_argument("--only", default=None, help="regex on the case names")
    ap.add_argument("--release", default="core_v0.19.0", choices=RELEASES,
                    help="the Megatron-LM release in MLM_SRC (core_v0.16.1 also needs MLM_HARNESS)")
    a = ap.parse_args()
    if RELEASES[a.release]["harness"] and "MLM_HARNESS" not in os.environ:
        sys.exit("set MLM_HARNESS (see the docstring)")

    def ckpt_of(name: str) -> Path:
        release, _, fixture = name.rpartition(":")
        return RELEASES[release or a.release]["fixtures"] / fixture / "ckpt"

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    results, port = {}, a.port
    for name, (lay, pattern, flags) in FIXTURE[a.release].items():
        cases = [(f"{name} (as saved)", None)] + [
            (f"{name} -> {fmt} TP{t['tp']}xPP{t['pp']}xDP{t['dp']}" + (f" {sh}" if sh else "")
             + (" " + " ".join(ex) if ex else ""), (fmt, t, sh, ex))
            for src, fmt, t, sh, ex in CASES[a.release] if src == name]
        for case, spec in cases:
            if a.only and not re.search(a.only, case):
                continue
            d = work / re.sub(r"[^\w.-]+", "_", case)
            d.mkdir(exist_ok=True)
            if spec is None:
                res = run(a.release, ckpt_of(name), d / "save", lay, lay["fmt"], pattern, flags,
                          d / "log.txt", port)
            else:
                fmt, t, sh, ex = spec
                conv = d / "converted"
                if not conv.exists() and fmt == "universal":
                    convert(ckpt_of(name), conv, progress=False)
                elif not conv.exists():
                    reshard(ckpt_of(name), conv, Layout(tp=t["tp"], pp=t["pp"], dp=t["dp"]),
                            fmt, progress=False, optim_sharding=sh)
                res = run(a.release, conv, d / "save", t, fmt, pattern, flags + ex, d / "log.txt", port)
            port += 1
            results[case] = res
            print(f"{case}: {res['losses']} step {res['saved_step']} {res['error'] or ''}", flush=True)
    print("\n| case (fixture → target) | loss 7 | loss 8 | loss 9 | max abs diff vs reference | "
          "max rel diff | saved step |\n|---|---|---|---|---|---|---|")
    for case, res in results.items():
        fixture = case.split(" -> ")[0].removesuffix(" (as saved)")
        ref_case = REFERENCE.get(fixture, f"{fixture} (as saved)")
        ref = results.get(ref_case)
        ls = [res["losses"].get(i) for i in (7, 8, 9)]
        cells = " | ".join(f"{x:.6f}" if x is not None else "–" for x in ls)
        if case == ref_case or not ref or None in ls:
            diff = ("(reference) | –" if case == ref_case else
                    f"– | – ({res['error'] or 'no reference'})")
        else:
            d_abs = max(abs(res["losses"][i] - ref["losses"][i]) for i in (7, 8, 9))
            d_rel = max(abs(res["losses"][i] - ref["losses"][i]) / abs(ref["losses"][i]) for i in (7, 8, 9))
            diff = f"{d_abs:.1e} | {d_rel:.1e}" if d_abs else "0 | 0"
        print(f"| `{case.replace('->', '→')}` | {cells} | {diff} | {res['saved_step']} |")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    counted = [r for case, r in results.items() if not (":" in case and "(as saved)" in case)]
    return 0 if all(r["rc"] == 0 for r in counted) else 1


if __name__ == "__main__":
    sys.exit(main())
