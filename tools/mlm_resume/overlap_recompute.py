#!/usr/bin/env python3
"""Stock Megatron-LM `pretrain_gpt.py` at PP2 with `--overlap-recompute PLAN.json` against
megatron's own `--recompute-*` and no recomputation: the logged `lm loss` and the trained state.

A 4-layer GPT (the resume tables' tiny flags, `--num-layers 4`, 2 layers per stage, one sample per
micro-batch: 4 micro-batches per iteration, so the 1F1B schedule has a warm-up, a steady state and
a cool-down) trains iterations 1-N from the same seed:

* `none`: no recomputation;
* megatron's full recompute: `--recompute-method block --recompute-num-layers 1` (the first layer
  of each stage: layers 0 and 2) and `--recompute-method uniform --recompute-num-layers 1` (all);
* `--overlap-recompute` plans (`megatron_ucp.testing.recompute_plans.make_plan`): `first` (layers 0
  and 2 full, as megatron's block run), `all` (every layer full, as megatron's uniform run) and
  `mixed` (full, selective core_attn and a full layer with window "inline"), through
  `megatron_ucp.megatron_lm.install()` on the unpatched tree (MLM_SRC) and, with `--patched-src`,
  through patches/megatron-lm-core_v0.19.0-universal.patch alone (no install()) and with it.

Recomputation changes no value: every run must log the `lm loss` of the `none` run bitwise (as
printed) and save bitwise the same fp32 weights and Adam moments at iteration N (read back with
megatron_ucp.formats). That the planned recomputation really ran is counted in each rank
(MLM_RECOMPUTE_COUNTS=1 in run_pretrain_resume.py): each layer's recomputed forwards (a forward
under grad inside a checkpoint recomputation), megatron's CheckpointFunction backwards (its full
layers and selective groups) and megatron-ucp's runtime counters (recomputed while waiting for
the output gradient / inline in the backward); each must equal what the plan or flags imply.

    MLM_SRC=/tmp/mlm019 PYTHONPATH=$PWD .venv312/bin/python tools/mlm_resume/overlap_recompute.py \\
        --patched-src /tmp/mlm019_lynx --work /tmp/ucp_overlap --json overlap.json

(MLM_SRC: a core_v0.19.0 tree with megatron/core moved aside, as for resume_table.py;
`--patched-src`: a copy with the patch applied by `patch -p1`.) core_v0.16.1 runs the same with
.venv, its tree, `MLM_HARNESS` and `--pythonpath` as resume_table.py does (and its own patch).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import resume_table as rt  # noqa: E402

from megatron_ucp.formats import open_source  # noqa: E402
from megatron_ucp.recompute import plan as recompute_plan  # noqa: E402
from megatron_ucp.spec import states_of  # noqa: E402
from megatron_ucp.testing.recompute_plans import make_plan  # noqa: E402

PP2 = dict(tp=1, pp=2, dp=1)
MODEL = ["--num-layers", "4", "--micro-batch-size", "1", "--save-interval", "1000"]
CFG = dict(hidden_size=32, num_attention_heads=4, ffn_hidden_size=128, seq_length=32, micro_batch_size=1,
           vocab_size=250, global_batch_size=4)
MICRO_BATCHES = 4  # global batch 4, one sample per micro-batch, DP1
# plan name -> (one choice per layer (make_plan), layers per stage); stage 1 is the last
PLANS = {"first": (["full", "none", "full", "none"], [2, 2]),
         "all": (["full", "full", "full", "full"], [2, 2]),
         "mixed": (["full", "selective:core_attn", "full:inline", "selective:core_attn"], [2, 2]),
         # an uneven partition: the run takes the plan's megatron_args
         # (--decoder-first/last-pipeline-num-layers)
         "uneven 3+1": (["full", "none", "full", "full"], [3, 1])}
# megatron's own recompute -> the layers it recomputes in full
MEGATRON = {"block": (["--recompute-granularity", "full", "--recompute-method", "block",
                       "--recompute-num-layers", "1"], [0, 2]),
            "uniform": (["--recompute-granularity", "full", "--recompute-method", "uniform",
                         "--recompute-num-layers", "1"], [0, 1, 2, 3])}


# misuse that must stop the run with megatron-ucp's PlanError: (name, plan, extra flags, message part)
REFUSALS = [("plan + megatron's --recompute-granularity", "first", MEGATRON["uniform"][0],
             "drop --recompute-granularity"),
            ("uneven plan without its partition flags", "uneven 3+1", [],
             "run with the plan's partition --decoder-first-pipeline-num-layers 3")]


def expected_counts(iters: int, plan: list[str] | None, megatron_full: list[int],
                    per_stage: list[int]) -> dict:
    """stage -> the counters a run must report: a full layer's forward is recomputed once per
    micro-batch; megatron's CheckpointFunction runs its full layers and selective groups;
    megatron-ucp recomputes a "p2p_wait" full layer in the wait except on the last stage, which
    receives no output gradient (there, and for window "inline", in the backward)."""
    n = iters * MICRO_BATCHES
    out = {}
    for stage in range(len(per_stage)):
        layers = range(sum(per_stage[:stage]), sum(per_stage[:stage + 1]))
        last = stage == len(per_stage) - 1
        choices = {i: (plan[i] if plan else ("full:megatron" if i in megatron_full else "none"))
                   for i in layers}
        full = [i for i, c in choices.items() if c.startswith("full")]
        out[stage] = {
            "layer_forwards_recomputed": {str(i): n for i in full},
            "megatron_checkpoint_backwards": n * sum(c == "full:megatron" or c.startswith("selective")
                                                     for c in choices.values()),
            "ucp_in_p2p_wait": 0 if last else n * sum(c == "full" for c in choices.values()),
            "ucp_inline": n * sum(c in ("full:inline",) or (last and c == "full")
                                  for c in choices.values())}
    return out


def trained_state(save: Path) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 master weight and Adam moments in the checkpoint saved at the end."""
    src = open_source(save)
    out = {}
    for name, entry in src.manifest.params.items():
        shape = tuple(entry.spec.shape)
        for state in states_of(entry.spec):
            out[f"{name}/{state}"] = src.read(name, state, (0,) * len(shape), shape).clone()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/megatron_ucp_overlap")
    ap.add_argument("--json", default=None)
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--patched-src", default=None,
                    help="a core_v0.19.0 tree with patches/megatron-lm-core_v0.19.0-universal.patch "
                         "applied (megatron/core moved aside): also run the patch route")
    ap.add_argument("--only", default=None, help="regex on the run name (the `none` run always runs)")
    ap.add_argument("--pythonpath", default=None,
                    help="PYTHONPATH of the runs (before this checkout), e.g. the triton that "
                         "core_v0.16.1's megatron.training imports (tools/mlm_resume/README.md)")
    ap.add_argument("--port", type=int, default=29880)
    a = ap.parse_args()
    if "MLM_SRC" not in os.environ:
        sys.exit("set MLM_SRC (see the docstring)")
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    python = os.environ.get("PYTHON", sys.executable)

    def runner(src: str, install: bool) -> dict:
        # MLM_HARNESS: core_v0.16.1's fixture harness shim, as in resume_table.py
        return {"python": python, "src": src, "harness": os.environ.get("MLM_HARNESS"),
                "pythonpath": a.pythonpath,
                "env": {"MLM_UCP_INSTALL": "1" if install else "0", "MLM_RECOMPUTE_COUNTS": "1"}}

    plan_files = {}
    plans = {}
    for name, (choices, per_stage) in PLANS.items():
        plan_files[name] = work / f"plan_{name.replace(' ', '_').replace('+', '_')}.json"
        plans[name] = make_plan(choices, 2, CFG, layers_per_stage=per_stage)
        recompute_plan.save(plans[name], plan_files[name])
    # (name, route, runner, flags, plan choices or None, megatron's full layers, layers per stage)
    uneven = plans["uneven 3+1"].megatron_args  # the 3+1 partition's reference
    runs = [("none", "stock", runner(os.environ["MLM_SRC"], False), [], None, [], [2, 2]),
            ("none 3+1", "stock", runner(os.environ["MLM_SRC"], False), uneven, None, [], [3, 1])]
    for key, (flags, layers) in MEGATRON.items():
        runs.append((f"megatron {key}", "stock", runner(os.environ["MLM_SRC"], False), flags, None, layers,
                     [2, 2]))
    routes = [("install()", os.environ["MLM_SRC"], True)]
    if a.patched_src:
        routes += [("patch", a.patched_src, False), ("patch + install()", a.patched_src, True)]
    for route, src, install in routes:
        for name, (choices, per_stage) in PLANS.items():
            runs.append((f"plan {name}", route, runner(src, install),
                         ["--overlap-recompute", str(plan_files[name]), *plans[name].megatron_args],
                         choices, [], per_stage))
    rows, port = [], a.port
    for name, route, run_with, flags, choices, megatron_full, per_stage in runs:
        label = f"{name} [{route}]"
        if a.only and not name.startswith("none") and not re.search(a.only, label):
            continue
        case = work / re.sub(r"[^A-Za-z0-9_.-]+", "_", label)
        case.mkdir()
        (case / "empty").mkdir()
        port += 1
        r = rt.run_megatron(run_with, case / "empty", case / "saved", PP2, "torch",
                            [*MODEL, "--train-iters", str(a.iters), *flags], case / "log.txt", port)
        text = Path(r["log"]).read_text()
        counts = {}
        for line in text.splitlines():
            if "> [recompute] " in line:
                c = json.loads(line.split("> [recompute] ", 1)[1])
                counts[c.pop("stage")] = c
        expected = expected_counts(a.iters, choices, megatron_full, per_stage)
        got = {s: {k: v for k, v in c.items() if k != "rank"} for s, c in counts.items()}
        r.update(case=name, route=route, partition=per_stage, counts=got, expected_counts=expected,
                 counts_ok=got == expected,
                 plan_line=next((line.strip() for line in text.splitlines()
                                 if "--overlap-recompute " in line and " full, " in line), None))
        r["state"] = trained_state(case / "saved") if r["rc"] == 0 else None
        rows.append(r)
        print(f"{label}: rc={r['rc']} losses={r['losses']} counts_ok={r['counts_ok']} "
              f"({r['seconds']:.0f} s)" + (f" error={r['error']}" if r["error"] else ""), flush=True)
        if not r["counts_ok"]:
            print(f"  counts {got}\n  expected {expected}", flush=True)
    refusals = []
    for name, plan_name, flags, message in REFUSALS:
        if a.only and not re.search(a.only, name):
            continue
        case = work / re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
        case.mkdir()
        (case / "empty").mkdir()
        port += 1
        r = rt.run_megatron(runner(os.environ["MLM_SRC"], True), case / "empty", case / "saved", PP2,
                            "torch", [*MODEL, "--train-iters", "1", "--overlap-recompute",
                                      str(plan_files[plan_name]), *flags], case / "log.txt", port)
        r.update(case=name, refused=r["rc"] != 0 and "PlanError" in (r["error"] or "")
                 and message in r["error"])
        refusals.append(r)
        print(f"{name} [install()]: rc={r['rc']} refused as expected={r['refused']}: {r['error']}",
              flush=True)
    states = [r.pop("state") for r in rows]
    # each partition's reference: the run without recomputation (another partition initialises
    # the stages' layers from other RNG streams)
    refs = {tuple(r["partition"]): (r, st) for r, st in zip(rows, states) if r["case"].startswith("none")}
    iters = list(range(1, a.iters + 1))
    print(f"\n| run | route | partition | {' | '.join(f'loss {i}' for i in iters)} | losses = reference | "
          "trained state = reference | recomputed (stage 0; stage 1) | counters as planned |")
    print("|---|---|---|" + "---|" * len(iters) + "---|---|---|---|")
    for r, st in zip(rows, states):
        ref, rs = refs[tuple(r["partition"])]
        r["reference"] = ref["case"]
        r["losses_equal"] = r["losses"] == ref["losses"] and len(r["losses"]) == a.iters
        r["state_bitwise"] = bool(st is not None and rs is not None and st.keys() == rs.keys()
                                  and all(torch.equal(st[k], rs[k]) for k in rs))
        r["state_max_abs"] = (max((st[k] - rs[k]).abs().max().item() for k in rs)
                              if st is not None and rs is not None and st.keys() == rs.keys() else None)
        desc = []
        for s in (0, 1):
            c = r["counts"].get(s, {})
            parts = [f"L{i} x{n}" for i, n in c.get("layer_forwards_recomputed", {}).items()]
            if c.get("megatron_checkpoint_backwards"):
                parts.append(f"CheckpointFunction x{c['megatron_checkpoint_backwards']}")
            if c.get("ucp_in_p2p_wait"):
                parts.append(f"in p2p wait x{c['ucp_in_p2p_wait']}")
            if c.get("ucp_inline"):
                parts.append(f"inline x{c['ucp_inline']}")
            desc.append(", ".join(parts) or "-")
        lo = " | ".join(f"{r['losses'].get(i, float('nan')):.6f}" for i in iters)
        same = ("(reference)", "(reference)") if r is ref else (
            "yes" if r["losses_equal"] else "NO",
            "bitwise" if r["state_bitwise"] else f"max abs diff {r['state_max_abs']}")
        print(f"| {r['case']} | {r['route']} | {'+'.join(map(str, r['partition']))} | {lo} | "
              f"{same[0]} | {same[1]} | {'; '.join(desc)} | {'yes' if r['counts_ok'] else 'NO'} |")
    for r in rows:
        if r["plan_line"]:
            print(f"{r['case']} [{r['route']}] logged: {r['plan_line']}")
        if r["error"]:
            print(f"{r['case']} [{r['route']}] failed: {r['error']} ({r['log']})")
    for r in refusals:
        print(f"refused ({'as expected' if r['refused'] else 'NOT AS EXPECTED'}): {r['case']}: {r['error']}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows + refusals, indent=1, default=str))
    return 0 if all(r["rc"] == 0 and r["losses_equal"] and r["state_bitwise"] and r["counts_ok"]
                    for r in rows) and all(r["refused"] for r in refusals) else 1


if __name__ == "__main__":
    sys.exit(main())
