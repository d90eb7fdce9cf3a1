"""The job benchmarks/_goodput_cluster.py kills: DDP on a tiny MLP, a disk checkpoint every K
steps, and a timestamp at every phase of a (re)start, so the recovery's cost splits into its
parts.

    _goodput_train.py OUT --steps N --save-every K --sleep S

Appends to OUT/phases, one line per event, ``<event> <attempt> <unix time> [<step>]``:
``start`` (first line of the script: the process exists), ``imported`` (torch and rankwise
imported), ``joined`` (``rw.init`` returned: the rendezvous and the process group),
``loaded`` (the checkpoint read back, with its step; ``fresh`` when there was none). Rank 0
appends ``<step> <unix time>`` to OUT/steps after every step and ``<step> <seconds>`` to
OUT/saves for every save (its cost). The per-rank batch is fixed, so the job runs at any
world size.
"""

import time

START = time.time()

import argparse  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import rankwise as rw  # noqa: E402

ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def log(out: str, name: str, *fields: object) -> None:
    with open(os.path.join(out, name), "a") as f:
        f.write(" ".join(str(v) for v in fields) + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--sleep", type=float, default=0.2)
    a = p.parse_args()
    imported = time.time()
    rt = rw.init(strategy="ddp", timeout=60)
    torch.set_num_threads(1)
    if rt.rank == 0:
        log(a.out, "phases", "start", ATTEMPT, f"{START:.3f}")
        log(a.out, "phases", "imported", ATTEMPT, f"{imported:.3f}")
        log(a.out, "phases", "joined", ATTEMPT, f"{time.time():.3f}")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(512, 8), torch.randint(0, 4, (512,)))
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, loader = rt.prepare(model, opt, DataLoader(data, batch_size=4, shuffle=True))
    ckpt = os.path.join(a.out, "ckpt")
    step, epoch = 0, 0
    if rw.list_checkpoints(ckpt):
        info = rt.load(ckpt, model=model, optimizer=opt, loader=loader)
        step, epoch = info["step"], info["epoch"]
    if rt.rank == 0:
        log(a.out, "phases", "loaded", ATTEMPT, f"{time.time():.3f}", step)
    while step < a.steps:
        loader.set_epoch(epoch)
        for x, y in loader:
            rt.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
            time.sleep(a.sleep)  # the step's compute: a fixed cost, so steps are alike
            step += 1
            if step % a.save_every == 0:
                began = time.time()
                rt.save(ckpt, model=model, optimizer=opt, loader=loader, step=step, epoch=epoch)
                if rt.rank == 0:
                    log(a.out, "saves", step, f"{time.time() - began:.4f}")
            if rt.rank == 0:
                log(a.out, "steps", step, f"{time.time():.3f}")
            if step == a.steps:
                break
        epoch += 1
    rw.shutdown()


if __name__ == "__main__":
    main()
