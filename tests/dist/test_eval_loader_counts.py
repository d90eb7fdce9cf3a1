"""An evaluation loader never counts padded duplicates silently (issue 43): 101 test samples
on 2 ranks count 101, not 102; an unshuffled loader not named as evaluation data and padded
says how many duplicates it reads and points at evaluation=True."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw
from rankwise.testing import run_distributed


class _Digits(TensorDataset):
    """A data set that says it is the test split the way torchvision's do (``train=False``)."""

    def __init__(self, n: int, train: bool) -> None:
        super().__init__(torch.arange(n, dtype=torch.float32))
        self.train = train


def _count(n, how, batch):
    rt = rw.get_runtime()
    data = TensorDataset(torch.arange(n, dtype=torch.float32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "named test":
            test = data
            loader = rt.prepare_loader(DataLoader(test, batch_size=batch))
        elif how == "named val_loader":
            val_loader = rt.prepare_loader(DataLoader(data, batch_size=batch))
            loader = val_loader
        elif how == "train=False":
            loader = rt.prepare_loader(DataLoader(_Digits(n, train=False), batch_size=batch))
        elif how == "explicit":
            loader = rt.prepare_loader(DataLoader(data, batch_size=batch), evaluation=True)
        else:  # unshuffled, named nothing of the kind
            samples = data
            loader = rt.prepare_loader(DataLoader(samples, batch_size=batch))
    seen = sum(len(x) for (x,) in loader)
    ids = torch.cat([x for (x,) in loader])
    total = rw.all_reduce_sum(float(seen))
    return total, ids.tolist(), [str(w.message) for w in caught]


_EVALUATION = ("named test", "named val_loader", "train=False", "explicit")


def _count_evaluation(n, batch):
    return {how: _count(n, how, batch) for how in _EVALUATION}


@pytest.mark.parametrize("world,n,batch", [(2, 101, 10), (3, 100, 7), (2, 100, 8)])
def test_an_evaluation_loader_counts_each_sample_once(world, n, batch):
    results = run_distributed(_count_evaluation, world, args=(n, batch), timeout=120)
    for how in _EVALUATION:
        per_rank = [r[how] for r in results]
        assert all(total == n for total, _, _ in per_rank), how  # 101 counted 101, not 102
        every = sorted(i for _, ids, _ in per_rank for i in ids)
        assert every == list(range(n)), how  # each sample exactly once
        assert all(not said for _, _, said in per_rank), how


def test_an_unnamed_unshuffled_loader_that_pads_says_how_many_duplicates():
    results = run_distributed(_count, 2, args=(101, "unnamed", 10), timeout=90)
    total, _, said = results[0]
    assert total == 102  # training semantics kept: the ranks read equal shares ...
    (message,) = said  # ... but not silently
    assert "101 samples is padded to 102 over 2 ranks" in message and "1 sample" in message
    assert "evaluation=True" in message
    assert results[1][2] == []  # rank 0 says it once for the job


def test_an_unnamed_unshuffled_loader_that_divides_evenly_says_nothing():
    results = run_distributed(_count, 2, args=(100, "unnamed", 10), timeout=90)
    assert all(total == 100 and not said for total, _, said in results)
