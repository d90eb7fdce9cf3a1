"""Shared-memory reduction: sums copied out by writing (rankwise) vs read in (the older design).

    flock /tmp/rankwise-bench.lock python benchmarks/shared_reduce_ab.py --out ab.json

Two ways to finish a bucket reduced through shared memory, after rank r has summed chunk r of
it over every slot into its own:

- ``write`` (what ``parallel/ddp/node/shared_reduce.py`` does): rank r copies its sum into
  chunk r of every other slot before the next barrier; the barrier after the last bucket ends
  the pass (n + 1 barriers for n buckets);
- ``read`` (kept here as the baseline only): after the next barrier every rank copies the other
  chunks from the ranks that summed them, and one more barrier must follow the last bucket
  before any rank writes its slot again (n + 2).

Both move the same bytes. Every loop order of ``benchmarks/ddp.py`` (where ``zero_grad`` sits,
``set_to_none`` or not), world size 2 on Gloo, one thread per process, the variants
interleaved in the same processes with the order rotated every repeat. A third variant,
``write_again``, is ``write`` built once more: ``write_again / write`` is the noise floor of
the comparison (same code; only the model's place in memory and in the rotation differ).
Prints the median step time per configuration (ms), ``write / read`` and ``write_again /
write`` per loop order.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import ddp as bench
from _report import emit

import rankwise as rw
from rankwise.parallel.ddp.node import shared_reduce as sr
from rankwise.testing import run_distributed


class _ReadChannel(sr._Channel):
    """The older channel: a job's gather reads other slots, so the fence takes two barriers."""

    def _run(self, reduce, work, early) -> None:
        if reduce is not None or self.pending is not None:
            self.barrier()
        if self.pending is not None:
            gather, done = self.pending
            self.pending = None
            gather()
            done._finish()
        if reduce is not None:
            self.pending = (reduce(), work)
        else:
            self.barrier()  # every rank has read the sums: slots may be written again
            work._finish()


class _ReadBuckets(sr.SharedBuckets):
    """Sum this rank's chunk; return the gather that reads the other chunks in."""

    def _reduce(self, b: int):
        views, bounds, me = self._views[b], self._bounds[b], self.rank
        acc = views[me][bounds[me] : bounds[me + 1]]
        for r, view in enumerate(views):
            if r != me:
                acc.add_(view[bounds[me] : bounds[me + 1]])

        def gather() -> None:
            for r, view in enumerate(views):
                if r != me:
                    views[me][bounds[r] : bounds[r + 1]].copy_(view[bounds[r] : bounds[r + 1]])

        return gather


def _build(variant: str, name: str, channel: list) -> rw.DistributedDataParallel:
    torch.manual_seed(0)
    model = rw.DistributedDataParallel(bench._build(name))
    shared = model.reducer.shared
    if shared is None:
        raise SystemExit(f"{name}: no bucket is shared (a /dev/shm too small?)")
    if variant == "read":
        if not channel:
            channel.append(_ReadChannel(dist.group.WORLD))  # its own barrier group and worker
        shared.__class__ = _ReadBuckets
        shared._channel = channel[0]
    return model


def _run(name: str, batch: int, steps: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    built, channel = {}, []
    # Built alternately, so that neither variant's shared files all come first in memory.
    for order in bench.ORDERS:
        for to_none in (True, False):
            for variant in ("write", "read", "write_again")[:: 1 if to_none else -1]:
                model = _build(variant, name, channel)
                opt = torch.optim.SGD(model.parameters(), lr=0.01)
                x, y = bench._batch(name, batch, seed=dist.get_rank())
                bench._time("rankwise", model, opt, x, y, 2, order, to_none)  # warm-up
                label = f"{variant}/{order}/{'none' if to_none else 'zero'}"
                built[label] = ("rankwise", model, opt, x, y, steps, order, to_none)
    times: dict[str, list[float]] = {label: [] for label in built}
    labels = list(built)
    for r in range(repeats):
        for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
            times[label].append(bench._time(*built[label]))
    return {label: round(statistics.median(v), 3) for label, v in times.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,mlp_small")
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=16, help="interleaved repeats")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    out: dict = {"ms": {}, "write_over_read": {}, "write_again_over_write": {}}
    for name in args.models.split(","):
        ms = run_distributed(_run, 2, args=(name, args.batch, args.steps, args.repeats),
                             timeout=1800)[0]  # fmt: skip
        out["ms"][name] = ms
        for a, b in (("write", "read"), ("write_again", "write")):
            out[f"{a}_over_{b}"][name] = {
                k.split("/", 1)[1]: round(v / ms[f"{b}/" + k.split("/", 1)[1]], 3)
                for k, v in ms.items()
                if k.startswith(f"{a}/")
            }
    out["conditions"] = {
        "world_size": 2, "backend": "gloo", "threads_per_rank": 1, "cpus": os.cpu_count(),
        "batch": args.batch, "steps": args.steps, "repeats": args.repeats,
        "load_before": load,
    }  # fmt: skip
    return emit(out, args.out)


if __name__ == "__main__":
    main()
