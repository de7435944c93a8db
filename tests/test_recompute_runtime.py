"""megatron_ucp.recompute.runtime: overlapped recomputation inside megatron-core's 1F1B schedule.

Real megatron-core on CPU (gloo, cpu_shim) under `launch`: a tiny fp32 GPT with dropout on (so the
RNG states a recomputation restores matter), 8 micro-batches of 1 (warm-up, 1F1B steady state and
cool-down all happen). Per run one training step; every parameter's main_grad and every micro-batch
loss are compared bitwise with megatron-core's own full recompute (recompute_granularity="full",
method "uniform", one layer per checkpoint). The activation high-water mark (ActivationCounter) of
each stage must stay within the simulator's prediction for the same per-layer choices, from a
profile of the bytes measured on the same model.

Biases are off: megatron-core 0.16.1's selective "mlp" recompute hangs when the MLP returns its bias
parameter (see test_refusals); without them every SELECTIVE group but "layernorm" (needs Transformer
Engine) is exercised.
"""

from __future__ import annotations

from megatron_ucp.recompute.profile import MODULES, LinkCost, ModuleCost, Profile, StageEnds
from megatron_ucp.recompute.simulator import simulate
from megatron_ucp.testing.launch import launch
from megatron_ucp.testing.recompute_plans import make_plan

DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
CFG = {"hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128, "vocab_size": 256,
       "seq_length": 32, "micro_batch_size": 1, "global_batch_size": 8, "add_bias_linear": False,
       "extra": DROPOUT}
NUM_MICROBATCHES = 8
MEGATRON_FULL = {"name": "megatron_full", "extra": {"recompute_granularity": "full",
                                                    "recompute_method": "uniform",
                                                    "recompute_num_layers": 1}}
TARGET = "megatron_ucp.testing.recompute_scenarios:compare_runs"


def _profile(measured: list[dict]) -> Profile:
    """A profile whose bytes are the ones measured on this model (times do not matter here).

    Per module: what a selective group frees is what its recompute saves (none - selective); the
    rest of the layer goes to qkv. Ends from the first and the last stage."""
    layer = measured[0]["bytes"]
    freed = {"core_attn": layer["none"] - layer["selective:core_attn"],
             "mlp": layer["none"] - layer["selective:mlp"]}
    act = {m: freed.get(m, 0) for m in MODULES}
    act["qkv"] = layer["none"] - sum(act.values())
    costs = [ModuleCost(m, 1e-3, 2e-3, act[m]) for m in MODULES]
    ends = StageEnds(embedding_act_bytes=measured[0]["bytes"]["embedding"],
                     output_act_bytes=measured[-1]["bytes"]["output"])
    return Profile(device="cpu-gloo", source="measured", model=dict(CFG), tp=1, layer=costs,
                   layer_input_bytes=layer["layer_input"], ends=ends, p2p=LinkCost(1e-4, 1e9))


def _megatron_layers(name: str, num_layers: int) -> list[str]:
    return {"megatron_full": ["full:inline"] * num_layers, "megatron_none": ["none"] * num_layers}[name]


def _check(results: list[dict], runs: list[dict], pp: int, num_layers: int) -> dict:
    """Bitwise equality with runs[0], overlap counters and the memory bound, for every stage."""
    assert [r["stage"] for r in results] == list(range(pp))
    profile = _profile(results)
    peaks = {}
    for i, run in enumerate(runs):
        choices = run.get("plan") or _megatron_layers(run["name"], num_layers)
        plan = make_plan(choices, pp, CFG)
        for res in results:
            got = res["runs"][i]
            assert got["name"] == run["name"]
            assert got["differ"] == [] and got["max_abs_diff"] == 0.0, (run["name"], res["stage"], got)
            assert got["digest"] == res["runs"][0]["digest"]
            assert got["losses"] == res["runs"][0]["losses"]  # [] except on the last stage
            # overlap: p2p_wait layers of every stage but the last are recomputed in the wait
            # for their output gradient, once per micro-batch; everything else inline
            stage_layers = plan.stage_layers(res["stage"])
            waits = sum(lp.recompute == "full" and lp.window == "p2p_wait" for lp in stage_layers)
            fulls = sum(lp.recompute == "full" for lp in stage_layers)
            if run.get("plan"):
                in_wait = 0 if res["stage"] == pp - 1 else waits * NUM_MICROBATCHES
                assert got["counts"] == {"in_wait": in_wait,
                                         "inline": fulls * NUM_MICROBATCHES - in_wait}, (run, res)
        # memory: the measured high-water mark within the simulator's prediction, per stage
        predicted = simulate(profile, plan.layers, plan.layers_per_stage, NUM_MICROBATCHES)
        measured = [res["runs"][i]["peak"] for res in results]
        assert all(m <= p for m, p in zip(measured, predicted.activation_peak_bytes)), \
            (run["name"], measured, predicted.activation_peak_bytes)
        # and tight where the most micro-batches are in flight (the model is exact up to the
        # input and mask storages a recomputation shares with its checkpoint)
        assert measured[0] >= 0.95 * predicted.activation_peak_bytes[0], (run["name"], measured)
        peaks[run["name"]] = (measured, predicted.activation_peak_bytes)
    losses = results[-1]["runs"][0]["losses"]
    assert len(losses) == NUM_MICROBATCHES and all(loss > 0 for loss in losses)
    return peaks


