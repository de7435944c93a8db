"""The planner's search over per-layer recompute choices and stage partitions (`planner.plan`
runs it).

Search (all scoring by `simulator.simulate_chunks`):
1. per stage and layer count, the options: for every number of full layers f and of them z in
   "p2p_wait", and every transient level (the largest re-created unit among the selective choices
   used), the cheapest count vector of the non-full choices whose kept bytes fit - found by one
   searchsorted in the Pareto fronts of (kept bytes, recompute s) per layer count, built by a DP
   over counts. Memory is checked exactly with the simulator's model (`simulator.memory_terms`)
   against limit - static bytes. The options are reduced to the Pareto set over (busy time, time on
   the backward's critical path): moving recompute from B into R never delays anything when each
   rank has its own device (with shared cores every distinct pair is kept instead);
2. partitions: every one megatron-LM accepts (--decoder-first/last-pipeline-num-layers, middle
   stages even; interleaved: even only). A 1F1B estimate (with a cheap lower bound to skip hopeless
   partitions) pre-selects PARTITIONS_RANKED, which are simulated with their least busy options;
   the best PARTITIONS_SIMULATED get a sweep over a shared bottleneck budget (each stage: the least
   critical-path time whose busy time stays within the budget);
3. the best is refined by coordinate descent over the stages' options (simulated), ties going to
   less activation memory.
Steps 2 and 3 are where the search is not exhaustive; tests/test_recompute_plan.py checks it against
an exhaustive search over every per-layer assignment and partition of small models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from megatron_ucp.recompute.plan import LayerPlan
from megatron_ucp.recompute.profile import SELECTIVE, Profile
from megatron_ucp.recompute.simulator import (
    ChunkCost,
    add_stage_ends,
    chunk_layers,
    memory_terms,
    simulate_chunks,
)
from megatron_ucp.recompute.stages import static_bytes

PARTITIONS_RANKED = 16  # partitions (best by estimate) simulated with their least-busy options
PARTITIONS_SIMULATED = 6  # of them, the best simulated, that get the budget sweep
BUDGETS_SIMULATED = 8  # bottleneck budgets tried per partition
DESCENT_PASSES = 3
SHARED_OPTIONS = 48  # stage options kept when ranks share cores (no Pareto pruning then)
KEY_STRIDE = 2**44  # > any kept-bytes total of one chunk (16 TiB)



@dataclass
class _Kind:
    """A non-full per-layer choice: recompute time added to the backward, bytes kept, re-created."""

    name: str
    modules: tuple
    extra_s: float
    kept: int
    transient: int


@dataclass
class _Option:
    """A stage's count vector (per chunk) and what it costs."""

    busy_s: float
    crit_s: float
    counts: dict  # kind name -> layers per chunk
    full: int  # full layers per chunk
    overlapped: int  # of them, in window p2p_wait
    chunk: ChunkCost  # per chunk, without the stage ends


