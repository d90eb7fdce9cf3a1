"""One activation through the pipeline transport (``p2p.Link``) against plain
``batch_isend_irecv``, the same two Gloo processes, rounds interleaved.

    flock /tmp/rw-bench.lock python benchmarks/pipeline_link.py --numel 1024,262144,1048576

Rank 0 sends a float32 tensor (an activation, with its header) and receives it back (a
gradient, no header); rank 1 the reverse. ``--compute-ms``: each rank spins that long before
each of its sends, as a stage computes before it sends: the transport's code then runs after
other work, as in a pipeline, where each call costs several times what it costs in a tight
loop. ``plain``: the same two transfers with
``batch_isend_irecv``, each waited on. Per size: the medians over ``--rounds`` interleaved
rounds of ``--reps`` round trips, their ratio, the most sends ``Link`` held at once (freed as
the executor frees them, on the peer's acknowledgement), and the
ceiling beside them (the bytes of one round trip over one thread's memcpy bandwidth). The JSON
records the machine's load before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _report import emit

from rankwise.bench.network.commbench import memcpy_gbps
from rankwise.pipeline.execution.p2p import Link
from rankwise.pipeline.execution.wire import Expected, Header
from rankwise.testing import run_distributed


def _compute(seconds: float) -> None:
    """A stage's computation between two messages: the CPU busy (spinning), so the transport's
    code runs as it does in a pipeline, after other work, not in a tight loop."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _plain(t: torch.Tensor, buf: torch.Tensor, rank: int, reps: int, compute: float) -> float:
    peer = 1 - rank
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        first, second = (dist.isend, dist.irecv) if rank == 0 else (dist.irecv, dist.isend)
        for op, x in ((first, t if rank == 0 else buf), (second, buf if rank == 0 else t)):
            if op is dist.isend:
                _compute(compute)
            for w in dist.batch_isend_irecv([dist.P2POp(op, x, peer)]):
                w.wait()
    return (time.perf_counter() - start) / reps


def _link(link: Link, t: torch.Tensor, rank: int, reps: int, compute: float) -> float:
    dist.barrier()
    start = time.perf_counter()
    for i in range(reps):
        if rank == 0:
            _compute(compute)
            link.send(t, 1, "activation", Header(i, reps, t.dtype, tuple(t.shape)))
            link.expect(1, t)
            link.post()
            link.recv(tuple(t.shape), t.dtype, 1, "gradient")
            link.acked(1, i + 1)  # as the executor: this gradient says activation i was read
        else:
            expected = Expected("stage 0 (rank 0)", i, reps)
            link.expect(0, None, expected)
            _, x = link.receive_activation(0, "activation", expected)
            link.acked(0, i)  # activation i says gradients 0..i-1 were read
            _compute(compute)
            link.send(x, 0, "gradient", None)
            link.post()
    link.flush()
    return (time.perf_counter() - start) / reps


def _job(sizes: list[int], reps: int, rounds: int, compute: float = 0.0) -> dict:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    out = {}
    for n in sizes:
        t, buf = torch.randn(n), torch.empty(n)
        link = Link(torch.device("cpu"), timedelta(seconds=120), rank)
        plain, via = [], []
        for _ in range(rounds):
            plain.append(_plain(t, buf, rank, reps, compute))
            via.append(_link(link, t, rank, reps, compute))
        p, v = statistics.median(plain), statistics.median(via)
        ceiling_us = 2 * n * 4 / (memcpy_gbps(torch.device("cpu")) * 1e9) * 1e6
        out[str(n)] = {"plain_us": round(p * 1e6, 1), "link_us": round(v * 1e6, 1),
                       "link_over_plain": round(v / p, 3),
                       "link_minus_plain_us": round((v - p) * 1e6, 1), "ceiling_memcpy_us": round(ceiling_us, 1),
                       "peak_sends_held": link.held().peak_sends}  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", default="1024,262144,1048576")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    ap.add_argument("--compute-ms", type=float, default=0.0,
                    help="spin this long before each send (a stage's compute)")
    args = ap.parse_args()
    before = os.getloadavg()
    sizes = [int(v) for v in args.numel.split(",") if v]
    ranks = run_distributed(_job, 2, args=(sizes, args.reps, args.rounds, args.compute_ms / 1000), timeout=1800)
    emit({"benchmark": "pipeline_link", "torch": torch.__version__, "rounds": args.rounds,
          "reps": args.reps, "compute_ms": args.compute_ms, "rank0": ranks[0], "load_before": before,
          "load_after": os.getloadavg()}, args.out)  # fmt: skip


if __name__ == "__main__":
    main()
