"""Lynx planner vs Megatron's best recompute setting, simulated from published A100 / H100 figures.

Every number here is a SIMULATION (megatron_ucp/recompute/simulator.py) of megatron-core's 1F1B
schedule fed by a profile stated from published hardware figures (megatron_ucp/recompute/hardware.py:
peak bf16 FLOP/s x MFU 0.5, HBM and NVLink/InfiniBand bandwidths, Korthikanti et al.'s activation
bytes), not a measurement on a GPU. Rows: GPT 1.3B, 2.7B, 6.7B, 13B, 23B (configs/recompute/) at
TP8 with sequence parallelism, PP 4 / 8 / 16, DP 2 / 1 / 1 (a 64-GPU job; PP16: 128 GPUs), global
batch 512 sequences of 2048 tokens, micro-batch 4 and 16. Limits per row: 80 GiB (the GPU; with
TP8 memory binds there only at micro-batch 16 for the larger models), and two where memory binds,
between the smallest limit any plan fits (min_fit) and Megatron's no-recompute peak (none_peak):
min_fit + 0.5 x (none_peak - min_fit) (Megatron's selective recompute suffices) and
min_fit + 0.1 x (none_peak - min_fit) (Megatron needs full recompute).

Per limit: the planner's plan (per-layer choices, windows, recompute-aware partition), the planner
restricted to Megatron's even partition (what the choices alone give) and without the p2p_wait
window (what the overlap adds), and Megatron's best setting
(none / selective with any recompute-modules / full uniform n / full block n, even partition),
with simulated step times, speedups and per-stage peak memory.

    .venv/bin/python bench/bench_recompute.py [--gpu A100-80GB H100-80GB] [--json F] [--cpu]
                                              [--models gpt-1.3b ...] [--micro-batches 4 16]

--cpu adds the measured CPU table of bench/_recompute_cpu.py (PP2/PP4 on gloo), if that module exists.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_ucp.recompute import baseline, planner, stages  # noqa: E402
from megatron_ucp.recompute.hardware import load_model_config, published_profile  # noqa: E402
from megatron_ucp.recompute.simulator import simulate_chunks  # noqa: E402

GIB = 2**30
# (config, tp, pp, dp)
ROWS = [("gpt-1.3b", 8, 4, 2), ("gpt-2.7b", 8, 4, 2), ("gpt-6.7b", 8, 8, 1), ("gpt-13b", 8, 8, 1),
        ("gpt-23b", 8, 16, 1)]
MICRO_BATCHES = (4, 16)
GLOBAL_BATCH = 512
BINDING_POINTS = (0.5, 0.1)


def none_peak(profile, model: dict, pp: int, dp: int, nmb: int) -> int:
    """Megatron without recompute, most even partition: the largest per-GPU peak (static + act)."""
    peaks = []
    for part in stages.most_even_partitions(model["num_layers"], pp):
        chunks = baseline.megatron_chunks(profile, {"recompute_granularity": None}, part, None)
        res = simulate_chunks(chunks, nmb, profile.p2p.time(profile.boundary_bytes),
                                      profile.compute_slots)
        peaks.append(max(res.prediction(planner.static_bytes(model, profile.tp, dp, part)).peak_bytes))
    return min(peaks)


def bench_row(config: str, tp: int, pp: int, dp: int, gpu: str, micro_batch: int) -> dict:
    model = load_model_config(ROOT / "configs" / "recompute" / f"{config}.yaml")
    model["micro_batch_size"] = micro_batch
    profile = published_profile(model, tp, micro_batch, gpu)
    nmb = planner.num_microbatches(GLOBAL_BATCH, micro_batch, dp)
    try:
        planner.plan(profile, pp=pp, dp=dp, global_batch_size=GLOBAL_BATCH, memory_limit_bytes=0,
                     model=model)
        raise AssertionError("a zero memory limit cannot fit")
    except planner.NothingFitsError as e:
        min_fit = e.min_limit_bytes
    peak_none = none_peak(profile, model, pp, dp, nmb)
    # limits above the GPU's are left out (memory binds at 80 GiB already there)
    limits = [80 * GIB] + [int(min_fit + f * (peak_none - min_fit)) for f in BINDING_POINTS
                           if min_fit + f * (peak_none - min_fit) < 80 * GIB]
    even = stages.most_even_partitions(model["num_layers"], pp)
    row = {"model": config, "gpu": gpu, "profile": profile.device, "profile_source": profile.source,
           "tp": tp, "pp": pp, "dp": dp, "micro_batch": micro_batch, "global_batch": GLOBAL_BATCH,
           "num_microbatches": nmb, "min_fit_gib": min_fit / GIB, "none_peak_gib": peak_none / GIB,
           "limits": []}
    for limit in limits:
        t0 = time.process_time()
        p = planner.plan(profile, pp=pp, dp=dp, global_batch_size=GLOBAL_BATCH,
                         memory_limit_bytes=limit, model=model)
        cpu_s = time.process_time() - t0
        evens = []
        for part in even:
            try:
                evens.append(planner.plan(profile, pp=pp, dp=dp, global_batch_size=GLOBAL_BATCH,
                                          memory_limit_bytes=limit, model=model, layers_per_stage=part))
            except planner.NothingFitsError:
                pass
        p_even = min(evens, key=lambda x: x.predicted.step_s) if evens else None
        no_overlap = planner.plan(profile, pp=pp, dp=dp, global_batch_size=GLOBAL_BATCH,
                                  memory_limit_bytes=limit, model=model,
                                  choices=[c for c in planner.all_choices(model) if c != "full:p2p_wait"])
        base = p.baseline.get("predicted")
        entry = {
            "limit_gib": limit / GIB,
            "memory_binds": peak_none > limit,
            "plan_step_s": p.predicted.step_s,
            "plan_layers_per_stage": p.layers_per_stage,
            "plan_peak_gib": [b / GIB for b in p.predicted.peak_bytes],
            "plan_stages": [planner.stage_summary(p.stage_layers(s)) for s in range(pp)],
            "plan_megatron_args": p.megatron_args,
            "plan_even_partition_step_s": p_even.predicted.step_s if p_even else None,
            "plan_no_overlap_step_s": no_overlap.predicted.step_s,
            "overlapped_layers": sum(lp.window == "p2p_wait" for lp in p.layers),
            "megatron_best": planner.setting_name(p.baseline.get("setting")),
            "megatron_flags": p.baseline.get("flags"),
            "megatron_layers_per_stage": p.baseline.get("layers_per_stage"),
            "megatron_step_s": base["step_s"] if base else None,
            "megatron_peak_gib": [b / GIB for b in base["peak_bytes"]] if base else None,
            "speedup": base["step_s"] / p.predicted.step_s if base else None,
            "speedup_even_partition": (base["step_s"] / p_even.predicted.step_s
                                       if base and p_even else None),
            "speedup_no_overlap": base["step_s"] / no_overlap.predicted.step_s if base else None,
            "search_s": p.search_s,
            "search_cpu_s": cpu_s,
        }
        row["limits"].append(entry)
    return row


def print_rows(rows: list[dict]) -> None:
    print("SIMULATED step times from published figures (not measured); speedup = Megatron's best / plan")
    print(f"{'model':<9} {'gpu':<10} {'layout':<12} {'mb':>3} {'limit GiB':>9} {'binds':>5} "
          f"{'Megatron best':<33} {'Meg s':>7} {'plan s':>7} {'speedup':>7} {'even-part':>9} "
          f"{'no-overlap':>10}  plan partition")
    for row in rows:
        layout = f"TP{row['tp']}PP{row['pp']}DP{row['dp']}"
        for e in row["limits"]:
            sp = f"{e['speedup']:.3f}" if e["speedup"] else "-"
            spe = f"{e['speedup_even_partition']:.3f}" if e["speedup_even_partition"] else "-"
            spn = f"{e['speedup_no_overlap']:.3f}" if e["speedup_no_overlap"] else "-"
            meg = f"{e['megatron_step_s']:.3f}" if e["megatron_step_s"] else "-"
            print(f"{row['model']:<9} {row['gpu']:<10} {layout:<12} {row['micro_batch']:>3} "
                  f"{e['limit_gib']:9.2f} {'yes' if e['memory_binds'] else 'no':>5} "
                  f"{e['megatron_best']:<33} {meg:>7} {e['plan_step_s']:7.3f} {sp:>7} {spe:>9} {spn:>10}  "
                  f"{e['plan_layers_per_stage']}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", nargs="+", default=["A100-80GB", "H100-80GB"])
    p.add_argument("--models", nargs="+", default=[config for config, *_ in ROWS],
                   choices=[config for config, *_ in ROWS], help="rows to run (default: all)")
    p.add_argument("--micro-batches", nargs="+", type=int, default=list(MICRO_BATCHES))
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--cpu", action="store_true", help="add the measured CPU table (bench/_recompute_cpu.py)")
    args = p.parse_args(argv)
    rows = [bench_row(config, tp, pp, dp, gpu, mb) for gpu in args.gpu for mb in args.micro_batches
            for config, tp, pp, dp in ROWS if config in args.models]
    print_rows(rows)
    binding = [e["speedup"] for r in rows for e in r["limits"] if e["memory_binds"] and e["speedup"]]
    result = {"source": "simulated from published figures (megatron_ucp/recompute/hardware.py)",
              "micro_batches": args.micro_batches, "global_batch": GLOBAL_BATCH, "rows": rows,
              "speedup_where_memory_binds": {"min": min(binding, default=None),
                                             "max": max(binding, default=None)}}
    if args.cpu:
        try:
            from bench import _recompute_cpu
        except ImportError:
            result["cpu"] = "bench/_recompute_cpu.py is not there: no measured CPU table"
        else:
            result["cpu"] = _recompute_cpu.measure_table()
        if isinstance(result["cpu"], str) or not hasattr(_recompute_cpu, "print_table"):
            print(result["cpu"] if isinstance(result["cpu"], str) else json.dumps(result["cpu"], indent=1))
        else:
            _recompute_cpu.print_table(result["cpu"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
