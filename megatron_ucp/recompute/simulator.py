"""Event-level simulation of megatron-core's pipeline schedules with per-stage recompute costs.

Every pipeline rank runs its ops in exactly the order megatron-core issues them:
- `forward_backward_pipelining_without_interleaving`: warm-up of min(pp - rank - 1, M) forwards,
  the 1F1B steady state (F of micro-batch w + i, then B of micro-batch i), the cool-down backwards;
- `forward_backward_pipelining_with_interleaving` (vpp model chunks per rank): megatron's schedule
  table (`get_schedule_table`, micro-batch groups of pp), warm-up of
  min((pp - rank - 1) * 2 + (vpp - 1) * pp, M * vpp) virtual forwards, then one forward and one
  backward per step (backward chunk = vpp - 1 - forward chunk of the same table entry), then the
  cool-down backwards. This is the schedule with --overlap-p2p-communication (Megatron-LM's default
  for interleaving): every op waits for its own input only.
An op F(rank, chunk, mb) or B(rank, chunk, mb) starts when the rank's previous op has finished and
its input has arrived: the output of the neighbouring virtual stage plus one p2p transfer
(`profile.p2p` for `profile.boundary_bytes`). Sends are eager: a rank never waits for its
receiver to post (megatron batches each send with a receive; NCCL and gloo rendezvous costs are
inside the fitted p2p time). For a stage with overlapped ("p2p_wait") full-recompute layers an
R(rank, chunk, mb) op - the recomputation of those layers - is issued right after the op that
precedes B(rank, chunk, mb) in the rank's order; it has no cross-stage input, so it fills the time
the rank would otherwise wait for the output gradient; B then waits for both. The last virtual
stage never waits for a gradient (its backward starts from its own loss): the runtime recomputes
its "p2p_wait" layers inline, right before each layer's backward, and `chunk_costs` costs them so
(no R op there).

Compute. Op durations come from the profile; with `profile.compute_slots` = k (CPU cores shared by
all ranks) the ranks share the cores as processor sharing: while n ops run at once each advances at
rate min(1, k / n). With `compute_slots` None every rank has its own device. Communication takes no
compute. The data-parallel gradient reduce-scatter / all-gather after the last backward is NOT
modelled: it does not depend on the recompute plan, so it cancels in every comparison this module
is used for (its time would be added to every setting alike).

Memory (activations per rank; THE model shared with the planner, the profiler and the runtime):
- a micro-batch's kept bytes on a chunk live from its F start to its B end;
- R re-creates the overlapped layers of ONE micro-batch, held from R start until that B ends;
- B re-creates, for the duration of the backward, one checkpointed unit at a time: a full inline
  layer, or the selectively recomputed modules of one layer; on the last virtual stage the backward
  first runs through the output layer and loss, whose kept bytes (`output_bytes`) are freed before
  any layer is re-created, so there B peaks at live + max(0, transient - output bytes), not
  live + transient;
- re-created bytes of a full layer are its act_bytes less layer_input_bytes (the kept input is the
  same storage the recomputation starts from).
Memory changes only at op boundaries on the rank itself, so the peak follows from the op order.

`simulate(...)` is the public entry (LayerPlans in, SimResult out). The planner calls
`simulate_chunks` with per-chunk cost vectors: one pass over a precomputed op order (cached per
pp, M, vpp), a few ms for pp 16 x 64 micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from megatron_ucp.recompute.plan import LayerPlan, Prediction
from megatron_ucp.recompute.profile import SELECTIVE, Profile
from megatron_ucp.recompute.schedule import KIND_NAMES, B, F, R, Schedule, SimulatorError, op_schedule


@dataclass
class ChunkCost:
    """One model chunk (the layers of one virtual stage) for one micro-batch."""

    fwd_s: float
    bwd_s: float  # backward, including selective and inline full recomputation
    rec_s: float = 0.0  # overlapped ("p2p_wait") full recomputation: the R op
    kept_bytes: int = 0  # kept from the forward until the backward ends
    overlap_bytes: int = 0  # re-created by R, held until the backward ends
    transient_bytes: int = 0  # re-created inside the backward, one unit at a time
    # of kept_bytes, what the backward frees before it re-creates anything: the output layer and
    # loss of the last virtual stage (its backward runs first)
    output_bytes: int = 0

    def transient_peak(self) -> int:
        """Bytes B adds to the live bytes at its peak: the largest re-created unit less what the
        backward freed before re-creating it (never below 0: B starts with everything live)."""
        return max(0, self.transient_bytes - self.output_bytes)


@dataclass
class SimResult:
    step_s: float
    activation_peak_bytes: list  # per rank
    idle_s: list  # per rank: time no op of the rank runs
    windows: list  # per rank: [(start_s, end_s), ...] idle windows, in time order
    busy_s: list = field(default_factory=list)  # per rank: time an op of the rank runs
    # per rank: [(kind "F"/"R"/"B", chunk, micro-batch, start_s, end_s), ...] in issue order
    timeline: list = field(default_factory=list)

    def prediction(self, static_bytes: list) -> Prediction:
        """A plan.Prediction: `static_bytes` (weights, grads, optimizer per rank) added to activations."""
        if len(static_bytes) != len(self.activation_peak_bytes):
            raise SimulatorError(f"static_bytes has {len(static_bytes)} entries for "
                                 f"{len(self.activation_peak_bytes)} pipeline ranks")
        return Prediction(step_s=self.step_s,
                          peak_bytes=[int(s) + int(a) for s, a in zip(static_bytes,
                                                                       self.activation_peak_bytes)],
                          activation_peak_bytes=[int(a) for a in self.activation_peak_bytes],
                          idle_s=list(self.idle_s))


def _times_dedicated(sched: Schedule, durations: list, p2p_s: float) -> tuple[list, list]:
    """Start and end of every op when every rank computes on its own device."""
    n = len(sched.rank_of)
    start, end = [0.0] * n, [0.0] * n
    free = [0.0] * sched.pp
    for op, r, dep, key in sched.order:
        t = free[r]
        if dep >= 0:
            arrival = end[dep] + p2p_s
            if arrival > t:
                t = arrival
        start[op] = t
        t += durations[key]
        end[op] = t
        free[r] = t
    return start, end


def _times_shared(sched: Schedule, durations: list, p2p_s: float, slots: int) -> tuple[list, list]:
    """Start and end of every op when the ranks share `slots` processors (processor sharing)."""
    n = len(sched.rank_of)
    start, end = [0.0] * n, [-1.0] * n
    deps = {op: (dep, key) for op, _, dep, key in sched.order}
    dependents: dict[int, list] = {}
    for op, (dep, _) in deps.items():
        if dep >= 0:
            dependents.setdefault(dep, []).append(op)
    cursor = [first for first, _ in sched.rank_slices]
    remaining: dict[int, float] = {}  # rank -> work left of its running op
    ready_at = [None] * sched.pp  # rank -> time its next op may start (None: input not yet known)
    now = 0.0

    def next_ready(r: int, prev_end: float) -> None:
        op = cursor[r]
        if op >= sched.rank_slices[r][1]:
            ready_at[r] = None
            return
        dep = deps[op][0]
        if dep < 0:
            ready_at[r] = prev_end
        elif end[dep] >= 0:
            ready_at[r] = max(prev_end, end[dep] + p2p_s)
        else:
            ready_at[r] = None  # set when the dependency finishes

    def finish(r: int, op: int) -> None:
        """Op `op` of rank r ends now: its rank and the ops waiting on it may become ready."""
        end[op] = now
        cursor[r] += 1
        for waiting in dependents.get(op, ()):
            wr = sched.rank_of[waiting]
            if cursor[wr] == waiting and wr not in remaining:
                prev = end[waiting - 1] if waiting > sched.rank_slices[wr][0] else 0.0
                next_ready(wr, prev)
        next_ready(r, now)

    for r in range(sched.pp):
        next_ready(r, 0.0)
    done = 0
    eps = 1e-15
    while done < n:
        # start every op whose time has come (zero-duration ops finish at once)
        started = True
        while started:
            started = False
            for r in range(sched.pp):
                if r in remaining or ready_at[r] is None or ready_at[r] > now + eps:
                    continue
                op = cursor[r]
                start[op] = now
                work = durations[deps[op][1]]
                if work <= 0.0:
                    finish(r, op)
                    done += 1
                    started = True
                else:
                    remaining[r] = work
        if done >= n:
            break
        rate = min(1.0, slots / len(remaining)) if remaining else 0.0
        t_finish = now + min(remaining.values()) / rate if remaining else float("inf")
        t_ready = min((t for r, t in enumerate(ready_at) if t is not None and r not in remaining
                       and t > now + eps), default=float("inf"))
        t_next = min(t_finish, t_ready)
        if t_next == float("inf"):
            raise SimulatorError("processor-sharing simulation stalled (simulator bug)")
        for r in remaining:
            remaining[r] -= rate * (t_next - now)
        now = t_next
        for r in [r for r, w in remaining.items() if w <= 1e-12 * max(1.0, now)]:
            del remaining[r]
            finish(r, cursor[r])
            done += 1
    return start, end


def _activation_peaks(sched: Schedule, chunks: list) -> list[int]:
    """Per-rank activation high-water mark, walking each rank's op order (see module docstring)."""
    peaks = []
    for r, rops in enumerate(sched.ops):
        live = peak = 0
        for kind, chunk, _ in rops:
            c = chunks[r][chunk]
            if kind == F:
                live += c.kept_bytes
                peak = max(peak, live)
            elif kind == R:
                live += c.overlap_bytes
                peak = max(peak, live)
            else:
                peak = max(peak, live + c.transient_peak())
                live -= c.kept_bytes + c.overlap_bytes
        peaks.append(peak)
    return peaks


