"""DistributedSampler: torch's partition index for index, the set_epoch warning, exact resume."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data.distributed import DistributedSampler as TorchSampler

import rankwise as rw
from rankwise.errors import ConfigError


def _ranks(n: int, world: int, epoch: int = 0, **kw) -> list[list[int]]:
    out = []
    for r in range(world):
        s = rw.DistributedSampler(range(n), world, r, **kw)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_same_indices_as_torch_for_every_rank_and_epoch(shuffle, drop_last):
    for n in [0, 1, 2, 3, 7, 10, 64, 101, 257]:
        for world in [1, 2, 3, 4, 5, 8]:
            for rank in range(world):
                ours = rw.DistributedSampler(range(n), world, rank, shuffle, 17, drop_last)
                theirs = TorchSampler(range(n), world, rank, shuffle, 17, drop_last)
                assert (ours.num_samples, ours.total_size) == (
                    theirs.num_samples,
                    theirs.total_size,
                )
                for epoch in range(3):
                    ours.set_epoch(epoch)
                    theirs.set_epoch(epoch)
                    assert list(ours) == list(theirs), (n, world, rank, epoch)
                    assert len(ours) == len(theirs)


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(0, 500),
    world=st.integers(1, 8),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    batch=st.integers(1, 40),
    epoch=st.integers(0, 3),
)
def test_partition_properties(n, world, drop_last, shuffle, batch, epoch):
    shares = _ranks(n, world, epoch, shuffle=shuffle, drop_last=drop_last)
    counts = Counter(i for share in shares for i in share)
    total = sum(len(s) for s in shares)
    # Identical sample and batch counts on every rank: no rank waits for a missing batch.
    assert len({len(s) for s in shares}) == 1
    if n == 0:  # the sampler copes; the loader refuses an empty data set (0 batches, silently)
        with pytest.raises(rw.ConfigError, match="empty data set"):
            rw.loader(range(0), batch_size=batch, num_replicas=world, rank=0)
        return
    batches = [
        len(
            list(
                rw.loader(
                    range(n),
                    batch_size=batch,
                    shuffle=shuffle,
                    drop_last=drop_last,
                    num_replicas=world,
                    rank=r,
                )
            )
        )
        for r in range(world)
    ]
    assert len(set(batches)) == 1
    assert set(counts) <= set(range(n))
    if drop_last:
        assert total == n // world * world and max(counts.values(), default=1) == 1
    else:
        assert set(counts) == set(range(n))  # every index appears
        duplicates = total - n  # only padding duplicates, fewer than one per rank
        assert duplicates == sum(c - 1 for c in counts.values()) and 0 <= duplicates <= world - 1


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 500), world=st.integers(1, 8))
def test_evaluation_mode_sees_every_sample_exactly_once(n, world):
    shares = _ranks(n, world, shuffle=False, pad=False)
    assert sorted(i for s in shares for i in s) == list(range(n))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert [len(rw.DistributedSampler(range(n), world, r, pad=False)) for r in range(world)] == [
        len(s) for s in shares
    ]


def test_warns_once_when_second_epoch_starts_without_set_epoch():
    s = rw.DistributedSampler(range(20), num_replicas=2, rank=0, shuffle=True)
    first = list(s)
    with pytest.warns(UserWarning, match=r"set_epoch\(\) was not called") as caught:
        second = list(s)
    assert len(caught) == 1
    assert second == first  # the trap itself: torch's sampler repeats the order silently
    t = TorchSampler(range(20), num_replicas=2, rank=0, shuffle=True)
    assert list(t) == list(t) == first
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(s)  # only the first repeat warns
        ok = rw.DistributedSampler(range(20), num_replicas=2, rank=0, shuffle=True)
        for epoch in range(3):
            ok.set_epoch(epoch)
            list(ok)
        plain = rw.DistributedSampler(range(20), num_replicas=2, rank=0, shuffle=False)
        list(plain), list(plain)


def test_bad_rank_and_world_are_config_errors():
    with pytest.raises(ConfigError, match=r"rank=2 is out of range for num_replicas=2"):
        rw.DistributedSampler(range(4), num_replicas=2, rank=2)
    with pytest.raises(ConfigError, match=r"num_replicas=0 must be a positive integer"):
        rw.DistributedSampler(range(4), num_replicas=0, rank=0)


def test_world_one_unlaunched_defaults():
    s = rw.DistributedSampler(range(10), shuffle=False)
    assert (s.rank, s.num_replicas, list(s)) == (0, 1, list(range(10)))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 300),
    world=st.integers(1, 6),
    drop_last=st.booleans(),
    cut_fraction=st.floats(0, 1),
    epoch=st.integers(0, 2),
)
def test_resume_continues_with_exactly_the_unseen_indices(n, world, drop_last, cut_fraction, epoch):
    for rank in range(world):
        torch_full = TorchSampler(range(n), world, rank, True, 5, drop_last)
        torch_full.set_epoch(epoch)
        expected = list(torch_full)
        cut = int(cut_fraction * len(expected))
        first = rw.DistributedSampler(range(n), world, rank, True, 5, drop_last)
        first.set_epoch(epoch)
        it = iter(first)
        seen = [next(it) for _ in range(cut)]
        state = first.state_dict()
        resumed = rw.DistributedSampler(range(n), world, rank, True, 5, drop_last)
        resumed.load_state_dict(state)
        resumed.set_epoch(epoch)  # the usual loop calls set_epoch again: the resume survives
        assert len(resumed) == len(expected) - cut
        rest = list(resumed)
        assert seen + rest == expected
        resumed.set_epoch(epoch + 1)  # the next epoch starts from its beginning
        torch_full.set_epoch(epoch + 1)
        assert list(resumed) == list(torch_full)


def test_resume_on_another_world_size_covers_the_unseen_samples_once():
    n, cut = 103, 10
    seen = set()
    for r in range(4):
        s = rw.DistributedSampler(range(n), 4, r, shuffle=True, seed=1)
        it = iter(s)
        seen |= {next(it) for _ in range(cut)}
    state = s.state_dict()
    rest = []
    for r in range(3):
        s3 = rw.DistributedSampler(range(n), 3, r, shuffle=True, seed=1)
        s3.load_state_dict(state)
        rest += list(s3)
    unseen = set(range(n)) - seen
    assert len(seen) == 40 and set(rest) == unseen and len(rest) - len(unseen) <= 2


def test_resume_refuses_another_dataset_or_seed():
    state = rw.DistributedSampler(range(10), 2, 0).state_dict()
    with pytest.raises(
        ConfigError,
        match=r"saved sampler state has dataset_size=10, this sampler has dataset_size=11",
    ):
        rw.DistributedSampler(range(11), 2, 0).load_state_dict(state)
    with pytest.raises(ConfigError, match=r"seed=0, this sampler has seed=3"):
        rw.DistributedSampler(range(10), 2, 0, seed=3).load_state_dict(state)
