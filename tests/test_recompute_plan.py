"""Lynx simulator, planner, published profiles and `megatron-ucp plan-recompute` (no processes).

The simulator is checked against schedules worked out by hand (1F1B with and without overlapped
recomputation, processor sharing, the interleaved bubble) and against megatron-core's own schedule
table; the planner against an exhaustive search over every per-layer assignment and partition."""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import astuple

import pytest

from megatron_ucp.recompute import hardware, planner, schedule, simulator, stages
from megatron_ucp.recompute import plan as plan_io
from megatron_ucp.recompute.plan import LayerPlan
from megatron_ucp.recompute.profile import LinkCost, ModuleCost, Profile, StageEnds
from megatron_ucp.recompute.schedule import rank_ops
from megatron_ucp.recompute.simulator import (
    ChunkCost,
    chunk_costs,
    memory_terms,
    simulate,
    simulate_chunks,
)

GIB = 2**30


def synthetic_profile(num_layers: int = 8, compute_slots: int | None = None) -> Profile:
    """Costs chosen so that choices trade time against memory in different ratios."""
    mods = [("input_layernorm", 0.02, 0.04, 4), ("qkv", 0.3, 0.6, 20), ("core_attn", 0.2, 0.4, 60),
            ("proj", 0.1, 0.2, 8), ("pre_mlp_layernorm", 0.02, 0.04, 4), ("mlp", 0.5, 1.0, 30)]
    model = {"num_layers": num_layers, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128,
             "num_query_groups": 4, "seq_length": 32, "vocab_size": 256, "micro_batch_size": 1,
             "dtype": "fp32"}
    return Profile(device="synthetic", source="published", model=model, tp=1,
                   layer=[ModuleCost(n, f, b, a * 1000) for n, f, b, a in mods], layer_input_bytes=2000,
                   ends=StageEnds(0.05, 0.05, 3000, 0.4, 0.8, 40000), p2p=LinkCost(0.01, 1e9),
                   compute_slots=compute_slots)


def uniform(pp: int, fwd: float, bwd: float, rec: float = 0.0, kept: int = 0, overlap: int = 0,
            transient: int = 0) -> list:
    return [[ChunkCost(fwd, bwd, rec, kept, overlap, transient)] for _ in range(pp)]


# -- simulator: hand-computed schedules ------------------------------------------------------------

def test_1f1b_step_time_and_idle_windows_by_hand():
    # pp=2, 4 micro-batches, F=1, B=2, no p2p cost: (M + pp - 1)(F + B) = 15
    res = simulate_chunks(uniform(2, 1.0, 2.0, kept=10), 4, 0.0)
    assert res.step_s == 15.0
    assert res.windows == [[(2.0, 4.0), (12.0, 13.0)], [(0.0, 1.0), (13.0, 15.0)]]
    assert res.idle_s == [3.0, 3.0]
    assert res.activation_peak_bytes == [20, 10]  # min(pp - rank, M) micro-batches in flight
    # the same with a 0.5 s p2p hop, 2 micro-batches (worked out op by op)
    res = simulate_chunks(uniform(2, 1.0, 2.0), 2, 0.5)
    assert res.step_s == 10.0
    assert res.windows == [[(2.0, 5.0), (7.0, 8.0)], [(0.0, 1.5), (7.5, 10.0)]]
    assert [op[:3] for op in res.timeline[0]] == [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1)]


def test_overlapped_recompute_fills_the_wait_by_hand():
    # rank 0 recomputes one unit of forward per micro-batch: inline it lengthens B to 3; in the
    # p2p wait it runs as R before B and hides in rank 0's wait for the output gradient
    inline = [[ChunkCost(1.0, 3.0, 0.0, 7)], [ChunkCost(1.0, 2.0, 0.0, 5)]]
    overlapped = [[ChunkCost(1.0, 2.0, 1.0, 7, 4)], [ChunkCost(1.0, 2.0, 0.0, 5)]]
    assert simulate_chunks(inline, 4, 0.0).step_s == 18.0
    res = simulate_chunks(overlapped, 4, 0.0)
    assert res.step_s == 17.0
    assert [op[:3] for op in res.timeline[0][:5]] == [("F", 0, 0), ("F", 0, 1), ("R", 0, 0), ("B", 0, 0),
                                                      ("F", 0, 2)]
    assert res.timeline[0][2][3:] == (2.0, 3.0) and res.timeline[0][3][3:] == (4.0, 6.0)
    assert res.windows == [[(3.0, 4.0)], [(0.0, 1.0), (10.0, 11.0), (14.0, 17.0)]]
    # memory: two micro-batches kept on rank 0 plus the overlapped layers of one
    assert res.activation_peak_bytes == [2 * 7 + 4, 5]