@lru_cache(maxsize=64)
def memory_terms(pp: int, num_microbatches: int, vpp: int = 1) -> list[list[tuple]]:
    """Per rank, the op boundaries where its activation memory can peak, as coefficient tuples
    (live micro-batch chunks, of them in chunk 0, in the last chunk, overlap held, transient held
    in a B of another chunk than the last, transient held in a B of the last chunk).

    When every chunk of a rank has the same costs, the rank's activation peak is the max over its
    tuples of live * kept + first * embedding bytes (rank 0) + last * output bytes (last rank)
    + overlap * overlap_bytes + transient * transient_bytes
    + transient_last * max(0, transient_bytes - output bytes (last rank; else 0)) - what
    `_activation_peaks` walks to (the last rank's last chunk frees its output layer's bytes
    before it re-creates anything: `ChunkCost.transient_peak`)."""
    sched = op_schedule(pp, num_microbatches, vpp)
    out = []
    for rops in sched.ops:
        live, terms = [0] * vpp, set()
        for kind, chunk, _ in rops:
            if kind == F:
                live[chunk] += 1
            last_chunk = chunk == vpp - 1
            terms.add((sum(live), live[0], live[-1], int(kind != F), int(kind == B and not last_chunk),
                       int(kind == B and last_chunk)))
            if kind == B:
                live[chunk] -= 1
        out.append([t for t in terms if not any(o != t and all(x >= y for x, y in zip(o, t))
                                                for o in terms)])
    return out


