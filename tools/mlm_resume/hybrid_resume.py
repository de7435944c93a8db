"""Stock Megatron-LM core_v0.19.0 `pretrain_hybrid.py` resumes megatron-ucp's conversions of its own
hybrid Mamba checkpoints (tests/fixtures/megatron_lm_v019 `*hybrid*`), on CPU: each fixture as saved
at its own layout (the reference), its conversions to other layouts and formats, and a
`--no-load-optim` control, trained from iteration 6 to 9; prints a markdown table of the losses at
7-9 and their distance to the reference, and writes all results as JSON.

    MLM_SRC=/tmp/mlm019 PYTHONPATH=$PWD .venv312/bin/python tools/mlm_resume/hybrid_resume.py \\
        --work /tmp/hres --json /tmp/hres.json

Runs go through run_hybrid_resume.py (run_pretrain_resume.py's shim and load fixes, plus
megatron_ucp.testing.mamba_cpu, as the fixtures' harness). The model flags are the fixtures'
(harness/run_hybrid.sh). A PP2 fixture's pattern cuts its stages with `|`; at another PP the
pattern without them (what megatron-ucp writes into the target's args) is passed. Target format
`universal`: the fixture converted (`convert`) and loaded as it is by
`megatron_ucp.megatron_lm.install()` (run_pretrain_resume.py's MLM_UCP_INSTALL=1).
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

from megatron_ucp.layout import Layout  # noqa: E402
from megatron_ucp.reshard import convert, reshard  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import resume_table  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures" / "megatron_lm_v019"
# resume_table's common flags (the fixture harness's) without its layer count (the pattern's)
_LAYERS = resume_table.COMMON.index("--num-layers")
COMMON = [*resume_table.COMMON[:_LAYERS], *resume_table.COMMON[_LAYERS + 2:],
          *("--mamba-state-dim 8 --mamba-head-dim 16 --mamba-num-groups 2 --normalization RMSNorm "
            "--position-embedding-type none --disable-bias-linear --untie-embeddings-and-output-weights "
            "--spec megatron_ucp.testing.mamba_cpu hybrid_stack_spec_local").split()]
MOE = ("--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 "
       "--moe-token-dispatcher-type allgather").split()
# fixture -> (its layout and format at save, its pattern, model flags)
FIXTURE = {"torch_dist_hybrid_tp2": (dict(fmt="torch_dist", tp=2, pp=1, dp=1), "M*M-", []),
           "torch_hybrid_pp2": (dict(fmt="torch", tp=1, pp=2, dp=1), "M*-|ME", MOE)}
# (fixture, target format, target layout, torch_dist optimizer form, extra Megatron flags)
CASES = [
    ("torch_dist_hybrid_tp2", "torch_dist", dict(tp=1, pp=1, dp=2), "dp_reshardable", []),
    ("torch_dist_hybrid_tp2", "torch", dict(tp=1, pp=2, dp=1), None, []),
    ("torch_dist_hybrid_tp2", "torch_dist", dict(tp=1, pp=2, dp=1), "fully_reshardable",
     ["--dist-ckpt-optim-fully-reshardable"]),
    ("torch_dist_hybrid_tp2", "torch", dict(tp=2, pp=1, dp=1), None, []),  # the saved TP, other format
    ("torch_dist_hybrid_tp2", "torch_dist", dict(tp=1, pp=1, dp=2), "dp_reshardable", ["--no-load-optim"]),
    ("torch_hybrid_pp2", "torch", dict(tp=1, pp=1, dp=2), None, []),
    ("torch_hybrid_pp2", "torch_dist", dict(tp=1, pp=1, dp=2), "dp_reshardable", []),
    ("torch_hybrid_pp2", "torch_dist", dict(tp=1, pp=1, dp=2), "fully_reshardable",
     ["--dist-ckpt-optim-fully-reshardable"]),
    ("torch_hybrid_pp2", "torch", dict(tp=1, pp=1, dp=2), None, ["--no-load-optim"]),
    # the universal checkpoint itself, loaded by megatron_ucp.megatron_lm.install() (MLM_UCP_INSTALL)
    ("torch_hybrid_pp2", "universal", dict(tp=1, pp=1, dp=2), None, []),
]


def run(load: Path, save: Path, lay: dict, fmt: str, pattern: str, extra: list[str], log: Path,
        port: int) -> dict:
    """resume_table.run_megatron with pretrain_hybrid.py (run_hybrid_resume.py) and this model's
    flags; a pattern's `|` stage cuts only where the run has that many stages."""
    if lay["pp"] != pattern.count("|") + 1:
        pattern = pattern.replace("|", "")
    runner = {"src": os.environ["MLM_SRC"], "python": sys.executable,
              "pythonpath": os.environ.get("PYTHONPATH"),
              "script": Path(__file__).with_name("run_hybrid_resume.py"), "common": COMMON,
              "env": {"MLM_UCP_INSTALL": "1"} if fmt == "universal" else {}}
    res = resume_table.run_megatron(runner, load, save, lay, fmt, ["--hybrid-layer-pattern", pattern, *extra],
                                    log, port)
    return {**res, "pattern": pattern}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/megatron_ucp_hybrid_resume")
    ap.add_argument("--json", default=None)
    ap.add_argument("--port", type=int, default=29980)
    ap.add_argument("--only", default=None, help="regex on the case names")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    results, port = {}, a.port
    for name, (lay, pattern, flags) in FIXTURE.items():
        cases = [(f"{name} (as saved)", None)] + [
            (f"{name} -> {fmt} TP{t['tp']}xPP{t['pp']}xDP{t['dp']}" + (f" {sh}" if sh else "")
             + (" " + " ".join(ex) if ex else ""), (fmt, t, sh, ex)) for src, fmt, t, sh, ex in CASES
            if src == name]
        for case, spec in cases:
            if a.only and not re.search(a.only, case):
                continue
            d = work / re.sub(r"[^\w.-]+", "_", case)
            d.mkdir(exist_ok=True)
            if spec is None:
                res = run(FIXTURES / name / "ckpt", d / "save", lay, lay["fmt"], pattern, flags,
                          d / "log.txt", port)
            else:
                fmt, t, sh, ex = spec
                conv = d / "converted"
                if not conv.exists() and fmt == "universal":
                    convert(FIXTURES / name / "ckpt", conv, progress=False)
                elif not conv.exists():
                    reshard(FIXTURES / name / "ckpt", conv, Layout(tp=t["tp"], pp=t["pp"], dp=t["dp"]),
                            fmt, progress=False, optim_sharding=sh)
                res = run(conv, d / "save", t, fmt, pattern, flags + ex, d / "log.txt", port)
            port += 1
            results[case] = res
            print(f"{case}: {res['losses']} step {res['saved_step']} {res['error'] or ''}", flush=True)
    print("\n| case (fixture → target) | loss 7 | loss 8 | loss 9 | max abs diff vs reference | "
          "max rel diff | saved step |\n|---|---|---|---|---|---|---|")
    for case, res in results.items():
        ref = results.get(case.split(" -> ")[0] + " (as saved)" if "->" in case else case)
        ls = [res["losses"].get(i) for i in (7, 8, 9)]
        cells = " | ".join(f"{x:.6f}" if x is not None else "–" for x in ls)
        if "->" not in case or not ref or None in ls:
            diff = "(reference) | –" if "->" not in case else f"– | – ({res['error']})"
        else:
            d_abs = max(abs(res["losses"][i] - ref["losses"][i]) for i in (7, 8, 9))
            d_rel = max(abs(res["losses"][i] - ref["losses"][i]) / abs(ref["losses"][i]) for i in (7, 8, 9))
            diff = f"{d_abs:.1e} | {d_rel:.1e}" if d_abs else "0 | 0"
        print(f"| `{case.replace('->', '→')}` | {cells} | {diff} | {res['saved_step']} |")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0 if all(r["rc"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
