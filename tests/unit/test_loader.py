"""rw.loader: the batch-size contract, its errors, epochs, exact resume, iterable sharding."""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler
from torch.utils.data.distributed import DistributedSampler as TorchSampler

import rankwise as rw
from rankwise.errors import ConfigError


def _message(exc_info) -> str:
    return str(exc_info.value)


def test_both_or_neither_batch_size_is_refused():
    with pytest.raises(ConfigError) as both:
        rw.loader(range(10), batch_size=3, global_batch_size=12, num_replicas=4, rank=0)
    assert _message(both) == (
        "both batch_size=3 and global_batch_size=12 were given\n"
        "Fix: pass exactly one: batch_size is per device, global_batch_size is per step over "
        "all 4 replica(s) (e.g. global_batch_size=12 alone)."
    )
    with pytest.raises(ConfigError) as neither:
        rw.loader(range(10), num_replicas=4, rank=0)
    assert _message(neither) == (
        "neither batch_size nor global_batch_size was given\n"
        "Fix: pass exactly one: batch_size= (samples per device per step) or "
        "global_batch_size= (samples per step over all 4 replica(s))."
    )


def test_indivisible_global_batch_names_the_nearest_valid_values():
    with pytest.raises(ConfigError) as exc:
        rw.loader(range(10), global_batch_size=100, num_replicas=4, rank=0, replicas_in_process=2)
    assert _message(exc) == (
        "global_batch_size=100 does not divide evenly over 8 replicas "
        "(4 process(es) x 2 device(s) each)\n"
        "Fix: use global_batch_size=96 (12 per device) or 104 (13 per device), or pass "
        "batch_size= (per device) instead."
    )
    with pytest.raises(ConfigError, match=re.escape("use global_batch_size=4 (1 per device), or")):
        rw.loader(range(10), global_batch_size=3, num_replicas=4, rank=0)
    with pytest.raises(ConfigError, match=re.escape("batch_size=0 must be a positive integer")):
        rw.loader(range(10), batch_size=0)


def test_shuffle_with_a_sampler_is_refused_with_the_fix():
    sampler = rw.DistributedSampler(range(10), num_replicas=1, rank=0)
    with pytest.raises(ConfigError) as exc:
        rw.loader(range(10), batch_size=2, shuffle=True, sampler=sampler)
    assert _message(exc) == (
        "shuffle=True was given together with sampler=DistributedSampler(...); the sampler "
        "decides the order\n"
        "Fix: drop shuffle=True and build the sampler with shuffle=True "
        "(rw.DistributedSampler(dataset, shuffle=True)), or drop sampler= and let rw.loader "
        "build one."
    )


def test_a_sampler_that_does_not_split_the_data_is_refused_when_distributed():
    with pytest.raises(
        ConfigError, match=r"splits the data over num_replicas=None, but 2 processes"
    ):
        rw.loader(range(10), batch_size=2, sampler=RandomSampler(range(10)), num_replicas=2, rank=1)
    ok = TorchSampler(range(10), num_replicas=2, rank=1, shuffle=False)
    assert [
        b.tolist() for b in rw.loader(range(10), batch_size=2, sampler=ok, num_replicas=2, rank=1)
    ] == [[1, 3], [5, 7], [9]]
    with pytest.raises(ConfigError, match=r"batch_sampler= was given to rw.loader"):
        rw.loader(range(10), batch_size=2, batch_sampler=[[0, 1]])
    with pytest.raises(ConfigError, match=r"evaluation=True was given with shuffle=True"):
        rw.loader(range(10), batch_size=2, shuffle=True, evaluation=True)


@pytest.mark.parametrize(
    ("kwargs", "per_device", "loader_batch", "global_batch"),
    [
        # DDP, 2 processes: batch_size=30 means 30 per device, 60 per step (docs/pitfalls.md#pitfall-4)
        ({"batch_size": 30, "num_replicas": 2}, 30, 30, 60),
        ({"global_batch_size": 60, "num_replicas": 2}, 30, 30, 60),
        # DataParallel, 1 process over 2 devices: the loader batch is the global batch
        ({"global_batch_size": 30, "replicas_in_process": 2}, 15, 30, 30),
        ({"batch_size": 15, "replicas_in_process": 2}, 15, 30, 30),
        # both: 2 processes x 4 devices
        ({"global_batch_size": 64, "num_replicas": 2, "replicas_in_process": 4}, 8, 32, 64),
    ],
)
def test_batch_contract(kwargs, per_device, loader_batch, global_batch):
    ld = rw.loader(torch.arange(1000), rank=0, **kwargs)
    assert (ld.per_device_batch_size, ld.batch_size, ld.global_batch_size) == (
        per_device,
        loader_batch,
        global_batch,
    )
    assert len(next(iter(ld))) == loader_batch


