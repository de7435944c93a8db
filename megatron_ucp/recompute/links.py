"""Link costs for the recompute profile.

Links: p2p send/recv between two ranks (ping-pong, megatron's batched isend/irecv) and all-reduce,
over message sizes, fitted by least squares to time = alpha + bytes / bandwidth (relative residuals,
so small messages count as much as large ones). gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import json
import socket
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_ucp.recompute.profile import LinkCost
from megatron_ucp.recompute.timing import ProfilerError, wall

LINK_SIZES = tuple(4096 * 4**i for i in range(7))  # 4 KiB .. 16 MiB


def fit_link(samples: list) -> LinkCost:
    """Least-squares time = alpha + bytes / bytes_per_s over [[bytes, seconds], ...].

    Residuals are relative (weight 1/seconds), so the fit holds for small messages (latency) as
    well as large ones (bandwidth); exact for noiseless alpha-beta data. alpha is kept >= 0.
    """
    pts = [(float(n), float(t)) for n, t in samples]
    if len(pts) < 2 or len({n for n, _ in pts}) < 2 or any(t <= 0 or n < 0 for n, t in pts):
        raise ProfilerError(f"link samples {samples!r}: need >= 2 distinct message sizes with positive times")
    w = [1.0 / t for _, t in pts]
    # weighted normal equations for t = a + b * n
    s00 = sum(wi * wi for wi in w)
    s01 = sum(wi * wi * n for wi, (n, _) in zip(w, pts))
    s11 = sum(wi * wi * n * n for wi, (n, _) in zip(w, pts))
    r0 = sum(wi * wi * t for wi, (_, t) in zip(w, pts))
    r1 = sum(wi * wi * n * t for wi, (n, t) in zip(w, pts))
    det = s00 * s11 - s01 * s01
    a = (r0 * s11 - r1 * s01) / det
    b = (s00 * r1 - s01 * r0) / det
    if a < 0:  # latency below resolution: a pure bandwidth fit through the origin
        a, b = 0.0, r1 / s11
    if b <= 0:  # time does not grow with size (noise): latency only, bandwidth unbounded
        a, b = statistics.median(t for _, t in pts), 0.0
    return LinkCost(alpha_s=a, bytes_per_s=1.0 / b if b > 0 else 1e18,
                    samples=[[int(n), t] for n, t in pts])


def measure_links(sizes=LINK_SIZES, warmup: int = 2, repeats: int = 5, ranks=(0, 1),
                  allreduce_group=None, device: str | None = None) -> tuple[LinkCost, LinkCost]:
    """(p2p, all-reduce) fits, measured between `ranks` inside an initialised process group.

    Every rank of the group calls this. p2p: ping-pong between the two ranks with batched
    isend/irecv (as megatron-core's 1F1B), one-way time = round trip / 2. All-reduce: over
    `allreduce_group` (default: a new group of `ranks`). The fits of rank ranks[0] are returned
    on every rank.
    """
    rank = dist.get_rank()
    if device is None:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    group = allreduce_group if allreduce_group is not None else dist.new_group(list(ranks))
    in_group = allreduce_group is not None or rank in ranks
    p2p, allreduce = [], []
    for nbytes in sizes:
        numel = max(1, nbytes // 4)
        buf = torch.ones(numel, dtype=torch.float32, device=device)
        if rank in ranks:
            me, peer = ranks.index(rank), ranks[1 - ranks.index(rank)]
            times = []
            for i in range(warmup + repeats):
                t0 = wall()
                for step in (0, 1):  # rank ranks[0] sends first, then receives the echo
                    op = dist.isend if (step == 0) == (me == 0) else dist.irecv
                    for req in dist.batch_isend_irecv([dist.P2POp(op, buf, peer)]):
                        req.wait()
                t1 = wall()
                if i >= warmup:
                    times.append((t1 - t0) / 2)
            p2p.append([numel * 4, statistics.median(times)])
        if in_group:
            times = []
            for i in range(warmup + repeats):
                t0 = wall()
                dist.all_reduce(buf, group=group)
                t1 = wall()
                if i >= warmup:
                    times.append(t1 - t0)
            allreduce.append([numel * 4, statistics.median(times)])
    result = [[p2p, allreduce] if rank == ranks[0] else None]
    dist.broadcast_object_list(result, src=ranks[0])
    p2p, allreduce = result[0]
    return fit_link(p2p), fit_link(allreduce)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _links_worker(rank: int, port: int, sizes, warmup: int, repeats: int, backend: str, out: str) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        p2p, allreduce = measure_links(sizes, warmup, repeats)
        if rank == 0:
            Path(out).write_text(json.dumps({"p2p": p2p.__dict__, "allreduce": allreduce.__dict__}))
    finally:
        dist.destroy_process_group()


def measure_links_spawned(gpu: bool, sizes=LINK_SIZES, warmup: int = 2,
                          repeats: int = 5) -> tuple[LinkCost, LinkCost]:
    """`measure_links` on two freshly spawned local processes (gloo on CPU, NCCL on two GPUs)."""
    import tempfile

    import torch.multiprocessing as mp

    if gpu and torch.cuda.device_count() < 2:
        raise ProfilerError("measuring NCCL links needs two GPUs on this host; run the profiler under "
                            "torchrun on >= 2 GPUs, or pass --no-links (links then cost nothing)")
    with tempfile.TemporaryDirectory(prefix="ucp_links_") as tmp:
        out = str(Path(tmp) / "links.json")
        mp.start_processes(_links_worker, args=(free_port(), list(sizes), warmup, repeats,
                                                "nccl" if gpu else "gloo", out),
                           nprocs=2, join=True, start_method="spawn")
        data = json.loads(Path(out).read_text())
    return LinkCost(**data["p2p"]), LinkCost(**data["allreduce"])
