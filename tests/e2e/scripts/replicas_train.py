"""An elastic job kept alive by in-memory replicas: every ``--every`` steps each rank's state is
replicated (own host's RAM folder and a buddy's); started again after a host is lost (or
returns), it resumes from the replicas at the new world, keeping the global batch.

    replicas_train.py OUT --steps N [--every K] [--disk] [--resume-from CKPT] [--sleep S]
                      [--stop-file PATH] [--strategy ddp|zero1|zero2|zero3]

Rank 0 appends ``{"step", "world", "time"}`` to ``OUT/progress.jsonl`` after every step and
writes the final parameters to ``OUT/final.pt``; ``--disk`` also saves a checkpoint every step
into ``OUT/disk`` (a reference run starts from one with ``--resume-from``, no replicas).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw
from rankwise.replicas.plan import accumulation_for

GLOBAL, MICRO = 12, 2


def _stop(path: str | None) -> bool:
    """Every rank stops at the same step: the file seen by any rank, agreed by a collective."""
    return path is not None and rw.all_reduce_max(float(Path(path).exists())) > 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--disk", action="store_true")
    p.add_argument("--resume-from", default=None)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--stop-file", default=None, help="stop when it exists (ranks agree)")
    p.add_argument("--strategy", default="ddp", help="ddp or zero1-3 (replicas of shards)")
    p.add_argument("--global-batch", type=int, default=GLOBAL, help="kept at every world")
    args = p.parse_args()
    out = Path(args.out)
    rt = rw.init(strategy=args.strategy, timeout=20)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g))
    model, opt, loader = rt.prepare(model, opt, DataLoader(data, batch_size=MICRO, shuffle=True))
    torch.manual_seed(1000 + rt.rank)
    step, epoch, reps = 0, 0, None
    accumulation = accumulation_for(args.global_batch, rt.world_size, MICRO)
    if args.resume_from:
        info = rt.load(args.resume_from, model=model, optimizer=opt, loader=loader)
        step, epoch = info["step"], info["epoch"]
    else:
        reps = rt.replicas(model, opt, loader, every=args.every, global_batch=args.global_batch)
        got = reps.restore()
        if got is not None:
            step, epoch, accumulation = got["step"], got["epoch"], got["accumulation"]
    while step < args.steps:
        loader.set_epoch(epoch)
        for x, y in loader:
            with rt.accumulate(model, steps=accumulation) as acc:
                rt.backward(F.cross_entropy(model(x), y))
                if not acc.sync:
                    continue
                opt.step()
                opt.zero_grad()
                step += 1
                if reps is not None:
                    reps.step(step, epoch=epoch)
                if args.disk:
                    rt.save(out / "disk", model=model, optimizer=opt, loader=loader, step=step,
                            epoch=epoch, keep_last=1000, sharded=False)  # fmt: skip
                if rt.rank == 0:
                    with open(out / "progress.jsonl", "a") as f:
                        f.write(json.dumps({"step": step, "world": rt.world_size,
                                            "time": time.time()}) + "\n")  # fmt: skip
                time.sleep(args.sleep)
                if step == args.steps or _stop(args.stop_file):
                    args.steps = step
                    break
        epoch += 1
    if reps is not None:
        reps.close(remove=True)
    final = model.state_dict()  # the full state: a gather under zero3, so every rank calls it
    if rt.rank == 0:
        torch.save(final, out / "final.pt")
    rw.shutdown()


if __name__ == "__main__":
    main()