def simulate_chunks(chunks: list, num_microbatches: int, p2p_s: float, compute_slots: int | None = None,
                    detail: bool = True) -> SimResult:
    """Simulate per-rank, per-chunk costs: chunks[rank][chunk] is a ChunkCost (vpp = chunks per rank).

    With detail=False only step_s and activation peaks are filled (the planner's inner loop)."""
    pp, vpp = len(chunks), len(chunks[0])
    if num_microbatches < 1:
        raise SimulatorError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if any(len(c) != vpp for c in chunks):
        raise SimulatorError("every pipeline rank needs the same number of model chunks")
    if vpp > 1 and pp < 2:
        raise SimulatorError("an interleaved schedule (vpp > 1) needs pp >= 2")
    with_r = any(c.rec_s > 0 or c.overlap_bytes > 0 for row in chunks for c in row)
    sched = op_schedule(pp, num_microbatches, vpp, with_r)
    durations = [0.0] * (pp * vpp * 3)
    for r in range(pp):
        for ci, c in enumerate(chunks[r]):
            base = (r * vpp + ci) * 3
            durations[base + F], durations[base + R], durations[base + B] = c.fwd_s, c.rec_s, c.bwd_s
    if compute_slots is None or compute_slots >= pp:
        start, end = _times_dedicated(sched, durations, p2p_s)
    else:
        start, end = _times_shared(sched, durations, p2p_s, compute_slots)
    step_s = max(end)
    if vpp == 1:  # one chunk per rank: the peak is linear in its costs (memory_terms), no walk
        peaks = []
        for r, rterms in enumerate(memory_terms(pp, num_microbatches, 1)):
            c = chunks[r][0]
            peaks.append(max(live * c.kept_bytes + overlap * c.overlap_bytes
                             + transient * c.transient_bytes + transient_last * c.transient_peak()
                             for live, _, _, overlap, transient, transient_last in rterms))
    else:
        peaks = _activation_peaks(sched, chunks)
    if not detail:
        return SimResult(step_s=step_s, activation_peak_bytes=peaks, idle_s=[], windows=[])
    idle, windows, busy, timeline = [], [], [], []
    for r, (first, stop) in enumerate(sched.rank_slices):
        gaps, t, run = [], 0.0, 0.0
        for op in range(first, stop):
            if start[op] > t + 1e-12:
                gaps.append((t, start[op]))
            run += end[op] - start[op]
            t = max(t, end[op])
        if step_s > t + 1e-12:
            gaps.append((t, step_s))
        windows.append(gaps)
        idle.append(sum(b - a for a, b in gaps))
        busy.append(run)
        timeline.append([(KIND_NAMES[k], c, mb, start[op], end[op])
                         for op, (k, c, mb) in zip(range(first, stop), sched.ops[r])])
    return SimResult(step_s=step_s, activation_peak_bytes=peaks, idle_s=idle, windows=windows,
                     busy_s=busy, timeline=timeline)


