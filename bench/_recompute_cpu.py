"""Simulator vs measurement on CPU: real megatron-core 1F1B training steps at PP2 and PP4 (gloo).

For one model (8 layers, hidden 256, seq 128, micro-batch 2, 8 micro-batches per step) and three
recompute settings - none; megatron-core's full recompute (recompute_granularity "full", method
"uniform", 1 layer per checkpoint); the overlapped plan (the same layers "full", run by
`runtime.forward_backward_func`, window "p2p_wait" where a stage waits for a gradient, "inline" on
the last stage, which never waits: that is what the runtime executes there) - it measures
- the step time: megatron-core's forward_backward_func (the schedule; the optimizer step is timed
  apart and not predicted), per step the slowest rank after a barrier, median over steps;
- the activation high-water mark per stage (ActivationCounter around one step's schedule),
and predicts both with `simulator.simulate` from a profile `profiler.profile_layer` measures on this
machine in the same run (one process, one thread; compute_slots = the cores here).

Every rank is one process with one thread (launch sets OMP_NUM_THREADS=1). With 2 cores, PP2 gives
each stage a core; PP4 puts 4 ranks on 2 cores, so a rank waiting for a gradient hands its core to
another rank's compute: the overlapped recompute then cannot shorten the step (the simulator models
this as processor sharing). The three settings run in one launch per PP size with their steps
interleaved, so load from other processes falls on all three alike.

Other processes on a shared host stretch the measured times. Per step the table records how many
cores they kept busy ("others": host busy CPU seconds from /proc/stat less the ranks' own CPU
seconds, over the step's window) and adds a second prediction on the cores left to the ranks
(pred*: compute_slots = cores - others). The plain prediction is the one to compare on a quiet
host; pred* is what can be checked on a busy one. Each rank's CPU seconds per step (which other
processes do not stretch) are also compared with its predicted compute: the profile's op costs
summed over the rank's ops (warm-up, 1F1B, cool-down, recomputations). The activation peaks do not
depend on load.

    .venv/bin/python bench/_recompute_cpu.py [--json F] [--pp 2 4] [--steps 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_ucp.recompute.plan import LayerPlan  # noqa: E402
from megatron_ucp.recompute.profile import Profile  # noqa: E402
from megatron_ucp.recompute.simulator import simulate  # noqa: E402
from megatron_ucp.testing.launch import launch  # noqa: E402

TARGET = "megatron_ucp.testing.recompute_profile"
MODEL = {"num_layers": 8, "hidden_size": 256, "num_attention_heads": 8, "ffn_hidden_size": 1024,
         "vocab_size": 512, "seq_length": 128, "micro_batch_size": 2, "dtype": "fp32"}
GLOBAL_BATCH = 16  # 8 micro-batches per step
MEGATRON_FULL = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
SETTINGS = ("none", "megatron_full", "overlapped")


def _choices(setting: str, num_layers: int, pp: int, last_stage: str = "inline") -> list[str]:
    """Per-layer make_plan choices of a setting (overlapped: p2p_wait, the last stage `last_stage`)."""
    per_stage = num_layers // pp
    if setting == "none":
        return ["none"] * num_layers
    if setting == "megatron_full":
        return ["full:inline"] * num_layers
    last = "full:inline" if last_stage == "inline" else "full"
    return ["full"] * (num_layers - per_stage) + [last] * per_stage


def _layer_plans(choices: list[str], pp: int) -> list[LayerPlan]:
    per_stage = len(choices) // pp
    plans = []
    for i, choice in enumerate(choices):
        kind, _, window = choice.partition(":")
        if kind == "full":
            plans.append(LayerPlan(i, i // per_stage, "full", window=window or "p2p_wait"))
        else:
            plans.append(LayerPlan(i, i // per_stage, "none"))
    return plans


def _rel(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas else float("nan")


def measure_profile(model: dict, warmup: int = 2, repeats: int = 7) -> Profile:
    """The profiler on this machine: one process (layer and ends), two for the links."""
    data = launch(1, f"{TARGET}:profile", {"model": model, "warmup": warmup, "repeats": repeats,
                                           "links": True})[0]
    return Profile.from_json(data, "profile measured by bench/_recompute_cpu.py")


def measure_settings(pp: int, settings: tuple, model: dict, global_batch: int, warmup: int,
                     steps: int) -> dict:
    """{setting: measured} at PP `pp`: one launch, the settings' steps interleaved."""
    cfg = {k: model[k] for k in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                                 "vocab_size", "seq_length", "micro_batch_size")}
    cfg["global_batch_size"] = global_batch
    runs = [{"name": setting, "extra": dict(MEGATRON_FULL) if setting == "megatron_full" else {},
             "plan": _choices(setting, model["num_layers"], pp) if setting == "overlapped" else None}
            for setting in settings]
    ranks = launch(pp, f"{TARGET}:timed_steps", {"layout": f"pp{pp}", "cfg": cfg, "runs": runs,
                                                 "warmup": warmup, "steps": steps})
    ranks.sort(key=lambda r: r["stage"])
    out = {}
    for j, setting in enumerate(settings):
        per_run = [r["runs"][j] for r in ranks]
        step_s, others = [], []
        for i in range(steps):
            per_rank = [r["steps"][i] for r in per_run]
            step_s.append(max(t["schedule_s"] for t in per_rank))
            # cores other processes kept busy while the ranks ran (host busy CPU less the ranks' own)
            window = per_rank[0]["window_s"]
            others.append(max(0.0, per_rank[0]["host_busy_s"] - sum(t["cpu_s"] for t in per_rank)) / window)
        out[setting] = {
            "step_s": statistics.median(step_s), "step_s_all": step_s,
            "other_cores": statistics.median(others), "other_cores_all": others,
            "optimizer_s": statistics.median(max(r["steps"][i]["optimizer_s"] for r in per_run)
                                             for i in range(steps)),
            "cpu_s": [statistics.median(t["cpu_s"] for t in r["steps"]) for r in per_run],
            "activation_peak_bytes": [r["activation_peak_bytes"] for r in per_run],
            "losses": per_run[-1]["losses"], "recompute_counts": [r["recompute_counts"] for r in per_run]}
    return out


