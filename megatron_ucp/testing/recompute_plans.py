"""Recompute plans written by hand for tests and benchmarks (no megatron-core, no CPU shim: test
modules import this at collection without changing the process)."""

from __future__ import annotations

from megatron_ucp.recompute.plan import LayerPlan, Plan, Prediction


def make_plan(choices: list[str], pp: int, cfg: dict, layers_per_stage: list[int] | None = None,
              tp: int = 1, vpp: int | None = None) -> Plan:
    """A plan from one choice per layer: "none", "full" (window p2p_wait), "full:inline",
    "selective:core_attn" or "selective:core_attn+mlp"; layers split evenly unless given."""
    n = len(choices)
    layers_per_stage = layers_per_stage or [n // pp] * pp
    if vpp:  # interleaved: layer i is in virtual stage i // (layers per chunk), on rank v % pp
        per_chunk = layers_per_stage[0] // vpp
        stages = [(i // per_chunk) % pp for i in range(n)]
    else:
        stages = [s for s, k in enumerate(layers_per_stage) for _ in range(k)]
    layers = []
    for index, (choice, stage) in enumerate(zip(choices, stages)):
        kind, _, detail = choice.partition(":")
        if kind == "full":
            layers.append(LayerPlan(index, stage, "full", window=detail or "p2p_wait"))
        elif kind == "selective":
            layers.append(LayerPlan(index, stage, "selective", modules=detail.split("+")))
        else:
            layers.append(LayerPlan(index, stage, kind))
    model = {k: cfg[k] for k in ("hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
                                 "micro_batch_size", "vocab_size") if k in cfg}
    model["num_layers"] = n
    layout = {"tp": tp, "pp": pp, "dp": 1, "vpp": vpp, "micro_batch_size": cfg.get("micro_batch_size", 1),
              "global_batch_size": cfg.get("global_batch_size", 8)}
    zero = Prediction(step_s=0.0, peak_bytes=[0] * pp, activation_peak_bytes=[0] * pp)
    plan = Plan(model=model, layout=layout, memory_limit_bytes=0, layers=layers,
                layers_per_stage=layers_per_stage, predicted=zero, baseline={})
    plan.check("make_plan")
    return plan
