"""Train a small CNN on scikit-learn's digits (it ships with the package: nothing is downloaded).

    rankwise run --nproc-per-node 2 examples/digits.py       # two processes: DDP
    python examples/digits.py                                # one process ('auto': single,
                                                             #   or DataParallel on several GPUs)
    python examples/digits.py --strategy dp --devices cpu,cpu    # DataParallel, 2 CPU replicas
    python examples/digits.py --ckpt runs/digits --resume    # continue from the last checkpoint
    python examples/digits.py --precision bf16-mixed --clip 1.0   # mixed precision, clipping
    tensorboard --logdir runs/digits-logs                    # the curves (also metrics.csv/.jsonl)

The training loop is the same under every strategy: ``rt.prepare`` moves the model, wraps it,
splits the data and moves each batch. ``--batch-size`` is the GLOBAL batch (samples per
optimizer step over all replicas), so every strategy trains on the same batches.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="auto", choices=["auto", "single", "dp", "ddp"])
    p.add_argument("--devices", default=None, help="DataParallel's devices, e.g. cpu,cpu or 0,1")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64, help="global batch per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--ckpt", default="runs/digits", help="checkpoint directory")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--precision", default="32", choices=["32", "bf16-mixed", "fp16-mixed"])
    p.add_argument("--clip", type=float, default=None, help="max gradient norm (global)")
    p.add_argument("--log-dir", default="runs/digits-logs", help="curves: CSV, JSONL, TensorBoard")
    return p.parse_args()


def datasets() -> tuple[TensorDataset, TensorDataset]:
    """1437 training and 360 test images of 8x8 pixels; the split is fixed (random_state=0)."""
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=0, stratify=y
    )

    def tensors(a, b):
        return TensorDataset(
            torch.tensor(a, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0, torch.tensor(b)
        )

    return tensors(x_train, y_train), tensors(x_test, y_test)


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10),
    )  # fmt: skip


def train_epoch(rt, model, opt, loader, epoch: int, clip: float | None) -> tuple[float, int]:
    """One pass over this process's share; returns (mean loss over all ranks, samples here)."""
    model.train()
    loader.set_epoch(epoch)
    total, samples = 0.0, 0
    for i, (x, y) in enumerate(rw.progress(loader, desc=f"epoch {epoch}")):  # a bar on rank 0
        loss = F.cross_entropy(model(x), y)
        rt.backward(loss)  # DDP: gradients averaged over the ranks here (fp16: scaled)
        if clip is not None:
            rt.clip_grad_norm_(model, clip)  # the global norm: the same on every rank
        opt.step()
        opt.zero_grad()
        # rank 0's batch loss (no collective; rank 0 writes), at the global step
        rt.log({"train/loss": loss.item()}, step=epoch * len(loader) + i)
        total += loss.item() * len(y)
        samples += len(y)
    return rw.all_reduce_sum(total) / rw.all_reduce_sum(samples), samples


@torch.no_grad()
def evaluate(model, loader) -> tuple[int, int]:
    """Exact accuracy: each test image once, gathered from every rank (Sync point: all ranks)."""
    model.eval()
    preds, labels = [], []
    for x, y in loader:
        preds.append(model(x).argmax(1))
        labels.append(y)
    preds, labels = rw.gather_for_metrics((torch.cat(preds), torch.cat(labels)))
    return int((preds == labels).sum()), len(labels)


def main() -> None:
    args = parse_args()
    devices = args.devices.split(",") if args.devices else None
    devices = [int(d) if d.isdigit() else d for d in devices] if devices else None
    rt = rw.init(strategy=args.strategy, devices=devices, precision=args.precision)
    rt.log_to(args.log_dir)  # TensorBoard too when it is installed
    if rt.device.type == "cpu":
        # A model this small gains nothing from intra-op threads; on a busy machine they only
        # contend with the other replicas (the launcher sets OMP_NUM_THREADS=1 for the same reason).
        torch.set_num_threads(1)
    torch.manual_seed(0)
    train_set, test_set = datasets()
    model = cnn()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    train = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    model, opt, train = rt.prepare(model, opt, train, global_batch_size=args.batch_size)
    test = rt.prepare_loader(DataLoader(test_set, batch_size=256), evaluation=True)

    start_epoch = 0
    if args.resume:  # every rank loads (a shared filesystem), mapped to its own device
        # The epoch to go on with: the next one, as the checkpoint was taken at an epoch's end.
        start_epoch = rt.load(args.ckpt, model=model, optimizer=opt, loader=train)["epoch"]
        rt.print(f"resumed from {args.ckpt} after epoch {start_epoch - 1}")

    train_s, samples = 0.0, 0
    for epoch in range(start_epoch, args.epochs):
        t0 = time.perf_counter()
        loss, n = train_epoch(rt, model, opt, train, epoch, args.clip)
        train_s += time.perf_counter() - t0
        samples += n
        correct, total = evaluate(model, test)
        rt.log({"epoch/train_loss": loss, "epoch/test_accuracy": correct / total}, step=epoch)
        rt.print(f"epoch {epoch}: train loss {loss:.4f}, test accuracy {correct / total:.4f}")
        rt.save(args.ckpt, model=model, optimizer=opt, loader=train, epoch=epoch)  # every rank

    correct, total = evaluate(model, test)
    samples, train_s = rw.all_reduce_sum(samples), rw.all_reduce_max(train_s)
    replicas = rt.world_size * len(rt.devices)
    rt.print(
        f"test accuracy {correct / total:.4f} ({correct}/{total}) | throughput "
        f"{samples / max(train_s, 1e-9):,.0f} samples/s | strategy {rt.strategy}, {replicas} "
        f"replica(s), epochs {start_epoch}-{args.epochs - 1} in {train_s:.1f} s"
    )
    rw.shutdown()


if __name__ == "__main__":
    main()
