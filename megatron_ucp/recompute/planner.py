"""Lynx planner: per-layer recompute choices, windows and the stage partition under a memory limit.

Identical layers (Lynx's heuristic, arXiv 2406.08756): the choices are solved for ONE layer and
reused - on a stage, only how many layers take each choice matters for its cost and memory, not
which layers. Choices per layer: "none", "selective:<groups>" (a non-empty subset of
profile.SELECTIVE, megatron-core's per-layer in-place recompute), "full:inline" (megatron's own
full recompute, right before the layer's backward) and "full:p2p_wait" (the same recomputation
issued while the stage waits for the output gradient; the runtime supports it only in the
non-interleaved schedule, so vpp plans never use it; the last stage never waits for a gradient, so
there it is recomputed inline and costs as "full:inline" - the planner labels those layers inline
unless "full:inline" is not an allowed choice).

The pieces: `stages` (choices, partitions, static memory), `search` (per-stage options, the
partitions, coordinate descent: its docstring has the three steps and where they are not
exhaustive), `baseline` (Megatron-LM's best setting), all scored by `simulator`.
"""

from __future__ import annotations

import math
import time

from megatron_ucp.recompute.baseline import megatron_best
from megatron_ucp.recompute.plan import Plan
from megatron_ucp.recompute.profile import Profile
from megatron_ucp.recompute.search import Search, choose, layer_plans
from megatron_ucp.recompute.simulator import simulate
from megatron_ucp.recompute.stages import (
    GIB,
    NothingFitsError,
    PlannerError,
    all_choices,
    megatron_partitions,
    num_microbatches,
    selective_names,
    static_bytes,
)


def plan(profile: Profile, *, pp: int, dp: int, global_batch_size: int, memory_limit_bytes: int,
         num_layers: int | None = None, vpp: int | None = None, choices: list[str] | None = None,
         model: dict | None = None, layers_per_stage: list[int] | None = None) -> Plan:
    """Search the recompute plan and stage partition (module docstring); raise NothingFitsError
    with the smallest limit that fits when none does.

    `model` (default: the profile's) gives the parameter counts for static memory and goes into
    the plan; `num_layers` defaults to the model's. The micro-batch is the profile's.
    `layers_per_stage` fixes the partition (default: search every one megatron-LM accepts)."""
    started = time.perf_counter()
    model = dict(model or profile.model)
    num_layers = int(num_layers or model.get("num_layers") or 0)
    if num_layers < 1:
        raise PlannerError("the number of layers is unknown: the profile's model has no "
                           "'num_layers'; pass num_layers (the CLI takes it from --config)")
    if pp < 1 or dp < 1:
        raise PlannerError(f"pp and dp must be >= 1 (got pp={pp}, dp={dp})")
    if num_layers < pp:
        raise PlannerError(f"{num_layers} layers cannot fill {pp} pipeline stages")
    vpp = vpp if vpp and vpp > 1 else None
    if vpp and pp < 2:
        raise PlannerError(f"--vpp {vpp} needs --pp >= 2 (an interleaved schedule has pipeline stages)")
    choices = list(choices or all_choices(model))
    unknown = sorted(set(choices) - set(all_choices()))
    if unknown:
        raise PlannerError(f"unknown recompute choice(s) {unknown}; known: {all_choices()}")
    if choices != [c for c in choices if c in all_choices(model)]:
        raise PlannerError(f"recompute choice(s) {sorted(set(choices) - set(all_choices(model)))} "
                           "cannot run on this model with megatron-core 0.16.1 (see "
                           f"stages.runnable_groups); runnable: {all_choices(model)}")
    if not any(c in choices for c in ("none", "full:inline", "full:p2p_wait", *selective_names())):
        raise PlannerError("no recompute choice left to plan with")
    micro = int(profile.model.get("micro_batch_size", 1))
    nmb = num_microbatches(global_batch_size, micro, dp)
    if vpp:
        choices = [c for c in choices if c != "full:p2p_wait"]
        if not choices:
            raise PlannerError("the interleaved schedule (vpp) cannot overlap recomputation with "
                               "p2p waits (runtime limitation); allow another choice")
    search = Search(profile, model, pp, dp, num_layers, nmb, int(memory_limit_bytes), vpp, choices)
    partitions = megatron_partitions(num_layers, pp, vpp)
    if layers_per_stage is not None:
        if list(layers_per_stage) not in partitions:
            raise PlannerError(f"layers_per_stage {layers_per_stage} is not a partition megatron-LM "
                               f"accepts for {num_layers} layers on {pp} stages"
                               f"{f' x {vpp} chunks' if vpp else ''}")
        partitions = [list(layers_per_stage)]
    chosen = choose(search, partitions)
    if chosen is None:
        need = min(max(search.limit - search.budget(r, n) + search.min_activation(r, n)
                       for r, n in enumerate(part)) for part in partitions)
        need = int(math.ceil(need))
        raise NothingFitsError(
            f"nothing fits in {memory_limit_bytes / GIB:.2f} GiB per GPU: the smallest memory limit "
            f"any plan fits is {math.ceil(need / GIB * 100) / 100:.2f} GiB ({need} bytes; static "
            "weights/grads/optimizer + activations); raise --memory-gib, or add pipeline/tensor/"
            "data parallelism or a smaller micro-batch", need)
    part, options, (searched_s, _) = chosen
    layers = layer_plans(search, part, options)
    result = simulate(profile, layers, part, nmb, vpp)  # the plan as the runtime will see it
    predicted = result.prediction(static_bytes(search.model, profile.tp, dp, part))
    if (max(predicted.peak_bytes) > memory_limit_bytes
            or abs(predicted.step_s - searched_s) > 1e-9 * searched_s):
        raise PlannerError(f"internal error: the per-layer plan simulates to {predicted.step_s} s and "
                           f"{max(predicted.peak_bytes)} bytes, the search said {searched_s} s within "
                           f"{memory_limit_bytes} bytes")
    baseline = megatron_best(profile, search.model, pp, dp, nmb, int(memory_limit_bytes), vpp)
    layout = {"tp": profile.tp, "pp": pp, "dp": dp, "micro_batch_size": micro,
              "global_batch_size": global_batch_size, "vpp": vpp, "num_microbatches": nmb}
    out = Plan(model=search.model, layout=layout, memory_limit_bytes=int(memory_limit_bytes),
               layers=layers, layers_per_stage=list(part), predicted=predicted, baseline=baseline,
               profile_device=profile.device, search_s=0.0)
    out.check("planner output")
    out.search_s = time.perf_counter() - started
    return out


