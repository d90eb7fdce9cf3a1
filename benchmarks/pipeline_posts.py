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

How: one step after warm-up, with ``p2p.Link._start`` (where every send and receive of the
pipeline is posted) wrapped to note the time of each send (sender) and of each receive's post
(receiver), with its tag; on a tag (a stream, ``tables.stream_tag``) the k-th send is the k-th
receive posted (each tag is first in, first out). Activations are packed with their header
after the warm-up: one send per message. ``time.perf_counter`` is the system's monotonic clock
on Linux, the same in both processes.
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
from rankwise.pipeline.execution import p2p
from rankwise.pipeline.execution.step import stream_tag
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
    start = p2p.Link._start

    def logged(self, recv_bufs, src=-1, tag=0):
        now = time.perf_counter()
        log.extend(("send", dst, k, now) for _, dst, _, _, k in self._queued)
        log.extend(("post", src, tag, now) for _ in recv_bufs)
        return start(self, recv_bufs, src, tag)

    dist.barrier()
    p2p.Link._start = logged
    try:
        step(x, y)
    finally:
        p2p.Link._start = start
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
            kinds = {stream_tag(m): m.kind for m in schedule.sends(peer, me)}
            for tag, kind in sorted(kinds.items()):
                sent = [t for what, dst, k, t in logs[peer] if (what, dst, k) == ("send", me, tag)]
                posted = [t for what, src, k, t in logs[me] if (what, src, k) == ("post", peer, tag)]
                for s, p in zip(sent, posted, strict=False):
                    row = per_kind.setdefault(kind, {"early": 0, "late": 0, "late_ms": []})
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
