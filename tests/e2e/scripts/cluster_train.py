"""A small job for the cluster tests: the one-call API, a checkpoint folder, a step log.

    cluster_train.py [OUT] [--strategy ddp|zero2] [--steps N] [--save-every K] [--sleep S]
                           [--timeout T] [--big]

Trains a small MLP on fixed random data with a global batch of 16 (the per-rank batch follows
from the world size), saving with ``rt.save`` into OUT/ckpt every K steps and at the end. It
resumes from OUT/ckpt when a checkpoint is there (a restarted or replaced node). Rank 0 appends
``<step> <time>`` to OUT/steps after every step and the step of every save that returned to
OUT/saved; each rank writes where it found itself (rank, node, source: the launcher's or
Slurm's variables) to OUT/env<R>.json, its pid to OUT/pid<R>, and its parameters to
OUT/rank<R>.pt at the end (replicas must be equal), and the DDP reducer's cross-rank path to
OUT/path<R>.txt (flat, shared memory, hierarchical). OUT defaults to the working directory.
A strategy written ``ddp+big`` runs ``ddp`` on the big model (its 4 MiB bucket takes the
shared-memory and hierarchical paths, which start at 1 MiB), into OUT/ddp+big.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import socket
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw


def model_for(big: bool) -> nn.Module:
    width = 1024 if big else 32  # big: a checkpoint of ~13 MB, so a save takes a while
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 4))  # fmt: skip


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("out", nargs="?", default=".")
    p.add_argument("--strategy", default="ddp", help="one, or several run one after the other")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--big", action="store_true")
    return p.parse_args()


def report(rt, out: str) -> None:
    with open(os.path.join(out, f"pid{rt.rank}"), "w") as f:
        f.write(str(os.getpid()))
    with open(os.path.join(out, f"env{rt.rank}.json"), "w") as f:
        e = rt.env  # where rankwise found this process: the launcher's or Slurm's variables
        json.dump({"rank": rt.rank, "world": rt.world_size, "node": e.node_rank,
                   "local": e.local_rank, "source": e.source, "master": e.master_addr,
                   "host": socket.gethostname(), "pid": os.getpid(),
                   "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME")}, f)  # fmt: skip


def log(out: str, name: str, line: str) -> None:
    with open(os.path.join(out, name), "a") as f:
        f.write(line + "\n")


def train(rt, a: argparse.Namespace, out: str) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 8), torch.randint(0, 4, (256,)))
    model = model_for(a.big)
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "weight_decay": 0.0},
                             {"params": model[2:].parameters()}], lr=1e-2)  # fmt: skip
    loader = DataLoader(data, batch_size=16, shuffle=True)
    model, opt, loader = rt.prepare(model, opt, loader, global_batch_size=16)
    reducer = getattr(model, "reducer", None)
    with open(os.path.join(out, f"path{rt.rank}.txt"), "w") as f:
        f.write(type(getattr(reducer, "shared", None)).__name__)  # NoneType: flat all-reduce
    ckpt = os.path.join(out, "ckpt")
    step, epoch = 0, 0
    if rw.list_checkpoints(ckpt):
        info = rt.load(ckpt, model=model, optimizer=opt, loader=loader)
        step, epoch = info["step"], info["epoch"]
        rt.print(f"resumed from step {step} (world size {rt.world_size})")
    while step < a.steps:
        loader.set_epoch(epoch)
        for x, y in loader:
            rt.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
            step += 1
            if rt.rank == 0:
                log(out, "steps", f"{step} {time.time():.3f}")
            if step % a.save_every == 0 or step == a.steps:
                rt.save(ckpt, model=model, optimizer=opt, loader=loader, step=step, epoch=epoch)
                if rt.rank == 0:  # the saves that returned: none of them may be lost
                    log(out, "saved", str(step))
            time.sleep(a.sleep)
            if step == a.steps:
                break
        epoch += 1
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(state, os.path.join(out, f"rank{rt.rank}.pt"))
    rt.print(f"done: {step} steps, world size {rt.world_size}, strategy {rt.strategy}")


def main() -> None:
    a = parse()
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # stacks on demand, in a hang
    strategies = a.strategy.split(",")
    big = a.big
    for token in strategies:  # several: each from scratch into OUT/<token>
        out = a.out if len(strategies) == 1 else os.path.join(a.out, token)
        strategy, _, size = token.partition("+")
        a.big = big or size == "big"
        os.makedirs(out, exist_ok=True)
        rt = rw.init(strategy=strategy, timeout=a.timeout)
        torch.set_num_threads(1)
        report(rt, out)
        train(rt, a, out)
        rw.shutdown()


if __name__ == "__main__":
    main()
