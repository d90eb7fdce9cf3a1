"""When does each receive of our pipeline get posted: before its message was sent, or after?

    flock /tmp/rankwise-bench.lock python benchmarks/pipeline_posts.py --out posts.json

Over Gloo a transfer starts only once its receive is posted: a receive posted after its
message was sent (late) makes the receiver pay a round trip when it waits, and the sender hold
the tensor until then. ``p2p.Link`` posts one receive ahead per channel; torch's pipelining
runtime posts each receive at the point of its program where the sender sends (several may be
outstanding). This counts, on our executor, per receiving rank and message kind, how many
receives were posted late and by how much, for each schedule at 2 and 4 stages (Gloo, CPU; one
process per stage), with the
simulated stack of ``benchmarks/pipeline.py`` (layers that sleep: ``--stage-ms`` per stage per
batch forward).

How: one step after warm-up, with ``torch.distributed.isend``/``irecv`` wrapped to note the
time of each send (sender) and of each receive's post (receiver); the k-th send on a channel is
the k-th receive posted on it (channels are first in, first out). ``time.perf_counter`` is the
system's monotonic clock on Linux, the same in both processes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _pipeline_schedules import SCHEDULES, SIM_LAYERS, _model, _ours
from _report import emit

from rankwise.pipeline import schedules
from rankwise.testing import run_distributed


def _logged_step(name: str, v: int, m: int, stage_ms: float, batch: int) -> list[tuple]:
    """This rank's sends and receive posts during one step: (kind, peer, time)."""
    torch.set_num_threads(1)
    per_sample = stage_ms / 1000 / batch / (SIM_LAYERS / dist.get_world_size())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, 8, generator=g), torch.randn(batch, 8, generator=g)
    _, step = _ours(_model(None, "simulated", per_sample), name, v, m)
    for _ in range(3):
        step(x, y)
    log: list[tuple] = []
    isend, irecv = dist.isend, dist.irecv

    def send(t, dst, *a, **k):
        log.append(("send", dst, time.perf_counter()))
        return isend(t, dst, *a, **k)

    def recv(t, src, *a, **k):
        log.append(("post", src, time.perf_counter()))
        return irecv(t, src, *a, **k)

    dist.barrier()
    dist.isend, dist.irecv = send, recv
    try:
        step(x, y)
    finally:
        dist.isend, dist.irecv = isend, irecv
    dist.barrier()
    return log


def _late(schedule: schedules.Schedule, logs: list[list[tuple]]) -> dict:
    """Per receiving rank and message kind: receives posted before / after their send."""
    out = {}
    for me in range(schedule.ranks):
        per_kind: dict[str, dict] = {}
        for peer in range(schedule.ranks):
            if peer == me:
                continue
            channel = schedule.sends(peer, me)
            sent = [t for kind, dst, t in logs[peer] if kind == "send" and dst == me]
            posted = [t for kind, src, t in logs[me] if kind == "post" and src == peer]
            for msg, s, p in zip(channel, sent, posted, strict=False):
                row = per_kind.setdefault(msg.kind, {"early": 0, "late": 0, "late_ms": []})
                row["late" if p > s else "early"] += 1
                if p > s:
                    row["late_ms"].append(1000 * (p - s))
        for row in per_kind.values():
            late = row.pop("late_ms")
            row["median_late_ms"] = round(statistics.median(late), 3) if late else 0.0
        out[str(me)] = per_kind
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4", help="pipeline sizes")
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--stage-ms", type=float, default=40.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    report = {"benchmark": "pipeline_posts", "torch": torch.__version__, "cpus": os.cpu_count(),
              "args": vars(args), "load_before": os.getloadavg(), "rows": []}  # fmt: skip
    for p in (int(k) for k in args.ranks.split(",")):
        for name, v, _ in SCHEDULES:
            job = (name, v, args.micro, args.stage_ms, args.batch)
            logs = run_distributed(_logged_step, p, args=job, timeout=600)
            sched = schedules.make(name, p, args.micro, v)
            report["rows"].append({"schedule": name, "stages_per_rank": v, "ranks": p,
                                   "m": args.micro, "by_receiver": _late(sched, logs)})  # fmt: skip
    report["load_after"] = os.getloadavg()
    emit(report, args.out)


if __name__ == "__main__":
    main()
