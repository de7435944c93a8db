"""Megatron-LM's own recompute settings, simulated: the baseline a plan is compared against.

Megatron's best (the baseline): none; selective with any subset of recompute-modules (core_attn
is its default); full/uniform with recompute_num_layers n dividing the layers of every chunk (one
checkpoint per n layers); full/block with n = 1.. (the first n layers of every chunk) - on the even
partition (or, when the layers do not split evenly, the most even ones megatron-LM accepts), the
fastest simulated setting that fits the limit.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict

from megatron_ucp.recompute.plan import LayerPlan
from megatron_ucp.recompute.profile import SELECTIVE, Profile
from megatron_ucp.recompute.simulator import ChunkCost, chunk_costs, chunk_layers, simulate_chunks
from megatron_ucp.recompute.stages import most_even_partitions, runnable_groups, static_bytes


def megatron_settings(layers_per_chunk_max: int, layers_per_chunk: list[int],
                      groups: list[str] | None = None) -> list[dict]:
    """Megatron-LM recompute settings: none, selective (each subset of `groups`, default all),
    full uniform n, full block n."""
    out = [{"recompute_granularity": None}]
    groups = sorted(SELECTIVE) if groups is None else sorted(groups)
    for n in range(1, len(groups) + 1):
        for c in itertools.combinations(groups, n):
            out.append({"recompute_granularity": "selective", "recompute_modules": list(c)})
    for n in range(1, layers_per_chunk_max + 1):
        if all(k % n == 0 for k in layers_per_chunk):
            out.append({"recompute_granularity": "full", "recompute_method": "uniform",
                        "recompute_num_layers": n})
    for n in range(1, layers_per_chunk_max):  # n = max is the same as uniform 1
        out.append({"recompute_granularity": "full", "recompute_method": "block",
                    "recompute_num_layers": n})
    return out


def megatron_flags(setting: dict) -> list[str]:
    if setting.get("recompute_granularity") is None:
        return []
    if setting["recompute_granularity"] == "selective":
        return ["--recompute-granularity", "selective", "--recompute-modules",
                *setting["recompute_modules"]]
    return ["--recompute-granularity", "full", "--recompute-method", setting["recompute_method"],
            "--recompute-num-layers", str(setting["recompute_num_layers"])]


def megatron_chunks(profile: Profile, setting: dict, layers_per_stage: list,
                    vpp: int | None) -> list[list[ChunkCost]]:
    """Per-chunk costs of a Megatron-LM recompute setting (block/uniform count per model chunk)."""
    granularity = setting.get("recompute_granularity")
    layers = [LayerPlan(i, 0, "none") for i in range(sum(layers_per_stage))]
    uniform = 1
    for r, ranges in enumerate(chunk_layers(layers_per_stage, vpp)):
        for idx in ranges:
            for j, i in enumerate(idx):
                lp = layers[i]
                lp.stage = r
                if granularity == "selective":
                    lp.recompute, lp.modules = "selective", list(setting["recompute_modules"])
                elif granularity == "full" and (setting["recompute_method"] == "uniform"
                                                or j < setting["recompute_num_layers"]):
                    lp.recompute, lp.window = "full", "inline"
    if granularity == "full" and setting["recompute_method"] == "uniform":
        uniform = setting["recompute_num_layers"]
    chunks = chunk_costs(profile, layers, layers_per_stage, vpp)
    if uniform > 1:  # one checkpoint per `uniform` layers: fewer kept inputs, a bigger re-created unit
        for r, ranges in enumerate(chunk_layers(layers_per_stage, vpp)):
            for c, idx in zip(chunks[r], ranges):
                c.kept_bytes -= (len(idx) - len(idx) // uniform) * profile.layer_input_bytes
                c.transient_bytes = uniform * profile.layer_act_bytes - profile.layer_input_bytes
    return chunks


def megatron_best(profile: Profile, model: dict, pp: int, dp: int, nmb: int, limit: int,
                  vpp: int | None = None) -> dict:
    """The fastest Megatron-LM recompute setting that fits `limit` (see module docstring)."""
    num_layers = model["num_layers"]
    p2p_s = profile.p2p.time(profile.boundary_bytes)
    best = None
    for part in most_even_partitions(num_layers, pp, vpp):
        per_chunk = [n // (vpp or 1) for n in part]
        static = static_bytes(model, profile.tp, dp, part)
        for setting in megatron_settings(max(per_chunk), per_chunk, runnable_groups(model)):
            res = simulate_chunks(megatron_chunks(profile, setting, part, vpp), nmb, p2p_s,
                                  profile.compute_slots)
            pred = res.prediction(static)
            if max(pred.peak_bytes) > limit:
                continue
            if best is None or pred.step_s < best["predicted"]["step_s"] * (1 - 1e-12):
                best = {"setting": setting, "layers_per_stage": part, "flags": megatron_flags(setting),
                        "predicted": asdict(pred)}
    if best is None:
        return {"setting": None, "predicted": None,
                "note": "no Megatron-LM recompute setting fits the memory limit"}
    return best