def test_world_one_each_pass_is_the_next_epoch_and_set_epoch_wins():
    data = torch.arange(50)
    ld = rw.loader(data, batch_size=8, shuffle=True, seed=4)
    passes = [torch.cat(list(ld)).tolist() for _ in range(3)]
    for epoch, seen in enumerate(passes):
        oracle = TorchSampler(data, num_replicas=1, rank=0, shuffle=True, seed=4)
        oracle.set_epoch(epoch)
        assert seen == list(oracle)
    assert passes[0] != passes[1] and sorted(passes[2]) == list(range(50))
    ld.set_epoch(1)
    assert torch.cat(list(ld)).tolist() == passes[1]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_resume_is_exact_despite_prefetching(num_workers):
    data = torch.arange(203)
    kw = dict(global_batch_size=12, shuffle=True, num_replicas=3, num_workers=num_workers)
    for rank in range(3):
        uninterrupted = rw.loader(data, rank=rank, **kw)
        uninterrupted.set_epoch(2)
        expected = torch.cat(list(uninterrupted)).tolist()
        first = rw.loader(data, rank=rank, **kw)
        first.set_epoch(2)
        it = iter(first)
        seen = torch.cat([next(it) for _ in range(5)]).tolist()
        state = first.state_dict()
        del it
        resumed = rw.loader(data, rank=rank, **kw)
        resumed.load_state_dict(state)
        assert len(resumed) == len(uninterrupted) - 5
        for epoch in range(state["epoch"], 4):  # the usual resume loop
            resumed.set_epoch(epoch)
            got = torch.cat(list(resumed)).tolist()
            if epoch == 2:
                assert seen + got == expected
        # After the finished epoch 3 the state is the start of epoch 4 (docs/checkpoints.md).
        end = resumed.state_dict()
        assert (end["epoch"], end["finished_epoch"], end["sampler"]["position"]) == (4, 3, 0)


class _Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterable_dataset_is_sharded_by_rank_and_worker(num_workers):
    n, world = 103, 3
    train = [
        list(
            rw.loader(_Stream(n), batch_size=4, num_replicas=world, rank=r, num_workers=num_workers)
        )
        for r in range(world)
    ]
    assert len({len(batches) for batches in train}) == 1  # same number of batches everywhere
    seen = [i for batches in train for b in batches for i in b.tolist()]
    assert sorted(seen) == list(range(n // world * world))  # ragged last group of 1 dropped
    evaluation = [
        torch.cat(
            list(
                rw.loader(
                    _Stream(n),
                    batch_size=4,
                    num_replicas=world,
                    rank=r,
                    num_workers=num_workers,
                    evaluation=True,
                )
            )
        ).tolist()
        for r in range(world)
    ]
    # Each rank reads its stride of the stream, in stream order, workers and all.
    assert evaluation == [list(range(r, n, world)) for r in range(world)]
    with pytest.raises(
        ConfigError, match=r"shuffle=True was given for the iterable dataset _Stream"
    ):
        rw.loader(_Stream(n), batch_size=4, shuffle=True)


def test_gather_for_metrics_and_join_at_world_one():
    preds, names = torch.arange(6), list("abcdef")
    out = rw.gather_for_metrics({"p": preds, "names": names})
    assert out["p"].tolist() == list(range(6)) and out["names"] == names
    assert rw.gather_for_metrics((preds, preds), num_samples=4)[1].tolist() == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match=r"different numbers of samples: \[6, 5\]"):
        rw.gather_for_metrics((preds, preds[:5]))
    with rw.join(DataLoader(range(10), batch_size=3)) as batches:
        assert [b.tolist() for b in batches][-1] == [9]
    assert (batches.steps, batches.ranks_out_of_data) == (4, 1)
    with pytest.raises(rw.RuntimeStateError, match=r"iterated outside its `with` block"):
        list(rw.join(range(3)))


@pytest.mark.parametrize("drop_last", [False, True])
def test_global_batch_holds_the_same_samples_on_any_world_size(drop_last):
    # Step k of a job of W ranks sees exactly the samples one process sees at step k with the
    # same global batch (the strided split keeps each step's slice of the permutation together),
    # so training with rw.loader(global_batch_size=G) matches single-device training.
    data = torch.arange(96)
    single = [
        set(b.tolist())
        for b in rw.loader(data, global_batch_size=12, shuffle=True, drop_last=drop_last)
    ]
    for world in (2, 3, 4):
        per_rank = [
            list(
                rw.loader(
                    data,
                    global_batch_size=12,
                    shuffle=True,
                    drop_last=drop_last,
                    num_replicas=world,
                    rank=r,
                )
            )
            for r in range(world)
        ]
        steps = [set(torch.cat(parts).tolist()) for parts in zip(*per_rank, strict=True)]
        assert steps == single