class Search:
    """Shared state of one planning request (profile, layout, limit) and its caches."""

    def __init__(self, profile: Profile, model: dict, pp: int, dp: int, num_layers: int, nmb: int,
                 limit: int, vpp: int | None, choices: list[str]):
        self.profile, self.pp, self.dp, self.num_layers, self.nmb = profile, pp, dp, num_layers, nmb
        self.limit, self.vpp = limit, vpp or 1
        self.model = {**model, "num_layers": num_layers}
        self.p2p_s = profile.p2p.time(profile.boundary_bytes)
        self.lf, self.lb = profile.layer_fwd_s, profile.layer_bwd_s
        self.act, self.inp = profile.layer_act_bytes, profile.layer_input_bytes
        self.recreated = self.act - self.inp
        self.kinds = []
        for name in choices:
            if name == "none":
                self.kinds.append(_Kind("none", (), 0.0, self.act, 0))
            elif name.startswith("selective:"):
                groups = tuple(name.split(":", 1)[1].split("+"))
                mods = [m for grp in groups for m in SELECTIVE[grp]]
                sel_act = sum(profile.module(m).act_bytes for m in mods)
                self.kinds.append(_Kind(name, groups, sum(profile.module(m).fwd_s for m in mods),
                                        self.act - sel_act, sel_act))
        self.full_inline = "full:inline" in choices
        self.full_p2p = "full:p2p_wait" in choices and self.vpp == 1
        self.any_full = self.full_inline or self.full_p2p
        self.terms = memory_terms(pp, nmb, self.vpp)
        self.shared = profile.compute_slots is not None and profile.compute_slots < pp
        ends = profile.ends
        # kept bytes the backward frees before it re-creates anything (the output layer and loss,
        # last stage's last chunk: simulator.ChunkCost.output_bytes)
        self.out_bytes = [ends.output_act_bytes if s == pp - 1 else 0 for s in range(pp)]
        self.ends_s = [0.0] * pp
        self.ends_s[0] += ends.embedding_fwd_s + ends.embedding_bwd_s
        self.ends_s[-1] += ends.output_fwd_s + ends.output_bwd_s
        self._frontiers = self._nonfull_levels()
        self._pairs: dict = {}
        self._options: dict = {}
        self.sims = 0

    # -- one stage ---------------------------------------------------------------------------
    def _nonfull_levels(self) -> list[dict]:
        """Per transient level t (the non-full choices whose transient is <= t), the Pareto fronts of
        (kept bytes, recompute s) over their count vectors for k = 0, 1, ... layers, grown on demand
        by `_grow`. The fronts of all k are concatenated under the sort key k * KEY_STRIDE + kept
        bytes, so one searchsorted finds, for any (k, byte threshold), the cheapest count vector
        that keeps at most that many bytes."""
        levels = []
        for t in sorted({k.transient for k in self.kinds}) or [0]:  # [0]: full layers only
            kinds = [k for k in self.kinds if k.transient <= t]
            levels.append({"t": t, "kinds": kinds, "kmax": 0,
                           "step_kept": np.array([k.kept for k in kinds], dtype=np.int64),
                           "step_cost": np.array([k.extra_s for k in kinds]),
                           "last": (np.zeros(1, np.int64), np.zeros(1), np.zeros((1, len(kinds)), np.int64)),
                           "keys": np.zeros(1, np.int64), "offsets": [0, 1], "kept": np.zeros(1, np.int64),
                           "cost": np.zeros(1), "counts": np.zeros((1, len(kinds)), np.int64)})
        return levels

    def _grow(self, kmax: int) -> None:
        """Extend every level's fronts to kmax layers."""
        for level in self._frontiers:
            if level["kmax"] >= kmax:
                continue
            target = kmax
            unit = np.eye(len(level["kinds"]), dtype=np.int64)
            new = []
            pk, pc, pn = level["last"]
            for k in range(level["kmax"] + 1, target + 1):
                if not level["kinds"]:  # no non-full choice: no count vector of k >= 1 layers
                    pk, pc, pn = pk[:0], pc[:0], pn[:0]
                    new.append((k, pk, pc, pn))
                    continue
                kk = (pk[:, None] + level["step_kept"][None, :]).ravel()
                cc = (pc[:, None] + level["step_cost"][None, :]).ravel()
                nn = (pn[:, None, :] + unit[None, :, :]).reshape(-1, len(unit))
                order = np.lexsort((cc, kk))
                kk, cc, nn = kk[order], cc[order], nn[order]
                best_before = np.minimum.accumulate(np.concatenate(([np.inf], cc[:-1])))
                keep = cc < best_before - 1e-15
                pk, pc, pn = kk[keep], cc[keep], nn[keep]
                new.append((k, pk, pc, pn))
            level["last"], level["kmax"] = (pk, pc, pn), target
            level["keys"] = np.concatenate([level["keys"], *[k * KEY_STRIDE + f for k, f, _, _ in new]])
            level["kept"] = np.concatenate([level["kept"], *[f for _, f, _, _ in new]])
            level["cost"] = np.concatenate([level["cost"], *[c for _, _, c, _ in new]])
            level["counts"] = np.concatenate([level["counts"], *[n for _, _, _, n in new]])
            for _, f, _, _ in new:
                level["offsets"].append(level["offsets"][-1] + len(f))

    def budget(self, stage: int, nlayers: int) -> float:
        """Bytes left for activations on this stage: the limit less its static bytes."""
        key = ("budget", stage, nlayers)
        if key not in self._options:
            lps = [nlayers if s == stage else 0 for s in range(self.pp)]
            self._options[key] = self.limit - static_bytes(self.model, self.profile.tp, self.dp, lps)[stage]
        return self._options[key]

    def waits(self, stage: int) -> bool:
        """Does the stage wait for an output gradient before its backwards? Not the last one: its
        "p2p_wait" layers are recomputed inline (runtime), so they cost and keep as inline ones."""
        return stage < self.pp - 1

    def _fixed(self, stage: int, terms: tuple, overlapped, transient):
        """One memory term's bytes besides the kept ones: overlapped layers held (per chunk, the
        ones really overlapped), the transient re-created in B (the last stage's last chunk first
        frees its output layer's bytes), the stage ends' kept bytes."""
        _, n_first, n_last, holds_overlap, holds_transient, holds_transient_last = terms
        ends = self.profile.ends
        return (holds_overlap * overlapped * self.recreated + holds_transient * transient
                + holds_transient_last * np.maximum(0, transient - self.out_bytes[stage])
                + (n_first * ends.embedding_act_bytes if stage == 0 else 0)
                + n_last * self.out_bytes[stage])

    def _peak(self, stage: int, kept, overlapped, transient):
        """Activation peak of the stage (memory_terms) for per-chunk kept bytes, really overlapped
        layers per chunk and transient bytes (arrays broadcast)."""
        peak = None
        for terms in self.terms[stage]:
            value = terms[0] * kept + self._fixed(stage, terms, overlapped, transient)
            peak = value if peak is None else np.maximum(peak, value)
        return peak

    def _windows(self, nc: int, waits: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(full layers, of them in window p2p_wait) per chunk: every pair the allowed windows
        permit; on a stage that does not wait (p2p_wait = inline there) only one window."""
        if (nc, waits) in self._pairs:
            return self._pairs[(nc, waits)]
        counts = np.arange(nc + 1, dtype=np.int64)
        if self.full_inline and self.full_p2p and waits:
            full, overlapped = np.tril_indices(nc + 1)
        elif self.full_p2p and not self.full_inline:
            full, overlapped = counts, counts
        elif self.full_inline or self.full_p2p:
            full, overlapped = counts, np.zeros_like(counts)
        else:
            full, overlapped = counts[:1], counts[:1]
        self._pairs[(nc, waits)] = (full.astype(np.int64), overlapped.astype(np.int64))
        return self._pairs[(nc, waits)]

    def stage_options(self, stage: int, nlayers: int) -> list[_Option]:
        """Pareto set over (busy, critical-path time) of the count vectors of this stage whose
        activation peak fits limit - static bytes, sorted by busy time (empty: nothing fits)."""
        key = (stage, nlayers)
        if key in self._options:
            return self._options[key]
        budget = self.budget(stage, nlayers)
        nc = nlayers // self.vpp
        self._grow(nc)
        full, overlapped = self._windows(nc, self.waits(stage))
        held = overlapped if self.waits(stage) else np.zeros_like(overlapped)  # really overlapped
        offsets_cache = {}
        rows = []  # per level: (busy, crit, level, front index, full, overlapped)
        for li, level in enumerate(self._frontiers):
            t = level["t"]
            transient = np.where(held == full, t, max(t, self.recreated))
            # the largest kept bytes per chunk that fit: every memory term is linear in them
            room = np.full(len(full), np.inf)
            for terms in self.terms[stage]:
                room = np.minimum(room, (budget - self._fixed(stage, terms, held, transient)) / terms[0])
            threshold = np.floor(room - full * self.inp)
            threshold = np.clip(threshold, -1, KEY_STRIDE - 1).astype(np.int64)
            k = nc - full
            pos = np.searchsorted(level["keys"], k * KEY_STRIDE + threshold, side="right") - 1
            if li not in offsets_cache:
                offsets_cache[li] = np.asarray(level["offsets"])
            ok = pos >= offsets_cache[li][k]
            pos = np.where(ok, pos, 0)
            cost = level["cost"][pos]
            busy = self.vpp * (nc * (self.lf + self.lb) + cost + full * self.lf) + self.ends_s[stage]
            crit = busy - self.vpp * held * self.lf
            n = int(ok.sum())
            rows.append(np.stack([busy[ok], crit[ok], np.full(n, li), pos[ok], full[ok],
                                  overlapped[ok]], 1))
        table = np.concatenate(rows)
        if not len(table):
            self._options[key] = []
            return []
        table = table[np.lexsort((table[:, 1], table[:, 0]))]
        if self.shared:
            # R competes with the other ranks for the shared cores, so less overlap can be faster:
            # keep every distinct (busy, critical-path) pair, the least busy first
            _, first = np.unique(table[:, :2], axis=0, return_index=True)
            table = table[np.sort(first)][:SHARED_OPTIONS]
        else:
            best_before = np.minimum.accumulate(np.concatenate(([np.inf], table[:-1, 1])))
            table = table[table[:, 1] < best_before - 1e-12 * np.maximum(1.0, table[:, 1])]
        options = [self._option(*row, nc=nc, stage=stage) for row in table]
        self._options[key] = options
        return options

    def _option(self, busy, crit, level, pos, full, overlapped, nc: int, stage: int) -> _Option:
        level = self._frontiers[int(level)]
        pos, full, overlapped = int(pos), int(full), int(overlapped)
        held = overlapped if self.waits(stage) else 0  # p2p_wait layers really overlapped
        counts = {k.name: int(c) for k, c in zip(level["kinds"], level["counts"][pos]) if c}
        transient = max([k.transient for k in level["kinds"] if counts.get(k.name)], default=0)
        if full > held:
            transient = max(transient, self.recreated)
        chunk = ChunkCost(fwd_s=nc * self.lf,
                          bwd_s=nc * self.lb + float(level["cost"][pos]) + (full - held) * self.lf,
                          rec_s=held * self.lf, kept_bytes=int(level["kept"][pos]) + full * self.inp,
                          overlap_bytes=held * self.recreated, transient_bytes=transient)
        return _Option(float(busy), float(crit), counts, full, overlapped, chunk)

    def min_activation(self, stage: int, nlayers: int) -> float:
        """The smallest activation peak any count vector of this stage reaches."""
        key = ("least", stage, nlayers)
        if key in self._options:
            return self._options[key]
        nc = nlayers // self.vpp
        full, overlapped = self._windows(nc, self.waits(stage))
        if not self.waits(stage):  # p2p_wait is inline there
            overlapped = np.zeros_like(overlapped)
        least_memory = (overlapped == 0) | (overlapped == full)  # more overlap only adds bytes
        full, overlapped = full[least_memory], overlapped[least_memory]
        best = np.inf
        for level in self._frontiers:
            if not level["kinds"]:
                full, overlapped = full[full == nc], overlapped[full == nc]
            least = level["step_kept"].min() if level["kinds"] else 0
            kept = (nc - full) * least + full * self.inp  # least kept bytes
            t = level["t"]
            transient = np.where(overlapped == full, t, max(t, self.recreated))
            best = min(best, float(self._peak(stage, kept, overlapped, transient).min()))
        self._options[key] = best
        return best

    # -- whole pipeline ----------------------------------------------------------------------
    def chunks_of(self, options: list[_Option]) -> list[list[ChunkCost]]:
        ends = self.profile.ends
        out = []
        for r, opt in enumerate(options):
            row = []
            for c in range(self.vpp):
                cc = replace(opt.chunk)
                add_stage_ends(cc, ends, first=r == 0 and c == 0,
                               last=r == self.pp - 1 and c == self.vpp - 1)
                row.append(cc)
            out.append(row)
        return out

    def score(self, options: list[_Option]) -> tuple[float, int]:
        """(simulated step s, total activation peak): lower is better, memory breaks ties."""
        self.sims += 1
        res = simulate_chunks(self.chunks_of(options), self.nmb, self.p2p_s,
                              self.profile.compute_slots, detail=False)
        return (res.step_s, sum(res.activation_peak_bytes))

    def stage_bound(self, stage: int, nlayers: int) -> tuple[float, float]:
        """Lower bounds of (busy, critical-path time) of any option of this stage: no recompute, plus
        the bytes the kept activations must shed to fit, each at the cheapest recompute s per byte
        any choice offers (an LP relaxation: overlap and transient bytes only add memory)."""
        key = ("bound", stage, nlayers)
        if key not in self._options:
            nc = nlayers // self.vpp
            busy = self.vpp * nc * (self.lf + self.lb) + self.ends_s[stage]
            ends = self.profile.ends
            budget = self.budget(stage, nlayers)
            excess = max(((n_live * nc * self.act + (n_first * ends.embedding_act_bytes if stage == 0 else 0)
                           + (n_last * ends.output_act_bytes if stage == self.pp - 1 else 0) - budget)
                          / n_live) for n_live, n_first, n_last, *_ in self.terms[stage])
            rates = [k.extra_s / (self.act - k.kept) for k in self.kinds if self.act > k.kept]
            if self.any_full and self.recreated > 0:
                rates.append(self.lf / self.recreated)
            shed = self.vpp * max(0.0, excess) * min(rates, default=math.inf)
            self._options[key] = (busy + shed if shed < math.inf else math.inf, busy)
        return self._options[key]

    def estimate(self, options: list[_Option] | None, part: list[int]) -> float:
        """1F1B estimate used only to rank partitions: the longest of the paths where stage k is the
        bottleneck (M x its busy time) and every other stage adds its fill and drain (critical-path
        time); with options None, the same from `stage_bound` (a lower bound of it)."""
        if options is None:
            busy, crit = zip(*[self.stage_bound(r, n) for r, n in enumerate(part)])
        else:
            busy, crit = [o.busy_s for o in options], [o.crit_s for o in options]
        total_crit = sum(crit)
        est = max(self.nmb * b + (total_crit - c) / self.vpp for b, c in zip(busy, crit))
        est += 2 * (self.pp - 1) * self.p2p_s
        slots = self.profile.compute_slots
        if slots is not None and slots < self.pp:
            est = max(est, self.nmb * sum(busy) / slots)
        return est

    def fits_at_all(self, stage: int, nlayers: int) -> bool:
        key = ("fits", stage, nlayers)
        if key not in self._options:
            self._options[key] = self.min_activation(stage, nlayers) <= self.budget(stage, nlayers)
        return self._options[key]


def _better(a: tuple, b: tuple) -> bool:
    """Is score a better than b: faster beyond float noise, or as fast with less memory."""
    tol = 1e-9 * max(1.0, b[0])
    return a[0] < b[0] - tol or (abs(a[0] - b[0]) <= tol and a[1] < b[1])


def choose(search: Search, partitions: list[list[int]]) -> tuple | None:
    """Best (partition, per-stage options, score) over the given partitions (None: nothing fits)."""
    # Rank partitions by the 1F1B estimate, computing stage options only while a partition's lower
    # bound (`Search.stage_bound`) can still beat the PARTITIONS_RANKED-th best.
    feasible = [i for i, part in enumerate(partitions)
                if all(search.fits_at_all(r, n) for r, n in enumerate(part))]
    bounds = sorted((search.estimate(None, partitions[i]), i) for i in feasible)
    ranked: list = []
    for bound, i in bounds:
        if len(ranked) >= PARTITIONS_RANKED and bound > ranked[PARTITIONS_RANKED - 1][0]:
            break
        part = partitions[i]
        opts = [search.stage_options(r, n) for r, n in enumerate(part)]
        if all(opts):
            ranked.append((search.estimate([o[0] for o in opts], part), i, part, opts))
            ranked.sort(key=lambda x: x[:2])
    if not ranked:
        return None
    # the estimate only pre-selects: the partitions that get the budget sweep are the best simulated
    simulated = sorted((search.score([o[0] for o in opts]), i, part, opts)
                       for _, i, part, opts in ranked[:PARTITIONS_RANKED])
    score, _, part, opts = simulated[0]
    best = (part, [o[0] for o in opts], score, opts)
    for _, _, part, opts in simulated[:PARTITIONS_SIMULATED]:
        floor = max(o[0].busy_s for o in opts)
        budgets = sorted({o.busy_s for stage in opts for o in stage if o.busy_s >= floor})
        for budget in budgets[:BUDGETS_SIMULATED]:
            pick = []
            for stage in opts:
                within = [o for o in stage if o.busy_s <= budget * (1 + 1e-12)]
                pick.append(min(within, key=lambda o: (o.crit_s, o.busy_s)) if within else stage[0])
            score = search.score(pick)
            if _better(score, best[2]):
                best = (part, pick, score, opts)
    part, pick, score, opts = best
    for _ in range(DESCENT_PASSES):  # coordinate descent over the stages' Pareto options
        improved = False
        for r, stage in enumerate(opts):
            for option in stage:
                if option is pick[r]:
                    continue
                trial = pick[:r] + [option] + pick[r + 1:]
                trial_score = search.score(trial)
                if _better(trial_score, score):
                    pick, score, improved = trial, trial_score, True
        if not improved:
            break
    return part, pick, score


def layer_plans(search: Search, part: list[int], options: list[_Option]) -> list[LayerPlan]:
    """Per-layer choices: in each chunk the overlapped full layers first, then inline full, then
    selective, then none (the order inside a chunk changes neither cost nor memory)."""
    layers: dict[int, LayerPlan] = {}
    for r, ranges in enumerate(chunk_layers(part, search.vpp if search.vpp > 1 else None)):
        opt = options[r]
        for idx in ranges:
            seq = [("full", [], "p2p_wait")] * opt.overlapped
            seq += [("full", [], "inline")] * (opt.full - opt.overlapped)
            for name, count in sorted(opt.counts.items()):
                if name.startswith("selective:"):
                    seq += [("selective", sorted(name.split(":", 1)[1].split("+")), None)] * count
            seq += [("none", [], None)] * opt.counts.get("none", 0)
            for i, (rec, mods, window) in zip(idx, seq):
                layers[i] = LayerPlan(index=i, stage=r, recompute=rec, modules=list(mods), window=window)
    return [layers[i] for i in range(sum(part))]
