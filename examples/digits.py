"""Train a small CNN on scikit-learn's digits (ships with the package; nothing is downloaded).

    python examples/digits.py                              # one process
    rankwise run --nproc-per-node 2 examples/digits.py     # two processes

Placeholder until the DDP engine lands: gradients are averaged with ``rw.all_reduce_mean``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import rankwise as rw


def main() -> None:
    rt = rw.init()
    torch.manual_seed(0)
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 64, 10)
    ).to(rt.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_x, train_y, test_x, test_y = x[:1500], y[:1500], x[1500:], y[1500:]
    mine = torch.arange(rt.rank, len(train_x), rt.world_size)
    for epoch in range(5):
        for i in range(0, len(mine), 32):
            idx = mine[i : i + 32]
            loss = F.cross_entropy(model(train_x[idx].to(rt.device)), train_y[idx].to(rt.device))
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                p.grad = rw.all_reduce_mean(p.grad)
            opt.step()
        rw.print0(f"epoch {epoch} loss {rw.all_reduce_mean(loss.item()):.4f}")
    with torch.no_grad():
        acc = (model(test_x.to(rt.device)).argmax(1).cpu() == test_y).float().mean().item()
    rw.print0(f"test accuracy {acc:.3f}")
    rw.shutdown()


if __name__ == "__main__":
    main()
