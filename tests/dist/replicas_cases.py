"""What the in-memory replica tests run on their ranks: a small MLP with dropout (so every
rank's RNG matters), SGD with momentum or AdamW (optimizer state), a shuffled prepared loader of
micro-batch 2 and a global batch of 12 kept by ``rt.accumulate`` at any world (3 ranks x 2
micro-batches, 2 ranks x 3, 1 x 6).

Each "host" is a folder ``<root>/host<k>``; a host lost is a folder deleted by the test. A
replica run and a reference run (the same state through a disk checkpoint, loaded at the new
world by ``rt.load``) both train ``AFTER`` steps; their parameters are returned.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw

GLOBAL = 12
MICRO = 2
AFTER = 5
"""Steps trained after the restore (crossing the end of the first epoch: 8 steps per epoch)."""


def build(rt, optimizer: str = "sgd"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g))
    model, opt, loader = rt.prepare(model, opt, DataLoader(data, batch_size=MICRO, shuffle=True))
    torch.manual_seed(1000 + rt.rank)
    return model, opt, loader


def train(rt, model, opt, loader, *, step: int, epoch: int, stop: int, accumulation: int,
          each=None) -> int:  # fmt: skip
    """Train from ``step`` to ``stop`` optimizer steps; ``each(step, epoch)`` after each."""
    while step < stop:
        loader.set_epoch(epoch)
        for x, y in loader:
            with rt.accumulate(model, steps=accumulation) as acc:
                rt.backward(F.cross_entropy(model(x), y))
                if acc.sync:
                    opt.step()
                    opt.zero_grad()
                    step += 1
                    if each is not None:
                        each(step, epoch)
                    if step == stop:
                        return step
        epoch += 1
    return step


def params(model) -> dict[str, torch.Tensor]:
    """The full model state (a collective under zero3: every rank calls it)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def first_run(root: str, strategy: str, optimizer: str, steps: int, every: int, disk_at: int):
    """The full-size job: replicas every ``every`` steps into ``root/host<rank>``, a disk
    checkpoint at ``disk_at`` (the reference's start), stopped after ``steps``."""
    rt = rw.init(strategy=strategy, timeout=60)
    model, opt, loader = build(rt, optimizer)
    reps = rt.replicas(model, opt, loader, every=every, global_batch=GLOBAL,
                       folder=Path(root) / f"host{rt.rank}")  # fmt: skip

    def each(step: int, epoch: int) -> None:
        reps.step(step, epoch=epoch)
        if step == disk_at:
            reps.wait()  # the same moment of the RNG: after the replica's snapshot
            rt.save(Path(root) / "disk", model=model, optimizer=opt, loader=loader, step=step,
                    epoch=epoch, sharded=False)  # fmt: skip

    train(rt, model, opt, loader, step=0, epoch=0, stop=steps, accumulation=reps.accumulation,
          each=each)  # fmt: skip
    reps.close()
    rw.shutdown()


def after_loss(root: str, strategy: str, optimizer: str, host_of: list[int] | None = None):
    """At the new world: the reference (disk checkpoint, ``rt.load``) and the replica restore,
    each trained ``AFTER`` steps. Returns both parameter sets, the step and the event."""
    rt = rw.init(strategy=strategy, timeout=60)
    host = rt.rank if host_of is None else host_of[rt.rank]
    model, opt, loader = build(rt, optimizer)
    info = rt.load(Path(root) / "disk", model=model, optimizer=opt, loader=loader)
    from rankwise.replicas.plan import accumulation_for  # not at collection (fast_tier.py)

    accumulation = accumulation_for(GLOBAL, rt.world_size, MICRO)
    train(rt, model, opt, loader, step=info["step"], epoch=info["epoch"],
          stop=info["step"] + AFTER, accumulation=accumulation)  # fmt: skip
    reference = params(model)
    model, opt, loader = build(rt, optimizer)
    reps = rt.replicas(model, opt, loader, global_batch=GLOBAL, folder=Path(root) / f"host{host}")
    events = []
    reps.on_resize(events.append)
    got = reps.restore()
    train(rt, model, opt, loader, step=got["step"], epoch=got["epoch"],
          stop=got["step"] + AFTER, accumulation=got["accumulation"])  # fmt: skip
    reps.close()
    replicas = params(model)
    rw.shutdown()
    return {"reference": reference, "replicas": replicas, "step": got["step"],
            "disk_step": info["step"], "accumulation": got["accumulation"],
            "event": events[0] if events else None}  # fmt: skip


def readme_loop(root: str, strategy: str):
    """The README's loop at world 2: AdamW in two parameter groups and a StepLR schedule,
    replicas every step; after step 3 a fresh prepare restores from them and trains on to step
    5. Returns both runs' parameters and learning rates (a collective under zero3)."""
    rt = rw.init(strategy=strategy, timeout=60)

    def build():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        opt = torch.optim.AdamW([{"params": net[0].parameters(), "weight_decay": 0.1},
                                 {"params": net[2].parameters(), "weight_decay": 0.0}], lr=1e-2)
        model, opt = rt.prepare(net, opt)
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    def steps(model, opt, sched, first, last):
        for k in range(first, last):
            g = torch.Generator().manual_seed(100 * k + rt.rank)
            x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
            rt.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
            sched.step()

    model, opt, sched = build()
    reps = rt.replicas(model, opt, every=1, folder=Path(root) / f"host{rt.rank}")
    steps(model, opt, sched, 0, 3)
    reps.step(3)
    reps.wait()
    steps(model, opt, sched, 3, 5)
    reps.close()
    whole = params(model), [g["lr"] for g in opt.param_groups]
    model, opt, sched = build()
    got = rt.replicas(model, opt, folder=Path(root) / f"host{rt.rank}").restore()
    sched.last_epoch = got["step"]  # the user's own scheduler object steps on from there
    steps(model, opt, sched, 3, 5)
    resumed = params(model), [g["lr"] for g in opt.param_groups]
    rw.shutdown()
    return {"whole": whole, "resumed": resumed, "step": got["step"]}