def predict(profile: Profile, setting: str, pp: int, num_microbatches: int, last_stage: str = "inline",
            slots: float | None = None, dedicated: bool = False):
    """simulate() of a setting; `slots` replaces the profile's compute_slots (cores left to the
    ranks), dedicated=True gives every rank its own core."""
    layers = _layer_plans(_choices(setting, profile.model["num_layers"], pp, last_stage), pp)
    per_stage = profile.model["num_layers"] // pp
    if slots is not None or dedicated:
        profile = dataclasses.replace(profile, compute_slots=slots)
    return simulate(profile, layers, [per_stage] * pp, num_microbatches)


def measure_table(pps: tuple = (2, 4), model: dict | None = None, global_batch: int = GLOBAL_BATCH,
                  warmup: int = 2, steps: int = 3, settings: tuple = SETTINGS) -> dict:
    """Measured vs predicted step time and per-stage activation peak, per (pp, setting)."""
    model = dict(model or MODEL)
    num_microbatches = global_batch // model["micro_batch_size"]
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    profile = measure_profile(model)
    rows = []
    for pp in pps:
        measured = measure_settings(pp, settings, model, global_batch, warmup, steps)
        for setting in settings:
            meas = measured[setting]
            sim = predict(profile, setting, pp, num_microbatches)
            # per step, the same on the cores other processes left to the ranks (processor sharing)
            loaded = [predict(profile, setting, pp, num_microbatches,
                              slots=max(0.5, profile.compute_slots - others)).step_s
                      for others in meas["other_cores_all"]]
            loaded_err = [_rel(p, m) for p, m in zip(loaded, meas["step_s_all"])]
            # compute seconds per rank: the op costs alone (each rank on its own core), against the
            # ranks' CPU seconds, which other processes do not stretch
            work = predict(profile, setting, pp, num_microbatches, slots=None, dedicated=True).busy_s
            row = {"pp": pp, "setting": setting,
                   "measured_step_s": meas["step_s"], "predicted_step_s": sim.step_s,
                   "step_rel_err": _rel(sim.step_s, meas["step_s"]),
                   "measured_activation_peak_bytes": meas["activation_peak_bytes"],
                   "predicted_activation_peak_bytes": list(sim.activation_peak_bytes),
                   "peak_rel_err": [_rel(p, m) for p, m in zip(sim.activation_peak_bytes,
                                                              meas["activation_peak_bytes"])],
                   "measured_cpu_s": meas["cpu_s"], "predicted_cpu_s": list(work),
                   "cpu_rel_err": [_rel(p, m) for p, m in zip(work, meas["cpu_s"])],
                   "other_cores": meas["other_cores"],
                   "predicted_step_s_loaded": statistics.median(loaded),
                   "predicted_step_s_loaded_all": loaded,
                   "step_rel_err_loaded": statistics.median(loaded_err),
                   "step_rel_err_loaded_all": loaded_err,
                   "predicted_idle_s": list(sim.idle_s), "measured_step_s_all": meas["step_s_all"],
                   "other_cores_all": meas["other_cores_all"],
                   "measured_optimizer_s": meas["optimizer_s"], "losses": meas["losses"],
                   "recompute_counts": meas["recompute_counts"]}
            if setting == "overlapped":
                # the same plan with "p2p_wait" on the last stage too, as the simulator predicts it
                # (the runtime recomputes those inline, and the simulator costs them so: the same peak)
                wait = predict(profile, setting, pp, num_microbatches, last_stage="p2p_wait")
                row["predicted_activation_peak_bytes_last_stage_p2p_wait"] = wait.activation_peak_bytes[-1]
            rows.append(row)
    reference = {pp: next(r["losses"] for r in rows if r["pp"] == pp) for pp in pps}
    for r in rows:
        r["losses_equal_to_none"] = r["losses"] == reference[r["pp"]]
    worst_step = max(abs(r["step_rel_err"]) for r in rows)
    worst_peak = max(abs(e) for r in rows for e in r["peak_rel_err"])
    worst_cpu = max(abs(e) for r in rows for e in r["cpu_rel_err"])
    worst_loaded = max(abs(r["step_rel_err_loaded"]) for r in rows)
    return {"model": model, "num_microbatches": num_microbatches, "profile": profile.to_json(),
            "rows": rows, "worst_step_rel_err": worst_step, "worst_peak_rel_err": worst_peak,
            "worst_step_rel_err_loaded": worst_loaded, "worst_cpu_rel_err": worst_cpu,
            "within_15pct": worst_step <= 0.15 and worst_peak <= 0.15,
            "cores": profile.compute_slots, "load_average_before": load_before,
            "load_average_after": os.getloadavg(), "wall_s": time.perf_counter() - t0}