def test_processor_sharing_by_hand():
    # pp=2, M=2, F=B=1 on ONE shared core: every op runs alone or at half speed; the 8 units of
    # work end at 8 (worked out op by op); on two cores (or dedicated devices) it takes 6
    chunks = uniform(2, 1.0, 1.0)
    shared = simulate_chunks(chunks, 2, 0.0, compute_slots=1)
    assert shared.step_s == pytest.approx(8.0, abs=1e-12)
    assert [t for op in shared.timeline[0] for t in op[3:]] == pytest.approx([0, 1, 1, 3, 4, 6, 7, 8])
    assert [t for op in shared.timeline[1] for t in op[3:]] == pytest.approx([1, 3, 3, 4, 4, 6, 6, 7])
    assert simulate_chunks(chunks, 2, 0.0).step_s == 6.0
    assert simulate_chunks(chunks, 2, 0.0, compute_slots=2).step_s == 6.0


def test_shared_with_enough_slots_equals_dedicated():
    chunks = [[ChunkCost(1.0 + r / 7, 2.0 + r / 5, 0.3 * (r % 2), 10)] for r in range(4)]
    dedicated = simulate_chunks(chunks, 9, 0.05)
    shared = simulate_chunks(chunks, 9, 0.05, compute_slots=4)
    assert dedicated.step_s == shared.step_s
    assert dedicated.windows == shared.windows
    assert simulate_chunks(chunks, 9, 0.05, compute_slots=3).step_s > dedicated.step_s


def test_interleaved_order_matches_megatron_core():
    import megatron_ucp.testing.cpu_shim  # noqa: F401, I001  (must precede megatron.core)
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table

    class Sizes:  # what get_pp_rank_microbatches reads from a P2PCommunicator
        def __init__(self, pp, rank, vpp):
            self.virtual_pipeline_model_parallel_size = vpp
            self.pp_group = type("G", (), {"size": lambda _: pp, "rank": lambda _: rank})()

    from megatron_ucp.recompute.schedule import schedule_table

    for pp, vpp, nmb in ((2, 2, 4), (4, 2, 8), (4, 3, 6), (3, 2, 5)):
        assert schedule_table(nmb, vpp, pp) == get_schedule_table(nmb, vpp, pp)
        for rank in range(pp):
            _, _, warmup, _ = get_pp_rank_microbatches(nmb, vpp, pp, p2p_communicator=Sizes(pp, rank, vpp))
            ops = [op for op in rank_ops(pp, rank, nmb, vpp) if op[0] != 1]  # without R
            kinds = [k for k, _, _ in ops]
            total = nmb * vpp
            if warmup < total:  # warm-up forwards, then one forward and one backward per step
                assert kinds[:warmup + 2] == [0] * (warmup + 1) + [2]
                assert kinds[warmup:2 * total - warmup] == [0, 2] * (total - warmup)
            else:
                assert kinds == [0] * total + [2] * total
            for kind in (0, 2):  # every (chunk, micro-batch) forward and backward exactly once
                assert sorted((c, mb) for k, c, mb in ops if k == kind) == sorted(
                    (c, mb) for c in range(vpp) for mb in range(nmb))
            for chunk in range(vpp):  # backwards of a chunk in its forward order
                fwd = [mb for k, c, mb in ops if k == 0 and c == chunk]
                assert [mb for k, c, mb in ops if k == 2 and c == chunk] == fwd
        # per-chunk costs f, b: the interleaved bubble is (pp - 1)(f + b) (1/vpp of 1F1B's)
        res = simulate_chunks([[ChunkCost(1.0, 2.0)] * vpp for _ in range(pp)], nmb, 0.0)
        if nmb % pp == 0:
            assert res.step_s == nmb * vpp * 3.0 + (pp - 1) * 3.0


