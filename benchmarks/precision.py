"""Mixed precision through ``rw.init(precision=...)`` vs the same loop written by hand.

    flock /tmp/bench.lock python benchmarks/precision.py --out benchmarks/results/precision.json

World size 2 on gloo (NCCL on GPUs), one thread per process, in one run. For the reference MLP
and CNN (``rankwise.bench.models``) and each precision ('32', 'bf16-mixed'; 'fp16-mixed' too
on CUDA) it measures the step time (forward, loss, backward with the gradient all-reduce,
optimizer step, zero_grad) of three arms, repeats interleaved (rotating which goes first):

- ``ours``: ``rt.prepare(model, opt)`` under that precision, ``rt.backward(loss)``,
  ``opt.step()`` (autocast hooks on the wrapper, fp32 outputs, loss scaler under fp16);
- ``hand_rw``: rankwise's DDP with ``torch.autocast`` and ``torch.amp.GradScaler`` written
  out by hand: the precision layer's own overhead is ``ours / hand_rw``;
- ``hand_torch``: the same hand-written loop on torch's DDP (the recipe of torch's AMP docs).

Prints one JSON object (and writes it to ``--out``): median ms per step and the median over
repeats of the paired ratios, and ``forward_overhead``: the µs our hooks add to one forward of
a tiny model (what the layer costs per step, free of the machine's noise). On CPUs without native bf16 matmuls, bf16-mixed may be slower
than fp32: the ratio to compare with the target is ours / hand-written at the same precision.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _report import emit

import rankwise as rw
from rankwise import session
from rankwise.bench import models
from rankwise.testing import run_distributed
from rankwise.training.loop import LoopState

ARMS = ("ours", "hand_rw", "hand_torch")
_DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def _build(arm: str, name: str, precision: str):
    """(step function, model) for one arm; every arm starts from the same weights."""
    rt = rw.get_runtime()
    torch.manual_seed(0)
    model = models.build(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if arm == "ours":
        # One process, several precisions: a runtime per arm, as rw.init(precision=) makes it.
        mine = dataclasses.replace(rt, precision=precision, loop=LoopState())
        model, opt = session.prepare(mine, model, opt)

        def step(x, y):
            mine.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step
    model = model.to(rt.device)
    if arm == "hand_rw":
        ddp = rw.DistributedDataParallel(model)
    else:
        ids = [rt.device] if rt.device.type == "cuda" else None
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    dtype = _DTYPES.get(precision)
    scaler = torch.amp.GradScaler(rt.device.type, enabled=precision == "fp16-mixed")

    def step(x, y):
        cast = torch.autocast(rt.device.type, dtype=dtype) if dtype else contextlib.nullcontext()
        with cast:
            loss = F.cross_entropy(ddp(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step


def _timed(step, batches, device) -> float:
    """ms per step over ``batches``; the slowest rank's."""
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for x, y in batches:
        step(x, y)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = torch.tensor([(time.perf_counter() - start) * 1000 / len(batches)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _compare(name: str, precision: str, batch: int, steps: int, repeats: int) -> dict:
    rt = rw.get_runtime()
    batches = [
        tuple(t.to(rt.device) for t in models.batch(name, batch, seed=rt.rank * 1000 + i))
        for i in range(steps)
    ]
    built = {arm: _build(arm, name, precision) for arm in ARMS}
    for arm in ARMS:
        _timed(built[arm], batches[:3], rt.device)  # warm-up
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for r in range(repeats):
        for arm in ARMS[r % 3 :] + ARMS[: r % 3]:
            times[arm].append(_timed(built[arm], batches, rt.device))

    def ratio(a: str, b: str) -> float:
        return round(statistics.median(x / y for x, y in zip(times[a], times[b], strict=True)), 4)

    return {
        "step_ms": {arm: round(statistics.median(v), 3) for arm, v in times.items()},
        "ours_over_hand_rw": ratio("ours", "hand_rw"),
        "ours_over_hand_torch": ratio("ours", "hand_torch"),
    }


def _forward_overhead(calls: int = 2000, repeats: int = 7) -> dict:
    """µs per forward of a tiny model: our autocast hooks vs ``with torch.autocast`` by hand.

    The step-time ratios above carry the machine's noise (a few %); this isolates what the
    precision layer adds per step (hooks, the fp32 cast of the output) on a model so small
    that the layer is all there is to time.
    """
    rt = rw.get_runtime()
    mine = dataclasses.replace(rt, strategy="single", precision="bf16-mixed", loop=LoopState())
    torch.manual_seed(0)
    ours, hand = session.prepare(mine, nn.Linear(8, 8)), nn.Linear(8, 8).to(rt.device)
    x = torch.randn(2, 8, device=rt.device)

    def by_hand() -> None:
        with torch.autocast(rt.device.type, dtype=torch.bfloat16):
            out = hand(x)
        out.float()

    arms = {"ours": lambda: ours(x), "hand": by_hand}
    times: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(repeats):
        for name in sorted(arms, reverse=r % 2 == 1):
            start = time.perf_counter()
            for _ in range(calls):
                arms[name]()
            times[name].append((time.perf_counter() - start) * 1e6 / calls)
    med = {k: round(statistics.median(v), 2) for k, v in times.items()}
    return {"us_per_forward": med, "added_us": round(med["ours"] - med["hand"], 2)}


def _run(names: list[str], batch: int, steps: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    precisions = ["32", "bf16-mixed"]
    if rw.get_runtime().device.type == "cuda":
        precisions.append("fp16-mixed")
    return {
        "models": {
            name: {p: _compare(name, p, batch, steps, repeats) for p in precisions}
            for name in names
        },
        "forward_overhead": _forward_overhead(),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved repeats")
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    res = run_distributed(
        _run,
        2,
        args=(args.models.split(","), args.batch, args.steps, args.repeats),
        backend=backend,
        timeout=3000,
    )[0]
    result = {
        "benchmark": "precision",
        "world_size": 2,
        "backend": backend,
        "device": "cuda" if backend == "nccl" else "cpu",
        "threads_per_process": 1,
        "per_rank_batch": args.batch,
        "steps_per_repeat": args.steps,
        "repeats": args.repeats,
        "torch": torch.__version__,
        **res,
    }
    return emit(result, args.out)


if __name__ == "__main__":
    main()
