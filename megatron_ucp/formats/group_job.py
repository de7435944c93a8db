"""A conversion written by every process of a torchrun job (gloo is enough), the one form every
distributed writer takes: the output's files are planned as one process plans them, each process
writes and fsyncs a balanced share of them into rank 0's staged directory (a filesystem every
process sees) or uploads them to the store prefix, and rank 0 finishes (metadata, checks) and
commits once, its marker file last; every rank returns or raises the job's one outcome. So the
output is byte for byte that of the single-process writer.

Used by `universal.write` and `hf.export` (their `distributed=True`), which the conversions in
`megatron_ucp.conversion` call; shared, so that no format package imports another.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_ucp.storage import Location, commit_group_job, fsync_path, group_staged


def balanced(sizes: list[int], n: int) -> list[list[int]]:
    """Indices of `sizes` split into n sets of near-equal total (largest first, each to the least
    loaded set), each set in index order."""
    sets: list[list[int]] = [[] for _ in range(n)]
    loads = [0] * n
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        k = loads.index(min(loads))
        sets[k].append(i)
        loads[k] += sizes[i]
    return [sorted(s) for s in sets]


def run(out: Location, marker: str, sizes: list[int], file_name: Callable[[int], str],
        write_share: Callable[[Location, list[int]], Any],
        finish: Callable[[Any, list[Any]], None], what: str) -> Location:
    """Write `out` as one job of the initialized process group.

    sizes: the bytes of each planned file (i = 0..n-1), which `balanced` splits among the ranks.
    write_share(partial, files): writes those files into the staged directory and returns what
    rank 0 needs of them (gathered, in rank order). finish(staged, results): on rank 0 once every
    rank wrote its share: the metadata, the checks and `staged.commit`. marker: the file that
    commits a store prefix (its create-only put) and that the writer writes last.
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    staged = group_staged(out, marker)
    mine = balanced(sizes, world)[rank]
    result, error = None, None
    try:
        result = write_share(staged.partial, mine)
        for i in mine:  # (the commit fsyncs rank 0's files only)
            fsync_path(staged.partial / file_name(i))
    except Exception as e:  # reported by rank 0 for every rank, once
        error = f"rank {rank}: {type(e).__name__}: {e}"
    commit_group_job(staged, what, result, error, lambda results: finish(staged, results))
    return out