def test_memory_terms_equal_the_walk():
    # the last rank's last chunk keeps `out` output-layer bytes, which its backward frees before it
    # re-creates the 17 transient bytes: below, equal to and above the transient
    for out in (13, 17, 40):
        for pp, nmb, vpp in ((4, 6, 1), (4, 8, 2), (2, 5, 3)):
            chunks = [[ChunkCost(1.0, 2.0, 0.5, 100 + 10 * r + (7 if (r, c) == (0, 0) else 0)
                                 + (out if (r, c) == (pp - 1, vpp - 1) else 0), 30, 17,
                                 out if (r, c) == (pp - 1, vpp - 1) else 0) for c in range(vpp)]
                      for r in range(pp)]
            walked = simulator._activation_peaks(schedule.op_schedule(pp, nmb, vpp), chunks)
            fast = simulate_chunks(chunks, nmb, 0.0, detail=False).activation_peak_bytes
            for r, terms in enumerate(memory_terms(pp, nmb, vpp)):
                kept, last_out = 100 + 10 * r, out if r == pp - 1 else 0
                expected = max(a * kept + (a0 * 7 if r == 0 else 0) + al * last_out + o * 30 + t * 17
                               + tl * max(0, 17 - last_out) for a, a0, al, o, t, tl in terms)
                assert walked[r] == expected
                assert fast[r] == expected


def test_layer_plans_cost_and_memory_model():
    prof = synthetic_profile(6)
    act, inp, out = prof.layer_act_bytes, prof.layer_input_bytes, prof.ends.output_act_bytes
    assert act - inp > out  # a re-created layer outweighs the output layer's kept bytes
    layers = [LayerPlan(0, 0, "none"), LayerPlan(1, 0, "selective", ["core_attn"]),
              LayerPlan(2, 1, "full", [], "inline"), LayerPlan(3, 1, "full", [], "p2p_wait"),
              LayerPlan(4, 2, "full", [], "p2p_wait"), LayerPlan(5, 2, "selective", ["core_attn"])]
    c0, c1, c2 = (row[0] for row in chunk_costs(prof, layers, [2, 2, 2]))
    ca = prof.module("core_attn")
    assert c0.kept_bytes == 2 * act - ca.act_bytes + prof.ends.embedding_act_bytes
    assert c0.bwd_s == pytest.approx(2 * prof.layer_bwd_s + ca.fwd_s + prof.ends.embedding_bwd_s)
    assert c0.transient_bytes == ca.act_bytes and c0.rec_s == 0 and c0.output_bytes == 0
    assert c1.kept_bytes == 2 * inp
    assert c1.rec_s == pytest.approx(prof.layer_fwd_s)
    assert c1.overlap_bytes == act - inp and c1.transient_bytes == act - inp
    # the last stage never waits for a gradient: its p2p_wait layer is recomputed inline (runtime)
    assert c2.kept_bytes == inp + act - ca.act_bytes + out and c2.output_bytes == out
    assert c2.rec_s == 0 and c2.overlap_bytes == 0
    assert c2.bwd_s == pytest.approx(2 * prof.layer_bwd_s + prof.layer_fwd_s + ca.fwd_s
                                     + prof.ends.output_bwd_s)
    assert c2.transient_bytes == act - inp
    res = simulate(prof, layers, [2, 2, 2], 4)
    # rank 0: 3 micro-batches in flight; rank 1: 2, plus the overlapped layer of one; the last
    # rank's backward frees the output layer's bytes before it re-creates a layer
    assert res.activation_peak_bytes == [3 * c0.kept_bytes + c0.transient_bytes,
                                         2 * c1.kept_bytes + c1.overlap_bytes + c1.transient_bytes,
                                         c2.kept_bytes - out + c2.transient_bytes]
    assert all(op[3] == op[4] for op in res.timeline[2] if op[0] == "R")  # no R work there
    # an output layer outweighing the re-created unit: the backward peaks where it starts
    big = simulator.ChunkCost(1.0, 2.0, kept_bytes=c2.kept_bytes + act, transient_bytes=act - inp,
                              output_bytes=out + act)
    assert simulate_chunks([[big]], 3, 0.0).activation_peak_bytes == [big.kept_bytes]


# -- planner -----------------------------------------------------------------------------------------

CHOICE_PLANS = {"none": ("none", [], None), "selective:core_attn": ("selective", ["core_attn"], None),
                "full:inline": ("full", [], "inline"), "full:p2p_wait": ("full", [], "p2p_wait")}


