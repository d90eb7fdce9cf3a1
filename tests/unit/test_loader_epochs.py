"""The loader's epoch contract against torch's DataLoader + DistributedSampler.

Peeking (``next(iter(loader))``) and partial passes never move the epoch; a finished pass
moves the next one to the following epoch; resumes (mid-epoch and end-of-epoch) continue with
exactly the batches the uninterrupted torch loop sees. See docs/data.md and docs/checkpoints.md.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data import DistributedSampler as TorchSampler

import rankwise as rw

N, WORLD, BATCH = 53, 3, 4


class Pair:
    """The same operations applied to rw.loader and to torch's loader; each returns both."""

    def __init__(self, rank: int, num_workers: int = 0) -> None:
        data = torch.arange(N)
        kw = dict(num_workers=num_workers)
        self.ours = rw.loader(
            data, batch_size=BATCH, shuffle=True, seed=7, num_replicas=WORLD, rank=rank, **kw
        )
        self.sampler = TorchSampler(data, num_replicas=WORLD, rank=rank, shuffle=True, seed=7)
        self.torch = DataLoader(data, batch_size=BATCH, sampler=self.sampler, **kw)

    def set_epoch(self, epoch: int, on_sampler: bool = False) -> None:
        (self.ours.sampler if on_sampler else self.ours).set_epoch(epoch)
        self.sampler.set_epoch(epoch)

    def peek(self) -> tuple[list[int], list[int]]:
        return next(iter(self.ours)).tolist(), next(iter(self.torch)).tolist()

    def take(self, k: int) -> tuple[list[list[int]], list[list[int]]]:
        mine, theirs = iter(self.ours), iter(self.torch)
        return [next(mine).tolist() for _ in range(k)], [next(theirs).tolist() for _ in range(k)]

    def full(self) -> tuple[list[list[int]], list[list[int]]]:
        return [b.tolist() for b in self.ours], [b.tolist() for b in self.torch]


@pytest.mark.parametrize("rank", range(WORLD))
def test_peeks_and_partial_passes_match_torch(rank):
    pair = Pair(rank)
    for epoch in range(3):
        # pytorch/examples' ddp tutorial peeks to read the batch size, then sets the epoch on
        # the sampler. Ours has already moved to `epoch` (the last pass finished), torch's not.
        peeked = next(iter(pair.ours)).tolist()
        pair.set_epoch(epoch, on_sampler=True)
        assert peeked == next(iter(pair.torch)).tolist()
        assert pair.peek()[0] == pair.peek()[1]  # peeking twice moves nothing either
        mine, theirs = pair.take(3)  # a partial pass (a `break`)
        assert mine == theirs
        mine, theirs = pair.full()
        assert mine == theirs and len(mine) == len(pair.torch)
        assert pair.ours.epoch == epoch
    assert pair.ours.state_dict()["epoch"] == 3  # epoch 2 finished: the next pass is epoch 3


def test_peek_after_set_epoch_trains_on_that_epoch_with_workers():
    pair = Pair(1, num_workers=2)
    for epoch in (0, 1):
        pair.set_epoch(epoch)
        pair.peek()
        mine, theirs = pair.full()
        assert mine == theirs
        state = pair.ours.state_dict()
        assert (state["epoch"], state["finished_epoch"]) == (epoch + 1, epoch)


def test_without_set_epoch_a_finished_pass_moves_to_the_next_epoch_and_a_peek_does_not():
    pair = Pair(0)
    for epoch in range(3):
        peeked = next(iter(pair.ours)).tolist()
        taken = [b.tolist() for b in pair.ours]
        pair.sampler.set_epoch(epoch)  # torch needs it; ours did it by itself
        assert taken == [b.tolist() for b in pair.torch]
        assert peeked == taken[0]


def _cut(rank: int, stop_epoch: int, stop_batch: int | None) -> tuple[dict, list[list[int]]]:
    """Run the tutorial loop until (stop_epoch, stop_batch); the state and the batches seen."""
    pair, seen = Pair(rank), []
    for epoch in range(stop_epoch + 1):
        pair.peek()
        pair.set_epoch(epoch)
        for i, batch in enumerate(pair.ours):
            seen.append(batch.tolist())
            if epoch == stop_epoch and i + 1 == stop_batch:
                return pair.ours.state_dict(), seen
    return pair.ours.state_dict(), seen  # saved after the inner loop: the end of stop_epoch


