"""Train an MLP on scikit-learn's digits with its layers pipelined over the launched ranks.

    rankwise run --nproc-per-node 2 examples/pipeline_digits.py --chunks 4 --schedule zero_bubble
    torchrun --nproc-per-node 2 examples/pipeline_digits.py          # same thing, torch's launcher
    python examples/pipeline_digits.py                               # world size 1: one stage

Rank 0 holds the first layers and reads the images, the last rank holds the last layers and
computes the loss (and sends it to the others: rank 0 prints it); activations go downstream
and gradients upstream with send/recv, in the order --schedule says.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import rankwise as rw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--schedule", default="1f1b",
                    help="gpipe, 1f1b, interleaved_1f1b or zero_bubble (docs/model-parallel.md)")
    args = ap.parse_args()
    rt = rw.init()
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    torch.manual_seed(0)  # every rank builds the same model, then keeps its own layers
    model = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
    )
    pipe = rw.DistributedPipeline(model, chunks=args.chunks, schedule=args.schedule)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)  # same shuffle on every rank
    for epoch in range(args.epochs):
        order = torch.randperm(len(x), generator=gen)
        total, batches = 0.0, 0
        for start in range(0, len(x), args.batch_size):
            idx = order[start : start + args.batch_size]
            loss = pipe.train_step(x[idx], y[idx], nn.functional.cross_entropy)
            opt.step()
            opt.zero_grad()
            total, batches = total + loss.item(), batches + 1  # every stage gets the loss
        rt.print(f"epoch {epoch} loss {total / batches:.4f}")
    rw.shutdown()


if __name__ == "__main__":
    main()
