"""``rankwise bench comm``: all-reduce latency and bus bandwidth, next to the machine's memcpy.

For each message size, ranks run back-to-back all-reduces of a float32 tensor; the time of one
is the median over repeats of the slowest rank's mean. Bandwidths follow nccl-tests:

- algorithm bandwidth ``algbw = size / time``;
- bus bandwidth ``busbw = algbw * 2(n-1)/n``: a ring all-reduce moves ``2(n-1)/n * size``
  bytes through every rank's link, so busbw compares across world sizes and with the
  hardware's link speed.

The memcpy bandwidth (one thread copying a 64 MiB tensor, ``size / time``) is the machine's
local physical reference: on one machine the ranks' "network" is memory, so an all-reduce
cannot beat it.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .projection import Network, fit_ring

KB = 1024
SIZES = tuple(4 * KB * 4**k for k in range(8))
"""4 KiB, 16 KiB, ..., 64 MiB."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _iters(nbytes: int) -> int:
    # Small messages repeat enough to rise above the timer; big ones once per repeat.
    return max(1, min(20, (4 * 2**20) // nbytes))


def allreduce_time(nbytes: int, device: torch.device, repeats: int) -> float:
    """Seconds for one all-reduce of ``nbytes``: median over repeats, slowest rank. Sync point: all ranks."""
    t = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    n = _iters(nbytes)
    dist.all_reduce(t)  # warm-up: connections, buffers
    samples = []
    for _ in range(repeats):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(t)
        _sync(device)
        samples.append((time.perf_counter() - start) / n)
    mine = torch.tensor(samples, dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return statistics.median(mine.tolist())


def memcpy_gbps(device: torch.device, nbytes: int = 64 * 2**20, repeats: int = 5) -> float:
    """Bytes copied per second (GB/s, 1e9) by one thread copying a ``nbytes`` tensor on ``device``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        samples = []
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            dst.copy_(src)
            _sync(device)
            samples.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return nbytes / statistics.median(samples) / 1e9


def sweep(device: torch.device, sizes: tuple[int, ...] = SIZES, repeats: int = 5) -> list[dict]:
    """One row per size: latency, algbw, busbw. Sync point: all ranks."""
    n = dist.get_world_size()
    rows = []
    for size in sizes:
        seconds = allreduce_time(size, device, repeats if size <= 4 * 2**20 else 3)
        algbw = size / seconds / 1e9
        rows.append(
            {
                "bytes": size,
                "latency_us": round(seconds * 1e6, 1),
                "algbw_GBps": round(algbw, 3),
                "busbw_GBps": round(algbw * 2 * (n - 1) / n, 3),
            }
        )
    return rows


def measure(sizes: tuple[int, ...] = SIZES, repeats: int = 5) -> dict:
    """The whole comm benchmark on this rank's device (run on every rank). Sync point: all ranks."""
    from ...runtime import get_runtime

    rt = get_runtime()
    rows = sweep(rt.device, sizes, repeats)
    net = fit_ring(rows, rt.world_size)
    return {
        "world_size": rt.world_size,
        "backend": rt.backend,
        "device": rt.device.type,
        "rows": rows,
        "memcpy_GBps": round(memcpy_gbps(rt.device), 2),
        "fit": net.to_dict(),
    }


def launched(sizes: tuple[int, ...] = SIZES, repeats: int = 5) -> dict | None:
    """Under a launcher (``rankwise run``, torchrun) with 2 ranks or more: measure between
    the job's own ranks, wherever they run (``rankwise run --nnodes 2 --nproc-per-node 1 ...
    -m rankwise bench comm`` measures the link between two nodes). None when not launched;
    rank 0 gets the report, the other ranks ``{}``. Sync point: all ranks."""
    from ...runtime import coords, init, shutdown

    where = coords()
    if where.source != "launcher" or where.world_size < 2:  # not an salloc shell's SLURM_*
        return None
    rt = init()
    torch.set_num_threads(1)
    try:
        report = measure(sizes, repeats)
    finally:
        shutdown()
    return report if rt.rank == 0 else {}


def _worker(sizes: tuple[int, ...], repeats: int) -> dict:
    torch.set_num_threads(1)
    return measure(sizes, repeats)


def run(
    nproc: int, backend: str, sizes: tuple[int, ...] = SIZES, repeats: int = 5, timeout: float = 600
) -> dict:
    """Spawn ``nproc`` ranks on ``backend`` and measure; returns rank 0's report."""
    from ...testing import run_distributed

    return run_distributed(_worker, nproc, args=(sizes, repeats), backend=backend, timeout=timeout)[
        0
    ]


def format_table(report: dict) -> str:
    """The comm report as a terminal table."""
    fit: Network = Network.from_dict(report["fit"])
    lines = [
        f"all-reduce, {report['world_size']} ranks, {report['backend']} on {report['device']}",
        f"{'size':>9}  {'latency':>11}  {'algbw GB/s':>10}  {'busbw GB/s':>10}",
    ]
    for r in report["rows"]:
        lines.append(
            f"{_size(r['bytes']):>9}  {r['latency_us']:>9.1f}us  "
            f"{r['algbw_GBps']:>10.3f}  {r['busbw_GBps']:>10.3f}"
        )
    lines.append(f"memcpy (1 thread, 64 MiB): {report['memcpy_GBps']:.2f} GB/s")
    lines.append(f"ring model fit: {fit.describe()} (use as --network {fit.flag()})")
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    return f"{nbytes // 2**20} MiB" if nbytes >= 2**20 else f"{nbytes // KB} KiB"