def exhaustive(prof: Profile, choices: list[str], pp: int, nmb: int) -> list[tuple]:
    """(step s, max per-GPU peak, partition) of EVERY per-layer assignment on every partition.

    A stage's costs depend only on its own layers, so each stage's ChunkCost is computed once per
    assignment of that stage's layers (by the simulator's own chunk_costs) and every combination
    of the stages' assignments is simulated (memoised on identical cost vectors)."""
    num_layers, results, cache = prof.model["num_layers"], [], {}
    p2p = prof.p2p.time(prof.boundary_bytes)
    for part in planner.megatron_partitions(num_layers, pp):
        first = [sum(part[:s]) for s in range(pp)]
        static = planner.static_bytes(prof.model, prof.tp, 1, part)
        per_stage = []
        for s, n in enumerate(part):
            costs = []
            for combo in itertools.product(choices, repeat=n):
                layers = [LayerPlan(i, t, "none") for t, m in enumerate(part) for i in
                          range(first[t], first[t] + m)]
                for j, c in enumerate(combo):
                    layers[first[s] + j] = LayerPlan(first[s] + j, s, *CHOICE_PLANS[c])
                cost = chunk_costs(prof, layers, part)[s][0]
                costs.append((cost, astuple(cost)))
            per_stage.append(costs)
        for row in itertools.product(*per_stage):
            key = tuple(k for _, k in row)
            if key not in cache:
                cache[key] = simulate_chunks([[c] for c, _ in row], nmb, p2p, prof.compute_slots,
                                             detail=False)
            res = cache[key]
            results.append((res.step_s, max(s + a for s, a in zip(static, res.activation_peak_bytes)),
                            part))
    return results


@pytest.mark.parametrize("layers,pp,nmb,slots,choices", [
    (8, 2, 4, None, ["none", "selective:core_attn", "full:p2p_wait"]),
    (8, 2, 4, None, ["none", "full:inline", "full:p2p_wait"]),
    (6, 3, 6, None, ["none", "selective:core_attn", "full:inline", "full:p2p_wait"]),
    (6, 3, 4, 2, ["none", "full:inline", "full:p2p_wait"]),  # 3 ranks share 2 cores
])
def test_planner_equals_exhaustive_search(layers, pp, nmb, slots, choices):
    prof = synthetic_profile(layers, slots)
    results = exhaustive(prof, choices, pp, nmb)
    peaks = sorted({r[1] for r in results})
    for q in (0.0, 0.02, 0.08, 0.2, 0.45, 1.0):  # limits from the tightest that fits to "all fit"
        limit = peaks[round(q * (len(peaks) - 1))]
        best = min(r[0] for r in results if r[1] <= limit)
        got = planner.plan(prof, pp=pp, dp=1, global_batch_size=nmb, memory_limit_bytes=limit,
                           choices=choices)
        assert got.predicted.step_s == pytest.approx(best, rel=1e-12), (limit, got.layers_per_stage)
        assert max(got.predicted.peak_bytes) <= limit
    with pytest.raises(planner.NothingFitsError) as e:
        planner.plan(prof, pp=pp, dp=1, global_batch_size=nmb, memory_limit_bytes=peaks[0] - 1,
                     choices=choices)
    assert e.value.min_limit_bytes == peaks[0]  # exactly the least memory any assignment needs


def test_nothing_fits_gives_the_smallest_limit_that_fits():
    model = hardware.load_model_config("configs/recompute/gpt-13b.yaml")
    prof = hardware.published_profile(model, 8, 4, "A100-80GB")
    kwargs = {"pp": 8, "dp": 1, "global_batch_size": 64, "model": {**model, "micro_batch_size": 4}}
    with pytest.raises(planner.NothingFitsError) as e:
        planner.plan(prof, memory_limit_bytes=2 * GIB, **kwargs)
    need = e.value.min_limit_bytes
    assert need > 2 * GIB
    assert f"{math.ceil(need / GIB * 100) / 100:.2f} GiB" in str(e.value)
    fits = planner.plan(prof, memory_limit_bytes=need, **kwargs)
    assert max(fits.predicted.peak_bytes) <= need
    with pytest.raises(planner.NothingFitsError):
        planner.plan(prof, memory_limit_bytes=int(0.99 * need), **kwargs)


def test_plan_json_round_trip(tmp_path):
    prof = synthetic_profile(8)
    for vpp in (None, 2):
        p = planner.plan(prof, pp=2, dp=1, global_batch_size=4, memory_limit_bytes=2_900_000, vpp=vpp)
        assert any(lp.recompute != "none" for lp in p.layers)  # memory binds: a real plan
        p.check()
        plan_io.save(p, tmp_path / "plan.json")
        back = plan_io.load(tmp_path / "plan.json")
        assert back.to_json() == p.to_json()
        # the stored prediction is what the public simulator says of the stored layers
        res = simulate(prof, back.layers, back.layers_per_stage, 4, vpp)
        assert res.step_s == back.predicted.step_s
        assert res.activation_peak_bytes == back.predicted.activation_peak_bytes
        if vpp:
            assert all(lp.window != "p2p_wait" for lp in back.layers)  # runtime: 1F1B only


