"""Where a DDP step's time goes beyond its compute: the ranks' skew and the reduction's tail.

    flock /tmp/rankwise-bench.lock python benchmarks/ddp_wait.py --out ddp_wait.json

Two Gloo ranks, one thread each, train the reference MLP (10.5M parameters, 42 MB of
gradients) with rankwise's DDP and torch's, in every loop order of ``benchmarks/ddp.py``,
repeats interleaved. Each step runs freely, as a training loop does (no barrier between
steps). Per step and rank, on the machine's monotonic clock (one clock for all processes):

- ``ready``: the last gradient of the pass accumulated (a ``post_accumulate_grad`` hook on
  every parameter, registered before wrapping: it runs before either wrapper copies the
  gradient into a bucket, so that copy counts in the tail of both);
- ``done``: ``backward()`` returned, every gradient averaged.

From the two ranks' times, per step: ``skew``, how far apart the ranks finished their own
backward compute (``max(ready) - min(ready)``), time the earlier one can only wait; ``tail``,
from the later rank's ``ready`` to the last ``done``: the part of the reduction that no
overlap can hide, since it starts when the last gradient exists; ``wait``, the mean over ranks
of ``done - ready``. Medians over the steps of all repeats.

Implementation-neutral: the same hooks and clock for both DDPs. Why it matters: two
processes on two cores are CPU-bound, so whatever a rank spends waiting is added to the
compute and reduction CPU time that ``benchmarks/ddp.py``'s floor counts.
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

from _report import emit
from ddp import ORDERS as ZERO_GRAD_AT
from ddp import _pin, step

import rankwise as rw
from rankwise.bench import models
from rankwise.testing import run_distributed

ORDERS = [(order, none) for order in ZERO_GRAD_AT for none in (True, False)]
KINDS = ("rankwise", "torch", "synced")
"""``synced``: the bare model, no gradient exchanged, a barrier where DDP waits (after backward):
the synchronous ceiling. Whatever skew it shows is the machine's, with nothing to reduce."""


def _clock_ms() -> float:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) / 1e6


class _Timed:
    """A wrapped MLP, its SGD and the per-step (ready, done) times of this rank."""

    def __init__(self, kind: str, order: str, to_none: bool) -> None:
        torch.manual_seed(0)
        net = models.build("mlp")
        self.ready = self.done = 0.0
        for p in net.parameters():  # before wrapping: fires before either wrapper's own hook
            p.register_post_accumulate_grad_hook(self._arrived)
        if kind == "rankwise":
            net = rw.DistributedDataParallel(net)
        elif kind == "torch":
            net = torch.nn.parallel.DistributedDataParallel(net)
        self.net, self.sync = net, kind == "synced"
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.01)
        self.order, self.to_none = order, to_none
        self.times: list[tuple[float, ...]] = []  # (start, ready, done, end) per step

    def _arrived(self, _p: torch.Tensor) -> None:
        self.ready = _clock_ms()

    def steps(self, x: torch.Tensor, y: torch.Tensor, n: int, keep: bool = True) -> None:
        for _ in range(n):
            start = _clock_ms()
            step(self.net, self.opt, x, y, self.order, self.to_none, self._backward_done)
            if keep:
                self.times.append((start, self.ready, self.done, _clock_ms()))

    def _backward_done(self) -> None:
        if self.sync:
            dist.barrier()
        self.done = _clock_ms()


def _rank_part(batch: int, steps: int, repeats: int, pin: bool) -> dict:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    x, y = models.batch("mlp", batch, seed=rank)
    built = {f"{k}/{o}/{'none' if n else 'zero'}": _Timed(k, o, n) for o, n in ORDERS for k in KINDS}
    if pin:  # after building: the wrappers' threads (rankwise's reduction worker) exist now
        _pin(rank)
    for timed in built.values():
        timed.steps(x, y, 2, keep=False)  # warm-up (and torch's bucket rebuild)
    labels = list(built)
    for r in range(repeats):
        for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
            dist.barrier()  # each repeat starts together; its steps then run freely
            built[label].steps(x, y, steps)
    out = {}
    for label, timed in built.items():
        mine = torch.tensor(timed.times, dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        out[label] = _derive(torch.stack(every))
    return out


def _derive(t: torch.Tensor) -> dict:
    """t[rank, step] = (start, ready, done, end), in ms: the medians over steps."""
    start, ready, done, end = t.unbind(-1)
    later = ready.max(0).values
    rows = {
        "step_ms": end.max(0).values - start.min(0).values,
        "compute_ms": (ready - start).mean(0),
        "skew_ms": later - ready.min(0).values,
        "tail_ms": done.max(0).values - later,
        "wait_ms": (done - ready).mean(0),
    }
    return {k: round(statistics.median(v.tolist()), 3) for k, v in rows.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=12, help="interleaved repeats")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--pin", action="store_true",
                        help="every thread of rank r on core r (as benchmarks/ddp.py --pin)")
    args = parser.parse_args(argv)
    load_before = list(os.getloadavg())
    rows = run_distributed(_rank_part, 2, args=(args.batch, args.steps, args.repeats, args.pin),
                           timeout=900)[0]  # fmt: skip
    orders = [label.split("/", 1)[1] for label in rows if label.startswith("torch/")]
    # Step time over torch's: rankwise, and the synchronous ceiling (nothing reduced).
    def over_torch(kind: str, order: str) -> float:
        return round(rows[f"{kind}/{order}"]["step_ms"] / rows[f"torch/{order}"]["step_ms"], 3)

    ratio = {order: {k: over_torch(k, order) for k in ("rankwise", "synced")} for order in orders}
    return emit(
        {
            "benchmark": "ddp_wait",
            "conditions": {
                "world": 2,
                "backend": "gloo",
                "threads_per_process": 1,
                "model": "mlp",
                "pinned": args.pin,
                "per_rank_batch": args.batch,
                "steps_per_repeat": args.steps,
                "repeats": args.repeats,
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
                "load_before": load_before,
                "load_after": list(os.getloadavg()),
            },
            "rows": rows,
            "step_over_torch": ratio,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