def speedup(plan_: Plan) -> float | None:
    """Megatron's best step time / the plan's (None when no Megatron setting fits)."""
    base = plan_.baseline.get("predicted") if plan_.baseline else None
    if not base:
        return None
    return base["step_s"] / plan_.predicted.step_s


def stage_summary(layers: list) -> str:
    counts: dict[str, int] = {}
    for lp in layers:
        if lp.recompute == "full":
            name = f"full/{lp.window}"
        elif lp.recompute == "selective":
            name = "selective " + "+".join(lp.modules)
        else:
            name = "none"
        counts[name] = counts.get(name, 0) + 1
    order = sorted(counts, key=lambda n: (not n.startswith("full/p2p"), not n.startswith("full"),
                                          n == "none", n))
    return ", ".join(f"{n} x{counts[n]}" for n in order)


def setting_name(setting: dict | None) -> str:
    if setting is None:
        return "none fits"
    if setting.get("recompute_granularity") is None:
        return "no recompute"
    if setting["recompute_granularity"] == "selective":
        return "selective " + "+".join(setting["recompute_modules"])
    return f"full {setting['recompute_method']} {setting['recompute_num_layers']}"


def format_plan(p: Plan, name: str = "") -> str:
    """The plan as a readable table: per stage layers, choices, memory, idle; step time against
    Megatron's best setting; the Megatron-LM flags."""
    lay = p.layout
    gib = 2.0**30
    base = p.baseline or {}
    base_pred = base.get("predicted")
    lines = [f"Lynx recompute plan{' for ' + name if name else ''}: TP{lay['tp']} PP{lay['pp']} "
             f"DP{lay['dp']}{' VPP' + str(lay['vpp']) if lay.get('vpp') else ''}, micro-batch "
             f"{lay['micro_batch_size']}, global batch {lay['global_batch_size']} "
             f"({lay.get('num_microbatches', '?')} micro-batches), memory limit "
             f"{p.memory_limit_bytes / gib:.2f} GiB per GPU",
             f"profile: {p.profile_device}",
             f"{'stage':>5} {'layers':>6} {'peak GiB':>9} {'act GiB':>8} {'idle s':>8} "
             f"{'Megatron peak GiB':>17}  recompute per layer (window)"]
    for s, n in enumerate(p.layers_per_stage):
        mpeak = f"{base_pred['peak_bytes'][s] / gib:17.2f}" if base_pred else f"{'-':>17}"
        idle = p.predicted.idle_s[s] if p.predicted.idle_s else float("nan")
        lines.append(f"{s:>5} {n:>6} {p.predicted.peak_bytes[s] / gib:9.2f} "
                     f"{p.predicted.activation_peak_bytes[s] / gib:8.2f} {idle:8.3f} {mpeak}  "
                     f"{stage_summary(p.stage_layers(s))}")
    lines.append(f"predicted step time: {p.predicted.step_s:.4f} s (plan)")
    if base_pred:
        parts = "/".join(str(x) for x in base["layers_per_stage"])
        lines.append(f"Megatron's best under the same limit: {setting_name(base['setting'])} "
                     f"(layers {parts}): {base_pred['step_s']:.4f} s -> speedup "
                     f"{base_pred['step_s'] / p.predicted.step_s:.3f}x")
        lines.append("  Megatron-LM flags: " + (" ".join(base["flags"]) or "(none)"))
    else:
        lines.append("Megatron's best under the same limit: no Megatron-LM recompute setting fits")
    overlapped = any(lp.window == "p2p_wait" for lp in p.layers)
    flags = p.megatron_args + (["--overlap-recompute", "PLAN.json"] if p.layers else [])
    lines.append("plan's Megatron-LM flags: " + " ".join(flags)
                 + ("" if overlapped else "  (no layer overlapped: the plan's recompute is all inline/"
                    "selective)"))
    lines.append(f"search time: {p.search_s:.3f} s")
    return "\n".join(lines)