def layer_choice_costs(profile: Profile, lp: LayerPlan, waits: bool = True) -> tuple:
    """One layer under its choice, one micro-batch: (fwd s, bwd s incl. inline recompute, R s,
    kept bytes, overlap bytes, transient bytes); see the memory model in the module docstring.

    `waits`: the layer's virtual stage waits for an output gradient before its backward (every one
    but the last); where it does not, a "p2p_wait" layer is recomputed inline, as the runtime does."""
    fwd, bwd, act = profile.layer_fwd_s, profile.layer_bwd_s, profile.layer_act_bytes
    recreated = act - profile.layer_input_bytes  # a full recompute starts from the kept input
    if lp.recompute == "none":
        return fwd, bwd, 0.0, act, 0, 0
    if lp.recompute == "selective":
        mods = [m for g in lp.modules for m in SELECTIVE[g]]
        sel_fwd = sum(profile.module(m).fwd_s for m in mods)
        sel_act = sum(profile.module(m).act_bytes for m in mods)
        return fwd, bwd + sel_fwd, 0.0, act - sel_act, 0, sel_act
    if lp.window == "p2p_wait" and waits:
        return fwd, bwd, fwd, profile.layer_input_bytes, recreated, 0
    return fwd, bwd + fwd, 0.0, profile.layer_input_bytes, 0, recreated


