"""megatron-core's pipeline schedules as op orders: which op (F, R, B of a model chunk and
micro-batch) each pipeline rank issues when, and the cross-stage dependencies between them
(`simulator` times them; its docstring describes the schedules).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

F, R, B = 0, 1, 2
KIND_NAMES = ("F", "R", "B")


class SimulatorError(ValueError):
    """A schedule or a set of layer plans the simulator cannot run; the message says what to fix."""


def schedule_table(num_microbatches: int, vpp: int, group: int) -> list[tuple[int, int]]:
    """megatron-core's `get_schedule_table`: virtual micro-batch id -> (micro-batch, model chunk)."""
    table = []
    for first in range(0, num_microbatches, group):
        last = num_microbatches if first + group >= num_microbatches else first + group
        table.extend((mb, chunk) for chunk in range(vpp) for mb in range(first, last))
    return table


def rank_ops(pp: int, rank: int, num_microbatches: int, vpp: int | None = None) -> list[tuple]:
    """The (kind, chunk, micro-batch) ops one pipeline rank issues, in megatron-core's order.

    R precedes every B (zero-cost where the chunk has no overlapped layers)."""
    if not vpp or vpp == 1:
        warmup = min(pp - rank - 1, num_microbatches)
        ops = [(F, 0, mb) for mb in range(warmup)]
        for i in range(num_microbatches - warmup):
            ops += [(F, 0, warmup + i), (R, 0, i), (B, 0, i)]
        for mb in range(num_microbatches - warmup, num_microbatches):
            ops += [(R, 0, mb), (B, 0, mb)]
        return ops
    table = schedule_table(num_microbatches, vpp, pp)
    total = num_microbatches * vpp
    warmup = min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)

    def fwd(k):
        mb, chunk = table[k]
        return (F, chunk, mb)

    def bwd(k):
        mb, chunk = table[k]
        return [(R, vpp - 1 - chunk, mb), (B, vpp - 1 - chunk, mb)]

    ops = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [fwd(warmup + k), *bwd(k)]
    for k in range(total - warmup, total):
        ops += bwd(k)
    return ops


@dataclass
class Schedule:
    pp: int
    vpp: int
    ops: list  # per rank: [(kind, chunk, mb)]
    # flat op list in a dependency-respecting order: (op id, rank, dep op id or -1, cost key)
    order: list
    rank_of: list  # op id -> rank
    rank_slices: list  # rank -> (first op id, end op id): op ids of a rank are contiguous


@lru_cache(maxsize=64)
def op_schedule(pp: int, num_microbatches: int, vpp: int, with_r: bool = True) -> Schedule:
    """Op orders of all ranks, the cross-stage dependencies and one global order that respects them.

    The cost key of an op is (rank * vpp + chunk) * 3 + kind, an index into a flat cost list.
    Without R ops (no overlapped layers anywhere) the timeline is the same and a third shorter."""
    ops = [rank_ops(pp, r, num_microbatches, vpp if vpp > 1 else None) for r in range(pp)]
    if not with_r:
        ops = [[op for op in rops if op[0] != R] for rops in ops]
    ids, rank_of, rank_slices = {}, [], []
    for r, rops in enumerate(ops):
        first = len(rank_of)
        for kind, chunk, mb in rops:
            ids[(r, kind, chunk, mb)] = len(rank_of)
            rank_of.append(r)
        rank_slices.append((first, len(rank_of)))
    last_virtual = pp * vpp - 1
    deps = []
    for r, rops in enumerate(ops):
        for kind, chunk, mb in rops:
            v = chunk * pp + r
            if kind == F and v > 0:
                dep = ids[((v - 1) % pp, F, (v - 1) // pp, mb)]
            elif kind == B and v < last_virtual:
                dep = ids[((v + 1) % pp, B, (v + 1) // pp, mb)]
            else:  # first virtual stage's F, any R, last virtual stage's B (its own F came earlier)
                dep = -1
            deps.append((dep, (r * vpp + chunk) * 3 + kind))
    # One global order: sweep the ranks, advancing each while its next op's input is placed.
    placed = [False] * len(rank_of)
    cursor = [first for first, _ in rank_slices]
    order = []
    while len(order) < len(rank_of):
        progressed = False
        for r in range(pp):
            end = rank_slices[r][1]
            while cursor[r] < end:
                op = cursor[r]
                dep, key = deps[op]
                if dep >= 0 and not placed[dep]:
                    break
                placed[op] = True
                order.append((op, r, dep, key))
                cursor[r] += 1
                progressed = True
        if not progressed:
            raise SimulatorError(f"schedule deadlock at pp={pp} vpp={vpp} M={num_microbatches}: "
                                 "the op orders wait on each other (simulator bug)")
    return Schedule(pp=pp, vpp=vpp, ops=ops, order=order, rank_of=rank_of, rank_slices=rank_slices)
