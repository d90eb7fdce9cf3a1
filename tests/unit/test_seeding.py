"""``rw.seed_everything``: the main-process streams equal fresh generators seeded as documented,
loaders built after it shuffle with its seed, their workers draw distinct, reproducible numbers,
and a training run repeats exactly."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import rankwise as rw
from rankwise.data import seeding


@pytest.fixture(autouse=True)
def _forget_the_seed(monkeypatch):
    monkeypatch.setattr(seeding, "_seed", None)


def _draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def _oracle(seed: int) -> tuple[float, float, list[float]]:
    return (random.Random(seed).random(), float(np.random.RandomState(seed).random_sample()),
            torch.rand(3, generator=torch.Generator().manual_seed(seed)).tolist())


def test_every_main_process_stream_gets_the_seed():
    assert rw.seed_everything(1234) == 1234
    assert _draws() == _oracle(1234)
    assert rw.seed_everything(1234, per_rank=True) == 1234  # rank 0: seed + 0
    assert _draws() == _oracle(1234)


@pytest.mark.parametrize("seed", [-1, 2**32, 1.5, True, "7", None])
def test_a_seed_outside_numpys_range_is_refused(seed):
    with pytest.raises(rw.ConfigError) as exc:
        rw.seed_everything(seed)
    assert f"seed={seed!r}" in str(exc.value) and "2**32 - 1" in str(exc.value)


def test_loaders_built_after_it_shuffle_with_its_seed():
    data = TensorDataset(torch.arange(20.0))

    def order(epoch: int) -> list[int]:
        loader = rw.loader(data, batch_size=20, shuffle=True)
        loader.set_epoch(epoch)
        return next(iter(loader))[0].long().tolist()

    def randperm(seed: int) -> list[int]:  # the sampler's order: randperm(seed + epoch)
        return torch.randperm(20, generator=torch.Generator().manual_seed(seed)).tolist()

    assert order(0) == randperm(0)  # no seed_everything yet: seed 0
    rw.seed_everything(77)
    assert (order(0), order(1)) == (randperm(77), randperm(78))
    explicit = rw.loader(data, batch_size=20, shuffle=True, seed=0)  # an explicit seed wins
    assert next(iter(explicit))[0].long().tolist() == randperm(0)


class Noisy(Dataset):
    """Each sample: the worker that made it and one draw from each of its random streams."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        info = torch.utils.data.get_worker_info()
        return torch.tensor([info.id, random.random(), float(np.random.rand()),
                             torch.rand(()).item()], dtype=torch.float64)


def _worker_draws(seed: int, epoch: int = 0) -> dict[int, list[tuple]]:
    rw.seed_everything(seed)
    loader = rw.loader(Noisy(), batch_size=1, num_workers=2)
    loader.set_epoch(epoch)
    out: dict[int, list[tuple]] = {}
    for (row,) in loader:
        out.setdefault(int(row[0]), []).append(tuple(row[1:].tolist()))
    return out


def test_workers_draw_distinct_numbers_that_a_rerun_repeats():
    first = _worker_draws(5)
    assert sorted(first) == [0, 1]
    values = [v for draws in first.values() for sample in draws for v in sample]
    assert len(set(values)) == len(values)  # no stream repeats another, in any worker
    assert _worker_draws(5) == first  # the same seed: the same numbers
    assert _worker_draws(5, epoch=1) != first  # another epoch: new numbers
    assert _worker_draws(6) != first


def _train(seed: int) -> list[float]:
    rw.seed_everything(seed)
    rt = rw.init()
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.linspace(-1, 1, 64).reshape(16, 4), torch.arange(16) % 2)
    model, opt, loader = rt.prepare(model, opt, DataLoader(data, batch_size=4, shuffle=True))
    losses = []
    for x, y in loader:
        loss = F.cross_entropy(model(x + 0.1 * torch.randn_like(x)), y)  # main-process noise
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    rw.shutdown()
    return losses


def test_the_same_seed_trains_the_same_losses():
    first = _train(3)
    assert _train(3) == first
    assert _train(4) != first


@pytest.mark.gpu
def test_every_cuda_device_gets_the_seed():
    rw.seed_everything(21)
    for index in range(torch.cuda.device_count()):
        device = torch.device("cuda", index)
        oracle = torch.rand(4, device=device, generator=torch.Generator(device).manual_seed(21))
        assert torch.equal(torch.rand(4, device=device), oracle), device
