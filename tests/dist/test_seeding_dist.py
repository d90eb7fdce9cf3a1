"""``rw.seed_everything`` on 2 ranks: the documented streams per rank (``seed`` by default,
``seed + rank`` with ``per_rank=True``), DataLoader workers distinct across ranks and workers,
and a DDP run with dropout, shuffling and worker-side noise repeats its losses exactly."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import rankwise as rw
from rankwise.testing import run_distributed

SEED = 11


def _oracle(seed: int) -> tuple[float, float, float]:
    return (random.Random(seed).random(), float(np.random.RandomState(seed).random_sample()),
            torch.rand((), generator=torch.Generator().manual_seed(seed)).item())


class NoisyPoints(Dataset):
    """Points with noise drawn in the worker (augmentation); each sample says who drew it."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        info = torch.utils.data.get_worker_info()
        noise = torch.tensor([random.random(), float(np.random.rand()), torch.rand(()).item()])
        x = torch.full((3,), i / 16.0) + 0.1 * noise
        return x, i % 2, info.id, noise


def _first_draws(per_rank: bool) -> tuple[int, tuple[float, float, float]]:
    main = rw.seed_everything(SEED, per_rank=per_rank)
    return main, (random.random(), float(np.random.rand()), torch.rand(()).item())


def _run() -> dict:
    out = {"default": _first_draws(False), "per_rank": _first_draws(True)}
    rt = rw.get_runtime()
    rw.seed_everything(SEED)  # before building the model: the same model on every rank
    model = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    loader = DataLoader(NoisyPoints(), batch_size=2, shuffle=True, num_workers=2)
    model, opt, loader = rt.prepare(model, opt, loader)
    out["losses"], out["draws"] = [], []
    for x, y, worker, noise in loader:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
        out["draws"] += [(rt.rank, int(w), *n.tolist()) for w, n in zip(worker, noise, strict=True)]
    return out


@pytest.mark.slow  # two jobs of 2 ranks, each starting 2 DataLoader workers
def test_ranks_get_the_documented_streams_and_runs_repeat():
    first, again = (run_distributed(_run, 2, timeout=240) for _ in range(2))
    # default: seed on every rank; per_rank: seed + rank
    assert [r["default"] for r in first] == [(SEED, _oracle(SEED))] * 2
    assert [r["per_rank"] for r in first] == [(SEED, _oracle(SEED)), (SEED + 1, _oracle(SEED + 1))]
    # workers: 2 ranks x 2 workers, every draw distinct (no rank repeats another's stream)
    draws = [d for r in first for d in r["draws"]]
    assert {(rank, w) for rank, w, *_ in draws} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    values = [v for _, _, *vs in draws for v in vs]
    assert len(set(values)) == len(values) == 16 * 3
    # a second job repeats everything: worker draws and DDP losses (dropout, shuffle included)
    assert [r["draws"] for r in again] == [r["draws"] for r in first]
    assert [r["losses"] for r in again] == [r["losses"] for r in first]
    assert first[0]["losses"] != first[1]["losses"]  # each rank trained on its own share