def test_search_time_96_layers():
    model = {"num_layers": 96, "hidden_size": 12288, "num_attention_heads": 96, "seq_length": 2048,
             "vocab_size": 51200, "sequence_parallel": True, "dtype": "bf16"}
    prof = hardware.published_profile(model, 8, 1, "H100-80GB")
    for pp, limit_gib in ((16, 40), (8, 60)):
        t0 = time.process_time()
        p = planner.plan(prof, pp=pp, dp=1, global_batch_size=64, memory_limit_bytes=limit_gib * GIB)
        cpu_s = time.process_time() - t0
        # reported, not asserted (timings are noisy on a shared box)
        print(f"\n96 layers, pp {pp}, 64 micro-batches, {limit_gib} GiB: search {p.search_s:.3f} s wall, "
              f"{cpu_s:.3f} s CPU, speedup {planner.speedup(p):.3f}")
        assert max(p.predicted.peak_bytes) <= limit_gib * GIB


# -- published profile and static memory ------------------------------------------------------------

def test_published_activation_bytes_follow_korthikanti():
    model = hardware.load_model_config("configs/recompute/gpt-13b.yaml")
    s, h, a = model["seq_length"], model["hidden_size"], model["num_attention_heads"]
    for tp, sp, b in ((8, True, 2), (4, False, 1), (1, False, 1)):
        prof = hardware.published_profile({**model, "sequence_parallel": sp}, tp, b)
        sbh = s * b * h
        if sp:  # Table 2, tensor + sequence parallel: sbh/t (34 + 5as/h)
            expected = sbh * (34 + 5 * a * s / h) / tp
        else:  # tensor parallel only: sbh (10 + 24/t + 5as/(ht))
            expected = sbh * (10 + 24 / tp + 5 * a * s / (h * tp))
        assert prof.layer_act_bytes == pytest.approx(expected, rel=1e-9)
        assert prof.source == "published" and "Korthikanti" in prof.notes
        assert prof.module("core_attn").act_bytes == pytest.approx(5 * a * s * s * b / tp)


def test_static_memory_formula():
    model = hardware.normalize_model({"num_layers": 2, "hidden_size": 8, "num_attention_heads": 2,
                                      "seq_length": 4, "vocab_size": 16, "dtype": "bf16"})
    layer = (8 * 24 + 24) + (8 * 8 + 8) + (8 * 32 + 32) + (32 * 8 + 8) + 2 * 16
    params = stages.stage_params(model, 1, [1, 1])
    assert params == [layer + 16 * 8 + 4 * 8, layer + 16 + 16 * 8]  # embedding+pos / norm+output
    assert planner.static_bytes(model, 1, 4, [1, 1]) == [math.ceil(p * (2 + 4 + 12 / 4)) for p in params]
    fp32 = {**model, "dtype": "fp32"}
    assert planner.static_bytes(fp32, 1, 2, [1, 1]) == [math.ceil(p * (4 + 4 + 8 / 2)) for p in params]


# -- command line ------------------------------------------------------------------------------------

def test_cli_plans_13b(tmp_path, capsys):
    from megatron_ucp.cli import main

    out = tmp_path / "plan.json"
    args = ["plan-recompute", "--config", "configs/recompute/gpt-13b.yaml", "--tp", "8", "--pp", "8",
            "--dp", "1", "--micro-batch", "4", "--global-batch", "512", "--memory-gib", "8", "--out",
            str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "Megatron's best under the same limit" in text and "speedup" in text
    p = plan_io.load(out)
    assert p.layout["pp"] == 8 and len(p.layers) == 40 and max(p.predicted.peak_bytes) <= 8 * GIB
    assert p.baseline["setting"] is not None and planner.speedup(p) >= 1.0
    # nothing fits: say so, with the smallest limit that does
    assert main([*args[:-4], "--memory-gib", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "nothing fits in 1.00 GiB" in err and "smallest memory limit" in err
    # a measured profile must be at --tp
    prof = hardware.published_profile(hardware.load_model_config("configs/recompute/gpt-13b.yaml"), 4, 4)
    prof.source = "measured"
    from megatron_ucp.recompute import profile as profile_io

    profile_io.save(prof, tmp_path / "prof.json")
    assert main([*args, "--profile", str(tmp_path / "prof.json")]) == 2
    assert "taken at TP 4, not --tp 8" in capsys.readouterr().err
