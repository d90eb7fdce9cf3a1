"""The cost of ``rt.prepare``: its loop vs the same loop written by hand, and vs torch's.

    flock /tmp/rankwise-bench.lock python benchmarks/session.py --out session.json

World size 2 on gloo, one thread per process. Each arm trains the same model on the same
synthetic data set for one epoch per repeat (per-rank batch 32, shuffled, ``set_epoch`` each
repeat), and the time of a whole epoch (data loading, host-to-device move, forward, loss,
backward with the gradient all-reduce, SGD step, zero_grad) is divided by its steps:

- ``prepare``: ``rt.prepare(model, opt, DataLoader(ds, batch_size=32, shuffle=True))``;
- ``manual``: ``rw.DistributedDataParallel(model.to(dev))`` + ``rw.loader(ds, batch_size=32,
  shuffle=True)`` + ``x.to(dev)`` by hand (what ``prepare`` builds, written out);
- ``torch``: ``torch.nn.parallel.DistributedDataParallel`` + ``DataLoader`` with torch's
  ``DistributedSampler`` + ``x.to(dev)``.

Repeats are interleaved (rotating which arm goes first). Models: the demo's digits CNN (1x8x8
inputs: tiny steps, where a per-batch overhead would show most) and the reference CNN of
``rankwise.bench.models`` (3x32x32). Prints one JSON object (and writes it to ``--out``):
median ms per step, and the median over repeats of the paired ratio prepare / manual.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data import DistributedSampler as TorchSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _report import emit

import rankwise as rw
from rankwise.bench import models
from rankwise.testing import run_distributed

ARMS = ("prepare", "manual", "torch")


def _digits_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 4 * 4, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def _model_and_data(name: str, n: int) -> tuple[nn.Module, TensorDataset]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "digits_cnn":
        model, shape = _digits_cnn(), (n, 1, 8, 8)
    else:
        model, shape = models.build(name), (n, 3, 32, 32)
    return model, TensorDataset(torch.randn(shape, generator=g), torch.randint(0, 10, (n,)))


def _build(arm: str, name: str, n: int, batch: int):
    rt = rw.get_runtime()
    model, ds = _model_and_data(name, n)
    if arm == "prepare":
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = DataLoader(ds, batch_size=batch, shuffle=True)
        model, opt, loader = rt.prepare(model, opt, loader)
        return model, opt, loader, None
    model = model.to(rt.device)
    if arm == "manual":
        ddp = rw.DistributedDataParallel(model)
        loader = rw.loader(ds, batch_size=batch, shuffle=True)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        loader = DataLoader(ds, batch_size=batch, sampler=TorchSampler(ds, shuffle=True))
    return ddp, torch.optim.SGD(ddp.parameters(), lr=0.01), loader, rt.device


def _epoch(model, opt, loader, device, epoch: int) -> float:
    """ms per step of one epoch; the slowest rank's."""
    loader_or_sampler = loader if hasattr(loader, "set_epoch") else loader.sampler
    loader_or_sampler.set_epoch(epoch)
    dist.barrier()
    start, steps = time.perf_counter(), 0
    for x, y in loader:
        if device is not None:  # the hand-written arms move their batches themselves
            x, y = x.to(device), y.to(device)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps += 1
    t = torch.tensor([(time.perf_counter() - start) * 1000 / steps])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _compare(name: str, n: int, batch: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    built = {arm: _build(arm, name, n, batch) for arm in ARMS}
    for arm in ARMS:
        _epoch(*built[arm], epoch=0)  # warm-up
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for r in range(repeats):
        for arm in ARMS[r % 3 :] + ARMS[: r % 3]:
            times[arm].append(_epoch(*built[arm], epoch=r + 1))
    paired = [p / m for p, m in zip(times["prepare"], times["manual"], strict=True)]
    vs_torch = [p / t for p, t in zip(times["prepare"], times["torch"], strict=True)]
    return {
        "step_ms": {arm: round(statistics.median(v), 3) for arm, v in times.items()},
        "ratio_prepare_over_manual": round(statistics.median(paired), 4),
        "ratio_prepare_over_torch": round(statistics.median(vs_torch), 4),
    }


def _run(n: int, batch: int, repeats: int, names: list[str]) -> dict:
    return {name: _compare(name, n, batch, repeats) for name in names}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--samples", type=int, default=640, help="data set size (all ranks)")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved repeats")
    parser.add_argument("--models", default="digits_cnn,cnn")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    names = args.models.split(",")
    res = run_distributed(
        _run, 2, args=(args.samples, args.batch, args.repeats, names), timeout=600
    )[0]
    result = {
        "benchmark": "session",
        "world_size": 2,
        "backend": "gloo",
        "threads_per_process": 1,
        "per_rank_batch": args.batch,
        "steps_per_epoch": args.samples // (2 * args.batch),
        "repeats": args.repeats,
        "torch": torch.__version__,
        "models": res,
    }
    return emit(result, args.out)


if __name__ == "__main__":
    main()