def test_pp2_overlapped_recompute_is_bitwise_megatron_full_recompute():
    runs = [MEGATRON_FULL, {"name": "megatron_none"},
            {"name": "ours_full", "plan": ["full"] * 4},
            {"name": "ours_mixed", "plan": ["full", "full:inline", "selective:core_attn",
                                            "selective:core_attn+mlp"]},
            {"name": "no_dropout", "extra": {"hidden_dropout": 0.0, "attention_dropout": 0.0}}]
    results = launch(2, TARGET, {"layout": "pp2", "cfg": {**CFG, "num_layers": 4}, "runs": runs,
                                 "refusals": True})
    # dropout is really on: without it the numbers change (so the restored RNG states matter)
    assert results[-1]["runs"][-1]["losses"] != results[-1]["runs"][0]["losses"]
    for res in results:
        assert res["runs"][-1]["differ"]
        res["runs"].pop()
    peaks = _check(results, runs[:-1], pp=2, num_layers=4)
    # overlapping holds the recomputed layers of one micro-batch longer than megatron does
    assert peaks["ours_full"][0][0] > peaks["megatron_full"][0][0]
    _check_refusals(results)


def test_pp4_overlapped_recompute_is_bitwise_megatron_full_recompute():
    runs = [MEGATRON_FULL,
            {"name": "ours_full", "plan": ["full"] * 8},
            # per stage: [p2p_wait, inline], [selective, p2p_wait], [none, selective],
            # [p2p_wait on the last stage (no wait there: inline), selective]
            {"name": "ours_mixed", "plan": ["full", "full:inline", "selective:core_attn", "full", "none",
                                            "selective:mlp", "full", "selective:core_attn+mlp"]}]
    results = launch(4, TARGET, {"layout": "pp4", "cfg": {**CFG, "num_layers": 8}, "runs": runs,
                                 "refusals": False})
    _check(results, runs, pp=4, num_layers=8)


def _check_refusals(results: list[dict]) -> None:
    for res in results:
        ref = res["refusals"]
        assert "plan is for 6 layers" in ref["layer_count"] and "num_layers=4" in ref["layer_count"]
        assert "'layers_per_stage' [3, 1]" in ref["partition"]
        assert "--decoder-first-pipeline-num-layers 3" in ref["partition"]
        assert "'layout.tp' is 2" in ref["layout"]
        assert "drop --recompute-granularity" in ref["megatron_recompute"]
        assert "interleaved" in ref["vpp_p2p_wait"] and "'inline'" in ref["vpp_p2p_wait"]
        assert "selective 'mlp' hangs" in ref["mlp_with_bias"]
        assert "Transformer Engine" in ref["layernorm_without_te"]
        # an interleaved run with an inline plan is megatron's interleaved schedule, bitwise
        assert ref["vpp_inline_equal"]
    # rank 0 holds layers 0 and 2 (full, inline) of the interleaved model: 2 x 8 recomputations
    assert [r["refusals"]["vpp_inline_counts"] for r in results] == [
        {"in_wait": 0, "inline": 16}, {"in_wait": 0, "inline": 0}]