@pytest.mark.parametrize("rank", range(WORLD))
@pytest.mark.parametrize("stop_batch", [2, 5, None])  # mid-epoch, its last batch, after the loop
def test_resume_continues_exactly_where_torch_goes_on(rank, stop_batch):
    epochs, pair = 3, Pair(rank)
    expected = []
    for epoch in range(epochs):
        pair.set_epoch(epoch)
        expected += pair.full()[1]
    state, seen = _cut(rank, 1, stop_batch)
    resumed = Pair(rank).ours
    resumed.load_state_dict(state)
    start = resumed.epoch  # the loader says where to go on: no +1 to remember
    for epoch in range(start, epochs):
        next(iter(resumed))  # a peek right after resuming neither fails nor moves anything
        resumed.set_epoch(epoch)
        seen += [b.tolist() for b in resumed]
    assert seen == expected


@pytest.mark.parametrize("inside_loop", [False, True])
def test_end_of_epoch_checkpoint_resumes_into_the_next_epoch(tmp_path, inside_loop):
    pair = Pair(0)
    expected = []
    for epoch in range(3):
        pair.set_epoch(epoch)
        expected.append(pair.full()[1])
    first, model, path = Pair(0).ours, torch.nn.Linear(1, 1), tmp_path / "c.pt"
    for epoch in range(2):  # the usual loop, saving `epoch=epoch`
        first.set_epoch(epoch)
        for i, _ in enumerate(first):
            if inside_loop and epoch == 1 and i + 1 == len(first):
                rw.save_checkpoint(path, model=model, loader=first, epoch=epoch)
        if not inside_loop:
            rw.save_checkpoint(path, model=model, loader=first, epoch=epoch)
    resumed = Pair(0).ours
    info = rw.load_checkpoint(path, model=model, loader=resumed)
    assert info["epoch"] == 2 == resumed.epoch
    got = []
    for epoch in range(info["epoch"], 3):  # the usual resume loop, without a +1 to know
        assert next(iter(resumed)).tolist() == expected[epoch][0]  # not a StopIteration
        resumed.set_epoch(epoch)
        got.append([b.tolist() for b in resumed])
    assert got == expected[2:]


def test_asking_again_for_the_finished_epoch_warns_and_gives_an_empty_pass():
    first = Pair(0).ours
    first.set_epoch(4)
    list(first)
    resumed = Pair(0).ours
    resumed.load_state_dict(first.state_dict())
    assert resumed.finished_epoch == 4
    with pytest.warns(UserWarning, match=r"set_epoch\(4\).*finished.*start the epoch loop at 5"):
        resumed.set_epoch(4)
    assert list(resumed) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.set_epoch(5)  # the next epoch: no warning, a full pass
        assert len(list(resumed)) == len(resumed)


def _resumed_after(epoch: int) -> rw.Loader:
    first = Pair(0).ours
    first.set_epoch(epoch)
    list(first)
    resumed = Pair(0).ours
    resumed.load_state_dict(first.state_dict())
    return resumed


def test_a_peek_then_the_finished_epoch_on_the_sampler_still_warns():
    resumed = _resumed_after(2)
    oracle = Pair(0)
    oracle.set_epoch(3)
    assert next(iter(resumed)).tolist() == oracle.peek()[1]  # a peek reads the next epoch
    resumed.sampler.set_epoch(2)  # the ddp tutorial's way, asking for the finished epoch
    with pytest.warns(UserWarning, match=r"set_epoch\(2\).*finished.*loop at 3"):
        assert list(resumed) == []


def test_adding_one_to_the_returned_epoch_warns_that_an_epoch_is_skipped():
    resumed = _resumed_after(2)
    with pytest.warns(UserWarning, match=r"set_epoch\(4\).*epoch 3 is never trained.*loop at 3"):
        resumed.set_epoch(4)
    assert len(list(resumed)) == len(resumed)
