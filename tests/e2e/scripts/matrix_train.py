"""The fault matrix's job (tests/cluster/matrix.py): one strategy, one bucket size, one fault.

    matrix_train.py OUT --strategy ddp|zero2|zero3|mesh|pipeline --width W --hosts H
                        --per-host L [--steps N] [--sleep S] [--timeout T]
                        [--fault none|crash|stuck|reinit] [--victim R] [--at STEP]
                        [--save-every N]
    matrix_train.py OUT --check --width W   (no job: the checkpoints OUT holds, as JSON)

A small MLP (8 -> W -> W -> 4) whose W x W weight decides the gradient bucket's size (the
matrix picks W on both sides of 1 MiB, the switch to shared memory and to the hierarchical
path). ``mesh``: data (hosts) x tensor (workers per host), the W x W layer column-parallel and
the last row-parallel. ``pipeline``: pipeline (workers per host) x data (hosts), 1F1B. Data
comes through a DataLoader with one worker process per rank.

Faults, on rank ``--victim`` at step ``--at``: ``crash`` (``sys.exit(3)``), ``stuck`` (its
DataLoader worker hangs in ``__getitem__`` for good), ``reinit`` (every rank: ``rw.shutdown()``
then ``rw.init()`` and training on, twice). Files in OUT: ``steps`` (rank 0: ``<step> <time>``),
``pid<R>`` (each rank), ``loader<R>-<pid>`` (each DataLoader worker of rank R), ``done<R>``,
``ckpt/`` (``rt.save`` every ``--save-every`` steps, in the strategy's format) and ``saved``
(rank 0: the step of each save that returned).

``--check`` loads every checkpoint of ``OUT/ckpt`` that looks complete (a published name; the
temporaries a save in flight leaves are counted apart) into the bare model, in this one
process, and prints what it found (``check_checkpoints``): the fault matrix's "nothing lost".
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import rankwise as rw


class Samples(Dataset):
    """Fixed random samples; ``stuck`` (a file) makes the worker hang in ``__getitem__``."""

    def __init__(self, out: str, rank: int, stuck: str | None) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(512, 8, generator=g), torch.randint(0, 4, (512,), generator=g)
        self.out, self.rank, self.stuck = out, rank, stuck

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        mark = os.path.join(self.out, f"loader{self.rank}-{os.getpid()}")
        if not os.path.exists(mark):
            open(mark, "w").close()
        if self.stuck and os.path.exists(self.stuck):
            time.sleep(3600)  # the fault: a worker that never returns
        return self.x[i], self.y[i]


def model_for(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 4))  # fmt: skip


def start(a: argparse.Namespace):
    """``rw.init`` and ``rt.prepare`` for ``a.strategy``; (rt, model, opt, loader, step fn)."""
    if a.strategy == "mesh":
        rt = rw.init(mesh={"data": a.hosts, "tensor": a.per_host}, timeout=a.timeout)
    elif a.strategy == "pipeline":
        rt = rw.init(mesh={"pipeline": a.per_host, "data": a.hosts}, timeout=a.timeout)
    else:
        rt = rw.init(strategy=a.strategy, timeout=a.timeout)
    torch.set_num_threads(1)
    model = model_for(a.width)
    if a.strategy == "mesh":
        model = rw.tensor_parallel(model, plan={"2": "column", "4": "row"},
                                   group=rt.mesh.group("tensor"))  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    stuck = os.path.join(a.out, "stuck_now") if a.fault == "stuck" else None
    data = Samples(a.out, rt.rank, stuck if rt.rank == a.victim else None)
    loader = DataLoader(data, batch_size=8, num_workers=1, shuffle=True)
    if a.strategy == "pipeline":
        model, opt, loader = rt.prepare(model, opt, loader, microbatches=2,
                                        loss_fn=F.cross_entropy)  # fmt: skip
        return rt, model, opt, loader, lambda x, y: rt.backward(model(x, y))
    model, opt, loader = rt.prepare(model, opt, loader)
    return rt, model, opt, loader, lambda x, y: rt.backward(F.cross_entropy(model(x), y))


def train(a: argparse.Namespace, first: int, last: int) -> None:
    rt, model, opt, loader, step_fn = start(a)
    with open(os.path.join(a.out, f"pid{rt.rank}"), "w") as f:
        f.write(str(os.getpid()))
    step, epoch = first, 0
    while step < last:
        loader.set_epoch(epoch)
        for x, y in loader:
            step_fn(x, y)
            opt.step()
            opt.zero_grad()
            step += 1
            if rt.rank == 0:
                with open(os.path.join(a.out, "steps"), "a") as f:
                    f.write(f"{step} {time.time():.3f}\n")
            if step == a.at and rt.rank == a.victim:
                if a.fault == "crash":
                    sys.exit(3)
                if a.fault == "stuck":  # the worker's next sample hangs; prefetched ones drain
                    open(os.path.join(a.out, "stuck_now"), "w").close()
            if a.save_every and step % a.save_every == 0:
                rt.save(os.path.join(a.out, "ckpt"), model=model, optimizer=opt, step=step)
                if rt.rank == 0:
                    with open(os.path.join(a.out, "saved"), "a") as f:
                        f.write(f"{step}\n")
            time.sleep(a.sleep)
            if step >= last:
                break
        epoch += 1
    rw.shutdown()


def check_checkpoints(out: str, width: int) -> dict:
    """Every complete-looking checkpoint of ``out/ckpt`` must load (digests verified) into the
    bare model with finite, trained values and its own step; ``latest`` must name one; the
    newest must be no older than the last save that returned."""
    import glob

    from rankwise.checkpoint import files

    folder = os.path.join(out, "ckpt")
    marks = Path(out, "saved")
    saved = marks.read_text().split() if marks.exists() else []
    found = files.list_checkpoints(folder) if os.path.isdir(folder) else []
    bad, steps, init = {}, [], model_for(width).state_dict()
    for path in found:
        try:
            model = model_for(width)
            got = rw.load_checkpoint(path, model=model, restore_rng=False)
            state = model.state_dict()
            if got["step"] != files.step_of(path):
                raise ValueError(f"step {got['step']} in a checkpoint named {path.name}")
            if not all(bool(t.isfinite().all()) for t in state.values()):
                raise ValueError("non-finite values")
            if all(torch.equal(state[k], init[k]) for k in init):
                raise ValueError("the values are the untrained model's")
            steps.append(got["step"])
        except Exception as exc:  # any failure to load is the finding
            bad[path.name] = f"{type(exc).__name__}: {str(exc)[:300]}"
    try:
        latest = None if not found else rw.load_checkpoint(
            folder, model=model_for(width), restore_rng=False)["step"]  # fmt: skip
    except Exception as exc:
        latest, bad["latest"] = None, f"{type(exc).__name__}: {str(exc)[:300]}"
    return {"checkpoints": len(found), "loaded": len(steps), "bad": bad,
            "newest": max(steps) if steps else None, "latest": latest,
            "last_saved": int(saved[-1]) if saved else None,
            "temporaries": len(glob.glob(os.path.join(folder, ".*.tmp")))}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--width", type=int, default=240)
    p.add_argument("--hosts", type=int, default=1)
    p.add_argument("--per-host", type=int, default=2)
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--sleep", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--fault", default="none")
    p.add_argument("--victim", type=int, default=1)
    p.add_argument("--at", type=int, default=8)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--check", action="store_true")
    a = p.parse_args()
    if a.check:
        import json

        print(json.dumps(check_checkpoints(a.out, a.width)))
        return
    rounds = 3 if a.fault == "reinit" else 1  # reinit: shutdown + init, twice, training on
    per = a.steps // rounds
    for r in range(rounds):
        train(a, r * per, a.steps if r == rounds - 1 else (r + 1) * per)
    with open(os.path.join(a.out, f"done{os.environ.get('RANK', '0')}"), "w") as f:
        f.write("ok")


if __name__ == "__main__":
    main()