def chunk_layers(layers_per_stage: list, vpp: int | None) -> list[list[range]]:
    """Global layer indices of each (rank, chunk). Interleaved: virtual stage v = chunk * pp + rank
    holds layers [v * n, (v + 1) * n) with n = layers per chunk (megatron-core, even split only)."""
    pp = len(layers_per_stage)
    if not vpp or vpp == 1:
        out, first = [], 0
        for n in layers_per_stage:
            out.append([range(first, first + n)])
            first += n
        return out
    if len(set(layers_per_stage)) != 1 or layers_per_stage[0] % vpp:
        raise SimulatorError(f"interleaved schedule (vpp={vpp}) needs the same number of layers on "
                             f"every stage, divisible by vpp; got {layers_per_stage}")
    n = layers_per_stage[0] // vpp
    return [[range((c * pp + r) * n, (c * pp + r + 1) * n) for c in range(vpp)] for r in range(pp)]


def add_stage_ends(c: ChunkCost, ends, first: bool, last: bool) -> None:
    """Add the embedding (first virtual stage) and output layer + loss (last) to a chunk's costs;
    the output layer's kept bytes are also its `output_bytes` (freed first by the backward)."""
    if first:
        c.fwd_s += ends.embedding_fwd_s
        c.bwd_s += ends.embedding_bwd_s
        c.kept_bytes += ends.embedding_act_bytes
    if last:
        c.fwd_s += ends.output_fwd_s
        c.bwd_s += ends.output_bwd_s
        c.kept_bytes += ends.output_act_bytes
        c.output_bytes += ends.output_act_bytes


def chunk_costs(profile: Profile, layers: list, layers_per_stage: list,
                vpp: int | None = None) -> list[list[ChunkCost]]:
    """Per-rank, per-chunk costs of LayerPlans (stage ends added to the first and last chunk; the
    last virtual stage has no gradient to wait for: its "p2p_wait" layers cost as inline ones)."""
    if sum(layers_per_stage) != len(layers):
        raise SimulatorError(f"layers_per_stage {layers_per_stage} adds up to "
                             f"{sum(layers_per_stage)} layers, but {len(layers)} LayerPlans were given")
    ends = profile.ends
    ranges = chunk_layers(layers_per_stage, vpp)
    pp, nchunks = len(ranges), len(ranges[0])
    out = []
    for r in range(pp):
        row = []
        for ci, idx in enumerate(ranges[r]):
            c = ChunkCost(0.0, 0.0)
            last = r == pp - 1 and ci == nchunks - 1
            for i in idx:
                fwd, bwd, rec, kept, overlap, transient = layer_choice_costs(profile, layers[i],
                                                                             waits=not last)
                c.fwd_s += fwd
                c.bwd_s += bwd
                c.rec_s += rec
                c.kept_bytes += kept
                c.overlap_bytes += overlap
                c.transient_bytes = max(c.transient_bytes, transient)
            add_stage_ends(c, ends, first=r == 0 and ci == 0, last=last)
            row.append(c)
        out.append(row)
    return out


def simulate(profile: Profile, layers: list, layers_per_stage: list, num_microbatches: int,
             vpp: int | None = None) -> SimResult:
    """Step time, per-rank activation peak, idle time and idle windows of one training step.

    `layers` are the LayerPlans of all layers in global order; `layers_per_stage` the partition
    (interleaved: the same count on every rank, split into vpp chunks)."""
    for i, lp in enumerate(layers):
        if lp.recompute == "full" and lp.window not in ("p2p_wait", "inline"):
            raise SimulatorError(f"layer {i}: full recompute needs window 'p2p_wait' or 'inline', "
                                 f"not {lp.window!r}")
        if lp.recompute == "selective" and not set(lp.modules) <= set(SELECTIVE):
            raise SimulatorError(f"layer {i}: selective modules {lp.modules} are not in "
                                 f"{sorted(SELECTIVE)}")
    chunks = chunk_costs(profile, layers, layers_per_stage, vpp)
    return simulate_chunks(chunks, num_microbatches, profile.p2p.time(profile.boundary_bytes),
                           profile.compute_slots)
