#!/usr/bin/env python3
"""Stock Megatron-LM `pretrain_gpt.py` saving `--ckpt-format universal` with `--async-save`, then
resuming it at the same layout and at another one.

1. From scratch at the save layout, iterations 1-6, `--ckpt-format universal --async-save`
   (`--use-persistent-ckpt-worker`: Megatron-LM 0.19 turns --async-save off for any format but
   `torch` without it): megatron-ucp's save hook stages each save (iterations 3 and 6) and returns;
   the training loop's `maybe_finalize_async_save` (megatron-ucp's hook after Megatron-LM's own)
   commits it — iteration 3 during training (blocking=False), iteration 6 at the end of training
   (blocking=True). The launcher logs each commit.
2. The uninterrupted reference: from scratch to iteration 9 at the save layout.
3. Resumed from the iteration-6 save to 9 at the save layout and at another layout (saving
   asynchronously again; the Adam step of that iteration-9 save must be 9).

The hooks come from `megatron_ucp.megatron_lm.install()` (MLM_UCP_INSTALL=1 in
run_pretrain_resume.py); with MLM_SRC a tree with patches/megatron-lm-core_v0.19.0-universal.patch
applied, the patch and install() run together; `--no-install` runs the patch alone, whose saves are
synchronous (only install() puts the finalize hook in place).

    MLM_SRC=/tmp/mlm019 PYTHONPATH=$PWD .venv312/bin/python tools/mlm_resume/universal_async.py \\
        --work /tmp/ucp_async --json ucp_async.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import resume_table as rt  # noqa: E402

LAYOUTS = {"TP2": dict(tp=2, pp=1, dp=1), "TP1 DP2": dict(tp=1, pp=1, dp=2),
           "PP2": dict(tp=1, pp=2, dp=1, first=2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/megatron_ucp_async")
    ap.add_argument("--json", default=None)
    ap.add_argument("--save-layout", default="TP2", choices=sorted(LAYOUTS))
    ap.add_argument("--resume-layouts", default="TP2,TP1 DP2",
                    help="comma-separated, from " + ", ".join(LAYOUTS))
    ap.add_argument("--no-install", action="store_true",
                    help="the patch route alone (MLM_SRC patched): no install(), so saves are synchronous")
    ap.add_argument("--port", type=int, default=29850)
    a = ap.parse_args()
    if "MLM_SRC" not in os.environ:
        sys.exit("set MLM_SRC (see the docstring)")
    runner = {"python": os.environ.get("PYTHON", sys.executable), "src": os.environ["MLM_SRC"],
              "harness": os.environ.get("MLM_HARNESS"),
              "env": {"MLM_UCP_INSTALL": "0" if a.no_install else "1"}}
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ucp = ["--ckpt-format", "universal"]
    # mcore: megatron-core's own queue (the default, nvrx, needs nvidia-resiliency-ext)
    asynchronous = ["--async-save", "--use-persistent-ckpt-worker", "--async-strategy", "mcore"]
    save_lay = LAYOUTS[a.save_layout]
    rows, port = [], a.port

    def run(name: str, lay: dict, load: Path, save: Path, extra: list[str]) -> dict:
        nonlocal port
        port += 1
        (work / name).mkdir(exist_ok=True)
        load.mkdir(parents=True, exist_ok=True)  # an empty --load: universal starts from scratch
        r = rt.run_megatron(runner, load, save, lay, "universal", extra, work / name / "log.txt", port)
        text = Path(r["log"]).read_text()
        r["commits"] = [line.split("> [resume] ", 1)[1] for line in text.splitlines()
                        if "async save of iteration" in line]
        r["async_save_disabled"] = "Disabling --async-save" in text
        r.update(case=name, layout=lay)
        rows.append(r)
        print(f"{name}: rc={r['rc']} losses={r['losses']} step={r['saved_step']} commits={r['commits']}"
              + (f" error={r['error']}" if r["error"] else ""), flush=True)
        return r

    saved = work / "saved"
    run("save, iterations 1-6, async", save_lay, work / "empty", saved,
        [*ucp, *asynchronous, "--train-iters", "6"])
    run("uninterrupted, iterations 1-9", save_lay, work / "empty2", work / "uninterrupted",
        [*ucp, "--save-interval", "100"])
    for name in a.resume_layouts.split(","):
        lay = LAYOUTS[name.strip()]
        run(f"resumed at {name.strip()}, iterations 7-9, async", lay, saved,
            work / f"resumed_{name.strip().replace(' ', '_')}", [*ucp, *asynchronous])
    # after a resume Megatron-LM logs at iteration 8 the mean of iterations 7 and 8 (its loss
    # accumulator is not reset after the first logged iteration of a resumed run): the uninterrupted
    # run's values compared with a resume's are 7, (7 + 8) / 2 and 9
    u = rows[1]["losses"]
    ref = {7: u[7], 8: (u[7] + u[8]) / 2, 9: u[9]} if all(i in u for i in (7, 8, 9)) else {}
    print(f"reference (uninterrupted, as a resume logs it): {ref}")
    print("\n| run | layout | rc | loss 7 | loss 8 | loss 9 | max abs diff vs uninterrupted "
          "| saved step | async commits |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lo = [f"{r['losses'].get(i, float('nan')):.6f}" for i in (7, 8, 9)]
        d = max((abs(v - ref[i]) for i, v in r["losses"].items() if i in ref), default=None)
        d = None if r is rows[1] else d
        r["max_abs_vs_uninterrupted"] = d
        lay = " ".join(f"{k.upper()}{v}" for k, v in r["layout"].items() if k != "first")
        print(f"| {r['case']} | {lay} | {r['rc']} | {' | '.join(lo)} | {'-' if d is None else f'{d:.2e}'} "
              f"| {r['saved_step']} | {'; '.join(r['commits']) or '-'} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0 if all(r["rc"] == 0 and not r["async_save_disabled"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