def print_table(table: dict) -> None:
    print(f"{'pp':>2} {'setting':<14} {'meas s':>7} {'pred s':>7} {'err':>6} {'others':>6} "
          f"{'pred*':>6} {'err*':>6}  {'cpu err':>7}  act peak MiB per stage: measured/predicted (err)")
    for r in table["rows"]:
        peaks = "  ".join(f"{m / 2**20:.2f}/{p / 2**20:.2f} ({e:+.1%})" for m, p, e in zip(
            r["measured_activation_peak_bytes"], r["predicted_activation_peak_bytes"], r["peak_rel_err"]))
        cpu = max(r["cpu_rel_err"], key=abs)
        print(f"{r['pp']:>2} {r['setting']:<14} {r['measured_step_s']:7.3f} {r['predicted_step_s']:7.3f} "
              f"{r['step_rel_err']:+6.1%} {r['other_cores']:6.2f} {r['predicted_step_s_loaded']:6.3f} "
              f"{r['step_rel_err_loaded']:+6.1%}  {cpu:+7.1%}  {peaks}")
    print(f"worst errors: step {table['worst_step_rel_err']:.1%}, step on the cores left "
          f"{table['worst_step_rel_err_loaded']:.1%}, CPU seconds per rank {table['worst_cpu_rel_err']:.1%}, "
          f"activation peak {table['worst_peak_rel_err']:.1%}; {table['cores']} cores, load average "
          f"{table['load_average_before'][0]:.2f} before, {table['load_average_after'][0]:.2f} after; "
          "others = cores other processes kept busy, pred* = predicted on the cores left, cpu err = "
          "worst rank's CPU seconds predicted vs measured")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write the table here")
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    table = measure_table(tuple(args.pp), warmup=args.warmup, steps=args.steps)
    print_table(table)
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1) + "\n")
    return table


if __name__ == "__main__":
    main()
